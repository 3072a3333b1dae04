"""The cost of packing follows the items, never the capacity (issue 9, item 8).

Three independent checks that the capacity-free kernels give the rows the
capacity-indexed ones gave:

- scaling: every decision of every algorithm compares or divides lengths and
  rooms, so multiplying the lengths and the capacity by ``K`` must give the
  very same ``Bins``; a small capacity runs the dense route, ``K`` times it
  (up to ``2**31 - 1``) the sparse one;
- forcing each route on the same input gives the same ``Bins``;
- :func:`ref_bfd_records` below, the segment algorithm over a plain sorted
  list of rooms (what the crit-bit room index replaces), gives exactly the
  records of the compiled kernel, also for rooms up to ``2**31 - 1``;
- :func:`ref_lower_bounds`, the Martello-Toth formula over every unit
  ``0..U`` (the code this replaces), equals :func:`lower_bounds` evaluated at
  the distinct sizes only.
"""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack import binpack
from sftpack.binpack import (
    MAX_CAPACITY,
    Algorithm,
    lower_bounds,
    pack,
    pack_histogram,
    packing_stats,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALGORITHMS = list(Algorithm)


# ----------------------------------------------------------------------------
# references


class _Segment:
    __slots__ = ("a", "b", "fill")

    def __init__(self, a: int, b: int, fill: int) -> None:
        self.a, self.b, self.fill = a, b, fill


def ref_bfd_records(sizes, counts, cap_units, max_items):
    """Segment BFD (see ``bfd_records``) with its rooms in a sorted Python list.

    Returns ``(records, n_bins)``, records as ``(first, end, rank, count, before)``.
    """
    rooms: list[int] = []  # distinct rooms whose stack is not empty, ascending
    stacks: dict[int, list[_Segment]] = {}  # room -> segments, last shelved at the end
    records: list[tuple[int, int, int, int, int]] = []
    smallest = sizes[0]
    n_bins = 0

    def shelve(seg: _Segment, room: int) -> None:
        if room >= smallest and seg.fill < max_items:
            if room not in stacks:
                bisect.insort(rooms, room)
                stacks[room] = []
            stacks[room].append(seg)

    def opened(a: int, width: int, rank: int, take: int, fill: int, room: int) -> None:
        records.append((a, a + width, rank, take, fill))
        shelve(_Segment(a, a + width, fill + take), room)

    for rank in range(len(sizes) - 1, -1, -1):
        s, k = int(sizes[rank]), int(counts[rank])
        while k > 0:
            i = bisect.bisect_left(rooms, s)
            if i == len(rooms):
                break
            r = rooms[i]
            stack = stacks[r]
            while stack:
                g = stack[-1]
                j = min(r // s, max_items - g.fill)
                if (g.b - g.a) * j <= k:  # the whole segment moves
                    stack.pop()
                    records.append((g.a, g.b, rank, j, g.fill))
                    k -= (g.b - g.a) * j
                    g.fill += j
                    shelve(g, r - j * s)
                    if k == 0:
                        break
                    continue
                t, rest = divmod(k, j)
                a = g.a
                for take, width in ((j, t), (rest, 1 if rest else 0)):
                    if width:
                        opened(a, width, rank, take, g.fill, r - take * s)
                        a += width
                k = 0
                if a < g.b:
                    g.a = a
                else:
                    stack.pop()
                break
            if not stack:
                rooms.remove(r)
                del stacks[r]
        if k > 0:
            per_bin = min(cap_units // s, max_items)
            full, rest = divmod(k, per_bin)
            for take, width in ((per_bin, full), (rest, 1 if rest else 0)):
                if width:
                    opened(n_bins, width, rank, take, 0, cap_units - take * s)
                    n_bins += width
    return records, n_bins


def ref_lower_bounds(units, cap_units):
    """L1 and L2 with arrays over every unit size 0..U (small U only)."""
    hist = np.bincount(np.asarray(units, np.int64), minlength=cap_units + 1)
    w = np.arange(cap_units + 1)
    sizes = hist * w
    total = int(sizes.sum())
    if total == 0:
        return 0, 0
    n_ge = np.append(np.cumsum(hist[::-1])[::-1], 0)
    s_ge = np.append(np.cumsum(sizes[::-1])[::-1], 0)
    best = 0
    half = cap_units // 2
    for a in range(half + 1):
        j1 = n_ge[cap_units - a + 1]
        j2 = n_ge[half + 1] - j1
        s2 = s_ge[half + 1] - s_ge[cap_units - a + 1]
        s3 = s_ge[a] - s_ge[half + 1]
        spill = max(0, -(-(s3 - (j2 * cap_units - s2)) // cap_units))
        best = max(best, int(j1 + j2 + spill))
    return -(-total // cap_units), best


@st.composite
def small_problems(draw, max_n=40, max_capacity=60):
    capacity = draw(st.integers(1, max_capacity))
    lengths = draw(st.lists(st.integers(1, capacity), max_size=max_n))
    return lengths, capacity


# ----------------------------------------------------------------------------
# the capacity no longer costs anything


def test_two_items_in_the_largest_row():
    # the dense route would allocate arrays of 2**31 entries (16 GiB); now a few bytes
    for algorithm in ALGORITHMS:
        bins = pack([5, 6], MAX_CAPACITY, algorithm)
        expected = [[0, 1]] if algorithm in ("first_fit_shuffle", "next_fit") else [[1, 0]]
        assert bins.to_lists() == expected, algorithm
    assert pack([5, 6], 10**9).to_lists() == pack([5, 6], 11).to_lists() == [[1, 0]]
    assert pack([5, 6], 10).to_lists() == [[1], [0]]
    assert lower_bounds([5, 6], MAX_CAPACITY) == (1, 1)
    stats = packing_stats([5, 6], pack([5, 6], MAX_CAPACITY), MAX_CAPACITY)
    assert (stats.rows, stats.tokens, stats.l1, stats.l2) == (1, 11, 1, 1)
    hb = pack_histogram([5, 6], [3, 2], MAX_CAPACITY)
    assert [(lens.tolist(), cnt.tolist()) for lens, cnt in hb] == [([6, 5], [2, 3])]


def test_large_capacities_in_a_fresh_process_use_little_memory():
    # peak RSS in a fresh interpreter (the test process's own peak would hide it);
    # before the change the first call alone took ~4 GB at 10**8 and failed at 10**9
    code = textwrap.dedent(
        """
        import json, resource
        import numpy as np
        from sftpack.binpack import Algorithm, lower_bounds, pack, pack_histogram, packing_stats
        for a in Algorithm:
            pack([3, 4], 8, a)  # load (or compile) the kernels first: their code is not what is measured
        pack([3, 4], 2**31 - 1)  # the sparse route's kernel too
        pack_histogram([3], [1], 8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rows = {}
        for cap in (10**8, 10**9, 2**31 - 1):
            for a in Algorithm:
                rows[f"{a}/{cap}"] = pack([5, 6, 2**26, 7], cap, a).to_lists()
            rows[f"bounds/{cap}"] = list(lower_bounds([5, 6, 2**26], cap))
            rows[f"stats/{cap}"] = packing_stats([5, 6], pack([5, 6], cap), cap).rows
            rows[f"hist/{cap}"] = len(pack_histogram([5, 6], [10, 10], cap, "ffd"))
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(json.dumps({"grown_kib": grown, "rows": rows}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout)
    assert result["grown_kib"] < 64 * 1024
    rows = result["rows"]
    for cap in (10**8, 10**9, 2**31 - 1):
        assert rows[f"bfd/{cap}"] == [[2, 3, 1, 0]]
        assert rows[f"next_fit/{cap}"] == [[0, 1, 2, 3]]
        assert rows[f"bounds/{cap}"] == [1, 1]
        assert rows[f"stats/{cap}"] == 1
        assert rows[f"hist/{cap}"] == 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(
    problem=small_problems(),
    scale_to=st.floats(0.0, 1.0),
    max_items=st.none() | st.integers(1, 4),
    min_bins=st.none() | st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_scaling_lengths_and_capacity_gives_the_same_bins(algorithm, problem, scale_to, max_items, min_bins, seed):
    lengths, capacity = problem
    if min_bins is not None and min_bins > len(lengths):
        min_bins = None
    # K from 2 up to the largest that keeps the capacity within 2**31 - 1
    k = 2 + int(scale_to * (MAX_CAPACITY // capacity - 2))
    options = dict(max_items_per_bin=max_items, min_bins=min_bins, seed=seed)
    small = pack(lengths, capacity, algorithm, **options)
    large = pack(np.array(lengths, np.int64) * k, capacity * k, algorithm, **options)
    assert large == small
    assert lower_bounds(np.array(lengths, np.int64) * k, capacity * k) == lower_bounds(lengths, capacity)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 200), max_size=60),
    capacity=st.integers(200, 400),
    m=st.integers(1, 3),
    max_items=st.none() | st.integers(1, 4),
)
def test_dense_and_sparse_routes_give_the_same_bins(algorithm, lengths, capacity, m, max_items):
    lengths = [min(x, capacity // m * m) for x in lengths]  # every cost within the capacity
    options = dict(cost_multiple=m, max_items_per_bin=max_items, seed=5)
    got = {}
    route = binpack._inputs._dense_route
    try:
        for dense in (True, False):
            binpack._inputs._dense_route = lambda cap_units, n, dense=dense: dense
            bins = pack(lengths, capacity, algorithm, **options)
            got[dense] = (bins, lower_bounds(lengths, capacity, cost_multiple=m))
            if algorithm in ("bfd", "ffd", "greedy_knapsack") and lengths:
                values, counts = np.unique(lengths, return_counts=True)
                hb = pack_histogram(values, counts, capacity, algorithm, cost_multiple=m, max_items_per_bin=max_items)
                got[dense] += (hb.offsets.tolist(), hb.lengths.tolist(), hb.counts.tolist())
    finally:
        binpack._inputs._dense_route = route
    assert got[True][0] == got[False][0]
    assert got[True][1:] == got[False][1:]


@st.composite
def histograms(draw):
    """(sizes ascending distinct, counts, U, max_items): keys up to 2**31 - 1 half the time."""
    cap_units = draw(st.sampled_from([draw(st.integers(1, 50)), draw(st.integers(2**20, MAX_CAPACITY))]))
    sizes = sorted(draw(st.sets(st.integers(1, cap_units), min_size=1, max_size=8)))
    counts = draw(st.lists(st.integers(1, 30), min_size=len(sizes), max_size=len(sizes)))
    max_items = draw(st.sampled_from([10**9, draw(st.integers(1, 5))]))
    return np.array(sizes, np.int64), np.array(counts, np.int64), cap_units, max_items


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=histograms())
def test_bfd_records_equal_the_segment_algorithm_over_a_sorted_list(problem):
    sizes, counts, cap_units, max_items = problem
    binpack._kernels.load()
    first, end, rank, count, before, _, n_bins = binpack._kernels.bfd_records(sizes, counts, cap_units, max_items)
    records, ref_bins = ref_bfd_records(sizes.tolist(), counts.tolist(), cap_units, max_items)
    assert n_bins == ref_bins
    assert list(zip(first.tolist(), end.tolist(), rank.tolist(), count.tolist(), before.tolist())) == records


def test_bfd_records_on_many_rooms_at_once():
    # thousands of live rooms spread over 31 bits: the crit-bit tree grows deep and
    # shrinks back as rooms empty (every query and removal path is taken)
    rng = np.random.default_rng(3)
    for cap_units, n_sizes in ((MAX_CAPACITY, 3000), (2**20 + 7, 3000), (5000, 2000)):
        sizes = np.unique(rng.integers(1, cap_units + 1, n_sizes)).astype(np.int64)
        counts = rng.integers(1, 6, sizes.shape[0]).astype(np.int64)
        binpack._kernels.load()
        got = binpack._kernels.bfd_records(sizes, counts, cap_units, 10**9)
        records, n_bins = ref_bfd_records(sizes.tolist(), counts.tolist(), cap_units, 10**9)
        assert got[6] == n_bins and got[5] == len(records)
        assert list(zip(*(a.tolist() for a in got[:5]))) == records


@SETTINGS
@given(
    units=st.lists(st.integers(1, 40), max_size=30),
    cap_units=st.integers(1, 40),
    m=st.integers(1, 3),
)
def test_lower_bounds_at_the_distinct_sizes_equal_the_bound_over_every_unit(units, cap_units, m):
    units = [min(u, cap_units) for u in units]
    lengths = [u * m - (m - 1) for u in units]  # the shortest length of u units
    assert tuple(lower_bounds(lengths, cap_units * m, cost_multiple=m)) == ref_lower_bounds(units, cap_units)
    if units:
        values, counts = np.unique(lengths, return_counts=True)
        assert tuple(lower_bounds(values, cap_units * m, counts=counts, cost_multiple=m)) == ref_lower_bounds(
            units, cap_units
        )


def test_many_items_in_a_huge_row_match_the_small_row_scaled():
    # 20,000 lognormal lengths: dense route at capacity 4096, sparse at 4096 * 524,287
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(300), 1.0, 20_000)), 1, 4096).astype(np.int64)
    k = MAX_CAPACITY // 4096
    for algorithm in ALGORITHMS:
        assert pack(lengths * k, 4096 * k, algorithm) == pack(lengths, 4096, algorithm), algorithm
    hb_small = pack_histogram(*np.unique(lengths, return_counts=True), 4096)
    hb_large = pack_histogram(*np.unique(lengths * k, return_counts=True), 4096 * k)
    assert np.array_equal(hb_small.offsets, hb_large.offsets)
    assert np.array_equal(hb_small.lengths * k, hb_large.lengths)


def test_radix_grouping_equals_a_stable_sort_for_every_pass_count():
    # keys U - units differ in no digit (all equal: 0 passes), in the low 11 bits only
    # (1 pass), up to bit 21 (2 passes: the result comes back from scratch), or in all 3
    rng = np.random.default_rng(5)
    cap_units = MAX_CAPACITY
    binpack._kernels.load()
    for spread in (0, 2**11 - 1, 2**22 - 1, 2**31 - 2):
        for m in (1, 3):
            lengths = (cap_units - rng.integers(0, spread + 1, 5000)) // m * m  # units U // m - key / m
            lengths = np.maximum(lengths, 1).astype(np.int64)
            units = -(-lengths // m)
            out = np.empty(5000, np.int32)
            sizes, counts, start = binpack._kernels.sort_by_units(lengths, m, cap_units // m, out, np.empty_like(out))
            expected = np.argsort(-units, kind="stable")
            assert out.tolist() == expected.tolist()
            values, tally = np.unique(units, return_counts=True)
            assert sizes.tolist() == values.tolist() and counts.tolist() == tally.tolist()
            assert all(units[out[b]] == s for b, s in zip(start, sizes))
