"""The loops behind :mod:`sftpack.binpack`, compiled by numba on first use.

(Over 500 lines on purpose: :func:`load` swaps every kernel for its numba
dispatcher in this module's globals at once, because a compiling kernel resolves
the helpers it calls as module globals; the BFD, FFD, greedy and record kernels
share those helpers, so splitting the module would need one lazy-compile registry
per piece and cross-module dispatch.)

Every kernel works in *units*: an item of length ``L`` costs
``u = ceil(L / cost_multiple)`` units and a bin holds ``U = capacity // cost_multiple``
units, so "a bin never overflows after padding" is the plain integer test
``sum(u) <= U``. The packing kernels never index an array by units: the
sizes present are compressed to their *ranks* ``0..D-1`` in ``sizes`` (the
``D`` distinct unit sizes, ascending), so their time and memory follow the
items, the distinct sizes and the bins, never ``U``. Only the grouping of
items by size has a dense form (:func:`scan_units` + :func:`bucket_by_units`,
arrays over ``0..U``, used while ``U`` is small); :func:`sort_by_units` (a
radix sort) gives the same groups for any ``U < 2**31``.

Three kernels decide the bins from the size histogram alone (items of equal
cost are interchangeable) and emit *records* ``(first bin, end bin, size rank,
count, before)``: "each of the bins ``first..end-1`` receives ``count`` items
of that size after the ``before`` it holds" (:func:`bfd_records`,
:func:`ffd_records`, :func:`greedy_records`). BFD keeps bins in segments of
equal history, so it needs few records (about 25,000 for 10M SFT-like
lengths, 1,400 for Wikipedia's 16.3M); FFD and greedy make one per (bin,
size) pair (2.3M and 16M there), which is why they are 3-8x slower. Two
kernels then turn records into item indices (:func:`records_to_order`) or
into per-bin histograms (:func:`records_to_runs`). :func:`first_fit_items`
(shuffled first fit) and :func:`next_fit_offsets` need the item order and go
item by item.

BFD asks one question per segment move: the smallest room ``r >= s`` among
the open bins. Its room index is a crit-bit tree (a binary trie with one
fork per branching) over the *distinct rooms in use*: ``2R - 1`` nodes for
``R`` live rooms, each query or update at most 31 steps down, whatever the
capacity. (It replaced a max segment tree over all rooms ``0..U``: the same
answers, so the same rows, but that tree cost ``16 * U`` bytes and the loop
over every size ``U..1`` cost ``O(U)`` time.)
Segments with equal room share a stack under their leaf, last shelved first.

Compiling is lazy and per kernel: importing this module does not import
numba; :func:`load` (called by the packers through :func:`kernels`) makes
every kernel a numba dispatcher (``cache=True``), and each compiles, or loads
from numba's on-disk cache, on its first call only, so a packer waits only
for the kernels its algorithm runs. Small inputs skip numba altogether: up to
:data:`PLAIN_MAX_ITEMS` (64) sequences, and as long as :func:`load` has not
run in the process, :func:`kernels` hands out :data:`PLAIN`, the same
functions run as plain Python (bound to a copy of this module's globals, so
:func:`load` never swaps them mid-run). Importing numba and loading the
kernels from its cache take over a second, a plain pack of 64 sequences a few
milliseconds (``benchmarks/bench_import.py``), so a first small pack (a
training step's micro-batch plan) starts at once; once a big
input has loaded numba, every pack runs compiled. Both give identical rows,
order and dtypes. Compile time shapes the code: explicit loops
instead of array expressions or slice assignments (a single ``out[:] = x``
multiplied the compile time of :func:`sort_by_units`), and typed values
(``np.int64(0)``) instead of bare constants as helper arguments (a literal
argument compiles the helper once more: ``_open_segment`` was compiled four
times per BFD).
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

_F = TypeVar("_F", bound=Callable[..., Any])

#: ``(first bin, end bin, size rank, count, before, n_records, n_bins)``, see :func:`bfd_records`
Records = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]

_KERNELS: list[str] = []
_loaded = False
_lock = threading.Lock()


def _kernel(fn: _F) -> _F:
    """Mark ``fn`` for compiling by :func:`load` (it stays plain Python until then)."""
    _KERNELS.append(fn.__name__)
    return fn


def load() -> None:
    """Import numba and make every kernel a lazily compiling, disk-cached dispatcher.

    Creating a dispatcher compiles nothing; a kernel compiles (or loads from
    numba's on-disk cache) on its first call. All kernels are swapped in at
    once because a compiled kernel resolves the helpers it calls as module
    globals when it compiles.
    """
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        import numba

        namespace = globals()
        for name in _KERNELS:
            namespace[name] = numba.njit(cache=True, nogil=True)(namespace[name])
        _loaded = True


#: Up to this many sequences, and while :func:`load` has not run in this process,
#: the packers run the kernels as plain Python (:data:`PLAIN`): importing numba and
#: loading the kernels from its cache take over a second, a plain pack of this many
#: sequences a few milliseconds with any algorithm and option
#: (``benchmarks/bench_import.py``, "plain Python" rows).
PLAIN_MAX_ITEMS = 64

#: Tests only: ``"plain"`` or ``"compiled"`` forces :func:`kernels`' choice.
FORCE: str | None = None


def kernels(n_items: int) -> types.ModuleType:
    """The kernels to run on ``n_items`` sequences: :data:`PLAIN` while the input is
    small (``<= PLAIN_MAX_ITEMS``) and :func:`load` has not run, else this module's
    compiled ones (loading them). Both give identical results (same bins, same
    order, same dtypes: ``tests/binpack/test_small_plain.py``).

    A run whose packs all stay small never loads numba: it pays a few milliseconds
    a pack instead of numba's first call once (both measured by
    ``benchmarks/bench_import.py``); next to a training step, noise.
    """
    if FORCE == "plain" or (FORCE is None and n_items <= PLAIN_MAX_ITEMS and not _loaded):
        return PLAIN
    load()
    return sys.modules[__name__]


# Every array that may hold up to one slot per item or per bin is allocated
# with ``np.empty`` at its worst-case size instead of grown: pages that are
# never written cost no memory, and loops that may reallocate an array run
# several times slower under numba.


# ----------------------------------------------------------------------------
# a max segment tree: ``tree[leaves + i]`` is leaf ``i``, ``leaves`` a power of two


@_kernel
def _tree_set(tree: np.ndarray, leaves: int, i: int, value: int) -> None:
    i += leaves
    tree[i] = value
    i >>= 1
    while i >= 1:
        left = tree[2 * i]
        right = tree[2 * i + 1]
        tree[i] = left if left >= right else right
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
# a crit-bit tree over non-negative keys below 2**62: node ``i`` is
# ``nodes[4 * i : 4 * i + 4]`` = (child 0, child 1, crit bit, key); a leaf has
# crit bit -1 and a key, a fork the highest bit on which its two subtrees
# differ (every key below it agrees on the bits above). ``meta`` is (root,
# free list, nodes used); free nodes are chained through child 0.

_C0, _C1, _CRIT, _KEY = 0, 1, 2, 3
_ROOT, _FREE, _USED = 0, 1, 2


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
    fork = -1
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
    diff = nodes[4 * node + _KEY] ^ x
    p = 0  # the highest bit on which x and its nearest key differ
    while diff > 1:
        diff >>= 1
        p += 1
    parent = -1
    node = meta[_ROOT]
    while nodes[4 * node + _CRIT] > p:
        parent = node
        node = nodes[4 * node + _C1] if (x >> nodes[4 * node + _CRIT]) & 1 else nodes[4 * node + _C0]
    nodes[4 * fork + _CRIT] = p
    side = (x >> p) & 1
    nodes[4 * fork + _C0 + side] = leaf
    nodes[4 * fork + _C1 - side] = node
    if parent < 0:
        meta[_ROOT] = fork
    elif nodes[4 * parent + _C0] == node:
        nodes[4 * parent + _C0] = fork
    else:
        nodes[4 * parent + _C1] = fork
    return leaf


@_kernel
def _cb_delete(nodes: np.ndarray, meta: np.ndarray, x: int) -> None:
    """Remove key ``x`` (present); its leaf and its parent fork go to the free list."""
    grand = -1
    parent = -1
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
    if grand < 0:
        meta[_ROOT] = sibling
    elif nodes[4 * grand + _C0] == parent:
        nodes[4 * grand + _C0] = sibling
    else:
        nodes[4 * grand + _C1] = sibling
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
    p = 0
    while diff > 1:
        diff >>= 1
        p += 1
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
# histogram-driven algorithms over (sizes, counts): emit records


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


@_kernel
def _shelve(
    g: int,
    room: int,
    fill: int,
    smallest: int,
    max_items: int,
    head: np.ndarray,
    nodes: np.ndarray,
    meta: np.ndarray,
    seg_next: np.ndarray,
    free: int,
) -> int:
    """Put segment ``g`` (room ``room``, ``fill`` items per bin) on its room's stack,
    or on the free list when its bins can take nothing more. Returns the free list."""
    if room >= smallest and fill < max_items:
        h = _cb_insert(nodes, meta, head, room)
        seg_next[g] = head[h]
        head[h] = g
        return free
    seg_next[g] = free
    return g


@_kernel
def _record(
    rec_a: np.ndarray,
    rec_b: np.ndarray,
    rec_s: np.ndarray,
    rec_j: np.ndarray,
    rec_f: np.ndarray,
    nr: int,
    a: int,
    b: int,
    s: int,
    j: int,
    f: int,
) -> int:
    """Append record ``nr``: bins ``a..b-1`` each take ``j`` items of size rank ``s`` after ``f``."""
    rec_a[nr] = a
    rec_b[nr] = b
    rec_s[nr] = s
    rec_j[nr] = j
    rec_f[nr] = f
    return nr + 1


@_kernel
def _open_segment(
    a: int,
    width: int,
    rank: int,
    take: int,
    fill: int,
    room: int,
    smallest: int,
    max_items: int,
    head: np.ndarray,
    nodes: np.ndarray,
    meta: np.ndarray,
    seg_a: np.ndarray,
    seg_b: np.ndarray,
    seg_fill: np.ndarray,
    seg_next: np.ndarray,
    n_seg: int,
    free: int,
    rec_a: np.ndarray,
    rec_b: np.ndarray,
    rec_s: np.ndarray,
    rec_j: np.ndarray,
    rec_f: np.ndarray,
    nr: int,
) -> tuple[int, int, int]:
    """A new segment of bins ``a..a+width-1`` that each held ``fill`` items and take
    ``take`` more of size rank ``rank``: recorded, then shelved at ``room``.
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
    nr = _record(rec_a, rec_b, rec_s, rec_j, rec_f, nr, a, a + width, rank, take, fill)
    free = _shelve(h, room, fill + take, smallest, max_items, head, nodes, meta, seg_next, free)
    return nr, n_seg, free


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
    seg_a = np.empty(pool, np.int64)  # first bin
    seg_b = np.empty(pool, np.int64)  # one past the last bin
    seg_fill = np.empty(pool, np.int64)  # items in each of its bins
    seg_next = np.empty(pool, np.int64)  # next segment on the stack / free list
    # np.int64(...) and not bare constants: a literal argument would make numba
    # compile the helpers again for it (4 versions of _open_segment instead of 1)
    free = np.int64(-1)
    n_seg = np.int64(0)

    rec_a = np.empty(n_items, np.int64)  # each record places >= 1 item
    rec_b = np.empty(n_items, np.int64)
    rec_s = np.empty(n_items, np.int32)
    rec_j = np.empty(n_items, np.int32)
    rec_f = np.empty(n_items, np.int64)
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
                    nr = _record(rec_a, rec_b, rec_s, rec_j, rec_f, nr, a, b, rank, j, f)
                    k -= (b - a) * j
                    seg_fill[g] = f + j
                    free = _shelve(g, r - j * s, f + j, smallest, max_items, head, nodes, meta, seg_next, free)
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
                        a,
                        width,
                        rank,
                        take,
                        f,
                        r - take * s,
                        smallest,
                        max_items,
                        head,
                        nodes,
                        meta,
                        seg_a,
                        seg_b,
                        seg_fill,
                        seg_next,
                        n_seg,
                        free,
                        rec_a,
                        rec_b,
                        rec_s,
                        rec_j,
                        rec_f,
                        nr,
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
            head[h] = g
            if g < 0:
                _cb_delete(nodes, meta, r)
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
                    n_bins,
                    width,
                    rank,
                    take,
                    np.int64(0),
                    cap_units - take * s,
                    smallest,
                    max_items,
                    head,
                    nodes,
                    meta,
                    seg_a,
                    seg_b,
                    seg_fill,
                    seg_next,
                    n_seg,
                    free,
                    rec_a,
                    rec_b,
                    rec_s,
                    rec_j,
                    rec_f,
                    nr,
                )
                n_bins += width
    return rec_a[:nr], rec_b[:nr], rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


