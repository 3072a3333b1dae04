"""Small inputs run the kernels as plain Python (no numba), with the compiled kernels' results.

Up to ``_kernels.PLAIN_MAX_ITEMS`` sequences, and while numba has not been
loaded, the packers run :data:`sftpack.binpack._kernels.PLAIN`. Each mode is
forced here through ``_kernels.FORCE`` (never left to what earlier tests loaded)
and the two must agree exactly: the same rows, the same order, the same
dtypes, or the same error. Which modules a fresh process loads is checked in a
subprocess. No timings: the plain run's cost is measured by hand, in
:func:`sftpack.binpack._kernels.kernels`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack.binpack import Algorithm, _kernels, pack, pack_histogram

ALGORITHMS = [a.value for a in Algorithm]
HISTOGRAM = ["bfd", "ffd", "greedy_knapsack"]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BIG_WEIGHT = 2**62  # the largest max_weight_per_bin pack accepts


@contextmanager
def forced(mode: str) -> Iterator[None]:
    before = _kernels.FORCE
    _kernels.FORCE = mode
    try:
        yield
    finally:
        _kernels.FORCE = before


def both(call: Callable[[], Any]) -> tuple[Any, Any]:
    """``call()`` with the plain kernels, then with the compiled ones: a result or the error."""
    out = []
    for mode in ("plain", "compiled"):
        with forced(mode):
            try:
                out.append(call())
            except (ValueError, TypeError) as err:
                out.append((type(err), str(err)))
    return out[0], out[1]


def assert_same_arrays(plain: np.ndarray, compiled: np.ndarray) -> None:
    assert plain.dtype == compiled.dtype
    assert plain.shape == compiled.shape
    assert np.array_equal(plain, compiled)


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    """A small pack: lengths within the capacity (now and then one too long), every option."""
    m = draw(st.sampled_from([1, 1, 2, 3, 8]))
    capacity = draw(st.sampled_from([draw(st.integers(m, 64)), draw(st.integers(64, 70_000)), 2**31 - 1]))
    top = capacity // m * m
    short = draw(st.integers(1, top))  # often many per row, sometimes one
    n = draw(st.integers(0, _kernels.PLAIN_MAX_ITEMS))
    lengths = draw(st.lists(st.integers(1, short), min_size=n, max_size=n))
    if lengths and draw(st.integers(0, 9)) == 0:  # an invalid length: both modes raise the same error
        lengths[draw(st.integers(0, n - 1))] = draw(st.sampled_from([0, top + 1]))
    options: dict[str, Any] = {
        "cost_multiple": m,
        "max_items_per_bin": draw(st.sampled_from([None, 1, 2, 3, 7, 2**64])),
        "min_bins": draw(st.sampled_from([None, 0, 1, 3, n])),
        "bins_multiple_of": draw(st.sampled_from([None, 1, 2, 4])),
        "seed": draw(st.integers(0, 2**32)),
    }
    if draw(st.booleans()):
        cap_weight = draw(st.sampled_from([0, 1, 5, 100, BIG_WEIGHT]))
        weights = draw(st.lists(st.integers(0, cap_weight), min_size=n, max_size=n))
        options["weights"] = np.array(weights, np.int64)
        options["max_weight_per_bin"] = cap_weight
    return {"lengths": np.array(lengths, np.int64), "capacity": capacity, "options": options}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(problem=problems())
def test_pack_gives_the_compiled_rows_as_plain_python(algorithm, problem):
    plain, compiled = both(lambda: pack(problem["lengths"], problem["capacity"], algorithm, **problem["options"]))
    if isinstance(compiled, tuple):  # an error: the same one
        assert plain == compiled
        return
    assert_same_arrays(plain.order, compiled.order)
    assert_same_arrays(plain.offsets, compiled.offsets)


@pytest.mark.parametrize("algorithm", HISTOGRAM)
@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=20),
    counts=st.lists(st.integers(0, 6), min_size=20, max_size=20),
    capacity=st.sampled_from([5000, 8192, 2**31 - 1]),
    m=st.sampled_from([1, 2, 7]),
    max_items=st.sampled_from([None, 1, 3, 2**64]),
)
def test_pack_histogram_gives_the_compiled_rows_as_plain_python(algorithm, lengths, counts, capacity, m, max_items):
    counts = counts[: len(lengths)]  # at most 20 * 6 = 120 sequences: both sides of PLAIN_MAX_ITEMS
    plain, compiled = both(
        lambda: pack_histogram(lengths, counts, capacity, algorithm, cost_multiple=m, max_items_per_bin=max_items)
    )
    if isinstance(compiled, tuple):
        assert plain == compiled
        return
    for field in ("offsets", "lengths", "counts"):
        assert_same_arrays(getattr(plain, field), getattr(compiled, field))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_weights_at_the_largest_cap_give_the_same_rows(algorithm):
    # weights of 2**62 each: sums pass 2**63 (the compiled any_fit_two once overflowed its row bound)
    lengths = np.array([1, 3, 2, 1, 2, 3, 1, 1], np.int64)
    weights = np.array([BIG_WEIGHT, 0, BIG_WEIGHT // 2, BIG_WEIGHT // 2, 1, BIG_WEIGHT, 0, 3], np.int64)
    plain, compiled = both(lambda: pack(lengths, 4, algorithm, weights=weights, max_weight_per_bin=BIG_WEIGHT))
    assert_same_arrays(plain.order, compiled.order)
    assert_same_arrays(plain.offsets, compiled.offsets)
    for row in plain:
        assert int(weights[row].astype(object).sum()) <= BIG_WEIGHT  # exact: Python ints
        assert int(lengths[row].sum()) <= 4


def test_the_plain_kernels_survive_load():
    _kernels.load()
    for name in _kernels._KERNELS:
        fn = getattr(_kernels.PLAIN, name)
        assert isinstance(fn, types.FunctionType)  # not a numba dispatcher
        assert fn.__globals__ is _kernels.PLAIN.__dict__  # its helpers are the plain ones, whatever load() swaps
        assert getattr(_kernels, name) is not fn
    assert _kernels.kernels(1) is _kernels  # once loaded, every size runs compiled
    with forced("plain"):
        assert _kernels.kernels(10**6) is _kernels.PLAIN


PROBE = textwrap.dedent(
    """
    import json, sys, threading, types
    import numpy as np
    from sftpack.binpack import _kernels, pack, pack_histogram

    lengths = np.array([700, 300, 1200, 5, 90, 4000, 640, 17], np.int64)
    small = []
    for a in ("bfd", "ffd", "greedy_knapsack", "first_fit_shuffle", "next_fit"):
        small.append(pack(lengths, 4096, a).to_lists())
        small.append(pack(lengths, 4096, a, weights=lengths % 7, max_weight_per_bin=9).to_lists())
    small.append(pack_histogram(lengths, [2] * 8, 4096).offsets.tolist())
    after_small = "numba" in sys.modules
    raced = []  # small bfd packs in threads while the main thread's big pack loads numba

    def worker():
        for _ in range(40):
            raced.append(pack(lengths, 4096).to_lists())

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    big = pack(np.arange(1, _kernels.PLAIN_MAX_ITEMS + 2), 4096)
    after_big = "numba" in sys.modules
    for t in threads:
        t.join()
    again = pack(lengths, 4096, "next_fit").to_lists()  # small, but numba is loaded now: compiled
    print(json.dumps({
        "after_small": after_small,
        "after_big": after_big,
        "loaded": _kernels._loaded,
        "next_fit_compiled": bool(_kernels.next_fit_offsets.signatures),
        "small": small,
        "again": again,
        "raced": len(raced),
        "raced_same": all(r == small[0] for r in raced),
        "plain_intact": all(
            isinstance(getattr(_kernels.PLAIN, n), types.FunctionType) for n in _kernels._KERNELS
        ),
    }))
    """
)


def test_a_small_pack_leaves_numba_unloaded_and_a_big_one_loads_it():
    # a fresh process: what earlier tests loaded here does not count
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(out.stdout)
    assert got["after_small"] is False
    assert got["after_big"] is True and got["loaded"] is True
    assert got["next_fit_compiled"] is True
    assert got["raced"] == 120 and got["raced_same"] is True  # plain or compiled, whichever each call got
    assert got["plain_intact"] is True
    # next fit: 700 + 300 + 1200 + 5 + 90 = 2295, + 4000 > 4096; 4000 + 640 > 4096; 640 + 17
    assert got["again"] == [[0, 1, 2, 3, 4], [5], [6, 7]]
    # bfd, longest first: 4000 opens row 0 (room 96), 1200, 700, 640, 300 fill row 1 (room 1256);
    # 90 fits row 0 more tightly (room 6), 17 only row 1, 5 row 0 again
    assert got["small"][0] == [[5, 4, 3], [2, 0, 6, 1, 7]]
