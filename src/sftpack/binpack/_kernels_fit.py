"""Best fit and first fit: best-fit and first-fit decreasing over the size
histogram (:func:`bfd_records`, :func:`ffd_records`) and first fit item by
item (:func:`first_fit_items`, the shuffled first fit).

Part of the loops behind :mod:`sftpack.binpack` (units, size ranks, records,
compiling and the plain copies: :mod:`._kernels`; the shared helpers:
:mod:`._kernels_common`).

BFD asks one question per segment move: the smallest room ``r >= s`` among
the open bins. Its room index is a crit-bit tree (a binary trie with one
fork per branching) over the *distinct rooms in use*: ``2R - 1`` nodes for
``R`` live rooms, each query or update at most 31 steps down, whatever the
capacity. (It replaced a max segment tree over all rooms ``0..U``: the same
answers, so the same rows, but that tree cost ``16 * U`` bytes and the loop
over every size ``U..1`` cost ``O(U)`` time.)
Segments with equal room share a stack under their leaf, last shelved first.
FFD and first fit find the leftmost bin with room in a max segment tree over
the bins (:func:`._kernels_common._tree_leftmost_ge`).
"""

from __future__ import annotations

import numpy as np

from ._kernels_common import (
    _MAX,
    RecordArrays,
    Records,
    _grouped_by_bin,
    _kernel,
    _max_bins,
    _new_records,
    _pow2_at_least,
    _record,
    _totals,
    _tree_leftmost_ge,
    _tree_set,
)

# ----------------------------------------------------------------------------
# a crit-bit tree over non-negative keys below 2**62: node ``i`` is
# ``nodes[4 * i : 4 * i + 4]`` = (child 0, child 1, crit bit, key); a leaf has
# crit bit -1 and a key, a fork the highest bit on which its two subtrees
# differ (every key below it agrees on the bits above). ``meta`` is (root,
# free list, nodes used); free nodes are chained through child 0.

_C0, _C1, _CRIT, _KEY = 0, 1, 2, 3
_ROOT, _FREE, _USED = 0, 1, 2


@_kernel
def _high_bit(diff: int) -> int:
    """The highest set bit of ``diff > 0``: where two keys ``x ^ y = diff`` first differ."""
    p = 0
    while diff > 1:
        diff >>= 1
        p += 1
    return p


@_kernel
def _cb_relink(nodes: np.ndarray, meta: np.ndarray, parent: int, old: int, new: int) -> None:
    """Hang node ``new`` where ``old`` hangs: under fork ``parent``, or as the root (``parent`` -1)."""
    if parent < 0:
        meta[_ROOT] = new
    elif nodes[4 * parent + _C0] == old:
        nodes[4 * parent + _C0] = new
    else:
        nodes[4 * parent + _C1] = new


@_kernel
def _cb_insert(nodes: np.ndarray, meta: np.ndarray, head: np.ndarray, x: int) -> int:
    """The leaf of key ``x``, created (with an empty stack, ``head = -1``) if absent."""
    node = meta[_ROOT]
    if node >= 0:  # the leaf that shares the longest prefix with x
        while nodes[4 * node + _CRIT] >= 0:
            node = nodes[4 * node + _C1] if (x >> nodes[4 * node + _CRIT]) & 1 else nodes[4 * node + _C0]
        if nodes[4 * node + _KEY] == x:
            return node
    leaf = -1  # a new leaf, and (unless the tree is empty) a new fork above it
    fork = np.int64(-1)  # typed: a literal argument would compile _cb_relink once more (see bfd_records)
    for t in range(2 if node >= 0 else 1):
        i = meta[_FREE]
        if i >= 0:
            meta[_FREE] = nodes[4 * i + _C0]
        else:
            i = meta[_USED]
            meta[_USED] = i + 1
        if t == 0:
            leaf = i
        else:
            fork = i
    nodes[4 * leaf + _CRIT] = -1
    nodes[4 * leaf + _KEY] = x
    head[leaf] = -1
    if node < 0:
        meta[_ROOT] = leaf
        return leaf
    p = _high_bit(nodes[4 * node + _KEY] ^ x)  # where x and its nearest key differ
    parent = np.int64(-1)
    node = meta[_ROOT]
    while nodes[4 * node + _CRIT] > p:
        parent = node
        node = nodes[4 * node + _C1] if (x >> nodes[4 * node + _CRIT]) & 1 else nodes[4 * node + _C0]
    nodes[4 * fork + _CRIT] = p
    side = (x >> p) & 1
    nodes[4 * fork + _C0 + side] = leaf
    nodes[4 * fork + _C1 - side] = node
    _cb_relink(nodes, meta, parent, node, fork)
    return leaf


