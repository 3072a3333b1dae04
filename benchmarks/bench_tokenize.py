"""Tokenizing throughput: render + tokenize + mask, against a plain batched ``tokenizer(texts)``.

Same corpus (the embedded default: 4,017 chitchat conversations, about 3.5 M
ChatML tokens), same tokenizer (the default Qwen BPE), same run, same batch
size, with 1 and 2 processes. The plain side gets the conversations already
rendered to text, so it only tokenizes; ours starts from the messages and
produces ``Sample`` objects (ids + loss mask). Goal: ours >= 0.7x the plain side.

Runs are interleaved (plain, ours, plain, ours, ...) and the best of
``--repeats`` is kept, so a noisy neighbour on the machine hurts both sides alike.
With 1 process the Rust tokenizer may use its own thread pool on both sides;
with N processes each worker is single-threaded on both sides. (On 2 cores, 2
processes gain nothing over 1: the Rust thread pool already fills both.)

    python benchmarks/bench_tokenize.py [--repeats 3] [--batch-size 256] [--limit N]

Prints a table and writes ``benchmarks/out/bench_tokenize.csv``.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section
from sftpack.chat import renderer_for, tokenize_conversations
from sftpack.data import default_corpus, default_tokenizer

_TOK: Any = None


def _plain_worker_init(tok: Any) -> None:
    global _TOK
    _TOK = tok


def _plain_worker(texts: list[str]) -> list[np.ndarray]:
    out = _TOK(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(ids, dtype=np.int64) for ids in out]  # shipped back like our samples' arrays


def plain(tok: Any, texts: list[str], batch_size: int, num_proc: int) -> int:
    """``tokenizer(texts)`` batch by batch; returns the number of tokens."""
    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    if num_proc == 1:
        return sum(len(ids) for b in batches for ids in tok(b, add_special_tokens=False)["input_ids"])
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker, as on our side
    try:
        pool = multiprocessing.get_context("fork").Pool(num_proc, _plain_worker_init, (tok,))
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        return sum(len(ids) for res in pool.imap(_plain_worker, batches) for ids in res)
    finally:
        pool.close()
        pool.join()  # reaped, so the workers' CPU time is counted


def backend_only(tok: Any, texts: list[str], batch_size: int) -> int:
    """The Rust ``encode_batch`` alone, without transformers' Python conversion."""
    backend = tok.backend_tokenizer
    n = 0
    for i in range(0, len(texts), batch_size):
        n += sum(len(e.ids) for e in backend.encode_batch(texts[i : i + batch_size], add_special_tokens=False))
    return n


def ours(tok: Any, convs: list[Any], batch_size: int, num_proc: int) -> int:
    out = tokenize_conversations(convs, tok, batch_size=batch_size, num_proc=num_proc, progress=False)
    n = sum(len(s) for s in out)
    assert n == out.stats.tokens
    return n


def machine() -> str:
    cpu = cpu_model()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = f" / load average {load_average():.2f}"
    import tokenizers
    import transformers

    return (
        f"{cpu}, {usable} usable cores{load}; Python {platform.python_version()}, "
        f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}, {platform.system()}"
    )


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system  # this process, its threads, reaped workers


