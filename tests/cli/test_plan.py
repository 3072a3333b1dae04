"""``sftpack plan DATA`` and :mod:`sftpack.report.balance`: each path's balance across ranks, on paper."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sftpack.balance import SequenceCost, lower_bound
from sftpack.cli import main
from sftpack.report.balance import PATHS, conversation_lengths, plan_paths
from sftpack.testing import samples_from_lengths, tiny_chat_tokenizer

#: a chat-like mix with a few long sequences: 600 sequences within 2,048 tokens
LENGTHS = np.clip(np.rint(np.random.default_rng(7).lognormal(np.log(120), 1.0, 600)), 1, 2048).astype(np.int64)
FLAGS = ["--dp", "8", "--global-batch", "64", "--max-seq-len", "2048", "--size", "7b", "--steps", "4"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _library():
    return plan_paths(LENGTHS, dp=8, global_batch=64, max_seq_len=2048, cost="7b", steps=4).to_dict()


@pytest.fixture
def lengths_txt(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# one length a line\n" + "\n".join(map(str, LENGTHS.tolist())) + "\n\n")
    return path


def test_a_lengths_file_gives_the_library_plan_as_json(tmp_path, capsys, lengths_txt):
    got = _json(capsys, ["plan", str(lengths_txt), *FLAGS, "--json"])
    assert got.pop("data") == str(lengths_txt)
    assert got == json.loads(json.dumps(_library()))
    assert list(got["paths"]) == list(PATHS)
    for name in ("trainer", "offline", "loader"):
        p = got["paths"][name]
        assert p["available"] and p["steps"] == 4, p
        for key in ("max_over_mean", "bound", "microbatches_per_rank", "padding", "worst", "worst_step_loads"):
            assert p[key] is not None, (name, key)
        # no plan beats its bound; the worst step is no better than the mean over steps
        assert p["max_over_mean"] >= p["bound"] - 1e-9 and p["worst"] >= p["max_over_mean"] - 1e-12
        assert len(p["worst_step_loads"]) == 8 and max(p["worst_step_loads"]) == pytest.approx(p["worst"], abs=1e-5)
        assert 0 <= p["padding"] < 1
    assert got["sequences"] == LENGTHS.size and got["tokens"] == int(LENGTHS.sum())
    assert got["cost"]["name"] == "7b" and got["cost"]["per_token_squared"] == 6 * 32 * 4096
    assert got["paths"]["dynamic_cp"]["available"] is False


def test_a_npy_file_gives_the_same_plan_as_the_text_file(tmp_path, capsys, lengths_txt):
    npy = tmp_path / "lengths.npy"
    np.save(npy, LENGTHS.astype(np.int32))
    from_npy = _json(capsys, ["plan", str(npy), *FLAGS, "--json"])
    from_txt = _json(capsys, ["plan", str(lengths_txt), *FLAGS, "--json"])
    assert from_npy["paths"] == from_txt["paths"] and from_npy["sequences"] == LENGTHS.size


def test_the_table_names_every_path(capsys, lengths_txt):
    assert main(["plan", str(lengths_txt), *FLAGS]) == 0
    out = capsys.readouterr().out
    lib = _library()["paths"]
    for name in ("trainer", "offline", "loader"):
        line = next(x for x in out.splitlines() if x.startswith(name + " "))
        assert f"{lib[name]['max_over_mean']:.3f}" in line and f"{lib[name]['bound']:.3f}" in line, line
    assert "dynamic_cp: not simulated: cp 1" in out
    assert "600 sequences" in out and "cost 7b" in out


def test_a_prepack_plans_its_stored_sequences_at_its_row_width(tmp_path, capsys):
    from sftpack.offline import PrepackedDataset, prepack_samples

    lengths = LENGTHS[:200]
    out = prepack_samples(samples_from_lengths(lengths.tolist()), tmp_path / "packed", max_seq_len=2048).path
    got = _json(capsys, ["plan", str(out), "--dp", "4", "--global-batch", "32", "--steps", "3", "--json"])
    assert got["settings"]["max_seq_len"] == 2048  # the prepack's own width
    assert got["sequences"] == 200 and got["tokens"] == int(lengths.sum())
    stored = PrepackedDataset(out).sequences["length"].astype(np.int64)  # in row order
    assert sorted(stored.tolist()) == sorted(lengths.tolist())
    want = plan_paths(stored, dp=4, global_batch=32, max_seq_len=2048, steps=3).to_dict()
    assert got["paths"] == json.loads(json.dumps(want["paths"]))
    assert got["paths"]["trainer"]["steps"] == 3 and got["paths"]["offline"]["available"]


def _chats(path, n=60):
    with path.open("w") as f:
        for i in range(1, n + 1):
            msgs = [{"role": "user", "content": "hi " * i}, {"role": "assistant", "content": "yo " * (3 * i)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def test_conversations_are_tokenized_as_prepack_does(tmp_path, capsys):
    tok = tiny_chat_tokenizer("chatml")
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    chats = _chats(tmp_path / "chats.jsonl")
    argv = ["plan", str(chats), "--dp", "4", "--global-batch", "16", "--max-seq-len", "256", "--steps", "2"]
    got = _json(capsys, [*argv, "--tokenizer", str(tok_dir), "--json"])
    lengths, read_stats, _ = conversation_lengths(chats, tok, max_seq_len=256)
    assert read_stats.kept == 60 and lengths.size >= 60 and lengths.max() <= 256
    got.pop("data")
    want = plan_paths(lengths, dp=4, global_batch=16, max_seq_len=256, steps=2).to_dict()
    assert got == json.loads(json.dumps(want))
    assert main([*argv, "--tokenizer", str(tok_dir)]) == 0
    assert "read 60 rows: 60 kept" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [("12\n7\nabc\n4\n", "line 3", "'abc' is not a whole number"), ("12\n\n0\n", "line 3", "0 is not a sequence")],
)
def test_a_bad_lengths_line_is_a_usage_error_naming_it(tmp_path, capsys, text, where, what):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    assert main(["plan", str(path), "--dp", "2", "--global-batch", "2", "--max-seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sftpack plan: {path} {where}: ") and what in err, err
    assert len(err.splitlines()) == 1


def test_a_length_over_the_row_width_names_its_line_and_the_width_to_use(tmp_path, capsys):
    path = tmp_path / "long.txt"
    path.write_text("10\n20\n5000\n")
    assert main(["plan", str(path), "--dp", "2", "--global-batch", "2", "--max-seq-len", "4096"]) == 2
    err = capsys.readouterr().err
    assert (
        f"{path} line 3: 5,000 tokens, more than --max-seq-len 4,096" in err and "raise --max-seq-len to 5,000" in err
    )


def test_settings_that_cannot_work_are_usage_errors(tmp_path, capsys, lengths_txt):
    # the context-parallel padding: the row width must be a multiple of 2*cp
    assert (
        main(["plan", str(lengths_txt), "--dp", "2", "--cp", "4", "--global-batch", "8", "--max-seq-len", "2044"]) == 2
    )
    assert "not a multiple of 2*cp = 8" in capsys.readouterr().err
    assert main(["plan", str(lengths_txt), "--dp", "16", "--global-batch", "8", "--max-seq-len", "2048"]) == 2
    assert "every rank needs at least one sequence" in capsys.readouterr().err
    assert main(["plan", str(lengths_txt), "--dp", "2", "--global-batch", "8"]) == 2
    assert "--max-seq-len is required" in capsys.readouterr().err


def test_png_draws_the_per_rank_load(tmp_path, capsys, lengths_txt):
    png = tmp_path / "load.png"
    assert main(["plan", str(lengths_txt), *FLAGS, "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"per-rank load drawn to {png}" in capsys.readouterr().out


def test_cp_pads_to_2cp_and_reports_the_dynamic_cp_path(capsys, lengths_txt):
    got = _json(capsys, ["plan", str(lengths_txt), *FLAGS, "--cp", "4", "--json"])
    assert got["settings"]["pad_multiple"] == 8
    dyn, trainer = got["paths"]["dynamic_cp"], got["paths"]["trainer"]
    assert dyn["available"] and dyn["steps"] == trainer["steps"]
    # spreading a sequence over ranks can only lower the bound, and the plan reaches within 3% of it
    assert dyn["bound"] <= trainer["bound"] and dyn["max_over_mean"] <= 1.03 * trainer["max_over_mean"]


# ---------------------------------------------------------------------------- the library, on cases worked by hand


def test_one_sequence_that_outweighs_the_rest_sets_the_trainer_plan_at_its_bound():
    lengths = np.array([1000] + [10] * 63)
    r = plan_paths(lengths, dp=4, global_batch=64, max_seq_len=1024, cost="tokens", shuffle=False)
    t = r.paths["trainer"]
    # the rank holding the 1,000-token sequence carries 1,000 of 1,630 tokens: 4 * 1000 / 1630
    assert t.bound == pytest.approx(4 * 1000 / 1630) and t.max_over_mean == pytest.approx(t.bound)
    assert t.loads is not None and sorted(t.loads.tolist())[-1] == 1000


def test_full_rows_of_equal_cost_deal_evenly_with_no_padding():
    lengths = np.full(32, 256)
    r = plan_paths(lengths, dp=4, global_batch=8, max_seq_len=512, cost=SequenceCost(1.0, 1.0), rows_per_rank=2)
    o = r.paths["offline"]
    assert r.rows_per_rank == 2 and o.steps == 2  # 16 rows of 2 sequences; 8 rows a step
    assert o.max_over_mean == 1.0 and o.bound == 1.0 and o.padding == 0.0 and o.microbatches_per_rank == 2.0
    assert r.paths["loader"].max_over_mean == o.max_over_mean and r.paths["loader"].note


def test_too_few_rows_for_one_step_is_said_not_guessed():
    r = plan_paths(np.full(10, 100), dp=8, global_batch=8, max_seq_len=1000)
    o = r.paths["offline"]
    assert not o.available and o.max_over_mean is None
    assert "1 rows of 1,000 slots, fewer than one step's 8" in o.reason
    assert r.paths["trainer"].available and r.paths["trainer"].bound == pytest.approx(lower_bound([100] * 8, 8))


def test_a_missing_file_or_a_npy_that_is_not_lengths_is_named(tmp_path, capsys):
    gone = tmp_path / "gone.txt"
    assert main(["plan", str(gone), "--dp", "2", "--global-batch", "2", "--max-seq-len", "64"]) == 1
    assert (
        capsys.readouterr().err.strip()
        == f"sftpack plan: {gone}: no such file or directory (check that the path exists)"
    )
    grid = tmp_path / "grid.npy"
    np.save(grid, np.ones((3, 2), np.int64))
    assert main(["plan", str(grid), "--dp", "2", "--global-batch", "2", "--max-seq-len", "64"]) == 2
    assert f"{grid}: holds an array of shape (3, 2); save a 1-D array of lengths" in capsys.readouterr().err
