"""The loader path as one global stream (issue 41, items 2 and 4): every step trains on the rows one
process packs, whatever the world size, dealt to the ranks by cost; its state is the same on every
rank and at every world size, so a run saved at N ranks continues at M.

``sftpack train --packing loader`` used to give each rank its own share of the samples to pack, so
a step's rows depended on the world size (2 ranks logged other losses than 1 from step 3 on text).
Now every rank runs the packer's decisions over the same seeded global order and lays only the rows
dealt to it (:func:`sftpack.balance.deal`, by a :class:`~sftpack.balance.SequenceCost` of each row's
sequence lengths).

Tolerance of the 2-rank run against 1 rank, float64: a fixed 1e-10, the derivation of
tests/loop/test_distributed.py (itself tests/loop/test_equality.py's): both runs compute the same
function of the same rows per step in another summation order (each rank sums its rows' token losses
over the global target count; DDP sums the two ranks' gradients, one rounding, and divides by 2,
exact). One step's loss moves by at most 1.5e-11 and AdamW's amplified rounding stays near 4.5e-14
after the steps; 8 steps here instead of 20 only shrink the bound. The negative control is the old
rule (each rank its own share): its steps hold other rows, so other label counts, not rounding.
"""

from __future__ import annotations

from datetime import timedelta
from itertools import islice

import pytest
import torch
import torch.distributed as dist

from sftpack.balance import CostError, SequenceCost, deal, sequence_cost
from sftpack.loader import PackingDataset
from sftpack.loop import make_source, train
from tests.helpers import tiny_config, tiny_model, tiny_samples
from tests.loop.conftest import run_ranks

STEPS = 8
TOL = 1e-10  # float64: tests/loop/test_distributed.py's bound; see the docstring


def _config(**kw):
    return tiny_config(packing="loader", steps=STEPS, batch_size=4, buffer_size=16, pad_multiple=2, **kw)


def _sources(world: int, samples, **kw):
    return [make_source(_config(**kw), samples=samples, rank=r, world=world) for r in range(world)]


def _steps(sources, n: int) -> list[list[list[tuple]]]:
    """``[step][rank]``: the ``sequence_ids`` of each row a rank lays, ``n`` steps."""
    out = []
    for _ in range(n):
        per_rank = [s.step_rows() for s in sources]
        out.append([[row.sequence_ids for row in p[r]] for r, p in enumerate(per_rank)])
    return out


def _row_sets(steps) -> list[list[tuple]]:
    """Per step, the rows of all ranks together, sorted."""
    return [sorted(row for rank in step for row in rank) for step in steps]


