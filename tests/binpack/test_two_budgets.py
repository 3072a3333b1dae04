"""The bin packer's second budget: a weight per sequence (e.g. vision patches) capped per row.

The references below are the plain item-by-item algorithms under two budgets, written
here independently of the compiled kernels they check.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack.binpack import Algorithm, pack

ALGORITHMS = list(Algorithm)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def costs_of(lengths, m=1):
    return [-(-x // m) * m for x in lengths]


def decreasing(c):
    return sorted(range(len(c)), key=lambda i: -c[i])  # stable: input order among equal costs


def ref_any_fit(lengths, weights, capacity, cap_w, visit, m=1, max_items=None, best=False):
    """First fit (or best fit: least cost room; among equals the most weight room, then the
    first) where both budgets fit."""
    c = costs_of(lengths, m)
    bins: list[list[int]] = []
    room: list[int] = []
    room_w: list[int] = []
    for i in visit:
        fits = [
            b
            for b in range(len(bins))
            if room[b] >= c[i] and room_w[b] >= weights[i] and (max_items is None or len(bins[b]) < max_items)
        ]
        if not fits:
            bins.append([])
            room.append(capacity)
            room_w.append(cap_w)
            b = len(bins) - 1
        else:
            b = min(fits, key=lambda k: (room[k], -room_w[k], k)) if best else fits[0]
        bins[b].append(i)
        room[b] -= c[i]
        room_w[b] -= weights[i]
    return bins


def ref_greedy(lengths, weights, capacity, cap_w, m=1, max_items=None):
    """One row at a time: the first item (cost descending) whose cost and weight both fit."""
    c = costs_of(lengths, m)
    left = decreasing(c)
    bins = []
    while left:
        row, room, room_w = [], capacity, cap_w
        while max_items is None or len(row) < max_items:
            pick = next((i for i in left if c[i] <= room and weights[i] <= room_w), None)
            if pick is None:
                break
            row.append(pick)
            left.remove(pick)
            room -= c[pick]
            room_w -= weights[pick]
        bins.append(row)
    return bins


def ref_next_fit(lengths, weights, capacity, cap_w, m=1, max_items=None):
    bins: list[list[int]] = []
    load = load_w = 0
    for i, x in enumerate(costs_of(lengths, m)):
        full = max_items is not None and bins and len(bins[-1]) == max_items
        if not bins or load + x > capacity or load_w + weights[i] > cap_w or full:
            bins.append([])
            load = load_w = 0
        bins[-1].append(i)
        load += x
        load_w += weights[i]
    return bins


def reference(algorithm, lengths, weights, capacity, cap_w, m=1, max_items=None, seed=0):
    c = costs_of(lengths, m)
    if algorithm == "next_fit":
        return ref_next_fit(lengths, weights, capacity, cap_w, m, max_items)
    if algorithm == "greedy_knapsack":
        return ref_greedy(lengths, weights, capacity, cap_w, m, max_items)
    if algorithm == "first_fit_shuffle":
        visit = np.random.default_rng(seed).permutation(len(lengths)).tolist()
        return ref_any_fit(lengths, weights, capacity, cap_w, visit, m, max_items)
    return ref_any_fit(lengths, weights, capacity, cap_w, decreasing(c), m, max_items, best=algorithm == "bfd")


@st.composite
def problems(draw, max_n=40):
    """(lengths, weights, capacity, weight cap, cost_multiple): every item fits both budgets alone."""
    m = draw(st.integers(1, 4))
    capacity = draw(st.integers(m, 64))
    cap_w = draw(st.integers(0, 40))
    n = draw(st.integers(0, max_n))
    lengths = draw(st.lists(st.integers(1, capacity // m * m), min_size=n, max_size=n))
    weights = draw(st.lists(st.integers(0, cap_w), min_size=n, max_size=n))
    return lengths, weights, capacity, cap_w, m


def row_weights(bins, weights):
    return [sum(weights[i] for i in row) for row in bins]


# ----------------------------------------------------------------------------
# by hand


def test_worked_example_every_algorithm():
    # costs 5 10 3 8 6, weights 1 3 0 2 2, rows of 16 tokens and 3 weight.
    # Decreasing order: 10 (item 1, w3), 8 (3, w2), 6 (4, w2), 5 (0, w1), 3 (2, w0).
    # 1 opens row 0 (room 6, w 0); 3 does not fit row 0 (8 > 6): row 1 (8, 1); 4 fits
    # row 0's tokens but not its weight, nor row 1's weight: row 2 (10, 1); 0 fits rows 1
    # and 2: first fit takes row 1 (3, 0), so does best fit (8 < 10); 2 (w0) fits rows 0
    # and 1 (and 2): first fit row 0, best fit row 1 (room 3, tightest).
    lengths, weights = [5, 10, 3, 8, 6], [1, 3, 0, 2, 2]
    got = {a.value: pack(lengths, 16, a, weights=weights, max_weight_per_bin=3).to_lists() for a in Algorithm}
    assert got["ffd"] == [[1, 2], [3, 0], [4]]
    assert got["bfd"] == [[1], [3, 0, 2], [4]]
    assert got["greedy_knapsack"] == [[1, 2], [3, 0], [4]]  # row 0: 10, then 3 (8, 6, 5 weigh too much)
    assert got["next_fit"] == [[0], [1, 2], [3], [4]]  # 5+10 fit 16 tokens but weigh 4
    # without the cap (or with weights that never bind), the one-budget rows
    for a in Algorithm:
        plain = pack(lengths, 16, a).to_lists()
        assert pack(lengths, 16, a, weights=weights).to_lists() == plain  # cap None: weights ignored
        assert pack(lengths, 16, a, weights=[0] * 5, max_weight_per_bin=0).to_lists() == plain


def test_a_sequence_heavier_than_the_cap_is_named():
    with pytest.raises(ValueError, match=r"weights\[1\] = 50 is more than max_weight_per_bin=40.*at least 50"):
        pack([3, 4, 5], 10, weights=[1, 50, 60], max_weight_per_bin=40)
    for a in Algorithm:  # every packer refuses it before packing
        with pytest.raises(ValueError, match=r"weights\[0\] = 5 is more than max_weight_per_bin=4"):
            pack([3], 10, a, weights=[5], max_weight_per_bin=4)


def test_second_budget_option_errors():
    with pytest.raises(ValueError, match="no weights were given"):
        pack([1, 2], 4, max_weight_per_bin=3)
    with pytest.raises(ValueError, match="weights has 1 entries but there are 2 lengths"):
        pack([1, 2], 4, weights=[1], max_weight_per_bin=3)
    with pytest.raises(ValueError, match=r"weights\[1\] = -2: weights must be >= 0"):
        pack([1, 2], 4, weights=[1, -2], max_weight_per_bin=3)
    with pytest.raises(ValueError, match="max_weight_per_bin must be a non-negative integer, got -1"):
        pack([1, 2], 4, weights=[1, 1], max_weight_per_bin=-1)
    with pytest.raises(ValueError, match="max_weight_per_bin must be a non-negative integer, got 2.5"):
        pack([1, 2], 4, weights=[1, 1], max_weight_per_bin=2.5)
    with pytest.raises(TypeError, match=r"weights\[0\] = 1.5 is not an integer"):
        pack([1, 2], 4, weights=[1.5, 1], max_weight_per_bin=3)
    with pytest.raises(ValueError, match="longer than the capacity"):  # the token budget still applies
        pack([1, 9], 4, weights=[1, 1], max_weight_per_bin=3)
    assert len(pack([], 4, weights=[], max_weight_per_bin=3)) == 0


def test_check_names_a_row_over_the_second_budget():
    bins = pack([5, 10, 3, 8, 6], 16)  # [[1, 4], [3, 0, 2]]: weights 3+2 and 2+1+0
    bins.check([5, 10, 3, 8, 6], 16, weights=[1, 3, 0, 2, 2], max_weight_per_bin=5)
    with pytest.raises(ValueError, match="bin 0 weighs 5 > max_weight_per_bin=4"):
        bins.check([5, 10, 3, 8, 6], 16, weights=[1, 3, 0, 2, 2], max_weight_per_bin=4)


# ----------------------------------------------------------------------------
# properties and references


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(
    problem=problems(),
    max_items=st.none() | st.integers(1, 5),
    min_bins=st.none() | st.integers(0, 6),
    multiple_of=st.none() | st.integers(1, 3),
    seed=st.integers(0, 2**32),
)
def test_properties(algorithm, problem, max_items, min_bins, multiple_of, seed):
    lengths, weights, capacity, cap_w, m = problem
    two = dict(weights=weights, max_weight_per_bin=cap_w)
    plain = pack(lengths, capacity, algorithm, cost_multiple=m, max_items_per_bin=max_items, seed=seed, **two)
    # every sequence exactly once, each row under the tokens, the items and the weight
    plain.check(lengths, capacity, cost_multiple=m, max_items_per_bin=max_items, **two)
    assert plain.to_lists() == reference(algorithm.value, lengths, weights, capacity, cap_w, m, max_items, seed)
    required = max(len(plain), min_bins or 0)
    required = -(-required // (multiple_of or 1)) * (multiple_of or 1)
    options = dict(
        cost_multiple=m, max_items_per_bin=max_items, min_bins=min_bins, bins_multiple_of=multiple_of, seed=seed
    )
    if required > len(lengths):
        with pytest.raises(ValueError, match="sequences"):
            pack(lengths, capacity, algorithm, **options, **two)
        return
    bins = pack(lengths, capacity, algorithm, **options, **two)
    assert len(bins) == required
    bins.check(lengths, capacity, cost_multiple=m, max_items_per_bin=max_items, **two)  # splitting keeps both
    assert pack(lengths, capacity, algorithm, **options, **two) == bins  # deterministic


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(problem=problems(), max_items=st.none() | st.integers(1, 5), seed=st.integers(0, 2**32))
def test_a_cap_that_never_binds_gives_the_one_budget_rows(algorithm, problem, max_items, seed):
    lengths, weights, capacity, _, m = problem
    one = pack(lengths, capacity, algorithm, cost_multiple=m, max_items_per_bin=max_items, seed=seed)
    loose = pack(
        lengths,
        capacity,
        algorithm,
        cost_multiple=m,
        max_items_per_bin=max_items,
        seed=seed,
        weights=weights,
        max_weight_per_bin=sum(weights),
    )
    ignored = pack(
        lengths, capacity, algorithm, cost_multiple=m, max_items_per_bin=max_items, seed=seed, weights=weights
    )
    assert ignored == one  # cap None: exactly the rows of before
    if algorithm is Algorithm.BFD and max_items is not None:
        # Rows of equal room that hold different numbers of items are not interchangeable under an
        # item cap, so the two routes' tie-breaks may differ in row count (test_item_cap_ties below):
        # both are valid best-fit-decreasing packings.
        loose.check(lengths, capacity, cost_multiple=m, max_items_per_bin=max_items)
    elif algorithm is Algorithm.BFD:
        # the histogram BFD breaks ties between rows of equal room another way; without an item cap
        # such rows are interchangeable: same row count, same loads
        assert len(loose) == len(one)
        assert np.array_equal(
            np.sort(loose.loads(lengths, cost_multiple=m)), np.sort(one.loads(lengths, cost_multiple=m))
        )
    else:
        assert loose == one


def test_item_cap_ties():
    """Why the item-capped BFD routes may differ: 33 and 30 open two rows of capacity 35, 3 goes
    to the 30-row, and now both rows have room 2. The histogram route puts 2 with the 30 and
    3 + 30 + 2 fills a row of 3 items; the two-budget route puts 2 with the 33, leaving the 30-row
    a slot for one 1. Both are best fit; under max_items_per_bin=3 one needs a row more."""
    lengths = np.array([1] * 11 + [2, 3, 30, 33])
    one = pack(lengths, 35, "bfd", max_items_per_bin=3)
    two = pack(lengths, 35, "bfd", max_items_per_bin=3, weights=np.ones(15, np.int64), max_weight_per_bin=15)
    assert (len(one), len(two)) == (5, 6)
    one.check(lengths, 35, max_items_per_bin=3)
    two.check(lengths, 35, max_items_per_bin=3)


def test_larger_inputs_where_the_second_budget_binds():
    # multimodal-like: tokens 20..600 per sample, patches 0..1024, rows of 2048 tokens and 2048 patches
    rng = np.random.default_rng(3)
    lengths = rng.integers(20, 600, size=3000)
    patches = np.where(rng.random(3000) < 0.2, 0, rng.integers(16, 1025, size=3000))
    rows = {}
    for a in Algorithm:
        bins = pack(lengths, 2048, a, cost_multiple=8, weights=patches, max_weight_per_bin=2048)
        bins.check(lengths, 2048, cost_multiple=8, weights=patches, max_weight_per_bin=2048)
        rows[a.value] = len(bins)
        free = pack(lengths, 2048, a, cost_multiple=8)
        assert len(bins) > len(free)  # the patch budget binds here
        assert max(int(patches[np.asarray(r)].sum()) for r in free) > 2048
    sub = (lengths[:300].tolist(), patches[:300].tolist())
    for a in ("bfd", "ffd", "greedy_knapsack"):  # the kernels against the references, on a bigger input
        got = pack(sub[0], 2048, a, cost_multiple=8, weights=sub[1], max_weight_per_bin=2048).to_lists()
        assert got == reference(a, sub[0], sub[1], 2048, 2048, 8)
    # the decreasing packers fill better than next fit under both budgets
    assert max(rows["bfd"], rows["ffd"], rows["greedy_knapsack"]) < rows["next_fit"]


def test_best_fit_gives_the_same_rows_on_both_routes(monkeypatch):
    # rooms indexed by value while the capacity is small, a branch and bound over the rows above:
    # the same choice (least token room, most weight room, first row), so the same rows
    import sftpack.binpack._inputs as inputs

    rng = np.random.default_rng(5)
    cases = []
    for n, capacity in ((2000, 1024), (500, 64)):
        lengths = rng.integers(1, capacity // 2, size=n)
        weights = np.where(rng.random(n) < 0.2, 0, rng.integers(1, 700, size=n))
        cases.append((lengths, weights, capacity))
    dense = [pack(ln, c, "bfd", cost_multiple=2, weights=w, max_weight_per_bin=1500) for ln, w, c in cases]
    monkeypatch.setattr(inputs, "_dense_route", lambda cap_units, n: False)
    for (ln, w, c), want in zip(cases, dense):
        got = pack(ln, c, "bfd", cost_multiple=2, weights=w, max_weight_per_bin=1500)
        assert got == want
        got.check(ln, c, cost_multiple=2, weights=w, max_weight_per_bin=1500)
