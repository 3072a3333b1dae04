"""How good a packing is: lower bounds on the rows and the statistics of a packing.

:func:`lower_bounds` gives ``L1`` and Martello-Toth's ``L2`` from the distinct
costs only; :func:`packing_stats` checks a packing (every sequence exactly
once, no row over the capacity) and reports rows, efficiency and the gaps.
Numpy only: nothing here waits for numba.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from .._base import positive_int
from ._bins import Bins, HistogramBins
from ._inputs import _as_counts, _as_lengths, _capacity, _size_histogram


class LowerBounds(NamedTuple):
    """Lower bounds on the number of rows any packing needs."""

    l1: int  #: ``ceil(total cost / capacity)``
    l2: int  #: Martello-Toth ``L2`` (``>= l1``): also counts sequences longer than half a row


@dataclass(frozen=True)
class PackingStats:
    """How good a packing is (:func:`packing_stats`)."""

    rows: int  #: number of rows (bins)
    sequences: int  #: number of sequences packed
    tokens: int  #: real tokens (sum of the lengths)
    capacity: int  #: row capacity in tokens
    efficiency: float  #: ``tokens / (rows * capacity)``
    l1: int  #: lower bound ``ceil(total cost / capacity)``
    l2: int  #: Martello-Toth lower bound
    gap_l1: float  #: ``rows / l1 - 1``: fraction of rows above ``l1``
    gap_l2: float  #: ``rows / l2 - 1``
    packing_factor: float  #: sequences per row

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def lower_bounds(
    lengths: ArrayLike, capacity: int, *, counts: ArrayLike | None = None, cost_multiple: int = 1
) -> LowerBounds:
    """Lower bounds on the rows needed to pack ``lengths`` into rows of ``capacity``.

    ``L1 = ceil(sum(cost) / U)``; ``L2`` is Martello and Toth's bound (1990):
    for every ``a <= U / 2``, items above ``U - a`` each need their own row
    (with no room left for any item ``>= a``), items in ``(U/2, U - a]`` too,
    and items in ``[a, U/2]`` can only use the room those second rows leave
    before opening more; ``L2 = max_a`` of that count. Between two item sizes
    the count only grows with ``a``, so only ``a`` in the sizes ``<= U/2`` and
    ``U/2`` itself are tried: ``O(D log D)`` for ``D`` distinct sizes, whatever
    the capacity. Costs are in units of ``cost_multiple`` and
    ``U = capacity // cost_multiple``.

    Args:
        lengths: ``(n,)`` integer lengths, or the distinct lengths of a
            histogram when ``counts`` is given.
        capacity: tokens per row.
        counts: optional ``(k,)`` counts of each length (histogram form).
        cost_multiple: as in :func:`pack`.

    >>> lower_bounds([6, 6, 6, 2, 2, 2], capacity=10)
    LowerBounds(l1=3, l2=3)
    >>> lower_bounds([6, 6, 6], capacity=10)  # no two of them share a row
    LowerBounds(l1=2, l2=3)
    """
    capacity = _capacity(capacity)
    cost_multiple = positive_int("cost_multiple", cost_multiple)
    values = _as_lengths(lengths)
    cnts = None if counts is None else _as_counts(counts, values)
    sizes, per_size = _size_histogram(values, cnts, capacity, cost_multiple)
    return _bounds(sizes, per_size, capacity // cost_multiple)


def _bounds(sizes: np.ndarray, counts: np.ndarray, cap_units: int) -> LowerBounds:
    """L1 and L2 of ``counts[k]`` items of ``sizes[k]`` units (sizes ascending, distinct)."""
    weight = sizes * counts
    total = int(weight.sum())
    if total == 0:
        return LowerBounds(0, 0)
    l1 = -(-total // cap_units)
    # n_ge(x) / s_ge(x): number / total size of the items of size >= x
    n_suffix = np.append(np.cumsum(counts[::-1])[::-1], 0)
    s_suffix = np.append(np.cumsum(weight[::-1])[::-1], 0)

    def ge(x: Any) -> tuple[Any, Any]:
        k = np.searchsorted(sizes, x, side="left")
        return n_suffix[k], s_suffix[k]

    half = cap_units // 2
    a = np.unique(np.append(sizes[sizes <= half], [0, half]))
    j1, s1 = ge(cap_units - a + 1)  # J1: size > U - a
    n_big, s_big = ge(half + 1)  # J1 + J2: size > U/2
    j2, s2 = n_big - j1, s_big - s1  # J2: U/2 < size <= U - a
    s3 = ge(a)[1] - s_big  # J3: a <= size <= U/2
    free = j2 * cap_units - s2
    spill = np.maximum(0, -(-(s3 - free) // cap_units))
    l2 = int((j1 + j2 + spill).max())
    return LowerBounds(int(l1), l2)


def packing_stats(
    lengths: ArrayLike,
    bins: Bins | HistogramBins | Sequence[Any],
    capacity: int,
    *,
    counts: ArrayLike | None = None,
    cost_multiple: int = 1,
) -> PackingStats:
    """Rows, efficiency and gaps to the lower bounds of a packing.

    The packing is checked first: it must hold every sequence exactly once
    (no index missing, repeated or out of range; for a :class:`HistogramBins`,
    the same count of every length) and no row may cost more than
    ``capacity``, else ``ValueError`` says which item or row is wrong.

    Args:
        lengths: ``(n,)`` lengths that were packed (or the distinct lengths of a
            histogram with ``counts``).
        bins: the packing: :class:`Bins`, :class:`HistogramBins`, or rows as
            sequences of item indices.
        capacity: tokens per row.
        counts: optional histogram counts for ``lengths`` (items are then
            numbered by expanding the histogram in order).
        cost_multiple: as in :func:`pack` (the bounds are on rounded costs).

    >>> from sftpack.binpack import pack
    >>> lengths = [5, 10, 3, 8, 6]
    >>> s = packing_stats(lengths, pack(lengths, 16), 16)
    >>> s.rows, s.efficiency, s.l1, s.l2, s.gap_l1, s.packing_factor
    (2, 1.0, 2, 2, 0.0, 2.5)
    >>> packing_stats(lengths, [[1, 4], [3, 0]], 16)
    Traceback (most recent call last):
    ...
    ValueError: item 2 is in no bin: every sequence must be packed exactly once
    """
    capacity = _capacity(capacity)
    cost_multiple = positive_int("cost_multiple", cost_multiple)
    values = _as_lengths(lengths)
    cnts = None if counts is None else _as_counts(counts, values)
    sizes, per_size = _size_histogram(values, cnts, capacity, cost_multiple)
    if cnts is None:
        sequences, tokens = int(values.shape[0]), int(values.sum())
    else:
        sequences, tokens = int(cnts.sum()), int((values * cnts).sum())
    _check_packing(bins, values, cnts, sequences, capacity, cost_multiple)
    rows = len(bins)
    l1, l2 = _bounds(sizes, per_size, capacity // cost_multiple)
    return PackingStats(
        rows=rows,
        sequences=sequences,
        tokens=tokens,
        capacity=capacity,
        efficiency=tokens / (rows * capacity) if rows else 0.0,
        l1=l1,
        l2=l2,
        gap_l1=rows / l1 - 1 if l1 else 0.0,
        gap_l2=rows / l2 - 1 if l2 else 0.0,
        packing_factor=sequences / rows if rows else 0.0,
    )


def _check_packing(
    bins: Any, values: np.ndarray, counts: np.ndarray | None, sequences: int, capacity: int, cost_multiple: int
) -> None:
    """Raise ``ValueError`` unless ``bins`` holds each sequence exactly once within ``capacity``."""
    if isinstance(bins, HistogramBins):
        want = _tally(values, np.ones_like(values) if counts is None else counts)
        got = _tally(np.asarray(bins.lengths, np.int64), np.asarray(bins.counts, np.int64))
        for length in sorted(set(want) | set(got)):
            if want.get(length, 0) != got.get(length, 0):
                raise ValueError(
                    f"the bins hold {got.get(length, 0)} sequences of length {length} but lengths has "
                    f"{want.get(length, 0)}: every sequence must be packed exactly once"
                )
        loads = bins.loads(cost_multiple=cost_multiple)
    else:
        if not isinstance(bins, Bins):
            bins = _bins_of_rows(bins, sequences)
        if bins.order.shape[0] != sequences:
            raise ValueError(
                f"the bins hold {bins.order.shape[0]} items but lengths has {sequences}: "
                f"every sequence must be packed exactly once"
            )
        items = values if counts is None else np.repeat(values, counts)
        loads = bins.loads(items, cost_multiple=cost_multiple)
    if loads.shape[0] and loads.max() > capacity:
        b = int(np.argmax(loads))
        raise ValueError(f"bin {b} costs {int(loads[b])} tokens, more than the capacity {capacity}")


def _bins_of_rows(rows: Sequence[Any], n: int) -> Bins:
    """Rows of item indices as :class:`Bins`, or ``ValueError`` naming the row and
    item when they do not hold each of the ``n`` items exactly once."""
    arrays = [_as_lengths(row, f"bins[{b}]") for b, row in enumerate(rows)]
    sizes = np.array([row.shape[0] for row in arrays], np.int64)
    if np.any(sizes == 0):
        raise ValueError(f"bins[{int(np.flatnonzero(sizes == 0)[0])}] is empty: a packing has no empty row")
    order = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    row_of = np.repeat(np.arange(sizes.shape[0]), sizes)
    outside = np.flatnonzero((order < 0) | (order >= n))
    if outside.size:
        p = int(outside[0])
        raise ValueError(
            f"bins[{int(row_of[p])}] holds item {int(order[p])}, outside 0..{n - 1}: "
            f"every sequence must be packed exactly once"
        )
    seen = np.bincount(order, minlength=n)
    if n and seen.max() > 1:
        i = int(np.flatnonzero(seen > 1)[0])
        where = " and ".join(f"bins[{int(b)}]" for b in row_of[order == i][:2])
        raise ValueError(
            f"item {i} is packed {int(seen[i])} times ({where}): every sequence must be packed exactly once"
        )
    if n and seen.min() < 1:
        i = int(np.flatnonzero(seen < 1)[0])
        raise ValueError(f"item {i} is in no bin: every sequence must be packed exactly once")
    return Bins._trusted(order, np.append(0, np.cumsum(sizes)).astype(np.int64))


def _tally(values: np.ndarray, counts: np.ndarray) -> dict[int, int]:
    """``{length: total count}`` of a histogram (lengths may repeat; zero counts dropped)."""
    uniq, inverse = np.unique(values, return_inverse=True)
    total = np.zeros(uniq.shape[0], np.int64)
    np.add.at(total, inverse, counts)
    return {int(v): int(c) for v, c in zip(uniq, total) if c}
