"""How long ``sftpack train --steps 1`` takes to its first step, first run and second run.

Each run is a fresh process (``python -c`` around ``sftpack.cli.main``) on the
embedded corpus with the default options, timed from the parent (wall, and the
child's CPU seconds). Three kinds of run, interleaved in every round:

- **first**: an empty cache folder (``--cache-dir`` a new temporary folder): the
  data is tokenized (in the background while torch loads and the model is built)
  and written to the cache;
- **second**: the same folder again: the samples are read from the cache;
- **no-cache**: ``--no-cache``: tokenized, nothing written;
- **second, transformers**: the second run again with ``--model-impl transformers``
  (transformers' ``LlamaForCausalLM`` instead of the default ``SmallLlama``, the same
  network and weights): what importing transformers' modeling code costs.

With ``--before REF`` two more kinds, **before first** and **before second**,
run the same pair (a fresh cache folder, then the same again) on the ``src/`` of
git revision ``REF`` (extracted with ``git archive``; it must know ``--cache-dir``).

The goal is **first step**: the wall time from launching the process to the end
of its first optimizer step. The phases come from the marks
:func:`sftpack.cli._train.run` records (``MARKS``): start-up (interpreter,
``import sftpack.cli``, and the exit), tokenizer (looking the data up in the
cache; on a miss forking the producer process that tokenizes), imports (torch
and the loop), model (on a miss waiting for the tokenizer's vocabulary size from
the producer; with ``--model-impl transformers`` also importing transformers'
modeling code), waiting for the data, the first step (source, optimizer, one
forward/backward/AdamW step, waiting for its conversations), and after (once trained, waiting for the rest of the data to be tokenized and
cached, when training started before it was all there). The medians
over ``--rounds`` rounds are printed with the machine and its load, and written
to this script's section of ``benchmarks/RESULTS.md``.

Usage::

    python benchmarks/bench_startup.py                     # 3 rounds
    python benchmarks/bench_startup.py --rounds 2 --before HEAD~5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section

ROOT = Path(__file__).resolve().parents[1]

# Runs the command as the ``sftpack`` console script does (``main()`` reading sys.argv),
# so that what the command does at exit is timed too; the marks are printed just before
# the process ends, whether main() returns or ends the process itself (os._exit).
DRIVER = """
import json, os, sys, time
t0 = time.perf_counter()
import sftpack.cli
from sftpack.cli import _train
t1 = time.perf_counter()
me = os.getpid()
def report(rc):
    if os.getpid() != me:  # a forked tokenizer worker ending (it inherits the patched os._exit)
        return
    print("BENCH_MARKS " + json.dumps({"t0": t0, "cli": t1, "end": time.perf_counter(), "rc": rc,
          "marks": getattr(_train, "MARKS", [])}), flush=True)
real_exit = os._exit
def exit_now(rc):
    report(rc)
    real_exit(rc)
