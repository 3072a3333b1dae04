"""The offline path end to end: prepack throughput, row reads, and peak memory.

Three measurements, each against a yardstick from the same run:

1. ``sftpack prepack`` on the embedded corpus (4,017 chitchat conversations,
   3.55 M Qwen tokens), read + tokenize + pack + write + checksum, against a
   plain batched ``tokenizer(texts)`` on the already rendered texts (goal:
   >= 0.75x its tokens/s), with 1 and 2 tokenizer processes.
2. Reading rows back: random rows per second and one full epoch through
   ``PrepackedDataset`` (a ``PackedBatch`` per row, built by the handoff's
   row builder), and random batches of 8 rows read row by row + collated
   against read in one compiled pass (``ds.read_rows``, what ``ds.batch`` and a
   ``DataLoader`` use), each against copying the same bytes out of a raw
   ``np.memmap`` (goal for a batch of 8 rows of 4,096 slots: >= 0.25x), in
   interleaved rounds (median).
3. Peak RSS of prepacking and of reading an epoch at 1x, 10x (and with
   ``--big N``, Nx) the corpus; the larger prepacks replicate the 1x
   prepack's tokenized samples (stages 1-3 without the tokenizer), each in a
   fresh process (goal: flat).
4. What checking costs: opening with ``verify=None`` / ``"size"`` (the
   default: manifest, headers, the index files' SHA-256 and structure) /
   ``"full"`` (also the token and mask data), and a full epoch with and
   without the SHA-256 of every byte it reads (the work a per-chunk checksum
   verified on first read would add).

    python benchmarks/bench_offline.py [--big 100] [--reads 2000] [--repeats 2] [--rounds 7] [--no-rss]
                                       [--verify-only | --reads-only]

Prints a table and writes ``benchmarks/out/bench_offline.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section


def machine() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cpu_model()}, {usable} usable cores / load average {load_average():.2f}; Python {platform.python_version()}"
    )


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------ children (fresh processes for RSS)


def child_prepack_tokenize(out: str) -> dict[str, Any]:
    from sftpack.data import default_tokenizer
    from sftpack.offline import prepack

    tok = default_tokenizer()
    base = _rss_mb()
    r = prepack(None, out, tokenizer=tok, max_seq_len=4096, overwrite=True)
    return {"base_mb": base, "peak_mb": _peak_mb(), "tokens": r.counts["tokens"], "seconds": r.seconds}


def child_prepack_replicate(src: str, out: str, factor: int) -> dict[str, Any]:
    from sftpack import Sample
    from sftpack.offline import PrepackedDataset, prepack_samples

    ds = PrepackedDataset(src)
    base = _rss_mb()

    def samples():
        for rep in range(factor):
            for r in range(ds.num_rows):
                for rec in ds.row_sequences(r):
                    a, n = int(rec["start"]), int(rec["length"])
                    cid = ds.conversation_id(int(rec["conversation"]))
                    yield Sample(
                        ds.tokens[a : a + n], ds.loss_mask[a : a + n], f"{cid}#{rep}", {"piece": int(rec["piece"])}
                    )
            ds.release_pages()

    t0 = time.perf_counter()
    r = prepack_samples(
        samples(),
        out,
        max_seq_len=ds.max_seq_len,
        vocab_size=ds.manifest["vocab_size"],
        pad_id=ds.pad_id,
        overwrite=True,
    )
    return {
        "base_mb": base,
        "peak_mb": _peak_mb(),
        "tokens": r.counts["tokens"],
        "bytes": sum(f["bytes"] for f in r.manifest["files"].values()),
        "seconds": time.perf_counter() - t0,
    }


def child_read_epoch(path: str) -> dict[str, Any]:
    from sftpack.offline import PrepackedDataset

    ds = PrepackedDataset(path)
    base = _rss_mb()
    t0 = time.perf_counter()
    n = 0
    for i in range(len(ds)):
        n += ds[i].num_real_tokens
    return {"base_mb": base, "peak_mb": _peak_mb(), "tokens": n, "seconds": time.perf_counter() - t0}


def _run_child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ in-process measurements


def plain_tokenizer(tok: Any, texts: list[str], batch_size: int = 256) -> int:
    return sum(
        len(ids)
        for i in range(0, len(texts), batch_size)
        for ids in tok(texts[i : i + batch_size], add_special_tokens=False)["input_ids"]
    )


def reads(path: Path, n_random: int, seed: int = 0, *, batch: int = 8, rounds: int = 7) -> dict[str, Any]:
    """Rows read back, each way against copying the same bytes out of a raw ``np.memmap``:
    interleaved rounds (every way once per round, in turn), the median round of each.

    Single rows: ``ds.row`` (a ``PackedBatch`` per row), ``ds.row_arrays`` (the stored slices,
    copied), the raw copy. Batches of ``batch`` random rows: row by row + ``ds.collate``,
    ``ds.read_rows`` (one compiled pass), the raw copy of the batch's rows. A full epoch: rows one
    by one, batched, raw. Both readers' batches are checked equal before timing.
    """
    import torch

    from sftpack import PackedBatch
    from sftpack.offline import PrepackedDataset

    ds = PrepackedDataset(path)
    rows = ds.rows
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, ds.num_rows, n_random)
    groups = [picks[i : i + batch] for i in range(0, n_random - batch + 1, batch)]
    epoch_groups = [np.arange(i, min(i + batch, ds.num_rows)) for i in range(0, ds.num_rows, batch)]
    tok_mm = np.load(path / "tokens.npy", mmap_mode="r")
    mask_mm = np.load(path / "loss_mask.npy", mmap_mode="r")

    def raw(r: int) -> int:
        a, b = int(rows[r]["token"]), int(rows[r + 1]["token"])
        ids = np.array(tok_mm[a:b])
        mask = np.array(mask_mm[a:b])
        return ids.shape[0] + mask.shape[0]

    def arrays(r: int) -> int:
        ids, mask, seqs = ds.row_arrays(r)
        return np.array(ids).shape[0] + np.array(mask).shape[0] + seqs.shape[0]

    def one_by_one(g: np.ndarray) -> int:
        return ds.collate([ds.row(int(r)) for r in g]).num_tokens

    def batched(g: np.ndarray) -> int:
        return ds.read_rows(g).num_tokens

    def raw_batch(g: np.ndarray) -> int:
        return sum(raw(int(r)) for r in g)

    for g in groups[:20] + epoch_groups[:2]:  # warm every way (and the compiled reader), and check them equal
        a, b = ds.read_rows(g), PackedBatch.concat([ds.row(int(r)) for r in g])
        fields = ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded")
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields) and a.sequence_ids == b.sequence_ids
        raw_batch(g)
        arrays(int(g[0]))

    ways: dict[str, Any] = {
        "random_ours": lambda: [ds.row(int(r)) for r in picks],
        "random_arrays": lambda: [arrays(int(r)) for r in picks],
        "random_raw": lambda: [raw(int(r)) for r in picks],
        "batch_rows": lambda: [one_by_one(g) for g in groups],
        "batch_batched": lambda: [batched(g) for g in groups],
        "batch_raw": lambda: [raw_batch(g) for g in groups],
        "epoch_ours": lambda: [ds.row(r) for r in range(ds.num_rows)],
        "epoch_batched": lambda: [batched(g) for g in epoch_groups],
        "epoch_raw": lambda: [raw(r) for r in range(ds.num_rows)],
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    loads = []
    for _ in range(rounds):
        loads.append(load_average())
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    out: dict[str, Any] = {f"{k}_s": v for k, v in med.items()}
    for k in ("random_ours", "random_arrays", "random_raw"):
        out[f"{k}_per_s"] = n_random / med[k]
    for k in ("batch_rows", "batch_batched", "batch_raw"):
        out[f"{k}_per_s"] = len(groups) / med[k]
    out["rows"] = ds.num_rows
    out["batches"] = len(groups)
    out["batch"] = batch
    out["rounds"] = rounds
    out["load"] = f"load {min(loads):.1f}-{max(loads):.1f}"
    return out


def read_results(rd: dict[str, Any], n_random: int) -> list[dict[str, Any]]:
    """The table rows of :func:`reads`: each way against the raw copy of the same bytes."""
    b, load, med = rd["batch"], rd["load"], f"median of {rd['rounds']} interleaved rounds"

    def row(measure: str, value: float, yard: float, unit: str, detail: str) -> dict[str, Any]:
        return {
            "measure": measure,
            "value": value,
            "unit": unit,
            "yardstick": yard,
            "ratio": value / yard,
            "cpu_ratio": float("nan"),
            "detail": f"{detail}; {med}, {load}",
        }

    ep = rd["rows"]
    return [
        row(
            "random row reads",
            rd["random_ours_per_s"],
            rd["random_raw_per_s"],
            "rows/s",
            f"{n_random} random rows of 4096 slots, each a PackedBatch (5 tensors, 160 KB)",
        ),
        row(
            "random row reads, flat arrays",
            rd["random_arrays_per_s"],
            rd["random_raw_per_s"],
            "rows/s",
            "ds.row_arrays (ids, mask, index), copied: the I/O alone",
        ),
        row(
            f"random batches of {b}, row by row",
            rd["batch_rows_per_s"],
            rd["batch_raw_per_s"],
            "batch/s",
            f"{rd['batches']} batches of {b} random rows: ds.row each + ds.collate (PackedBatch.concat)",
        ),
        row(
            f"random batches of {b}, batched",
            rd["batch_batched_per_s"],
            rd["batch_raw_per_s"],
            "batch/s",
            f"the same batches, ds.read_rows (one compiled pass; ds.batch, DataLoader); "
            f"{rd['batch_rows_s'] / rd['batch_batched_s']:.1f}x row by row",
        ),
        row(
            "full epoch read",
            ep / rd["epoch_ours_s"],
            ep / rd["epoch_raw_s"],
            "rows/s",
            f"{ep} rows one by one in {rd['epoch_ours_s']:.3f} s",
        ),
        row(
            f"full epoch read, batches of {b}",
            ep / rd["epoch_batched_s"],
            ep / rd["epoch_raw_s"],
            "rows/s",
            f"{ep} rows in {rd['epoch_batched_s']:.3f} s",
        ),
    ]


def verification(path: Path, repeats: int = 5) -> list[dict[str, Any]]:
    """Open times per verify mode, and an epoch with and without hashing the bytes each row reads."""
    import hashlib

    from sftpack.offline import PrepackedDataset

    opens = {}
    for mode in (None, "size", "full"):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            PrepackedDataset(path, verify=mode)
            best = min(best, time.perf_counter() - t0)
        opens[mode] = best
    sizes = {f.name: f.stat().st_size for f in path.iterdir()}
    index_bytes = sum(v for k, v in sizes.items() if k not in ("tokens.npy", "loss_mask.npy", "manifest.json"))
    ds = PrepackedDataset(path)
    out = [
        {
            "measure": f"open, verify={mode}",
            "value": opens[mode] * 1e3,
            "unit": "ms",
            "yardstick": opens[None] * 1e3,
            "ratio": opens[mode] / opens[None],
            "cpu_ratio": float("nan"),
            "detail": {
                None: "manifest (seal, entries, layout), sizes, .npy headers",
                "size": f"+ SHA-256 and structure of the index ({index_bytes / 1e6:.2f} MB, "
                f"{int(ds.sequences.shape[0]):,} sequences, {ds.num_rows:,} rows)",
                "full": f"+ SHA-256 of tokens and masks ({(sizes['tokens.npy'] + sizes['loss_mask.npy']) / 1e6:.1f} MB)",
            }[mode],
        }
        for mode in (None, "size", "full")
    ]

    def epoch(hashing: bool) -> float:
        t0 = time.perf_counter()
        for r in range(ds.num_rows):
            if hashing:
                ids, mask, _ = ds.row_arrays(r)
                h = hashlib.sha256(ids.tobytes())
                h.update(mask.tobytes())
            ds.row(r)
        return time.perf_counter() - t0

    plain = min(epoch(False) for _ in range(2))
    hashed = min(epoch(True) for _ in range(2))
    out.append(
        {
            "measure": "epoch + SHA-256 of bytes read",
            "value": ds.num_rows / hashed,
            "unit": "rows/s",
            "yardstick": ds.num_rows / plain,
            "ratio": plain / hashed,
            "cpu_ratio": float("nan"),
            "detail": "what a per-chunk checksum verified on first read adds to an epoch (per process)",
        }
    )
    return out


def _table(results: list[dict[str, Any]]) -> None:
    print()
    print(f"{'measure':<34} | {'value':>14} | {'yardstick':>14} | {'ratio':>6} | {'CPU ratio':>9} | detail")
    print("-" * 120)
    for r in results:
        cr = f"{r['cpu_ratio']:>8.2f}x" if r["cpu_ratio"] == r["cpu_ratio"] else f"{'':>9}"
        print(
            f"{r['measure']:<34} | {r['value']:>10,.1f} {r['unit'][:3]:<3} | {r['yardstick']:>10,.1f} "
            f"{r['unit'][:3]:<3} | {r['ratio']:>5.2f}x | {cr} | {r['detail']}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--big", type=int, default=0, help="also measure an N-times replicated corpus (e.g. 100: ~1.8 GB)")
    ap.add_argument("--reads", type=int, default=2000, help="random rows read")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved prepack / tokenizer runs (best kept)")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS measurements")
    ap.add_argument("--verify-only", action="store_true", help="only the cost of checking (one prepack, no yardsticks)")
    ap.add_argument("--reads-only", action="store_true", help="only the row reads (one prepack; no RESULTS.md)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the row reads (median kept)")
    ap.add_argument("--workdir", type=Path, help="where the prepacks go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "bench_offline.csv")
    add_flag(ap)  # --verify-only / --reads-only never rewrite RESULTS.md: their rows are part of the full run's table
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        fn = {"tokenize": child_prepack_tokenize, "replicate": child_prepack_replicate, "read": child_read_epoch}[kind]
        print(json.dumps(fn(*[int(x) if x.isdigit() else x for x in rest])))
        return 0

    from sftpack.chat import renderer_for
    from sftpack.data import default_corpus, default_tokenizer
    from sftpack.offline import prepack

    where = machine()
    print(f"machine: {where}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_offline_"))
    work.mkdir(parents=True, exist_ok=True)
    tok = default_tokenizer()
    convs = list(default_corpus())
    renderer = renderer_for(tok)
    texts = [renderer.render(c.messages) for c in convs]
    plain_tokenizer(tok, texts[:64])
    prepack(None, work / "warm", tokenizer=tok, max_seq_len=4096, limit=64, overwrite=True)  # compile, warm
    if args.verify_only:
        prepack(None, work / "x1_p1", tokenizer=tok, max_seq_len=4096, overwrite=True)
        _table(verification(work / "x1_p1"))
        return 0
    if args.reads_only:
        if not (work / "x1_p1" / "manifest.json").is_file():
            prepack(None, work / "x1_p1", tokenizer=tok, max_seq_len=4096, overwrite=True)
        _table(read_results(reads(work / "x1_p1", args.reads, rounds=args.rounds), args.reads))
        print(f"machine: {machine()}")
        return 0

    results: list[dict[str, Any]] = []
    # interleaved repeats, best of each side: a noisy neighbour hurts both sides alike
    best: dict[str, tuple[float, float]] = {}
    seconds: dict[int, dict[str, float]] = {}
    n_plain = 0
    for _ in range(args.repeats):
        w, c = time.perf_counter(), _cpu()
        n_plain = plain_tokenizer(tok, texts)
        t, cpu = time.perf_counter() - w, _cpu() - c
        best["plain"] = (min(t, best.get("plain", (t, cpu))[0]), min(cpu, best.get("plain", (t, cpu))[1]))
        for procs in (1, 2):
            w, c = time.perf_counter(), _cpu()
            r = prepack(None, work / f"x1_p{procs}", tokenizer=tok, max_seq_len=4096, num_proc=procs, overwrite=True)
            t, cpu = time.perf_counter() - w, _cpu() - c
            assert r.counts["tokens"] == n_plain, (r.counts["tokens"], n_plain)
            key = f"p{procs}"
            if key not in best or t < best[key][0]:
                seconds[procs] = r.seconds
            best[key] = (min(t, best.get(key, (t, cpu))[0]), min(cpu, best.get(key, (t, cpu))[1]))
    t_plain, c_plain = best["plain"]
    for procs in (1, 2):
        t, cpu = best[f"p{procs}"]
        results.append(
            {
                "measure": f"prepack, {procs} process(es)",
                "value": n_plain / t,
                "unit": "tokens/s",
                "yardstick": n_plain / t_plain,
                "ratio": t_plain / t,
                "cpu_ratio": c_plain / cpu,
                "detail": " ".join(f"{k} {v:.2f}s" for k, v in seconds[procs].items()),
            }
        )
    same = all(
        (work / "x1_p1" / f).read_bytes() == (work / "x1_p2" / f).read_bytes() for f in os.listdir(work / "x1_p1")
    )
    print(f"1 and 2 processes wrote byte-identical directories: {same}")

    rd = reads(work / "x1_p1", args.reads, rounds=args.rounds)
    results += read_results(rd, args.reads)
    results += verification(work / "x1_p1")

    rss = [] if args.no_rss else [("prepack (tokenize) 1x", _run_child("tokenize", str(work / "rss_tok")))]
    for k in ([] if args.no_rss else [1, 10]) + ([args.big] if args.big and not args.no_rss else []):
        rss.append(
            (f"prepack (samples) {k}x", _run_child("replicate", str(work / "x1_p1"), str(work / f"x{k}"), str(k)))
        )
        rss.append((f"read epoch {k}x", _run_child("read", str(work / f"x{k}"))))
    for name, r in rss:
        size = f", {r['bytes'] / 1e6:,.0f} MB on disk" if "bytes" in r else ""
        secs = r["seconds"] if isinstance(r["seconds"], float) else r["seconds"]["total"]
        results.append(
            {
                "measure": f"peak RSS, {name}",
                "value": r["peak_mb"],
                "unit": "MB",
                "yardstick": r["base_mb"],
                "ratio": r["peak_mb"] / r["base_mb"],
                "cpu_ratio": float("nan"),
                "detail": f"{r['tokens']:,} tokens in {secs:.1f} s{size}; yardstick = RSS before the work",
            }
        )

    _table(results)
    print(
        "\nprepack yardstick: plain tokenizer(texts) on the rendered texts (goal ratio >= 0.75); reads: copying the "
        "same bytes out of a raw np.memmap (goal for batches of 8 rows >= 0.25); RSS: flat across sizes"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(results[0]) + ["machine"])
        wr.writeheader()
        for r in results:
            wr.writerow({**r, "machine": machine()})
    print(f"wrote {args.out}")
    if not args.no_results:
        table = formatted_table(
            results,
            [
                ("measure", "measure", "{}"),
                ("value", "sftpack", "{:,.1f}"),
                ("yardstick", "yardstick", "{:,.1f}"),
                ("unit", "unit", "{}"),
                ("ratio", "ratio", "{:.2f}x"),
                ("cpu_ratio", "CPU ratio", "{:.2f}x"),
                ("detail", "detail", "{}"),
            ],
        )
        title = (
            "Prepack of the embedded corpus (rows of 4,096) against a plain `tokenizer(texts)` on the rendered "
            "texts (goal ratio >= 0.75), 1 and 2 processes (byte-identical directories: "
            f"{'yes' if same else 'NO'}); row reads, one by one and in batches of 8 rows, against copying the same "
            f"bytes out of a raw `np.memmap` (goal for a batch of 8: >= 0.25x; median of {args.rounds} interleaved "
            f"rounds); the cost of checking; peak RSS (flat across sizes); prepack best of {args.repeats} "
            "interleaved runs."
        )
        write_section(__file__, table, where, title=title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
