"""The global stream and the step deal on their own (``_shard``), on random costs: one order
per (seed, epoch) whatever the world size; each step's rows dealt to every rank once, the
same count each, heaviest first, the same deal on every call, the same set for W = 1, 2, 4;
and the deal by cost no worse than the stream's own order cut into equal shares."""

from __future__ import annotations

import numpy as np
import pytest

from sftpack.balance import lower_bound, max_over_mean
from sftpack.offline._shard import deal_rows, epoch_order


@pytest.mark.parametrize("per_rank", [1, 2, 3])
def test_every_row_of_the_step_once_counts_equal_the_same_set_for_any_world(per_rank):
    rng = np.random.default_rng(per_rank)
    costs = rng.lognormal(7, 1, 300)
    order = epoch_order(300, epoch=2, seed=5, shuffle=True)
    step = 4 * per_rank  # a step's rows, over all ranks: the same for W = 1, 2 and 4
    for s in range(0, 300 - step + 1, step):
        rows = order[s : s + step]
        for world in (1, 2, 4):
            dealt = deal_rows(rows, costs, world)
            assert dealt.shape == (world, step // world)  # the same count on every rank
            assert sorted(dealt.ravel().tolist()) == sorted(rows.tolist())  # every row of the step once
            np.testing.assert_array_equal(dealt, deal_rows(rows.copy(), costs.copy(), world))  # deterministic
            if world > 1:
                assert all(np.all(np.diff(costs[line]) <= 0) for line in dealt)  # heaviest first
                by_cost = max_over_mean(costs[dealt].sum(axis=1))
                in_order = max_over_mean(costs[rows.reshape(world, -1)].sum(axis=1))
                assert lower_bound(costs[rows], world) - 1e-12 <= by_cost <= in_order + 1e-12
            else:
                np.testing.assert_array_equal(dealt[0], rows)  # one rank: the stream's order


def test_the_order_depends_on_seed_and_epoch_only():
    a = epoch_order(50, epoch=1, seed=3, shuffle=True)
    assert sorted(a.tolist()) == list(range(50))
    np.testing.assert_array_equal(a, epoch_order(50, epoch=1, seed=3, shuffle=True))
    assert not np.array_equal(a, epoch_order(50, epoch=2, seed=3, shuffle=True))
    assert not np.array_equal(a, epoch_order(50, epoch=1, seed=4, shuffle=True))
    assert epoch_order(50).tolist() == list(range(50))  # no shuffle: row order


def test_rows_that_do_not_split_evenly_are_refused():
    with pytest.raises(ValueError, match=r"5 rows cannot be dealt evenly to 2 rank\(s\)"):
        deal_rows(np.arange(5), np.ones(5), 2)
