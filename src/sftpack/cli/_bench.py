"""``sftpack bench``: what packing saves on your conversations, per algorithm."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._common import UsageError, load_tokenizer, positive, render_read_stats, render_tokenize_stats

if TYPE_CHECKING:
    from ..chat import Conversation


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench",
        help="how much packing saves on your conversations (or the embedded corpus): rows and padding per algorithm",
    )
    b.add_argument(
        "paths", nargs="*", help="JSONL / Parquet files, globs or dataset folders (default: embedded corpus)"
    )
    b.add_argument("--max-seq-len", type=positive, default=4096, help="row width in tokens (default 4096)")
    b.add_argument("--pad-multiple", type=positive, default=1, help="pad each sequence to a multiple of this (2*CP)")
    b.add_argument("--overlong", default="split", choices=["truncate", "drop", "split", "error"])
    b.add_argument("--on-bad-row", default="skip", choices=["error", "skip"])
    b.add_argument("--tokenizer", metavar="DIR", help="a local Hugging Face tokenizer folder (default: embedded Qwen)")
    b.add_argument("--limit", type=positive, help="first N conversations only")
    b.add_argument("--num-proc", type=positive, default=1, help="tokenizer worker processes")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from itertools import islice

    import numpy as np

    from ..chat import read_conversations
    from ..data import default_corpus
    from ..report.savings import bench_lengths, format_layouts

    if args.max_seq_len % args.pad_multiple:
        raise UsageError(
            f"--max-seq-len {args.max_seq_len} is not a multiple of --pad-multiple {args.pad_multiple} "
            f"(use {args.max_seq_len // args.pad_multiple * args.pad_multiple})"
        )
    tok = load_tokenizer(args.tokenizer)
    conversations: Iterable[Conversation]
    if args.paths:
        reader = read_conversations(args.paths, on_bad_row=args.on_bad_row)
        conversations = reader
        source, read_stats = ", ".join(args.paths), reader.stats
    else:
        conversations, source, read_stats = default_corpus(), "the embedded chitchat corpus", None
    if args.limit is not None:
        conversations = islice(conversations, args.limit)
    r = bench_lengths(
        conversations,
        tok,
        source=source,
        read_stats=read_stats,
        max_seq_len=args.max_seq_len,
        pad_multiple=args.pad_multiple,
        overlong=args.overlong,
        on_bad_row=args.on_bad_row,
        num_proc=args.num_proc,
        seed=args.seed,
        progress=True,
    )
    st = r.tokenize_stats
    print(f"source: {r.source}")
    if r.read_stats is not None:
        print(render_read_stats(r.read_stats))
    print(render_tokenize_stats(st, len(r.lengths), r.seconds))
    if not len(r.lengths):
        print("  nothing to pack")
        return 1
    lengths = r.lengths
    print(
        f"  {int(lengths.sum()):,} tokens; lengths median {int(np.median(lengths))}, "
        f"p90 {int(np.percentile(lengths, 90))}, max {int(lengths.max())}"
    )
    print(f"\nrows of {args.max_seq_len} tokens, each sequence padded to a multiple of {args.pad_multiple}:")
    print(format_layouts(r.layouts, r.bounds))
    return 0
