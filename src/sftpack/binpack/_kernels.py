"""The loops behind :mod:`sftpack.binpack`, compiled by numba on first use: the
registry that hands the packers the kernels, compiled or as plain Python.

The kernels live in one module per algorithm family, each registering its
kernels with :func:`._kernels_common._kernel`:

- :mod:`._kernels_common`: the max (or min) segment tree, grouping the items
  by cost (:func:`scan_units`, :func:`bucket_by_units`, :func:`sort_by_units`),
  and records to bins (:func:`records_to_order`, :func:`records_to_runs`);
- :mod:`._kernels_fit`: best fit and first fit (:func:`bfd_records`,
  :func:`ffd_records`, :func:`first_fit_items`);
- :mod:`._kernels_next`: next fit, under one budget or two, and greedy
  knapsack (:func:`next_fit_offsets`, :func:`greedy_records`);
- :mod:`._kernels_two`: two budgets (:func:`any_fit_two`,
  :func:`best_fit_two`, :func:`greedy_two`).

This module binds every kernel by name (:data:`_KERNELS`, private helpers
included) and is the compiled table: :func:`kernels` returns it once
:func:`load` has run. :data:`PLAIN` is the plain-Python table.

Every kernel works in *units*: an item of length ``L`` costs
``u = ceil(L / cost_multiple)`` units and a bin holds ``U = capacity // cost_multiple``
units, so "a bin never overflows after padding" is the plain integer test
``sum(u) <= U``. The packing kernels never index an array by units: the
sizes present are compressed to their *ranks* ``0..D-1`` in ``sizes`` (the
``D`` distinct unit sizes, ascending), so their time and memory follow the
items, the distinct sizes and the bins, never ``U``. Only the grouping of
items by size has a dense form (:func:`scan_units` + :func:`bucket_by_units`,
arrays over ``0..U``, used while ``U`` is small); :func:`sort_by_units` (a
radix sort) gives the same groups for any ``U < 2**31``.

Three kernels decide the bins from the size histogram alone (items of equal
cost are interchangeable) and emit *records* ``(first bin, end bin, size rank,
count, before)``: "each of the bins ``first..end-1`` receives ``count`` items
of that size after the ``before`` it holds" (:func:`bfd_records`,
:func:`ffd_records`, :func:`greedy_records`). BFD keeps bins in segments of
equal history, so it needs few records (about 25,000 for 10M SFT-like
lengths, 1,400 for Wikipedia's 16.3M); FFD and greedy make one per (bin,
size) pair (2.3M and 16M there), which is why they are 3-8x slower. Two
kernels then turn records into item indices (:func:`records_to_order`) or
into per-bin histograms (:func:`records_to_runs`). :func:`first_fit_items`
(shuffled first fit) and :func:`next_fit_offsets` need the item order and go
item by item. (BFD's room index, a crit-bit tree over the rooms in use, is
described in :mod:`._kernels_fit`.)

Compiling is lazy and per kernel: importing this module does not import
numba; :func:`load` (called by the packers through :func:`kernels`) makes
every kernel a numba dispatcher (``cache=True``), and each compiles, or loads
from numba's on-disk cache, on its first call only, so a packer waits only
for the kernels its algorithm runs. A compiling kernel resolves the helpers
it calls as globals of its own module, so :func:`load` swaps each kernel for
its dispatcher, at once, in every kernel module that binds its name (its
own, the modules that import it, and this one). Small inputs skip numba
altogether: up to :data:`PLAIN_MAX_ITEMS` (64) sequences, and as long as
:func:`load` has not run in the process, :func:`kernels` hands out
:data:`PLAIN`, the same functions run as plain Python (bound to one namespace
that merges the kernel modules' globals, so :func:`load` never swaps them
mid-run). Importing numba and loading the kernels from its cache take over a
second, a plain pack of 64 sequences a few milliseconds
(``benchmarks/bench_import.py``), so a first small pack (a training step's
micro-batch plan) starts at once; once a big input has loaded numba, every
pack runs compiled. Both give identical rows, order and dtypes. Compile time
shapes the code: explicit loops instead of array expressions or slice
assignments (a single ``out[:] = x`` multiplied the compile time of
:func:`sort_by_units`), and typed values (``np.int64(0)``) instead of bare
constants as helper arguments (a literal argument compiles the helper once
more: BFD's segment helper was compiled four times per BFD).

Numba's on-disk cache checks a kernel only against the file that defines it
(its index is stamped with that file), not the files of the helpers it calls,
so after an edit of a helper in :mod:`._kernels_common` (or a ``git pull`` of
an editable install) the kernels of the other modules would keep running the
old helper from the cache. :func:`load` therefore ties every kernel's cache to
*all* the kernel sources: it hashes the ``_kernels*.py`` files of this package
once (sorted by name, their bytes: about 0.25 ms) and adds that digest to the
stamp numba writes into, and checks against, each kernel's index
(:func:`_tie_to_sources`). Any edit to any kernel module makes every cached
kernel a miss: each recompiles on its next first call and overwrites its
entry; going back to earlier sources is a miss again, never a stale hit. The
stamp travels inside numba's own index, written atomically with the entries,
so a process that loaded the kernels before an edit and compiles one of them
later saves it under its old digest, which no newer process reads. If the
kernel sources changed on disk after this package was imported (the code in
memory is no longer the code on disk), cannot be read, or numba no longer has
the index stamp this relies on, :func:`load` warns and compiles without the
disk cache for this process: slower, never stale.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import types
import warnings
from typing import Any

from . import _kernels_common, _kernels_fit, _kernels_next, _kernels_two
from ._kernels_common import _DEFINED
from ._kernels_common import _KERNELS as _KERNELS
from ._kernels_common import Records as Records

#: the modules that define (and bind) the kernels
_FAMILIES: tuple[types.ModuleType, ...] = (_kernels_common, _kernels_fit, _kernels_next, _kernels_two)
_loaded = False
_lock = threading.Lock()

# every kernel, by name: plain Python until load() swaps in its dispatcher
globals().update(_DEFINED)


def _source_files() -> list[str]:
    """The kernel modules' files (``_kernels*.py`` of this package), sorted by name (plain
    ``os`` calls: ``import sftpack.binpack`` loads no pathlib or hashlib for this)."""
    here = os.path.dirname(os.path.abspath(__file__))
    names = (n for n in os.listdir(here) if n.startswith("_kernels") and n.endswith(".py"))
    return [os.path.join(here, n) for n in sorted(names)]


def _file_stamps() -> tuple[tuple[str, int, int], ...]:
    """Name, mtime and size of every kernel module's file (``OSError`` if one cannot be read)."""
    return tuple(
        (os.path.basename(path), stat.st_mtime_ns, stat.st_size)
        for path in _source_files()
        for stat in (os.stat(path),)
    )


