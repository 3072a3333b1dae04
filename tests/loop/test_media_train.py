"""Training on samples with images through the one loop: the trainer path (padded batches with
their media packed at the step) and the padded baseline train the same tiny Qwen2-VL the same
way, 20 AdamW steps in float64; the loader's and a prepack's rows against a replay of their
steps; exact resume from a checkpoint; 2 DDP ranks (gloo) against 1.

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
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("easy_vqa")
pytest.importorskip("PIL")

from sftpack.loop import ReplaySource, TrainConfig, compact_vocabulary, make_source, train  # noqa: E402
from sftpack.loop._model import build_media_model, media_token_ids  # noqa: E402
from sftpack.loop._setup import media_samples  # noqa: E402
from sftpack.loop._sources import TrainerSource  # noqa: E402
from sftpack.multimodal import family_for, vqa_corpus  # noqa: E402
from tests.loop.conftest import run_ranks  # noqa: E402

TOL = 1e-10  # float64; see the docstring
BUG = 1e-6  # what the negative control must move the first step's loss by, at least (1e4 x TOL)
STEPS = 20


class Data:
    """16 easy-vqa samples over the ids they use (plus the pad and the ids the model's config
    names), and the tiny float64 Qwen2-VL for that vocabulary."""

    def __init__(self) -> None:
        self.family = family_for()
        self.tok = self.family.tokenizer()
        convs = vqa_corpus(seed=0, limit=16, min_side=56, max_side=112)
        samples, _ = media_samples(convs, max_seq_len=256)
        keep = [self.tok.pad_token_id, *media_token_ids(self.family, self.tok).values()]
        self.samples, self.vocab = compact_vocabulary(samples, keep=keep)
        self.pad_id = int(np.searchsorted(self.vocab, self.tok.pad_token_id))

    def model(self):
        return build_media_model(
            self.family, self.tok, vocab=self.vocab, dim=32, layers=2, heads=4, kv_heads=2, dtype=torch.float64
        )


@pytest.fixture(scope="module")
def data():
    return Data()


def _config(packing: str, **kw) -> TrainConfig:
    base = dict(steps=STEPS, batch_size=4, max_seq_len=256, dim=32, layers=2, heads=4, kv_heads=2, device="cpu")
    return TrainConfig(packing=packing, **{**base, **kw})


def _run(data, cfg: TrainConfig, source=None, **kw):
    src = source or make_source(cfg, samples=data.samples, pad_id=data.pad_id)
    return train(cfg, source=src, model=data.model(), **kw)


@pytest.fixture(scope="module")
def padded_run(data):
    return _run(data, _config("none"))


@pytest.mark.parametrize("boundaries, pad_multiple", [("real", 1), ("padded", 4)])
def test_trainer_path_trains_as_padded_for_20_steps(data, padded_run, boundaries, pad_multiple):
    samples = data.samples
    packed = _run(data, _config("trainer", boundaries=boundaries, pad_multiple=pad_multiple))
    # the same samples and images per step
    assert [sorted(map(str, c)) for c in packed.conversations] == [
        sorted(map(str, c)) for c in padded_run.conversations
    ]
    by_id = {s.conversation_id: s for s in samples}
    assert len(by_id) == len(samples)  # none split at this max_seq_len: an id names one sample
    images = [sum(by_id[c].media.num_items for c in step) for step in padded_run.conversations]
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


def test_the_patch_budget_bounds_every_micro_batch_and_changes_no_loss(data, padded_run):
    """--max-patches-per-row on the trainer path: micro-batches of at most that many vision patches
    (more of them), the same losses as without the budget (the grouping changes only summation orders)."""
    budget = max(s.num_patches for s in data.samples)
    free_cfg = _config("trainer", steps=4, micro_batch_tokens=1024)  # the whole step in one micro-batch by tokens
    cfg = _config("trainer", steps=4, micro_batch_tokens=1024, max_patches_per_row=budget)
    rows = {}
    for name, c in (("free", free_cfg), ("budget", cfg)):
        src = make_source(c, samples=data.samples, pad_id=data.pad_id)
        rows[name] = [mb for _ in range(4) for mb in src.next_step()]
    assert max(r.media.num_patches for r in rows["free"]) > budget  # the premise: the budget binds
    assert max(r.media.num_patches for r in rows["budget"]) <= budget
    run = _run(data, cfg)
    free = _run(data, free_cfg)
    assert sum(r.micro_batches for r in run.logs) > sum(r.micro_batches for r in free.logs)
    assert max(abs(a - b) for a, b in zip(run.losses, free.losses)) <= TOL
    assert abs(run.losses[0] - padded_run.losses[0]) <= TOL  # the same first step as the padded run


class _OneDPositions(TrainerSource):
    """The bug: rows whose MRoPE rows are the plain 1-D text positions (the grids ignored)."""

    def next_step(self):
        return [
            dataclasses.replace(b, media=dataclasses.replace(b.media, positions=b.position_ids.expand(3, -1).clone()))
            for b in super().next_step()
        ]


def test_negative_control_1d_positions_moves_the_loss(data, padded_run):
    cfg = _config("trainer", steps=1)
    bad = _OneDPositions(data.samples, micro_batch_tokens=256, batch_size=4, seed=0, pad_id=data.pad_id)
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
    with pytest.raises(ValueError, match="needs a prepacked directory"):
        make_source(_config("offline"), samples=data.samples)
    with pytest.raises(ValueError, match="more than max_seq_len=16"):
        make_source(_config("trainer", max_seq_len=16), samples=data.samples)
    with pytest.raises(ValueError, match="pad_id .* is the media placeholder id"):
        make_source(_config("none"), samples=data.samples, pad_id=data.samples[0].media.token_id).next_step()
    with pytest.raises(ValueError, match="vision patches, more than max_patches_per_row=1"):
        make_source(_config("trainer", max_patches_per_row=1), samples=data.samples, pad_id=data.pad_id).next_step()


@pytest.fixture(scope="module")
def prepacked(tmp_path_factory):
    from sftpack.offline import prepack

    out = tmp_path_factory.mktemp("vqa") / "rows"
    convs = vqa_corpus(seed=0, limit=16, min_side=56, max_side=112)
    return prepack(convs, out, max_seq_len=256, on_bad_row="error", images=True).path


@pytest.mark.parametrize("packing", ["loader", "offline"])
def test_loader_and_offline_paths_train_as_padded_for_20_steps(data, prepacked, packing):
    """The rows of the loader (packed while streaming) and of a prepack with images (read back,
    its ids renumbered into the data's vocabulary) against the same conversations per step as
    right-padded batches (ReplaySource): the same losses and parameters, 20 float64 steps."""
    cfg = _config(packing, batch_size=2)
    src = make_source(cfg, samples=data.samples, pad_id=data.pad_id, prepacked=prepacked, vocab=data.vocab)
    packed = _run(data, cfg, source=src)
    by_id = {s.conversation_id: s for s in data.samples}
    steps = [[by_id[c] for c in step] for step in packed.conversations]
    assert all(steps) and sum(r.images for r in packed.logs) == sum(s.media.num_items for st in steps for s in st)
    replay = ReplaySource(steps, pad_id=data.pad_id)
    padded = _run(data, _config("none"), source=replay)
    assert [r.images for r in packed.logs] == [r.images for r in padded.logs]
    assert max(abs(a - b) for a, b in zip(packed.losses, padded.losses)) <= TOL, (packed.losses, padded.losses)
    drift = max(
        float((p - q).detach().abs().max()) for p, q in zip(packed.model.parameters(), padded.model.parameters())
    )
    assert drift <= TOL


@pytest.mark.parametrize("packing", ["trainer", "loader", "none"])
def test_resume_continues_the_same_image_run(data, packing, tmp_path):
    """Stopped after step 5, resumed from its step-4 checkpoint: the uninterrupted run's losses, bit for bit."""
    cfg = _config(packing, steps=8, batch_size=4 if packing != "loader" else 2, checkpoint_every=2, buffer_size=8)
    full = _run(data, cfg)
    ckpt = tmp_path / "ckpt"
    first = _run(data, cfg, checkpoint_dir=ckpt, stop_after=5)
    second = _run(data, cfg, checkpoint_dir=ckpt, resume=True)
    assert second.resumed_from == 4 and [r.step for r in second.logs] == [5, 6, 7, 8]
    assert first.losses == full.losses[:5]
    assert second.losses == full.losses[4:]  # bit for bit: same data, images, RNG and arithmetic
    assert [r.images for r in second.logs] == [r.images for r in full.logs[4:]]
    assert all(torch.equal(p, q) for p, q in zip(second.model.parameters(), full.model.parameters()))


def test_a_checkpoint_of_other_images_is_refused(data, tmp_path):
    from sftpack.loop import CheckpointError

    cfg = _config("trainer", steps=2, checkpoint_every=2)
    ckpt = tmp_path / "ckpt"
    _run(data, cfg, checkpoint_dir=ckpt)
    other = [
        dataclasses.replace(s, media=dataclasses.replace(s.media, pixel_values=s.media.pixel_values + 1))
        for s in data.samples
    ]
    longer = _config("trainer", steps=4, checkpoint_every=2)
    with pytest.raises(CheckpointError, match="other data"):
        train(
            longer,
            source=make_source(longer, samples=other, pad_id=data.pad_id),
            model=data.model(),
            checkpoint_dir=ckpt,
            resume=True,
        )


def test_a_llava_run_trains_packed_as_padded(tmp_path):
    """Another family through the same loop: LLaVA (one fixed-size image per tower entry, 1-D
    positions; its tower runs inside its model, so the loss module hands it the pixels). The
    trainer path and the padded baseline, 3 float64 steps: the same losses to TOL (the docstring's
    derivation; LLaVA's chains are shorter: 32 px images, 8 px patches, width 32)."""
    family = family_for("llava")
    tok = family.tokenizer()
    samples, _ = media_samples(vqa_corpus(seed=0, limit=8, min_side=56, max_side=112), max_seq_len=256, family=family)
    samples, vocab = compact_vocabulary(samples, keep=[tok.pad_token_id, *media_token_ids(family, tok).values()])
    pad = int(np.searchsorted(vocab, tok.pad_token_id))
    runs = {}
    for packing in ("trainer", "none"):
        cfg = _config(packing, steps=3)
        model = build_media_model(family, tok, vocab=vocab, dim=32, dtype=torch.float64)
        runs[packing] = train(cfg, source=make_source(cfg, samples=samples, pad_id=pad), model=model)
    packed, padded = runs["trainer"], runs["none"]
    assert [r.images for r in packed.logs] == [r.images for r in padded.logs] and packed.logs[0].images >= 1
    assert max(abs(a - b) for a, b in zip(packed.losses, padded.losses)) <= TOL


# ------------------------------------------------------------------ data parallel, 2 ranks (gloo)
#: float64; 2 DDP ranks against 1 on the same global batches. The same function in another
#: summation order: each rank sums its micro-batches' token losses over the *global* target count,
#: DDP all-reduces the gradients (a sum of 2 terms, one rounding) and divides by the world size
#: (a power of two: exact), undone by the loss module's average_over_ranks (exact). One step is
#: then off by the rounding chain of the docstring (n <= 4,000, 2 * n * u = 8.9e-13 relative on a
#: loss of about 4 and gradients <= 10: <= 8.9e-12) plus one rounding of the all-reduce; AdamW's
#: lr/eps amplification over 6 steps is bounded as in tests/loop/test_equality.py (a factor
#: 2,000 below 1e-10 for 20 steps). 1e-10 is 11x the per-step bound. The negative control (both
#: ranks train on rank 0's share) moves the loss by more than BUG_DDP = 1e-3.
DDP_TOL = 1e-10
BUG_DDP = 1e-3
_DDP_DATA = {}


#: each path's 2-rank image run: the trainer path's 8 conversations a step, the offline path's 4 rows
#: (of the 5 the prepack holds) in 2 micro-batches a rank, the loader path's 2 rows
_DDP_CONFIGS = {
    "trainer": lambda: _config("trainer", steps=6, batch_size=8, pad_multiple=2),
    "offline": lambda: _config("offline", steps=4, batch_size=4, grad_accum=2),
    "loader": lambda: _config("loader", steps=4, batch_size=2, buffer_size=8),
}


def _ddp_source(packing: str, data, rank: int, world: int = 2, prepacked: str | None = None):
    cfg = _DDP_CONFIGS[packing]()
    if packing == "offline":
        return make_source(cfg, prepacked=prepacked, pad_id=data.pad_id, vocab=data.vocab, rank=rank, world=world)
    return make_source(cfg, samples=data.samples, pad_id=data.pad_id, rank=rank, world=world)


def _ddp_worker(rank: int, init_file: str, out_file: str, packing: str, unsharded: bool, prepacked: str | None) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=300)
    )
    try:
        data = _DDP_DATA["data"]
        # the negative control: every rank takes rank 0's share
        source = _ddp_source(packing, data, 0 if unsharded else rank, prepacked=prepacked)
        result = train(_DDP_CONFIGS[packing](), source=source, model=data.model())
        torch.save(
            {
                "params": [p.detach() for p in result.model.parameters()],
                "losses": result.losses,
                "images": [r.images for r in result.logs],
                "conversations": result.conversations,
            },
            f"{out_file}.{rank}",
        )
        # both ranks done before either tears gloo down: a rank that left first once aborted its peer's
        # teardown under load (SIGABRT, "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _two_ranks_like_one(data, tmp_path, packing: str, prepacked: str | None = None, unsharded: bool = False):
    """The 1-rank run (first: the forked ranks inherit what it loaded), then 2 ranks; asserts each step's
    conversations or rows over both ranks are the 1-rank step's, the images' global counts, and the
    losses and parameters to DDP_TOL. Returns the 1-rank run."""
    one = _run(data, _DDP_CONFIGS[packing](), source=_ddp_source(packing, data, 0, world=1, prepacked=prepacked))
    _DDP_DATA["data"] = data
    out = str(tmp_path / "rank")
    run_ranks(_ddp_worker, (str(tmp_path / "init"), out, packing, unsharded, prepacked))
    a, b = torch.load(out + ".0"), torch.load(out + ".1")
    if unsharded:
        assert max(abs(x - y) for x, y in zip(a["losses"], one.losses)) > BUG_DDP
        return one
    for step, (x, y, both) in enumerate(zip(a["conversations"], b["conversations"], one.conversations)):
        assert x and y, f"step {step}: a rank got no conversation or row"
        assert sorted(map(str, x + y)) == sorted(map(str, both)), f"step {step}: not the 1-rank step's"
    assert a["images"] == [r.images for r in one.logs] and all(n >= 1 for n in a["images"])  # global counts
    loss_diff = max(abs(x - y) for x, y in zip(a["losses"], one.losses))
    param_diff = max(float((p - q.detach()).abs().max()) for p, q in zip(a["params"], one.model.parameters()))
    assert loss_diff <= DDP_TOL and param_diff <= DDP_TOL, (loss_diff, param_diff)
    return one


