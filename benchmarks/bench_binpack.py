"""Bin packing, side by side: sftpack's packers, ``np.sort`` and TRL's BFD, in one run.

Cases (all seeded):

- ``lognormal``: 10M lengths, ``round(lognormal(mu=ln 600, sigma=1))`` clipped to
  ``[1, 8192]`` (median 600, mean ~970), capacity 8192.
- ``wikipedia``: Graphcore's Wikipedia length histogram (16,279,552 sequences),
  capacity 512, expanded to one length per sequence and shuffled.
- ``squad``: Graphcore's SQuAD 1.1 histogram (88,641 sequences), capacity 384.

For each: wall time (best of ``--repeats``), lengths per second, rows,
efficiency (real tokens / row tokens), the gaps to the L1 and L2 lower bounds,
and the peak memory the call added (``VmHWM`` minus ``VmRSS`` before it, each
measurement in a forked child so the runs do not share a heap). Everything
runs on one core: sftpack, ``np.sort`` and TRL are single-threaded (pyarrow
is set to one thread).

TRL (``trl.data_utils._pack_bfd``, the BFD behind ``pack_dataset``) runs on a
lengths-only table (list columns of null values). Its token-data steps
(``list_slice``, ``filter``, ``take``) are no-ops for such a table but still cost
``O(tokens)`` in pyarrow, so they are stubbed out: what is timed is TRL's sort
plus its binning loop. It is about 0.05M lengths/s, so by default it runs on a
1M-length subsample (``--trl-items``; 0 = all), beside sftpack's BFD on the same
subsample, and its row says so.

- ``capacity``: the cost must not grow with the capacity. Two lengths in rows
  of ``10**8``, ``10**9`` and ``2**31 - 1`` tokens (the old dense kernels took
  19 s and 4 GB at ``10**8`` and failed at ``10**9``), and the 10M lognormal
  lengths multiplied by ``K = 262,143`` in rows of ``8192 * K`` tokens (just
  under ``2**31``): the sparse route, with exactly the rows of the small case.

Usage::

    python benchmarks/bench_binpack.py            # the full run (a few minutes)
    python benchmarks/bench_binpack.py --quick    # 1M lognormal, small TRL subsample
    python benchmarks/bench_binpack.py --cases lognormal squad

The data histograms are read from ``benchmarks/data/`` in the repository
(``--data`` to point elsewhere). Results are printed and written to
``benchmarks/out/bench_binpack.csv``.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section
from sftpack import binpack
from sftpack.binpack import lower_bounds, pack, pack_histogram

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "benchmarks" / "data"
OUT = ROOT / "benchmarks" / "out"


# ----------------------------------------------------------------------------
# measuring


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _child(fn: Callable[[], Any], summarize: Callable[[Any], dict], repeats: int, conn: Any) -> None:
    try:
        peak_ok = _reset_peak()
        base = _status_kib("VmRSS")
        t0 = time.perf_counter()
        result = fn()
        times = [time.perf_counter() - t0]
        hwm = _status_kib("VmHWM")
        summary = summarize(result)
        del result
        for _ in range(repeats - 1):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        peak = (hwm - base) / 1024 if peak_ok and base is not None and hwm is not None else float("nan")
        conn.send({"time": min(times), "peak_mib": peak, **summary})
    except BaseException as err:  # report, do not hang the parent
        conn.send({"error": f"{type(err).__name__}: {err}"})
    finally:
        conn.close()


def measure(fn: Callable[[], Any], summarize: Callable[[Any], dict], repeats: int) -> dict:
    """Run ``fn`` in a forked child ``repeats`` times: best time, peak memory, summary."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, summarize, repeats, child))
    proc.start()
    child.close()
    out = parent.recv()
    proc.join()
    return out


# ----------------------------------------------------------------------------
# cases


@dataclass
class Case:
    name: str
    lengths: np.ndarray  # (n,) int64, the order the packers see
    capacity: int
    values: np.ndarray  # histogram form of the same lengths
    counts: np.ndarray
    source: str
    trl_sub: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def lognormal_case(n: int) -> Case:
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(600), 1.0, n)), 1, 8192).astype(np.int64)
    counts = np.bincount(lengths)
    values = np.flatnonzero(counts)
    return Case(
        f"lognormal {n / 1e6:g}M",
        lengths,
        8192,
        values,
        counts[values],
        "lognormal(ln 600, 1) clipped to [1, 8192], seed 0",
    )