@_kernel
def _cb_delete(nodes: np.ndarray, meta: np.ndarray, x: int) -> None:
    """Remove key ``x`` (present); its leaf and its parent fork go to the free list."""
    grand = np.int64(-1)  # typed, as in _cb_insert
    parent = np.int64(-1)
    node = meta[_ROOT]
    while nodes[4 * node + _CRIT] >= 0:
        grand = parent
        parent = node
        node = nodes[4 * node + _C1] if (x >> nodes[4 * node + _CRIT]) & 1 else nodes[4 * node + _C0]
    nodes[4 * node + _C0] = meta[_FREE]
    meta[_FREE] = node
    if parent < 0:
        meta[_ROOT] = -1
        return
    sibling = nodes[4 * parent + _C0] if nodes[4 * parent + _C1] == node else nodes[4 * parent + _C1]
    _cb_relink(nodes, meta, grand, parent, sibling)
    nodes[4 * parent + _C0] = meta[_FREE]
    meta[_FREE] = parent


@_kernel
def _cb_find_ge(nodes: np.ndarray, meta: np.ndarray, x: int) -> int:
    """The leaf of the smallest key ``>= x``, or -1.

    Walk by the bits of ``x`` to a leaf ``k``; if ``k != x`` they first differ
    at bit ``p``. Walking again down to the subtree below bit ``p`` reaches
    the keys that agree with ``x`` above ``p``: all larger than ``x`` if ``x``
    has 0 at ``p`` (take their smallest), else all smaller (take the smallest
    key of the last subtree passed on the right).
    """
    node = meta[_ROOT]
    if node < 0:
        return -1
    while nodes[4 * node + _CRIT] >= 0:
        node = nodes[4 * node + _C1] if (x >> nodes[4 * node + _CRIT]) & 1 else nodes[4 * node + _C0]
    diff = nodes[4 * node + _KEY] ^ x
    if diff == 0:
        return node
    p = _high_bit(diff)
    right = -1
    node = meta[_ROOT]
    while nodes[4 * node + _CRIT] > p:
        if (x >> nodes[4 * node + _CRIT]) & 1:
            node = nodes[4 * node + _C1]
        else:
            right = nodes[4 * node + _C1]
            node = nodes[4 * node + _C0]
    if (x >> p) & 1:  # the keys below are all smaller than x
        if right < 0:
            return -1
        node = right
    while nodes[4 * node + _CRIT] >= 0:  # the smallest key below
        node = nodes[4 * node + _C0]
    return node


# ----------------------------------------------------------------------------
# best-fit decreasing over (sizes, counts): segments of bins, records


@_kernel
def _shelve(
    g: int,
    room: int,
    fill: int,
    smallest: int,
    max_items: int,
    rooms: Rooms,
    seg_next: np.ndarray,
    free: int,
) -> int:
    """Put segment ``g`` (room ``room``, ``fill`` items per bin) on its room's stack,
    or on the free list when its bins can take nothing more. Returns the free list."""
    nodes, meta, head = rooms
    if room >= smallest and fill < max_items:
        h = _cb_insert(nodes, meta, head, room)
        seg_next[g] = head[h]
        head[h] = g
        return free
    seg_next[g] = free
    return g


#: the room index: the crit-bit tree's ``(nodes, meta)`` and the stack of each room, by its leaf
Rooms = tuple[np.ndarray, np.ndarray, np.ndarray]