def timed(fn: Any, *args: Any) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tokens)."""
    w, c = time.perf_counter(), _cpu()
    n = fn(*args)
    return time.perf_counter() - w, _cpu() - c, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="first N conversations only")
    ap.add_argument("--procs", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "bench_tokenize.csv")
    add_flag(ap)
    args = ap.parse_args(argv)

    where = machine()
    print(f"machine: {where}")
    tok = default_tokenizer()
    convs = list(default_corpus(limit=args.limit))
    renderer = renderer_for(tok)
    texts = [renderer.render(c.messages) for c in convs]
    print(f"corpus: {len(convs)} conversations, {sum(map(len, texts)):,} characters, batch size {args.batch_size}")
    ours(tok, convs[:64], args.batch_size, 1)  # warm-up: template compiled, fast-path probes done

    rows = []
    for num_proc in [int(p) for p in args.procs.split(",")]:
        times: dict[str, list[float]] = {"plain": [], "ours": [], "backend": []}
        cpus: dict[str, list[float]] = {"plain": [], "ours": [], "backend": []}
        tokens: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, fn, fargs in (
                ("plain", plain, (tok, texts, args.batch_size, num_proc)),
                ("ours", ours, (tok, convs, args.batch_size, num_proc)),
                *([("backend", backend_only, (tok, texts, args.batch_size))] if num_proc == 1 else []),
            ):
                dt, cpu, n = timed(fn, *fargs)
                times[name].append(dt)
                cpus[name].append(cpu)
                tokens[name] = n
        assert len(set(tokens.values())) == 1, f"token counts differ: {tokens}"
        n = tokens["ours"]
        t_plain, t_ours = min(times["plain"]), min(times["ours"])
        row = {
            "procs": num_proc,
            "tokens": n,
            "plain_tok_per_s": n / t_plain,
            "ours_tok_per_s": n / t_ours,
            "ratio": t_plain / t_ours,
            "cpu_ratio": min(cpus["plain"]) / min(cpus["ours"]),
            "backend_tok_per_s": n / min(times["backend"]) if times["backend"] else float("nan"),
            "ratio_vs_backend": min(times["backend"]) / t_ours if times["backend"] else float("nan"),
        }
        rows.append(row)

    print()
    header = (
        f"{'procs':>5} | {'tokens':>10} | {'plain tokenizer(texts)':>22} | {'render+tokenize+mask':>20} | "
        f"{'ratio':>6} | {'CPU ratio':>9} | {'backend encode_batch':>20} | {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        backend = (
            f"{r['backend_tok_per_s']:>16,.0f} t/s"
            if r["backend_tok_per_s"] == r["backend_tok_per_s"]
            else f"{'-':>20}"
        )
        vs = f"{r['ratio_vs_backend']:>5.2f}x" if r["ratio_vs_backend"] == r["ratio_vs_backend"] else f"{'-':>6}"
        print(
            f"{r['procs']:>5} | {r['tokens']:>10,} | {r['plain_tok_per_s']:>18,.0f} t/s | "
            f"{r['ours_tok_per_s']:>16,.0f} t/s | {r['ratio']:>5.2f}x | {r['cpu_ratio']:>8.2f}x | {backend} | {vs}"
        )
    print(
        f"\nbest of {args.repeats} interleaved runs; goal: ratio >= 0.70 against the plain tokenizer. "
        "ratio = plain time / our time (wall clock); CPU ratio = the same with CPU seconds of all threads "
        "and worker processes (robust to other load on the machine)"
    )
    print(f"fast path served {renderer.fast_renders} renders in this process, reference method {renderer.slow_renders}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["machine"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "machine": machine()})
    print(f"wrote {args.out}")
    met = all(r["ratio"] >= 0.7 for r in rows)
    print("goal met" if met else "goal MISSED (a busy machine also slows one side more than the other: rerun)")
    if not args.no_results:
        table = formatted_table(
            rows,
            [
                ("procs", "processes", "{}"),
                ("tokens", "tokens", "{:,}"),
                ("plain_tok_per_s", "plain `tokenizer(texts)` tokens/s", "{:,.0f}"),
                ("ours_tok_per_s", "render + tokenize + mask tokens/s", "{:,.0f}"),
                ("ratio", "ratio", "{:.2f}x"),
                ("cpu_ratio", "CPU ratio", "{:.2f}x"),
                ("backend_tok_per_s", "backend `encode_batch` tokens/s", "{:,.0f}"),
                ("ratio_vs_backend", "ratio to backend", "{:.2f}x"),
            ],
        )
        title = (
            f"Rendering, tokenizing and masking the embedded corpus ({len(convs):,} conversations, batch size "
            f"{args.batch_size}) against a plain batched `tokenizer(texts)` on the already-rendered texts; best of "
            f"{args.repeats} interleaved runs; goal: ratio >= 0.70 ({'met' if met else 'missed'})."
        )
        write_section(__file__, table, where, title=title)
    return 0  # a measurement, not a test


if __name__ == "__main__":
    sys.exit(main())
