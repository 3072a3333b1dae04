"""The result types of a packing: :class:`Bins` (item indices) and :class:`HistogramBins`.

``Bins`` stores ten million items as two int64 arrays (``order`` and
``offsets``), not ten million Python lists; its public constructor checks that
``order`` holds every index exactly once (a packer's own output is wrapped
without the check, by construction valid).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
from numpy.typing import ArrayLike

from .._base import round_up
from ._inputs import _as_lengths


def _row_index(i: int, rows: int) -> int:
    """``i`` as a row number in ``[0, rows)`` (negative counts from the end)."""
    j = operator.index(i)
    if j < 0:
        j += rows
    if not 0 <= j < rows:
        raise IndexError(f"bin {i} is out of range for {rows} bins")
    return j


def _check_permutation(order: np.ndarray) -> None:
    """Raise ``ValueError`` unless ``order`` ``(n,)`` holds every index ``0..n-1`` exactly once."""
    n = order.shape[0]
    if n == 0:
        return
    lo, hi = int(order.min()), int(order.max())
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        where = int(np.flatnonzero(order == bad)[0])
        raise ValueError(
            f"Bins order[{where}] = {bad} is outside 0..{n - 1}: the order must hold every item index "
            f"0..{n - 1} exactly once"
        )
    seen = np.bincount(order, minlength=n)
    if seen.max() > 1:
        bad = int(np.flatnonzero(seen > 1)[0])
        at = np.flatnonzero(order == bad)[:2].tolist()
        raise ValueError(
            f"Bins order holds index {bad} {int(seen[bad])} times (order[{at[0]}] and order[{at[1]}]): "
            f"every item index 0..{n - 1} must appear exactly once"
        )


class Bins(Sequence[np.ndarray]):
    """Rows of a packing, stored compactly as ``order`` + ``offsets``.

    Attributes:
        order: ``(n,)`` int64, read-only: every item index ``0..n-1`` exactly
            once, row after row.
        offsets: ``(rows + 1,)`` int64, read-only: row ``i`` is
            ``order[offsets[i]:offsets[i + 1]]``; ``offsets[0] == 0``,
            ``offsets[-1] == n``, strictly increasing (no empty row).

    ``len(bins)`` is the number of rows; ``bins[i]`` and iteration give the
    rows as ``(k,)`` int64 index arrays (read-only views).

    >>> bins = Bins(np.array([1, 4, 3, 0, 2]), np.array([0, 2, 5]))
    >>> len(bins), bins[1].tolist(), bins.sizes.tolist()
    (2, [3, 0, 2], [2, 3])
    >>> bins.loads([5, 10, 3, 8, 6]).tolist()
    [16, 16]
    """

    __slots__ = ("offsets", "order")

    def __init__(self, order: ArrayLike, offsets: ArrayLike) -> None:
        order = _as_lengths(order, "order")
        offsets = _as_lengths(offsets, "offsets")
        if offsets.shape[0] < 1:
            raise ValueError("Bins needs offsets of at least one entry ([0] for no bins)")
        _check_permutation(order)
        if offsets[0] != 0 or offsets[-1] != order.shape[0]:
            raise ValueError(
                f"Bins offsets must run from 0 to len(order) = {order.shape[0]}, "
                f"got {int(offsets[0])} .. {int(offsets[-1])}"
            )
        empty = np.flatnonzero(np.diff(offsets) < 1)
        if empty.size:
            b = int(empty[0])
            raise ValueError(
                f"Bins offsets must increase strictly (no empty bin): bin {b} spans "
                f"{int(offsets[b])} .. {int(offsets[b + 1])}"
            )
        self._set(order.view(), offsets.view())  # read-only views: the caller's arrays keep their flags

    @classmethod
    def _trusted(cls, order: np.ndarray, offsets: np.ndarray) -> Bins:
        """Wrap arrays that a packer just built (valid by construction) without checks or copies."""
        bins = cls.__new__(cls)
        bins._set(order, offsets)
        return bins

    def _set(self, order: np.ndarray, offsets: np.ndarray) -> None:
        order.flags.writeable = False
        offsets.flags.writeable = False
        self.order = order
        self.offsets = offsets

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        j = _row_index(i, len(self))
        return self.order[self.offsets[j] : self.offsets[j + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        order, offsets = self.order, self.offsets.tolist()
        for a, b in zip(offsets[:-1], offsets[1:]):
            yield order[a:b]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bins):
            return NotImplemented
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.order, other.order)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Bins(rows={len(self)}, items={self.order.shape[0]})"

    @property
    def sizes(self) -> np.ndarray:
        """``(rows,)`` int64: the number of items in each row."""
        return np.diff(self.offsets)

    def loads(self, lengths: ArrayLike, *, cost_multiple: int = 1) -> np.ndarray:
        """``(rows,)`` int64: each row's total length (or cost, with ``cost_multiple``).

        ``lengths`` is the ``(n,)`` array the bins were packed from.
        """
        arr = _as_lengths(lengths)
        if arr.shape[0] != self.order.shape[0]:
            raise ValueError(f"lengths has {arr.shape[0]} items but the bins hold {self.order.shape[0]}")
        if len(self) == 0:
            return np.zeros(0, np.int64)
        costs = round_up(arr, cost_multiple)
        return np.add.reduceat(costs[self.order], self.offsets[:-1])

    def bin_index(self) -> np.ndarray:
        """``(n,)`` int64: the row of each item (``bin_index()[i]`` is the row of item ``i``)."""
        out = np.empty(self.order.shape[0], np.int64)
        out[self.order] = np.repeat(np.arange(len(self), dtype=np.int64), self.sizes)
        return out

    def to_lists(self) -> list[list[int]]:
        """The rows as Python lists (for small packings and printing)."""
        return [row.tolist() for row in self]

    def check(
        self,
        lengths: ArrayLike,
        capacity: int,
        *,
        cost_multiple: int = 1,
        max_items_per_bin: int | None = None,
        weights: ArrayLike | None = None,
        max_weight_per_bin: int | None = None,
    ) -> None:
        """Raise ``ValueError`` unless every item appears exactly once, no row is
        empty, each row's cost fits ``capacity`` and holds at most ``max_items_per_bin``
        items and at most ``max_weight_per_bin`` of ``weights`` (the second budget)."""
        arr = _as_lengths(lengths)
        n = arr.shape[0]
        if self.order.shape[0] != n:
            raise ValueError(f"the bins hold {self.order.shape[0]} items but lengths has {n}")
        _check_permutation(self.order)  # the constructor checked it; bins from _trusted are re-checked here
        sizes = self.sizes
        if np.any(sizes < 1):
            raise ValueError(f"bin {int(np.flatnonzero(sizes < 1)[0])} is empty")
        if max_items_per_bin is not None and np.any(sizes > max_items_per_bin):
            b = int(np.argmax(sizes))
            raise ValueError(f"bin {b} holds {int(sizes[b])} items > max_items_per_bin={max_items_per_bin}")
        loads = self.loads(arr, cost_multiple=cost_multiple)
        if loads.shape[0] and loads.max() > capacity:
            b = int(np.argmax(loads))
            raise ValueError(f"bin {b} costs {int(loads[b])} > capacity {capacity}")
        if max_weight_per_bin is not None:
            if weights is None:
                raise ValueError("max_weight_per_bin needs the weights to check")
            w = _as_lengths(weights, "weights")
            if w.shape[0] != n:
                raise ValueError(f"weights has {w.shape[0]} entries but lengths has {n}")
            sums = np.add.reduceat(w[self.order], self.offsets[:-1]) if n else np.zeros(0, np.int64)
            if sums.shape[0] and sums.max() > max_weight_per_bin:
                b = int(np.argmax(sums))
                raise ValueError(f"bin {b} weighs {int(sums[b])} > max_weight_per_bin={max_weight_per_bin}")


@dataclass(frozen=True, eq=False)
class HistogramBins:
    """Rows of a histogram packing (:func:`pack_histogram`), without item indices.

    Row ``i`` holds ``counts[j]`` sequences of length ``lengths[j]`` for ``j``
    in ``offsets[i]:offsets[i + 1]``.

    Attributes:
        offsets: ``(rows + 1,)`` int64 into ``lengths`` and ``counts``.
        lengths: ``(m,)`` int64 sequence lengths.
        counts: ``(m,)`` int64, each ``>= 1``.
    """

    offsets: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, counts)`` of row ``i``."""
        j = _row_index(i, len(self))
        a, b = self.offsets[j], self.offsets[j + 1]
        return self.lengths[a:b], self.counts[a:b]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for j in range(len(self)):
            yield self[j]

    def loads(self, *, cost_multiple: int = 1) -> np.ndarray:
        """``(rows,)`` int64: each row's total length (or cost, with ``cost_multiple``)."""
        if len(self) == 0:
            return np.zeros(0, np.int64)
        per = round_up(self.lengths, cost_multiple)
        return np.add.reduceat(per * self.counts, self.offsets[:-1])

    def sequences(self) -> np.ndarray:
        """``(rows,)`` int64: the number of sequences in each row."""
        if len(self) == 0:
            return np.zeros(0, np.int64)
        return np.add.reduceat(self.counts, self.offsets[:-1])
