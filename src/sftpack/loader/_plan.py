"""The packing rule of one buffer: which buffered sequences share a row, which wait.

Both loaders in this package (:class:`~sftpack.loader.PackingDataset` and the
Megatron-Energon :class:`~sftpack.loader.PackingTaskEncoder`) decide rows with
:func:`plan_rows`, so for the same buffer they lay the same rows:

1. every sequence costs ``padded_lengths(length, pad_multiple)``, the very
   function :func:`sftpack.handoff.build_row` uses to lay it, so a planned row
   can never overflow when it is built (the "expanded size 517 vs 502" crash
   comes from costing with one padding and laying with another);
2. :func:`sftpack.binpack.pack` packs those costs into rows of ``max_seq_len``;
3. each row lists its sequences in buffer order (input order), and rows come
   in the packer's order.

:func:`hold_back` is the streaming half: it picks the under-filled rows whose
sequences may wait for the next buffer (BFD leaves its few poorly filled rows
last; with fresh samples they fill up), never more than half the buffer and
never a sequence that has already waited ``max_wait`` rounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..binpack import pack
from ..handoff import padded_lengths

__all__ = ["hold_back", "plan_flat", "plan_rows"]


def plan_rows(
    lengths: Any,
    *,
    max_seq_len: int,
    pad_multiple: int = 1,
    algorithm: str = "bfd",
    seed: int = 0,
) -> list[np.ndarray]:
    """Rows for one buffer: a list of ``(k,)`` int64 arrays of buffer positions,
    each ascending (buffer order kept within a row).

    Args:
        lengths: ``(n,)`` real lengths of the buffered sequences, each
            ``1 <= length`` and ``padded_lengths(length, pad_multiple) <= max_seq_len``.
        max_seq_len: the row width (a multiple of ``pad_multiple``).
        pad_multiple: per-sequence pad multiple (``2 * CP``).
        algorithm: a :func:`sftpack.binpack.pack` algorithm.
        seed: for ``first_fit_shuffle``.

    >>> [r.tolist() for r in plan_rows([5, 10, 30, 20], max_seq_len=36, pad_multiple=4)]
    [[2], [1, 3], [0]]
    """
    order, offsets = plan_flat(padded_lengths(lengths, pad_multiple), max_seq_len, algorithm, seed)
    return [order[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def plan_flat(costs: np.ndarray, max_seq_len: int, algorithm: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plan_rows` as ``(order, offsets)``: row ``i`` is ``order[offsets[i]:offsets[i+1]]``
    (ascending), ``costs`` already padded. One sort for all rows, no loop over rows."""
    if costs.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    bins = pack(costs, max_seq_len, algorithm, seed=seed)
    row_of = np.repeat(np.arange(len(bins), dtype=np.int64), bins.sizes)
    order = bins.order[np.lexsort((bins.order, row_of))]  # rows kept in the packer's order, items ascending
    return order, np.asarray(bins.offsets, dtype=np.int64)


def hold_back(
    rows: list[np.ndarray] | tuple[np.ndarray, np.ndarray],
    costs: np.ndarray,
    ages: np.ndarray,
    *,
    max_seq_len: int,
    min_fill: float,
    max_wait: int,
    max_items: int,
) -> np.ndarray:
    """``(rows,)`` bool: True for the rows to keep in the buffer for another round.

    ``rows`` is a list of index arrays or :func:`plan_flat`'s ``(order, offsets)``.
    A row may wait when its cost fill is below ``min_fill`` and none of its
    sequences has waited ``max_wait`` rounds already. The emptiest candidates
    wait first, up to ``max_items`` sequences in all (so each round reads at
    least ``buffer_size - max_items`` new samples).

    >>> rows = [np.array([0]), np.array([1, 2]), np.array([3])]
    >>> hold_back(rows, np.array([36, 20, 12, 8]), np.zeros(4, int), max_seq_len=36,
    ...           min_fill=0.99, max_wait=2, max_items=2).tolist()
    [False, False, True]
    """
    if isinstance(rows, tuple):
        order, offsets = rows
    else:
        order = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum([r.shape[0] for r in rows])]).astype(np.int64)
    n_rows = offsets.shape[0] - 1
    held = np.zeros(n_rows, dtype=bool)
    if max_wait <= 0 or n_rows == 0:
        return held
    starts = offsets[:-1]
    fill = np.add.reduceat(costs[order], starts) / max_seq_len
    oldest = np.maximum.reduceat(ages[order], starts)
    sizes = np.diff(offsets)
    candidates = np.flatnonzero((fill < min_fill) & (oldest < max_wait))
    budget = max_items
    for i in candidates[np.argsort(fill[candidates], kind="stable")].tolist():
        if sizes[i] <= budget:
            held[i] = True
            budget -= int(sizes[i])
    return held
