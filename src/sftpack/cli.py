"""The ``sftpack`` command line.

    sftpack map [--png FILE]   the contract's worked example at the three packing moments
    sftpack demo               the main job on the embedded default
    sftpack bench [PATHS]      what packing saves on your conversations, per algorithm
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _cmd_map(args: argparse.Namespace) -> int:
    from .layout import render_map, save_map_png, worked_example

    rows = worked_example()
    print(render_map(rows))
    if args.png:
        print(f"\nwrote {save_map_png(args.png, rows)}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .report import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sftpack",
        description="Pack SFT conversations into flat rows for variable-length (THD) attention.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    m = sub.add_parser("map", help="print the worked example (two conversations) at the three packing moments")
    m.add_argument("--png", metavar="FILE", help="also draw it as a PNG (needs matplotlib)")
    m.set_defaults(func=_cmd_map)
    d = sub.add_parser("demo", help="the main job on the embedded default corpus and tokenizer")
    d.add_argument("--quick", action="store_true", help="a smaller, faster run")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-seq-len", type=int, default=4096, help="row width in tokens (default 4096)")
    d.add_argument("--num-proc", type=int, default=1, help="tokenizer worker processes (default 1)")
    d.set_defaults(func=_cmd_demo)
    b = sub.add_parser(
        "bench",
        help="how much packing saves on your conversations (or the embedded corpus): rows and padding per algorithm",
    )
    b.add_argument("paths", nargs="*", help="JSONL / Parquet files, globs or dataset folders (default: embedded corpus)")
    b.add_argument("--max-seq-len", type=int, default=4096, help="row width in tokens (default 4096)")
    b.add_argument("--pad-multiple", type=int, default=1, help="pad each sequence to a multiple of this (2*CP)")
    b.add_argument("--overlong", default="split", choices=["truncate", "drop", "split", "error"])
    b.add_argument("--on-bad-row", default="skip", choices=["error", "skip"])
    b.add_argument("--tokenizer", metavar="DIR", help="a local Hugging Face tokenizer folder (default: embedded Qwen)")
    b.add_argument("--limit", type=int, help="first N conversations only")
    b.add_argument("--num-proc", type=int, default=1, help="tokenizer worker processes")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
