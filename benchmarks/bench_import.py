"""Import times and the cost of the first ``pack`` call, each in a fresh process.

Two questions a user meets before any packing happens:

- **imports**: ``import sftpack``, ``sftpack.binpack``, ``sftpack.chat`` and
  ``sftpack.handoff``, each timed inside a fresh interpreter (the interpreter's
  own start-up excluded), median of ``--repeats`` runs; the heavy modules each
  one pulled in (torch, numba, transformers, pyarrow) are listed beside it.
- **first call**: the first :func:`sftpack.binpack.pack` call of each
  algorithm in a fresh interpreter, *cold* (``NUMBA_CACHE_DIR`` pointed at an
  empty folder: numba compiles the algorithm's kernels) and *warm* (the same
  folder again: the kernels load from numba's on-disk cache). Each cold run
  gets its own empty folder; median of ``--compile-repeats`` runs. Also the
  sparse route (``bfd`` at capacity ``2**31 - 1``), :func:`pack_histogram`, and
  every algorithm at once. Wall and CPU seconds (the machine may be shared:
  CPU time is the steadier number).
- **small packs**: the same first calls on 8 and 64 sequences run as plain
  Python, which ``pack`` does for up to 64 sequences while numba is not loaded
  (no numba import, no cache load).

Usage::

    python benchmarks/bench_import.py             # about a minute or two
    python benchmarks/bench_import.py --quick     # 3 import runs, 1 compile run

Results are printed and written to ``benchmarks/out/bench_import.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
HEAVY = ("torch", "numba", "transformers", "pyarrow")
MODULES = ("sftpack", "sftpack.binpack", "sftpack.chat", "sftpack.handoff")

IMPORT_PROBE = """
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import {module}
t1, c1 = time.perf_counter(), time.process_time()
print(json.dumps({{"wall": t1 - t0, "cpu": c1 - c0, "loaded": [m for m in {heavy!r} if m in sys.modules]}}))
"""

FIRST_CALL_PROBE = """
import json, time
import numpy as np
import sftpack.binpack as bp
bp._kernels.FORCE = {force!r}  # "compiled": 8 lengths would otherwise run as plain Python
lengths = np.array([700, 300, 1200, 5, 90, 4000, 640, 17], np.int64)
if {n} != 8:
    lengths = np.random.default_rng(0).integers(1, 4000, {n}).astype(np.int64)
calls = {calls}
t0, c0 = time.perf_counter(), time.process_time()
for algorithm, capacity, histogram in calls:
    if histogram:
        bp.pack_histogram(lengths, np.ones_like(lengths), capacity, algorithm)
    else:
        bp.pack(lengths, capacity, algorithm)
