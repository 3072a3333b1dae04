"""Bin packing of sequence lengths into rows: which conversations share a row.

Every packing path asks the same question: given ``n`` sequence lengths and a
row capacity, group the sequences into as few rows as possible. The answer is a
:class:`Bins`: one flat ``order`` array of item indices plus ``offsets``, so
ten million items cost two int64 arrays, not ten million Python lists::

    lengths = [5, 10, 3, 8, 6]   capacity 16, best-fit decreasing
    bin 0   [1, 4]     10 + 6     = 16
    bin 1   [3, 0, 2]  8 + 5 + 3  = 16
    order   [1, 4, 3, 0, 2]    offsets [0, 2, 5]

Algorithms (:class:`Algorithm`):

- ``bfd``, best-fit decreasing, the default. Sequences of equal length are
  interchangeable and so are rows with equal room left, so BFD runs on the
  length *histogram*: for each length ``s`` (longest first) the best-fit row is
  any row of the smallest room ``r >= s``, and it takes ``r // s`` sequences of
  length ``s`` at once. Rows that were opened together and filled alike stay
  together as one *segment* (a run of row ids), so the decisions cost
  ``O(segment moves * log L)``: about 25,000 on 10M SFT-like lengths, 1,400 on
  Wikipedia's 16.3M, against ``n log L`` for a segment tree per item (TRL's
  Python loop). The row count is exactly that of item-by-item BFD. Item
  indices are then dealt to the rows by a counting sort and one streaming
  pass. Measured on one core of a busy 2-core Xeon (AVX-512): 10M lognormal
  lengths (capacity 8192) in 0.16-0.25 s (40-63M lengths/s), 1.7-2.1x the time
  of one ``np.sort`` of them, 700-1000x faster than TRL's BFD with the same
  rows, 0.002% above the ``L1`` bound; the Wikipedia histogram (16.3M
  sequences, capacity 512) in 0.24 s at 99.949% efficiency (8,138,483 rows,
  the best published); SQuAD 1.1 at 97.74%. Memory: the result (8 bytes per item, 8 per row) plus
  4 bytes per item while dealing. Numbers: ``benchmarks/bench_binpack.py``.
- ``ffd``, first-fit decreasing; ``greedy_knapsack`` (fill one row at a time
  with the longest sequence that still fits, as Megatron-Energon does: the same
  rows as ``ffd`` by a different route). Both also histogram-driven.
- ``first_fit_shuffle``: a seeded shuffle, then first fit, as Megatron-Bridge
  does. Item by item, ``O(n log rows)`` (2M lengths/s); 0.2-0.7% more rows
  than BFD on the cases above.
- ``next_fit``: keeps the input order, opens a new row when the next sequence
  does not fit (an order-preserving offline packer). ``O(n)``, 15-30% more
  rows than BFD.

Options every algorithm honours: ``cost_multiple`` (each sequence costs its
length rounded up to the per-sequence pad multiple, as the row builder pads it,
so no row overflows after padding), ``max_items_per_bin``, ``min_bins`` and
``bins_multiple_of`` (every data-parallel rank needs a row: rows are split until
there are enough) and ``seed``. The same input and seed give the same bins.

:func:`lower_bounds` gives ``L1 = ceil(sum / capacity)`` and the Martello-Toth
bound ``L2 >= L1`` (it counts sequences longer than half a row);
:func:`packing_stats` reports rows, efficiency and the gaps to both.

The loops run compiled by numba when it is installed (about 4 s to compile
the BFD path on first use, 7 s for all, then cached on disk: 0.4 s); without it
they run as plain Python, correct but about 100x slower.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, overload

import numpy as np

from .._base import StrEnum as _StrEnum
from .._base import choose
from . import _kernels as _k

__all__ = [
    "Algorithm",
    "Bins",
    "HistogramBins",
    "LowerBounds",
    "PackingStats",
    "lower_bounds",
    "pack",
    "pack_histogram",
    "packing_stats",
]


class Algorithm(_StrEnum):
    """How :func:`pack` chooses the row of each sequence."""

    BFD = "bfd"  #: best-fit decreasing: longest first, into the row it fills most tightly
    FFD = "ffd"  #: first-fit decreasing: longest first, into the first row it fits
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"  #: seeded shuffle, then first fit (Megatron-Bridge)
    NEXT_FIT = "next_fit"  #: input order kept; a new row when the next one does not fit
    GREEDY_KNAPSACK = "greedy_knapsack"  #: one row at a time, longest that fits (Energon); = ffd rows


#: The algorithms that only need the length histogram (and so work in :func:`pack_histogram`).
_HISTOGRAM_ALGORITHMS = (Algorithm.BFD, Algorithm.FFD, Algorithm.GREEDY_KNAPSACK)


def _choose_algorithm(algorithm: str | Algorithm) -> Algorithm:
    return choose(Algorithm, algorithm, "algorithm")


# ----------------------------------------------------------------------------
# results


def _row_index(i: int, rows: int) -> int:
    """``i`` as a row number in ``[0, rows)`` (negative counts from the end)."""
    j = operator.index(i)
    if j < 0:
        j += rows
    if not 0 <= j < rows:
        raise IndexError(f"bin {i} is out of range for {rows} bins")
    return j


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

    def __init__(self, order: Any, offsets: Any) -> None:
        order = np.ascontiguousarray(order, dtype=np.int64)
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if order.ndim != 1 or offsets.ndim != 1 or offsets.shape[0] < 1:
            raise ValueError(
                f"Bins needs a 1-D order and a 1-D offsets of at least one entry, "
                f"got shapes {order.shape} and {offsets.shape}"
            )
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

    def loads(self, lengths: Any, *, cost_multiple: int = 1) -> np.ndarray:
        """``(rows,)`` int64: each row's total length (or cost, with ``cost_multiple``).

        ``lengths`` is the ``(n,)`` array the bins were packed from.
        """
        arr = _as_lengths(lengths)
        if arr.shape[0] != self.order.shape[0]:
            raise ValueError(f"lengths has {arr.shape[0]} items but the bins hold {self.order.shape[0]}")
        if len(self) == 0:
            return np.zeros(0, np.int64)
        costs = arr if cost_multiple == 1 else -(-arr // cost_multiple) * cost_multiple
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
        lengths: Any,
        capacity: int,
        *,
        cost_multiple: int = 1,
        max_items_per_bin: int | None = None,
    ) -> None:
        """Raise ``ValueError`` unless every item appears exactly once, no row is
        empty, each row's cost fits ``capacity`` and holds at most ``max_items_per_bin``."""
        arr = _as_lengths(lengths)
        n = arr.shape[0]
        if self.order.shape[0] != n:
            raise ValueError(f"the bins hold {self.order.shape[0]} items but lengths has {n}")
        if n:
            lo, hi = int(self.order.min()), int(self.order.max())
            if lo < 0 or hi >= n:
                raise ValueError(f"the bins hold index {lo if lo < 0 else hi}, outside 0..{n - 1}")
            seen = np.bincount(self.order, minlength=n)
            if not np.all(seen == 1):
                bad = int(np.flatnonzero(seen != 1)[0])
                raise ValueError(f"item {bad} appears {int(seen[bad])} times in the bins, expected once")
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
        per = -(-self.lengths // cost_multiple) * cost_multiple
        return np.add.reduceat(per * self.counts, self.offsets[:-1])

    def sequences(self) -> np.ndarray:
        """``(rows,)`` int64: the number of sequences in each row."""
        if len(self) == 0:
            return np.zeros(0, np.int64)
        return np.add.reduceat(self.counts, self.offsets[:-1])


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


# ----------------------------------------------------------------------------
# validation


def _as_lengths(lengths: Any, name: str = "lengths") -> np.ndarray:
    """Any 1-D integer sequence (list, numpy, torch) as a contiguous int64 array."""
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.shape[0] == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}: cast them with .astype(int)")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _int_option(name: str, value: Any, minimum: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _too_long(i: int, length: int, capacity: int, cost_multiple: int) -> ValueError:
    if length < 1:
        where = f"lengths[{i}]" if i >= 0 else "a length"
        return ValueError(
            f"{where} = {length}: every sequence needs at least 1 token; drop empty sequences before packing"
        )
    cost = -(-length // cost_multiple) * cost_multiple
    where = f"lengths[{i}] = {length}" if i >= 0 else f"length {length}"
    if cost_multiple == 1:
        what = f"{where} is longer than the capacity {capacity}"
    else:
        what = (
            f"{where} costs {cost} tokens once rounded up to a multiple of "
            f"cost_multiple={cost_multiple}, more than the capacity {capacity}"
        )
    return ValueError(
        f"{what}: truncate or drop over-long sequences when tokenizing, or raise the capacity to at least {cost}"
    )


def _unit_histogram(
    values: np.ndarray, counts: np.ndarray | None, capacity: int, cost_multiple: int
) -> np.ndarray:
    """``(capacity // cost_multiple + 1,)`` int64 histogram of item units, validated."""
    cap_units = capacity // cost_multiple
    if counts is None:
        hist, bad = _k.scan_units(values, cost_multiple, cap_units)
        if bad >= 0:
            raise _too_long(int(bad), int(values[bad]), capacity, cost_multiple)
        return hist
    used = counts > 0
    units = -(-values // cost_multiple)
    bad_mask = used & ((values < 1) | (units > cap_units))
    if bad_mask.any():
        j = int(np.flatnonzero(bad_mask)[0])
        raise _too_long(-1, int(values[j]), capacity, cost_multiple)
    hist = np.zeros(cap_units + 1, np.int64)
    np.add.at(hist, units[used], counts[used])
    return hist


def _as_counts(counts: Any, values: np.ndarray) -> np.ndarray:
    arr = _as_lengths(counts, "counts")
    if arr.shape != values.shape:
        raise ValueError(f"counts has shape {arr.shape} but the lengths have shape {values.shape}")
    if arr.shape[0] and arr.min() < 0:
        raise ValueError(f"counts must be >= 0, got {int(arr.min())}")
    return arr


# ----------------------------------------------------------------------------
# packing


def pack(
    lengths: Any,
    capacity: int,
    algorithm: str | Algorithm = "bfd",
    *,
    cost_multiple: int = 1,
    max_items_per_bin: int | None = None,
    min_bins: int | None = None,
    bins_multiple_of: int | None = None,
    seed: int = 0,
) -> Bins:
    """Pack sequences of the given lengths into rows of ``capacity`` tokens.

    Args:
        lengths: ``(n,)`` integer lengths, each ``>= 1`` (numpy array, list or
            torch tensor; tens of millions are fine).
        capacity: tokens per row.
        algorithm: one of :class:`Algorithm` (``"bfd"`` by default).
        cost_multiple: each sequence costs its length rounded up to this
            multiple (the per-sequence pad multiple of the row builder, e.g.
            ``2 * CP``); rows hold at most ``capacity`` of cost.
        max_items_per_bin: at most this many sequences per row.
        min_bins: at least this many rows (rows are split, largest item count
            first, until there are enough).
        bins_multiple_of: the row count is a multiple of this (e.g. the
            data-parallel size, so every rank gets a row).
        seed: shuffle seed of ``first_fit_shuffle`` (the others are
            deterministic without it).

    Returns:
        :class:`Bins`: every index of ``lengths`` exactly once; each row's cost
        ``<= capacity``. Histogram-driven algorithms list each row's items
        longest first; ``next_fit`` keeps the input order.

    Raises:
        ValueError: an unknown algorithm (listing the valid ones), a length
            below 1 or above the capacity (naming its index, length and the
            capacity), or fewer sequences than the rows required.

    >>> bins = pack([5, 10, 3, 8, 6], capacity=16)
    >>> bins.to_lists()
    [[1, 4], [3, 0, 2]]
    >>> pack([5, 10, 3, 8, 6], capacity=16, algorithm="next_fit").to_lists()
    [[0, 1], [2, 3], [4]]
    """
    algo = _choose_algorithm(algorithm)
    capacity = _int_option("capacity", capacity, 1)
    cost_multiple = _int_option("cost_multiple", cost_multiple, 1)
    max_items = None if max_items_per_bin is None else _int_option("max_items_per_bin", max_items_per_bin, 1)
    min_rows = 0 if min_bins is None else _int_option("min_bins", min_bins, 0)
    multiple_of = 1 if bins_multiple_of is None else _int_option("bins_multiple_of", bins_multiple_of, 1)
    seed = _int_option("seed", seed, 0)

    arr = _as_lengths(lengths)
    n = arr.shape[0]
    if min_rows > n:
        raise ValueError(
            f"min_bins={min_rows} rows need at least {min_rows} sequences, got {n}: "
            f"lower min_bins or pack more sequences"
        )
    hist = _unit_histogram(arr, None, capacity, cost_multiple)
    cap_units = capacity // cost_multiple
    item_cap = n + 1 if max_items is None else max_items

    if algo in _HISTOGRAM_ALGORITHMS:
        records = _RECORD_KERNELS[algo](hist, item_cap)
        bucket = np.empty(n, np.int32 if n < 2**31 else np.int64)  # int32 halves the traffic
        start = _k.bucket_by_units(arr, cost_multiple, hist, bucket)
        order, offsets = _k.records_to_order(*records, bucket, start)
        del bucket
    elif algo is Algorithm.FIRST_FIT_SHUFFLE:
        visit = np.random.default_rng(seed).permutation(n)
        order, offsets = _k.first_fit_items(arr, cost_multiple, cap_units, item_cap, visit)
    else:  # next_fit
        offsets = _k.next_fit_offsets(arr, cost_multiple, cap_units, item_cap)
        order = np.arange(n, dtype=np.int64)

    rows = offsets.shape[0] - 1
    target = max(rows, min_rows)
    target = -(-target // multiple_of) * multiple_of
    if target > rows:
        if target > n:
            raise ValueError(
                f"{target} rows are required (min_bins={min_bins}, bins_multiple_of={bins_multiple_of}, "
                f"packing made {rows}) but there are only {n} sequences to fill them: pack more sequences, "
                f"or lower min_bins / bins_multiple_of"
            )
        offsets = _split_rows(offsets, target)
    return Bins._trusted(order, offsets)


_RECORD_KERNELS = {
    Algorithm.BFD: _k.bfd_records,
    Algorithm.FFD: _k.ffd_records,
    Algorithm.GREEDY_KNAPSACK: _k.greedy_records,
}


def _split_rows(offsets: np.ndarray, target: int) -> np.ndarray:
    """Split rows (contiguous runs of ``order``) until there are ``target`` of them.

    Chooses the piece count ``k_b`` of each row to minimise the largest piece
    (``P``: the smallest with ``sum(ceil(c_b / P)) <= target``, the rest of the
    pieces going to the first rows that can take one more), then cuts each row
    into ``k_b`` near-equal runs. Pieces are subsets, so capacity and
    ``max_items_per_bin`` still hold, and ``order`` is untouched.
    """
    sizes = np.diff(offsets)
    n = int(offsets[-1])
    lo, hi = 1, int(sizes.max())
    while lo < hi:
        mid = (lo + hi) // 2
        if int((-(-sizes // mid)).sum()) <= target:
            hi = mid
        else:
            lo = mid + 1
    pieces = -(-sizes // lo)
    extra = target - int(pieces.sum())
    if extra > 0:  # lo > 1 here, since sum(ceil(c / 1)) = n >= target
        more = -(-sizes // (lo - 1)) - pieces
        before = np.cumsum(more) - more
        pieces = pieces + np.clip(extra - before, 0, more)
    owner = np.repeat(np.arange(sizes.shape[0]), pieces)
    first = np.cumsum(pieces) - pieces
    i = np.arange(target, dtype=np.int64) - first[owner]
    starts = offsets[:-1][owner] + (i * sizes[owner]) // pieces[owner]
    return np.append(starts, n).astype(np.int64)


def pack_histogram(
    lengths: Any,
    counts: Any,
    capacity: int,
    algorithm: str | Algorithm = "bfd",
    *,
    cost_multiple: int = 1,
    max_items_per_bin: int | None = None,
) -> HistogramBins:
    """Pack a length histogram (``counts[j]`` sequences of ``lengths[j]``) without item indices.

    The same rows as :func:`pack` on the expanded lengths, in memory
    proportional to the rows, not to the sequences. Only the histogram-driven
    algorithms (``bfd``, ``ffd``, ``greedy_knapsack``) apply.

    Args:
        lengths: ``(k,)`` integer lengths (repeats are allowed).
        counts: ``(k,)`` integer counts, ``>= 0``.
        capacity, algorithm, cost_multiple, max_items_per_bin: as in :func:`pack`.

    Returns:
        :class:`HistogramBins`.

    >>> hb = pack_histogram([10, 8, 6, 5, 3], [1, 1, 1, 1, 1], capacity=16)
    >>> [(l.tolist(), c.tolist()) for l, c in hb]
    [([10, 6], [1, 1]), ([8, 5, 3], [1, 1, 1])]
    """
    algo = _choose_algorithm(algorithm)
    if algo not in _HISTOGRAM_ALGORITHMS:
        valid = ", ".join(repr(a.value) for a in _HISTOGRAM_ALGORITHMS)
        raise ValueError(f"pack_histogram needs a histogram-driven algorithm ({valid}), got {algo.value!r}")
    capacity = _int_option("capacity", capacity, 1)
    cost_multiple = _int_option("cost_multiple", cost_multiple, 1)
    max_items = None if max_items_per_bin is None else _int_option("max_items_per_bin", max_items_per_bin, 1)
    values = _as_lengths(lengths)
    cnts = _as_counts(counts, values)
    hist = _unit_histogram(values, cnts, capacity, cost_multiple)
    n = int(hist.sum())
    used = cnts > 0
    values, cnts = values[used], cnts[used]
    units = -(-values // cost_multiple)
    by_class = np.lexsort((-values, units))  # within a cost class, longest first
    run_len, run_cnt = values[by_class], cnts[by_class]
    run_start = np.searchsorted(units[by_class], np.arange(hist.shape[0] + 1), side="left").astype(np.int64)
    records = _RECORD_KERNELS[algo](hist, n + 1 if max_items is None else max_items)
    offsets, out_len, out_cnt = _k.records_to_runs(*records, run_len, run_cnt, run_start)
    return HistogramBins(offsets, out_len, out_cnt)


# ----------------------------------------------------------------------------
# bounds and statistics


def lower_bounds(lengths: Any, capacity: int, *, counts: Any = None, cost_multiple: int = 1) -> LowerBounds:
    """Lower bounds on the rows needed to pack ``lengths`` into rows of ``capacity``.

    ``L1 = ceil(sum(cost) / U)``; ``L2`` is Martello and Toth's bound (1990):
    for every ``a <= U / 2``, items above ``U - a`` each need their own row
    (with no room left for any item ``>= a``), items in ``(U/2, U - a]`` too,
    and items in ``[a, U/2]`` can only use the room those second rows leave
    before opening more; ``L2 = max_a`` of that count.
    Costs are in units of ``cost_multiple`` and ``U = capacity // cost_multiple``.

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
    capacity = _int_option("capacity", capacity, 1)
    cost_multiple = _int_option("cost_multiple", cost_multiple, 1)
    values = _as_lengths(lengths)
    cnts = None if counts is None else _as_counts(counts, values)
    return _bounds_of_histogram(_unit_histogram(values, cnts, capacity, cost_multiple))


def _bounds_of_histogram(hist: np.ndarray) -> LowerBounds:
    cap_units = hist.shape[0] - 1
    w = np.arange(cap_units + 1, dtype=np.int64)
    sizes = hist * w
    total = int(sizes.sum())
    if total == 0:
        return LowerBounds(0, 0)
    l1 = -(-total // cap_units)
    # n_ge[x] / s_ge[x]: number / total size of items of size >= x, for x in 0..U+1
    n_ge = np.zeros(cap_units + 2, np.int64)
    s_ge = np.zeros(cap_units + 2, np.int64)
    n_ge[:-1] = np.cumsum(hist[::-1])[::-1]
    s_ge[:-1] = np.cumsum(sizes[::-1])[::-1]
    half = cap_units // 2
    a = np.arange(half + 1, dtype=np.int64)
    above = cap_units - a + 1  # J1: size > U - a
    j1 = n_ge[above]
    j2 = n_ge[half + 1] - n_ge[above]  # J2: U/2 < size <= U - a
    s2 = s_ge[half + 1] - s_ge[above]
    s3 = s_ge[a] - s_ge[half + 1]  # J3: a <= size <= U/2
    free = j2 * cap_units - s2
    spill = np.maximum(0, -(-(s3 - free) // cap_units))
    l2 = int((j1 + j2 + spill).max())
    return LowerBounds(int(l1), l2)


def packing_stats(
    lengths: Any,
    bins: Bins | HistogramBins | Sequence[Any],
    capacity: int,
    *,
    counts: Any = None,
    cost_multiple: int = 1,
) -> PackingStats:
    """Rows, efficiency and gaps to the lower bounds of a packing.

    Args:
        lengths: ``(n,)`` lengths that were packed (or the distinct lengths of a
            histogram with ``counts``).
        bins: the packing (its ``len()`` is the row count).
        capacity: tokens per row.
        counts: optional histogram counts for ``lengths``.
        cost_multiple: as in :func:`pack` (the bounds are on rounded costs).

    >>> lengths = [5, 10, 3, 8, 6]
    >>> s = packing_stats(lengths, pack(lengths, 16), 16)
    >>> s.rows, s.efficiency, s.l1, s.l2, s.gap_l1, s.packing_factor
    (2, 1.0, 2, 2, 0.0, 2.5)
    """
    capacity = _int_option("capacity", capacity, 1)
    cost_multiple = _int_option("cost_multiple", cost_multiple, 1)
    values = _as_lengths(lengths)
    cnts = None if counts is None else _as_counts(counts, values)
    hist = _unit_histogram(values, cnts, capacity, cost_multiple)
    if cnts is None:
        sequences, tokens = int(values.shape[0]), int(values.sum())
    else:
        sequences, tokens = int(cnts.sum()), int((values * cnts).sum())
    if isinstance(bins, Bins) and bins.order.shape[0] != sequences:
        raise ValueError(f"the bins hold {bins.order.shape[0]} items but lengths has {sequences}")
    rows = len(bins)
    l1, l2 = _bounds_of_histogram(hist)
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
