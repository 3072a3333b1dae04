"""Exactness of packing on the hybrid families, with and without sftpack.hybrid: the table of
family x path x boundary mode (logits, loss, gradients, and the negative control).

Each family is a tiny user's folder written by ``save_pretrained`` from a config
(:func:`sftpack.testing.save_hybrid_folder`: one layer that carries state, one attention
layer). :func:`sftpack.report.verify.verify` runs every path (trainer, loader, offline) in both
boundary modes in float64 against each sample alone, the tolerances derived from the model's
shape (float32's where the family's own PyTorch code rounds to float32); then the same with the
state crossing every boundary (:func:`sftpack.hybrid.leaking`, the negative control: what
Hugging Face's classes do on a packed row without sftpack). Short chats of the test suite's
kind; CPU, float64.

    python benchmarks/bench_hybrid_exactness.py [--limit 4] [--families nemotron_h lfm2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import tempfile
import time

import torch

import sftpack.loop
from _machine import cpu_model
from _results import add_flag, markdown_table, write_section
from sftpack.hybrid import covered_layers, leaking, rounding_dtype
from sftpack.report.verify import verify
from sftpack.testing import HYBRID_FAMILIES, save_hybrid_folder

CHATS = [
    {
        "messages": [
            {"role": "user", "content": "word " * (3 + 5 * i)},
            {"role": "assistant", "content": "reply " * (2 + 3 * i)},
        ]
    }
    for i in range(8)
]


@contextlib.contextmanager
def _loaded_leaking():
    """Every model ``sftpack.loop.load_model`` opens has its state crossing the boundaries."""
    real = sftpack.loop.load_model
    with contextlib.ExitStack() as stack:

        def leaky(*args, **kwargs):
            model = real(*args, **kwargs)
            stack.enter_context(leaking(model))
            return model

        sftpack.loop.load_model = leaky
        try:
            yield
        finally:
            sftpack.loop.load_model = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=4, help="conversations per check")
    ap.add_argument("--max-seq-len", type=int, default=64)
    ap.add_argument("--families", nargs="+", default=list(HYBRID_FAMILIES), choices=HYBRID_FAMILIES)
    add_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    machine = f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    print(f"machine: {machine}")
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sftpack-hybrid-") as tmp:
        for kind in args.families:
            folder = save_hybrid_folder(kind, os.path.join(tmp, kind))
            model = sftpack.loop.load_model(folder, dtype=torch.float64)
            layer = ", ".join(sorted({f"{c.kind} ({c.cls})" for c in covered_layers(model)}))
            rounds = str(rounding_dtype(model, torch.float64)).removeprefix("torch.")
            common = dict(model=folder, dtype=torch.float64, limit=args.limit, max_seq_len=args.max_seq_len)
            kept = verify(CHATS, **common)
            with _loaded_leaking():
                leak = verify(CHATS, **common)
            control = {(c.path, c.boundaries): c for c in leak.checks}
            for c in kept.checks:
                bad = control[(c.path, c.boundaries)]
                rows.append(
                    {
                        "family": kind,
                        "layer": layer,
                        "path": c.path,
                        "mode": c.boundaries,
                        "logits": c.logits,
                        "loss": c.loss,
                        "grads": c.grads,
                        "tolerance": max(c.tolerance.values()),
                        "rounds in": rounds,
                        "result": "exact" if c.ok else "DIFFERS",
                        "control logits": bad.logits,
                        "control": "fails" if not bad.ok else "PASSES (not caught)",
                    }
                )
            print(f"{kind}: {'exact' if kept.ok else 'DIFFERS'}; control {'fails' if not leak.ok else 'passes'}")
    seconds = time.perf_counter() - t0
    columns = list(rows[0])
    table = markdown_table(rows, columns=columns)
    print(table)
    body = (
        f"Tiny folders of each family (hidden 32, one layer that carries state and one attention layer), "
        f"{args.limit} short chats, rows of {args.max_seq_len}, float64 on CPU: `verify` of every path and "
        "boundary mode against each sample alone (the largest |packed - alone| difference; the tolerance is "
        "float32's where the family's own code rounds to float32), and the negative control: the same with "
        "the state crossing every boundary (`sftpack.hybrid.leaking`, what the Hugging Face classes do on a "
        f"packed row without sftpack). {seconds:.0f} s.\n\n{table}"
    )
    if not args.no_results:
        write_section(__file__, body, machine, title="Hybrid models: packed vs alone, and the negative control")


if __name__ == "__main__":
    main()
