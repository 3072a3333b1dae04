"""The one balancer: every item dealt once, the counts asked, never worse than LPT, near the bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftpack.balance import BalanceError, SequenceCost, assign, deal, lower_bound, max_over_mean


@given(
    costs=st.lists(st.integers(0, 10_000), min_size=1, max_size=80),
    ranks=st.integers(1, 9),
)
@settings(max_examples=120, deadline=None)
def test_assign_properties(costs, ranks):
    c = np.asarray(costs, dtype=np.float64)
    owner = assign(c, ranks)
    assert owner.shape == c.shape and owner.min() >= 0 and owner.max() < ranks
    loads = np.bincount(owner, weights=c, minlength=ranks)
    lpt = np.bincount(assign(c, ranks, refine=False), weights=c, minlength=ranks)
    assert loads.max() <= lpt.max()  # refining never raises the slowest rank
    # LPT's guarantee, kept by the refinement: the slowest rank is at most one item above the mean
    assert loads.max() <= loads.mean() + c.max() + 1e-9 * max(1.0, c.sum())  # 1e-9: float64 sums of <= 80 integers
    assert np.array_equal(owner, assign(c, ranks))  # deterministic


@given(per=st.integers(1, 6), ranks=st.integers(1, 8), seed=st.integers(0, 10_000))
@settings(max_examples=80, deadline=None)
def test_deal_gives_every_rank_the_same_count(per, ranks, seed):
    c = np.random.default_rng(seed).lognormal(0, 1, per * ranks)
    d = deal(c, ranks, per)
    assert d.shape == (ranks, per)
    assert sorted(d.ravel().tolist()) == list(range(per * ranks))
    assert all((np.diff(c[row]) <= 0).all() for row in d)  # heaviest first


def test_chat_lengths_land_within_a_hundredth_of_a_percent_of_the_bound():
    """16 sequences per rank, a 7B cost: the mean is reachable and the refinement reaches it."""
    cost = SequenceCost.named("7b")
    rng = np.random.default_rng(0)
    for ranks in (8, 64, 1024):
        lengths = np.clip(np.rint(rng.lognormal(np.log(900), 1.0, 16 * ranks)), 1, 16_384)
        c = cost(lengths)
        got = max_over_mean(np.bincount(assign(c, ranks), weights=c, minlength=ranks))
        assert got <= lower_bound(c, ranks) * 1.001, (ranks, got)


def test_bad_input_names_the_fix():
    with pytest.raises(BalanceError, match=r"costs\[1\] = -1.0"):
        assign([1, -1], 2)
    with pytest.raises(BalanceError, match="5 items cannot give 2 ranks 2 each"):
        assign([1, 2, 3, 4, 5], 2, per_rank=2)


@given(
    costs=st.lists(st.integers(0, 10_000), min_size=1, max_size=60),
    ranks=st.integers(1, 9),
    data=st.data(),
)
@settings(max_examples=120, deadline=None)
def test_assign_keeps_groups_whole(costs, ranks, data):
    n = len(costs)
    groups = data.draw(st.lists(st.integers(-3, n // 2), min_size=n, max_size=n))
    c = np.asarray(costs, dtype=np.float64)
    owner = assign(c, ranks, groups=groups)
    g = np.asarray(groups)
    for gid in np.unique(g):
        assert len(set(owner[g == gid].tolist())) == 1  # a group on one rank
    unit = {gid: c[g == gid].sum() for gid in np.unique(g).tolist()}
    loads = np.bincount(owner, weights=c, minlength=ranks)
    # LPT's guarantee over the groups: the slowest rank is at most one group above the mean
    assert loads.max() <= loads.mean() + max(unit.values()) + 1e-9 * max(1.0, c.sum())
    assert np.array_equal(owner, assign(c, ranks, groups=groups))  # deterministic


def test_assign_without_groups_is_unchanged():
    c = np.random.default_rng(5).lognormal(6.8, 0.8, 3000)
    plain = assign(c, 16)
    assert plain.tobytes() == assign(c, 16, groups=None).tobytes()
    assert plain.tobytes() == assign(c, 16, groups=np.arange(3000)[::-1]).tobytes()  # singleton groups: same deal


def test_assign_groups_errors_name_the_fix():
    with pytest.raises(BalanceError, match="groups has 2 entries but there are 3 sequences"):
        assign([1, 2, 3], 2, groups=[0, 1])
    with pytest.raises(BalanceError, match="per_rank=1 counts items"):
        assign([1, 2], 2, per_rank=1, groups=[0, 0])
