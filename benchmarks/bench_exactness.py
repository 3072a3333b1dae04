"""Measured exactness of packing: worst |packed - unpacked| per consumer and mode.

Runs seeded random rows (1-8 conversations of 1-64 tokens, fp32) through a plain
PyTorch model fed Megatron PackedSeqParams (both boundary modes) and a real
Hugging Face LlamaForCausalLM fed ``to_hf_kwargs()`` (sdpa, eager and sftpack's
varlen attention), and prints the largest logit, loss and gradient differences
against running each conversation alone.

    python benchmarks/bench_exactness.py [--trials 20]
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import time

import torch

from _machine import cpu_model
from _results import add_flag, markdown_table, write_section
from sftpack.exactness import exactness_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default="benchmarks/out/exactness.csv")
    add_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}, fp32"
    )
    print(f"machine: {machine}")
    t0 = time.perf_counter()
    rows = exactness_table(trials=args.trials, seed=args.seed)
    print(f"{'consumer':28} {'boundaries':22} {'pad':>4} {'max|dlogit|':>12} {'|dloss|':>10} {'max|dgrad|':>11}")
    for r in rows:
        print(
            f"{r['consumer']:28} {r['mode']:22} {r['pad_multiple']:>4} {r['logits']:12.2e} "
            f"{r['loss']:10.2e} {r['grads']:11.2e}"
        )
    print(f"({args.trials} random rows per line, {time.perf_counter() - t0:.1f} s)")
    os.makedirs(os.path.dirname(args.csv), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if not args.no_results:
        table = markdown_table(
            [
                {**r, "logits": f"{r['logits']:.1e}", "loss": f"{r['loss']:.1e}", "grads": f"{r['grads']:.1e}"}
                for r in rows
            ],
            columns=["consumer", "mode", "pad_multiple", "logits", "loss", "grads"],
            headers=["consumer", "boundaries", "pad multiple", "max \\|Δ logit\\|", "\\|Δ loss\\|", "max \\|Δ grad\\|"],
        )
        title = (
            f"The worst difference between the packed run and running each conversation alone, "
            f"{args.trials} seeded random rows of 1-8 conversations of 1-64 tokens per line (seed {args.seed})."
        )
        write_section(__file__, table, machine, title=title)


if __name__ == "__main__":
    main()
