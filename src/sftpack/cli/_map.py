"""``sftpack map``: the contract's worked example at the three packing moments."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("map", help="print the worked example (two conversations) at the three packing moments")
    m.add_argument("--png", metavar="FILE", help="also draw it as a PNG (needs matplotlib)")
    m.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..report.layout import render_map, save_map_png, worked_example  # start-up: the drawing loads torch

    rows = worked_example()
    print(render_map(rows))
    if args.png:
        print(f"\nwrote {save_map_png(args.png, rows)}")
    return 0
