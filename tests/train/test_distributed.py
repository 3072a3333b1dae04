"""Data parallelism on torch.distributed: two real processes (gloo on CPU, DDP)
train on the trainer path's own sharding of each global batch (token-budget
micro-batches dealt evenly to the ranks); after 8 steps their parameters equal
those of one process training on the same global batches, within fp32 noise.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sftpack.train import make_source, train

from ._tiny import tiny_config, tiny_model, tiny_samples

WORLD = 2
STEPS = 8
TOL = 1e-5  # the 1-rank-vs-2-rank difference is summation order only: measured 1e-7 .. 1e-6


def _config():
    return tiny_config(packing="trainer", steps=STEPS, batch_size=8, pad_multiple=2)


def _worker(rank: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=90),
    )
    try:
        cfg = _config()
        result = train(
            cfg,
            source=make_source(cfg, samples=tiny_samples(), rank=rank, world=WORLD),
            model=tiny_model(),
        )
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
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)
def test_two_ranks_train_like_one(tmp_path, samples):
    # The 1-rank run first: it also loads transformers and compiles the packer, which
    # the forked ranks then inherit instead of redoing (about 10 s each on 2 cores).
    cfg = _config()
    one = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model())

    out = str(tmp_path / "rank0.pt")
    ctx = mp.start_processes(
        _worker,
        args=(str(tmp_path / "init"), out),
        nprocs=WORLD,
        join=False,
        start_method="fork",
    )
    deadline = (
        time.monotonic() + 240
    )  # a collective that waits forever must fail the test, not hang it
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    os.kill(p.pid, 9)
            pytest.fail("the 2-rank run did not finish in 240 s")
    two = torch.load(out)
    other = torch.load(out + ".1")
    for step, (a, b, both) in enumerate(
        zip(two["conversations"], other["conversations"], one.conversations)
    ):
        assert a and b, f"step {step}: a rank got no conversation"
        assert sorted(a + b) == sorted(both), (
            f"step {step}: the ranks together did not see the global batch"
        )
    loss_diff = max(abs(x - y) for x, y in zip(two["losses"], one.losses))
    param_diff = max(
        float((p - q.detach()).abs().max())
        for p, q in zip(two["params"], one.model.parameters())
    )
    print(f"2 ranks vs 1: max |dloss| {loss_diff:.1e}, max |dparam| {param_diff:.1e}")
    assert loss_diff <= TOL and param_diff <= TOL, (loss_diff, param_diff)
    assert one.losses[-1] < one.losses[0]
