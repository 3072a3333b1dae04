"""Groups that no row splits: ``pack(..., groups=)`` on every algorithm, and :class:`Groups`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack.binpack import Algorithm, Groups, pack

ALGORITHMS = list(Algorithm)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_groups_numbered_by_first_appearance():
    g = Groups.of([-4, 9, -4, 2, 9, 9])
    assert g.unit.tolist() == [0, 1, 0, 2, 1, 1]
    assert g.ids.tolist() == [-4, 9, 2]
    assert g.sizes.tolist() == [2, 3, 1]
    assert g.items([1, 2, 0]).tolist() == [1, 4, 5, 3, 0, 2]
    assert g.sum(np.arange(6)).tolist() == [2, 10, 3]
    assert "group 9 (3 sequences: [1, 4, 5])" == g.describe(1)
    assert len(Groups.of([])) == 0 and Groups.of([]).items([]).tolist() == []


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_worked_example_every_algorithm(algorithm):
    lengths = [5, 10, 3, 8, 6, 2]
    groups = [0, 1, 0, 1, 2, 2]  # 0: 5 + 3 = 8, 1: 10 + 8 = 18 > 16 -> an error; so capacity 20
    bins = pack(lengths, 20, algorithm, groups=groups)
    rows = bins.to_lists()
    assert sorted(i for r in rows for i in r) == list(range(6))
    for r in rows:
        assert sum(lengths[i] for i in r) <= 20
        for a, b in ((0, 2), (1, 3), (4, 5)):
            assert (a in r) == (b in r)  # a group is whole in its row
        for a, b in ((0, 2), (1, 3), (4, 5)):
            if a in r:
                assert r.index(a) + 1 == r.index(b)  # members next to each other, in input order


def test_without_groups_the_rows_are_unchanged():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 900, 5000)
    for algorithm in ALGORITHMS:
        plain = pack(lengths, 4096, algorithm, cost_multiple=8, max_items_per_bin=6, bins_multiple_of=4, seed=2)
        none = pack(
            lengths, 4096, algorithm, cost_multiple=8, max_items_per_bin=6, bins_multiple_of=4, seed=2, groups=None
        )
        assert plain.order.tobytes() == none.order.tobytes()
        assert plain.offsets.tobytes() == none.offsets.tobytes()
        # singleton groups are the same problem: the same rows, byte for byte
        alone = pack(
            lengths,
            4096,
            algorithm,
            cost_multiple=8,
            max_items_per_bin=6,
            bins_multiple_of=4,
            seed=2,
            groups=np.arange(5000) * 7 - 100,
        )
        assert plain.order.tobytes() == alone.order.tobytes(), algorithm
        assert plain.offsets.tobytes() == alone.offsets.tobytes(), algorithm


@st.composite
def grouped_problems(draw):
    n = draw(st.integers(0, 30))
    lengths = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, max(n // 2, 1)), min_size=n, max_size=n))
    weights = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    return lengths, groups, weights


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(
    problem=grouped_problems(),
    m=st.sampled_from([1, 3]),
    max_items=st.none() | st.integers(1, 8),
    min_bins=st.none() | st.integers(0, 6),
    multiple_of=st.none() | st.integers(1, 4),
    weight_cap=st.none() | st.integers(6, 20),
    seed=st.integers(0, 2**32),
)
def test_properties(algorithm, problem, m, max_items, min_bins, multiple_of, weight_cap, seed):
    lengths, groups, weights = problem
    cap = 60
    g = Groups.of(groups, len(lengths))
    cost = np.array([-(-x // m) * m for x in lengths], dtype=np.int64)
    w = np.array(weights, dtype=np.int64)
    kw = dict(cost_multiple=m, max_items_per_bin=max_items, min_bins=min_bins, bins_multiple_of=multiple_of)
    kw |= dict(seed=seed, weights=weights, max_weight_per_bin=weight_cap, groups=groups)
    try:
        bins = pack(lengths, cap, algorithm, **kw)
    except ValueError as e:
        msg = str(e)
        if "never split" in msg and "costs" in msg:
            assert (g.sum(cost) > cap).any()
        elif "never split" in msg and "weighs" in msg:
            assert weight_cap is not None and (g.sum(w) > weight_cap).any()
        elif "never split" in msg and "holds" in msg:
            assert max_items is not None and g.sizes.max() > max_items
        else:  # more rows asked for than there are groups
            assert "groups (a group is never split over rows)" in msg, msg
            assert (min_bins or 0) > len(g) or (multiple_of or 1) > 1
        return
    bins.check(
        lengths, cap, cost_multiple=m, max_items_per_bin=max_items, weights=weights, max_weight_per_bin=weight_cap
    )
    row = bins.bin_index()
    for u in range(len(g)):
        members = g.items([u])
        assert len(set(row[members].tolist())) == 1  # the whole group in one row
    for r in bins:  # each row: whole groups, each's members together and in input order
        units = g.unit[r]
        starts = np.flatnonzero(np.diff(units, prepend=-1))
        assert len(set(units[starts].tolist())) == starts.size
        for s, e in zip(starts, [*starts[1:], units.size]):
            assert np.all(np.diff(r[s:e]) > 0)
    rows = len(bins)
    assert rows >= (min_bins or 0)
    assert rows % (multiple_of or 1) == 0
    again = pack(lengths, cap, algorithm, **kw)
    assert again == bins


def test_a_group_over_the_capacity_is_named():
    with pytest.raises(
        ValueError,
        match=r"group 7 \(2 sequences: \[1, 2\]\) costs 16 tokens .*multiple of 4.*"
        r"never split.*raise the capacity to at least 16",
    ):
        pack([4, 5, 6, 1], 12, groups=[3, 7, 7, 3], cost_multiple=4)
    with pytest.raises(ValueError, match=r"group 1 \(1 sequence: \[0\]\) costs 2\*\*40|costs 1099511627776"):
        pack([2**40, 1], 100, groups=[1, 2])
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0"):
        pack([3, 0], 100, groups=[1, 1])


def test_group_option_errors():
    with pytest.raises(ValueError, match="groups has 2 entries but there are 3 sequences"):
        pack([1, 2, 3], 10, groups=[0, 1])
    with pytest.raises(TypeError, match=r"groups\[1\] = 1.5"):
        pack([1, 2], 10, groups=[0, 1.5])
    with pytest.raises(ValueError, match=r"group 0 \(3 sequences.*max_items_per_bin=2.*at least 3"):
        pack([1, 1, 1], 10, groups=[0, 0, 0], max_items_per_bin=2)
    with pytest.raises(ValueError, match=r"group 5 .* weighs 7 in all, more than max_weight_per_bin=6"):
        pack([1, 1, 1], 10, groups=[4, 5, 5], weights=[1, 3, 4], max_weight_per_bin=6)
    with pytest.raises(ValueError, match=r"4 rows are required .* only 2 groups \(a group is never split"):
        pack([1, 1, 1, 1], 10, groups=[0, 0, 1, 1], bins_multiple_of=4)
    with pytest.raises(ValueError, match=r"min_bins=3 rows need at least 3 groups"):
        pack([1, 1, 1, 1], 10, groups=[0, 0, 1, 1], min_bins=3)


def test_row_splits_fall_between_groups():
    bins = pack([1] * 8, 100, groups=[0, 0, 1, 1, 2, 2, 3, 3], bins_multiple_of=4)
    assert bins.to_lists() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_items_per_row_count_members():
    # pairs: at most 2 pairs a row under max_items_per_bin=5
    bins = pack([1] * 12, 100, groups=np.arange(12) // 2, max_items_per_bin=5)
    assert bins.sizes.tolist() == [4, 4, 4]
    # mixed sizes: the members counted as a second budget (groups of 3 and 1 fill rows of 4)
    bins = pack([1] * 8, 100, groups=[0, 0, 0, 1, 1, 1, 2, 3], max_items_per_bin=4)
    assert bins.sizes.tolist() == [4, 4]
    # mixed sizes with a weight cap too: still within the member count
    bins = pack(
        [1] * 8, 100, groups=[0, 0, 0, 1, 1, 1, 2, 3], max_items_per_bin=4, weights=[1] * 8, max_weight_per_bin=8
    )
    assert bins.sizes.max() <= 4


def test_pairs_keep_rows_near_the_bound():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(900), 0.8, 4000).astype(np.int64), 1, 4096 // 2)
    pairs = np.arange(4000) // 2
    free, whole = pack(lengths, 4096), pack(lengths, 4096, groups=pairs)
    assert len(whole) >= len(free)
    assert len(whole) <= len(free) * 1.02  # whole pairs cost at most 2% more rows here