def histogram_case(name: str, path: Path, capacity: int) -> Case:
    table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    values, counts = table[:, 0], table[:, 1]
    lengths = np.repeat(values, counts)
    lengths = lengths[np.random.default_rng(1).permutation(lengths.shape[0])]
    return Case(name, lengths, capacity, values, counts, f"{path.name}, expanded and shuffled (seed 1)")


# ----------------------------------------------------------------------------
# packers


def _trl_packer() -> Callable[[np.ndarray, int], int] | None:
    """TRL's BFD on a lengths-only table; returns the row count. None without trl."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import trl.data_utils as du
    except ImportError:
        return None
    if not hasattr(du, "_pack_bfd"):
        return None

    class _DataOpsStubbed:
        """pyarrow.compute, with the token-data steps made no-ops (see the module docstring)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(pc, name)

        @staticmethod
        def list_slice(column: Any, start: int, stop: int) -> Any:
            return column  # nothing exceeds the capacity: no truncation

        @staticmethod
        def filter(column: Any, mask: Any) -> Any:
            return column  # every length is >= 1: nothing to drop

        @staticmethod
        def take(table: Any, indices: Any) -> Any:
            return table  # reordering the token data is not binning

    def run(lengths: np.ndarray, capacity: int) -> int:
        pa.set_cpu_count(1)
        du.pc = _DataOpsStubbed()
        offsets = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.nulls(int(offsets[-1])))
        table = pa.table({"input_ids": column})
        t0 = time.perf_counter()
        rows = du._pack_bfd(table, capacity).num_rows
        run.elapsed = time.perf_counter() - t0  # type: ignore[attr-defined]
        return rows

    return run


def stats_row(case: Case, method: str, res: dict, n: int, tokens: int, bounds: Any, note: str = "") -> dict:
    row = {"case": case.name, "method": method, "items": n, "capacity": case.capacity, "note": note}
    if "error" in res:
        row["note"] = res["error"]
        return row
    rows = res.get("rows")
    t = res["time"]
    row.update(
        time_s=t,
        mlen_per_s=n / t / 1e6 if t > 0 else float("inf"),
        rows=rows,
        efficiency=tokens / (rows * case.capacity) if rows else None,
        gap_l1=rows / bounds.l1 - 1 if rows else None,
        gap_l2=rows / bounds.l2 - 1 if rows else None,
        peak_mib=res["peak_mib"],
    )
    return row


def run_case(case: Case, args: argparse.Namespace, trl: Callable[[np.ndarray, int], int] | None) -> list[dict]:
    lengths, cap = case.lengths, case.capacity
    n, tokens = int(lengths.shape[0]), int(lengths.sum())
    bounds = lower_bounds(case.values, cap, counts=case.counts)
    out: list[dict] = []

    def progress(msg: str) -> None:
        print(f"  [{case.name}] {msg}", file=sys.stderr, flush=True)

    def checked(bins: Any) -> dict:
        bins.check(lengths, cap)
        return {"rows": len(bins)}

    def add(method: str, fn: Callable[[], Any], summarize: Callable[[Any], dict], repeats: int, **kw: Any) -> dict:
        progress(f"{method} ...")
        res = measure(fn, summarize, repeats)
        row = stats_row(
            case, method, res, kw.get("n", n), kw.get("tokens", tokens), kw.get("bounds", bounds), kw.get("note", "")
        )
        if "time_s" in row:
            progress(f"{method}: {row['time_s']:.3f} s, {row['rows']} rows")
        else:
            progress(f"{method}: {row['note']}")
        out.append(row)
        return row

    r = args.repeats
    sort_row = add("np.sort (yardstick)", lambda: np.sort(lengths), lambda _: {"rows": None}, r)
    bfd_row = add("sftpack bfd", lambda: pack(lengths, cap), checked, r)
    if "time_s" in sort_row and "time_s" in bfd_row:
        bfd_row["note"] = f"{bfd_row['time_s'] / sort_row['time_s']:.2f}x np.sort"
    add(
        "sftpack bfd, histogram",
        lambda: pack_histogram(case.values, case.counts, cap),
        lambda hb: {"rows": len(hb)},
        r,
        note=f"pack_histogram on {case.values.shape[0]} distinct lengths",
    )
    for algo in ("ffd", "greedy_knapsack", "first_fit_shuffle", "next_fit"):
        add(f"sftpack {algo}", lambda a=algo: pack(lengths, cap, a), checked, 1 if algo == "first_fit_shuffle" else r)

    sub_n = n if args.trl_items <= 0 else min(n, args.trl_items)
    sub = lengths[:sub_n]  # the input is shuffled already: a prefix is a fair sample
    sub_tokens = int(sub.sum())
    sub_bounds = lower_bounds(sub, cap)
    label = "" if sub_n == n else f" (first {sub_n:,} lengths)"
    sub_bfd = (
        bfd_row
        if sub_n == n
        else add(
            f"sftpack bfd{label}",
            lambda: pack(sub, cap),
            lambda b: {"rows": len(b)},
            r,
            n=sub_n,
            tokens=sub_tokens,
            bounds=sub_bounds,
        )
    )
    if trl is None:
        note = "trl not installed: pip install -c constraints.txt trl"
        out.append({"case": case.name, "method": "trl bfd", "note": note})
        return out

    def trl_summary(rows: int) -> dict:  # time the packing, not the building of its input table
        return {"rows": rows, "time": trl.elapsed}  # type: ignore[union-attr]

    trl_row = add(
        f"trl bfd{label}", lambda: trl(sub, cap), trl_summary, 1, n=sub_n, tokens=sub_tokens, bounds=sub_bounds
    )
    if "time_s" in trl_row and "time_s" in sub_bfd:
        speedup = trl_row["time_s"] / sub_bfd["time_s"]
        diff = sub_bfd["rows"] - trl_row["rows"]
        same = "same rows" if diff == 0 else f"sftpack {diff:+d} rows"
        trl_row["note"] = f"sftpack bfd is {speedup:.0f}x faster, {same}"
        if sub_n != n:
            trl_row["note"] += f"; all {n:,} would take ~{trl_row['time_s'] * n / sub_n:.0f} s"
    return out


