"""Benchmark: the fused output head against the chunked, checkpointed head it replaced.

Two measurements, each ``before`` and ``after`` alternated in one run (the order
rotated every round, so a busy machine slows both alike), median over rounds:

1. **head**: ``--rows`` supervised rows of width ``--dim`` through a
   ``--vocab``-id output head (defaults: 3,500 rows, as in a 9k-token step of the
   embedded corpus at about 38% supervised tokens; width 64 as ``sftpack train``'s
   default model; the embedded tokenizer's 151,646 ids), forward and backward.
   ``before`` is the head ``sftpack.loop.LossModule`` ran until issue 18, copied here:
   ``token_mean_loss(head(h), ...)`` in chunks of at most 2**27 logits, each under
   ``torch.utils.checkpoint`` (recomputed in the backward pass). ``after`` is
   :func:`sftpack.head.fused_linear_cross_entropy` (the PyTorch implementation).
2. **step**: one whole training step of ``sftpack train``'s default model
   (``build_model``: Llama, width 64, 2 layers, the full vocabulary) on a packed row
   of ``--tokens`` random tokens (conversations of 200-400 tokens, 38% supervised) and
   on the same conversations as right-padded rows (the baseline): forward, backward
   and an AdamW step, through ``LossModule`` with the old head (``before``) or the
   fused one (``after``).

Time is wall-clock per call; peak memory is the growth of this process's peak RSS
during the call (``VmHWM`` after it minus ``VmRSS`` before it; the peak is reset
through ``/proc/self/clear_refs`` before every call; Linux only, else blank).
The losses of ``before`` and ``after`` are printed beside (they must agree).

    python benchmarks/bench_head.py [--rows 3500] [--tokens 9000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section
from sftpack import IGNORE_INDEX, PackedBatch
from sftpack.exactness import random_samples
from sftpack.head import DEFAULT_CHUNK_BYTES, fused_linear_cross_entropy
from sftpack.loop import build_model
from sftpack.loop._model import LossModule
from sftpack.loop._sources import padded_micro_batch
from sftpack.loss import loss_dtype, token_mean_loss

QWEN_VOCAB = 151_646
OLD_CHUNK_LOGITS = 1 << 27  # the old head's chunk: 2**27 logits (512 MB in float32)


# --- the head before issue 18 (src/sftpack/loop/_model.py, copied as it was) ---------------------
def _old_head_piece(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, n: torch.Tensor, avg: int):
    return token_mean_loss(head(hidden), labels, n, average_over_ranks=avg)


def old_head(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, n: torch.Tensor, avg: int = 1):
    chunk = max(1, OLD_CHUNK_LOGITS // int(head.weight.shape[0]))
    if hidden.shape[0] <= chunk:
        return _old_head_piece(head, hidden, labels, n, avg)
    total = hidden.new_zeros((), dtype=loss_dtype(hidden.dtype))
    for s in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(
            _old_head_piece, head, hidden[s : s + chunk], labels[s : s + chunk], n, avg, use_reentrant=False
        )
    return total


class OldLossModule(LossModule):
    """``LossModule`` with the old head (the body part is LossModule's own, unchanged)."""

    def forward(self, mb: Any, num_label_tokens: torch.Tensor) -> torch.Tensor:
        body, head = self.model.base_model, self.model.get_output_embeddings()
        if hasattr(mb, "cu_seqlens_padded"):
            kw = mb.to_hf_kwargs()
            kw.pop("labels")
            hidden, labels = body(**kw).last_hidden_state[0], mb.labels
        else:
            hidden = body(input_ids=mb.input_ids, use_cache=False).last_hidden_state.flatten(0, 1)
            labels = mb.labels.reshape(-1)
        keep = labels != IGNORE_INDEX
        return old_head(head, hidden[keep], labels[keep], num_label_tokens, self.average_over_ranks)


# --- measuring ----------------------------------------------------------------------------------
def _status_mib(field: str) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current RSS
        return True
    except OSError:
        return False


def measure(fn: Callable[[], float]) -> dict[str, float]:
    """One call: seconds, peak RSS growth (MiB) and the loss it returned."""
    ok = _reset_peak()
    base = _status_mib("VmRSS")
    t0 = time.perf_counter()
    loss = fn()
    seconds = time.perf_counter() - t0
    peak = _status_mib("VmHWM") - base if ok else float("nan")
    return {"seconds": seconds, "peak_mib": peak, "loss": loss}


def head_case(rows: int, dim: int, vocab: int, seed: int) -> dict[str, Callable[[], float]]:
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(dim, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=g) * dim**-0.5)
    hidden = torch.randn(rows, dim, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    n = torch.tensor(rows)

    def before() -> float:
        head.weight.grad, hidden.grad = None, None
        loss = old_head(head, hidden, labels, n)
        loss.backward()
        return loss.item()

    def after() -> float:
        head.weight.grad, hidden.grad = None, None
        loss = fused_linear_cross_entropy(hidden, head.weight, labels, n)
        loss.backward()
        return loss.item()

    return {"before": before, "after": after}


def step_case(tokens: int, vocab: int, seed: int, padded: bool) -> dict[str, Callable[[], float]]:
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(200, 401, (1,), generator=g)))
    samples = random_samples(lengths, vocab, seed=seed, p_train=0.38)
    mb: Any = padded_micro_batch(samples) if padded else PackedBatch.from_samples(samples)
    n = (mb.labels != IGNORE_INDEX).sum()
    model = build_model(vocab, seed=seed)
    fns = {}
    for name, cls in (("before", OldLossModule), ("after", LossModule)):
        module = cls(copy.deepcopy(model), pad_between_seqs=False)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

        def step(module: LossModule = module, opt: torch.optim.Optimizer = opt) -> float:
            opt.zero_grad(set_to_none=True)
            loss = module(mb, n)
            loss.backward()
            opt.step()
            return loss.item()

        fns[name] = step
    return fns