@_kernel
def _plus_one(a: np.ndarray, n: int) -> np.ndarray:
    """``a[:n] + 1`` as a loop (an array expression costs seconds more to compile)."""
    out = np.empty(n, np.int64)
    for i in range(n):
        out[i] = a[i] + 1
    return out


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
    rec_a = np.empty(n_items, np.int64)
    rec_s = np.empty(n_items, np.int32)
    rec_j = np.empty(n_items, np.int32)
    rec_f = np.empty(n_items, np.int64)
    nr = 0
    n_bins = 0
    for rank in range(sizes.shape[0] - 1, -1, -1):
        s = sizes[rank]
        k = counts[rank]
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
            rec_s[nr] = rank
            rec_j[nr] = j
            rec_f[nr] = fill[b]
            nr += 1
            k -= j
            fill[b] += j
            room -= j * s
            _tree_set(tree, leaves, b, room if fill[b] < max_items else 0)
    return rec_a[:nr], _plus_one(rec_a, nr), rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


@_kernel
def greedy_records(sizes: np.ndarray, counts: np.ndarray, cap_units: int, max_items: int) -> Records:
    """Greedy knapsack: fill one bin at a time with the largest item that fits.

    A max segment tree over size ranks (leaf ``k`` holds ``k + 1`` while items
    of ``sizes[k]`` are left) gives the largest size ``<= room`` as a prefix
    maximum up to the last rank whose size fits (a binary search).
    This makes the same bins as first-fit decreasing (FFD's first bin is
    exactly the greedy fill of the sorted items, and so on) by another route.
    Same return as :func:`bfd_records`, one bin per record, bin after bin.
    """
    n_sizes = sizes.shape[0]
    left = counts.copy()
    remaining, _ = _totals(sizes, counts)
    leaves = _pow2_at_least(n_sizes if n_sizes > 0 else 1)
    tree = np.zeros(2 * leaves, np.int64)
    for k in range(n_sizes):
        if left[k] > 0:
            _tree_set(tree, leaves, k, k + 1)
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
            last = np.searchsorted(sizes, room, side="right") - 1
            if last < 0:
                break
            rank = _tree_prefix_max(tree, leaves, last) - 1
            if rank < 0:
                break
            s = sizes[rank]
            j = room // s
            if left[rank] < j:
                j = left[rank]
            if max_items - fill < j:
                j = max_items - fill
            rec_a[nr] = b
            rec_s[nr] = rank
            rec_j[nr] = j
            rec_f[nr] = fill
            nr += 1
            left[rank] -= j
            if left[rank] == 0:
                _tree_set(tree, leaves, rank, np.int64(0))
            room -= j * s
            fill += j
            remaining -= j
    return rec_a[:nr], _plus_one(rec_a, nr), rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


