"""The offline path's one global stream: each step trains on the same rows whatever the number of
ranks (dealt to the ranks by cost), and its data position is the same at 1 and 2 ranks, so a run
continues at another world size with exactly the rows it would have read next.

Two real processes (gloo on CPU, DDP) train 8 float64 steps of a prepack through
``make_source`` + ``train`` (what ``sftpack train --packing offline`` runs), 2 rows per rank in
2 micro-batches, across an epoch boundary; their losses and parameters equal those of one
process on the same prepack to TOL = 1e-10. Derivation (tests/loop/test_distributed.py's, from
tests/loop/test_equality.py): both runs compute the same function of the same rows per step
(asserted: the two ranks' conversations of each step are the one rank's), in another summation
order. Each rank sums its micro-batches' token losses over the step's *global* target count, DDP
all-reduces the gradients (a sum of 2 terms, one rounding) and divides by the world size (2: exact),
undone by the loss module's average over ranks (exact). One step is off by at most the rounding
chain of test_equality.py (n <= 4,000 in float64, 2 * n * u = 8.9e-13 relative, on a loss of
about 4.6 and gradients <= 10: <= 8.9e-12) plus the all-reduce's rounding; AdamW's lr/eps
amplification over 8 steps stays a factor 2,000 below 1e-10 (test_equality.py's bound for 20).
1e-10 is 11x the per-step bound. A row dealt to the wrong rank, read twice or skipped is not
rounding: it changes the step's conversations, which are compared exactly.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sftpack.loop import make_source, train
from sftpack.offline import prepack_samples
from tests.helpers import tiny_config, tiny_model, tiny_samples
from tests.loop.conftest import run_ranks

WORLD = 2
STEPS = 8
TOL = 1e-10  # float64: the same computation in another summation order; see the docstring


def _config(**kw):
    return tiny_config(packing="offline", steps=STEPS, batch_size=4, grad_accum=2, **kw)


@pytest.fixture(scope="module")
def prepacked(tmp_path_factory):
    return prepack_samples(tiny_samples(), tmp_path_factory.mktemp("stream") / "rows", max_seq_len=128).path


def _worker(rank: int, init_file: str, out_file: str, prepacked: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        cfg = _config()
        source = make_source(cfg, prepacked=prepacked, rank=rank, world=WORLD)
        result = train(cfg, source=source, model=tiny_model(dtype=torch.float64))
        torch.save(
            {
                "params": [p.detach() for p in result.model.parameters()],
                "losses": result.losses,
                "conversations": result.conversations,
                "state": source.state_dict(),
            },
            f"{out_file}.{rank}",
        )
        dist.barrier()  # both ranks done before either tears gloo down (see test_distributed.py)
    finally:
        dist.destroy_process_group()


needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


@needs_gloo
def test_two_ranks_train_the_offline_stream_like_one(prepacked, tmp_path):
    cfg = _config()
    one_source = make_source(cfg, prepacked=prepacked)
    assert one_source.epoch_steps() < STEPS  # the run crosses an epoch boundary
    one = train(cfg, source=one_source, model=tiny_model(dtype=torch.float64))  # first: the ranks inherit its imports
    out = str(tmp_path / "rank")
    run_ranks(_worker, (str(tmp_path / "init"), out, str(prepacked)), WORLD)
    a, b = torch.load(out + ".0"), torch.load(out + ".1")
    for step, (x, y, both) in enumerate(zip(a["conversations"], b["conversations"], one.conversations)):
        assert x and y, f"step {step}: a rank got no row"
        assert sorted(x + y) == sorted(both), f"step {step}: the ranks together did not read the 1-rank step's rows"
    assert a["state"] == b["state"] == one_source.state_dict()  # one position for every rank and world size
    loss_diff = max(abs(x - y) for x, y in zip(a["losses"], one.losses))
    param_diff = max(float((p - q.detach()).abs().max()) for p, q in zip(a["params"], one.model.parameters()))
    print(f"float64, 2 ranks vs 1: max |dloss| {loss_diff:.1e}, max |dparam| {param_diff:.1e} (tolerance {TOL:.0e})")
    assert loss_diff <= TOL and param_diff <= TOL, (loss_diff, param_diff)
    assert one.losses[-1] < one.losses[0]


def _ids(batches) -> list:
    return sorted(c for b in batches for c in b.sequence_ids)


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_a_position_saved_at_one_world_size_continues_the_stream_at_another(prepacked, before, after):
    """The sources of every rank, in one process (no collective is needed to read rows): after 5
    steps (an epoch boundary crossed) at ``before`` ranks, the saved state is the 1-rank run's, and
    ``after`` ranks loaded with it read together exactly the rows the 1-rank run reads next."""
    cfg = tiny_config(packing="offline", batch_size=4)

    def sources(world):
        return [make_source(cfg, prepacked=prepacked, rank=r, world=world) for r in range(world)]

    one = sources(1)[0]
    reference = [_ids(one.next_step()) for _ in range(8)]
    old = sources(before)
    for step in range(5):
        assert _ids(mb for s in old for mb in s.next_step()) == reference[step]
    states = [s.state_dict() for s in old]
    assert all(st == states[0] for st in states) and states[0]["epoch"] == 1
    new = sources(after)
    for s in new:
        s.load_state_dict(states[0])
    for step in range(5, 8):
        got = [s.next_step() for s in new]
        assert all(len(g) == 1 for g in got)  # each rank its one micro-batch of batch_size / after rows
        assert _ids(mb for g in got for mb in g) == reference[step], step


def test_an_old_or_foreign_position_is_refused(prepacked):
    src = make_source(tiny_config(packing="offline", batch_size=4), prepacked=prepacked)
    with pytest.raises(ValueError, match="each rank's own shard.*start a fresh --checkpoint-dir"):
        src.load_state_dict({"epoch": 0, "position": 3})
    with pytest.raises(ValueError, match="not a whole number of steps of batch_size=4"):
        src.load_state_dict({"epoch": 0, "rows": 6})


def test_the_step_deal_is_balanced_by_the_dataset_cost(prepacked):
    """Rank 0's and rank 1's rows of each step: every row of the step once, 2 each, and the heavier
    rank no heavier than the stream's order cut in two would make it."""
    from sftpack.offline import PrepackedDataset

    ds = PrepackedDataset(prepacked, shuffle=True, seed=0, world_size=2, cost="attention")
    costs = ds.row_costs()
    for start in range(0, ds.num_rows - 3, 4):
        dealt = ds.step_rows(start, 4)
        rows = ds.epoch_order()[start : start + 4]
        assert sorted(dealt.ravel().tolist()) == sorted(rows.tolist())
        assert costs[dealt].sum(axis=1).max() <= costs[rows.reshape(2, 2)].sum(axis=1).max()
        assert np.all(costs[dealt][:, 0] >= costs[dealt][:, 1])