try:  # the kernel files as imported (a few stat calls): load() refuses to cache code that no longer matches them
    _IMPORTED_STAMPS: tuple[tuple[str, int, int], ...] | None = _file_stamps()
except OSError:
    _IMPORTED_STAMPS = None


def _sources_digest() -> str | None:
    """SHA-256 over every kernel module's source (names, lengths and bytes, sorted by
    name), or ``None`` when they cannot be read or changed on disk since import (then
    the code in memory is not the code the digest would describe)."""
    try:
        files = _source_files()
        if not files or _IMPORTED_STAMPS is None or _file_stamps() != _IMPORTED_STAMPS:
            return None

        digest = hashlib.sha256()
        for path in files:
            with open(path, "rb") as f:
                data = f.read()
            digest.update(f"{os.path.basename(path)}\0{len(data)}\0".encode())
            digest.update(data)
    except OSError:
        return None
    return digest.hexdigest()


_NO_STAMP = object()


def _tie_to_sources(dispatcher: Any, digest: str) -> bool:
    """Make ``dispatcher``'s on-disk cache depend on ``digest`` too; ``False`` if this
    numba has no index stamp to extend (then the caller must not use its cache).

    Numba's ``FunctionCache`` keeps the stamp of the defining file in
    ``_cache._cache_file._source_stamp``, writes it into the index with every entry
    and serves an entry only while the stored stamp equals it: replacing it with
    ``(stamp, digest)`` before the first compile makes every entry depend on all
    the kernel sources, with no file of our own and nothing to flush.
    """
    index = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    stamp = getattr(index, "_source_stamp", _NO_STAMP)
    if stamp is _NO_STAMP:
        return False
    index._source_stamp = (stamp, digest)  # type: ignore[union-attr]
    return True


