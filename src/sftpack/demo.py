"""``sftpack demo``: the main job on the embedded default.

For now: the worked example at the three packing moments, and the measured
exactness of packed training against one-conversation-at-a-time training.
"""

from __future__ import annotations

import argparse
import time

__all__ = ["run_demo"]


def run_demo(args: argparse.Namespace) -> int:
    from .exactness import exactness_table
    from .layout import render_map

    print(render_map())
    print()
    trials = 2 if args.quick else 5
    print(f"Exactness: packed vs. one conversation at a time ({trials} random rows per line, fp32)")
    t0 = time.perf_counter()
    rows = exactness_table(trials=trials, seed=args.seed)
    print(f"  {'consumer':28} {'boundaries':22} {'pad':>4} {'max|dlogit|':>12} {'|dloss|':>10} {'max|dgrad|':>11}")
    worst = 0.0
    for r in rows:
        worst = max(worst, r["logits"], r["loss"], r["grads"])
        print(
            f"  {r['consumer']:28} {r['mode']:22} {r['pad_multiple']:>4} {r['logits']:12.2e} "
            f"{r['loss']:10.2e} {r['grads']:11.2e}"
        )
    ok = worst <= 1e-5
    print(f"  worst difference {worst:.2e}: {'exact (<= 1e-5)' if ok else 'NOT EXACT'}  [{time.perf_counter() - t0:.1f} s]")
    return 0 if ok else 1
