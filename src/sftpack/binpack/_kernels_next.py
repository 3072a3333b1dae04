"""Next fit and greedy knapsack: the kernels that fill one bin at a time
(:func:`next_fit_offsets` in input order, under one budget or two,
:func:`greedy_records` with the largest size that fits, over the size histogram).

Part of the loops behind :mod:`sftpack.binpack` (units, size ranks, records,
compiling and the plain copies: :mod:`._kernels`; the shared helpers:
:mod:`._kernels_common`).
"""

from __future__ import annotations

import numpy as np

from ._kernels_common import (
    _MAX,
    Records,
    _kernel,
    _new_records,
    _pow2_at_least,
    _record,
    _totals,
    _tree_prefix_max,
    _tree_set,
)


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
            _tree_set(tree, leaves, k, k + 1, _MAX)
    recs = _new_records(remaining)
    # np.int64(...) and not bare constants: a literal argument would compile a helper once more
    nr = np.int64(0)
    n_bins = np.int64(0)
    while remaining > 0:
        b = n_bins
        n_bins += 1
        room = cap_units
        fill = np.int64(0)
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
            nr = _record(recs, nr, b, b + 1, rank, j, fill)
            left[rank] -= j
            if left[rank] == 0:
                _tree_set(tree, leaves, rank, np.int64(0), _MAX)
            room -= j * s
            fill += j
            remaining -= j
    rec_a, rec_b, rec_s, rec_j, rec_f = recs
    return rec_a[:nr], rec_b[:nr], rec_s[:nr], rec_j[:nr], rec_f[:nr], nr, n_bins


@_kernel
def next_fit_offsets(
    lengths: np.ndarray, multiple: int, cap_units: int, max_items: int, weights: np.ndarray, cap_weight: int
) -> np.ndarray:
    """Next fit in input order: bin offsets ``(n_bins + 1,)`` int64 (the order is ``arange(n)``).

    Under two budgets when ``weights`` holds a weight per item (each bin's sum at most
    ``cap_weight``); empty ``weights`` (and ``cap_weight`` 0): units and items only."""
    n = lengths.shape[0]
    two = weights.shape[0] > 0
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    n_bins = 0
    load = 0
    load_w = 0
    fill = 0
    for i in range(n):
        u = (lengths[i] + multiple - 1) // multiple
        w = weights[i] if two else 0
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