#: the segments' arrays: ``(first bin, end bin, items in each bin, next on the stack / free list)``
Segments = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@_kernel
def _open_segments(
    a: int,
    k: int,
    per: int,
    rank: int,
    s: int,
    fill: int,
    room: int,
    smallest: int,
    max_items: int,
    rooms: Rooms,
    segs: Segments,
    n_seg: int,
    free: int,
    recs: RecordArrays,
    nr: int,
) -> tuple[int, int, int, int]:
    """The bins from ``a`` on, each holding ``fill`` items in ``room`` left, take ``k``
    items of size rank ``rank`` (``s`` units each), ``per`` a bin: ``k // per`` bins
    take ``per``, then one takes the rest. Each group is a new segment, recorded, then
    shelved at its new room. Returns the updated ``(a, nr, n_seg, free)``: ``a`` past
    the last bin taken."""
    seg_a, seg_b, seg_fill, seg_next = segs
    full = k // per
    rest = k - full * per
    for take, width in ((per, full), (rest, 1 if rest > 0 else 0)):
        if width == 0:
            continue
        if free >= 0:
            h = free
            free = seg_next[free]
        else:
            h = n_seg
            n_seg += 1
        seg_a[h] = a
        seg_b[h] = a + width
        seg_fill[h] = fill + take
        nr = _record(recs, nr, a, a + width, rank, take, fill)
        free = _shelve(h, room - take * s, fill + take, smallest, max_items, rooms, seg_next, free)
        a += width
    return a, nr, n_seg, free


@_kernel
def bfd_records(sizes: np.ndarray, counts: np.ndarray, cap_units: int, max_items: int) -> Records:
    """Best-fit decreasing over a histogram: ``counts[k]`` items of ``sizes[k]`` units.

    ``sizes`` ``(D,)`` int64 ascending and distinct, ``counts`` ``(D,)`` int64
    ``>= 1``, every size ``<= cap_units``.

    Bins are kept in *segments*: runs of consecutive bin ids with one history,
    hence one room and one item count. Segments with equal room are
    interchangeable and share a stack. For each size ``s``, largest first,
    the best fit is any bin of the smallest non-empty room ``r >= s`` (the
    crit-bit room index of the module docstring); that bin stays the
    best fit until its room drops below ``s``, so each bin of a segment takes
    ``j = min(r // s, max_items - fill)`` at once, and the segment moves whole
    to room ``r - j * s``. Only the last segment a size touches is split. New
    bins open as one segment per size.

    Returns ``(first, end, rank, count, before, n_records, n_bins)``: record
    ``i`` puts ``count[i]`` items of ``sizes[rank[i]]`` units into each bin
    ``first[i]..end[i]-1``, after the ``before[i]`` items each of them holds
    already (a segment's bins share their whole history, so they hold the
    same number); records come in the order BFD makes them (sizes descending).
    """
    n_items, n_units = _totals(sizes, counts)
    n_sizes = sizes.shape[0]
    smallest = sizes[0] if n_sizes > 0 else cap_units + 1

    # live segments partition the live bins: at most max_bins (+2 while splitting)
    pool = _max_bins(n_items, n_units, cap_units, max_items) + 4
    # the room index: a crit-bit tree of R live rooms has 2R - 1 nodes, R <= live segments
    nodes = np.empty(8 * pool, np.int64)
    head = np.empty(2 * pool, np.int64)  # the stack of each room, by its leaf
    meta = np.empty(3, np.int64)
    meta[_ROOT] = -1
    meta[_FREE] = -1
    meta[_USED] = 0
    rooms = (nodes, meta, head)
    segs = (np.empty(pool, np.int64), np.empty(pool, np.int64), np.empty(pool, np.int64), np.empty(pool, np.int64))
    seg_a, seg_b, seg_fill, seg_next = segs
    # np.int64(...) and not bare constants: a literal argument would make numba
    # compile the helpers again for it (4 versions of one helper here instead of 1)
    free = np.int64(-1)
    n_seg = np.int64(0)

    recs = _new_records(n_items)
    nr = np.int64(0)
    n_bins = np.int64(0)

    for rank in range(n_sizes - 1, -1, -1):
        s = sizes[rank]
        k = counts[rank]
        while k > 0:
            h = _cb_find_ge(nodes, meta, s)
            if h < 0:
                break
            r = nodes[4 * h + _KEY]
            q = r // s
            g = head[h]
            while g >= 0:
                after = seg_next[g]
                a = seg_a[g]
                b = seg_b[g]
                f = seg_fill[g]
                j = q if q <= max_items - f else max_items - f
                if (b - a) * j <= k:  # the whole segment
                    nr = _record(recs, nr, a, b, rank, j, f)
                    k -= (b - a) * j
                    seg_fill[g] = f + j
                    free = _shelve(g, r - j * s, f + j, smallest, max_items, rooms, seg_next, free)
                    g = after
                    if k == 0:
                        break
                    continue
                # part of it: its first bins take the k items left, j a bin
                a, nr, n_seg, free = _open_segments(
                    a, k, j, rank, s, f, r, smallest, max_items, rooms, segs, n_seg, free, recs, nr
                )
                k = 0
                if a < b:
                    seg_a[g] = a  # g keeps its untouched bins, still first on this stack
                else:
                    seg_next[g] = free
                    free = g
                    g = after
                break
            head[h] = g
            if g < 0:
                _cb_delete(nodes, meta, r)
        if k > 0:  # no bin has room: open new ones, filled with this size
            per_bin = cap_units // s
            if max_items < per_bin:
                per_bin = max_items
            held = np.int64(0)  # the items a new bin holds (typed, as free)
            n_bins, nr, n_seg, free = _open_segments(
                n_bins, k, per_bin, rank, s, held, cap_units, smallest, max_items, rooms, segs, n_seg, free, recs, nr
            )
    rec_a, rec_b, rec_s, rec_j, rec_f = recs
    return rec_a[:nr], rec_b[:nr], rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


