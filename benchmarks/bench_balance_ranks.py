"""Step-time spread measured on CPU ranks (issue 41, item 6): the trainer path's plan before and
after the cost model, each rank's own compute time per step.

``W`` = 2 and 4 gloo ranks (forked processes, one torch thread each) train the loop's tiny
Llama (transformers' ``LlamaForCausalLM``: 2 layers, ``d = 64``, 4 heads, a 256-id vocabulary,
float32) on the trainer path: each step's global batch of conversations planned into
micro-batches of at most ``--width`` tokens, every rank packing its own at the step
(:func:`sftpack.trainer.pack_step`) and running their forward and backward through the loop's
loss module; then the gradients are all-reduced and AdamW steps. Two plans of the same global
batches:

- **before**: the planner of ``e7dffec`` (``git show e7dffec:src/sftpack/trainer/_plan.py``),
  re-implemented here in a few lines: BFD bins of at most ``width`` tokens over the whole
  global batch, their number split to a multiple of ``W`` (``binpack.pack(...,
  bins_multiple_of=W)``), then longest-processing-time by tokens (heaviest bin to the least
  loaded rank that still has room, every rank the same number of bins);
- **after**: today's :func:`sftpack.trainer.plan_microbatches` with ``cost`` =
  :meth:`SequenceCost.from_config <sftpack.balance.SequenceCost.from_config>` of the model's
  config: the sequences dealt to the ranks by cost first, then each rank's share packed.

Per step, each rank's compute time is the CPU time (``time.process_time``) of its micro-batches'
packing, forward and backward, taken before the gradient all-reduce: CPU time, not wall time,
because 4 ranks share the machine's cores and a rank's wall time would count the time the
others held its core. The table gives, per plan, the mean over the measured steps of
``max / mean`` of the ranks' compute time (1.00: no straggler), the worst step, the same ratio
predicted by the model's cost, the mean step's slowest and mean rank in seconds, and the
micro-batches per rank (each costs a fixed overhead the cost model does not price).

Lengths (seeded): ``round(lognormal(ln 160, 0.9))`` clipped to ``[8, width]``, each replaced with
probability ``--tail`` (5%) by one uniform in ``[width / 2, width]``: a chat mix with a long tail.
The first step of each run is a warm-up and not counted.

Usage::

    python benchmarks/bench_balance_ranks.py             # 2 and 4 ranks, 12 steps each (a few minutes on 2 cores)
    python benchmarks/bench_balance_ranks.py --quick     # 4 steps
    python benchmarks/bench_balance_ranks.py --no-results

Writes its section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import heapq
import os
import platform
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section
from sftpack import binpack
from sftpack.balance import SequenceCost
from sftpack.loop import build_model
from sftpack.loop._model import LossModule
from sftpack.sample import Sample
from sftpack.trainer import pack_step, padded_batch, plan_microbatches

VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 256, 64, 2, 4, 2
MEDIAN, SIGMA = 160, 0.9
PER_RANK = 16  # conversations per rank per step: the global batch is 16 x W


def lengths_of(step: int, batch: int, width: int, tail: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, step])
    chat = np.clip(np.round(rng.lognormal(np.log(MEDIAN), SIGMA, size=batch)), 8, width).astype(np.int64)
    long = rng.random(batch) < tail
    chat[long] = rng.integers(width // 2, width + 1, size=int(long.sum()))
    return chat


def plan_before(lengths: np.ndarray, width: int, dp: int) -> list[list[np.ndarray]]:
    """e7dffec's deal: BFD bins over the global batch, a multiple of ``dp`` of them, LPT by tokens."""
    bins = binpack.pack(lengths, width, "bfd", min_bins=dp, bins_multiple_of=dp)
    tokens = np.array([int(lengths[b].sum()) for b in bins])
    per = len(bins) // dp
    heap = [(0, r) for r in range(dp)]
    out: list[list[np.ndarray]] = [[] for _ in range(dp)]
    for b in np.argsort(-tokens, kind="stable"):
        load, r = heapq.heappop(heap)
        out[r].append(np.asarray(bins[b], dtype=np.int64))
        if len(out[r]) < per:
            heapq.heappush(heap, (load + int(tokens[b]), r))
    return out


def plan_after(lengths: np.ndarray, width: int, dp: int, cost: SequenceCost) -> list[list[np.ndarray]]:
    return plan_microbatches(lengths, width, dp_size=dp, cost=cost).microbatches


