"""Benchmark: real tokens per second of training on each packing path against padded batches.

The embedded corpus (chitchat conversations, ChatML, the Qwen tokenizer; the
first ``--limit`` conversations, longer ones split at ``--max-seq-len``) trains
the same seeded model with the same optimizer on:

- ``none``: right-padded batches of ``--conversations`` conversations (the baseline);
- ``trainer``: the same conversations per step, packed at the step;
- ``loader`` / ``offline``: ``--rows`` rows of ``--max-seq-len`` slots per step.

After one untimed warm-up step per path, ``--rounds`` rounds each run every path
for ``--steps`` steps from a fresh seeded model (round ``r`` on the conversations
of seed ``+ r``, the paths in a rotated order, so a busy machine slows all
alike); the table gives the median over rounds of real tokens/s, the speed-up over ``none``,
and the bound that packing alone allows: the ratio of the fills (real tokens
per slot), i.e. the slots saved. What keeps a path under its bound is printed
beside it: the share of the step that does not scale with slots (the output
head on supervised tokens, the optimizer step) and the per-segment attention.

The model: a small Llama built from a config, attention through sftpack's
variable-length reference (one causal SDPA per segment) on CPU, flash-attn on
CUDA when installed. ``--vocab data`` (default) gives it only the ids that occur
in the data (34,460 of 151,646 for the whole corpus): with the full vocabulary a
64-wide model spends most of its time in the output head, which packing does not
change (``--vocab tokenizer`` measures that case).

    python benchmarks/bench_train.py [--max-seq-len 4096] [--limit 600] [--rounds 4] [--steps 2]

Writes ``benchmarks/out/bench_train.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section

OUT = Path(__file__).resolve().parent / "out"
PATHS = ("none", "trainer", "loader", "offline")


def machine(device: str) -> str:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU only"
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, Python {platform.python_version()}, {gpu}; 1-min load average {load_average():.2f}"
    )


def run_benchmark(args: argparse.Namespace) -> list[dict]:
    from sftpack.data import default_tokenizer
    from sftpack.loop import (
        TrainConfig,
        build_model,
        compact_vocabulary,
        default_attention,
        make_source,
        tokenized_samples,
        train,
    )
    from sftpack.offline import prepack_samples

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    tok = default_tokenizer()
    t0 = time.perf_counter()
    samples, stats = tokenized_samples(tok, max_seq_len=args.max_seq_len, limit=args.limit)
    vocab, pad_id = len(tok), tok.pad_token_id
    if args.vocab == "data":
        samples, ids = compact_vocabulary(samples)
        vocab, pad_id = len(ids), 0
    print(
        f"data: {stats.conversations:,} conversations -> {len(samples):,} samples, {stats.tokens:,} tokens "
        f"({time.perf_counter() - t0:.1f} s); vocabulary {vocab:,} ({args.vocab}); device {device}, {args.dtype}, "
        f"attention {default_attention(device)}"
    )

    def run_once(path: str, seed: int, steps: int, prepacked: Any) -> Any:
        per_rows = path in ("loader", "offline")
        cfg = TrainConfig(
            packing=path,
            steps=steps,
            max_seq_len=args.max_seq_len,
            seed=seed,
            batch_size=args.rows if per_rows else args.conversations,
            lr=1e-3,
            dim=args.dim,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            device=device,
            buffer_size=256,
            micro_batch_tokens=args.micro_batch_tokens or args.rows * args.max_seq_len,
        )
        model = build_model(
            vocab,
            dim=args.dim,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            seed=seed,
            attn_implementation=default_attention(device),
            dtype=dtype,
        )
        return train(
            cfg,
            source=make_source(cfg, samples=samples, prepacked=prepacked, pad_id=pad_id),
            model=model,
        )

    logs: dict[str, list[Any]] = {p: [] for p in args.paths}
    per_round: dict[str, list[float]] = {p: [] for p in args.paths}
    first_last: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepacked = None
        if "offline" in args.paths:
            prepacked = prepack_samples(samples, Path(tmp) / "rows", max_seq_len=args.max_seq_len, pad_id=pad_id).path
        t = time.perf_counter()
        for path in args.paths:  # untimed: first calls, allocator growth
            run_once(path, args.seed, 1, prepacked)
        print(
            f"  warm-up: one step per path in {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        for r in range(args.rounds):
            # Round r: every path once, in a rotated order, on the conversations of seed + r; a busy
            # machine then slows every path alike instead of whichever ran during the busy minute.
            order = args.paths[r % len(args.paths) :] + args.paths[: r % len(args.paths)]
            for path in order:
                res = run_once(path, args.seed + r, args.steps, prepacked)
                logs[path].extend(res.logs)
                per_round[path].append(sum(x.real_tokens for x in res.logs) / sum(x.step_time for x in res.logs))
                if r == 0:
                    first_last[path] = (res.logs[0].loss, res.logs[-1].loss)
            print(
                f"  round {r + 1}/{args.rounds}: "
                + ", ".join(f"{p} {per_round[p][-1]:,.0f}" for p in args.paths)
                + " real tokens/s",
                flush=True,
            )
    rows = []
    for path in args.paths:
        timed = logs[path]
        real = sum(x.real_tokens for x in timed)
        slots = sum(x.slots for x in timed)
        rows.append(
            {
                "path": path,
                "steps": len(timed),
                "real_tokens": real,
                "slots": slots,
                "label_tokens": sum(x.label_tokens for x in timed),
                "fill": real / slots,
                "micro_batches_per_step": sum(x.micro_batches for x in timed) / len(timed),
                "sequences_per_step": sum(x.sequences for x in timed) / len(timed),
                "seconds": sum(x.step_time for x in timed),
                "real_tokens_per_s": float(np.median(per_round[path])),
                "min_tokens_per_s": min(per_round[path]),
                "max_tokens_per_s": max(per_round[path]),
                "first_loss": first_last[path][0],
                "last_loss": first_last[path][1],
            }
        )
    base = next((r for r in rows if r["path"] == "none"), None)
    for r in rows:
        r["speedup"] = r["real_tokens_per_s"] / base["real_tokens_per_s"] if base else float("nan")
        r["bound"] = r["fill"] / base["fill"] if base else float("nan")
        r["of_bound"] = r["speedup"] / r["bound"] if base else float("nan")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument(
        "--limit",
        type=int,
        default=600,
        help="first N conversations of the corpus (default 600)",
    )
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated (default: all four)")
    p.add_argument(
        "--conversations",
        type=int,
        default=8,
        help="conversations per step (none, trainer)",
    )
    p.add_argument("--rows", type=int, default=2, help="rows per step (loader, offline)")
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="timed steps per path per round (default 2)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="rounds over all paths, each on other conversations",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", choices=["data", "tokenizer"], default="data")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: steadier than 2 on a shared 2-core machine)",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="trainer path: token budget of one packed micro-batch (default: rows x max-seq-len)",
    )
    p.add_argument("--csv", default=str(OUT / "bench_train.csv"))
    add_flag(p)
    args = p.parse_args(argv)
    args.paths = [x for x in args.paths.split(",") if x]
    bad = sorted(set(args.paths) - set(PATHS))
    if bad:
        p.error(f"unknown paths {bad}: choose from {', '.join(PATHS)}")
    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    where = machine(device)
    print(f"machine: {where}")
    if load_average() > (os.cpu_count() or 1):
        print("note: the machine is busy (load average above the core count); timings are noisy")
    print(
        f"model: Llama dim {args.dim}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv); "
        f"max_seq_len {args.max_seq_len}; {args.conversations} conversations or {args.rows} rows per step; "
        f"{args.rounds} rounds x {args.steps} timed steps per path (round-robin, rotated order; median of rounds)"
    )
    rows = run_benchmark(args)
    head = (
        f"{'path':8s} {'fill':>7s} {'slots/step':>10s} {'real tok/s':>11s} {'(min-max)':>15s} {'speed-up':>9s} "
        f"{'bound':>7s} {'of bound':>9s} {'seq/step':>9s} {'mb/step':>8s}  loss first -> last"
    )
    print()
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['path']:8s} {r['fill']:7.1%} {r['slots'] / r['steps']:10,.0f} {r['real_tokens_per_s']:11,.0f} "
            f"{r['min_tokens_per_s']:7,.0f}-{r['max_tokens_per_s']:<7,.0f} "
            f"{r['speedup']:8.2f}x {r['bound']:6.2f}x {r['of_bound']:8.0%} {r['sequences_per_step']:9.1f} "
            f"{r['micro_batches_per_step']:8.1f}  {r['first_loss']:.3f} -> {r['last_loss']:.3f}"
        )
    print(
        "\nbound = fill / fill of padded batches (the slots packing saves). Under it: work that does not scale with "
        "slots (the output head runs on supervised tokens only, the same for every path; the AdamW step), and "
        "the reference attention's per-segment loop (one SDPA call per conversation) against one batched call per "
        "padded micro-batch."
    )
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    if not args.no_results:
        table = formatted_table(
            [{**r, "slots_per_step": r["slots"] / r["steps"]} for r in rows],
            [
                ("path", "path", "{}"),
                ("fill", "fill", "{:.1%}"),
                ("slots_per_step", "slots / step", "{:,.0f}"),
                ("real_tokens_per_s", "real tokens/s (median of rounds)", "{:,.0f}"),
                ("min_tokens_per_s", "min", "{:,.0f}"),
                ("max_tokens_per_s", "max", "{:,.0f}"),
                ("speedup", "vs padded", "{:.2f}x"),
                ("bound", "bound (slots saved)", "{:.2f}x"),
                ("of_bound", "of bound", "{:.0%}"),
                ("sequences_per_step", "conversations / step", "{:.1f}"),
                ("first_loss", "first loss", "{:.3f}"),
                ("last_loss", "last loss", "{:.3f}"),
            ],
        )
        title = (
            f"Real tokens/s of each path against padded batches on the same seeded Llama (dim {args.dim}, "
            f"{args.layers} layers, {args.heads} heads / {args.kv_heads} kv, vocabulary: {args.vocab}, "
            f"{args.dtype} on {device}, {args.threads} torch thread(s)), the first {args.limit} conversations of "
            f"the embedded corpus at {args.max_seq_len}; {args.conversations} conversations or {args.rows} rows per "
            f"step; {args.rounds} rounds of {args.steps} timed steps per path. The bound is the padded batches' fill "
            "against the packed rows': the slots packing saves."
        )
        write_section(__file__, table, where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