needs_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)


@needs_gloo
def test_two_ranks_train_an_image_run_like_one(data, tmp_path):
    _two_ranks_like_one(data, tmp_path, "trainer")
    (tmp_path / "bad").mkdir()
    _two_ranks_like_one(data, tmp_path / "bad", "trainer", unsharded=True)


@needs_gloo
def test_two_ranks_train_a_prepack_with_images_like_one(data, prepacked, tmp_path):
    """The offline path's one global stream with images: each step's 4 rows (of the 5 the prepack
    holds; a fresh seeded order every step) dealt 2 to each rank by cost, 2 micro-batches each; the
    same rows per step, images, losses and parameters as one rank's, to DDP_TOL (its derivation above:
    the same function in another summation order)."""
    _two_ranks_like_one(data, tmp_path, "offline", prepacked=str(prepacked))


@needs_gloo
def test_two_ranks_train_an_image_run_like_one_on_the_loader_path(data, tmp_path):
    """The loader path's one global stream (issue 41): 2 DDP ranks each lay one of every step's two
    rows (dealt by cost) and train like 1 process laying both, to DDP_TOL (the derivation above:
    the same rows per step, another summation order)."""
    _two_ranks_like_one(data, tmp_path, "loader")


# ------------------------------------------------------------------ sftpack train with images
#: float32, first step (the loss of the same initial parameters): rounding errors grow like
#: lambda*sqrt(n)*u (Higham & Mary 2019; lambda = 10: exceeded with probability <= 4e-22), n <= 4,000
#: (the chain above), u = 2**-24 = 6.0e-8: 10 * sqrt(4000) * 6e-8 = 3.8e-5 relative per run, 7.6e-5 for
#: two, on a loss of about 4.1: 3.1e-4 -> 4e-4 absolute. Later float32 steps carry AdamW's lr/eps
#: amplification of rounding (tests/loop/test_equality.py): compared in float64 above, not here.
LOSS_TOL_32 = 4e-4


