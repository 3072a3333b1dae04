"""Bin packing of sequence lengths into rows: which conversations share a row.

Every packing path asks the same question: given ``n`` sequence lengths and a
row capacity, group the sequences into as few rows as possible. :func:`pack`
answers with a :class:`Bins`: one flat ``order`` array of item indices plus
``offsets``, so ten million items cost two int64 arrays, not ten million Python
lists::

    lengths = [5, 10, 3, 8, 6]   capacity 16, best-fit decreasing
    bin 0   [1, 4]     10 + 6     = 16
    bin 1   [3, 0, 2]  8 + 5 + 3  = 16
    order   [1, 4, 3, 0, 2]    offsets [0, 2, 5]

Algorithms (:class:`Algorithm`):

- ``bfd``, best-fit decreasing, the default. It runs on the length histogram:
  sequences of equal length are interchangeable, and so are rows with equal
  room left, so for each length (longest first) it fills whole groups of rows
  at once and gives exactly the rows of item-by-item BFD.
- ``ffd``, first-fit decreasing, and ``greedy_knapsack`` (fill one row at a
  time with the longest sequence that still fits, as Megatron-Energon does);
  also histogram-driven.
- ``first_fit_shuffle``: a seeded shuffle, then first fit, as Megatron-Bridge
  does.
- ``next_fit``: keeps the input order and opens a new row when the next
  sequence does not fit.

Options every algorithm honours: ``cost_multiple`` (each sequence costs its
length rounded up to the per-sequence pad multiple, as the row builder pads it,
so no row overflows after padding), ``max_items_per_bin``, ``min_bins`` and
``bins_multiple_of`` (every data-parallel rank needs a row) and ``seed``. The
same input and seed give the same bins. A second budget, ``weights`` (one
integer per sequence, e.g. a multimodal sample's vision patches) capped per
row by ``max_weight_per_bin``, is honoured by every algorithm, item by item.
``groups`` (one integer id per sequence) binds sequences into groups that no row
splits (a DPO pair, a prompt's GRPO completions): :class:`Groups` numbers them, and
every algorithm packs the groups as units, then expands each back to its members.
:func:`pack_histogram` packs a
``(length, count)`` histogram into :class:`HistogramBins` without item indices.

Time and memory follow the number of sequences, of distinct lengths and of
rows, never the capacity: any capacity up to :data:`MAX_CAPACITY`
(``2**31 - 1``) is accepted, and multiplying every length and the capacity by
``K`` gives the same rows. :func:`lower_bounds` gives ``L1 = ceil(sum /
capacity)`` and the Martello-Toth bound ``L2``; :func:`packing_stats` reports
rows, efficiency and the gaps to both (:class:`PackingStats`), after checking
that the bins hold every sequence exactly once within the capacity.

The loops are compiled by numba, lazily and per algorithm, and kept in numba's
on-disk cache (up to 64 sequences, while numba is not loaded, they run as plain
Python instead: the same rows without numba's ~1.2 s first call, see
``_kernels.kernels``): ``import sftpack.binpack`` loads numpy only (neither numba nor
torch), and :func:`lower_bounds` and :func:`packing_stats` never wait for a
compile. Guide: ``docs/binpack.md``; measured speed, memory and first-call
cost: ``benchmarks/RESULTS.md`` (``benchmarks/bench_binpack.py``,
``benchmarks/bench_import.py``).

Modules: ``_pack`` (the packers and :class:`Algorithm`), ``_kernels`` (the
registry of the compiled loops and their plain-Python copies), whose kernels
live per family in ``_kernels_common`` (shared helpers, grouping by cost,
records to bins), ``_kernels_fit`` (best and first fit), ``_kernels_next``
(next fit, greedy knapsack) and ``_kernels_two`` (two budgets), ``_bins``
(:class:`Bins`, :class:`HistogramBins`), ``_groups`` (:class:`Groups`), ``_bounds`` (:func:`lower_bounds`,
:func:`packing_stats`), ``_inputs`` (validation and grouping by cost). Out of ``__all__`` and
importable from here (not from ``_kernels``): :data:`PLAIN_MAX_ITEMS`, the most sequences a
pack runs as plain Python (the benchmarks time the first compiled call just past it).
"""

from __future__ import annotations

from ._bins import Bins, HistogramBins
from ._bounds import LowerBounds, PackingStats, lower_bounds, packing_stats
from ._groups import Groups
from ._inputs import MAX_CAPACITY
from ._kernels import PLAIN_MAX_ITEMS as PLAIN_MAX_ITEMS
from ._pack import Algorithm, pack, pack_histogram

__all__ = [
    "MAX_CAPACITY",
    "Algorithm",
    "Bins",
    "Groups",
    "HistogramBins",
    "LowerBounds",
    "PackingStats",
    "lower_bounds",
    "pack",
    "pack_histogram",
    "packing_stats",
]
