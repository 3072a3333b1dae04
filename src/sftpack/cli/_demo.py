"""``sftpack demo``: the whole story on the embedded default, printed as it runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .._publish import Publish
from ..data import default_corpus
from ._common import UsageError, positive


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo",
        help="the main job on the embedded default: the three paths, exactness, training vs padded batches, "
        "and conversations with images",
    )
    d.add_argument(
        "--quick",
        action="store_true",
        help="a smaller, faster run (the first 400 conversations)",
    )
    d.add_argument(
        "--corpus",
        choices=["chat", "vqa"],
        help="chat: only the text story (chitchat conversations); vqa: only the multimodal section "
        "(easy-vqa conversations with images on a tiny Qwen2-VL); default: both",
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--max-seq-len",
        type=positive,
        default=4096,
        help="row width in tokens (default 4096)",
    )
    d.add_argument(
        "--num-proc",
        type=positive,
        default=1,
        help="tokenizer worker processes (default 1)",
    )
    d.add_argument(
        "--report",
        metavar="DIR",
        help="also write a PNG report (rows, fill, loss curves, tokens/s)",
    )
    d.add_argument(
        "--write-data",
        metavar="FILE.jsonl",
        help="write the embedded chitchat conversations (the first 400 with --quick) to FILE.jsonl, one OpenAI "
        '{"messages": [...]} object a line, and stop: a chat file to try prepack, bench, train and verify on '
        "before your own (a FILE that holds other data is refused)",
    )
    d.set_defaults(func=run)


def write_data(path: str, *, quick: bool) -> str:
    """The embedded chitchat conversations (400 with ``quick``) written to ``path`` as OpenAI-messages
    JSONL (atomically); the line that says so. Writing the same file again is a no-op; a file of
    other bytes is refused (a usage error), so a user's own data is never replaced."""

    data = "".join(
        json.dumps({"messages": c.messages}, ensure_ascii=False) + "\n"
        for c in default_corpus(limit=400 if quick else None)
    ).encode("utf-8")
    dest, n = Path(path), data.count(b"\n")
    if dest.exists():
        if dest.is_file() and dest.stat().st_size == len(data) and dest.read_bytes() == data:
            return f"{dest} already holds the {n:,} embedded chitchat conversations"
        raise UsageError(
            f"--write-data {dest}: the path exists and holds other data; remove it or give another FILE.jsonl"
        )
    with Publish(dest, folder=False) as tmp:
        tmp.write_bytes(data)
    return f"wrote {n:,} chitchat conversations to {dest} (OpenAI messages JSONL, {len(data) / 1e6:.1f} MB)"


def run(args: argparse.Namespace) -> int:
    if args.write_data is not None:
        if args.corpus == "vqa" or args.report is not None:
            raise UsageError("--write-data writes the chat conversations and stops: drop --corpus vqa and --report")
        print(write_data(args.write_data, quick=args.quick))
        return 0
    from ..report.demo import DemoDone, Section, run_demo  # loads torch: after --write-data, which needs none

    for item in run_demo(
        quick=args.quick,
        seed=args.seed,
        max_seq_len=args.max_seq_len,
        num_proc=args.num_proc,
        report_dir=args.report,
        corpus=args.corpus,
    ):
        if isinstance(item, Section):
            print(f"\n== {item.title} " + "=" * max(0, 72 - len(item.title)), flush=True)
        elif isinstance(item, DemoDone):
            return 0 if item.ok else 1
        else:
            print(item, flush=True)
    return 1