# ----------------------------------------------------------------------------
# records -> bins


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
    """Deal the items of ``bucket`` to the bins, replaying the records in their order.

    ``bucket`` ``(n,)`` holds the item indices grouped by size, largest first
    (input order within a size); the items of size rank ``k`` start at
    ``bucket[start[k]]`` (``start`` ``(D,)``).

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


@_kernel
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
    """Like :func:`records_to_order` for a histogram: the items of size rank
    ``k`` are the runs ``run_start[k]:run_start[k + 1]`` (``run_cnt`` items of
    length ``run_len`` each), handed out front to back. Returns ``(offsets
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
    return _grouped_by_bin(bin_of, fill, n_bins, visit)


@_kernel
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


# ----------------------------------------------------------------------------
# two budgets: units per bin and a second weight per bin (e.g. vision patches)
#
# Items of equal cost are no longer interchangeable (their weights differ), so
# these kernels go item by item, in the order the caller hands them (``visit``:
# cost descending for the decreasing algorithms, a seeded shuffle for first
# fit). A bin takes an item only if both its units and its weight fit.

_BIG = np.int64(1) << np.int64(62)
#: above every weight (a weight may be ``_BIG`` itself): a taken item in :func:`greedy_two`
_TAKEN = np.int64(np.iinfo(np.int64).max)


@_kernel
def _max_bins_two(n_items: int, n_units: int, cap_units: int, per_weight: int, max_items: int) -> int:
    """An upper bound on the bins of an any-fit packing under two budgets.

    A bin opens only when its first item fits no earlier bin still below
    ``max_items``: for two such bins the later one's items and the earlier
    one's exceed the units or the weight budget together. Pairing those bins
    one after another, each pair holds more than ``U`` units or more than
    ``W`` weight: bins ``<= n / max_items + 2 * (units / U + weight / W) + 2``
    (``per_weight`` is ``floor(weight / W)``, 0 when ``W`` is 0).
    """
    if n_items == 0:
        return 0
    bound = n_items // max_items + 2 * (n_units // cap_units + per_weight) + 2
    return n_items if n_items < bound else bound


@_kernel
def _tree_set_min(tree: np.ndarray, leaves: int, i: int, value: int) -> None:
    i += leaves
    tree[i] = value
    i >>= 1
    while i >= 1:
        left = tree[2 * i]
        right = tree[2 * i + 1]
        tree[i] = left if left <= right else right
        i >>= 1


@_kernel
def _leftmost_both(tree_u: np.ndarray, tree_w: np.ndarray, leaves: int, u: int, w: int, stack: np.ndarray) -> int:
    """The leftmost leaf with ``tree_u >= u`` and ``tree_w >= w`` (two max trees), or -1.

    Depth first, left before right, entering only subtrees whose maxima both
    suffice (both maxima sufficing does not mean one leaf has both, hence the search).
    """
    if tree_u[1] < u or tree_w[1] < w:
        return -1
    stack[0] = 1
    top = 1
    while top > 0:
        top -= 1
        i = stack[top]
        if i >= leaves:
            return i - leaves
        right = 2 * i + 1
        if tree_u[right] >= u and tree_w[right] >= w:
            stack[top] = right
            top += 1
        left = 2 * i
        if tree_u[left] >= u and tree_w[left] >= w:
            stack[top] = left
            top += 1
    return -1


@_kernel
def _best_both(
    tree_u: np.ndarray,
    tree_w: np.ndarray,
    tree_min: np.ndarray,
    leaves: int,
    u: int,
    w: int,
    stack: np.ndarray,
) -> int:
    """The best-fit leaf, or -1: the least ``tree_u >= u`` among the leaves with
    ``tree_w >= w``; among equals the most ``tree_w``, then the leftmost. A depth-first
    branch and bound that skips subtrees whose maxima fall short or whose least room
    (``tree_min``, open bins only) is above the best found (the sparse route of
    :func:`best_fit_two`, for capacities too large to index rooms by value)."""
    best = np.int64(-1)
    best_room = _BIG
    best_w = np.int64(-1)
    stack[0] = 1
    top = 1
    while top > 0:
        top -= 1
        i = stack[top]
        if tree_u[i] < u or tree_w[i] < w or tree_min[i] > best_room:
            continue
        if i >= leaves:
            if tree_u[i] < best_room or tree_w[i] > best_w:  # left first: a later equal loses
                best = i - leaves
                best_room = tree_u[i]
                best_w = tree_w[i]
            continue
        stack[top] = 2 * i + 1
        stack[top + 1] = 2 * i
        top += 2
    return best


@_kernel
def any_fit_two(
    lengths: np.ndarray,
    multiple: int,
    cap_units: int,
    max_items: int,
    weights: np.ndarray,
    cap_weight: int,
    visit: np.ndarray,
    best_fit: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """First fit (``best_fit=False``) or best fit on units (``True``) of the items in
    the order ``visit``, each bin within ``cap_units`` units, ``cap_weight`` weight
    and ``max_items`` items. Returns ``(order, offsets)``; each bin lists its items
    in visiting order."""
    n = visit.shape[0]
    n_units = np.int64(0)
    # floor(total weight / cap_weight) without the total, which may pass 2**63
    # (weights up to 2**62 each): ``rest < cap_weight <= 2**62`` before each add
    per_weight = np.int64(0)
    rest = np.int64(0)
    for t in range(n):
        n_units += (lengths[visit[t]] + multiple - 1) // multiple
        rest += weights[visit[t]]
        if cap_weight > 0 and rest >= cap_weight:
            per_weight += rest // cap_weight
            rest = rest % cap_weight
    most = _max_bins_two(n, n_units, cap_units, per_weight, max_items)
    leaves = _pow2_at_least(most if most > 0 else 1)
    tree_u = np.zeros(2 * leaves, np.int64)  # room in units (0 once closed)
    tree_w = np.zeros(2 * leaves, np.int64)  # room in weight
    tree_min = np.full(2 * leaves, _BIG, np.int64)  # room in units of the open bins (best fit only)
    fill = np.zeros(leaves, np.int64)
    stack = np.empty(2 * 64 + 2, np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = 0
    for t in range(n):
        i = visit[t]
        u = (lengths[i] + multiple - 1) // multiple
        w = weights[i]
        if best_fit:
            b = _best_both(tree_u, tree_w, tree_min, leaves, u, w, stack)
        else:
            b = _leftmost_both(tree_u, tree_w, leaves, u, w, stack)
        if b < 0:
            b = n_bins
            n_bins += 1
            room = cap_units
            room_w = cap_weight
        else:
            room = tree_u[leaves + b]
            room_w = tree_w[leaves + b]
        room -= u
        room_w -= w
        fill[b] += 1
        still_open = fill[b] < max_items and room > 0
        _tree_set(tree_u, leaves, b, room if still_open else 0)
        _tree_set(tree_w, leaves, b, room_w)
        if best_fit:
            _tree_set_min(tree_min, leaves, b, room if still_open else _BIG)
        bin_of[t] = b
    return _grouped_by_bin(bin_of, fill, n_bins, visit)


@_kernel
def _leftmost_from(tree: np.ndarray, leaves: int, lo: int, x: int, stack: np.ndarray, sign: int) -> int:
    """The leftmost leaf ``>= lo`` holding ``>= x`` in a max tree (``sign`` 1), or ``<= x``
    in a min tree (``sign`` -1), or -1 (depth first; the stack carries each node's first
    leaf and width). Values stay within ``+-(2**63 - 1)``, so negating never overflows."""
    stack[0] = 1
    stack[1] = 0
    stack[2] = leaves
    top = 1
    while top > 0:
        top -= 1
        i = stack[3 * top]
        first = stack[3 * top + 1]
        width = stack[3 * top + 2]
        if first + width <= lo or sign * tree[i] < sign * x:
            continue
        if i >= leaves:
            return i - leaves
        half = width // 2
        stack[3 * top] = 2 * i + 1
        stack[3 * top + 1] = first + half
        stack[3 * top + 2] = half
        stack[3 * top + 3] = 2 * i
        stack[3 * top + 4] = first
        stack[3 * top + 5] = half
        top += 2
    return -1


@_kernel
def greedy_two(
    lengths: np.ndarray,
    multiple: int,
    cap_units: int,
    max_items: int,
    weights: np.ndarray,
    cap_weight: int,
    visit: np.ndarray,
) -> np.ndarray:
    """Greedy knapsack under two budgets: fill one bin at a time with the first item
    of ``visit`` (cost descending) whose units and weight both fit.

    The items whose units fit are a suffix of ``visit`` (a binary search); among
    them a min tree over the weights left (taken items hold a huge value) gives
    the first whose weight fits. Returns the bins' offsets into ``visit`` reordered
    in place: bin after bin, each in the order filled."""
    n = visit.shape[0]
    us = np.empty(n, np.int64)
    for t in range(n):
        us[t] = (lengths[visit[t]] + multiple - 1) // multiple
    leaves = _pow2_at_least(n if n > 0 else 1)
    tree = np.full(2 * leaves, _TAKEN, np.int64)
    for t in range(n):
        _tree_set_min(tree, leaves, t, weights[visit[t]])
    stack = np.empty(3 * (2 * 64 + 2), np.int64)
    taken = np.empty(n, np.int64)
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    n_bins = 0
    done = 0
    while done < n:
        room = cap_units
        room_w = cap_weight
        fill = 0
        while fill < max_items and room > 0:
            lo = 0  # the first position whose units fit: us is non-increasing
            hi = n
            while lo < hi:
                mid = (lo + hi) // 2
                if us[mid] <= room:
                    hi = mid
                else:
                    lo = mid + 1
            if lo >= n:
                break
            q = _leftmost_from(tree, leaves, lo, room_w, stack, np.int64(-1))
            if q < 0:
                break
            taken[done] = visit[q]
            done += 1
            fill += 1
            room -= us[q]
            room_w -= weights[visit[q]]
            _tree_set_min(tree, leaves, q, _TAKEN)
        n_bins += 1
        offsets[n_bins] = done
    for t in range(n):
        visit[t] = taken[t]
    return offsets[: n_bins + 1].copy()


@_kernel
def next_fit_two(
    lengths: np.ndarray, multiple: int, cap_units: int, max_items: int, weights: np.ndarray, cap_weight: int
) -> np.ndarray:
    """Next fit in input order under two budgets: bin offsets ``(n_bins + 1,)``."""
    n = lengths.shape[0]
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    n_bins = 0
    load = 0
    load_w = 0
    fill = 0
    for i in range(n):
        u = (lengths[i] + multiple - 1) // multiple
        w = weights[i]
        # ``w > cap_weight - load_w`` and not ``load_w + w > cap_weight``: both may be 2**62
        if fill > 0 and (load + u > cap_units or w > cap_weight - load_w or fill == max_items):
            n_bins += 1
            offsets[n_bins] = i
            load = 0
            load_w = 0
            fill = 0
        load += u
        load_w += w
        fill += 1
    if n > 0:
        n_bins += 1
        offsets[n_bins] = n
    return offsets[: n_bins + 1].copy()


@_kernel
def _before(x: int, y: int, key: np.ndarray) -> bool:
    """Heap order: the larger ``key`` first, then the lower index."""
    return key[x] > key[y] or (key[x] == key[y] and x < y)


@_kernel
def _lh_merge(
    a: int, b: int, left: np.ndarray, right: np.ndarray, rank: np.ndarray, key: np.ndarray, stack: np.ndarray
) -> int:
    """Merge two leftist heaps (roots ``a``, ``b``; -1 is empty), iteratively: down the
    right spines, then ranks fixed (and children swapped) on the way back up."""
    if a < 0:
        return b
    if b < 0:
        return a
    if _before(b, a, key):
        a, b = b, a
    root = a
    cur = a
    top = 0
    while b >= 0:
        stack[top] = cur
        top += 1
        r = right[cur]
        if r < 0:
            right[cur] = b
            b = -1
        elif _before(b, r, key):
            right[cur] = b
            cur = b
            b = r
        else:
            cur = r
    while top > 0:
        top -= 1
        x = stack[top]
        lr = rank[left[x]] if left[x] >= 0 else 0
        rr = rank[right[x]] if right[x] >= 0 else 0
        if lr < rr:
            t = left[x]
            left[x] = right[x]
            right[x] = t
            rr = lr
        rank[x] = rr + 1
    return root


@_kernel
def best_fit_two(
    lengths: np.ndarray,
    multiple: int,
    cap_units: int,
    max_items: int,
    weights: np.ndarray,
    cap_weight: int,
    visit: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Best fit under two budgets with rooms indexed by value (the dense route: arrays over
    ``0..U``): the open bins of each token room ``r`` form a leftist max-heap by weight
    room (then lowest index), and a max tree over ``r`` holds each heap's top weight room.
    A sequence of ``u`` units and weight ``w`` goes to the top bin of the least ``r >= u``
    whose top has ``>= w``: the least token room that fits both, the most weight room among
    those, then the lowest bin, as :func:`_best_both` chooses. ``O(log U + log bins)`` a
    sequence. Returns ``(order, offsets)`` like :func:`any_fit_two`."""
    n = visit.shape[0]
    leaves = _pow2_at_least(cap_units + 1)
    tree = np.full(2 * leaves, np.int64(-1), np.int64)  # top weight room per token room, -1: none
    heap = np.full(cap_units + 1, np.int64(-1), np.int64)
    left = np.full(n, np.int64(-1), np.int64)
    right = np.full(n, np.int64(-1), np.int64)
    rank = np.ones(n, np.int64)
    room_w = np.zeros(n, np.int64)
    fill = np.zeros(n, np.int64)
    stack = np.empty(3 * (2 * 64 + 2), np.int64)
    spine = np.empty(256, np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = 0
    for t in range(n):
        i = visit[t]
        u = (lengths[i] + multiple - 1) // multiple
        w = weights[i]
        r = _leftmost_from(tree, leaves, u, w, stack, np.int64(1))
        if r < 0:
            b = n_bins
            n_bins += 1
            room = cap_units
            room_w[b] = cap_weight
        else:
            b = heap[r]
            top = _lh_merge(left[b], right[b], left, right, rank, room_w, spine)
            heap[r] = top
            _tree_set(tree, leaves, r, room_w[top] if top >= 0 else np.int64(-1))
            left[b] = -1
            right[b] = -1
            rank[b] = 1
            room = r
        room -= u
        room_w[b] -= w
        fill[b] += 1
        if fill[b] < max_items and room > 0:
            top = _lh_merge(heap[room], b, left, right, rank, room_w, spine)
            heap[room] = top
            _tree_set(tree, leaves, room, room_w[top])
        bin_of[t] = b
    return _grouped_by_bin(bin_of, fill, n_bins, visit)


def _plain_copy() -> types.ModuleType:
    """A copy of this module whose kernels are the plain functions, each resolving
    the helpers it calls in the copy: :func:`load` swaps this module's globals,
    never the copy's, so a plain run never calls a dispatcher (never compiles),
    even while another thread loads."""
    plain = types.ModuleType(__name__ + ".PLAIN", __doc__)
    namespace = plain.__dict__
    for key, value in globals().items():
        namespace.setdefault(key, value)
    for name in _KERNELS:
        fn = globals()[name]
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__doc__ = fn.__doc__
        copy.__qualname__ = fn.__qualname__
        namespace[name] = copy
    return plain


#: The kernels as plain Python functions, whatever :func:`load` did (built at import,
#: before any :func:`load`).
PLAIN = _plain_copy()
