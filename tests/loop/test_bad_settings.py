"""``sftpack train`` under settings a new user gets wrong (issue 16 items 8 and 10):
each case ends in one clear line (exit 2 for options that cannot work, 1 for data
or a run that cannot go on) or a counted skip, and loses nothing: no log line,
checkpoint or ``latest`` pointer of a step that was not applied."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoTokenizer

from sftpack import Sample
from sftpack.cli import main
from sftpack.loop import (
    CheckpointError,
    NonFiniteError,
    build_model,
    make_source,
    train,
)
from sftpack.loop._checkpoint import latest_checkpoint
from sftpack.offline import prepack_samples
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import TINY_MODEL, TINY_VOCAB, tiny_config, tiny_model, tiny_samples

from .test_cli_train import _args

#: a learning rate that blows the tiny model up at step 2: AdamW's first step moves
#: every parameter by about lr, so step 2 multiplies weights of ~1e6 through a few
#: matmuls and the squared activations of its RMSNorms overflow float32 (3.4e38) by
#: orders of magnitude, on any CPU: the gradient norm is NaN (step 1 is finite)
BLOW_UP_LR = "1e6"


def _one_line(err: str) -> str:
    """The one line of an error (the progress bar, also on stderr, left aside)."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("train (")]
    assert len(lines) == 1, err
    return lines[0]


def _log_steps(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _state(ckpt_step):
    return torch.load(ckpt_step / "state.pt", map_location="cpu", weights_only=False)


def _set(args, flag, value):
    args[args.index(flag) + 1] = value
    return args


# ----------------------------------------------------------------------------- non-finite steps


def test_blow_up_stops_naming_the_step_and_saves_nothing_of_it(chat, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    args = _args(chat, tmp_path, "trainer", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    assert main(_set(args, "--lr", BLOW_UP_LR)) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("sftpack train: step 2: ") and "not finite" in line
    assert "--on-nonfinite skip" in line and "lower --lr" in line
    # step 1 was applied and saved; nothing of step 2 exists
    assert [r["step"] for r in _log_steps(tmp_path / "trainer.jsonl")] == [1]
    assert latest_checkpoint(ckpt).name == "step_000001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001"]
    weights = _state(ckpt / "step_000001")["model"]
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())


def test_blow_up_with_skip_counts_every_skipped_step(chat, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    args = _args(
        chat,
        tmp_path,
        "trainer",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "1",
        "--on-nonfinite",
        "skip",
    )
    assert main(_set(args, "--lr", BLOW_UP_LR)) == 0
    out = capsys.readouterr().out
    assert "skipped 3 of 4 step(s), a non-finite loss or gradient (--on-nonfinite skip): step 2, 3, 4" in out
    recs = _log_steps(tmp_path / "trainer.jsonl")
    assert [r["skipped"] for r in recs] == ["", "nonfinite", "nonfinite", "nonfinite"]
    # a skipped step leaves the parameters as they were: every later checkpoint holds step 1's weights
    first = _state(ckpt / "step_000001")["model"]
    last = _state(ckpt / "step_000004")["model"]
    assert all(torch.equal(first[k], last[k]) for k in first)
    assert all(bool(torch.isfinite(w).all()) for w in last.values())


def test_nonfinite_error_in_the_library_names_the_step(samples):
    cfg = tiny_config(packing="trainer", steps=3, lr=float(BLOW_UP_LR), warmup_steps=0)
    model = tiny_model()
    with pytest.raises(NonFiniteError, match=r"^step 2: "):
        train(cfg, source=make_source(cfg, samples=samples), model=model)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())  # step 2 never applied


def test_a_checkpoint_of_nonfinite_weights_is_never_written(samples, tmp_path):
    cfg = tiny_config(packing="trainer", steps=2, checkpoint_every=1)
    model = tiny_model()
    with torch.no_grad():  # inf in an embedding row no step looks up: every loss and gradient stays finite
        model.get_input_embeddings().weight[5, 0] = math.inf
    without_5 = [s for s in samples if 5 not in s.input_ids.tolist()]
    assert len(without_5) >= cfg.batch_size
    with pytest.raises(NonFiniteError, match="model.embed_tokens.weight holds NaN or infinite values"):
        train(cfg, source=make_source(cfg, samples=without_5), model=model, checkpoint_dir=tmp_path)
    assert not (tmp_path / "latest").exists() and not list(tmp_path.glob("step_*"))


# ----------------------------------------------------------------------------- no supervised target


def test_max_seq_len_1_is_refused_before_training(chat, tmp_path, capsys):
    args = _set(_args(chat, tmp_path, "trainer"), "--max-seq-len", "1")
    assert main(args) == 1
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert "no supervised target" in line and "raise --max-seq-len" in line
    assert "0 supervised targets" in captured.out  # the data line says so too
    assert not (tmp_path / "trainer.jsonl").exists()


def test_prepack_without_targets_is_refused(tmp_path):
    flat = [
        Sample(s.input_ids, torch.zeros(len(s), dtype=torch.bool).numpy(), s.conversation_id) for s in tiny_samples(8)
    ]
    out = prepack_samples(flat, tmp_path / "rows", max_seq_len=128).path
    cfg = tiny_config(packing="offline", batch_size=2)
    with pytest.raises(ValueError, match="no supervised target"):
        make_source(cfg, prepacked=out)


def test_a_step_without_targets_is_counted_and_not_applied():
    # two conversations, one step each: "t" has targets, "p" is all prompt
    ids = torch.arange(1, 9).numpy() % TINY_VOCAB
    t = Sample(ids, ids >= 4, "t")
    p = Sample(ids, ids < 0, "p")
    cfg = tiny_config(packing="trainer", steps=4, batch_size=1)
    result = train(cfg, source=make_source(cfg, samples=[t, p]), model=tiny_model())
    empty = [i + 1 for i, convs in enumerate(result.conversations) if convs == ["p"]]
    assert empty and len(empty) < 4
    assert result.skipped_steps == {"no_targets": empty}
    for r in result.logs:
        assert (r.skipped == "no_targets") == (r.step in empty)
        assert (r.label_tokens == 0) == (r.step in empty)


# ----------------------------------------------------------------------------- device and model


def test_unavailable_device_is_refused_first(chat, tmp_path, capsys):
    name = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    assert main(_args(chat, tmp_path, "trainer", "--device", name)) == 2
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert f"--device device {name!r}" in line and "--device cpu" in line
    assert captured.out == ""  # nothing tokenized or built before the refusal
    assert main(_args(chat, tmp_path, "trainer", "--device", "gpu")) == 2
    assert "not a torch device name" in _one_line(capsys.readouterr().err)


def test_model_with_a_smaller_vocabulary_is_refused_before_tokenizing(chat, tmp_path, capsys):
    model_dir = tmp_path / "model"
    build_model(100, dim=16, layers=1, heads=2, kv_heads=1).save_pretrained(model_dir)
    n_tok = len(AutoTokenizer.from_pretrained(chat / "tok", local_files_only=True))
    assert n_tok > 100
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(_args(chat, tmp_path, "trainer", "--model", str(model_dir))) == 2
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert f"vocabulary of 100 ids, smaller than the tokenizer's {n_tok:,}" in line
    assert captured.out == ""


def test_token_id_outside_the_model_is_one_clear_error(samples):
    cfg = tiny_config(packing="trainer", steps=2)
    small = build_model(50, **TINY_MODEL)
    with pytest.raises(ValueError, match=r"step 1: token id \d+ is outside the model's vocabulary of 50 ids"):
        train(cfg, source=make_source(cfg, samples=samples), model=small)


# ----------------------------------------------------------------------------- --prepacked


@pytest.fixture(scope="module")
def prepacked(chat, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepacked") / "rows"
    argv = [
        "prepack",
        str(chat / "chat.jsonl"),
        "--tokenizer",
        str(chat / "tok"),
        "--max-seq-len",
        "512",
        "--pad-multiple",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    return out


def _offline(chat, tmp_path, prepacked, *extra):
    args = _args(chat, tmp_path, "offline", "--prepacked", str(prepacked), *extra)
    i = args.index("--max-seq-len")
    del args[i : i + 2]  # not repeated: taken from the prepack
    args.remove(str(chat / "chat.jsonl"))
    return args


def test_prepacked_takes_its_layout_from_the_manifest(chat, tmp_path, prepacked, capsys):
    assert main(_offline(chat, tmp_path, prepacked)) == 0
    recs = _log_steps(tmp_path / "offline.jsonl")
    assert len(recs) == 4 and all(r["slots"] == 2 * 512 for r in recs)  # rows of the prepack's 512
    # the same values given explicitly are fine; others are refused naming both
    assert main(_offline(chat, tmp_path, prepacked, "--max-seq-len", "512", "--pad-multiple", "2")) == 0
    capsys.readouterr()
    assert main(_offline(chat, tmp_path, prepacked, "--max-seq-len", "1024")) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--max-seq-len 1024" in line and "max_seq_len=512" in line
    assert main(_offline(chat, tmp_path, prepacked, "--pad-multiple", "4")) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--pad-multiple 4" in line and "pad_multiple=2" in line


def test_prepacked_with_another_tokenizer_is_refused(chat, tmp_path, prepacked, capsys):
    tiny_chat_tokenizer("llama3").save_pretrained(tmp_path / "tok2")
    args = _offline(chat, tmp_path, prepacked)
    _set(args, "--tokenizer", str(tmp_path / "tok2"))
    assert main(args) == 1
    line = _one_line(capsys.readouterr().err)
    assert "another tokenizer" in line and str(prepacked) in line
    assert not (tmp_path / "offline.jsonl").exists()


# ----------------------------------------------------------------------------- --resume


def test_resume_without_a_checkpoint_is_refused(chat, tmp_path, capsys):
    typo = tmp_path / "ckpt_typo"
    assert main(_args(chat, tmp_path, "trainer", "--checkpoint-dir", str(typo), "--resume")) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"{typo} holds no checkpoint to resume from" in line and "--resume-if-any" in line
    assert not (tmp_path / "trainer.jsonl").exists()  # nothing trained
    # the explicit flag starts fresh, and says so
    assert main(_args(chat, tmp_path, "trainer", "--checkpoint-dir", str(typo), "--resume-if-any")) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert [r["step"] for r in _log_steps(tmp_path / "trainer.jsonl")] == [1, 2, 3, 4]


def test_resume_with_other_optimisation_options_is_refused(chat, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    assert main(_args(chat, tmp_path, "trainer", "--checkpoint-dir", ckpt, "--checkpoint-every", "2")) == 0
    log = (tmp_path / "trainer.jsonl").read_text()
    capsys.readouterr()
    args = _args(chat, tmp_path, "trainer", "--checkpoint-dir", ckpt, "--resume", "--schedule", "linear")
    _set(_set(args, "--lr", "1e-3"), "--steps", "6")
    assert main(args) == 1
    line = _one_line(capsys.readouterr().err)
    assert "--lr 0.01 (checkpoint) vs 0.001 (this run)" in line
    assert "--schedule 'cosine' (checkpoint) vs 'linear' (this run)" in line
    assert (tmp_path / "trainer.jsonl").read_text() == log  # the log was not touched


def test_resume_true_in_the_library_needs_a_checkpoint(samples, tmp_path):
    cfg = tiny_config(packing="trainer", steps=2)
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(), checkpoint_dir=tmp_path, resume=True)
    out = train(
        cfg, source=make_source(cfg, samples=samples), model=tiny_model(), checkpoint_dir=tmp_path, resume="auto"
    )
    assert out.resumed_from == 0 and len(out.logs) == 2
