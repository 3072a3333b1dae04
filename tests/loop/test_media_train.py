"""Multimodal training: the trainer path (padded batches with images packed at the step) and the
padded baseline train the same tiny Qwen2-VL the same way, 20 AdamW steps in float64.

Both runs take the same conversations every step (one seeded order), so they see the
same samples and the same images; the trainer path bins them into micro-batches of at
most 256 tokens (several per step) and packs each, the baseline pads them into one
``[4, S]`` batch. Per-step losses and the final parameters must agree to 1e-10, in both
boundary modes; a packed row whose MRoPE positions are plain 1-D ones (a collator's bug)
moves the first step's loss by more than BUG.

Tolerance, fixed (float64, u = 2**-53 = 1.1e-16): the two runs compute the same function
of the same samples and differ only by summation order. One step's loss and gradients:
the longest rounding chain is n <= 4,000 (tests/multimodal/test_exactness.py: the patch
embedding's 1,176-term dot products, width 32 over 2 vision and 2 text layers, segments
<= 256 tokens, 56-112 px images), so each run is off by <= n*u = 4.4e-13 relative, the two
by <= 8.9e-13, on a loss of about 4 (log of the 60-odd ids): <= 3.6e-12; 1e-10 is 28x that.
Later steps carry AdamW's amplification of rounding in near-zero gradients (lr / eps); the
argument of tests/loop/test_equality.py (the same mechanism scaled from float32, where it
was seen at 2.4e-5, down by 2**29) leaves 1e-10 a factor 2,000 above it. A packing bug is
not rounding: the negative control moves the first step's loss by more than BUG = 1e-6, 1e4 x TOL
(observed 1.7e-5: at width 32 the MRoPE height and width sections hold 2 of the 8 rotary
frequencies, and an untrained model's attention is nearly uniform, so wrong positions move
its first loss little; they move it all the same, far outside rounding).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("easy_vqa")
pytest.importorskip("PIL")

from sftpack.loop import TrainConfig  # noqa: E402
from sftpack.loop._media import (  # noqa: E402
    MediaTrainerSource,
    compact_media_vocabulary,
    make_media_source,
    media_ids,
    tiny_vqa_model,
    train_media,
    vqa_samples,
)

TOL = 1e-10  # float64; see the docstring
BUG = 1e-6  # what the negative control must move the first step's loss by, at least (1e4 x TOL)
STEPS = 20


@pytest.fixture(scope="module")
def data():
    samples, _ = vqa_samples(limit=16, seed=0, max_seq_len=256, min_side=56, max_side=112)
    samples, vocab = compact_media_vocabulary(samples)
    return samples, vocab


def _config(packing: str, **kw) -> TrainConfig:
    base = dict(steps=STEPS, batch_size=4, max_seq_len=256, dim=32, layers=2, heads=4, kv_heads=2, device="cpu")
    return TrainConfig(packing=packing, **{**base, **kw})


def _run(data, cfg: TrainConfig, source=None, **kw):
    samples, vocab = data
    model = tiny_vqa_model(vocab, dim=32, layers=2, heads=4, kv_heads=2, seed=0, dtype=torch.float64)
    src = source or make_media_source(cfg, samples, pad_id=media_ids(vocab)["pad_id"])
    return train_media(cfg, source=src, model=model, **kw)


@pytest.fixture(scope="module")
def padded_run(data):
    return _run(data, _config("none"))


@pytest.mark.parametrize("boundaries, pad_multiple", [("real", 1), ("padded", 4)])
def test_trainer_path_trains_as_padded_for_20_steps(data, padded_run, boundaries, pad_multiple):
    samples, _ = data
    packed = _run(data, _config("trainer", boundaries=boundaries, pad_multiple=pad_multiple))
    # the same samples and images per step
    assert [sorted(map(str, c)) for c in packed.conversations] == [
        sorted(map(str, c)) for c in padded_run.conversations
    ]
    by_id = {s.conversation_id: s for s in samples}
    assert len(by_id) == len(samples)  # none split at this max_seq_len: an id names one sample
    images = [sum(by_id[c].num_images for c in step) for step in padded_run.conversations]
    assert [r.images for r in packed.logs] == [r.images for r in padded_run.logs] == images
    assert sum(images) >= STEPS  # images in (almost) every step
    assert max(r.micro_batches for r in packed.logs) > 1  # the trainer path accumulates several rows
    assert all(r.real_tokens == q.real_tokens for r, q in zip(packed.logs, padded_run.logs))
    # the same losses and parameters
    diff = max(abs(a - b) for a, b in zip(packed.losses, padded_run.losses))
    assert diff <= TOL, (packed.losses, padded_run.losses)
    assert packed.losses[-1] < packed.losses[0]  # it trains
    drift = max(
        float((p - q).detach().abs().max()) for p, q in zip(packed.model.parameters(), padded_run.model.parameters())
    )
    assert drift <= TOL


class _OneDPositions(MediaTrainerSource):
    """The bug: rows whose MRoPE rows are the plain 1-D text positions (the grids ignored)."""

    def next_step(self):
        return [
            dataclasses.replace(b, mrope_position_ids=b.position_ids.expand(3, -1).clone()) for b in super().next_step()
        ]


def test_negative_control_1d_positions_moves_the_loss(data, padded_run):
    samples, vocab = data
    cfg = _config("trainer", steps=1)
    bad = _OneDPositions(samples, token_budget=256, batch_size=4, seed=0, pad_id=media_ids(vocab)["pad_id"])
    run = _run(data, cfg, source=bad)
    assert abs(run.losses[0] - padded_run.losses[0]) > BUG


def test_the_log_adds_images(data, tmp_path):
    log = tmp_path / "run.jsonl"
    run = _run(data, _config("trainer", steps=2), log=log)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["images"] for line in lines] == [r.images for r in run.logs]
    assert all(line["images"] >= 1 for line in lines)
    assert {"step", "loss", "real_tokens", "slots", "tokens_per_s"} <= set(lines[0])


def test_bad_settings_are_refused_with_a_clear_error(data):
    samples, _ = data
    with pytest.raises(ValueError, match="needs a prepack with images"):
        make_media_source(_config("offline"), samples)
    with pytest.raises(ValueError, match="more than max_seq_len=16"):
        make_media_source(_config("trainer", max_seq_len=16), samples)


@pytest.fixture(scope="module")
def prepacked(tmp_path_factory):
    from sftpack.multimodal import vqa_corpus
    from sftpack.offline import prepack_multimodal

    out = tmp_path_factory.mktemp("vqa") / "rows"
    convs = vqa_corpus(seed=0, limit=16, min_side=56, max_side=112)
    return prepack_multimodal(convs, out, max_seq_len=256, on_bad_row="error").path


@pytest.mark.parametrize("packing", ["loader", "offline"])
def test_loader_and_offline_paths_train_as_padded_for_20_steps(data, prepacked, packing):
    """The rows of the loader (packed while streaming) and of a prepack with images (read back,
    its ids renumbered into the data's vocabulary) against the same conversations per step as
    right-padded batches (MediaReplaySource): the same losses and parameters, 20 float64 steps."""
    from sftpack.loop._media import MediaReplaySource

    samples, vocab = data
    cfg = _config(packing, batch_size=2)
    src = make_media_source(cfg, samples, pad_id=media_ids(vocab)["pad_id"], prepacked=prepacked, vocab=vocab)
    packed = _run(data, cfg, source=src)
    by_id = {s.conversation_id: s for s in samples}
    steps = [[by_id[c] for c in step] for step in packed.conversations]
    assert all(steps) and sum(r.images for r in packed.logs) == sum(s.num_images for st in steps for s in st)
    replay = MediaReplaySource(steps, pad_id=media_ids(vocab)["pad_id"])
    padded = _run(data, _config("none"), source=replay)
    assert [r.images for r in packed.logs] == [r.images for r in padded.logs]
    assert max(abs(a - b) for a, b in zip(packed.losses, padded.losses)) <= TOL, (packed.losses, padded.losses)
    drift = max(
        float((p - q).detach().abs().max()) for p, q in zip(packed.model.parameters(), padded.model.parameters())
    )
    assert drift <= TOL


# ------------------------------------------------------------------ sftpack train --corpus vqa
#: float32, first step (the loss of the same initial parameters): rounding errors grow like
#: lambda*sqrt(n)*u (Higham & Mary 2019; lambda = 10: exceeded with probability <= 4e-22), n <= 4,000
#: (the chain above), u = 2**-24 = 6.0e-8: 10 * sqrt(4000) * 6e-8 = 3.8e-5 relative per run, 7.6e-5 for
#: two, on a loss of about 4.1: 3.1e-4 -> 4e-4 absolute. Later float32 steps carry AdamW's lr/eps
#: amplification of rounding (tests/loop/test_equality.py): compared in float64 above, not here.
LOSS_TOL_32 = 4e-4


def _cli(tmp_path, packing: str, dtype: str, steps: int):
    import argparse

    from sftpack.cli._train import register
    from sftpack.cli._train_vqa import add_vqa_arguments

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    train = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    if "--corpus" not in train._option_string_actions:  # until cli/_train.py registers it itself
        add_vqa_arguments(train)
    log = tmp_path / f"{packing}-{dtype}.jsonl"
    args = parser.parse_args(
        ["train", "--corpus", "vqa", "--packing", packing, "--steps", str(steps), "--batch-size", "4"]
        + ["--limit", "12", "--image-sides", "56", "112", "--max-seq-len", "256", "--vocab", "data"]
        + ["--dim", "32", "--device", "cpu", "--dtype", dtype, "--log", str(log)]
    )
    return args, log


def _log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("dtype, steps", [("float64", 5), ("float32", 2)])  # 20 steps: above
def test_sftpack_train_corpus_vqa_trainer_equals_none(tmp_path, capsys, dtype, steps):
    from sftpack.cli._train_vqa import run_vqa

    logs = {}
    for packing in ("trainer", "none"):
        args, log = _cli(tmp_path, packing, dtype, steps)
        assert run_vqa(args) == 0
        logs[packing] = _log(log)
    out = capsys.readouterr().out
    assert "easy-vqa conversations" in out and "images over" in out
    packed, padded = logs["trainer"], logs["none"]
    assert len(packed) == len(padded) == steps
    for key in ("images", "sequences", "real_tokens", "label_tokens"):
        assert [r[key] for r in packed] == [r[key] for r in padded], key
    assert all(r["images"] >= 1 for r in packed)
    if dtype == "float64":
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(packed, padded)) <= TOL
    else:
        assert abs(packed[0]["loss"] - padded[0]["loss"]) <= LOSS_TOL_32


def test_sftpack_train_corpus_vqa_refuses_what_it_does_not_take(tmp_path):
    from sftpack.cli._common import UsageError
    from sftpack.cli._train_vqa import run_vqa

    args, _ = _cli(tmp_path, "trainer", "float32", 1)
    args.checkpoint_dir = str(tmp_path)
    with pytest.raises(UsageError, match="--checkpoint-dir"):
        run_vqa(args)


@pytest.mark.parametrize("packing", ["loader", "offline"])
def test_sftpack_train_corpus_vqa_on_the_loader_and_offline_paths(tmp_path, capsys, packing):
    from sftpack.cli._train_vqa import run_vqa

    args, log = _cli(tmp_path, packing, "float32", 2)
    args.batch_size = 2  # rows: 12 conversations make 3 rows of 256
    assert run_vqa(args) == 0
    lines = _log(log)
    assert len(lines) == 2 and all(r["images"] >= 1 and r["padding"] < 0.5 for r in lines)
    assert "images over 2 steps" in capsys.readouterr().out
