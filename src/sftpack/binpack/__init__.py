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
  together as one *segment* (a run of row ids), so the decisions cost one
  room-index lookup (at most 31 steps) per segment move: about 25,000 moves
  on 10M SFT-like lengths, 1,400 on Wikipedia's 16.3M, against one lookup
  per item for a segment tree per item (TRL's Python loop). The row count is
  exactly that of item-by-item BFD. Item indices are then grouped by size
  (a counting or radix sort) and dealt to the rows in one streaming pass.
  Measured on one core of a busy 2-core Xeon (AVX-512): 10M lognormal
  lengths (capacity 8192) in 0.16-0.32 s (31-63M lengths/s), 1.7-2.1x the
  time of one ``np.sort`` of them, 700-1000x faster than TRL's BFD with the
  same rows, 0.002% above the ``L1`` bound; the Wikipedia histogram (16.3M
  sequences, capacity 512) in 0.24 s at 99.949% efficiency (8,138,483 rows,
  the best published); SQuAD 1.1 at 97.74%. Memory: the result (8 bytes per
  item, 8 per row) plus 4 bytes per item while dealing. Numbers:
  ``benchmarks/bench_binpack.py``.
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
:func:`packing_stats` reports rows, efficiency and the gaps to both, after
checking that the bins hold every sequence exactly once within the capacity.

The capacity costs nothing. Any capacity up to ``2**31 - 1`` tokens
(:data:`MAX_CAPACITY`) is accepted, and time and memory follow the number of
sequences ``n``, of distinct costs ``D`` and of rows, never the capacity ``U``:
the kernels work on the ``D`` distinct sizes (ranks), BFD finds the tightest
row in a crit-bit tree over the distinct rooms in use (``2R - 1`` nodes for
``R`` rooms), and the bounds evaluate Martello-Toth's ``L2`` only at the
distinct sizes (between two sizes it cannot grow). Only the grouping of
sequences by size has two routes: while ``U <= max(65536, n / 4)`` a counting
sort over ``0..U`` (64 bytes per unit at most, so at most 16 per sequence),
above it a radix sort (at most 3 passes, ``O(n)``, 12 bytes of scratch per
sequence). Both give the same groups, so every algorithm gives the same rows
as before, and scaling all lengths and the capacity by ``K`` gives the same
``Bins`` (decisions only compare and divide them). Before this,
``pack([5, 6], 10**8)`` took 19 s and 4 GB and ``10**9`` raised
``MemoryError``; now two sequences take 10-40 us at any capacity, and the 10M
lognormal lengths scaled to a capacity just under ``2**31`` pack into the same
1,187,237 rows in 0.5-1.0 s (the radix route) against 0.24-0.29 s at capacity
8192 in the same runs (the counting one; one core of a busy 2-core Xeon).

The loops are compiled by numba, a dependency. Compiling is lazy and per
algorithm: ``import sftpack.binpack`` imports neither numba nor torch (0.11 s
of CPU, numpy included); the first call of an algorithm imports numba and
compiles only the kernels that algorithm runs, and numba's on-disk cache
(``cache=True``; ``NUMBA_CACHE_DIR`` moves it) keeps them for every later
process. First call with an empty cache, CPU seconds on the busy 2-core Xeon:
``bfd`` 4.6, ``ffd`` 3.1, ``greedy_knapsack`` 3.5, ``first_fit_shuffle`` 1.8,
``next_fit`` 0.9; with the cache warm, 0.45-0.5 for any (mostly importing
numba). :func:`lower_bounds` and :func:`packing_stats` are numpy only and
never wait for numba. Numbers: ``benchmarks/bench_import.py``.

Modules: ``_pack`` (the packers and :class:`Algorithm`), ``_kernels`` (the
compiled loops), ``_bins`` (:class:`Bins`, :class:`HistogramBins`),
``_bounds`` (:func:`lower_bounds`, :func:`packing_stats`), ``_inputs``
(validation and grouping by cost).
"""

from __future__ import annotations

from ._bins import Bins, HistogramBins
from ._bounds import LowerBounds, PackingStats, lower_bounds, packing_stats
from ._inputs import MAX_CAPACITY
from ._pack import Algorithm, pack, pack_histogram

__all__ = [
    "MAX_CAPACITY",
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
