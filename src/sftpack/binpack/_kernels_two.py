"""Two budgets: units per bin and a second weight per bin (e.g. vision patches).

Part of the loops behind :mod:`sftpack.binpack` (units, compiling and the plain
copies: :mod:`._kernels`; the shared helpers: :mod:`._kernels_common`).

Items of equal cost are no longer interchangeable (their weights differ), so
these kernels go item by item, in the order the caller hands them (``visit``:
cost descending for the decreasing algorithms, a seeded shuffle for first
fit). A bin takes an item only if both its units and its weight fit:
:func:`any_fit_two` (first fit, or best fit as a branch and bound),
:func:`best_fit_two` (best fit with rooms indexed by value, while ``U`` is
small) and :func:`greedy_two` (next fit under two budgets is
:func:`._kernels_next.next_fit_offsets`).
"""

from __future__ import annotations

import numpy as np

from ._kernels_common import _MAX, _MIN, _grouped_by_bin, _kernel, _pow2_at_least, _tree_set

_BIG = np.int64(1) << np.int64(62)
#: above every weight (a weight may be ``_BIG`` itself): a taken item in :func:`greedy_two`
_TAKEN = np.int64(np.iinfo(np.int64).max)

#: what each kernel of this module packs: ``(lengths, multiple, cap_units, max_items,
#: weights, cap_weight, visit)``, the items (``u = ceil(length / multiple)`` units and a
#: weight each), visited in the order ``visit``, into bins of at most ``cap_units`` units,
#: ``cap_weight`` weight and ``max_items`` items
TwoBudgets = tuple[np.ndarray, int, int, int, np.ndarray, int, np.ndarray]


@_kernel
def _item(problem: TwoBudgets, t: int) -> tuple[int, int]:
    """``(units, weight)`` of the ``t``-th visited item of ``problem``."""
    lengths, multiple, cap_units, max_items, weights, cap_weight, visit = problem
    i = visit[t]
    return (lengths[i] + multiple - 1) // multiple, weights[i]


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
def any_fit_two(problem: TwoBudgets, best_fit: bool) -> tuple[np.ndarray, np.ndarray]:
    """First fit (``best_fit=False``) or best fit on units (``True``) of the items of
    ``problem`` in their visiting order. Returns ``(order, offsets)``; each bin lists
    its items in visiting order."""
    lengths, multiple, cap_units, max_items, weights, cap_weight, visit = problem
    n = visit.shape[0]
    n_units = np.int64(0)
    # floor(total weight / cap_weight) without the total, which may pass 2**63
    # (weights up to 2**62 each): ``rest < cap_weight <= 2**62`` before each add
    per_weight = np.int64(0)
    rest = np.int64(0)
    for t in range(n):
        u, w = _item(problem, t)
        n_units += u
        rest += w
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
    n_bins = np.int64(0)  # typed: a literal argument would compile _grouped_by_bin once more
    for t in range(n):
        u, w = _item(problem, t)
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
        _tree_set(tree_u, leaves, b, room if still_open else 0, _MAX)
        _tree_set(tree_w, leaves, b, room_w, _MAX)
        if best_fit:
            _tree_set(tree_min, leaves, b, room if still_open else _BIG, _MIN)
        bin_of[t] = b
    return _grouped_by_bin(bin_of, fill, n_bins, visit)


@_kernel
def _leftmost_from(tree: np.ndarray, leaves: int, lo: int, x: int, stack: np.ndarray, sign: int) -> int:
    """The leftmost leaf ``>= lo`` holding ``>= x`` in a max tree (``sign`` :data:`_MAX`), or
    ``<= x`` in a min tree (:data:`_MIN`), or -1 (depth first; the stack carries each node's first
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
def greedy_two(problem: TwoBudgets) -> np.ndarray:
    """Greedy knapsack under two budgets: fill one bin at a time with the first item
    of ``visit`` (cost descending) whose units and weight both fit.

    The items whose units fit are a suffix of ``visit`` (a binary search); among
    them a min tree over the weights left (taken items hold a huge value) gives
    the first whose weight fits. Returns the bins' offsets into ``visit`` reordered
    in place: bin after bin, each in the order filled."""
    lengths, multiple, cap_units, max_items, weights, cap_weight, visit = problem
    n = visit.shape[0]
    us = np.empty(n, np.int64)
    for t in range(n):
        us[t] = (lengths[visit[t]] + multiple - 1) // multiple
    leaves = _pow2_at_least(n if n > 0 else 1)
    tree = np.full(2 * leaves, _TAKEN, np.int64)
    for t in range(n):
        _tree_set(tree, leaves, t, weights[visit[t]], _MIN)
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
            q = _leftmost_from(tree, leaves, lo, room_w, stack, _MIN)
            if q < 0:
                break
            taken[done] = visit[q]
            done += 1
            fill += 1
            room -= us[q]
            room_w -= weights[visit[q]]
            _tree_set(tree, leaves, q, _TAKEN, _MIN)
        n_bins += 1
        offsets[n_bins] = done
    for t in range(n):
        visit[t] = taken[t]
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
def best_fit_two(problem: TwoBudgets) -> tuple[np.ndarray, np.ndarray]:
    """Best fit under two budgets with rooms indexed by value (the dense route: arrays over
    ``0..U``): the open bins of each token room ``r`` form a leftist max-heap by weight
    room (then lowest index), and a max tree over ``r`` holds each heap's top weight room.
    A sequence of ``u`` units and weight ``w`` goes to the top bin of the least ``r >= u``
    whose top has ``>= w``: the least token room that fits both, the most weight room among
    those, then the lowest bin, as :func:`_best_both` chooses. ``O(log U + log bins)`` a
    sequence. Returns ``(order, offsets)`` like :func:`any_fit_two`."""
    lengths, multiple, cap_units, max_items, weights, cap_weight, visit = problem
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
    n_bins = np.int64(0)  # typed: a literal argument would compile _grouped_by_bin once more
    for t in range(n):
        u, w = _item(problem, t)
        r = _leftmost_from(tree, leaves, u, w, stack, _MAX)
        if r < 0:
            b = n_bins
            n_bins += 1
            room = cap_units
            room_w[b] = cap_weight
        else:
            b = heap[r]
            top = _lh_merge(left[b], right[b], left, right, rank, room_w, spine)
            heap[r] = top
            _tree_set(tree, leaves, r, room_w[top] if top >= 0 else np.int64(-1), _MAX)
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
            _tree_set(tree, leaves, room, room_w[top], _MAX)
        bin_of[t] = b
    return _grouped_by_bin(bin_of, fill, n_bins, visit)
