"""``sftpack train`` from the command line: chat files, a local tokenizer, each
path and the padded baseline; the JSONL log, the plot, resume and its refusals."""

from __future__ import annotations

import json

import pytest

from sftpack.cli import main


def _args(chat, tmp_path, packing, *extra):
    return [
        "train",
        str(chat / "chat.jsonl"),
        "--tokenizer",
        str(chat / "tok"),
        "--packing",
        packing,
        "--steps",
        "4",
        "--batch-size",
        "4" if packing in ("trainer", "none") else "2",
        "--max-seq-len",
        "256",
        "--dim",
        "16",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--lr",
        "1e-2",
        "--log",
        str(tmp_path / f"{packing}.jsonl"),
        *extra,
    ]


def test_train_trainer_writes_log_and_plot(chat, tmp_path, capsys):
    png = tmp_path / "curves.png"
    assert main(_args(chat, tmp_path, "trainer", "--plot", str(png))) == 0
    out = capsys.readouterr().out
    assert "40 conversations -> 40 samples" in out and "real tokens/s" in out
    recs = [json.loads(line) for line in (tmp_path / "trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert {
            "step",
            "loss",
            "real_tokens",
            "slots",
            "padding",
            "tokens_per_s",
            "time",
        } <= set(r)
        assert 0 < r["real_tokens"] <= r["slots"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("packing", ["none", "loader", "offline"])
def test_train_each_path(chat, tmp_path, packing, capsys):
    extra = ["--vocab", "data"] if packing == "offline" else []
    assert main(_args(chat, tmp_path, packing, *extra)) == 0
    if extra:  # only the ids of the data, renumbered: a smaller model, prepacked after renumbering
        assert "ids that occur in the data, renumbered" in capsys.readouterr().out
    recs = [json.loads(line) for line in (tmp_path / f"{packing}.jsonl").read_text().splitlines()]
    assert len(recs) == 4
    if packing in ("loader", "offline"):
        assert all(r["slots"] == 2 * 256 for r in recs)  # rows of exactly max_seq_len


def test_trainer_and_none_see_the_same_conversations(chat, tmp_path, capsys):
    assert main(_args(chat, tmp_path, "trainer")) == 0
    assert main(_args(chat, tmp_path, "none")) == 0
    a = [json.loads(x) for x in (tmp_path / "trainer.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "none.jsonl").read_text().splitlines()]
    assert [r["real_tokens"] for r in a] == [r["real_tokens"] for r in b]
    assert [r["label_tokens"] for r in a] == [r["label_tokens"] for r in b]
    # Step 1 only: both runs start from the same float32 parameters, so their losses differ by
    # rounding alone. A forward pass here chains n <= 1,000 roundings (width 16, rows <= 256,
    # <= 284 logits); float32 errors grow like 10*sqrt(n)*u whatever the summation order
    # (Higham & Mary 2019, exceeded with probability <= 4e-22; u = 6.0e-8): 1.9e-5 relative a
    # run, 3.8e-5 for two, on a loss <= log(284) = 5.7: 2.2e-4 -> 3e-4. Later steps are not
    # compared in float32 (AdamW's 1/(sqrt(v) + eps) amplifies rounding in gradients near zero);
    # tests/loop/test_equality.py proves 20 steps equal in float64.
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 3e-4, (a[0]["loss"], b[0]["loss"])
    assert all(x["slots"] < y["slots"] for x, y in zip(a, b))


def test_resume_and_refusals(chat, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    assert (
        main(
            _args(
                chat,
                tmp_path,
                "trainer",
                "--checkpoint-dir",
                ckpt,
                "--checkpoint-every",
                "2",
            )
        )
        == 0
    )
    longer = _args(chat, tmp_path, "trainer", "--checkpoint-dir", ckpt, "--resume")
    longer[longer.index("--steps") + 1] = "6"
    assert main(longer) == 0
    assert "resumed from step 4" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (tmp_path / "trainer.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    # Other data options: one clear line, exit 1.
    args = _args(chat, tmp_path, "trainer", "--checkpoint-dir", ckpt, "--resume")
    args[args.index("--max-seq-len") + 1] = "128"
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "other data or data options" in err and len(err.strip().splitlines()) == 1
    # Usage errors: exit 2.
    assert main(_args(chat, tmp_path, "trainer", "--resume")) == 2
    assert main(_args(chat, tmp_path, "trainer", "--pad-multiple", "3")) == 2
    assert "max_seq_len=256 is not a multiple of pad_multiple=3" in capsys.readouterr().err


def test_the_default_model_is_small_llama_and_trains_as_transformers_llama(chat, tmp_path, capsys):
    """``--model-impl torch`` (the default) and ``transformers`` train the same network from the same
    weights with the same ops (tests/loop/test_llama.py), so every step's loss is the same float32 number."""
    assert main(_args(chat, tmp_path, "trainer")) == 0
    assert "model: SmallLlama," in capsys.readouterr().out
    assert main([*_args(chat, tmp_path, "none"), "--model-impl", "transformers"]) == 0
    assert "model: LlamaForCausalLM," in capsys.readouterr().out
    (tmp_path / "none.jsonl").rename(tmp_path / "hf.jsonl")
    assert main(_args(chat, tmp_path, "none")) == 0
    hf = [json.loads(x) for x in (tmp_path / "hf.jsonl").read_text().splitlines()]
    me = [json.loads(x) for x in (tmp_path / "none.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in me] == [r["loss"] for r in hf]
    assert [r["grad_norm"] for r in me] == [r["grad_norm"] for r in hf]


def test_model_impl_is_refused_where_it_picks_nothing(chat, tmp_path, capsys):
    assert main([*_args(chat, tmp_path, "trainer"), "--model", str(tmp_path), "--model-impl", "torch"]) == 2
    assert "--model-impl picks the code of the default text model: not with --model" in capsys.readouterr().err
    assert main(["train", "--corpus", "vqa", "--model-impl", "transformers", "--steps", "1"]) == 2
    assert "not with --corpus vqa" in capsys.readouterr().err