# ----------------------------------------------------------------------------
# first-fit decreasing over (sizes, counts), and first fit item by item


@_kernel
def _first_fit(tree: np.ndarray, leaves: int, size: int, n_bins: int, cap_units: int) -> tuple[int, int]:
    """``(bin, room)``: the leftmost of the ``n_bins`` open bins with room ``>= size`` in
    the max tree over their rooms, else a new bin ``n_bins`` with all its room."""
    b = _tree_leftmost_ge(tree, leaves, size)
    if b < 0:
        return n_bins, cap_units
    return b, tree[leaves + b]


@_kernel
def ffd_records(sizes: np.ndarray, counts: np.ndarray, cap_units: int, max_items: int) -> Records:
    """First-fit decreasing over a histogram (as :func:`bfd_records`).

    A max segment tree over bins (leaf = room, 0 once at ``max_items``) finds
    the leftmost bin with room ``>= s``; it stays the leftmost fit until its
    room drops below ``s``, so it takes its share of the size at once.
    Same return as :func:`bfd_records`, one bin per record.
    """
    n_items, n_units = _totals(sizes, counts)
    leaves = _pow2_at_least(_max_bins(n_items, n_units, cap_units, max_items))
    tree = np.zeros(2 * leaves, np.int64)
    fill = np.zeros(leaves, np.int64)
    recs = _new_records(n_items)
    nr = np.int64(0)  # typed, as in bfd_records
    n_bins = np.int64(0)
    for rank in range(sizes.shape[0] - 1, -1, -1):
        s = sizes[rank]
        k = counts[rank]
        while k > 0:
            b, room = _first_fit(tree, leaves, s, n_bins, cap_units)
            if b == n_bins:
                n_bins += 1
            j = room // s
            if max_items - fill[b] < j:
                j = max_items - fill[b]
            if k < j:
                j = k
            nr = _record(recs, nr, b, b + 1, rank, j, fill[b])
            k -= j
            fill[b] += j
            room -= j * s
            _tree_set(tree, leaves, b, room if fill[b] < max_items else 0, _MAX)
    rec_a, rec_b, rec_s, rec_j, rec_f = recs
    return rec_a[:nr], rec_b[:nr], rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


@_kernel
def first_fit_items(
    lengths: np.ndarray, multiple: int, cap_units: int, max_items: int, visit: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """First fit of the items in the order ``visit`` (a permutation of ``0..n-1``).

    Returns ``(order, offsets)``; each bin lists its items in visiting order.
    """
    n = visit.shape[0]
    n_units = np.int64(0)
    for t in range(n):
        n_units += (lengths[visit[t]] + multiple - 1) // multiple
    leaves = _pow2_at_least(_max_bins(n, n_units, cap_units, max_items))
    tree = np.zeros(2 * leaves, np.int64)
    fill = np.zeros(leaves, np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = np.int64(0)  # typed, as in bfd_records
    for t in range(n):
        u = (lengths[visit[t]] + multiple - 1) // multiple
        b, room = _first_fit(tree, leaves, u, n_bins, cap_units)
        if b == n_bins:
            n_bins += 1
        room -= u
        fill[b] += 1
        _tree_set(tree, leaves, b, room if fill[b] < max_items else 0, _MAX)
        bin_of[t] = b
    return _grouped_by_bin(bin_of, fill, n_bins, visit)
