"""``sftpack demo``: the whole story on the embedded default, printed as it runs."""

from __future__ import annotations

import argparse

from ._common import positive


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
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..report.demo import DemoDone, Section, run_demo

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