def _cli(tmp_path, packing: str, dtype: str, steps: int, *extra: str, data: tuple[str, ...] = ("--corpus", "vqa")):
    log = tmp_path / f"{packing}-{dtype}.jsonl"
    args = (
        ["train", *data, "--packing", packing, "--steps", str(steps), "--batch-size", "4"]
        + ["--max-seq-len", "256", "--vocab", "data", "--dim", "32", "--device", "cpu", "--dtype", dtype]
        + ["--log", str(log), *extra]
    )
    if data[:2] == ("--corpus", "vqa"):
        args += ["--limit", "12", "--image-sides", "56", "112"]
    return args, log


def _log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("dtype, steps", [("float64", 5), ("float32", 2)])  # 20 steps: above
def test_sftpack_train_corpus_vqa_trainer_equals_none(tmp_path, capsys, dtype, steps):
    from sftpack.cli import main

    logs = {}
    for packing in ("trainer", "none"):
        args, log = _cli(tmp_path, packing, dtype, steps)
        assert main(args) == 0
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


def test_sftpack_train_refuses_what_an_image_run_does_not_take(tmp_path, capsys):
    from sftpack.cli import main

    args, _ = _cli(tmp_path, "trainer", "float32", 1)
    assert main([*args, "--vocab", "tokenizer", "--model", str(tmp_path)]) == 2  # a folder with no model in it
    err = capsys.readouterr().err
    assert "config.json" in err and "supported: qwen2_vl" in err
    assert main([*args, "--model-impl", "torch"]) == 2
    assert "not with --corpus vqa" in capsys.readouterr().err
    assert main(["train", "--max-patches-per-row", "64", "--steps", "1"]) == 2
    assert "--max-patches-per-row is the vision-patch budget of data with images" in capsys.readouterr().err
    assert main([*args, "--image-sides", "112", "56"]) == 2
    assert "MIN must not exceed MAX" in capsys.readouterr().err
    assert main([*args, "--max-patches-per-row", "8"]) == 1  # an image of more patches: no micro-batch holds it
    assert "raise the patch budget" in capsys.readouterr().err


