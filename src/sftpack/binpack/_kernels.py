"""The loops behind :mod:`sftpack.binpack`, compiled with numba when it is installed.

Every kernel works in *units*: an item of length ``L`` costs
``u = ceil(L / cost_multiple)`` units and a bin holds ``U = capacity // cost_multiple``
units, so "a bin never overflows after padding" is the plain integer test
``sum(u) <= U``.

Three kernels decide the bins from the *histogram* of units alone (items of
equal cost are interchangeable) and emit *records* ``(first bin, end bin,
size, count, before)``: "each of the bins ``first..end-1`` receives ``count``
items of ``size`` units after the ``before`` it holds" (:func:`bfd_records`,
:func:`ffd_records`, :func:`greedy_records`). BFD keeps bins in segments of
equal history, so it needs few records (about 25,000 for 10M SFT-like lengths,
1,400 for Wikipedia's 16.3M); FFD and greedy make one per (bin, size) pair
(2.3M and 16M there), which is why they are 3-8x slower. Two kernels then turn records into item indices
(:func:`records_to_order`, after :func:`bucket_by_units` has grouped the item
indices by size with a counting sort) or into per-bin histograms
(:func:`records_to_runs`). :func:`first_fit_items` (shuffled first fit) and
:func:`next_fit_offsets` need the item order and go item by item.

Without numba the same functions run as plain Python: correct, about 100x
slower, fine for a few thousand items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

_F = TypeVar("_F", bound=Callable[..., Any])

#: ``(first bin, end bin, size, count, before, n_records, n_bins)``, see :func:`bfd_records`
Records = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]

try:  # numba is optional: the kernels are plain Python that it compiles.
    import numba as _numba

    HAVE_NUMBA = True

    def _jit(fn: _F) -> _F:
        return _numba.njit(cache=True, nogil=True)(fn)  # type: ignore[no-any-return]

except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAVE_NUMBA = False

    def _jit(fn: _F) -> _F:
        return fn


# Every array that may hold up to one slot per item or per bin is allocated
# with ``np.empty`` at its worst-case size instead of grown: pages that are
# never written cost no memory, and loops that may reallocate an array run
# several times slower under numba.


# ----------------------------------------------------------------------------
# a max segment tree: ``tree[leaves + i]`` is leaf ``i``, ``leaves`` a power of two


@_jit
def _tree_set(tree: np.ndarray, leaves: int, i: int, value: int) -> None:
    i += leaves
    tree[i] = value
    i >>= 1
    while i >= 1:
        left = tree[2 * i]
        right = tree[2 * i + 1]
        tree[i] = left if left >= right else right
        i >>= 1


@_jit
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


@_jit
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


@_jit
def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


# ----------------------------------------------------------------------------
# passes over the lengths


@_jit
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


@_jit
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
# histogram-driven algorithms: emit records (first bin, end bin, size, count)


@_jit
def _totals(counts: np.ndarray) -> tuple[int, int, int]:
    """(items, units, smallest size present) of a histogram."""
    n_items = 0
    n_units = 0
    smallest = counts.shape[0]
    for s in range(counts.shape[0] - 1, 0, -1):
        if counts[s] > 0:
            n_items += counts[s]
            n_units += s * counts[s]
            smallest = s
    return n_items, n_units, smallest


@_jit
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


@_jit
def _shelve(
    g: int,
    room: int,
    fill: int,
    smallest: int,
    max_items: int,
    head: np.ndarray,
    tree: np.ndarray,
    leaves: int,
    seg_next: np.ndarray,
    free: int,
) -> int:
    """Put segment ``g`` (room ``room``, ``fill`` items per bin) on its room's stack,
    or on the free list when its bins can take nothing more. Returns the free list."""
    if room >= smallest and fill < max_items:
        if head[room] < 0:
            _tree_set(tree, leaves, room, room)
        seg_next[g] = head[room]
        head[room] = g
        return free
    seg_next[g] = free
    return g


@_jit
def _record(
    rec_a: np.ndarray, rec_b: np.ndarray, rec_s: np.ndarray, rec_j: np.ndarray, rec_f: np.ndarray,
    nr: int, a: int, b: int, s: int, j: int, f: int,
) -> int:
    """Append record ``nr``: bins ``a..b-1`` each take ``j`` items of size ``s`` after ``f``."""
    rec_a[nr] = a
    rec_b[nr] = b
    rec_s[nr] = s
    rec_j[nr] = j
    rec_f[nr] = f
    return nr + 1


@_jit
def _open_segment(
    a: int, width: int, s: int, take: int, fill: int, room: int, smallest: int, max_items: int,
    head: np.ndarray, tree: np.ndarray, leaves: int,
    seg_a: np.ndarray, seg_b: np.ndarray, seg_fill: np.ndarray, seg_next: np.ndarray, n_seg: int, free: int,
    rec_a: np.ndarray, rec_b: np.ndarray, rec_s: np.ndarray, rec_j: np.ndarray, rec_f: np.ndarray, nr: int,
) -> tuple[int, int, int]:
    """A new segment of bins ``a..a+width-1`` that each held ``fill`` items and take
    ``take`` more of size ``s``: recorded, then shelved at ``room``.
    Returns the updated ``(nr, n_seg, free)``."""
    if free >= 0:
        h = free
        free = seg_next[free]
    else:
        h = n_seg
        n_seg += 1
    seg_a[h] = a
    seg_b[h] = a + width
    seg_fill[h] = fill + take
    nr = _record(rec_a, rec_b, rec_s, rec_j, rec_f, nr, a, a + width, s, take, fill)
    free = _shelve(h, room, fill + take, smallest, max_items, head, tree, leaves, seg_next, free)
    return nr, n_seg, free


@_jit
def bfd_records(counts: np.ndarray, max_items: int) -> Records:
    """Best-fit decreasing over a histogram of units.

    Bins are kept in *segments*: runs of consecutive bin ids with one history,
    hence one room and one item count. Segments with equal room are
    interchangeable and share a stack. For each size ``s``, largest first,
    the best fit is any bin of the smallest non-empty room ``r >= s`` (a max
    segment tree over rooms whose leaf ``r`` holds ``r`` while that stack is
    non-empty); that bin stays the best fit until its room drops below ``s``,
    so each bin of a segment takes ``j = min(r // s, max_items - fill)`` at
    once, and the segment moves whole to room ``r - j * s``. Only the last
    segment a size touches is split. New bins open as one segment per size.

    Returns ``(first, end, size, count, before, n_records, n_bins)``: record
    ``i`` puts ``count[i]`` items of ``size[i]`` units into each bin
    ``first[i]..end[i]-1``, after the ``before[i]`` items each of them holds
    already (a segment's bins share their whole history, so they hold the
    same number); records come in the order BFD makes them (sizes descending).
    """
    cap_units = counts.shape[0] - 1
    n_items, n_units, smallest = _totals(counts)
    leaves = _pow2_at_least(cap_units + 1)
    tree = np.zeros(2 * leaves, np.int64)
    head = np.full(cap_units + 1, -1, np.int64)

    # live segments partition the live bins: at most max_bins (+2 while splitting)
    pool = _max_bins(n_items, n_units, cap_units, max_items) + 4
    seg_a = np.empty(pool, np.int64)  # first bin
    seg_b = np.empty(pool, np.int64)  # one past the last bin
    seg_fill = np.empty(pool, np.int64)  # items in each of its bins
    seg_next = np.empty(pool, np.int64)  # next segment on the stack / free list
    free = -1
    n_seg = 0

    rec_a = np.empty(n_items, np.int64)  # each record places >= 1 item
    rec_b = np.empty(n_items, np.int64)
    rec_s = np.empty(n_items, np.int32)
    rec_j = np.empty(n_items, np.int32)
    rec_f = np.empty(n_items, np.int64)
    nr = 0
    n_bins = 0

    for s in range(cap_units, 0, -1):
        k = counts[s]
        while k > 0:
            r = _tree_leftmost_ge(tree, leaves, s)
            if r < 0:
                break
            q = r // s
            g = head[r]
            while g >= 0:
                after = seg_next[g]
                a = seg_a[g]
                b = seg_b[g]
                f = seg_fill[g]
                j = q if q <= max_items - f else max_items - f
                if (b - a) * j <= k:  # the whole segment
                    nr = _record(rec_a, rec_b, rec_s, rec_j, rec_f, nr, a, b, s, j, f)
                    k -= (b - a) * j
                    seg_fill[g] = f + j
                    free = _shelve(g, r - j * s, f + j, smallest, max_items, head, tree, leaves, seg_next, free)
                    g = after
                    if k == 0:
                        break
                    continue
                # part of it: t bins take j items each, then maybe one bin takes the rest
                t = k // j
                rest = k - t * j
                for take, width in ((j, t), (rest, 1 if rest > 0 else 0)):
                    if width == 0:
                        continue
                    nr, n_seg, free = _open_segment(
                        a, width, s, take, f, r - take * s, smallest, max_items, head, tree, leaves,
                        seg_a, seg_b, seg_fill, seg_next, n_seg, free, rec_a, rec_b, rec_s, rec_j, rec_f, nr,
                    )
                    a += width
                k = 0
                if a < b:
                    seg_a[g] = a  # g keeps its untouched bins, still first on this stack
                else:
                    seg_next[g] = free
                    free = g
                    g = after
                break
            head[r] = g
            if g < 0:
                _tree_set(tree, leaves, r, 0)
        if k > 0:  # no bin has room: open new ones, filled with this size
            per_bin = cap_units // s
            if max_items < per_bin:
                per_bin = max_items
            full = k // per_bin
            rest = k - full * per_bin
            for take, width in ((per_bin, full), (rest, 1 if rest > 0 else 0)):
                if width == 0:
                    continue
                nr, n_seg, free = _open_segment(
                    n_bins, width, s, take, 0, cap_units - take * s, smallest, max_items, head, tree, leaves,
                    seg_a, seg_b, seg_fill, seg_next, n_seg, free, rec_a, rec_b, rec_s, rec_j, rec_f, nr,
                )
                n_bins += width
    return rec_a[:nr], rec_b[:nr], rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


@_jit
def ffd_records(counts: np.ndarray, max_items: int) -> Records:
    """First-fit decreasing over a histogram of units.

    A max segment tree over bins (leaf = room, 0 once at ``max_items``) finds
    the leftmost bin with room ``>= s``; it stays the leftmost fit until its
    room drops below ``s``, so it takes its share of the size at once.
    Same return as :func:`bfd_records`, one bin per record.
    """
    cap_units = counts.shape[0] - 1
    n_items, n_units, _ = _totals(counts)
    leaves = _pow2_at_least(_max_bins(n_items, n_units, cap_units, max_items))
    tree = np.zeros(2 * leaves, np.int64)
    fill = np.zeros(leaves, np.int64)
    rec_a = np.empty(n_items, np.int64)
    rec_s = np.empty(n_items, np.int32)
    rec_j = np.empty(n_items, np.int32)
    rec_f = np.empty(n_items, np.int64)
    nr = 0
    n_bins = 0
    for s in range(cap_units, 0, -1):
        k = counts[s]
        while k > 0:
            b = _tree_leftmost_ge(tree, leaves, s)
            if b < 0:
                b = n_bins
                n_bins += 1
                room = cap_units
            else:
                room = tree[leaves + b]
            j = room // s
            if max_items - fill[b] < j:
                j = max_items - fill[b]
            if k < j:
                j = k
            rec_a[nr] = b
            rec_s[nr] = s
            rec_j[nr] = j
            rec_f[nr] = fill[b]
            nr += 1
            k -= j
            fill[b] += j
            room -= j * s
            _tree_set(tree, leaves, b, room if fill[b] < max_items else 0)
    return rec_a[:nr], rec_a[:nr] + 1, rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


@_jit
def greedy_records(counts: np.ndarray, max_items: int) -> Records:
    """Greedy knapsack: fill one bin at a time with the largest item that fits.

    A max segment tree over sizes (leaf ``s`` holds ``s`` while items of that
    size are left) gives the largest size ``<= room`` by a prefix maximum.
    This makes the same bins as first-fit decreasing (FFD's first bin is
    exactly the greedy fill of the sorted items, and so on) by another route.
    Same return as :func:`bfd_records`, one bin per record, bin after bin.
    """
    cap_units = counts.shape[0] - 1
    left = counts.copy()
    remaining, _, _ = _totals(counts)
    leaves = _pow2_at_least(cap_units + 1)
    tree = np.zeros(2 * leaves, np.int64)
    for s in range(1, cap_units + 1):
        if left[s] > 0:
            _tree_set(tree, leaves, s, s)
    rec_a = np.empty(remaining, np.int64)
    rec_s = np.empty(remaining, np.int32)
    rec_j = np.empty(remaining, np.int32)
    rec_f = np.empty(remaining, np.int64)
    nr = 0
    n_bins = 0
    while remaining > 0:
        b = n_bins
        n_bins += 1
        room = cap_units
        fill = 0
        while fill < max_items and room > 0:
            s = _tree_prefix_max(tree, leaves, room)
            if s <= 0:
                break
            j = room // s
            if left[s] < j:
                j = left[s]
            if max_items - fill < j:
                j = max_items - fill
            rec_a[nr] = b
            rec_s[nr] = s
            rec_j[nr] = j
            rec_f[nr] = fill
            nr += 1
            left[s] -= j
            if left[s] == 0:
                _tree_set(tree, leaves, s, 0)
            room -= j * s
            fill += j
            remaining -= j
    return rec_a[:nr], rec_a[:nr] + 1, rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


# ----------------------------------------------------------------------------
# records -> bins


@_jit
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


@_jit
def records_to_order(
    rec_a: np.ndarray,
    rec_b: np.ndarray,
    rec_s: np.ndarray,
    rec_j: np.ndarray,
    rec_f: np.ndarray,
    nr: int,
    n_bins: int,
    bucket: np.ndarray,
    start: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Deal the items of ``bucket`` (grouped by units, see :func:`bucket_by_units`)
    to the bins, replaying the records in their order.

    Each record hands each of its bins the next ``count`` items of its size,
    placed after the ``before`` items the bin holds, so a bin lists its items
    in record order. A record's bins are consecutive, so the writes stream.
    Returns ``(order (n,) int64, offsets (n_bins + 1,) int64)``.
    """
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


@_jit
def records_to_runs(
    rec_a: np.ndarray,
    rec_b: np.ndarray,
    rec_s: np.ndarray,
    rec_j: np.ndarray,
    rec_f: np.ndarray,
    nr: int,
    n_bins: int,
    run_len: np.ndarray,
    run_cnt: np.ndarray,
    run_start: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like :func:`records_to_order` for a histogram: the items of ``u`` units
    are the runs ``run_start[u]:run_start[u + 1]`` (``run_cnt`` items of length
    ``run_len`` each), handed out front to back. Returns ``(offsets
    (n_bins + 1,), length (m,), count (m,))``: bin ``b`` holds ``count[j]``
    items of ``length[j]`` for ``j`` in ``offsets[b]:offsets[b + 1]``.
    """
    # first pass: how many (length, count) pieces each bin gets (one per run it draws from)
    per_bin = np.zeros(n_bins + 1, np.int64)
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
                per_bin[b + 1] += 1
                if left[p] == 0:
                    ptr[s] = p + 1
    for b in range(n_bins):
        per_bin[b + 1] += per_bin[b]
    m = per_bin[n_bins]  # second pass: write them
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
                out_len[cursor[b]] = run_len[p]
                out_cnt[cursor[b]] = take
                cursor[b] += 1
                if left[p] == 0:
                    ptr[s] = p + 1
    return per_bin, out_len, out_cnt


# ----------------------------------------------------------------------------
# order-driven algorithms


@_jit
def first_fit_items(
    lengths: np.ndarray, multiple: int, cap_units: int, max_items: int, visit: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """First fit of the items in the order ``visit`` (a permutation of ``0..n-1``).

    Returns ``(order, offsets)``; each bin lists its items in visiting order.
    """
    n = visit.shape[0]
    n_units = 0
    for t in range(n):
        n_units += (lengths[visit[t]] + multiple - 1) // multiple
    leaves = _pow2_at_least(_max_bins(n, n_units, cap_units, max_items))
    tree = np.zeros(2 * leaves, np.int64)
    fill = np.zeros(leaves, np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = 0
    for t in range(n):
        u = (lengths[visit[t]] + multiple - 1) // multiple
        b = _tree_leftmost_ge(tree, leaves, u)
        if b < 0:
            b = n_bins
            n_bins += 1
            room = cap_units
        else:
            room = tree[leaves + b]
        room -= u
        fill[b] += 1
        _tree_set(tree, leaves, b, room if fill[b] < max_items else 0)
        bin_of[t] = b
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


@_jit
def next_fit_offsets(lengths: np.ndarray, multiple: int, cap_units: int, max_items: int) -> np.ndarray:
    """Next fit in input order: bin offsets ``(n_bins + 1,)`` int64 (the order is ``arange(n)``)."""
    n = lengths.shape[0]
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    n_bins = 0
    load = 0
    fill = 0
    for i in range(n):
        u = (lengths[i] + multiple - 1) // multiple
        if fill > 0 and (load + u > cap_units or fill == max_items):
            n_bins += 1
            offsets[n_bins] = i
            load = 0
            fill = 0
        load += u
        fill += 1
    if n > 0:
        n_bins += 1
        offsets[n_bins] = n
    return offsets[: n_bins + 1].copy()
