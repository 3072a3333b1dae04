"""Cheap imports and lazy, cached compiling (issue 8, item 9).

``import sftpack.binpack`` loads neither torch nor numba; each packer
compiles (or loads from numba's on-disk cache) only the kernels its
algorithm runs; a second process finds them in the cache. Checked on results
(which modules are loaded, which kernels have compiled signatures, cache hits
and misses), never on timings: those are in ``benchmarks/bench_import.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PROBE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import sftpack.binpack as bp

    k = bp._kernels
    k.FORCE = "compiled"  # small inputs would run as plain Python (tests/binpack/test_small_plain.py)
    steps = [("import", [m for m in ("numba", "torch") if m in sys.modules])]

    def compiled():
        return sorted(n for n in k._KERNELS if not n.startswith("_") and getattr(getattr(k, n), "signatures", None))

    calls = [
        ("lower_bounds", lambda: bp.lower_bounds([3, 4], 8)),
        ("next_fit", lambda: bp.pack([3, 4], 8, "next_fit")),
        ("first_fit_shuffle", lambda: bp.pack([3, 4], 8, "first_fit_shuffle")),
        ("bfd", lambda: bp.pack([3, 4], 8)),
        ("bfd, capacity 2**31 - 1", lambda: bp.pack([3, 4], 2**31 - 1)),
        ("ffd", lambda: bp.pack([3, 4], 8, "ffd")),
        ("greedy_knapsack", lambda: bp.pack([3, 4], 8, "greedy_knapsack")),
        ("pack_histogram", lambda: bp.pack_histogram([3, 4], [1, 1], 8)),
        ("packing_stats", lambda: bp.packing_stats([3, 4], [[1, 0]], 8)),
    ]
    seen = compiled()
    for name, call in calls[: int(sys.argv[1])]:
        call()
        now = compiled()
        steps.append((name, sorted(set(now) - set(seen))))
        seen = now
    cache = {n: [sum(getattr(k, n).stats.cache_hits.values()), sum(getattr(k, n).stats.cache_misses.values())]
             for n in seen}
    print(json.dumps({"steps": steps, "cache": cache}))
    """
)


def probe(calls: int, cache_dir: str | None = None) -> dict:
    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(calls)], capture_output=True, text=True, timeout=600, env=env, check=True
    )
    return json.loads(out.stdout)


def test_each_call_compiles_only_the_kernels_its_algorithm_runs():
    steps = dict(probe(9)["steps"])
    assert steps == {
        "import": [],  # neither numba nor torch
        "lower_bounds": [],  # numpy only
        "next_fit": ["next_fit_offsets"],
        "first_fit_shuffle": ["first_fit_items"],
        "bfd": ["bfd_records", "bucket_by_units", "records_to_order", "scan_units"],
        "bfd, capacity 2**31 - 1": ["sort_by_units"],  # the sparse route's grouping, nothing else
        "ffd": ["ffd_records"],
        "greedy_knapsack": ["greedy_records"],
        "pack_histogram": ["records_to_runs"],
        "packing_stats": [],
    }


def test_compiled_kernels_are_cached_on_disk_and_reused(tmp_path: Path):
    cache = str(tmp_path / "numba-cache")
    first = probe(2, cache)  # a cold cache: next_fit compiles ...
    assert dict(first["steps"])["next_fit"] == ["next_fit_offsets"]
    assert first["cache"] == {"next_fit_offsets": [0, 1]}
    written = sorted(p.name for p in Path(cache).rglob("*") if p.is_file())
    assert written and all(name.startswith("_kernels_next.next_fit_offsets-") for name in written)
    second = probe(2, cache)  # ... and a new process loads it from the cache
    assert second["cache"] == {"next_fit_offsets": [1, 0]}