def run(cases: dict[str, dict[str, Callable[[], float]]], rounds: int) -> list[dict[str, Any]]:
    """Every (case, variant) once untimed (warm-up), then ``rounds`` rotated rounds."""
    keys = [(c, v) for c in cases for v in cases[c]]
    for c, v in keys:
        cases[c][v]()
    got: dict[tuple[str, str], list[dict[str, float]]] = {k: [] for k in keys}
    first_loss: dict[tuple[str, str], float] = {}
    for r in range(rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for c, v in order:
            m = measure(cases[c][v])
            first_loss.setdefault((c, v), m["loss"])
            got[(c, v)].append(m)
            print(
                f"  round {r + 1} {c:14s} {v:6s} {m['seconds'] * 1e3:9.0f} ms  peak +{m['peak_mib']:7.0f} MiB",
                flush=True,
            )
    out = []
    for c in cases:
        med = {
            v: (
                statistics.median(m["seconds"] for m in got[(c, v)]),
                statistics.median(m["peak_mib"] for m in got[(c, v)]),
            )
            for v in cases[c]
        }
        (tb, pb), (ta, pa) = med["before"], med["after"]
        out.append(
            {
                "case": c,
                "before_ms": tb * 1e3,
                "after_ms": ta * 1e3,
                "speedup": tb / ta,
                "before_mib": pb,
                "after_mib": pa,
                "mem_ratio": pb / pa if pa == pa and pa > 0 else float("nan"),
                "dloss": abs(first_loss[(c, "before")] - first_loss[(c, "after")]),
            }
        )
    return out


COLUMNS = [
    ("case", "measured", "{}"),
    ("before_ms", "before ms", "{:,.0f}"),
    ("after_ms", "after ms", "{:,.0f}"),
    ("speedup", "speed-up", "{:.2f}x"),
    ("before_mib", "before peak MiB", "{:,.0f}"),
    ("after_mib", "after peak MiB", "{:,.0f}"),
    ("mem_ratio", "peak ratio", "{:.1f}x"),
    ("dloss", "\\|Δ loss\\| (first call)", "{:.1e}"),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=3500, help="supervised rows through the head alone")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    ap.add_argument("--tokens", type=int, default=9000, help="tokens of the whole-step case (0: skip it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_flag(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = (
        f"{cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, Python {platform.python_version()}, float32"
    )
    load_before = load_average()
    print(f"machine: {machine}; load {load_before:.2f}")
    cases = {f"head, {args.rows:,} rows": head_case(args.rows, args.dim, args.vocab, args.seed)}
    if args.tokens:
        cases["step, packed"] = step_case(args.tokens, args.vocab, args.seed, padded=False)
        cases["step, padded"] = step_case(args.tokens, args.vocab, args.seed, padded=True)
    rows = run(cases, args.rounds)
    load_after = load_average()
    table = formatted_table(rows, COLUMNS)
    print(table)
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    if not args.no_results:
        title = (
            f"The output head and loss with {args.vocab:,} ids at width {args.dim}: before, the chunked "
            f"(2**27 logits) checkpointed `token_mean_loss` over the head; after, "
            f"`sftpack.head.fused_linear_cross_entropy` (chunks of {DEFAULT_CHUNK_BYTES >> 20} MiB of logits, "
            f"gradients formed in the forward). `head`: {args.rows:,} supervised rows, forward + backward. "
            f"`step`: `sftpack train`'s default model (Llama, width 64, 2 layers) on {args.tokens:,} random tokens "
            f"(38% supervised), packed in one row and as right-padded rows, forward + backward + AdamW. "
            f"Median of {args.rounds} interleaved rounds; peak = growth of the process's peak RSS during a call."
        )
        body = f"{table}\n\nLoad average (1 min): {load_before:.2f} before the run, {load_after:.2f} after."
        write_section(__file__, body, machine, title=title)


if __name__ == "__main__":
    main()
