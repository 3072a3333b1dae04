"""Benchmark: training speed of each packing path against padded batches, the whole step
and its two parts (the transformer body, the output head with the loss), for both vocabularies.

The embedded corpus (chitchat conversations, ChatML, the Qwen tokenizer; the
first ``--limit`` conversations, longer ones split at ``--max-seq-len``) trains
the same seeded model with the same optimizer on:

- ``none``: right-padded batches of ``--conversations`` conversations (the baseline);
- ``trainer``: the same conversations per step, packed at the step;
- ``loader`` / ``offline``: ``--rows`` rows of ``--max-seq-len`` slots per step.

Each vocabulary (``--vocab both``, the default, runs the two in turn) is its own
section: ``data`` gives the model only the ids that occur in the data (34,460 of
151,646 for the whole corpus), ``tokenizer`` all 151,646 Qwen ids. After one
untimed warm-up step per path, ``--rounds`` rounds each run every path for
``--steps`` steps from a fresh seeded model (round ``r`` on the conversations of
seed ``+ r``, the paths in a rotated order, so a busy machine slows all alike).

Inside every step, hooks time the two parts of each micro-batch as
:class:`sftpack.loop.LossModule` runs them (:class:`BodyHeadClock`): the
**body** (``model.base_model``: embeddings, layers, final norm; its forward and
its backward) and the **head** (everything between the body's output and the
gradient of that output: the output head and the loss, forward and backward,
whatever implementation ``LossModule`` uses). The rest of the step (fetching
the batch, the gradient norm, the optimizer) is the step minus both.

Per path the table gives the median over rounds of real tokens/s for the step,
the body and the head, each as a speed-up over ``none``, beside the **bound**:
the ratio of the fills (real tokens per slot), i.e. the slots packing saves. The
body's work scales with slots, so packing speeds it up toward the bound; the
head runs on supervised tokens only, the same on every path, so packing leaves
it as it is; the step lands in between, weighted by the head's share.

    python benchmarks/bench_train.py [--vocab both] [--max-seq-len 4096] [--limit 400] [--rounds 3] [--steps 1]

Writes ``benchmarks/out/bench_train.csv`` (one line per vocabulary and path).
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
VOCABS = ("data", "tokenizer")


def machine(device: str) -> str:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU only"
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, Python {platform.python_version()}, {gpu}"
    )


class BodyHeadClock:
    """Seconds spent in a causal LM's body and in its head (+ loss), forward and backward,
    summed over every micro-batch, measured by hooks while the model trains.

    - body forward: ``model.base_model``'s forward pre-hook to its forward hook;
    - head: from the body's forward hook to the moment the gradient of the body's output
      is ready (a hook on that tensor): the head's and the loss's forward, ``backward()``
      starting, and the head's backward; with a fused head that computes its gradients in
      the forward, the same interval;
    - body backward: from there to the last gradient accumulated into a body parameter.

    Nothing else runs in these intervals in :func:`sftpack.loop.train` (a micro-batch's
    forward is followed by its ``backward()``). On CUDA every mark synchronises first.
    """

    def __init__(self, model: Any, *, cuda: bool = False) -> None:
        self.body_seconds = 0.0
        self.head_seconds = 0.0
        self._cuda = cuda
        self._start = 0.0  # the current phase's start
        self._last_grad = 0.0  # the latest gradient accumulated into a body parameter
        self._backward = False  # a body backward is under way (settled at the next forward or read)
        body = model.base_model
        if body is model:
            raise ValueError(f"{type(model).__name__} has no separate base model to time")
        self._handles = [
            body.register_forward_pre_hook(self._body_begins),
            body.register_forward_hook(self._body_ends),
        ]
        for p in body.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_accumulated))

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _settle(self) -> None:
        if self._backward:
            self.body_seconds += self._last_grad - self._start
            self._backward = False

    def _body_begins(self, module: Any, args: Any) -> None:
        self._settle()
        self._start = self._now()

    def _body_ends(self, module: Any, args: Any, output: Any) -> None:
        now = self._now()
        self.body_seconds += now - self._start
        self._start = now
        hidden = output[0]
        if hidden.requires_grad:
            hidden.register_hook(self._head_done)

    def _head_done(self, grad: torch.Tensor) -> None:
        now = self._now()
        self.head_seconds += now - self._start
        self._start = self._last_grad = now
        self._backward = True

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        self._last_grad = self._now()

    def read(self) -> tuple[float, float]:
        """``(body seconds, head seconds)`` so far."""
        self._settle()
        return self.body_seconds, self.head_seconds

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def run_benchmark(args: argparse.Namespace, vocab_kind: str, tok: Any, all_samples: list[Any]) -> list[dict]:
    from sftpack.loop import (
        TrainConfig,
        build_model,
        compact_vocabulary,
        default_attention,
        make_source,
        train,
    )
    from sftpack.offline import prepack_samples

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    samples, vocab, pad_id = all_samples, len(tok), tok.pad_token_id
    if vocab_kind == "data":
        samples, ids = compact_vocabulary(samples)
        vocab, pad_id = len(ids), 0
    print(f"\n[vocabulary: {vocab_kind}, {vocab:,} ids]", flush=True)

    def run_once(path: str, seed: int, steps: int, prepacked: Any) -> tuple[Any, float, float]:
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
        clock = BodyHeadClock(model, cuda=device == "cuda")
        res = train(
            cfg,
            source=make_source(cfg, samples=samples, prepacked=prepacked, pad_id=pad_id),
            model=model,
        )
        body, head = clock.read()
        clock.remove()
        return res, body, head

    keys = ("step", "body", "head")
    logs: dict[str, list[Any]] = {p: [] for p in args.paths}
    rate: dict[str, dict[str, list[float]]] = {p: {k: [] for k in keys} for p in args.paths}
    seconds: dict[str, dict[str, float]] = {p: dict.fromkeys(keys, 0.0) for p in args.paths}
    loads: list[float] = []
    first_last: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepacked = None
        if "offline" in args.paths:
            prepacked = prepack_samples(samples, Path(tmp) / "rows", max_seq_len=args.max_seq_len, pad_id=pad_id).path
        t = time.perf_counter()
        for path in args.paths:  # untimed: first calls, allocator growth
            run_once(path, args.seed, 1, prepacked)
        print(f"  warm-up: one step per path in {time.perf_counter() - t:.1f} s", flush=True)
        for r in range(args.rounds):
            # Round r: every path once, in a rotated order, on the conversations of seed + r; a busy
            # machine then slows every path alike instead of whichever ran during the busy minute.
            order = args.paths[r % len(args.paths) :] + args.paths[: r % len(args.paths)]
            for path in order:
                res, body, head = run_once(path, args.seed + r, args.steps, prepacked)
                logs[path].extend(res.logs)
                real = sum(x.real_tokens for x in res.logs)
                step = sum(x.step_time for x in res.logs)
                for k, s in zip(keys, (step, body, head)):
                    rate[path][k].append(real / s)
                    seconds[path][k] += s
                if r == 0:
                    first_last[path] = (res.logs[0].loss, res.logs[-1].loss)
            loads.append(load_average())
            print(
                f"  round {r + 1}/{args.rounds} (load {loads[-1]:.2f}): "
                + ", ".join(f"{p} {rate[p]['step'][-1]:,.0f}" for p in args.paths)
                + " real tokens/s a step",
                flush=True,
            )
    rows = []
    for path in args.paths:
        timed = logs[path]
        real = sum(x.real_tokens for x in timed)
        slots = sum(x.slots for x in timed)
        sec = seconds[path]
        rows.append(
            {
                "vocab": vocab_kind,
                "vocab_size": vocab,
                "path": path,
                "steps": len(timed),
                "real_tokens": real,
                "slots": slots,
                "label_tokens": sum(x.label_tokens for x in timed),
                "fill": real / slots,
                "micro_batches_per_step": sum(x.micro_batches for x in timed) / len(timed),
                "sequences_per_step": sum(x.sequences for x in timed) / len(timed),
                "seconds": sec["step"],
                "body_share": sec["body"] / sec["step"],
                "head_share": sec["head"] / sec["step"],
                "rest_share": 1.0 - (sec["body"] + sec["head"]) / sec["step"],
                **{f"{k}_tokens_per_s": float(np.median(rate[path][k])) for k in keys},
                "min_tokens_per_s": min(rate[path]["step"]),
                "max_tokens_per_s": max(rate[path]["step"]),
                "first_loss": first_last[path][0],
                "last_loss": first_last[path][1],
                "load_min": min(loads),
                "load_max": max(loads),
            }
        )
    base = next((r for r in rows if r["path"] == "none"), None)
    for r in rows:
        for k in keys:
            r[f"{k}_speedup"] = r[f"{k}_tokens_per_s"] / base[f"{k}_tokens_per_s"] if base else float("nan")
        r["bound"] = r["fill"] / base["fill"] if base else float("nan")
        r["of_bound"] = r["step_speedup"] / r["bound"] if base else float("nan")
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'path':8s} {'fill':>6s} {'bound':>6s} | {'step tok/s':>10s} {'(min-max)':>13s} {'vs pad':>7s} | "
        f"{'body':>6s} {'head':>6s} | {'body':>5s} {'head':>5s} {'rest':>5s}  loss first -> last"
    )
    print(f"{'':24s}| {'':31s} | speed-up vs pad | share of the step")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['path']:8s} {r['fill']:6.1%} {r['bound']:5.2f}x | {r['step_tokens_per_s']:10,.0f} "
            f"{r['min_tokens_per_s']:6,.0f}-{r['max_tokens_per_s']:<6,.0f} {r['step_speedup']:6.2f}x | "
            f"{r['body_speedup']:5.2f}x {r['head_speedup']:5.2f}x | {r['body_share']:5.0%} {r['head_share']:5.0%} "
            f"{r['rest_share']:5.0%}  {r['first_loss']:.3f} -> {r['last_loss']:.3f}"
        )
    print(f"load average over the rounds: {rows[0]['load_min']:.2f}-{rows[0]['load_max']:.2f}")


COLUMNS = [
    ("path", "path", "{}"),
    ("fill", "fill", "{:.1%}"),
    ("bound", "bound (slots saved)", "{:.2f}x"),
    ("step_tokens_per_s", "step: real tokens/s", "{:,.0f}"),
    ("step_speedup", "step vs padded", "{:.2f}x"),
    ("body_speedup", "body vs padded", "{:.2f}x"),
    ("head_speedup", "head + loss vs padded", "{:.2f}x"),
    ("body_share", "body share", "{:.0%}"),
    ("head_share", "head share", "{:.0%}"),
    ("rest_share", "rest share", "{:.0%}"),
    ("first_loss", "first loss", "{:.3f}"),
    ("last_loss", "last loss", "{:.3f}"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument(
        "--limit",
        type=int,
        default=400,
        help="first N conversations of the corpus (default 400)",
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
        default=1,
        help="timed steps per path per round (default 1)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over all paths, each on other conversations (default 3)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab",
        choices=[*VOCABS, "both"],
        default="both",
        help="the model's vocabulary: the ids of the data, the tokenizer's 151,646, or both in turn (default)",
    )
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
    print(f"machine: {where}; 1-min load average {load_average():.2f}")
    if load_average() > (os.cpu_count() or 1):
        print("note: the machine is busy (load average above the core count); timings are noisy")
    print(
        f"model: Llama dim {args.dim}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), {args.dtype}; "
        f"max_seq_len {args.max_seq_len}; {args.conversations} conversations or {args.rows} rows per step; "
        f"{args.rounds} rounds x {args.steps} timed steps per path (round-robin, rotated order; median of rounds)"
    )

    from sftpack.data import default_tokenizer
    from sftpack.loop import default_attention, tokenized_samples

    tok = default_tokenizer()
    t0 = time.perf_counter()
    samples, stats = tokenized_samples(tok, max_seq_len=args.max_seq_len, limit=args.limit)
    print(
        f"data: {stats.conversations:,} conversations -> {len(samples):,} samples, {stats.tokens:,} tokens "
        f"({time.perf_counter() - t0:.1f} s); device {device}, attention {default_attention(device)}"
    )
    vocabs = list(VOCABS) if args.vocab == "both" else [args.vocab]
    results = {v: run_benchmark(args, v, tok, samples) for v in vocabs}
    for v, rows in results.items():
        print(f"\nvocabulary: {v} ({rows[0]['vocab_size']:,} ids)")
        print_table(rows)
    print(
        "\nbound = fill / fill of padded batches (the slots packing saves). body = model.base_model forward + "
        "backward (scales with slots: packing speeds it up toward the bound; the per-segment attention loop and the "
        "input embedding's dense gradient keep it under); head = output head + loss, forward + backward (runs on "
        "supervised tokens only, the same on every path: about 1.00x); rest = batch fetch, gradient norm, AdamW step."
    )
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    flat = [r for rows in results.values() for r in rows]
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(flat[0]))
        w.writeheader()
        w.writerows(flat)
    print(f"wrote {out}")
    if not args.no_results:
        parts = []
        for v, rows in results.items():
            parts += [
                f"**Vocabulary: {v}** ({rows[0]['vocab_size']:,} ids; 1-min load average "
                f"{rows[0]['load_min']:.2f}-{rows[0]['load_max']:.2f} over the rounds)",
                "",
                formatted_table(rows, COLUMNS),
                "",
            ]
        parts.append(
            "Speed-ups are medians over rounds of real tokens/s (of the whole step, of the time in the body, of the "
            "time in the head + loss) against padded batches. The body (`model.base_model`, forward + backward) does "
            "work per slot, so packing moves it toward the bound; the head + loss runs on supervised tokens only, the "
            "same on every path, so packing leaves it at about 1x; the step lands between, by the head's share. "
            "Body and head are timed by hooks inside the training step (`BodyHeadClock`); rest = batch fetch, "
            "gradient norm, optimizer. On a real model the body dominates: see docs/performance.md."
        )
        title = (
            f"Training speed of each path against padded batches on the same seeded Llama (dim {args.dim}, "
            f"{args.layers} layers, {args.heads} heads / {args.kv_heads} kv, {args.dtype} on {device}, "
            f"{args.threads} torch thread(s)), the first {args.limit} conversations of the embedded corpus at "
            f"{args.max_seq_len}; {args.conversations} conversations or {args.rows} rows per step; {args.rounds} "
            f"rounds of {args.steps} timed step(s) per path; for each vocabulary. The bound is the padded batches' "
            "fill against the packed rows': the slots packing saves."
        )
        write_section(__file__, "\n".join(parts), where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
