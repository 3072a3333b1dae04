"""A row the loader has decided but not laid: which sequences it holds, and how to lay it.

Deciding a row (reading samples, planning the buffer, holding rows back) needs only the
samples' lengths and patch counts; laying it (:func:`~sftpack.loader._row.lay_items`: the
ids, labels, positions and media as tensors) is the work. :meth:`PackingDataset.decided_rows
<sftpack.loader.PackingDataset.decided_rows>` yields the decisions alone, so data-parallel
ranks that share one stream (``sftpack train --packing loader``: every rank runs the same
decisions over the global sample order) lay only the rows dealt to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..handoff import PackedBatch
from ._source import Item

__all__ = ["DecidedRow"]


class DecidedRow:
    """One decided row of a :class:`~sftpack.loader.PackingDataset`: its sequences' ``lengths``
    (real tokens, in row order), ``sequence_ids`` and vision ``num_patches``; :meth:`build` lays it,
    the :class:`~sftpack.PackedBatch` ``iter()`` yields for it.

    >>> from sftpack.loader import PackingDataset
    >>> from sftpack.testing import samples_from_lengths
    >>> ds = PackingDataset(samples_from_lengths([5, 10, 30]), max_seq_len=36, buffer_size=8, pad_multiple=4)
    >>> rows = list(ds.decided_rows())
    >>> [r.lengths.tolist() for r in rows], [r.sequence_ids for r in rows]
    ([[30], [5, 10]], [(2,), (0, 1)])
    >>> rows[1].build().cu_seqlens_padded.tolist()
    [0, 8, 36]
    """

    __slots__ = ("_items", "_lay")

    def __init__(self, items: Sequence[Item], lay: Callable[[list[Item]], PackedBatch]) -> None:
        self._items = list(items)
        self._lay = lay

    @property
    def lengths(self) -> np.ndarray:
        """``(n,)`` int64: each sequence's real tokens, in row order."""
        return np.fromiter((it.length for it in self._items), dtype=np.int64, count=len(self._items))

    @property
    def sequence_ids(self) -> tuple[Any, ...]:
        """Each sequence's ``conversation_id`` (the source index when it has none), in row order."""
        return tuple(it.sequence_id for it in self._items)

    @property
    def num_patches(self) -> int:
        """Vision patches of the row's media (0 without)."""
        return sum(it.patches for it in self._items)

    @property
    def weighted(self) -> bool:
        """Whether a sequence of the row carries per-token weights (the laid row then has ``weights``)."""
        return any(it.weights is not None for it in self._items)

    def build(self) -> PackedBatch:
        """The laid row (each call lays it anew)."""
        return self._lay(self._items)

    def __repr__(self) -> str:
        return f"DecidedRow(lengths={self.lengths.tolist()}, sequence_ids={self.sequence_ids})"
