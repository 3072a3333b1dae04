"""The epoch deal on its own (``_shard``), on random costs: every row once per epoch,
row counts within one, totals within the bound the module promises, and the order a
function of (seed, epoch) only."""

from __future__ import annotations

import numpy as np
import pytest

from sftpack.offline._shard import epoch_rows


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("rows", [0, 1, 7, 40, 101])
def test_every_row_once_counts_within_one_totals_within_the_bound(world, rows):
    rng = np.random.default_rng(rows * 10 + world)
    costs = rng.integers(1, 1000, rows)
    for shuffle in (False, True):
        shards = [epoch_rows(costs, epoch=2, seed=5, shuffle=shuffle, rank=r, world_size=world) for r in range(world)]
        assert sorted(np.concatenate(shards).tolist()) == list(range(rows))
        sizes = [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 1
        if rows:
            totals = [int(costs[s].sum()) for s in shards]
            # full rounds: within max-min of the costs; a partial last round adds at most one row
            bound = int(costs.max() - costs.min()) + (int(costs.max()) if rows % world else 0)
            assert max(totals) - min(totals) <= bound
        if not shuffle:
            assert all(np.all(np.diff(s) > 0) for s in shards)  # row order without shuffle


def test_the_order_depends_on_seed_and_epoch_only():
    costs = np.arange(50)
    a = epoch_rows(costs, epoch=1, seed=3, shuffle=True, rank=1, world_size=2)
    np.testing.assert_array_equal(a, epoch_rows(costs, epoch=1, seed=3, shuffle=True, rank=1, world_size=2))
    assert not np.array_equal(a, epoch_rows(costs, epoch=2, seed=3, shuffle=True, rank=1, world_size=2))
    assert not np.array_equal(a, epoch_rows(costs, epoch=1, seed=4, shuffle=True, rank=1, world_size=2))
    assert epoch_rows(costs).tolist() == list(range(50))  # one rank, no shuffle: row order


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match=r"rank=2 is outside 0..1 \(world_size=2\)"):
        epoch_rows(np.ones(4), rank=2, world_size=2)
