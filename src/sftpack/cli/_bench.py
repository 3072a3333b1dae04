"""``sftpack bench``: what packing saves on your conversations, per algorithm.

Conversations with images (PATHS whose conversations hold image parts, found in
their first records, or ``--corpus vqa``: the embedded easy-vqa corpus) are
benched as such: each packer's rows and fill for text + vision tokens, without
and with a vision-patch budget per row."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np

from ..chat import DEFAULT_MAX_SEQ_LEN, OVERLONG_HELP, InputOptions, read_conversations
from ..data import default_corpus
from ..loop.inputs import load_tokenizer, tokenizer_folder, vlm_setup
from ..report.savings import bench_lengths, bench_media, format_layouts, format_media_layouts
from ._common import (
    INPUTS_HELP,
    UsageError,
    add_family,
    add_settings,
    has_images,
    positive,
    render_read_stats,
    render_tokenize_stats,
)

if TYPE_CHECKING:
    from ..chat import Conversation


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench",
        help="how much packing saves on your conversations (or the embedded corpus): rows and padding per algorithm",
    )
    b.add_argument(
        "paths",
        nargs="*",
        help=f"{INPUTS_HELP} (default: embedded corpus); conversations with image parts are benched as such (image "
        "paths relative to each file)",
    )
    b.add_argument(
        "--corpus",
        choices=["chat", "vqa"],
        default="chat",
        help="the embedded data without PATHS: chat conversations (default) or easy-vqa conversations with "
        "images, packed under a token and a vision-patch budget",
    )
    b.add_argument(
        "--max-patches-per-row",
        "--max-patches",
        dest="max_patches_per_row",
        type=positive,
        help="data with images: vision patches per row for the patch budget (default 2 x --max-seq-len)",
    )
    b.add_argument(
        "--max-seq-len",
        type=positive,
        default=DEFAULT_MAX_SEQ_LEN,
        help=f"row width in tokens (default {DEFAULT_MAX_SEQ_LEN})",
    )
    b.add_argument("--pad-multiple", type=positive, default=1, help="pad each sequence to a multiple of this (2*CP)")
    b.add_argument(
        "--overlong",
        default="split",
        choices=["truncate", "drop", "split", "error"],
        help=OVERLONG_HELP.format(default="split"),
    )
    add_settings(b, InputOptions, "on_bad_row", "split", "chat_template", "allow_outside_images")
    b.add_argument("--tokenizer", metavar="DIR", help="a local Hugging Face tokenizer folder (default: embedded Qwen)")
    b.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face model folder: its tokenizer; with images its family (config.model_type), "
        "tokenizer and image processor",
    )
    add_family(b)
    b.add_argument("--limit", type=positive, help="first N conversations only")
    b.add_argument("--num-proc", type=positive, default=1, help="tokenizer worker processes (text data)")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=run)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The packing settings the flags give, the same for text and for data with images."""
    return {name: getattr(args, name) for name in ("max_seq_len", "pad_multiple", "overlong", "on_bad_row", "seed")}


def run(args: argparse.Namespace) -> int:
    if args.max_seq_len % args.pad_multiple:
        raise UsageError(
            f"--max-seq-len {args.max_seq_len} is not a multiple of --pad-multiple {args.pad_multiple} "
            f"(use {args.max_seq_len // args.pad_multiple * args.pad_multiple})"
        )
    if args.split is not None and not args.paths:
        raise UsageError("--split picks the split of a saved DatasetDict among the PATHS: give PATHS")
    if args.corpus == "vqa" or (args.paths and has_images(args.paths, split=args.split)):
        return _run_images(args)
    if args.max_patches_per_row is not None:
        raise UsageError(
            "--max-patches-per-row is the vision-patch budget of --corpus vqa or data with image parts; text rows "
            "have no patches"
        )
    if args.family is not None:
        raise UsageError(
            f"--family {args.family} names the model of data with images: these inputs have no image parts"
        )
    tok = load_tokenizer(tokenizer_folder(args.model, args.tokenizer), args.chat_template)
    conversations: Iterable[Conversation]
    if args.paths:
        reader = read_conversations(
            args.paths, on_bad_row=args.on_bad_row, split=args.split, allow_outside_images=args.allow_outside_images
        )
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
        **_settings(args),
        num_proc=args.num_proc,
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


