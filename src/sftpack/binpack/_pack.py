"""The packers: :func:`pack` (item indices) and :func:`pack_histogram` (counts only).

Both validate, group the sequences by cost (a counting sort while the capacity
is small, a radix sort above it: :func:`_group_by_size`), run the algorithm's
kernels (:mod:`._kernels`, compiled on first use) and, for :func:`pack`,
split rows until ``min_bins`` / ``bins_multiple_of`` are met.

Small inputs run the kernels as plain Python instead: up to
``_kernels.PLAIN_MAX_ITEMS`` (64) sequences while numba has not been loaded in
the process (:func:`._kernels.kernels`), since importing numba and loading the
kernels from its cache take over a second and a plain pack of 64 sequences a
few milliseconds (``benchmarks/bench_import.py``). The plain route groups the sequences by cost with numpy's
stable sort and runs best fit under two budgets as the branch and bound (the
counting sort and the dense best fit loop over ``0..U``, the radix sort over
2048 digits, too slow in Python); the rows are the same either way.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
from numpy.typing import ArrayLike

from .._base import StrEnum as _StrEnum
from .._base import choose, positive_int, round_up
from . import _inputs
from . import _kernels as _k
from ._bins import Bins, HistogramBins
from ._groups import Groups
from ._inputs import (
    _as_counts,
    _as_lengths,
    _capacity,
    _check_fits,
    _non_negative_int,
    _too_long,
    _units,
)


class Algorithm(_StrEnum):
    """How :func:`pack` chooses the row of each sequence."""

    BFD = "bfd"  #: best-fit decreasing: longest first, into the row it fills most tightly
    FFD = "ffd"  #: first-fit decreasing: longest first, into the first row it fits
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"  #: seeded shuffle, then first fit (Megatron-Bridge)
    NEXT_FIT = "next_fit"  #: input order kept; a new row when the next one does not fit
    GREEDY_KNAPSACK = "greedy_knapsack"  #: one row at a time, longest that fits (Energon); = ffd rows


#: The algorithms that only need the length histogram (and so work in :func:`pack_histogram`).
_HISTOGRAM_ALGORITHMS = (Algorithm.BFD, Algorithm.FFD, Algorithm.GREEDY_KNAPSACK)


def _choose_algorithm(algorithm: str | Algorithm) -> Algorithm:
    return choose(Algorithm, algorithm, "algorithm")


def pack(
    lengths: ArrayLike,
    capacity: int,
    algorithm: str | Algorithm = "bfd",
    *,
    cost_multiple: int = 1,
    max_items_per_bin: int | None = None,
    min_bins: int | None = None,
    bins_multiple_of: int | None = None,
    seed: int = 0,
    weights: ArrayLike | None = None,
    max_weight_per_bin: int | None = None,
    groups: ArrayLike | None = None,
) -> Bins:
    """Pack sequences of the given lengths into rows of ``capacity`` tokens.

    Args:
        lengths: ``(n,)`` integer lengths, each ``>= 1`` (numpy array, list or
            torch tensor; tens of millions are fine).
        capacity: tokens per row, ``1 .. 2**31 - 1`` (the cost does not grow
            with it).
        algorithm: one of :class:`Algorithm` (``"bfd"`` by default).
        cost_multiple: each sequence costs its length rounded up to this
            multiple (the per-sequence pad multiple of the row builder, e.g.
            ``2 * CP``); rows hold at most ``capacity`` of cost.
        max_items_per_bin: at most this many sequences per row.
        min_bins: at least this many rows (rows are split, largest item count
            first, until there are enough).
        bins_multiple_of: the row count is a multiple of this (e.g. the
            data-parallel size, so every rank gets a row).
        seed: shuffle seed of ``first_fit_shuffle`` (the others are
            deterministic without it).
        weights: ``(n,)`` a second integer size per sequence, each ``>= 0``
            (e.g. the vision patches of a multimodal sample), capped per row
            by ``max_weight_per_bin``. Without the cap they are checked and
            otherwise ignored: the rows are those of the one budget.
        max_weight_per_bin: the second budget: each row's weights sum to at
            most this. Every algorithm honours it, item by item (see
            :func:`_pack_two`); with it, equal lengths are no longer
            interchangeable, so the histogram shortcut is off.
        groups: ``(n,)`` integer group id per sequence (equal ids: one group, e.g. a
            DPO pair or a prompt's GRPO completions): a group is one unit that no row
            splits. Its cost is the sum of its members' (each rounded to
            ``cost_multiple``), its weight the sum of theirs; ``max_items_per_bin``
            counts members and ``min_bins`` / ``bins_multiple_of`` split rows between
            whole groups. Packed as units by :func:`_pack_groups`, so every algorithm
            honours it. ``None``: every sequence alone (the same rows as singleton
            groups).

    Returns:
        :class:`Bins`: every index of ``lengths`` exactly once; each row's cost
        ``<= capacity``. Histogram-driven algorithms list each row's items
        longest first; ``next_fit`` keeps the input order. With ``groups``, a row
        lists its groups in the algorithm's order, each group's members in input
        order.

    Raises:
        ValueError: an unknown algorithm (listing the valid ones), a bad option,
            a length below 1 or above the capacity (naming its index, length
            and the capacity) or beyond int64, a weight below 0 or above
            ``max_weight_per_bin`` (naming its index), or fewer sequences than
            the rows required; with ``groups``: a group over the capacity, the weight cap
            or ``max_items_per_bin`` (naming its id and members), fewer groups than rows.
        TypeError: a length that is not an integer (naming its index and value).

    >>> bins = pack([5, 10, 3, 8, 6], capacity=16)
    >>> bins.to_lists()
    [[1, 4], [3, 0, 2]]
    >>> pack([5, 10, 3, 8, 6], capacity=16, algorithm="next_fit").to_lists()
    [[0, 1], [2, 3], [4]]
    >>> pack([5, 10, 3, 8, 6], capacity=2**31 - 1).to_lists()  # one row, in microseconds
    [[1, 3, 4, 0, 2]]
    >>> pack([5, 10, 3, 8, 6], 16, weights=[1, 3, 0, 2, 2], max_weight_per_bin=3).to_lists()
    [[1], [3, 0, 2], [4]]
    >>> pack([5, 10, 3, 8, 6], capacity=16, groups=[0, 0, 1, 1, 2]).to_lists()  # 0 and 1 together
    [[0, 1], [2, 3], [4]]
    """
    algo = _choose_algorithm(algorithm)
    capacity = _capacity(capacity)
    cost_multiple = positive_int("cost_multiple", cost_multiple)
    max_items = positive_int("max_items_per_bin", max_items_per_bin, allow_none=True)
    min_rows = 0 if min_bins is None else _non_negative_int("min_bins", min_bins)
    multiple_of = positive_int("bins_multiple_of", bins_multiple_of, allow_none=True) or 1
    seed = _non_negative_int("seed", seed)

    arr = _as_lengths(lengths)
    n = arr.shape[0]
    wts, cap_weight = _second_budget(weights, max_weight_per_bin, n)
    asked = f"min_bins={min_bins}, bins_multiple_of={bins_multiple_of}"
    rows = (min_rows, multiple_of, asked)
    if groups is not None:
        return _pack_groups(
            Groups.of(groups, n), arr, capacity, algo, cost_multiple, max_items, rows, seed, wts, cap_weight
        )
    return _pack_items(
        arr, capacity, algo, cost_multiple, max_items, min_rows, multiple_of, seed, wts, cap_weight, asked
    )


def _pack_items(
    arr: np.ndarray,
    capacity: int,
    algo: Algorithm,
    cost_multiple: int,
    max_items: int | None,
    min_rows: int,
    multiple_of: int,
    seed: int,
    wts: np.ndarray | None,
    cap_weight: int | None,
    asked: str,
    noun: str = "sequences",
) -> Bins:
    """:func:`pack` on validated settings; ``asked``: the row options as given and ``noun``:
    what the items are, for the errors."""
    n = arr.shape[0]
    if min_rows > n:
        raise ValueError(
            f"min_bins={min_rows} rows need at least {min_rows} {noun}, got {n}: lower min_bins or pack more {noun}"
        )
    cap_units = capacity // cost_multiple
    item_cap = _item_cap(max_items, n)
    if n == 0 or cap_units == 0:  # cap_units 0: no length fits (nor reaches a kernel as an int64 overflow)
        _check_fits(arr, capacity, cost_multiple)
        return Bins._trusted(np.zeros(0, np.int64), np.zeros(1, np.int64))
    k = _k.kernels(n)

    if wts is not None and cap_weight is not None:
        _check_fits(arr, capacity, cost_multiple)
        order, offsets = _pack_two(k, algo, arr, cost_multiple, cap_units, item_cap, wts, cap_weight, seed)
    elif algo in _HISTOGRAM_ALGORITHMS:
        sizes, counts, bucket, start = _group_by_size(k, arr, capacity, cost_multiple)
        records = _records(k, algo, sizes, counts, cap_units, item_cap)
        order, offsets = k.records_to_order(records, bucket, start)
        del bucket
    elif algo is Algorithm.FIRST_FIT_SHUFFLE:
        _check_fits(arr, capacity, cost_multiple)
        visit = np.random.default_rng(seed).permutation(n)
        order, offsets = k.first_fit_items(arr, cost_multiple, cap_units, item_cap, visit)
    else:  # next_fit
        _check_fits(arr, capacity, cost_multiple)
        offsets = k.next_fit_offsets(arr, cost_multiple, cap_units, item_cap, np.zeros(0, np.int64), 0)
        order = np.arange(n, dtype=np.int64)

    rows = offsets.shape[0] - 1
    target = round_up(max(rows, min_rows), multiple_of)
    if target > rows:
        if target > n:
            raise ValueError(
                f"{target} rows are required ({asked}, "
                f"packing made {rows}) but there are only {n} {noun} to fill them: pack more {noun}, "
                f"or lower min_bins / bins_multiple_of"
            )
        offsets = _split_rows(offsets, target)
    return Bins._trusted(order, offsets)


def _pack_groups(
    grouped: Groups,
    arr: np.ndarray,
    capacity: int,
    algo: Algorithm,
    cost_multiple: int,
    max_items: int | None,
    rows: tuple[int, int, str],
    seed: int,
    wts: np.ndarray | None,
    cap_weight: int | None,
) -> Bins:
    """:func:`pack` with ``groups``: the groups packed as units, then expanded to their members.

    A unit's length is its members' summed cost (each length rounded up to
    ``cost_multiple``, so the unit's own rounding changes nothing) and its weight their
    summed weight. ``max_items_per_bin`` counts members: with groups all of one size ``s``
    it caps the units at ``max_items // s``; with mixed sizes it becomes the second budget
    (each unit weighing its size) when that is free, else (weights capped too) the units
    are capped at ``max_items // largest group``, which holds but may leave rows short.
    Rows are split (``min_bins``, ``bins_multiple_of``) between units, so between groups.
    """
    if arr.shape[0] and int(arr.min()) < 1:
        i = int(np.argmin(arr))
        raise _too_long(i, int(arr[i]), capacity, cost_multiple)
    fits = capacity // cost_multiple * cost_multiple  # the longest length whose cost fits
    costs = round_up(np.minimum(arr, fits + 1), cost_multiple)  # clipped: the sums stay within int64
    unit_len = grouped.sum(costs)
    over = np.flatnonzero(unit_len > capacity)
    if over.size:
        g = int(over[0])
        cost = sum(round_up(int(x), cost_multiple) for x in arr[grouped.items([g])])
        rounded = "" if cost_multiple == 1 else f" (each length rounded up to a multiple of {cost_multiple})"
        raise ValueError(
            f"{grouped.describe(g)} costs {cost} tokens{rounded}, more than the capacity {capacity}: a group "
            f"is packed whole, never split over rows; drop or truncate its sequences when tokenizing, or raise "
            f"the capacity to at least {cost}"
        )
    unit_w, unit_cap = None, None
    if wts is not None and cap_weight is not None:
        unit_w, unit_cap = grouped.sum(np.minimum(wts, cap_weight + 1)), cap_weight
        heavy = np.flatnonzero(unit_w > cap_weight)
        if heavy.size:
            g = int(heavy[0])
            weight = sum(int(x) for x in wts[grouped.items([g])])
            raise ValueError(
                f"{grouped.describe(g)} weighs {weight} in all, more than max_weight_per_bin={cap_weight}: a group "
                f"is packed whole, never split over rows; drop or shrink its sequences, or raise "
                f"max_weight_per_bin to at least {weight}"
            )
    item_cap = max_items
    if max_items is not None and len(grouped):
        big = int(grouped.sizes.max())
        if big > max_items:
            g = int(np.argmax(grouped.sizes))
            raise ValueError(
                f"{grouped.describe(g)} holds {big} sequences, more than max_items_per_bin={max_items}: a group "
                f"is packed whole, never split over rows; raise max_items_per_bin to at least {big}"
            )
        if int(grouped.sizes.min()) == big:
            item_cap = max_items // big
        elif unit_w is None:  # mixed sizes: the members counted as the second budget
            unit_w, unit_cap, item_cap = grouped.sizes, max_items, None
        else:  # both budgets taken: a cap that holds for any mix
            item_cap = max_items // big
    min_rows, multiple_of, asked = rows
    units = _pack_items(
        unit_len,
        capacity,
        algo,
        cost_multiple,
        item_cap,
        min_rows,
        multiple_of,
        seed,
        unit_w,
        unit_cap,
        asked,
        noun="groups (a group is never split over rows)",
    )
    offsets = np.append(np.zeros(1, np.int64), np.cumsum(grouped.sizes[units.order]))[units.offsets]
    return Bins._trusted(grouped.items(units.order), offsets.astype(np.int64))


def _item_cap(max_items: int | None, n: int) -> int:
    """The kernels' ``max_items``: a cap above ``n`` never binds, so it is ``n + 1``
    (which also keeps it within int64 for the compiled kernels)."""
    return n + 1 if max_items is None or max_items > n else max_items


def _second_budget(
    weights: ArrayLike | None, max_weight_per_bin: object, n: int
) -> tuple[np.ndarray | None, int | None]:
    """The validated ``(weights, cap)`` of the second budget (either may be None)."""
    cap = None if max_weight_per_bin is None else _non_negative_int("max_weight_per_bin", max_weight_per_bin)
    if cap is not None and cap > _MAX_WEIGHT:
        raise ValueError(f"max_weight_per_bin must be at most 2**62 = {_MAX_WEIGHT}, got {cap}")
    if weights is None:
        if cap is not None:
            raise ValueError(
                f"max_weight_per_bin={cap} caps the weights per row, but no weights were given: pass weights=, "
                f"one per sequence"
            )
        return None, None
    wts = _as_lengths(weights, "weights")
    if wts.shape[0] != n:
        raise ValueError(f"weights has {wts.shape[0]} entries but there are {n} lengths: give one weight per sequence")
    if n and int(wts.min()) < 0:
        i = int(np.argmin(wts))
        raise ValueError(f"weights[{i}] = {int(wts[i])}: weights must be >= 0")
    if cap is not None and n and int(wts.max()) > cap:
        i = int(np.flatnonzero(wts > cap)[0])
        raise ValueError(
            f"weights[{i}] = {int(wts[i])} is more than max_weight_per_bin={cap}: no row can hold that sequence; "
            f"drop or split it first, or raise max_weight_per_bin to at least {int(wts[i])}"
        )
    return wts, cap


#: the largest second budget: a row's weight sum stays below 2**63 while it is being tested
_MAX_WEIGHT = 2**62


def _pack_two(
    k: ModuleType,
    algo: Algorithm,
    arr: np.ndarray,
    cost_multiple: int,
    cap_units: int,
    item_cap: int,
    weights: np.ndarray,
    cap_weight: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(order, offsets)`` under both budgets, item by item.

    - ``ffd``: cost descending (input order among equal costs), each into the first
      row where both its cost and its weight fit;
    - ``bfd``: the same order, each into the row left tightest in cost among those
      where both fit (among equals the one with the most weight room left, then the first);
    - ``greedy_knapsack``: one row at a time, taking the first item of that order whose
      cost and weight both fit;
    - ``first_fit_shuffle``: first fit in the seeded shuffled order;
    - ``next_fit``: input order, a new row when either budget or the item count is full.

    When the weights never bind, ``ffd``, ``greedy_knapsack``, ``first_fit_shuffle`` and
    ``next_fit`` give exactly their one-budget rows, and ``bfd`` rows of the same loads
    (rows of equal room may swap). The rows are found in trees over the rows (max trees of
    both rooms, depth first), no longer in the length histogram: first fit and greedy
    stay near ``O(n log n)``. Best fit indexes the rows by their token room while the
    capacity is small (:func:`_kernels.best_fit_two`, ``O(log U + log rows)`` a sequence);
    above that it is a branch and bound over the rows that may visit many of them per
    sequence when the second budget binds (same rows, ``benchmarks/bench_media.py``
    measures the dense route). Plain kernels (``k is _kernels.PLAIN``) take the branch and
    bound: over a few rows it is cheaper than walking a tree over ``0..U`` in Python.
    """
    n = arr.shape[0]
    if algo is Algorithm.NEXT_FIT:
        return np.arange(n, dtype=np.int64), k.next_fit_offsets(
            arr, cost_multiple, cap_units, item_cap, weights, cap_weight
        )
    if algo is Algorithm.FIRST_FIT_SHUFFLE:
        visit = np.random.default_rng(seed).permutation(n).astype(np.int64)
    else:
        visit = np.argsort(-_units(arr, cost_multiple), kind="stable").astype(np.int64)
    problem = (arr, cost_multiple, cap_units, item_cap, weights, cap_weight, visit)
    if algo is Algorithm.GREEDY_KNAPSACK:
        offsets = k.greedy_two(problem)
        return visit, offsets
    if algo is Algorithm.BFD and k is not _k.PLAIN and _inputs._dense_route(cap_units, n):
        return k.best_fit_two(problem)
    return k.any_fit_two(problem, algo is Algorithm.BFD)


def _group_by_size(
    k: ModuleType, arr: np.ndarray, capacity: int, cost_multiple: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The items grouped by cost, validated: ``(sizes, counts, bucket, start)``.

    ``sizes`` ``(D,)`` int64: the distinct unit sizes ascending; ``counts``
    ``(D,)``: items of each; ``bucket`` ``(n,)`` int32 (int64 from 2**31
    items): the item indices, largest size first and in input order within a
    size; ``start`` ``(D,)``: where each size's items begin in ``bucket``.

    Dense route: one counting pass and one dealing pass, ``O(n + U)``. Sparse
    route: a radix sort (at most 3 passes), ``O(n)``, nothing over ``U``. Both
    give the same arrays. With the plain kernels (``k is _kernels.PLAIN``, small
    inputs) a stable numpy argsort stands in for both: as plain Python the dense
    route's loop over ``0..U`` costs milliseconds per 10,000 units, and the radix
    sort's over its 2048 digits about a millisecond per pass; same arrays again.
    """
    n = arr.shape[0]
    cap_units = capacity // cost_multiple
    index_type = np.int32 if n < 2**31 else np.int64  # int32 halves the dealing traffic
    if k is not _k.PLAIN and _inputs._dense_route(cap_units, n):  # looked up here: a test can force a route
        hist, bad = k.scan_units(arr, cost_multiple, cap_units)
        if bad >= 0:
            raise _too_long(int(bad), int(arr[bad]), capacity, cost_multiple)
        bucket = np.empty(n, index_type)
        start = k.bucket_by_units(arr, cost_multiple, hist, bucket)
        sizes = np.flatnonzero(hist).astype(np.int64)
        return sizes, hist[sizes], bucket, start[sizes]
    _check_fits(arr, capacity, cost_multiple)
    if k is _k.PLAIN:  # numpy's stable sort: the radix sort's loops over 2048 digits cost ms in Python
        units = _units(arr, cost_multiple)
        sizes, counts = np.unique(units, return_counts=True)
        counts = counts.astype(np.int64)
        start = n - np.cumsum(counts)  # the larger sizes come first in bucket
        return sizes.astype(np.int64), counts, np.argsort(-units, kind="stable").astype(index_type), start
    bucket = np.empty(n, index_type)
    sizes, counts, start = k.sort_by_units(arr, cost_multiple, cap_units, bucket, np.empty(n, index_type))
    return sizes, counts, bucket, start


def _records(
    k: ModuleType, algo: Algorithm, sizes: np.ndarray, counts: np.ndarray, cap_units: int, item_cap: int
) -> _k.Records:
    if algo is Algorithm.BFD:
        return k.bfd_records(sizes, counts, cap_units, item_cap)
    if algo is Algorithm.FFD:
        return k.ffd_records(sizes, counts, cap_units, item_cap)
    return k.greedy_records(sizes, counts, cap_units, item_cap)


def _split_rows(offsets: np.ndarray, target: int) -> np.ndarray:
    """Split rows (contiguous runs of ``order``) until there are ``target`` of them.

    Chooses the piece count ``k_b`` of each row to minimise the largest piece
    (``P``: the smallest with ``sum(ceil(c_b / P)) <= target``, the rest of the
    pieces going to the first rows that can take one more), then cuts each row
    into ``k_b`` near-equal runs. Pieces are subsets, so capacity and
    ``max_items_per_bin`` still hold, and ``order`` is untouched.
    """
    sizes = np.diff(offsets)
    n = int(offsets[-1])
    lo, hi = 1, int(sizes.max())
    while lo < hi:
        mid = (lo + hi) // 2
        if int((-(-sizes // mid)).sum()) <= target:
            hi = mid
        else:
            lo = mid + 1
    pieces = -(-sizes // lo)
    extra = target - int(pieces.sum())
    if extra > 0:  # lo > 1 here, since sum(ceil(c / 1)) = n >= target
        more = -(-sizes // (lo - 1)) - pieces
        before = np.cumsum(more) - more
        pieces = pieces + np.clip(extra - before, 0, more)
    owner = np.repeat(np.arange(sizes.shape[0]), pieces)
    first = np.cumsum(pieces) - pieces
    i = np.arange(target, dtype=np.int64) - first[owner]
    starts = offsets[:-1][owner] + (i * sizes[owner]) // pieces[owner]
    return np.append(starts, n).astype(np.int64)


def pack_histogram(
    lengths: ArrayLike,
    counts: ArrayLike,
    capacity: int,
    algorithm: str | Algorithm = "bfd",
    *,
    cost_multiple: int = 1,
    max_items_per_bin: int | None = None,
) -> HistogramBins:
    """Pack a length histogram (``counts[j]`` sequences of ``lengths[j]``) without item indices.

    The same rows as :func:`pack` on the expanded lengths, in memory
    proportional to the rows, not to the sequences. Only the histogram-driven
    algorithms (``bfd``, ``ffd``, ``greedy_knapsack``) apply.

    Args:
        lengths: ``(k,)`` integer lengths (repeats are allowed).
        counts: ``(k,)`` integer counts, ``>= 0``.
        capacity, algorithm, cost_multiple, max_items_per_bin: as in :func:`pack`.

    Returns:
        :class:`HistogramBins`.

    >>> hb = pack_histogram([10, 8, 6, 5, 3], [1, 1, 1, 1, 1], capacity=16)
    >>> [(l.tolist(), c.tolist()) for l, c in hb]
    [([10, 6], [1, 1]), ([8, 5, 3], [1, 1, 1])]
    """
    algo = _choose_algorithm(algorithm)
    if algo not in _HISTOGRAM_ALGORITHMS:
        valid = ", ".join(repr(a.value) for a in _HISTOGRAM_ALGORITHMS)
        raise ValueError(f"pack_histogram needs a histogram-driven algorithm ({valid}), got {algo.value!r}")
    capacity = _capacity(capacity)
    cost_multiple = positive_int("cost_multiple", cost_multiple)
    max_items = positive_int("max_items_per_bin", max_items_per_bin, allow_none=True)
    values = _as_lengths(lengths)
    cnts = _as_counts(counts, values)
    used = cnts > 0
    values, cnts = values[used], cnts[used]
    _check_fits(values, capacity, cost_multiple, indexed=False)
    empty = np.zeros(0, np.int64)
    if values.shape[0] == 0:
        return HistogramBins(np.zeros(1, np.int64), empty, empty)
    units = _units(values, cost_multiple)
    by_class = np.lexsort((-values, units))  # within a cost class, longest first
    run_len, run_cnt, run_units = values[by_class], cnts[by_class], units[by_class]
    first = np.flatnonzero(np.diff(run_units, prepend=run_units[0] - 1))  # where each size's runs start
    sizes = run_units[first]
    per_size = np.add.reduceat(run_cnt, first)
    run_start = np.append(first, run_units.shape[0]).astype(np.int64)
    n = int(per_size.sum())
    k = _k.kernels(n)
    cap_units = capacity // cost_multiple
    records = _records(k, algo, sizes, per_size, cap_units, _item_cap(max_items, n))
    offsets, out_len, out_cnt = k.records_to_runs(records, run_len, run_cnt, run_start)
    return HistogramBins(offsets, out_len, out_cnt)