def run_capacity(args: argparse.Namespace) -> list[dict]:
    """Rows whose capacity is 10**8 .. 2**31 - 1 tokens: the cost follows the items."""
    out: list[dict] = []
    two = np.array([5, 6], np.int64)
    two_case = Case("capacity: 2 lengths", two, 0, two, np.ones(2, np.int64), "[5, 6]")
    for cap in (10**8, 10**9, binpack.MAX_CAPACITY):
        two_case.capacity = cap
        for algo in ("bfd", "next_fit"):
            # best of 5 at least: one run of a microsecond call measures page faults, not packing
            res = measure(lambda c=cap, a=algo: pack(two, c, a), lambda b: {"rows": len(b)}, max(args.repeats, 5))
            row = stats_row(two_case, f"sftpack {algo}, capacity {cap:,}", res, 2, 11, lower_bounds(two, cap))
            row["capacity"] = cap
            if "time_s" in row:
                row["note"] = f"{row['time_s'] * 1e6:.0f} us"
            out.append(row)
    base = lognormal_case(args.items)
    k = binpack.MAX_CAPACITY // base.capacity
    scaled = Case(
        f"capacity: lognormal {args.items / 1e6:g}M x {k:,}",
        base.lengths * k,
        base.capacity * k,
        base.values * k,
        base.counts,
        f"the lognormal case, lengths and capacity times {k:,}",
    )
    bounds = lower_bounds(scaled.values, scaled.capacity, counts=scaled.counts)
    n, tokens = int(scaled.lengths.shape[0]), int(scaled.lengths.sum())
    small = measure(lambda: pack(base.lengths, base.capacity), lambda b: {"rows": len(b)}, 1)
    for algo in ("bfd", "next_fit"):
        res = measure(lambda a=algo: pack(scaled.lengths, scaled.capacity, a), lambda b: {"rows": len(b)}, args.repeats)
        row = stats_row(scaled, f"sftpack {algo}, capacity {scaled.capacity:,}", res, n, tokens, bounds)
        if algo == "bfd" and "rows" in res:
            row["note"] = "same row count as capacity 8192" if res["rows"] == small.get("rows") else "ROWS DIFFER"
        out.append(row)
    return out


# ----------------------------------------------------------------------------
# output