os._exit = exit_now
sys.argv = ["sftpack", *sys.argv[1:]]
rc = sftpack.cli.main()
report(rc)
"""

PHASES = ("tokenizer", "imports", "model", "data", "step 1", "cache")

COLUMNS = [
    ("kind", "run", "{}"),
    ("runs", "rounds", "{}"),
    ("first", "first step s", "{:.1f}"),
    ("wall", "wall s", "{:.1f}"),
    ("cpu", "CPU s", "{:.1f}"),
    ("startup", "start-up s", "{:.1f}"),
    ("tokenizer", "tokenizer s", "{:.1f}"),
    ("imports", "imports s", "{:.1f}"),
    ("model", "model s", "{:.1f}"),
    ("data", "data wait s", "{:.1f}"),
    ("step 1", "to step 1 s", "{:.1f}"),
    ("cache", "after s", "{:.1f}"),
    ("ratio", "wall / no-cache", "{:.2f}"),
    ("load", "load", "{:.1f}"),
]


def machine() -> str:
    versions = [f"python {platform.python_version()}"]
    for mod in ("numpy", "torch", "transformers"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            versions.append(f"{mod} -")
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}; "
        f"load average {load_average():.1f} at start; " + ", ".join(versions)
    )


def run_once(argv: list[str], env: dict[str, str]) -> dict:
    """One ``sftpack train`` process: wall, CPU and the phase durations."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = load_average()
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *argv], env=env, capture_output=True, text=True, cwd=ROOT, check=False
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_MARKS ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(
            f"sftpack train failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    info = json.loads(line.split(" ", 1)[1])
    row = {
        "wall": wall,
        "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "load": load,
        # interpreter start and exit, and import sftpack.cli: all the wall time outside main()
        "startup": wall - (info["end"] - info["cli"]),
    }
    prev = info["cli"]
    for name, at in info["marks"]:
        if name in PHASES:  # a mark not listed (start, source) counts in the next listed phase
            row[name] = row.get(name, 0.0) + at - prev
            prev = at
        if name == "step 1":
            # the child's perf_counter is the same monotonic clock as ours (Linux): from launch to step 1
            row["first"] = at - t
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (first, second, no-cache) (default 3)")
    parser.add_argument(
        "--before", metavar="REF", help="also run the first/second pair on the src/ of this git revision"
    )
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "bench_startup.json")
    add_flag(parser)
    args = parser.parse_args(argv)

    where = machine()
    print(f"machine: {where}")
    work = Path(tempfile.mkdtemp(prefix="sftpack-bench-startup-"))
    env = dict(os.environ)
    env.pop("SFTPACK_CACHE_DIR", None)
    cmd = ["train", "--steps", str(args.steps), "--log", str(work / "log.jsonl")]
    kinds: dict[str, list[str]] = {"no-cache": [*cmd, "--no-cache"]}
    envs = {"no-cache": env, "first": env, "second": env, "second, transformers": env}
    if args.before:
        old = work / "before"
        old.mkdir()
        archive = subprocess.run(["git", "archive", args.before, "src"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        envs["before first"] = envs["before second"] = {**env, "PYTHONPATH": str(old / "src")}
    try:
        print("warm-up (numba and Python byte-code caches)...", flush=True)
        run_once(kinds["no-cache"], env)
        if args.before:
            run_once([*cmd, "--cache-dir", str(work / "before-warm")], envs["before first"])
        rows: dict[str, list[dict]] = {k: [] for k in ("first", "second", "second, transformers", "no-cache")}
        if args.before:
            rows.update({"before first": [], "before second": []})
        for r in range(args.rounds):
            cache = work / f"cache-{r}"
            order = ["first", "second", "second, transformers", "no-cache"]
            order += ["before first", "before second"] if args.before else []
            if r % 2:  # alternate which kinds run first in a round (each first run before its second)
                order = order[3:] + order[:3]
            for kind in order:
                folder = work / f"before-cache-{r}" if kind.startswith("before") else cache
                argv_ = kinds.get(kind) or [*cmd, "--cache-dir", str(folder)]
                if kind == "second, transformers":
                    argv_ = [*argv_, "--model-impl", "transformers"]
                row = run_once(argv_, envs[kind])
                rows[kind].append(row)
                print(
                    f"round {r + 1} {kind:>13}: first step {row.get('first', float('nan')):.1f} s, wall {row['wall']:.1f} s, CPU {row['cpu']:.1f} s, load {row['load']:.1f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = []
    base = statistics.median(x["wall"] for x in rows["no-cache"])
    for kind, runs in rows.items():
        if not runs:
            continue
        med = {k: statistics.median(x[k] for x in runs if k in x) for k in runs[0]}
        med.update(kind=kind, runs=len(runs), ratio=med["wall"] / base)
        table.append(med)
    text = formatted_table(table, COLUMNS)
    print()
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": where, "rows": rows}, indent=1))
    print(f"\nwritten: {args.out}")
    if not args.no_results:
        title = (
            f"`sftpack train --steps {args.steps}` on the embedded corpus, default options, each run a fresh "
            f"process; medians over {args.rounds} interleaved rounds (a fresh cache folder per round). first: empty "
            "cache; second: the same cache again (second, transformers: with `--model-impl transformers`); "
            "no-cache: `--no-cache`"
            + (f"; before first / before second: the same pair on the `src/` of `{args.before}`" if args.before else "")
            + ". First step: wall from launching the process to the end of step 1 (the goal). Phases: start-up "
            "(interpreter, `import sftpack.cli`, exit), tokenizer (cache look-up; on a miss forking the producer process that "
            "tokenizes), "
            "imports (torch, the loop), model build (with transformers' modeling imports for `--model-impl "
            "transformers`), waiting for the data, "
            "to step 1 (source, optimizer, the first step, waiting for its conversations), after (the rest of the "
            "data tokenized and cached after training). Wall and CPU seconds (the machine may be shared)."
        )
        write_section(__file__, text, where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
