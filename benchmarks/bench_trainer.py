"""Benchmark: pack_step at the training step against the minimal work.

A right-padded batch ``[B, S] = [64, 4096]`` whose row lengths are drawn from the
embedded corpus (the chitchat conversations rendered with the ChatML template and
the Qwen tokenizer, truncated to ``S``) is packed by :func:`sftpack.trainer.pack_step`
in several configurations. The reference in the same run is the least any packer
must do: a boolean-mask gather of the real tokens into a flat tensor,
``input_ids[attention_mask]`` (no labels, no boundaries, no positions).

Timings are interleaved round-robin (every variant once per round) so that a
busy machine slows all of them alike; the table gives medians. Goal: ``pack_step``
at most 3x the minimal gather on CPU. CUDA columns appear only when a GPU is
present.

    python benchmarks/bench_trainer.py [--batch 64] [--seq 4096] [--rounds 200]

Writes ``benchmarks/out/bench_trainer.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from _machine import cpu_model, load_average
from _results import add_flag, markdown_table, write_section
from sftpack.trainer import pack_step

OUT = Path(__file__).resolve().parent / "out"


def machine() -> str:
    cpu = cpu_model()
    load = load_average()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} logical cores, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, Python {platform.python_version()}, {gpu}; 1-min load average at start {load:.2f}"
    )


def corpus_lengths() -> tuple[np.ndarray, str]:
    """Token lengths of the embedded corpus (cached under benchmarks/out/), or a documented fallback."""
    cache = OUT / "corpus_lengths.npy"
    if cache.exists():
        return np.load(cache), "embedded corpus (chitchat, ChatML, Qwen tokenizer; cached lengths)"
    try:
        from sftpack.data import default_corpus, default_tokenizer

        tok = default_tokenizer()
        texts = [tok.apply_chat_template(c.messages, tokenize=False) for c in default_corpus()]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
    except Exception as e:  # noqa: BLE001 - any failure falls back to a documented distribution
        rng = np.random.default_rng(0)
        lengths = np.maximum(1, np.round(rng.lognormal(np.log(400), 1.0, 4000))).astype(np.int64)
        return lengths, f"lognormal fallback (median 400, sigma 1.0): embedded corpus unavailable ({e!r})"
    OUT.mkdir(parents=True, exist_ok=True)
    np.save(cache, lengths)
    return lengths, "embedded corpus (chitchat, ChatML, Qwen tokenizer)"


def make_batches(lengths: np.ndarray, B: int, S: int, count: int, device: str) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        lens = np.minimum(rng.choice(lengths, B), S)  # over-long conversations truncated to S
        L = torch.from_numpy(lens)
        am = torch.arange(S)[None, :] < L[:, None]
        ids = torch.from_numpy(rng.integers(1, 151643, (B, S))).masked_fill(~am, 0)
        loss_mask = torch.from_numpy(rng.random((B, S)) < 0.6) & am
        labels = torch.where(loss_mask, ids, torch.full_like(ids, -100))
        out.append(
            {
                k: v.to(device)
                for k, v in dict(ids=ids, lengths=L, attention_mask=am, loss_mask=loss_mask, labels=labels).items()
            }
            | {"lengths_host": L, "real": int(lens.sum())}
        )
    return out


VARIANTS: dict[str, Callable[[dict], object]] = {
    "minimal: input_ids[attention_mask]": lambda b: b["ids"][b["attention_mask"]],
    "pack_step(ids, lengths, loss_mask)": lambda b: pack_step(b["ids"], b["lengths"], b["loss_mask"]),
    "  + pad_multiple=4 (CP=2)": lambda b: pack_step(b["ids"], b["lengths"], b["loss_mask"], pad_multiple=4),
    "  + pad_multiple=8, pad_to_multiple_of=128 (CP=4, FP8)": lambda b: pack_step(
        b["ids"], b["lengths"], b["loss_mask"], pad_multiple=8, pad_to_multiple_of=128
    ),
    "pack_step(ids, attention_mask=, labels=) (HF batch)": lambda b: pack_step(
        b["ids"], attention_mask=b["attention_mask"], labels=b["labels"]
    ),
    "pack_step(ids, host lengths, loss_mask)": lambda b: pack_step(b["ids"], b["lengths_host"], b["loss_mask"]),
}


def time_all(batches: list[dict], rounds: int, device: str) -> dict[str, np.ndarray]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in VARIANTS.values():  # warm-up
        for b in batches[:2]:
            fn(b)
    sync()
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(rounds):
        b = batches[r % len(batches)]
        for name, fn in VARIANTS.items():
            sync()
            t0 = time.perf_counter()
            fn(b)
            sync()
            times[name].append(time.perf_counter() - t0)
    return {k: np.asarray(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--batches", type=int, default=8, help="distinct batches cycled through")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    add_flag(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    lengths, source = corpus_lengths()
    B, S = args.batch, args.seq
    # CPU with 1 thread and with torch's default; a busy machine hurts multi-threaded
    # runs of many small ops most (each op waits for its slowest thread).
    nthreads = torch.get_num_threads()
    configs = [("cpu", 1)] + ([("cpu", nthreads)] if nthreads > 1 else [])
    configs += [("cuda", nthreads)] if torch.cuda.is_available() else []
    where = machine()
    print(f"machine: {where}")
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > (os.cpu_count() or 1):
        print("note: the machine is busy (load average above the core count); timings are noisy")
    print(
        f"lengths: {source}; {len(lengths)} conversations, median {int(np.median(lengths))}, "
        f"p90 {int(np.percentile(lengths, 90))}, max {int(lengths.max())} tokens"
    )
    results = {}
    for dev, threads in configs:
        torch.set_num_threads(threads)
        label = f"{dev} {threads}t" if dev == "cpu" else dev
        results[label] = time_all(make_batches(lengths, B, S, args.batches, dev), args.rounds, dev)
    torch.set_num_threads(nthreads)
    devices = list(results)
    batches = make_batches(lengths, B, S, args.batches, "cpu")
    real = np.mean([b["real"] for b in batches])
    print(
        f"batch [{B}, {S}]: {real:,.0f} real tokens on average ({100 * real / (B * S):.1f}% of the padded batch), "
        f"{args.rounds} interleaved rounds over {args.batches} batches\n"
    )
    base = "minimal: input_ids[attention_mask]"
    head = f"{'variant':58}"
    for d in devices:
        head += f" {d + ' ms':>11} {'x min':>6} {'Mtok/s':>7}"
    print(head)
    print("-" * len(head))
    rows = []
    for name in VARIANTS:
        line = f"{name:58}"
        row: dict[str, object] = {"variant": name.strip(), "batch": B, "seq": S, "real_tokens": round(real)}
        for d in devices:
            med = float(np.median(results[d][name]))
            ratio = med / float(np.median(results[d][base]))
            line += f" {med * 1e3:11.3f} {ratio:6.2f} {real / med / 1e6:7.1f}"
            key = d.replace(" ", "_")
            row |= {
                f"{key}_ms_median": round(med * 1e3, 4),
                f"{key}_ms_p10": round(float(np.percentile(results[d][name], 10)) * 1e3, 4),
                f"{key}_ratio_to_minimal": round(ratio, 3),
                f"{key}_mtok_per_s": round(real / med / 1e6, 2),
            }
        print(line)
        rows.append(row)
    print()
    for d in devices:
        ratio = float(np.median(results[d]["pack_step(ids, lengths, loss_mask)"]) / np.median(results[d][base]))
        print(
            f"{d}: pack_step / minimal gather = {ratio:.2f}x (goal <= 3x on CPU): {'met' if ratio <= 3 else 'NOT met'}"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "bench_trainer.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {OUT / 'bench_trainer.csv'}")
    if not args.no_results:
        columns = ["variant"] + [
            f"{d.replace(' ', '_')}_{k}" for d in devices for k in ("ms_median", "ratio_to_minimal", "mtok_per_s")
        ]
        headers = ["variant"] + [f"{d} {k}" for d in devices for k in ("ms (median)", "x minimal gather", "M tokens/s")]
        title = (
            f"`pack_step` on right-padded `[{B}, {S}]` batches of the embedded corpus's lengths ({real:,.0f} real "
            f"tokens on average), against a bare `input_ids[attention_mask]` gather (goal <= 3x on CPU); medians "
            f"of {args.rounds} interleaved rounds over {args.batches} batches."
        )
        write_section(__file__, markdown_table(rows, columns=columns, headers=headers), where, title=title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
