"""The kernels every packing family shares: the registry, a max segment tree,
the grouping of items by cost, and the records turned into bins.

Part of the loops behind :mod:`sftpack.binpack` (units, size ranks, records and
how the kernels compile or run as plain Python: :mod:`._kernels`, which builds
both tables from the kernels these modules register). Here:

- :func:`_kernel`, which registers a kernel (it stays plain Python until
  :func:`._kernels.load`), and :data:`Records`, what the histogram kernels return;
- a max (or min) segment tree over bins or size ranks (:func:`_tree_set`,
  :func:`_tree_leftmost_ge`, :func:`_tree_prefix_max`), used by FFD, first fit,
  greedy and the two-budget kernels;
- grouping the items by cost: the dense route (:func:`scan_units` +
  :func:`bucket_by_units`, arrays over ``0..U``) and the sparse one
  (:func:`sort_by_units`, a radix sort), the same groups either way;
- histogram sums and the any-fit bin bound (:func:`_totals`, :func:`_max_bins`);
- records: made in the arrays of :func:`_new_records` by :func:`_record`,
  turned into bins by :func:`records_to_order` (item indices) and
  :func:`records_to_runs` (per-bin histograms); and
  :func:`_grouped_by_bin` for the kernels that place item by item.

The family modules: :mod:`._kernels_fit` (best fit and first fit: BFD, FFD,
shuffled first fit), :mod:`._kernels_next` (next fit, greedy knapsack) and
:mod:`._kernels_two` (two budgets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

_F = TypeVar("_F", bound=Callable[..., Any])

#: ``(first bin, end bin, size rank, count, before, n_records, n_bins)``, see :func:`._kernels_fit.bfd_records`
Records = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]

#: every kernel's name, in the order the family modules define them (re-exported by :mod:`._kernels`)
_KERNELS: list[str] = []
#: every kernel as defined (plain Python), by name: what :func:`._kernels.load` compiles
#: and :data:`._kernels.PLAIN` copies
_DEFINED: dict[str, Callable[..., Any]] = {}


def _kernel(fn: _F) -> _F:
    """Register ``fn`` as a kernel: compiled by :func:`._kernels.load`, plain Python until then."""
    if fn.__name__ in _DEFINED:  # load() swaps kernels by name, in every module that binds it
        raise RuntimeError(f"two kernels are named {fn.__name__!r}")
    _KERNELS.append(fn.__name__)
    _DEFINED[fn.__name__] = fn
    return fn


# Every array that may hold up to one slot per item or per bin is allocated
# with ``np.empty`` at its worst-case size instead of grown: pages that are
# never written cost no memory, and loops that may reallocate an array run
# several times slower under numba.


# ----------------------------------------------------------------------------
# a max segment tree: ``tree[leaves + i]`` is leaf ``i``, ``leaves`` a power of two
# (a min tree where a helper takes ``sign``: :data:`_MIN`)

#: ``sign`` of a max tree and of a min tree (typed: a literal argument would compile the helper once more)
_MAX = np.int64(1)
_MIN = np.int64(-1)


@_kernel
def _tree_set(tree: np.ndarray, leaves: int, i: int, value: int, sign: int) -> None:
    """Set leaf ``i`` of a max tree (``sign`` :data:`_MAX`) or a min tree (:data:`_MIN`)."""
    larger = sign > 0
    i += leaves
    tree[i] = value
    i >>= 1
    while i >= 1:
        left = tree[2 * i]
        right = tree[2 * i + 1]
        tree[i] = left if (left >= right) == larger else right
        i >>= 1


@_kernel
def _tree_leftmost_ge(tree: np.ndarray, leaves: int, value: int) -> int:
    """Index of the leftmost leaf holding ``>= value``, or -1."""
    if tree[1] < value:
        return -1
    i = 1
    while i < leaves:
        i *= 2
        if tree[i] < value:
            i += 1
    return i - leaves


@_kernel
def _tree_prefix_max(tree: np.ndarray, leaves: int, last: int) -> int:
    """Largest value among leaves ``0..last``."""
    lo = leaves
    hi = leaves + last + 1
    best = 0
    while lo < hi:
        if lo & 1:
            if tree[lo] > best:
                best = tree[lo]
            lo += 1
        if hi & 1:
            hi -= 1
            if tree[hi] > best:
                best = tree[hi]
        lo >>= 1
        hi >>= 1
    return best


@_kernel
def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


# ----------------------------------------------------------------------------
# passes over the lengths (the dense route: arrays over units 0..U)


@_kernel
def scan_units(lengths: np.ndarray, multiple: int, cap_units: int) -> tuple[np.ndarray, int]:
    """Histogram of item units ``(cap_units + 1,)`` int64, and the first invalid index.

    An item is invalid when its length is below 1 or its units exceed
    ``cap_units``; the histogram is then incomplete and the index is ``>= 0``.
    """
    counts = np.zeros(cap_units + 1, np.int64)
    n = lengths.shape[0]
    if multiple == 1:  # no division in the hot loop
        for i in range(n):
            x = lengths[i]
            if x < 1 or x > cap_units:
                return counts, i
            counts[x] += 1
    else:
        for i in range(n):
            x = lengths[i]
            if x < 1:
                return counts, i
            u = (x + multiple - 1) // multiple
            if u > cap_units:
                return counts, i
            counts[u] += 1
    return counts, -1


@_kernel
def bucket_by_units(lengths: np.ndarray, multiple: int, counts: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Stable counting sort of item indices by units, largest first, into ``out`` ``(n,)``.

    Returns ``start`` ``(U + 1,)``: the items of ``u`` units are
    ``out[start[u]:start[u] + counts[u]]``, in input order. Largest first is
    the order in which BFD and FFD consume them, so dealing reads ``out``
    front to back.
    """
    cap_units = counts.shape[0] - 1
    start = np.zeros(cap_units + 1, np.int64)
    acc = 0
    for u in range(cap_units, -1, -1):
        start[u] = acc
        acc += counts[u]
    pos = start.copy()
    n = lengths.shape[0]
    if multiple == 1:
        for i in range(n):
            u = lengths[i]
            out[pos[u]] = i
            pos[u] += 1
    else:
        for i in range(n):
            u = (lengths[i] + multiple - 1) // multiple
            out[pos[u]] = i
            pos[u] += 1
    return start