def _run_images(args: argparse.Namespace) -> int:
    """Conversations with images: PATHS (read by :func:`sftpack.chat.read_conversations`) or easy-vqa."""

    from ..multimodal import vqa_corpus  # start-up: multimodal loads torch; only --images needs it

    what = "--corpus vqa" if args.corpus == "vqa" else "data with images"
    if args.tokenizer is not None:
        raise UsageError(
            f"--tokenizer: not offered with {what}, which is tokenized with the family's tokenizer and image "
            "processor (a --model folder's, else Qwen2-VL's, embedded); drop --tokenizer"
        )
    if args.chat_template is not None:
        raise UsageError(f"--chat-template: {what} is rendered with the model family's own template; drop it")
    if args.overlong == "truncate":
        raise UsageError(
            f"--overlong truncate: not offered with {what} (sftpack never cuts inside an image): use --overlong "
            "split (cut at text boundaries), drop or error"
        )
    if args.num_proc != 1:
        raise UsageError(f"--num-proc: not offered with {what} (tokenized and its images processed in this process)")
    # a folder of an unsupported model type: one line, before any work; loaded once, used by bench_media
    family, tok, processor = vlm_setup(args.model, None, args.family)
    max_patches = args.max_patches_per_row if args.max_patches_per_row is not None else 2 * args.max_seq_len
    read_stats = None
    conversations: Iterable[Any]
    if args.paths:
        reader = read_conversations(
            args.paths, on_bad_row=args.on_bad_row, split=args.split, allow_outside_images=args.allow_outside_images
        )
        conversations, read_stats = reader, reader.stats
        source = ", ".join(args.paths)
    else:
        conversations = vqa_corpus(seed=args.seed)
        source = f"the embedded easy-vqa corpus (seed {args.seed}: image sizes 56-448 px a side)"
    if args.limit is not None:
        conversations = islice(conversations, args.limit)
    print(f"source: {source}", flush=True)
    r = bench_media(
        conversations,
        source=source,
        **_settings(args),
        max_patches_per_row=max_patches,
        progress=True,
        family=family,
        tokenizer=tok,
        processor=processor,
    )
    if read_stats is not None:
        lines = render_read_stats(read_stats).split("\n")
        lines[0] += f"; {read_stats.images:,} image parts"
        print("\n".join(lines))
    st = r.stats
    dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(st.dropped.items())) or "none"
    print(
        f"  {st.read:,} conversations -> {st.samples:,} samples with {st.images:,} images "
        f"(dropped: {dropped}); tokenized and images processed in {r.seconds:.1f} s"
    )
    if not len(r.lengths):
        print("  nothing to pack")
        return 1
    print(
        f"  {int(r.lengths.sum()):,} tokens, of which {int(r.vision_tokens.sum()):,} vision; "
        f"{int(r.patches.sum()):,} vision patches; lengths median {int(np.median(r.lengths))}, "
        f"max {int(r.lengths.max())}; patches per sample median {int(np.median(r.patches))}, "
        f"max {int(r.patches.max())}"
    )
    print(
        f"\nrows of {args.max_seq_len} tokens, each sample padded to a multiple of {args.pad_multiple}; "
        f"patch budget {max_patches:,} vision patches per row (the vision tower's load):"
    )
    print(format_media_layouts(r.layouts, args.max_seq_len))
    print(
        "  fill = real tokens (text + vision placeholders) / row slots; a row over the patch budget is one "
        "the vision tower would have to take whole"
    )
    return 0