def _rank(rank: int, world: int, init: str, out: str, plan: str, steps: int, width: int, tail: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        model = build_model(VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, seed=0)
        cost = SequenceCost.from_config(model.config.to_dict())
        loss = LossModule(model, pad_between_seqs=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = []
        for step in range(steps + 1):  # step 0: the warm-up
            lengths = lengths_of(step, PER_RANK * world, width, tail, seed=world)
            rng = np.random.default_rng([world, step, 1])
            samples = [
                Sample(rng.integers(VOCAB, size=int(n)), np.ones(int(n), bool), f"s{i}") for i, n in enumerate(lengths)
            ]
            mbs = plan_before(lengths, width, world) if plan == "before" else plan_after(lengths, width, world, cost)
            predicted = [float(sum(cost(lengths[b]).sum() for b in mine)) for mine in mbs]
            n = torch.tensor(int(lengths.sum()) - len(lengths))  # every token trained but each sample's first
            opt.zero_grad()
            t0 = time.process_time()
            for b in mbs[rank]:
                picked = [samples[i] for i in sorted(b.tolist())]
                ids, lens, mask = padded_batch(picked)
                loss(pack_step(ids, lens, mask), n).backward()
            mine = torch.tensor([time.process_time() - t0], dtype=torch.float64)
            times = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(times, mine)
            for p in model.parameters():  # the gradient all-reduce, after the compute measured above
                dist.all_reduce(p.grad)
            opt.step()
            if step:
                rows.append(([float(t) for t in times], predicted, len(mbs[0])))
        if rank == 0:
            torch.save(rows, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, plan: str, steps: int, width: int, tail: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.pt")
        args = (world, str(Path(tmp) / "init"), out, plan, steps, width, tail)
        mp.start_processes(_rank, args=args, nprocs=world, start_method="fork")
        rows = torch.load(out)
    measured = [max(t) / (sum(t) / len(t)) for t, _, _ in rows]
    predicted = [max(c) / (sum(c) / len(c)) for _, c, _ in rows]
    return {
        "ranks": world,
        "plan": plan,
        "measured": float(np.mean(measured)),
        "worst": float(np.max(measured)),
        "predicted": float(np.mean(predicted)),
        "slowest": float(np.mean([max(t) for t, _, _ in rows])),
        "mean": float(np.mean([sum(t) / len(t) for t, _, _ in rows])),
        "microbatches": float(np.mean([m for _, _, m in rows])),
    }


COLUMNS = [
    ("ranks", "ranks", "{:,}"),
    ("plan", "plan", "{}"),
    ("measured", "max/mean compute time (mean over steps)", "{:.3f}"),
    ("worst", "worst step", "{:.3f}"),
    ("predicted", "max/mean predicted cost", "{:.3f}"),
    ("slowest", "slowest rank s/step", "{:.3f}"),
    ("mean", "mean rank s/step", "{:.3f}"),
    ("microbatches", "micro-batches per rank", "{:.2f}"),
]


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores (ranks forked, one torch thread each), {platform.system()} "
        f"{platform.machine()}; load average {load_average():.1f} at start; python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 12; --quick 4)")
    parser.add_argument("--quick", action="store_true", help="4 steps per run")
    parser.add_argument("--width", type=int, default=1024, help="micro-batch budget in tokens (default 1024)")
    parser.add_argument("--tail", type=float, default=0.05, help="share of long sequences (default 0.05)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    add_flag(parser)
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 12)
    where = machine()
    print(f"machine: {where}", file=sys.stderr)
    rows = []
    for world in args.ranks:
        for plan in ("before", "after"):
            t = time.perf_counter()
            rows.append(run(world, plan, steps, args.width, args.tail))
            r = rows[-1]
            print(
                f"  {world} ranks, {plan:6s}: measured {r['measured']:.3f} (worst {r['worst']:.3f}), predicted "
                f"{r['predicted']:.3f}; {time.perf_counter() - t:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    body = formatted_table(rows, COLUMNS)
    print(body)
    if not args.no_results:
        title = (
            f"Step-time spread on CPU ranks, the trainer path before (e7dffec: BFD bins, LPT by tokens) and after "
            f"(plan_microbatches, cost from the model's config): tiny Llama (L={LAYERS}, d={DIM}), {PER_RANK} "
            f"conversations per rank per step, lengths lognormal(ln {MEDIAN}, {SIGMA}) with a {args.tail:.0%} tail in "
            f"[{args.width // 2:,}, {args.width:,}], micro-batch budget {args.width:,}; each rank's CPU time of its "
            f"micro-batches per step, {steps} steps after a warm-up."
        )
        write_section(__file__, body, where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
