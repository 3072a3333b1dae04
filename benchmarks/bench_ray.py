"""Benchmark: the Ray prepack engine against the local one, and the driver's packing limit.

1. **Driver: pack-and-assign at scale.** The driver of the Ray engine holds the
   lengths and the plan, never a token. For N synthetic conversations (lengths
   drawn, seeded, from a log-normal fitted to the embedded corpus under Qwen:
   log-mean 5.86, log-sd 1.47, clipped to 1..4096), a fresh process allocates what
   the driver holds after the tokenize stage (lengths, conversation numbers,
   pieces, id offsets) and runs :func:`sftpack.offline.engine.plan_rows` (BFD,
   ``max_seq_len=4096``) and the write ranges: wall time and peak RSS
   (``ru_maxrss``), and from them the bytes per sample and the largest N that
   fits this machine's memory.
2. **Engines on the embedded corpus replicated 5x** (five JSONL copies, 20,085
   conversations, about 17.7 M Qwen tokens, ``max_seq_len=4096``, over-long split):
   local ``num_proc`` 1 and 2, Ray with 1 and 2 workers, each in a fresh process:
   time per stage, peak total RSS and PSS of the whole process tree (driver,
   Ray's daemons and workers; sampled every 0.5 s), per-actor tokens/s, and
   whether the files equal the local engine's byte for byte.

    python benchmarks/bench_ray.py [--sizes 1e6,1e7] [--copies 5] [--skip-engines | --skip-driver]

Prints a table and writes ``benchmarks/out/bench_ray.csv`` (a skipped section keeps
its rows from the previous run).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from _machine import cpu_model, load_average
from _results import add_flag, markdown_table, write_section

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
WIDTH = 4096


# ---------------------------------------------------------------------------- 1. driver at scale


def _driver_one(n: int) -> dict[str, Any]:
    """Run in a fresh process: what the driver allocates and computes for n samples."""
    from sftpack.offline._ray import split_rows
    from sftpack.offline.engine import plan_rows

    plan_rows(np.array([5, 10, 3, 8]), max_seq_len=16)  # compile the packer outside the timing
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    lengths = np.clip(np.rint(rng.lognormal(5.86, 1.47, n)), 1, WIDTH).astype(np.int64)
    # the rest of the merged stage-1 result: one conversation per sample here, ids of ~24 bytes
    conversation = np.arange(n, dtype=np.int64)
    piece = np.zeros(n, np.int32)
    id_offsets = np.arange(n + 1, dtype=np.int64) * 24
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = plan_rows(lengths, max_seq_len=WIDTH)
    t_pack = time.perf_counter() - t0
    t0 = time.perf_counter()
    ranges = split_rows(plan, 64)
    t_split = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del conversation, piece, id_offsets
    return {
        "n": n,
        "tokens": int(lengths.sum()),
        "rows": plan.num_rows,
        "fill": float(lengths.sum() / (plan.num_rows * WIDTH)),
        "gen_s": t_gen,
        "pack_s": t_pack,
        "split_s": t_split,
        "ranges": len(ranges),
        "base_rss": base,
        "peak_rss": peak,
        "bytes_per_sample": (peak - base) / n,
    }


# ---------------------------------------------------------------------------- 2. engines


class _TreeMemory:
    """Peak of the summed RSS and PSS of this process and all its descendants."""

    def __init__(self, interval: float = 0.5):
        import psutil

        self.psutil = psutil
        self.interval = interval
        self.peak_rss = self.peak_pss = 0
        self.peak_procs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        me = self.psutil.Process()
        procs = [me, *me.children(recursive=True)]
        rss = pss = 0
        for p in procs:
            try:
                info = p.memory_full_info()
            except (self.psutil.Error, OSError):
                continue
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_procs = max(self.peak_procs, len(procs))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> _TreeMemory:  # noqa: PYI034 - Python 3.10 has no typing.Self
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _write_corpus(folder: Path, copies: int) -> list[str]:
    from sftpack.data import default_corpus

    lines = [json.dumps({"id": c.id, "messages": c.messages}) for c in default_corpus()]
    paths = []
    for k in range(copies):
        p = folder / f"chitchat-{k}.jsonl"
        p.write_text("\n".join(lines) + "\n")
        paths.append(str(p))
    return paths


def _engine_one(spec: str, inputs: list[str], out: str) -> dict[str, Any]:
    """Run in a fresh process: one prepack, with the memory of the whole process tree."""
    engine, n = spec.split(":")
    n = int(n)
    t0 = time.perf_counter()
    with _TreeMemory() as mem:
        if engine == "local":
            from sftpack.data import default_tokenizer
            from sftpack.offline import prepack

            tok = default_tokenizer()
            t_tok = time.perf_counter() - t0
            r = prepack(inputs, out, tokenizer=tok, max_seq_len=WIDTH, num_proc=n)
            actors: list[dict[str, Any]] = []
            seconds = dict(r.seconds, tokenizer_load=t_tok)
        else:
            from sftpack.offline import prepack_ray

            r = prepack_ray(inputs, out, max_seq_len=WIDTH, workers=n)
            actors = r.actors
            seconds = dict(r.seconds)
    wall = time.perf_counter() - t0
    return {
        "engine": engine,
        "n": n,
        "wall_s": wall,
        "seconds": seconds,
        "peak_tree_rss": mem.peak_rss,
        "peak_tree_pss": mem.peak_pss,
        "processes": mem.peak_procs,
        "actors": actors,
        "counts": {k: r.counts[k] for k in ("read", "kept", "sequences", "tokens", "rows")},
        "files": {k: v["sha256"] for k, v in r.manifest["files"].items()},
    }


def _child(args: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, timeout=1800, cwd=HERE, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mb(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7", help="driver section: sample counts (comma separated)")
    ap.add_argument("--copies", type=int, default=5, help="engine section: copies of the embedded corpus")
    ap.add_argument("--engines", default="local:1,local:2,ray:1,ray:2", help="engine:workers, comma separated")
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--skip-driver", action="store_true")
    ap.add_argument("--_driver", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_engine", help=argparse.SUPPRESS)
    ap.add_argument("--_inputs", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    add_flag(ap)
    a = ap.parse_args()
    if a._driver:
        print(json.dumps(_driver_one(a._driver)))
        return
    if a._engine:
        print(json.dumps(_engine_one(a._engine, a._inputs.split(","), a._out)))
        return

    import psutil

    total_ram = psutil.virtual_memory().total
    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, {total_ram / 2**30:.0f} GiB RAM, "
        f"Python {platform.python_version()}, load {load_average():.1f} at start"
    )
    print(f"machine: {machine}")
    csv_rows: list[dict[str, Any]] = []

    if not a.skip_driver:
        print("\n1. driver: pack-and-assign (BFD, max_seq_len 4096), fresh process per size")
        print(
            f"{'samples':>12} {'tokens':>15} {'rows':>11} {'fill':>7} {'pack s':>8} {'ranges s':>9} "
            f"{'peak RSS MB':>12} {'B/sample':>9}"
        )
        results = []
        for text in a.sizes.split(","):
            n = int(float(text))
            r = _child(["--_driver", str(n)])
            results.append(r)
            print(
                f"{n:>12,} {r['tokens']:>15,} {r['rows']:>11,} {r['fill']:>7.2%} {r['pack_s']:>8.2f} "
                f"{r['split_s']:>9.3f} {_mb(r['peak_rss']):>12} {r['bytes_per_sample']:>9.1f}"
            )
            csv_rows.append(
                {
                    "section": "driver",
                    "config": f"{n}",
                    "samples": n,
                    "tokens": r["tokens"],
                    "rows": r["rows"],
                    "pack_s": round(r["pack_s"], 3),
                    "peak_rss_mb": round(r["peak_rss"] / 2**20),
                    "bytes_per_sample": round(r["bytes_per_sample"], 1),
                }
            )
        big = results[-1]
        per = big["bytes_per_sample"]
        fits = int(0.8 * total_ram / per)
        t8 = big["pack_s"] * (1e8 / big["n"]) * math.log(1e8) / math.log(big["n"])
        print(
            f"   -> {per:.0f} bytes a sample: one driver with {total_ram / 2**30:.0f} GiB packs about {fits:,.0f} "
            f"samples (80% of RAM); 1e8 samples need {1e8 * per / 2**30:.1f} GiB and about {t8:.0f} s "
            "to pack (n log n from the largest size)"
        )

    if not a.skip_engines:
        with tempfile.TemporaryDirectory(prefix="sfr-bench-", dir="/tmp") as tmp:
            inputs = _write_corpus(Path(tmp), a.copies)
            print(f"\n2. engines on the embedded corpus x{a.copies} ({a.copies} JSONL files), max_seq_len 4096, split")
            runs = []
            for spec in a.engines.split(","):
                out = os.path.join(tmp, "out-" + spec.replace(":", "-"))
                runs.append(_child(["--_engine", spec, "--_inputs", ",".join(inputs), "--_out", out]))
            ref = runs[0]["files"]
            stages = ("tokenizer_load", "ray_start", "read_tokenize", "pack", "write", "checksum", "finalize")
            print(
                f"{'engine':<10} {'wall s':>7} "
                + " ".join(f"{s[:13]:>13}" for s in stages)
                + f" {'tree RSS MB':>12} {'tree PSS MB':>12} {'procs':>6} {'tok/s/actor':>12} {'actor load s':>12} {'same bytes':>10}"
            )
            for r in runs:
                sec = r["seconds"]
                tps = ",".join(f"{x['tokens_per_s'] / 1e3:.0f}k" for x in r["actors"]) or "-"
                load = ",".join(f"{x.get('load_seconds', float('nan')):.1f}" for x in r["actors"]) or "-"
                same = "yes" if r["files"] == ref else "NO"
                print(
                    f"{r['engine'] + ':' + str(r['n']):<10} {r['wall_s']:>7.1f} "
                    + " ".join(f"{sec.get(s, float('nan')):>13.2f}" for s in stages)
                    + f" {_mb(r['peak_tree_rss']):>12} {_mb(r['peak_tree_pss']):>12} {r['processes']:>6} {tps:>12} {load:>12} {same:>10}"
                )
                csv_rows.append(
                    {
                        "section": "engine",
                        "config": f"{r['engine']}:{r['n']}",
                        "samples": r["counts"]["sequences"],
                        "tokens": r["counts"]["tokens"],
                        "rows": r["counts"]["rows"],
                        "wall_s": round(r["wall_s"], 2),
                        **{f"{s}_s": round(sec[s], 3) for s in stages if s in sec},
                        "tree_rss_mb": round(r["peak_tree_rss"] / 2**20),
                        "tree_pss_mb": round(r["peak_tree_pss"] / 2**20),
                        "actor_tokens_per_s": ";".join(f"{x['tokens_per_s']:.0f}" for x in r["actors"]),
                        "actor_load_s": ";".join(f"{x.get('load_seconds', float('nan')):.2f}" for x in r["actors"]),
                        "identical_to_first": r["files"] == ref,
                    }
                )
            c = runs[0]["counts"]
            print(
                f"   {c['read']:,} conversations, {c['sequences']:,} sequences, {c['tokens']:,} tokens, {c['rows']:,} rows"
            )

    OUT.mkdir(parents=True, exist_ok=True)
    ran = {row["section"] for row in csv_rows}
    if (OUT / "bench_ray.csv").exists():  # keep the rows of a section skipped this time
        with open(OUT / "bench_ray.csv", newline="") as f:
            kept = [row for row in csv.DictReader(f) if row["section"] not in ran]
        csv_rows = kept + csv_rows
    fields: list[str] = []
    for row in csv_rows:
        fields += [k for k in row if k not in fields]
    with open(OUT / "bench_ray.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(csv_rows)
    print(f"wrote {OUT / 'bench_ray.csv'}")
    if not a.no_results:
        parts = []
        for section, title in (
            ("driver", "Driver: pack and assign (BFD, max_seq_len 4096), a fresh process per size"),
            (
                "engine",
                f"Engines on the embedded corpus x{a.copies} (JSONL files), max_seq_len 4096, "
                "over-long split, each run a fresh process",
            ),
        ):
            rows = [
                {k: v for k, v in row.items() if k != "section" and v not in (None, "")}
                for row in csv_rows
                if row["section"] == section
            ]
            if rows:
                cols = [k for k in rows[0]] + [k for r in rows for k in r if k not in rows[0]]
                parts.append(f"{title}:\n\n" + markdown_table(rows, columns=list(dict.fromkeys(cols))))
        skipped = (
            " (a section skipped in this run keeps the rows of the CSV's last run)"
            if a.skip_driver or a.skip_engines
            else ""
        )
        write_section(
            __file__, "\n\n".join(parts), machine, title="Local against Ray engine, and the driver's packing." + skipped
        )


if __name__ == "__main__":
    main()
