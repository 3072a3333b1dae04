"""Which planned rows of one buffer wait for the next: the streaming half of the loader's rule.

Both loaders in this package (:class:`~sftpack.loader.PackingDataset` and the
Megatron-Energon :class:`~sftpack.loader.PackingTaskEncoder`) decide a buffer's
rows with the one row planner, :func:`sftpack.handoff.pack_rows` (every
sequence costed at the padded length the row builder lays, input order kept
within a row), so for the same buffer they lay the same rows; with samples with
media and a patch budget, its ``max_patches`` adds the budget to the same plan.

:func:`hold_back` then picks the under-filled rows whose
sequences may wait for the next buffer (BFD leaves its few poorly filled rows
last; with fresh samples they fill up), never more than half the buffer and
never a sequence that has already waited ``max_wait`` rounds.
"""

from __future__ import annotations

import numpy as np

from ..binpack import Bins

__all__ = ["hold_back"]


def hold_back(
    rows: Bins,
    costs: np.ndarray,
    ages: np.ndarray,
    *,
    max_seq_len: int,
    min_fill: float,
    max_wait: int,
    max_items: int,
    patches: np.ndarray | None = None,
    max_patches: int | None = None,
) -> np.ndarray:
    """``(rows,)`` bool: True for the rows to keep in the buffer for another round.

    ``rows`` is a buffer's plan (:func:`sftpack.handoff.pack_rows`).
    A row may wait when its fill is below ``min_fill`` and none of its
    sequences has waited ``max_wait`` rounds already. The emptiest candidates
    wait first, up to ``max_items`` sequences in all (so each round reads at
    least ``buffer_size - max_items`` new samples). A row's fill is its cost fill,
    or under a patch budget (``patches`` per sequence, ``max_patches`` per row) the
    larger of its cost fill and its patch fill.

    >>> rows = Bins(np.array([0, 1, 2, 3]), np.array([0, 1, 3, 4]))
    >>> hold_back(rows, np.array([36, 20, 12, 8]), np.zeros(4, int), max_seq_len=36,
    ...           min_fill=0.99, max_wait=2, max_items=2).tolist()
    [False, False, True]
    """
    order, offsets = rows.order, rows.offsets
    n_rows = offsets.shape[0] - 1
    held = np.zeros(n_rows, dtype=bool)
    if max_wait <= 0 or n_rows == 0:
        return held
    starts = offsets[:-1]
    fill = np.add.reduceat(costs[order], starts) / max_seq_len
    if patches is not None and max_patches is not None:
        fill = np.maximum(fill, np.add.reduceat(patches[order], starts) / max_patches)
    oldest = np.maximum.reduceat(ages[order], starts)
    sizes = np.diff(offsets)
    candidates = np.flatnonzero((fill < min_fill) & (oldest < max_wait))
    budget = max_items
    for i in candidates[np.argsort(fill[candidates], kind="stable")].tolist():
        if sizes[i] <= budget:
            held[i] = True
            budget -= int(sizes[i])
    return held
