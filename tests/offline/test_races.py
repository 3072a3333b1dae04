"""Races at publish time: something that appears at --out while a prepack runs is never
renamed away or deleted; of two prepacks with the same --out one wins and the other fails
clearly; an output folder inside an input folder is refused before anything is read.

The second actor is run deterministically at the last moment before the first run
publishes (the test wraps ``Output.publish``), with the atomic exchange and with the
two-rename fallback for systems without ``renameat2``."""

from __future__ import annotations

import shutil

import pytest

from sftpack.cli import main
from sftpack.offline import PrepackedDataset, PrepackError, _publish, prepack
from sftpack.offline._format import FILES


def _hidden(parent, name):
    return sorted(parent.glob(f".{name}.sftpack-*"))


def _snapshot(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(params=["renameat2", "fallback"])
def publish_mode(request, monkeypatch):
    """Every race once with renameat2 (NOREPLACE / EXCHANGE), once with the two-rename fallback."""
    if request.param == "fallback":
        monkeypatch.setattr(_publish, "_renameat2", lambda src, dst, flags: False)
    return request.param


def _before_publish(monkeypatch, action):
    """Run ``action()`` once, right before the first publish that happens."""
    original = _publish.Output.publish
    state = {"done": False}

    def publish(self):
        if not state["done"]:
            state["done"] = True
            action()
        return original(self)

    monkeypatch.setattr(_publish.Output, "publish", publish)


def _run(chat_file, tok, out, **kw):
    return prepack(chat_file, out, tokenizer=tok, max_seq_len=512, pad_multiple=4, limit=20, **kw)


def test_a_folder_that_appears_at_out_during_the_run_is_left_untouched(
    chat_file, tok, tmp_path, monkeypatch, publish_mode
):
    out = tmp_path / "out"

    def appear():
        out.mkdir()
        (out / "notes.txt").write_text("the user's, not a prepack")

    _before_publish(monkeypatch, appear)
    with pytest.raises(PrepackError, match=r"appeared while this run was writing .* left untouched .* discarded"):
        _run(chat_file, tok, out)
    assert _snapshot(out) == {"notes.txt": b"the user's, not a prepack"}
    assert _hidden(tmp_path, "out") == []  # this run's own folder is gone, nothing else


def test_two_prepacks_with_the_same_out_one_wins_the_other_fails_clearly(
    chat_file, tok, tmp_path, monkeypatch, publish_mode
):
    out = tmp_path / "out"
    winner = {}

    def second_run():  # a whole second prepack (another seed) finishes while the first is about to publish
        winner["result"] = prepack(
            chat_file,
            out,
            tokenizer=tok,
            max_seq_len=512,
            pad_multiple=4,
            limit=20,
            seed=5,
            algorithm="first_fit_shuffle",
        )

    _before_publish(monkeypatch, second_run)
    with pytest.raises(PrepackError, match="appeared while this run was writing"):
        _run(chat_file, tok, out)
    ds = PrepackedDataset(out, verify="full")
    assert ds.manifest == winner["result"].manifest and ds.manifest["fingerprint"]["seed"] == 5
    assert _hidden(tmp_path, "out") == []


def test_two_overwrites_of_the_same_prepack_one_wins_the_other_fails_clearly(
    built, chat_file, tok, tmp_path, monkeypatch, publish_mode
):
    out = tmp_path / "out"
    shutil.copytree(built[1], out)
    winner = {}

    def second_run():
        winner["result"] = prepack(
            chat_file,
            out,
            tokenizer=tok,
            max_seq_len=512,
            pad_multiple=4,
            limit=20,
            seed=5,
            algorithm="first_fit_shuffle",
            overwrite=True,
        )

    _before_publish(monkeypatch, second_run)
    with pytest.raises(PrepackError, match=r"was replaced while this run was writing .* left as it is"):
        _run(chat_file, tok, out, overwrite=True)
    ds = PrepackedDataset(out, verify="full")
    assert ds.manifest == winner["result"].manifest  # the winner's prepack, whole
    assert _hidden(tmp_path, "out") == []


def test_overwrite_still_replaces_a_prepack_and_an_empty_folder(built, chat_file, tok, tmp_path, publish_mode):
    out = tmp_path / "out"
    shutil.copytree(built[1], out)
    r = _run(chat_file, tok, out, overwrite=True)
    assert PrepackedDataset(out, verify="full").manifest == r.manifest != PrepackedDataset(built[1]).manifest
    empty = tmp_path / "empty"
    empty.mkdir()
    _run(chat_file, tok, empty)  # an empty folder is allowed without --overwrite
    for f in FILES:
        assert (empty / f).read_bytes() == (out / f).read_bytes(), f
    assert _hidden(tmp_path, "out") == [] and _hidden(tmp_path, "empty") == []


def test_the_cli_says_in_one_line_that_the_output_appeared(chat_file, tok, tmp_path, monkeypatch, capsys):
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    out = tmp_path / "out"
    _before_publish(monkeypatch, lambda: (out.mkdir(), (out / "keep.txt").write_text("mine")))
    code = main(
        [
            "prepack",
            str(chat_file),
            "--out",
            str(out),
            "--tokenizer",
            str(tok_dir),
            "--max-seq-len",
            "512",
            "--limit",
            "20",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith(f"sftpack prepack: {out} appeared while this run was writing")
    assert err[0].endswith("choose another --out, or pass --overwrite to replace a prepack")
    assert (out / "keep.txt").read_text() == "mine" and _hidden(tmp_path, "out") == []


def test_an_output_inside_an_input_folder_is_refused_before_reading(chat_file, tok, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(chat_file, data / "chat.jsonl")
    for out in (data / "pp", data / "sub" / "pp"):
        with pytest.raises(
            PrepackError,
            match=rf"--out {out} is inside the input folder {data}, which is read "
            "recursively",
        ):
            _run(data, tok, out)
    # an output written elsewhere and then named as an input (a glob that reaches it) is refused too
    pp = tmp_path / "pp"
    _run(data, tok, pp)
    with pytest.raises(PrepackError, match=rf"the input {pp}/manifest.json is inside --out {pp}"):
        _run(str(tmp_path / "pp" / "*.json"), tok, pp, overwrite=True)
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    assert main(["prepack", str(data), "--out", str(data / "pp"), "--tokenizer", str(tok_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is inside the input folder" in err[0] and "choose an --out outside it" in err[0]
    assert sorted(p.name for p in data.iterdir()) == ["chat.jsonl"]


def test_a_row_wider_than_the_limit_is_refused_up_front(chat_file, tok, tmp_path, capsys):
    from sftpack.offline._format import MAX_ROW_WIDTH

    with pytest.raises(ValueError, match=r"max_seq_len=2,000,000,000 is wider than sftpack's limit of 16,777,216"):
        prepack(chat_file, tmp_path / "w", tokenizer=tok, max_seq_len=2_000_000_000)
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    assert (
        main(
            [
                "prepack",
                str(chat_file),
                "--out",
                str(tmp_path / "w"),
                "--tokenizer",
                str(tok_dir),
                "--max-seq-len",
                "2000000000",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sftpack prepack: --max-seq-len=2,000,000,000 is wider than")
    assert not (tmp_path / "w").exists()
    # the limit itself is accepted (the plan is checked, not built here)
    from sftpack.offline.engine import plan_rows

    assert plan_rows([5, 10], max_seq_len=MAX_ROW_WIDTH).max_seq_len == MAX_ROW_WIDTH
    with pytest.raises(ValueError, match="wider than sftpack's limit"):
        plan_rows([5, 10], max_seq_len=MAX_ROW_WIDTH + 1)
