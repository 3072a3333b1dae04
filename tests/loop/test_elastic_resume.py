"""Elastic resume: a run checkpointed at N ranks resumes at M ranks and continues the
global stream exactly, nothing repeated or skipped (issue 41, item 4).

Each case trains 4 steps at N ranks (gloo, forked ranks, or the test's own process at 1),
checkpoints, and resumes at M ranks for 4 more; the 8 losses and the final parameters must
equal an uninterrupted 8-step run at 1 rank, in float64, to a fixed 1e-10. The derivation
is tests/loop/test_distributed.py's: a step at 2 ranks is the 1-rank step in another
summation order plus DDP's gradient all-reduce and division by the world size (exact or
one rounding each, ~1e-16 relative per step); the resumed half adds nothing, since the
checkpoint holds the whole model and AdamW state (saved and loaded bit for bit) and the
data position is the global stream's. Over 8 steps at lr 1e-2 the differences stay many
orders of magnitude under 1e-10, while a step trained on other conversations (a position
off by one step, a rank's share lost) moves the loss by more than 1e-3
(test_distributed.py's negative control).

Every packing path's source is elastic (``Source.elastic``: its position does not depend
on the number of ranks): the trainer path and the padded baseline (``none``), the offline
path (rows read of one seeded order) and the loader path (one global stream). 2 -> 1 and
1 -> 2 on all four; 2 -> 4 on the three packing paths, whose second half is a 4-rank run
against the 1-rank one (issue 41: 2 and 4 gloo ranks give the 1-rank losses).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from sftpack.loop import CheckpointError, make_source, train
from sftpack.loop._checkpoint import latest_checkpoint, load_checkpoint
from sftpack.offline import prepack_samples
from tests.helpers import max_param_diff, tiny_config, tiny_model, tiny_samples
from tests.loop.conftest import run_ranks

STEPS, HALF = 8, 4
TOL = 1e-10  # float64, the same steps in another summation order: see the docstring
#: the packing paths whose sources are elastic
PACKINGS = ["trainer", "none", "offline", "loader"]

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _config(packing: str):
    # trainer / none: conversations per step; offline / loader: rows of 128 slots (2 per rank at 2 ranks)
    batch = 8 if packing in ("trainer", "none") else 4
    return tiny_config(
        packing=packing, steps=STEPS, batch_size=batch, pad_multiple=2, checkpoint_every=HALF, buffer_size=16
    )


def _train(packing: str, prepacked: str, ckpt, *, resume: bool, rank: int = 0, world: int = 1):
    """The first half (stopped after step 4, its checkpoint written) or, with ``resume``, the
    second half from that checkpoint (a model of another seed: its weights must come from it)."""
    cfg = _config(packing)
    source = make_source(cfg, samples=tiny_samples(), prepacked=prepacked, rank=rank, world=world)
    model = tiny_model(seed=1 if resume else 0, dtype=torch.float64)
    more = {"resume": True} if resume else {"stop_after": HALF}
    return train(cfg, source=source, model=model, checkpoint_dir=ckpt, **more)


def _worker(rank: int, world: int, packing: str, prepacked: str, init: str, ckpt: str, out: str, resume: bool):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        result = _train(packing, prepacked, ckpt, resume=resume, rank=rank, world=world)
        if rank == 0:
            torch.save(
                {
                    "losses": result.losses,
                    "params": [p.detach() for p in result.model.parameters()],
                    "resumed_from": result.resumed_from,
                },
                out,
            )
        dist.barrier()  # both ranks done before either tears gloo down (see test_distributed.py)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def prepacked(samples, tmp_path_factory):
    return str(
        prepack_samples(samples, tmp_path_factory.mktemp("prepack") / "rows", max_seq_len=128, pad_multiple=2).path
    )


@pytest.fixture(scope="module")
def uninterrupted(samples, prepacked):
    """Each path's 8 steps at 1 rank, in one go (run in the test's process before any fork, so
    the ranks inherit the loaded libraries)."""
    done: dict[str, object] = {}

    def get(packing: str):
        if packing not in done:
            cfg = _config(packing)
            source = make_source(cfg, samples=samples, prepacked=prepacked)
            done[packing] = train(cfg, source=source, model=tiny_model(dtype=torch.float64))
        return done[packing]

    return get


def _check(losses, params, resumed_from, full) -> None:
    assert resumed_from == HALF
    assert len(losses) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(losses, full.losses))
    param_diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, full.model.parameters()))
    print(f"max |dloss| {loss_diff:.1e}, max |dparam| {param_diff:.1e} (tolerance {TOL:.0e})")
    assert loss_diff <= TOL and param_diff <= TOL, (loss_diff, param_diff)
    assert full.losses[-1] < full.losses[0]  # it learns: the equality is not of two idle runs


@needs_gloo
@pytest.mark.parametrize("packing", PACKINGS)
def test_two_ranks_resume_on_one(packing, prepacked, uninterrupted, tmp_path):
    full = uninterrupted(packing)
    ckpt, out = tmp_path / "ckpt", str(tmp_path / "first.pt")
    run_ranks(_worker, (2, packing, prepacked, str(tmp_path / "init"), str(ckpt), out, False), 2)
    first = torch.load(out)
    path = latest_checkpoint(ckpt)
    assert path is not None and path.name == f"step_{HALF:06d}"
    if packing in ("trainer", "none"):
        # what the per-rank files of the seeded order hold: the same data position and RNG states
        # on both ranks, so rank 0's file is every rank's at another world size
        files = [torch.load(path / f"rank_{r}.pt", weights_only=False) for r in range(2)]
        assert files[0]["data"] == files[1]["data"]
        # (Python's own ``random`` is left out: every process seeds it from the OS, a fork too, and
        # no step uses it, or no run would repeat)
        assert torch.equal(files[0]["rng"]["torch"], files[1]["rng"]["torch"])
        assert repr(files[0]["rng"]["numpy"]) == repr(files[1]["rng"]["numpy"])
    # a source whose position is per rank is refused, with the message it always had
    fp = make_source(_config(packing), samples=tiny_samples(), prepacked=prepacked).fingerprint()
    with pytest.raises(CheckpointError, match=r"written by 2 rank\(s\), resumed on 1: .*same number of processes"):
        load_checkpoint(path, rank=0, world=1, fingerprint=fp, elastic=False)

    second = _train(packing, prepacked, ckpt, resume=True)
    _check(first["losses"] + second.losses, list(second.model.parameters()), second.resumed_from, full)
    assert max_param_diff(second.model, full.model) <= TOL


@needs_gloo
@pytest.mark.parametrize("packing", PACKINGS)
def test_one_rank_resumes_on_two(packing, prepacked, uninterrupted, tmp_path):
    full = uninterrupted(packing)
    ckpt, out = tmp_path / "ckpt", str(tmp_path / "second.pt")
    first = _train(packing, prepacked, ckpt, resume=False)
    assert [r.step for r in first.logs] == list(range(1, HALF + 1))
    run_ranks(_worker, (2, packing, prepacked, str(tmp_path / "init"), str(ckpt), out, True), 2)
    second = torch.load(out)
    _check(first.losses + second["losses"], second["params"], second["resumed_from"], full)


@needs_gloo
@pytest.mark.parametrize("packing", ["trainer", "offline", "loader"])
def test_two_ranks_resume_on_four(packing, prepacked, uninterrupted, tmp_path):
    full = uninterrupted(packing)
    ckpt = tmp_path / "ckpt"
    run_ranks(_worker, (2, packing, prepacked, str(tmp_path / "init2"), str(ckpt), str(tmp_path / "a.pt"), False), 2)
    first = torch.load(tmp_path / "a.pt")
    out = str(tmp_path / "b.pt")
    run_ranks(_worker, (4, packing, prepacked, str(tmp_path / "init4"), str(ckpt), out, True), 4)
    second = torch.load(out)
    _check(first["losses"] + second["losses"], second["params"], second["resumed_from"], full)