t1, c1 = time.perf_counter(), time.process_time()
k = bp._kernels
hits = sum(sum(getattr(k, n).stats.cache_hits.values()) for n in k._KERNELS if hasattr(getattr(k, n), "stats"))
misses = sum(sum(getattr(k, n).stats.cache_misses.values()) for n in k._KERNELS if hasattr(getattr(k, n), "stats"))
print(json.dumps({{"wall": t1 - t0, "cpu": c1 - c0, "hits": hits, "misses": misses}}))
"""

ALGORITHMS = ("bfd", "ffd", "greedy_knapsack", "first_fit_shuffle", "next_fit")
MAX_CAPACITY = 2**31 - 1


def run_probe(code: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(what: str, mode: str, runs: list[dict], note: str = "") -> dict:
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"what": what, "mode": mode, "runs": 0, "note": runs[0]["error"] if runs else "no runs"}
    walls = [r["wall"] for r in good]
    return {
        "what": what,
        "mode": mode,
        "runs": len(good),
        "median_s": statistics.median(walls),
        "min_s": min(walls),
        "max_s": max(walls),
        "cpu_s": statistics.median(r["cpu"] for r in good),
        "note": note,
    }


def bench_imports(repeats: int) -> list[dict]:
    rows = []
    for module in MODULES:
        print(f"  import {module} x{repeats} ...", file=sys.stderr, flush=True)
        runs = [run_probe(IMPORT_PROBE.format(module=module, heavy=HEAVY)) for _ in range(repeats)]
        loaded = runs[-1].get("loaded", [])
        rows.append(
            summarise(
                f"import {module}",
                "fresh process",
                runs,
                "loads " + (", ".join(loaded) or "none of ") + ("" if loaded else ", ".join(HEAVY)),
            )
        )
    return rows


def bench_first_calls(repeats: int) -> list[dict]:
    cases = [(algo, [(algo, 8192, False)]) for algo in ALGORITHMS]
    cases.append(("bfd, capacity 2**31 - 1 (sparse route)", [("bfd", MAX_CAPACITY, False)]))
    cases.append(("pack_histogram bfd", [("bfd", 8192, True)]))
    cases.append(("all five algorithms", [(a, 8192, False) for a in ALGORITHMS]))
    rows = []
    for what, calls in cases:
        cold, warm = [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
                env = dict(os.environ, NUMBA_CACHE_DIR=cache)
                print(f"  first call {what}: cold, then warm ...", file=sys.stderr, flush=True)
                cold.append(run_probe(FIRST_CALL_PROBE.format(calls=calls, force="compiled", n=8), env))
                warm.append(run_probe(FIRST_CALL_PROBE.format(calls=calls, force="compiled", n=8), env))
        note_cold = _cache_note(cold)
        note_warm = _cache_note(warm)
        rows.append(summarise(f"first pack: {what}", "cold cache (compiles)", cold, note_cold))
        rows.append(summarise(f"first pack: {what}", "warm cache (loads)", warm, note_warm))
    # what a small pack really costs: up to 64 sequences, while numba is not loaded, the
    # kernels run as plain Python (sftpack.binpack._kernels.kernels), no numba at all
    for n in (8, 64):
        for what, calls in cases:
            if what.startswith("all"):
                continue
            print(f"  first call {what}, {n} sequences: plain Python ...", file=sys.stderr, flush=True)
            runs = [run_probe(FIRST_CALL_PROBE.format(calls=calls, force="plain", n=n)) for _ in range(repeats)]
            rows.append(summarise(f"first pack: {what}, {n} sequences", "plain Python (no numba)", runs))
    return rows


def _cache_note(runs: list[dict]) -> str:
    good = [r for r in runs if "error" not in r]
    if not good:
        return ""
    return f"{good[0]['misses']} kernels compiled, {good[0]['hits']} loaded from the cache"


COLUMNS = [
    ("what", "what", "{}"),
    ("mode", "mode", "{}"),
    ("runs", "runs", "{}"),
    ("median_s", "median s", "{:.3f}"),
    ("min_s", "min s", "{:.3f}"),
    ("max_s", "max s", "{:.3f}"),
    ("cpu_s", "CPU s", "{:.3f}"),
    ("note", "note", "{}"),
]


def render(rows: list[dict]) -> str:
    cells = [[title for _, title, _ in COLUMNS]]
    for row in rows:
        cells.append(["" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    left = (0, 1, len(COLUMNS) - 1)
    lines = []
    for k, line in enumerate(cells):
        lines.append(
            "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> str:
    versions = [f"python {platform.python_version()}"]
    for mod in ("numpy", "numba", "torch"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            versions.append(f"{mod} -")
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}; "
        f"load average {load_average():.1f} at start; " + ", ".join(versions)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 import runs, 1 compile run")
    parser.add_argument("--repeats", type=int, default=None, help="import runs per module (default 5)")
    parser.add_argument("--compile-repeats", type=int, default=None, help="cold/warm runs per call (default 3)")
    parser.add_argument("--csv", type=Path, default=OUT / "bench_import.csv")
    add_flag(parser)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    compile_repeats = args.compile_repeats or (1 if args.quick else 3)

    where = machine()
    print(f"machine: {where}")
    rows = bench_imports(repeats) + bench_first_calls(compile_repeats)
    print()
    print(render(rows))
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k, _, _ in COLUMNS], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwritten: {args.csv}")
    if not args.no_results:
        title = (
            f"Imports ({repeats} fresh processes each) and the first `pack` call per algorithm, with an empty "
            f"numba cache (cold: compiles) and a warm one (loads), {compile_repeats} runs each."
        )
        write_section(__file__, formatted_table(rows, COLUMNS), where, title=title)
    failed = [r for r in rows if not r.get("runs")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