@pytest.mark.parametrize("packing", ["loader", "offline"])
def test_sftpack_train_corpus_vqa_on_the_loader_and_offline_paths(tmp_path, capsys, packing):
    from sftpack.cli import main

    args, log = _cli(tmp_path, packing, "float32", 2, "--batch-size", "2")  # rows: 12 conversations, 3 rows
    assert main(args) == 0
    lines = _log(log)
    assert len(lines) == 2 and all(r["images"] >= 1 and r["padding"] < 0.5 for r in lines)
    assert "images over 2 steps" in capsys.readouterr().out


@pytest.mark.parametrize("packing", ["trainer", "loader"])
def test_sftpack_train_images_resume_is_exact(tmp_path, capsys, packing):
    """--checkpoint-dir, SIGTERM-free: a 4-step run with a checkpoint at step 2, its log cut there and
    resumed with --resume: steps 3 and 4 have the uninterrupted run's losses, bit for bit (float32)."""
    from sftpack.cli import main

    batch = ["--batch-size", "2"] if packing == "loader" else []
    full_args, full_log = _cli(tmp_path / "full", packing, "float32", 4, *batch)
    (tmp_path / "full").mkdir()
    assert main(full_args) == 0
    ckpt = str(tmp_path / "ckpt")
    args, log = _cli(tmp_path, packing, "float32", 4, *batch, "--checkpoint-dir", ckpt, "--checkpoint-every", "2")
    assert main(args) == 0
    import shutil

    shutil.rmtree(Path(ckpt) / "step_000004")  # as if killed after step 3: the latest is step 2
    (Path(ckpt) / "latest").write_text("step_000002")
    assert main([*args, "--resume"]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    full, resumed = _log(full_log), _log(log)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["images"] for r in resumed] == [r["images"] for r in full]


def test_sftpack_train_a_file_with_image_parts(tmp_path, capsys):
    """``sftpack train FILE`` where FILE's conversations hold image parts: found from the data, and
    the same run as ``--corpus vqa`` on the same conversations (their JSONL), loss for loss."""
    from sftpack.cli import main

    convs = list(vqa_corpus(seed=0, limit=12, min_side=56, max_side=112))
    path = tmp_path / "my_images.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    (tmp_path / "vqa").mkdir()
    # the corpus's images lie in its package, outside the JSONL's folder: read when allowed
    args, log = _cli(tmp_path, "trainer", "float32", 3, "--allow-outside-images", data=(str(path),))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "12 conversations -> 12 samples with" in out and "tiny qwen2_vl" in out
    vqa_args, vqa_log = _cli(tmp_path / "vqa", "trainer", "float32", 3)
    assert main(vqa_args) == 0
    assert [r["loss"] for r in _log(log)] == [r["loss"] for r in _log(vqa_log)]
    assert all(r["images"] >= 1 for r in _log(log))
