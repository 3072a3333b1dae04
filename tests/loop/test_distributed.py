"""Data parallelism on torch.distributed: two real processes (gloo on CPU, DDP)
train on the trainer path's own sharding of each global batch (token-budget
micro-batches dealt evenly to the ranks); after 8 steps their losses and
parameters equal those of one process training on the same global batches.

In float64, to a fixed 1e-10 (the derivation is tests/loop/test_equality.py's:
the same function in another summation order, here also DDP's gradient
all-reduce and division by the world size, which are exact or one rounding
each; 8 steps instead of 20 only shrink the bound). A negative control: a
2-rank run whose ranks both train on rank 0's share (a sharding bug) moves the
loss by more than 1e-3, 1e7x the tolerance.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from sftpack.loop import make_source, train
from tests.helpers import tiny_config, tiny_model, tiny_samples
from tests.loop.conftest import run_ranks

WORLD = 2
STEPS = 8
TOL = 1e-10  # float64: the same computation in another summation order; see the docstring
BUG = 1e-3  # what the negative control must move the loss by, at least


def _config():
    return tiny_config(packing="trainer", steps=STEPS, batch_size=8, pad_multiple=2)


def _worker(rank: int, init_file: str, out_file: str, unsharded: bool = False) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=300),
    )
    try:
        cfg = _config()
        # the negative control: every rank takes rank 0's share
        shard = 0 if unsharded else rank
        source = make_source(cfg, samples=tiny_samples(), rank=shard, world=WORLD)
        result = train(cfg, source=source, model=tiny_model(dtype=torch.float64))
        if rank == 0:
            torch.save(
                {
                    "params": [p.detach() for p in result.model.parameters()],
                    "losses": result.losses,
                    "conversations": result.conversations,
                },
                out_file,
            )
        else:
            torch.save({"conversations": result.conversations}, out_file + ".1")
        # both ranks done before either tears gloo down: a rank that left first once aborted its peer's
        # teardown under load (SIGABRT, "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path, unsharded=False):
    out = str(tmp_path / "rank0.pt")
    run_ranks(_worker, (str(tmp_path / "init"), out, unsharded), WORLD)
    return torch.load(out), torch.load(out + ".1")


def _diffs(two, one):
    loss_diff = max(abs(x - y) for x, y in zip(two["losses"], one.losses))
    param_diff = max(float((p - q.detach()).abs().max()) for p, q in zip(two["params"], one.model.parameters()))
    return loss_diff, param_diff


@pytest.fixture(scope="module")
def one_rank(samples):
    # The 1-rank run first: it also loads transformers and compiles the packer, which
    # the forked ranks then inherit instead of redoing.
    cfg = _config()
    return train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(dtype=torch.float64))


needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


@needs_gloo
def test_two_ranks_train_like_one(tmp_path, one_rank):
    two, other = _two_ranks(tmp_path)
    for step, (a, b, both) in enumerate(zip(two["conversations"], other["conversations"], one_rank.conversations)):
        assert a and b, f"step {step}: a rank got no conversation"
        assert sorted(a + b) == sorted(both), f"step {step}: the ranks together did not see the global batch"
    loss_diff, param_diff = _diffs(two, one_rank)
    print(f"float64, 2 ranks vs 1: max |dloss| {loss_diff:.1e}, max |dparam| {param_diff:.1e} (tolerance {TOL:.0e})")
    assert loss_diff <= TOL and param_diff <= TOL, (loss_diff, param_diff)
    assert one_rank.losses[-1] < one_rank.losses[0]


@needs_gloo
def test_negative_control_unsharded_ranks(tmp_path, one_rank):
    two, _ = _two_ranks(tmp_path, unsharded=True)
    loss_diff, _ = _diffs(two, one_rank)
    print(f"unsharded ranks: max |dloss| {loss_diff:.1e} = {loss_diff / TOL:.1e} x the tolerance")
    assert loss_diff > BUG, loss_diff
