"""Multimodal packing on the easy-vqa corpus: fill per packer, image cost vs text cost, training speed.

The corpus is :func:`sftpack.multimodal.vqa_corpus` (``--conversations``, seeded image
sizes 56-448 px a side), tokenized with the embedded Qwen2-VL tokenizer and Qwen2-VL's
image processor (placeholders expanded: a sample's length counts its vision tokens).

(a) **Fill and rows** at ``--max-seq-len`` per packer: every :func:`sftpack.binpack.pack`
    algorithm on the total lengths (vision placeholders included), without and with the
    second budget (``weights=`` the samples' vision patches, ``max_weight_per_bin=``
    ``--max-patches``; :func:`sftpack.multimodal.plan_rows` is the ``ffd`` line), each
    sample's cost rounded up to ``--pad-multiple``. Fill = real tokens (text + vision) /
    row tokens; the patch columns say how much the vision tower gets per row, which the
    patch budget caps; the pack time is one call (a single run, not a ratio).
(b) **Image cost vs text cost**: per round, every conversation's images decoded (PIL,
    from the PNG files), resized to their seeded size, turned into Qwen2-VL patches (the
    PIL/numpy processor), and its ChatML text tokenized; the four stages alternate
    conversation by conversation (one interleaved run). Medians over ``--rounds`` of the
    per-image and per-conversation costs, and each stage's ratio to tokenizing.
(c) **Training real tokens/s, packed vs padded** on a tiny Qwen2-VL (``Family.tiny_model``,
    float32, CPU, its vocabulary renumbered to the ids the corpus uses so that the output
    head is not the whole cost): the same ``--batch`` samples per step either packed in
    one row (sftpack's varlen attention, boundaries from ``cu_seqlens``, the vision tower
    over ``media.vision_cu_seqlens``) or padded to the longest in a ``[B, S]`` batch (Hugging
    Face's own path: ``sdpa`` with an attention mask, the model runs its vision tower and
    computes its MRoPE positions); forward + backward + SGD step; A and B alternate
    every step, medians over ``--train-steps`` steps.
(d) **Packing time at scale**: ``--pack-items`` samples resampled from the corpus's
    (length, patches) pairs, each packer without and with the patch budget (alternating,
    best of ``--rounds``).

Usage::

    python benchmarks/bench_media.py                 # all four, writes RESULTS.md
    python benchmarks/bench_media.py --conversations 60 --rounds 2 --train-steps 2 --pack-items 10000 --no-results
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import numpy as np

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section


def machine() -> str:
    import torch
    import transformers

    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}; "
        f"load average {load_average():.1f} at start"
    )


# ------------------------------------------------------------------------- (a)
def fill_table(samples: list, max_seq_len: int, max_patches: int, pad_multiple: int) -> list[dict[str, Any]]:
    from sftpack.report.savings import compare_media_layouts

    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    patches = np.array([s.num_patches for s in samples], dtype=np.int64)
    vision = np.array([0 if s.media is None else s.media.num_placeholders for s in samples], dtype=np.int64)
    rows = compare_media_layouts(
        lengths, patches, vision, max_seq_len, max_patches_per_row=max_patches, cost_multiple=pad_multiple
    )
    return [
        {
            "packer": r.layout if r.layout != "one per row" else "none (one sample per row)",
            "budget": "-" if r.patch_budget is None else f"{r.patch_budget:,}",
            "rows": r.rows,
            "fill": r.fill,
            "vision": r.vision,
            "p_mean": r.patches_mean,
            "p_max": r.patches_max,
            "over": r.over_budget,
            "ms": float("nan") if r.seconds is None else r.seconds * 1e3,
        }
        for r in rows
    ]


FILL_COLUMNS = [
    ("packer", "packer", "{}"),
    ("budget", "patch budget", "{}"),
    ("rows", "rows", "{:,}"),
    ("fill", "fill (text+vision)", "{:.3f}"),
    ("vision", "of which vision", "{:.3f}"),
    ("p_mean", "patches/row mean", "{:,.0f}"),
    ("p_max", "patches/row max", "{:,}"),
    ("over", "rows over the patch budget", "{:,}"),
    ("ms", "pack time (ms)", "{:.2f}"),
]


# ------------------------------------------------------------------------- (b)
def stage_costs(convs: list[dict], tok: Any, proc: Any, rounds: int) -> list[dict[str, Any]]:
    from PIL import Image

    from bench_media_read import _chatml
    from sftpack.multimodal import family_for
    from sftpack.multimodal._images import process_images

    block = "".join(family_for().image_block)
    rendered = [_chatml(c["messages"], tok, block) for c in convs]
    n_img = sum(len(parts) for _, parts in rendered)
    per_round: dict[str, list[float]] = {k: [] for k in ("decode", "resize", "patch", "tokenize")}
    loads = []
    for _ in range(rounds):
        tot = dict.fromkeys(per_round, 0.0)
        for text, parts in rendered:
            t0 = time.perf_counter()
            imgs = []
            for part in parts:
                with Image.open(part["path"]) as im:
                    imgs.append(im.convert("RGB"))
            t1 = time.perf_counter()
            imgs = [im.resize(tuple(p["resize"]), Image.Resampling.BICUBIC) for im, p in zip(imgs, parts)]
            t2 = time.perf_counter()
            process_images(imgs, proc)
            t3 = time.perf_counter()
            tok(text, add_special_tokens=False, return_offsets_mapping=True)
            t4 = time.perf_counter()
            tot["decode"] += t1 - t0
            tot["resize"] += t2 - t1
            tot["patch"] += t3 - t2
            tot["tokenize"] += t4 - t3
        for k, v in tot.items():
            per_round[k].append(v)
        loads.append(load_average())
    med = {k: statistics.median(v) for k, v in per_round.items()}
    rows = []
    for k in ("decode", "resize", "patch", "tokenize"):
        rows.append(
            {
                "stage": {
                    "decode": "decode PNG (PIL, RGB)",
                    "resize": "resize to the seeded size",
                    "patch": "Qwen2-VL patches (processor)",
                    "tokenize": "tokenize the ChatML text",
                }[k],
                "per_image_us": med[k] / n_img * 1e6 if k != "tokenize" else float("nan"),
                "per_conv_us": med[k] / len(convs) * 1e6,
                "vs_tok": med[k] / med["tokenize"],
                "load": statistics.median(loads),
            }
        )
    img = med["decode"] + med["resize"] + med["patch"]
    rows.append(
        {
            "stage": "all image work",
            "per_image_us": img / n_img * 1e6,
            "per_conv_us": img / len(convs) * 1e6,
            "vs_tok": img / med["tokenize"],
            "load": statistics.median(loads),
        }
    )
    return rows


COST_COLUMNS = [
    ("stage", "stage", "{}"),
    ("per_image_us", "per image (us)", "{:,.0f}"),
    ("per_conv_us", "per conversation (us)", "{:,.0f}"),
    ("vs_tok", "x tokenizing", "{:.2f}"),
    ("load", "load", "{:.1f}"),
]


# ------------------------------------------------------------------------- (c)
def train_speed(samples: list, batch: int, steps: int, threads: int) -> list[dict[str, Any]]:
    import torch

    from sftpack.report.demo import _Compact, step_times

    torch.set_num_threads(threads)
    c = _Compact(samples)  # the samples over the ids they use, and the tiny Qwen2-VL for them
    items, ids = c.samples, dict(c.ids)
    pad = ids.pop("pad_id")
    sizes = dict(dim=64, heads=4, kv_heads=2, vision_dim=64)
    packed_model = c.model(dtype=torch.float32, seed=0, **sizes)
    padded_model = c.model(dtype=torch.float32, seed=0, **sizes, text_attention="sdpa")
    padded_model.load_state_dict(packed_model.state_dict())
    groups = [items[i : i + batch] for i in range(0, batch * steps, batch)]
    t_a, t_b = step_times(
        packed_model, padded_model, groups[0], groups, pad_id=pad, image_token_id=ids["image_token_id"]
    )
    real = [sum(len(s) for s in g) for g in groups]
    slots_b = [len(g) * max(len(s) for s in g) for g in groups]
    loads = [load_average()]
    tok_a = [r / t for r, t in zip(real, t_a)]
    tok_b = [r / t for r, t in zip(real, t_b)]
    return [
        {
            "mode": "packed (one row, varlen)",
            "real_tok_s": statistics.median(tok_a),
            "step_ms": statistics.median(t_a) * 1e3,
            "slots": statistics.median(real),
            "speedup": statistics.median([a / b for a, b in zip(tok_a, tok_b)]),
            "load": statistics.median(loads),
        },
        {
            "mode": "padded [B, S] (HF sdpa + mask)",
            "real_tok_s": statistics.median(tok_b),
            "step_ms": statistics.median(t_b) * 1e3,
            "slots": statistics.median(slots_b),
            "speedup": 1.0,
            "load": statistics.median(loads),
        },
    ]


TRAIN_COLUMNS = [
    ("mode", "mode", "{}"),
    ("real_tok_s", "real tokens/s", "{:,.0f}"),
    ("step_ms", "step (ms)", "{:,.1f}"),
    ("slots", "token slots per step", "{:,.0f}"),
    ("speedup", "real tokens/s vs padded (median of per-step ratios)", "{:.2f}"),
    ("load", "load", "{:.1f}"),
]


# ------------------------------------------------------------------------- (d)
def pack_time(samples: list, n: int, max_seq_len: int, max_patches: int, rounds: int, seed: int) -> list[dict]:
    """Packing time at scale: ``n`` samples drawn (seeded, with replacement) from the corpus's
    (length, patches) pairs; each packer without and with the patch budget, alternating,
    best of ``rounds``."""
    from sftpack.binpack import Algorithm, pack

    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(samples), size=n)
    lengths = np.array([len(s) for s in samples], dtype=np.int64)[pick]
    patches = np.array([s.num_patches for s in samples], dtype=np.int64)[pick]
    out = []
    for algo in Algorithm:
        pack(lengths[:100], max_seq_len, algo)  # compile (or load from numba's cache) first
        pack(lengths[:100], max_seq_len, algo, weights=patches[:100], max_weight_per_bin=max_patches)
        one, two, loads = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            rows_one = len(pack(lengths, max_seq_len, algo))
            one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rows_two = len(pack(lengths, max_seq_len, algo, weights=patches, max_weight_per_bin=max_patches))
            two.append(time.perf_counter() - t0)
            loads.append(load_average())
        out.append(
            {
                "packer": algo.value,
                "one_s": min(one),
                "rows_one": rows_one,
                "two_s": min(two),
                "rows_two": rows_two,
                "ratio": min(two) / min(one),
                "load": statistics.median(loads),
            }
        )
    return out


TIME_COLUMNS = [
    ("packer", "packer", "{}"),
    ("one_s", "tokens only (s)", "{:.3f}"),
    ("rows_one", "rows", "{:,}"),
    ("two_s", "+ patch budget (s)", "{:.3f}"),
    ("rows_two", "rows", "{:,}"),
    ("ratio", "x tokens only", "{:.1f}"),
    ("load", "load", "{:.1f}"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--max-patches", type=int, default=2048, help="the vision-patch budget per row")
    ap.add_argument("--pad-multiple", type=int, default=1, help="each sample's cost rounded up to this in (a)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (b)")
    ap.add_argument("--batch", type=int, default=8, help="samples per training step in (c)")
    ap.add_argument("--train-steps", type=int, default=6, help="timed steps per mode in (c); 0 skips (c)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in (c)")
    ap.add_argument("--pack-items", type=int, default=1_000_000, help="samples packed in (d); 0 skips (d)")
    add_flag(ap)
    args = ap.parse_args()

    from sftpack.multimodal import family_for, tokenize_media_conversations, vqa_corpus

    where = machine()
    print(f"machine: {where}")
    family = family_for()
    tok, proc = family.tokenizer(), family.image_processor()
    convs = list(vqa_corpus(seed=args.seed, limit=args.conversations))
    samples = list(tokenize_media_conversations(convs, tokenizer=tok, processor=proc))
    n_img = sum(s.media.num_items for s in samples if s.media is not None)
    lens = np.array([len(s) for s in samples])
    corpus = (
        f"{len(convs)} easy-vqa conversations (seed {args.seed}), {len(samples)} samples, {n_img} images; "
        f"sample length median {int(np.median(lens))}, max {int(lens.max())} tokens (vision included)"
    )
    print(corpus)

    fill = fill_table(samples, args.max_seq_len, args.max_patches, args.pad_multiple)
    t_fill = formatted_table(fill, FILL_COLUMNS)
    cost = -(-lens // args.pad_multiple) * args.pad_multiple
    l1_tokens = -(-int(cost.sum()) // args.max_seq_len)
    l1_both = max(l1_tokens, -(-sum(s.num_patches for s in samples) // args.max_patches))
    bounds = (
        f"Lower bounds on rows (L1): {l1_tokens} on tokens alone, {l1_both} under both budgets "
        f"(ceil of the patches over the budget)."
    )
    print(f"\n(a) rows of {args.max_seq_len} tokens\n{t_fill}\n{bounds}")
    costs = stage_costs(convs, tok, proc, args.rounds)
    t_cost = formatted_table(costs, COST_COLUMNS)
    print(f"\n(b) image work vs tokenizing, medians over {args.rounds} rounds\n{t_cost}")
    t_train = ""
    if args.train_steps > 0:
        train = train_speed(samples, args.batch, args.train_steps, args.threads)
        t_train = formatted_table(train, TRAIN_COLUMNS)
        print(f"\n(c) training, {args.batch} samples per step, {args.train_steps} steps each, interleaved\n{t_train}")

    t_time = ""
    if args.pack_items > 0:
        times = pack_time(samples, args.pack_items, args.max_seq_len, args.max_patches, args.rounds, args.seed)
        t_time = formatted_table(times, TIME_COLUMNS)
        print(f"\n(d) packing {args.pack_items:,} samples, best of {args.rounds} alternating rounds\n{t_time}")

    if not args.no_results:
        body = (
            f"{corpus}.\n\n"
            f"(a) Fill and rows at {args.max_seq_len} tokens per row (each sample padded to a multiple of "
            f"{args.pad_multiple}), per packer, without and with a budget of {args.max_patches:,} vision patches "
            "per row (sftpack.binpack's second budget; multimodal.plan_rows is ffd); the patch columns are "
            "the vision tower's load per row.\n\n"
            f"{t_fill}\n\n{bounds}\n\n"
            f"(b) Image work against tokenizing the text (stages alternate per conversation; medians over "
            f"{args.rounds} rounds).\n\n{t_cost}\n"
        )
        if t_train:
            body += (
                f"\n(c) Training a tiny Qwen2-VL (float32, CPU, {args.threads} thread(s)), {args.batch} samples "
                f"per step, packed vs padded alternating every step, medians over {args.train_steps} steps.\n\n"
                f"{t_train}\n"
            )
        if t_time:
            body += (
                f"\n(d) Packing time at scale: {args.pack_items:,} samples drawn (seeded, with replacement) from the "
                f"corpus's (length, patches) pairs, rows of {args.max_seq_len} tokens and {args.max_patches:,} "
                f"patches; each packer without and with the patch budget, alternating, best of {args.rounds} rounds. "
                "The one-budget packers run on the length histogram; under two budgets equal lengths are no longer "
                "interchangeable and every packer goes item by item.\n\n"
                f"{t_time}\n"
            )
        write_section(__file__, body, where, title="bench_media.py: multimodal packing on easy-vqa")


if __name__ == "__main__":
    main()