def load() -> None:
    """Import numba and make every kernel a lazily compiling, disk-cached dispatcher.

    Creating a dispatcher compiles nothing; a kernel compiles (or loads from
    numba's on-disk cache) on its first call. All kernels are swapped in at
    once, in this module and in every kernel module that binds them, because a
    compiled kernel resolves the helpers it calls as globals of its module
    when it compiles. Every kernel's cache entry holds for one digest of all the
    kernel sources (:func:`_tie_to_sources`); without one, nothing is cached.
    """
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        import numba  # start-up: numba (~1 s) loads at the first compiled pack

        digest = _sources_digest()
        compiled = {}
        untied = False
        for name, fn in _DEFINED.items():
            dispatcher = None
            if digest is not None:
                dispatcher = numba.njit(cache=True, nogil=True)(fn)
                if not _tie_to_sources(dispatcher, digest):
                    dispatcher = None
            if dispatcher is None:  # uncached: never a cached kernel built on other helpers
                dispatcher = numba.njit(nogil=True)(fn)
                untied = True
            compiled[name] = dispatcher
        if untied:
            why = (
                "the kernel sources cannot be read or changed on disk since import"
                if digest is None
                else "this numba has no cache index stamp to extend"
            )
            warnings.warn(
                f"sftpack.binpack: {why}; the kernels compile without numba's disk cache in this process",
                RuntimeWarning,
                stacklevel=2,
            )
        for namespace in (globals(), *(vars(module) for module in _FAMILIES)):
            for name, dispatcher in compiled.items():
                if namespace.get(name) is _DEFINED[name]:
                    namespace[name] = dispatcher
        _loaded = True


#: Up to this many sequences, and while :func:`load` has not run in this process,
#: the packers run the kernels as plain Python (:data:`PLAIN`): importing numba and
#: loading the kernels from its cache take over a second, a plain pack of this many
#: sequences a few milliseconds with any algorithm and option
#: (``benchmarks/bench_import.py``, "plain Python" rows).
PLAIN_MAX_ITEMS = 64

#: Tests only: ``"plain"`` or ``"compiled"`` forces :func:`kernels`' choice.
FORCE: str | None = None


def kernels(n_items: int) -> types.ModuleType:
    """The kernels to run on ``n_items`` sequences: :data:`PLAIN` while the input is
    small (``<= PLAIN_MAX_ITEMS``) and :func:`load` has not run, else this module's
    compiled ones (loading them). Both give identical results (same bins, same
    order, same dtypes: ``tests/binpack/test_small_plain.py``).

    A run whose packs all stay small never loads numba: it pays a few milliseconds
    a pack instead of numba's first call once (both measured by
    ``benchmarks/bench_import.py``); next to a training step, noise.
    """
    if FORCE == "plain" or (FORCE is None and n_items <= PLAIN_MAX_ITEMS and not _loaded):
        return PLAIN
    load()
    return sys.modules[__name__]


def _global_names(code: types.CodeType) -> set[str]:
    """The names ``code`` (and any code nested in it) may read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _plain_copy() -> types.ModuleType:
    """One namespace holding every kernel as a plain function, each resolving the
    helpers it calls in that namespace: :func:`load` swaps the kernel modules'
    globals, never these, so a plain run never calls a dispatcher (never
    compiles), even while another thread loads. The namespace merges the globals
    of this module and of the kernel modules; a global that two of them bind to
    different objects, where a kernel reads it, is refused here."""
    plain = types.ModuleType(__name__ + ".PLAIN", __doc__)
    namespace = plain.__dict__
    for source in (globals(), *(vars(module) for module in _FAMILIES)):
        for key, value in source.items():
            namespace.setdefault(key, value)
    for name, fn in _DEFINED.items():
        for ref in _global_names(fn.__code__):
            if ref not in _DEFINED and ref in fn.__globals__ and namespace[ref] is not fn.__globals__[ref]:
                raise RuntimeError(f"kernel {name!r} reads global {ref!r}, bound differently in another kernel module")
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__doc__ = fn.__doc__
        copy.__qualname__ = fn.__qualname__
        namespace[name] = copy
    return plain


#: The kernels as plain Python functions, whatever :func:`load` did (built at import,
#: before any :func:`load`).
PLAIN = _plain_copy()
