"""``sftpack plan DATA``: how far the slowest data-parallel rank is above the mean, on every
path, before renting the machines.

DATA is a file of lengths (.txt, one a line; .npy), a prepack directory, or
conversations (chat files, folders or saved datasets, tokenized as sftpack prepack does).
Each path is simulated step by step with its own planner and the cost model of
--model, --size or --cost (sftpack.report.balance; docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from ..balance import NAMED_SIZES, CostError, sequence_cost
from ..chat import InputOptions
from ..loop.inputs import load_tokenizer, tokenizer_folder
from ._common import (
    INPUTS_HELP,
    UsageError,
    add_settings,
    has_images,
    positive,
    render_read_stats,
    render_tokenize_stats,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="each path's max/mean rank cost per step, its bound, micro-batches and padding at --dp ranks "
        "(on paper, in seconds)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "data",
        metavar="DATA",
        help=f"lengths (.txt one a line, .npy), a prepack directory, or conversations: {INPUTS_HELP}",
    )
    p.add_argument("--dp", type=positive, required=True, help="data-parallel ranks")
    p.add_argument(
        "--cp",
        type=positive,
        default=1,
        help="context-parallel size: sequences padded to a multiple of 2*CP; > 1 also asks for the dynamic-CP path",
    )
    p.add_argument("--global-batch", type=positive, required=True, help="sequences per step, over all ranks")
    p.add_argument(
        "--max-seq-len",
        type=positive,
        help="the micro-batch budget and row width in tokens (default for a prepack: its row width; "
        "conversations longer are split, as sftpack prepack splits them)",
    )
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--model", metavar="DIR", help="a Hugging Face model folder: the cost from its config.json")
    cost.add_argument(
        "--size",
        choices=list(NAMED_SIZES),
        help="the cost of a dense decoder of this size (training FLOPs: linear work and causal attention)",
    )
    cost.add_argument(
        "--cost",
        choices=["tokens", "attention"],
        help="one-term cost: tokens (the default without --model or --size) or attention (length squared)",
    )
    p.add_argument("--steps", type=positive, default=8, help="steps simulated per path, at most (default 8)")
    p.add_argument(
        "--rows-per-rank",
        type=positive,
        help="offline and loader rows per rank per step (default: the rows a global batch fills, per rank, >= 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="the seeded order the sequences and rows are taken in")
    p.add_argument("--in-order", action="store_true", help="take the sequences in DATA's order (no permutation)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys paths.<path>.max_over_mean, ...)")
    p.add_argument("--png", metavar="FILE", help="draw each path's per-rank load in its worst step (needs matplotlib)")
    conv = p.add_argument_group("conversations", "DATA holding conversations: tokenized as sftpack prepack does")
    conv.add_argument(
        "--tokenizer", metavar="DIR", help="a local tokenizer folder (default: --model's, else the embedded Qwen one)"
    )
    conv.add_argument("--limit", type=positive, help="first N conversations only")
    add_settings(conv, InputOptions, "on_bad_row", "split")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..report.balance import LengthsError, data_kind, draw_plan, format_plan, plan_paths  # start-up: torch

    kind = data_kind(args.data)
    t0 = time.perf_counter()
    said: list[str] = []
    try:
        cost = sequence_cost(args.model or args.size or args.cost)
    except CostError as e:
        raise UsageError(str(e)) from None
    try:
        lengths, max_seq_len = _lengths(args, kind, said)
        report = plan_paths(
            lengths,
            dp=args.dp,
            cp=args.cp,
            global_batch=args.global_batch,
            max_seq_len=max_seq_len,
            cost=cost,
            steps=args.steps,
            rows_per_rank=args.rows_per_rank,
            seed=args.seed,
            shuffle=not args.in_order,
        )
    except LengthsError as e:
        raise UsageError(str(e)) from None
    seconds = time.perf_counter() - t0
    if args.png:
        draw_plan(report, args.png, title=f"{args.data}: cost per rank ({cost.name}), worst step of each path")
    if args.json:
        print(json.dumps({"data": str(args.data), **report.to_dict()}, indent=2))
        return 0
    for line in said:
        print(line)
    lens = np.asarray(lengths)
    print(
        f"{report.sequences:,} sequences, {report.tokens:,} tokens; lengths median {int(np.median(lens)):,}, "
        f"p99 {int(np.percentile(lens, 99)):,}, max {int(lens.max()):,}"
    )
    print(
        f"{report.dp:,} data-parallel ranks x cp {report.cp}, global batch {report.global_batch:,} sequences, "
        f"max_seq_len {report.max_seq_len:,} (pad multiple {report.pad_multiple}), {report.rows_per_rank} row(s) a "
        f"rank a step (offline, loader); cost {cost.name}: {cost.per_token:.4g} per token + "
        f"{cost.per_token_squared:.4g} per token squared"
    )
    print()
    print(format_plan(report))
    print(f"\nplanned in {seconds:.1f} s" + (f"; per-rank load drawn to {args.png}" if args.png else ""))
    return 0


def _lengths(args: argparse.Namespace, kind: str, said: list[str]) -> tuple[Any, int]:
    """DATA's lengths and the row width to plan with; ``said``: lines about the reading."""
    from ..report.balance import conversation_lengths, read_lengths  # start-up: torch

    if kind != "conversations":
        for flag in ("tokenizer", "limit", "split"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} is for conversations; {args.data} holds lengths")
        got = read_lengths(args.data)
        width = args.max_seq_len
        if width is None:
            if kind != "prepack":
                raise UsageError("--max-seq-len is required (the micro-batch budget and row width, in tokens)")
            from ..offline import read_manifest  # start-up: the offline path loads torch

            width = int(read_manifest(args.data)["max_seq_len"])
        got.check(width, args.cp)
        said.append(f"data: {got.source}")
        return got.values, width
    if args.max_seq_len is None:
        raise UsageError("--max-seq-len is required (the micro-batch budget and row width; longer conversations split)")
    if has_images([args.data], split=args.split):
        raise UsageError(f"{args.data} holds conversations with images: sftpack plan reads text conversations")
    tok = load_tokenizer(tokenizer_folder(args.model, args.tokenizer))
    t = time.perf_counter()
    lengths, read_stats, tok_stats = conversation_lengths(
        args.data,
        tok,
        max_seq_len=args.max_seq_len,
        on_bad_row=args.on_bad_row,
        split=args.split,
        limit=args.limit,
        progress=not args.json,
    )
    said += [f"data: {args.data}", render_read_stats(read_stats)]
    said.append(render_tokenize_stats(tok_stats, len(lengths), time.perf_counter() - t))
    return lengths, args.max_seq_len