# ----------------------------------------------------------------------------
# the sparse route: a radix sort, nothing indexed by units


@_kernel
def _radix_pass(
    key: np.ndarray,
    index: np.ndarray,
    key_to: np.ndarray,
    index_to: np.ndarray,
    shift: int,
    count: np.ndarray,
    first: bool,
) -> None:
    """One stable counting pass on the 11 bits of ``key`` at ``shift``: ``(key, index)``
    -> ``(key_to, index_to)``; the first pass reads the identity for ``index``."""
    n = key.shape[0]
    for d in range(2048):
        count[d] = 0
    for p in range(n):
        count[(key[p] >> shift) & 2047] += 1
    acc = 0
    for d in range(2048):
        c = count[d]
        count[d] = acc
        acc += c
    for p in range(n):
        k = key[p]
        d = (k >> shift) & 2047
        q = count[d]
        count[d] = q + 1
        index_to[q] = p if first else index[p]
        key_to[q] = k


@_kernel
def sort_by_units(
    lengths: np.ndarray, multiple: int, cap_units: int, out: np.ndarray, scratch: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Item indices grouped by units, largest first, input order within a size, into ``out`` ``(n,)``.

    An LSD radix sort of the keys ``U - units`` (``< 2**31``) in digits of 11
    bits, the keys travelling with the indices so every pass reads
    sequentially; a digit on which no two keys differ is skipped (3 passes at
    most, often 1-2). ``O(n)`` time and 12 bytes per item of scratch (two
    int32 key arrays and ``scratch``) for any capacity: the sparse route's counterpart of :func:`scan_units` +
    :func:`bucket_by_units`. Lengths must be valid (``1 <= units <= U``);
    ``scratch`` is ``(n,)`` like ``out``. Returns ``(sizes, counts, start)``,
    each ``(D,)`` int64 by size rank (sizes ascending): the items of
    ``sizes[k]`` units are ``out[start[k]:start[k] + counts[k]]``.
    """
    n = out.shape[0]
    key = np.empty(n, np.int32)
    key_to = np.empty(n, np.int32)
    k_or = 0
    k_and = (1 << 31) - 1
    for i in range(n):
        u = lengths[i] if multiple == 1 else (lengths[i] + multiple - 1) // multiple
        k = cap_units - u
        key[i] = k
        k_or |= k
        k_and &= k
    varying = k_or ^ k_and  # the bits on which some keys differ
    count = np.empty(2048, np.int64)
    passes = 0
    for step in range(3):
        shift = 11 * step
        if (varying >> shift) & 2047 == 0:
            continue
        # even passes read (key, scratch) and write (key_to, out); odd ones the reverse
        if passes % 2 == 0:
            _radix_pass(key, scratch, key_to, out, shift, count, passes == 0)
        else:
            _radix_pass(key_to, out, key, scratch, shift, count, passes == 0)
        passes += 1
    if passes == 0:  # every item has the same size
        for p in range(n):
            out[p] = p
    elif passes % 2 == 0:  # the last pass wrote into scratch and key
        for p in range(n):
            out[p] = scratch[p]
    if passes % 2 == 1:
        key = key_to
    n_sizes = 0
    for p in range(n):
        if p == 0 or key[p] != key[p - 1]:
            n_sizes += 1
    sizes = np.empty(n_sizes, np.int64)
    counts = np.zeros(n_sizes, np.int64)
    start = np.empty(n_sizes, np.int64)
    rank = n_sizes
    for p in range(n):
        if p == 0 or key[p] != key[p - 1]:
            rank -= 1
            sizes[rank] = cap_units - key[p]
            start[rank] = p
        counts[rank] += 1
    return sizes, counts, start


# ----------------------------------------------------------------------------
# histograms: totals and the any-fit bound


@_kernel
def _totals(sizes: np.ndarray, counts: np.ndarray) -> tuple[int, int]:
    """(items, units) of a histogram."""
    n_items = 0
    n_units = np.int64(0)
    for k in range(sizes.shape[0]):
        n_items += counts[k]
        n_units += sizes[k] * counts[k]
    return n_items, n_units


@_kernel
def _max_bins(n_items: int, n_units: int, cap_units: int, max_items: int) -> int:
    """An upper bound on the bins of any any-fit packing (BFD, FFD, first fit).

    A new bin opens only when no open bin that may take more items has room,
    so among the bins below ``max_items`` items at most one is half full or
    less: bins ``<= n / max_items + 2 * units / U + 1``.
    """
    if n_items == 0:
        return 0
    bound = n_items // max_items + 2 * (n_units // cap_units) + 2
    return n_items if n_items < bound else bound


# ----------------------------------------------------------------------------
# records: made by the histogram kernels, turned into bins

#: the record arrays while a kernel makes them: ``(first bin, end bin, size rank, count, before)``
RecordArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@_kernel
def _new_records(n: int) -> RecordArrays:
    """Room for ``n`` records; a kernel's records each place at least one item, so its
    items bound them (pages never written cost no memory)."""
    return (
        np.empty(n, np.int64),
        np.empty(n, np.int64),
        np.empty(n, np.int32),
        np.empty(n, np.int32),
        np.empty(n, np.int64),
    )


@_kernel
def _record(recs: RecordArrays, nr: int, a: int, b: int, s: int, j: int, f: int) -> int:
    """Append record ``nr``: bins ``a..b-1`` each take ``j`` items of size rank ``s`` after ``f``."""
    rec_a, rec_b, rec_s, rec_j, rec_f = recs
    rec_a[nr] = a
    rec_b[nr] = b
    rec_s[nr] = s
    rec_j[nr] = j
    rec_f[nr] = f
    return nr + 1


@_kernel
def _bin_offsets(rec_a: np.ndarray, rec_b: np.ndarray, per: np.ndarray, nr: int, n_bins: int) -> np.ndarray:
    """``(n_bins + 1,)`` offsets from records adding ``per[i]`` to bins ``rec_a[i]..rec_b[i]-1``."""
    offsets = np.zeros(n_bins + 1, np.int64)
    for i in range(nr):  # first as differences of the bin sizes ...
        offsets[rec_a[i]] += per[i]
        offsets[rec_b[i]] -= per[i]
    size = 0
    acc = 0
    for b in range(n_bins + 1):  # ... then, in place, their running sums
        size += offsets[b]
        offsets[b] = acc
        acc += size
    return offsets


@_kernel
def records_to_order(records: Records, bucket: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deal the items of ``bucket`` to the bins, replaying the ``records`` in their order.

    ``bucket`` ``(n,)`` holds the item indices grouped by size, largest first
    (input order within a size); the items of size rank ``k`` start at
    ``bucket[start[k]]`` (``start`` ``(D,)``).

    Each record hands each of its bins the next ``count`` items of its size,
    placed after the ``before`` items the bin holds, so a bin lists its items
    in record order. A record's bins are consecutive, so the writes stream.
    Returns ``(order (n,) int64, offsets (n_bins + 1,) int64)``.
    """
    rec_a, rec_b, rec_s, rec_j, rec_f, nr, n_bins = records
    offsets = _bin_offsets(rec_a, rec_b, rec_j, nr, n_bins)
    ptr = start.copy()
    order = np.empty(bucket.shape[0], np.int64)
    for i in range(nr):
        s = rec_s[i]
        j = rec_j[i]
        f = rec_f[i]
        q = ptr[s]
        if j == 1:  # the common case on short rows
            for b in range(rec_a[i], rec_b[i]):
                order[offsets[b] + f] = bucket[q]
                q += 1
        else:
            for b in range(rec_a[i], rec_b[i]):
                p = offsets[b] + f
                for t in range(j):
                    order[p + t] = bucket[q + t]
                q += j
        ptr[s] = q
    return order, offsets


@_kernel
def records_to_runs(
    records: Records, run_len: np.ndarray, run_cnt: np.ndarray, run_start: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like :func:`records_to_order` for a histogram: the items of size rank
    ``k`` are the runs ``run_start[k]:run_start[k + 1]`` (``run_cnt`` items of
    length ``run_len`` each), handed out front to back. Returns ``(offsets
    (n_bins + 1,), length (m,), count (m,))``: bin ``b`` holds ``count[j]``
    items of ``length[j]`` for ``j`` in ``offsets[b]:offsets[b + 1]``.
    """
    rec_a, rec_b, rec_s, rec_j, rec_f, nr, n_bins = records
    per_bin = np.zeros(n_bins + 1, np.int64)
    out_len = np.empty(0, np.int64)
    out_cnt = np.empty(0, np.int64)
    cursor = per_bin[1:]
    # two passes over the records, each bin drawing one (length, count) piece per run it
    # draws from: the first counts each bin's pieces (at per_bin[b + 1]), the second writes them
    for write in range(2):
        if write:
            for b in range(n_bins):
                per_bin[b + 1] += per_bin[b]
            m = per_bin[n_bins]
            out_len = np.empty(m, np.int64)
            out_cnt = np.empty(m, np.int64)
            cursor = per_bin[:n_bins].copy()
        ptr = run_start[:-1].copy()
        left = run_cnt.copy()
        for i in range(nr):
            s = rec_s[i]
            for b in range(rec_a[i], rec_b[i]):
                c = rec_j[i]
                while c > 0:
                    p = ptr[s]
                    take = left[p] if left[p] < c else c
                    left[p] -= take
                    c -= take
                    if write:
                        out_len[cursor[b]] = run_len[p]
                        out_cnt[cursor[b]] = take
                    cursor[b] += 1
                    if left[p] == 0:
                        ptr[s] = p + 1
    return per_bin, out_len, out_cnt


# ----------------------------------------------------------------------------
# bins from the bin of each visited item (the item-by-item kernels)


@_kernel
def _grouped_by_bin(
    bin_of: np.ndarray, fill: np.ndarray, n_bins: int, visit: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(order, offsets)`` from ``bin_of[t]``, the bin of the ``t``-th visited item: each
    bin's items in visiting order, bins one after another (``fill`` counts each bin's)."""
    n = visit.shape[0]
    offsets = np.zeros(n_bins + 1, np.int64)
    for b in range(n_bins):
        offsets[b + 1] = offsets[b] + fill[b]
    pos = offsets[:n_bins].copy()
    order = np.empty(n, np.int64)
    for t in range(n):
        b = bin_of[t]
        order[pos[b]] = visit[t]
        pos[b] += 1
    return order, offsets
