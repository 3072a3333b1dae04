"""Tests of sftpack.binpack: hand-packed examples, then properties and references.

Every reference packer below is the plain item-by-item textbook algorithm,
written here independently of the histogram-driven kernels it checks.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack.binpack import (
    Algorithm,
    Bins,
    LowerBounds,
    lower_bounds,
    pack,
    pack_histogram,
    packing_stats,
)

ALGORITHMS = list(Algorithm)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def costs_of(lengths, m=1):
    return [-(-x // m) * m for x in lengths]


def bin_costs(bins, lengths, m=1):
    """Each bin as its sorted tuple of costs (what BFD's bins are, up to ties)."""
    c = costs_of(list(lengths), m)
    return [tuple(sorted(c[i] for i in row)) for row in bins]


# ----------------------------------------------------------------------------
# references


def ref_bfd(lengths, capacity, m=1):
    """Item-by-item best-fit decreasing: longest first, into the bin left tightest."""
    c = costs_of(lengths, m)
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # sorted (room, bin)
    for i in sorted(range(len(c)), key=lambda i: -c[i]):
        k = bisect.bisect_left(rooms, (c[i], -1))
        if k == len(rooms):
            bins.append([])
            b, room = len(bins) - 1, capacity
        else:
            room, b = rooms.pop(k)
        bins[b].append(i)
        bisect.insort(rooms, (room - c[i], b))
    return bins


def ref_first_fit(lengths, capacity, visit, m=1, max_items=None):
    c = costs_of(lengths, m)
    bins: list[list[int]] = []
    rooms: list[int] = []
    for i in visit:
        for b, room in enumerate(rooms):
            if room >= c[i] and (max_items is None or len(bins[b]) < max_items):
                break
        else:
            bins.append([])
            rooms.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        rooms[b] -= c[i]
    return bins


def ref_ffd(lengths, capacity, m=1, max_items=None):
    c = costs_of(lengths, m)
    visit = sorted(range(len(c)), key=lambda i: -c[i])
    return ref_first_fit(lengths, capacity, visit, m, max_items)


def ref_next_fit(lengths, capacity, m=1, max_items=None):
    bins: list[list[int]] = []
    load = 0
    for i, x in enumerate(costs_of(lengths, m)):
        if not bins or load + x > capacity or (max_items is not None and len(bins[-1]) == max_items):
            bins.append([])
            load = 0
        bins[-1].append(i)
        load += x
    return bins


def optimum(costs, capacity):
    """The fewest bins, by exhaustive search (tiny inputs only)."""
    items = sorted(costs, reverse=True)
    best = len(items)

    def place(k, rooms):
        nonlocal best
        if len(rooms) >= best:
            return
        if k == len(items):
            best = len(rooms)
            return
        tried = set()
        for j, room in enumerate(rooms):
            if room >= items[k] and room not in tried:
                tried.add(room)
                rooms[j] -= items[k]
                place(k + 1, rooms)
                rooms[j] += items[k]
        place(k + 1, [*rooms, capacity - items[k]])

    place(0, [])
    return best


@st.composite
def problems(draw, max_n=40, max_capacity=64):
    """(lengths, capacity, cost_multiple) with every cost within the capacity."""
    m = draw(st.integers(1, 4))
    capacity = draw(st.integers(m, max_capacity))
    top = capacity // m * m
    lengths = draw(st.lists(st.integers(1, top), max_size=max_n))
    return lengths, capacity, m


# ----------------------------------------------------------------------------
# worked examples, packed by hand


def test_bfd_worked_example():
    # sorted: 10 (item 1), 8 (3), 6 (4), 5 (0), 3 (2). 10 opens bin 0 (room 6);
    # 8 fits nowhere, opens bin 1 (room 8); 6: rooms 6 and 8 fit, 6 is tighter;
    # 5 and 3 fill bin 1.
    bins = pack([5, 10, 3, 8, 6], 16)
    assert bins.to_lists() == [[1, 4], [3, 0, 2]]
    assert bins.order.tolist() == [1, 4, 3, 0, 2]
    assert bins.offsets.tolist() == [0, 2, 5]
    assert bins.loads([5, 10, 3, 8, 6]).tolist() == [16, 16]


def test_best_fit_and_first_fit_differ():
    # capacity 7; items 3 (0), 5 (1), 1 (2), 3 (3); sorted 5, 3, 3, 1.
    # 5 opens bin 0 (room 2); 3 fits nowhere, opens bin 1 (room 4); 3 -> bin 1 (room 1).
    # 1: first fit takes bin 0 (room 2); best fit takes bin 1 (room 1, tighter).
    lengths = [3, 5, 1, 3]
    assert pack(lengths, 7, "ffd").to_lists() == [[1, 2], [0, 3]]
    assert pack(lengths, 7, "greedy_knapsack").to_lists() == [[1, 2], [0, 3]]
    assert pack(lengths, 7, "bfd").to_lists() == [[1], [0, 3, 2]]


def test_next_fit_keeps_the_input_order():
    # capacity 10: 4+5 = 9 fits, 4+5+3 = 12 does not; 3+6 = 9; 2 alone after 9.
    bins = pack([4, 5, 3, 6, 2], 10, "next_fit")
    assert bins.to_lists() == [[0, 1], [2, 3], [4]]
    assert bins.order.tolist() == [0, 1, 2, 3, 4]


def test_cost_multiple_rounds_each_sequence_up():
    # capacity 8, multiple 4: lengths 5, 3, 2 cost 8, 4, 4 -> [5] and [3, 2];
    # without rounding, 5 + 3 = 8 and 2 would share one row of two.
    assert pack([5, 3, 2], 8).to_lists() == [[0, 1], [2]]
    bins = pack([5, 3, 2], 8, cost_multiple=4)
    assert bins.to_lists() == [[0], [1, 2]]
    assert bins.loads([5, 3, 2], cost_multiple=4).tolist() == [8, 8]
    assert bins.loads([5, 3, 2]).tolist() == [5, 5]


def test_max_items_per_bin():
    assert pack([1] * 5, 10, max_items_per_bin=2).to_lists() == [[0, 1], [2, 3], [4]]
    assert pack([1] * 5, 10, "next_fit", max_items_per_bin=2).to_lists() == [[0, 1], [2, 3], [4]]


def test_min_bins_splits_the_fullest_rows():
    # one row [0, 1, 2, 3] (4 x 2 tokens = 8); three rows wanted: pieces of 1, 1, 2.
    assert pack([2, 2, 2, 2], 8).to_lists() == [[0, 1, 2, 3]]
    assert pack([2, 2, 2, 2], 8, min_bins=3).to_lists() == [[0], [1], [2, 3]]
    # rows [5, 3] and [6, 2] (capacity 8); a multiple of 4 rows: each split in two.
    bins = pack([5, 3, 6, 2], 8, bins_multiple_of=4)
    assert len(bins) == 4 and all(len(row) == 1 for row in bins)
    assert len(pack([5, 3, 6, 2], 8, bins_multiple_of=2)) == 2  # already a multiple
    # a row of 5 cut in two: pieces start at floor(i * 5 / 2) = 0, 2; next_fit keeps the order
    assert pack([1, 1, 1, 1, 1], 10, "next_fit", min_bins=2).to_lists() == [[0, 1], [2, 3, 4]]


def test_lower_bounds_by_hand():
    # L1 = ceil(24 / 10) = 3; the three 6s need a row each, the 2s fill their rooms: L2 = 3.
    assert lower_bounds([6, 6, 6, 2, 2, 2], 10) == LowerBounds(3, 3)
    # L1 = ceil(18 / 10) = 2, but no two 6s share a row of 10: L2 = 3.
    assert lower_bounds([6, 6, 6], 10) == LowerBounds(2, 3)
    # a = 3: the 8 (> 7) owns a row whose room 2 no item >= 3 fits; the 6 (in (5, 7])
    # owns a row with room 4; the 3s (in [3, 5], 6 tokens) overflow it by 2: one more
    # row. L2 = 1 + 1 + ceil((6 - 4) / 10) = 3 while L1 = ceil(20 / 10) = 2 (and 3 is optimal).
    assert lower_bounds([8, 6, 3, 3], 10) == LowerBounds(2, 3)
    # a = 4: 8 and 7 (> 6) own rows whose rooms (2, 3) fit no item >= 4; 5 and 4
    # need ceil(9 / 10) = 1 more row: L2 = 3 = L1.
    assert lower_bounds([8, 7, 5, 4], 10) == LowerBounds(3, 3)
    # the histogram form agrees; costs round up with cost_multiple
    assert lower_bounds([6, 2], 10, counts=[3, 3]) == LowerBounds(3, 3)
    assert lower_bounds([5, 5], 10, cost_multiple=4) == LowerBounds(2, 2)  # two rows of 8 of 8
    assert lower_bounds([], 10) == LowerBounds(0, 0)


def test_packing_stats_by_hand():
    lengths = [5, 10, 3, 8, 6]
    stats = packing_stats(lengths, pack(lengths, 16), 16)
    assert (stats.rows, stats.sequences, stats.tokens) == (2, 5, 32)
    assert (stats.efficiency, stats.l1, stats.l2, stats.gap_l1, stats.gap_l2) == (1.0, 2, 2, 0.0, 0.0)
    assert stats.packing_factor == 2.5
    stats = packing_stats([6, 6, 6], pack([6, 6, 6], 10), 10)
    assert (stats.rows, stats.l1, stats.l2, stats.gap_l1, stats.gap_l2) == (3, 2, 3, 0.5, 0.0)
    assert stats.efficiency == pytest.approx(18 / 30)
    hist = pack_histogram([6], [3], 10)
    assert packing_stats([6], hist, 10, counts=[3]) == stats


def test_histogram_packing_by_hand():
    # Wikipedia-like: 3 x 300 and 5 x 200 in rows of 512: BFD puts each 300 with a 200.
    hb = pack_histogram([300, 200], [3, 5], 512)
    assert [(lens.tolist(), cnt.tolist()) for lens, cnt in hb] == [
        ([300, 200], [1, 1]),
        ([300, 200], [1, 1]),
        ([300, 200], [1, 1]),
        ([200], [2]),
    ]
    assert hb.loads().tolist() == [500, 500, 500, 400]
    assert hb.sequences().tolist() == [2, 2, 2, 2]
    # lengths of one cost class (multiple 8: 5..8 cost 8) keep their own lengths
    hb = pack_histogram([5, 8], [1, 1], 16, cost_multiple=8)
    assert [(lens.tolist(), cnt.tolist()) for lens, cnt in hb] == [([8, 5], [1, 1])]


# ----------------------------------------------------------------------------
# inputs and errors


def test_accepts_lists_numpy_and_torch():
    torch = pytest.importorskip("torch")
    lengths = [5, 10, 3, 8, 6]
    expected = pack(lengths, 16)
    for form in (np.array(lengths, np.int32), np.array(lengths, np.uint16), torch.tensor(lengths), tuple(lengths)):
        assert pack(form, 16) == expected
    assert len(pack([], 16)) == 0 and len(pack(np.zeros(0, np.int64), 16, "next_fit")) == 0


def test_bins_sequence_protocol():
    bins = pack([5, 10, 3, 8, 6], 16)
    assert len(bins) == 2
    assert bins[-1].tolist() == [3, 0, 2]
    assert [b.tolist() for b in bins[0:2]] == [[1, 4], [3, 0, 2]]
    assert [b.tolist() for b in bins] == bins.to_lists()
    assert bins.sizes.tolist() == [2, 3]
    assert bins.bin_index().tolist() == [1, 0, 1, 1, 0]
    assert bins.order.dtype == np.int64 and bins.offsets.dtype == np.int64
    assert not bins.order.flags.writeable
    with pytest.raises(IndexError, match="out of range for 2 bins"):
        bins[2]
    assert repr(bins) == "Bins(rows=2, items=5)"


def test_unknown_algorithm_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'bfd', 'ffd', 'first_fit_shuffle', 'next_fit', 'greedy_knapsack'"):
        pack([1, 2], 4, "best_fit")
    with pytest.raises(ValueError, match="histogram-driven"):
        pack_histogram([1], [1], 4, "next_fit")


def test_too_long_names_index_length_capacity_and_fixes():
    with pytest.raises(ValueError, match=r"lengths\[2\] = 9 is longer than the capacity 8: truncate .* or raise"):
        pack([3, 4, 9, 1], 8)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 7 costs 8 tokens .*=4, more than the capacity 7"):
        pack([7], 7, cost_multiple=4)
    with pytest.raises(ValueError, match=r"length 9 is longer than the capacity 8"):
        pack_histogram([9, 2], [1, 1], 8)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0: every sequence needs at least 1 token"):
        pack([3, 0], 8)
    with pytest.raises(ValueError, match=r"lengths\[0\] = -2"):
        lower_bounds([-2], 8)


def test_option_errors():
    with pytest.raises(ValueError, match="min_bins=5 rows need at least 5 sequences, got 3"):
        pack([1, 1, 1], 8, min_bins=5)
    with pytest.raises(ValueError, match="4 rows are required .* only 3 sequences"):
        pack([1, 1, 1], 8, bins_multiple_of=4)
    with pytest.raises(ValueError, match="capacity must be a positive integer, got 0"):
        pack([1], 0)
    with pytest.raises(ValueError, match=r"capacity must be at most 2\*\*31 - 1 = 2147483647 tokens, got 2147483648"):
        pack([1], 2**31)
    with pytest.raises(ValueError, match="max_items_per_bin must be a positive integer, got 0"):
        pack([1], 4, max_items_per_bin=0)
    with pytest.raises(ValueError, match="cost_multiple must be a positive integer, got 1.5"):
        pack([1], 4, cost_multiple=1.5)
    with pytest.raises(ValueError, match="bins_multiple_of must be a positive integer, got True"):
        pack([1], 4, bins_multiple_of=True)
    with pytest.raises(ValueError, match="min_bins must be a non-negative integer, got -1"):
        pack([1], 4, min_bins=-1)
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got '3'"):
        pack([1], 4, seed="3")
    with pytest.raises(ValueError, match="must be 1-D"):
        pack([[1, 2]], 4)
    with pytest.raises(ValueError, match="bin 0 costs 5 > capacity 4"):
        Bins(np.array([0, 1]), np.array([0, 2])).check([2, 3], 4)
    with pytest.raises(ValueError, match="the bins hold 2 items but lengths has 3"):
        Bins(np.array([0, 1]), np.array([0, 2])).check([2, 3, 1], 4)


# ----------------------------------------------------------------------------
# properties of every algorithm


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(
    problem=problems(),
    max_items=st.none() | st.integers(1, 5),
    min_bins=st.none() | st.integers(0, 6),
    multiple_of=st.none() | st.integers(1, 4),
    seed=st.integers(0, 2**32),
)
def test_properties(algorithm, problem, max_items, min_bins, multiple_of, seed):
    lengths, capacity, m = problem
    options = dict(
        cost_multiple=m, max_items_per_bin=max_items, min_bins=min_bins, bins_multiple_of=multiple_of, seed=seed
    )
    plain = pack(lengths, capacity, algorithm, cost_multiple=m, max_items_per_bin=max_items, seed=seed)
    required = max(len(plain), min_bins or 0)
    required = -(-required // (multiple_of or 1)) * (multiple_of or 1)
    if required > len(lengths):  # the ranks need more rows than there are sequences
        with pytest.raises(ValueError, match="sequences"):
            pack(lengths, capacity, algorithm, **options)
        return
    bins = pack(lengths, capacity, algorithm, **options)
    assert len(bins) == required  # split only as far as needed
    # every index exactly once, each row within capacity after rounding, counts honoured
    bins.check(lengths, capacity, cost_multiple=m, max_items_per_bin=max_items)
    bounds = lower_bounds(lengths, capacity, cost_multiple=m)
    assert len(bins) >= bounds.l2 >= bounds.l1
    if multiple_of:
        assert len(bins) % multiple_of == 0
    assert pack(lengths, capacity, algorithm, **options) == bins  # deterministic
    if algorithm is Algorithm.NEXT_FIT:
        assert bins.order.tolist() == list(range(len(lengths)))


@SETTINGS
@given(problem=problems(max_n=30), seed=st.integers(0, 2**32))
def test_references(problem, seed):
    lengths, capacity, m = problem
    # BFD: the rows of item-by-item BFD. Rows with equal room are interchangeable,
    # so which one takes an item may differ, but the multiset of rooms evolves
    # identically: the same row count and the same multiset of row loads.
    bfd = pack(lengths, capacity, cost_multiple=m)
    ref = ref_bfd(lengths, capacity, m)
    assert len(bfd) == len(ref)
    assert sorted(map(sum, bin_costs(bfd, lengths, m))) == sorted(map(sum, bin_costs(ref, lengths, m)))
    # FFD and greedy knapsack: exactly item-by-item FFD
    ffd = pack(lengths, capacity, "ffd", cost_multiple=m)
    assert ffd.to_lists() == ref_ffd(lengths, capacity, m)
    greedy = pack(lengths, capacity, "greedy_knapsack", cost_multiple=m)
    assert bin_costs(greedy, lengths, m) == bin_costs(ffd, lengths, m)
    # first fit in the seeded shuffled order
    shuffled = pack(lengths, capacity, "first_fit_shuffle", cost_multiple=m, seed=seed)
    visit = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    assert shuffled.to_lists() == ref_first_fit(lengths, capacity, visit, m)
    assert pack(lengths, capacity, "next_fit", cost_multiple=m).to_lists() == ref_next_fit(lengths, capacity, m)


@SETTINGS
@given(problem=problems(max_n=30), max_items=st.integers(1, 4))
def test_references_with_max_items(problem, max_items):
    lengths, capacity, m = problem
    ffd = pack(lengths, capacity, "ffd", cost_multiple=m, max_items_per_bin=max_items)
    assert ffd.to_lists() == ref_ffd(lengths, capacity, m, max_items)
    greedy = pack(lengths, capacity, "greedy_knapsack", cost_multiple=m, max_items_per_bin=max_items)
    assert bin_costs(greedy, lengths, m) == bin_costs(ffd, lengths, m)
    nf = pack(lengths, capacity, "next_fit", cost_multiple=m, max_items_per_bin=max_items)
    assert nf.to_lists() == ref_next_fit(lengths, capacity, m, max_items)


@SETTINGS
@given(problem=problems(max_n=7, max_capacity=12))
def test_bfd_within_11_9_of_the_optimum(problem):
    lengths, capacity, m = problem
    opt = optimum(costs_of(lengths, m), capacity)
    rows = len(pack(lengths, capacity, cost_multiple=m))
    assert opt <= rows <= 11 / 9 * opt + 1


@SETTINGS
@given(problem=problems(max_n=40), max_items=st.none() | st.integers(1, 4))
def test_histogram_matches_items(problem, max_items):
    lengths, capacity, m = problem
    for algorithm in ("bfd", "ffd", "greedy_knapsack"):
        bins = pack(lengths, capacity, algorithm, cost_multiple=m, max_items_per_bin=max_items)
        values, counts = np.unique(np.array(lengths, np.int64), return_counts=True)
        hb = pack_histogram(values, counts, capacity, algorithm, cost_multiple=m, max_items_per_bin=max_items)
        # the same rows of costs; lengths of one cost class may swap rows
        expected = [sorted(costs_of([lengths[i] for i in row], m)) for row in bins]
        got = [sorted(costs_of(np.repeat(lens, cnt).tolist(), m)) for lens, cnt in hb]
        assert got == expected
        assert sorted(np.repeat(hb.lengths, hb.counts).tolist()) == sorted(lengths)


def test_bfd_matches_item_by_item_bfd_on_larger_random_inputs():
    rng = np.random.default_rng(7)
    cases = [
        (np.clip(np.rint(rng.lognormal(np.log(capacity / 8), 1.0, size)), 1, capacity).astype(np.int64), capacity)
        for capacity, size in ((512, 4000), (8192, 3000), (384, 3000))
    ]
    # few distinct lengths: long runs of equal rows, so segments split and regroup often
    cases.append((rng.choice([100, 130, 200, 260, 300, 450, 512], 5000), 512))
    for lengths, capacity in cases:
        for m in (1, 8):
            bins = pack(lengths, capacity, cost_multiple=m)
            ref = ref_bfd(lengths.tolist(), capacity, m)
            assert len(bins) == len(ref)
            assert np.array_equal(
                np.sort(bins.loads(lengths, cost_multiple=m)), sorted(map(sum, bin_costs(ref, lengths.tolist(), m)))
            )
            bins.check(lengths, capacity, cost_multiple=m)


def test_large_input_fast_path():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(600), 1.0, 200_000)), 1, 8192).astype(np.int64)
    bins = pack(lengths, 8192)
    bins.check(lengths, 8192)
    stats = packing_stats(lengths, bins, 8192)
    assert stats.gap_l2 < 1e-3  # BFD lands within 0.1% of the bound on SFT-like lengths
    assert len(pack(lengths, 8192, "next_fit")) > 1.05 * len(bins)


def test_bfd_on_every_small_multiset():
    # every multiset of up to 5 lengths from 1..6 in rows of 6: BFD rows equal the reference's
    for n in range(1, 6):
        for combo in itertools.combinations_with_replacement(range(1, 7), n):
            lengths = list(combo)[::-1]
            got, ref = pack(lengths, 6), ref_bfd(lengths, 6)
            assert sorted(map(sum, bin_costs(got, lengths))) == sorted(map(sum, bin_costs(ref, lengths)))


def test_bins_constructor_validates_and_leaves_the_callers_arrays_alone():
    order, offsets = np.array([1, 0, 2]), np.array([0, 2, 3])
    bins = Bins(order, offsets)
    assert bins.to_lists() == [[1, 0], [2]]
    assert order.flags.writeable and not bins.order.flags.writeable
    with pytest.raises(ValueError, match="no empty bin"):
        Bins(order, np.array([0, 2, 2, 3]))
    with pytest.raises(ValueError, match="from 0 to len"):
        Bins(order, np.array([0, 2]))
