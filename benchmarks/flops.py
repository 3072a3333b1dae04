"""Matmul FLOPs per token of real decoders: the body against the output head.

The FLOP model lives in the library (:mod:`sftpack.report.flops`, where ``sftpack
demo`` takes its speed bounds from); this script prints its split for the models
``docs/performance.md`` discusses.

    python benchmarks/flops.py [--context 4096] [--supervised 0.38] [--bound 2]

Prints a table (the last column: ``expected_speedup`` of a packed step over a
padded one at that bound); ``docs/performance.md`` quotes it.
"""

from __future__ import annotations

import argparse

from sftpack.report.flops import Decoder, expected_speedup, split

__all__ = ["MODELS", "main"]

#: the models ``docs/performance.md`` discusses, and the benchmark's tiny one
MODELS = (
    Decoder("Qwen2.5-0.5B", 896, 24, 4864, 14, 2, 151_936),
    Decoder("Llama-3-8B", 4096, 32, 14336, 32, 8, 128_256),
    Decoder("bench_train (data vocabulary)", 128, 4, 512, 4, 2, 34_460),
    Decoder("bench_train (tokenizer vocabulary)", 128, 4, 512, 4, 2, 151_646),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096, help="sequence length in tokens (default 4096)")
    p.add_argument("--bound", type=float, default=2.0, help="slots saved by packing, for the last column (default 2)")
    p.add_argument(
        "--supervised",
        type=float,
        default=0.38,
        help="fraction of tokens with a target (default 0.38, the embedded corpus)",
    )
    args = p.parse_args(argv)
    print(f"forward matmul FLOPs per token, causal sequences of {args.context:,} tokens")
    head = (
        f"{'model':36s} {'body GFLOP':>10s} {'(attn)':>7s} {'head/scored':>11s} "
        f"{'head share, all scored':>22s} {f'at {args.supervised:.0%} scored':>15s} "
        f"{f'step at bound {args.bound:g}x':>17s}"
    )
    print(head)
    print("-" * len(head))
    for m in MODELS:
        everything = split(m, args.context, 1.0)
        some = split(m, args.context, args.supervised)
        print(
            f"{m.name:36s} {m.body(args.context) / 1e9:10.3f} {m.attention(args.context) / 1e9:7.3f} "
            f"{m.head() / 1e9:11.3f} {everything['head_share']:22.1%} {some['head_share']:15.1%} "
            f"{expected_speedup(args.bound, some['head'] / some['body']):16.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