def machine() -> str:
    model = cpu_model()
    load = load_average()
    versions = [f"python {platform.python_version()}", f"numpy {np.__version__}"]
    for mod in ("numba", "trl", "pyarrow"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            versions.append(f"{mod} -")
    return (
        f"{model}, {os.cpu_count()} cores (one used), {platform.system()} {platform.machine()}; "
        f"load average {load:.1f} at start; " + ", ".join(versions)
    )


COLUMNS = [
    ("case", "case", "{}"),
    ("method", "method", "{}"),
    ("items", "lengths", "{:,}"),
    ("time_s", "time s", "{:.3f}"),
    ("mlen_per_s", "M len/s", "{:.2f}"),
    ("rows", "rows", "{:,}"),
    ("efficiency", "efficiency", "{:.4%}"),
    ("gap_l1", "gap L1", "{:.4%}"),
    ("gap_l2", "gap L2", "{:.4%}"),
    ("peak_mib", "peak MiB", "{:.0f}"),
    ("note", "note", "{}"),
]


def render(rows: list[dict]) -> str:
    cells = [[title for _, title, _ in COLUMNS]]
    for row in rows:
        line = []
        for key, _, fmt in COLUMNS:
            v = row.get(key)
            line.append("" if v is None or (isinstance(v, float) and np.isnan(v)) else fmt.format(v))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    left = (0, 1, len(COLUMNS) - 1)  # text columns; numbers align right
    text = []
    for k, line in enumerate(cells):
        padded = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        text.append("  ".join(padded).rstrip())
        if k == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M lognormal lengths, TRL on 100k, one repeat")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["lognormal", "wikipedia", "squad", "capacity"],
        choices=["lognormal", "wikipedia", "squad", "capacity"],
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"histogram folder (default {DEFAULT_DATA})")
    parser.add_argument("--items", type=int, default=None, help="lognormal lengths (default 10M, 1M with --quick)")
    parser.add_argument(
        "--trl-items",
        type=int,
        default=None,
        help="lengths given to TRL per case (default 1M, 100k with --quick; 0 = all)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="best of this many runs (default 3, 1 with --quick)")
    parser.add_argument("--csv", type=Path, default=OUT / "bench_binpack.csv")
    add_flag(parser)
    args = parser.parse_args(argv)
    args.items = args.items or (1_000_000 if args.quick else 10_000_000)
    args.trl_items = args.trl_items if args.trl_items is not None else (100_000 if args.quick else 1_000_000)
    args.repeats = args.repeats or (1 if args.quick else 3)

    files = {"wikipedia": ("wikipedia_512.csv", 512), "squad": ("squad11_384.csv", 384)}
    missing = [files[c][0] for c in args.cases if c in files and not (args.data / files[c][0]).is_file()]
    if missing:
        print(
            f"error: {', '.join(missing)} not found in {args.data}: restore benchmarks/data/ from the "
            f"repository, pass --data DIR, or run only --cases lognormal capacity",
            file=sys.stderr,
        )
        return 2

    where = machine()
    print(f"machine: {where}")
    t0 = time.perf_counter()
    for algo in binpack.Algorithm:  # compile (or load the cache) before timing
        pack(np.array([3, 5, 1, 3]), 8, algo)
    pack(np.array([3, 5, 1, 3]), binpack.MAX_CAPACITY)  # the sparse route's kernel
    pack_histogram([3, 5], [1, 2], 8)
    print(f"first calls (numba compile or cache load, all kernels): {time.perf_counter() - t0:.1f} s")
    trl = _trl_packer()

    results: list[dict] = []
    for name in args.cases:
        print(f"preparing {name} ...", file=sys.stderr, flush=True)
        if name == "capacity":
            results.extend(run_capacity(args))
            continue
        if name == "lognormal":
            case = lognormal_case(args.items)
        else:
            fname, cap = files[name]
            case = histogram_case(name, args.data / fname, cap)
        b = lower_bounds(case.values, case.capacity, counts=case.counts)
        print(
            f"{case.name}: {case.lengths.shape[0]:,} sequences, {int(case.lengths.sum()):,} tokens, "
            f"capacity {case.capacity}, L1 {b.l1:,}, L2 {b.l2:,} ({case.source})"
        )
        results.extend(run_case(case, args, trl))

    print()
    print(render(results))
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    keys = [k for k, _, _ in COLUMNS] + ["capacity"]
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    print(f"\nwritten: {args.csv}")
    if not args.no_results:
        title = (
            f"Bin packing against `np.sort` and TRL's BFD on the same lengths (cases: {', '.join(args.cases)}; "
            f"{args.items:,} lognormal lengths, TRL on {args.trl_items or 'all'} per case, best of {args.repeats})."
        )
        write_section(__file__, formatted_table(results, COLUMNS), where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