def test_every_world_size_trains_the_same_rows_per_step(samples):
    one = _steps(_sources(1, samples), 12)
    for world in (2, 4):
        steps = _steps(_sources(world, samples), 12)
        assert _row_sets(steps) == _row_sets(one), f"world {world}: another row set in some step"
        for step in steps:
            assert [len(rank) for rank in step] == [4 // world] * world  # B/W rows each, none twice
    assert sum(len(row) for step in one for row in step[0]) > len(samples)  # past the first epoch


def test_each_rank_lays_the_rows_the_deal_gives_it(samples):
    """Each step's rows, in the 1-rank stream's order, dealt by :func:`sftpack.balance.deal` of their
    cost (every rank deciding the same deal), and each rank lays exactly its own (``next_step``)."""
    for cost in (SequenceCost.tokens(), SequenceCost.attention()):
        deciding, laying = _sources(2, samples), _sources(2, samples)
        for s in deciding + laying:
            s.cost = cost
        stream = make_source(_config(), samples=samples).ds.decided_rows()  # the global rows, in order
        for _ in range(6):
            rows = list(islice(stream, 4))
            sizes = [len(r.lengths) for r in rows]
            lengths = [n for r in rows for n in r.lengths.tolist()]
            offsets = [sum(sizes[:i]) for i in range(5)]
            expected = deal(cost.of_groups(lengths, offsets), 2, 2)
            dealt = [s.step_rows() for s in deciding]
            for r in range(2):
                ids = [rows[i].sequence_ids for i in expected[r].tolist()]
                assert [x.sequence_ids for x in dealt[0][r]] == [x.sequence_ids for x in dealt[1][r]] == ids
                (laid,) = laying[r].next_step()  # grad_accum=1: its two rows laid end to end
                assert laid.sequence_ids == tuple(i for row in ids for i in row)
                assert laid.input_ids.shape[0] == 2 * 128


def test_the_state_is_world_size_independent_and_resumes_on_another(samples):
    straight = _steps(_sources(1, samples), 10)
    for saved_at, resumed_at in ((2, 1), (1, 2), (2, 4)):
        first = _sources(saved_at, samples)
        _steps(first, 4)
        states = [s.state_dict() for s in first]
        assert all(st == states[0] for st in states)  # every rank holds the same position
        assert states[0]["rows"] == 4 * 4 and states[0]["loader"]["world_size"] == 1
        other = _sources(resumed_at, samples)
        for s in other:
            s.load_state_dict(states[0])
        assert _row_sets(_steps(other, 6)) == _row_sets(straight[4:]), (saved_at, resumed_at)
    # the same position at any world size, rank for rank
    by_world = {}
    for world in (1, 2, 4):
        srcs = _sources(world, samples)
        _steps(srcs, 3)
        by_world[world] = srcs[-1].state_dict()
    assert by_world[1] == by_world[2] == by_world[4]


def test_a_state_that_is_not_a_whole_number_of_steps_is_refused(samples):
    src = _sources(2, samples)[0]
    src.step_rows()
    state = src.state_dict()
    for bad in ({**state, "rows": 6}, {"loader": state["loader"]}):
        with pytest.raises(ValueError, match=r"not a whole number of steps of batch_size=4 global rows"):
            _sources(2, samples)[1].load_state_dict(bad)


def test_the_cost_option(samples):
    cfg = _config()
    src = make_source(cfg, samples=samples)
    assert src.cost == SequenceCost.tokens() and src.elastic
    from sftpack.loop._source_loader import LoaderSource

    for spelling in ("attention", "7b", SequenceCost(1.0, 0.5)):
        other = LoaderSource(src.ds, batch_size=4, samples_fp="x", cost=spelling)
        assert other.cost == sequence_cost(spelling)
        # the cost deals the step's rows, never chooses them: a checkpoint resumes under another
        assert other.fingerprint() == LoaderSource(src.ds, batch_size=4, samples_fp="x").fingerprint()
    with pytest.raises(CostError, match="not 'tokens', 'attention'"):
        LoaderSource(src.ds, batch_size=4, samples_fp="x", cost="quadratic")
    shared = PackingDataset(samples, max_seq_len=128, buffer_size=16, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"build it with rank=0, world_size=1 on every rank"):
        LoaderSource(shared, batch_size=4, samples_fp="x", rank=1, world=2)


def test_negative_control_per_rank_shares_train_other_rows(samples):
    """The old rule, each rank packing its own share (``PackingDataset(rank=r, world_size=2)``), takes
    other rows in some of the first steps: what the 2-rank training test below would catch."""
    cfg = _config()
    kw = dict(shuffle=True, num_epochs=None, max_seq_len=cfg.max_seq_len, buffer_size=cfg.buffer_size)
    kw.update(pad_multiple=cfg.pad_multiple, seed=cfg.seed)
    shares = [iter(PackingDataset(samples, rank=r, world_size=2, **kw)) for r in range(2)]
    old = [sorted(row.sequence_ids for sh in shares for row in islice(sh, 2)) for _ in range(STEPS)]
    new = _row_sets(_steps(_sources(2, samples), STEPS))
    assert old != new


# ------------------------------------------------------------------ 2 gloo ranks against 1


def _worker(rank: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=300)
    )
    try:
        cfg = _config()
        result = train(
            cfg,
            source=make_source(cfg, samples=tiny_samples(), rank=rank, world=2),
            model=tiny_model(dtype=torch.float64),
        )
        torch.save(
            {
                "params": [p.detach() for p in result.model.parameters()],
                "losses": result.losses,
                "label_tokens": [r.label_tokens for r in result.logs],
                "conversations": result.conversations,
            },
            f"{out_file}.{rank}",
        )
        dist.barrier()  # both ranks done before either tears gloo down
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_gloo_ranks_train_like_one_on_the_loader_path(samples, tmp_path):
    cfg = _config()
    one = train(
        cfg, source=make_source(cfg, samples=samples), model=tiny_model(dtype=torch.float64)
    )  # first: the ranks inherit its imports
    out = str(tmp_path / "rank")
    run_ranks(_worker, (str(tmp_path / "init"), out), 2)
    a, b = torch.load(out + ".0"), torch.load(out + ".1")
    for step, (x, y, both) in enumerate(zip(a["conversations"], b["conversations"], one.conversations)):
        assert x and y, f"step {step}: a rank got no row"
        assert sorted(x + y) == sorted(both), f"step {step}: the ranks together did not train the 1-rank rows"
    assert a["label_tokens"] == b["label_tokens"] == [r.label_tokens for r in one.logs]  # global counts
    loss_diff = max(abs(x - y) for x, y in zip(a["losses"], one.losses))
    param_diff = max(float((p - q.detach()).abs().max()) for p, q in zip(a["params"], one.model.parameters()))
    print(f"loader path, float64, 2 ranks vs 1: max |dloss| {loss_diff:.1e}, max |dparam| {param_diff:.1e}")
    assert loss_diff <= TOL and param_diff <= TOL, (loss_diff, param_diff)
    assert one.losses[-1] < one.losses[0]
