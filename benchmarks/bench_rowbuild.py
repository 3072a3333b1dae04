"""Benchmark: building one packed row from flat arrays.

The offline path reads a row's sequences from memory-mapped arrays and the
loader from its buffer; both hand :func:`sftpack.handoff.build_row` the
concatenated ids, the concatenated loss mask and the lengths. This measures
one 4,096-token row of about 5 sequences (lengths drawn so the row is ~97%
full, the last sequence absorbing the tail), five ways in the same run:

- ``build_row`` from numpy arrays (what the loader did before issue 18),
- ``build_row`` from slices of a ``np.memmap`` on disk (int32 ids, uint8 mask:
  what the offline path does),
- ``build_parts`` from each sequence's own arrays, unchecked (what the loader
  does: it checks the ids once, on the laid row),
- ``build_row`` of a row holding only the first sequence (what an unpacked
  loader's row costs),
- ``PackedBatch.from_samples`` on :class:`~sftpack.Sample` objects (the wrapper:
  concatenates, then calls ``build_row``).

Rounds are interleaved (each variant once per round) and the table gives
medians in microseconds.

    python benchmarks/bench_rowbuild.py [--rounds 3000] [--width 4096] [--pad-multiple 1]

Writes ``benchmarks/out/bench_rowbuild.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _machine import cpu_model, load_average
from _results import add_flag, markdown_table, write_section
from sftpack.handoff import PackedBatch, Sample, build_row
from sftpack.handoff.build import build_parts

OUT = Path(__file__).resolve().parent / "out"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--pad-multiple", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    add_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    m = args.pad_multiple
    cuts = np.sort(rng.choice(np.arange(1, int(args.width * 0.97) // m), size=4, replace=False)) * m
    lengths = np.diff(np.concatenate([[0], cuts, [int(args.width * 0.97) // m * m]])).astype(np.int64)
    n_tok = int(lengths.sum())
    ids = rng.integers(0, 151_646, n_tok).astype(np.int32)
    mask = rng.random(n_tok) < 0.6
    samples = []
    start = 0
    for i, n in enumerate(lengths):
        samples.append(Sample(ids[start : start + n].astype(np.int64), mask[start : start + n], f"conv{i}"))
        start += n

    tmp = tempfile.mkdtemp()
    mm_ids = np.memmap(os.path.join(tmp, "ids.bin"), dtype=np.int32, mode="w+", shape=(n_tok + 1000,))
    mm_mask = np.memmap(os.path.join(tmp, "mask.bin"), dtype=np.uint8, mode="w+", shape=(n_tok + 1000,))
    mm_ids[500 : 500 + n_tok] = ids
    mm_mask[500 : 500 + n_tok] = mask
    mm_ids.flush()
    mm_mask.flush()
    ro_ids = np.memmap(os.path.join(tmp, "ids.bin"), dtype=np.int32, mode="r")
    ro_mask = np.memmap(os.path.join(tmp, "mask.bin"), dtype=np.uint8, mode="r")
    seq_ids = [s.conversation_id for s in samples]
    id_parts, mask_parts, lens = [s.input_ids for s in samples], [s.loss_mask for s in samples], lengths.tolist()

    variants = {
        "build_row (numpy arrays)": lambda: build_row(
            ids, mask, lengths, row_width=args.width, pad_multiple=m, sequence_ids=seq_ids
        ),
        "build_row (memmap slices)": lambda: build_row(
            ro_ids[500 : 500 + n_tok],
            ro_mask[500 : 500 + n_tok],
            lengths,
            row_width=args.width,
            pad_multiple=m,
            sequence_ids=seq_ids,
        ),
        "build_parts (each sequence's arrays)": lambda: build_parts(
            id_parts, mask_parts, lens, row_width=args.width, pad_multiple=m, sequence_ids=seq_ids
        ),
        "build_row (one sequence)": lambda: build_row(
            samples[0].input_ids, samples[0].loss_mask, [len(samples[0])], row_width=args.width, pad_multiple=m
        ),
        "PackedBatch.from_samples": lambda: PackedBatch.from_samples(samples, row_width=args.width, pad_multiple=m),
    }
    ref = variants["PackedBatch.from_samples"]()
    for name, fn in variants.items():  # same row every way (but the one-sequence row), and warm-up
        b = fn()
        if name != "build_row (one sequence)":
            assert torch.equal(b.input_ids, ref.input_ids) and torch.equal(b.labels, ref.labels), name
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    machine = (
        f"{cpu_model()}, {os.cpu_count()} logical cores, 1 torch thread, numpy {np.__version__}, "
        f"Python {platform.python_version()}; 1-min load average {load_average():.2f}"
    )
    setting = (
        f"one row of width {args.width}: {len(lengths)} sequences {lengths.tolist()} ({n_tok} real tokens), "
        f"pad multiple {m}, {args.rounds} interleaved rounds, medians"
    )
    print(f"machine: {machine}")
    print(setting + "\n")
    base = float(np.median(times["PackedBatch.from_samples"]))
    rows = []
    nw = max(len(k) for k in variants)
    print(f"| {'builder':{nw}} | {'median µs':>9} | {'p90 µs':>7} | {'vs from_samples':>15} |")
    print(f"|{'-' * (nw + 2)}|{'-' * 11}|{'-' * 9}|{'-' * 17}|")
    for name, ts in times.items():
        med, p90 = float(np.median(ts)) * 1e6, float(np.percentile(ts, 90)) * 1e6
        rows.append((name, f"{med:.1f}", f"{p90:.1f}", f"{med / (base * 1e6):.2f}"))
        print(f"| {name:{nw}} | {med:9.1f} | {p90:7.1f} | {med / (base * 1e6):14.2f}x |")
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "bench_rowbuild.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["builder", "median_us", "p90_us", "ratio_vs_from_samples"])
        w.writerows(rows)
    if not args.no_results:
        table = markdown_table(rows, headers=["builder", "median µs", "p90 µs", "vs from_samples"])
        write_section(__file__, table, machine, title=f"`build_row` against `PackedBatch.from_samples`: {setting}.")


if __name__ == "__main__":
    main()
