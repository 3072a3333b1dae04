"""How long ``sftpack demo`` (what ``make demo`` runs) and ``sftpack demo --quick`` take.

Each run is a fresh process of the console script, timed from the parent (wall
and the child's CPU seconds), after one untimed ``--quick`` run that warms the
byte-code and numba caches, as a second ``make demo`` on a clone finds them.
The runs of the two kinds alternate; the medians over ``--rounds`` are printed
with the machine and its load, and written to this script's section of
``benchmarks/RESULTS.md``. The goal: ``sftpack demo`` under 3 minutes on 2 cores.

Usage::

    python benchmarks/bench_demo.py              # 2 rounds, about 4 minutes on 2 cores
    python benchmarks/bench_demo.py --rounds 1
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section

ROOT = Path(__file__).resolve().parents[1]
SFTPACK = Path(sys.executable).with_name("sftpack")

COLUMNS = [
    ("kind", "command", "{}"),
    ("runs", "runs", "{}"),
    ("wall", "wall s", "{:.1f}"),
    ("min", "min s", "{:.1f}"),
    ("max", "max s", "{:.1f}"),
    ("cpu", "CPU s", "{:.1f}"),
    ("load", "load", "{:.1f}"),
]


def run_once(argv: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = load_average()
    t = time.perf_counter()
    proc = subprocess.run([str(SFTPACK), "demo", *argv], capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"sftpack demo {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "load": load}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    add_flag(parser)
    args = parser.parse_args(argv)
    if not SFTPACK.exists():
        raise SystemExit(f"{SFTPACK} not found: run this with the project's virtual environment's python")
    where = (
        f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}; "
        f"load average {load_average():.1f} at start; python {platform.python_version()}"
    )
    print(f"machine: {where}")
    kinds = {"sftpack demo": [], "sftpack demo --quick": ["--quick"]}
    rows: dict[str, list[dict]] = {k: [] for k in kinds}
    print("warm-up (sftpack demo --quick) ...", flush=True)
    run_once(["--quick"])
    for r in range(args.rounds):
        order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
        for kind in order:
            row = run_once(kinds[kind])
            rows[kind].append(row)
            print(f"round {r + 1} {kind}: {row['wall']:.1f} s wall, {row['cpu']:.1f} s CPU, load {row['load']:.1f}")
    table = []
    for kind, runs in rows.items():
        walls = [x["wall"] for x in runs]
        table.append(
            {
                "kind": f"`{kind}`",
                "runs": len(runs),
                "wall": statistics.median(walls),
                "min": min(walls),
                "max": max(walls),
                "cpu": statistics.median(x["cpu"] for x in runs),
                "load": statistics.median(x["load"] for x in runs),
            }
        )
    text = formatted_table(table, COLUMNS)
    print()
    print(text)
    if not args.no_results:
        title = (
            f"`sftpack demo` (what `make demo` runs: the text story and the multimodal section) and `sftpack demo "
            f"--quick`, each a fresh process after one warm-up run; medians over {args.rounds} alternating rounds. "
            "Goal: `sftpack demo` under 3 minutes on 2 cores. Wall and CPU seconds (the machine may be shared)."
        )
        write_section(__file__, text, where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
