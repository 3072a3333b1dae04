"""How far the slowest data-parallel rank is above the mean, before and after issue 41.

A step is as slow as its slowest rank, so what matters across ``W`` data-parallel
ranks is ``max / mean`` of the ranks' cost per step (1.00: no straggler). This
script measures it on paper with the one cost model every planner uses,
:class:`sftpack.balance.SequenceCost` of a 7B decoder (``SequenceCost.named("7b")``:
Llama 2 7B's shape, 32 layers, ``d = 4096``; a sequence of ``l`` tokens costs
``6*P*l + 6*L*d*l**2`` FLOPs, forward and backward, ``P`` = 6.6e9 weights a token
meets). A rank's cost in a step is the sum over the sequences of its micro-batches
(trainer) or rows (offline, loader); only real tokens are charged.

- **Before** (the code of ``e7dffec``, re-implemented here in a few lines so the
  comparison stays runnable): the trainer path's ``plan_microbatches`` packed the
  global batch into BFD bins, split them to a multiple of ``W`` and dealt the bins
  LPT by tokens; the offline path dealt the whole epoch's rows in a snake by tokens,
  each rank then reading its share in a shuffled order, ``k`` rows a step.
- **After**: :func:`sftpack.report.plan_paths`, what ``sftpack plan`` prints: the
  trainer path's ``plan_microbatches`` (sequences dealt to ranks by cost, then each
  share packed), priced with the 7B model (and with ``cost="tokens"``, the default of
  ``sftpack train`` without a model); the offline and loader paths' steps of rows dealt
  by cost (:func:`sftpack.balance.deal`); dynamic context parallelism with ``--cp 8``
  (:func:`sftpack.balance.dynamic_cp`) where the case has a long tail. The bound is
  :func:`sftpack.balance.lower_bound`: the heaviest sequence (trainer) or row
  (offline) over the mean rank, which no plan without context parallelism beats.

Every ratio is the **mean over steps** of the per-step ``max / mean`` (the tables
also give the worst step). Cases are issue 41's: 8 / 64 / 512 / 1,024 ranks;
trainer: global batch 256 / 2,048 / 8,192 / 16,384, budget 16,384 / 16,384 /
32,768 / 131,072; offline: row width the same, 2 / 2 / 2 / 1 rows per rank per
step. Length mixes (all seeded):

- ``chat``: ``round(lognormal(mu=ln 900, sigma=1))`` (median 900, mean ~1,480)
  clipped to ``[1, width]``;
- ``chat + tail``: the same, with each sequence replaced, with probability 2%,
  by one drawn uniformly from ``[16,384, width]`` (the issue's long tail, in the
  512- and 1,024-rank cases, up to 32,768 and 131,072), and without it there too;
- ``wikipedia`` / ``squad``: drawn from the histograms in ``benchmarks/data/``
  (``wikipedia_512.csv``, ``squad11_384.csv``), as ``bench_loader.py`` draws them
  (``rng.choice`` with the counts as probabilities).

Last, the time ``plan_microbatches`` (7B cost) and ``dynamic_cp`` take for a
16,384-sequence global batch (``chat + tail`` up to 131,072) at 1,024 ranks,
budget 131,072 (issue 41's goal: under 1 s), median of ``--repeats`` after a
warm-up call.

Usage::

    python benchmarks/bench_balance.py            # the full run (a few minutes on 2 cores)
    python benchmarks/bench_balance.py --quick    # fewer steps, a smaller dataset
    python benchmarks/bench_balance.py --no-results --steps 4

Writes its section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import heapq
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section
from sftpack.offline import plan_rows
from sftpack.offline._shard import epoch_rows
from sftpack.trainer import plan_microbatches

DATA = Path(__file__).resolve().parent / "data"

# ----------------------------------------------------------------------------
# the FLOP model: a 7B decoder, forward + backward

LAYERS = 32
HIDDEN = 4096
PARAMS = 6.7e9


def sequence_flops(lengths: np.ndarray) -> np.ndarray:
    """``6*N*l + 6*L*d*l**2`` per sequence (float64): the linear work and causal attention."""
    l = np.asarray(lengths, dtype=np.float64)  # noqa: E741
    return 6.0 * PARAMS * l + 6.0 * LAYERS * HIDDEN * l * l


# ----------------------------------------------------------------------------
# length mixes

CHAT_MEDIAN, CHAT_SIGMA = 900, 1.0
TAIL_SHARE, TAIL_FROM = 0.02, 16_384


def chat(rng: np.random.Generator, n: int, width: int, tail: bool) -> np.ndarray:
    lengths = np.clip(np.rint(rng.lognormal(np.log(CHAT_MEDIAN), CHAT_SIGMA, n)), 1, width).astype(np.int64)
    if tail:
        long = rng.random(n) < TAIL_SHARE
        lengths[long] = rng.integers(TAIL_FROM, width, size=int(long.sum()), endpoint=True)
    return lengths


def histogram(name: str) -> Callable[[np.random.Generator, int, int, bool], np.ndarray]:
    table = np.loadtxt(DATA / name, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    values, p = table[:, 0], table[:, 1] / table[:, 1].sum()

    def draw(rng: np.random.Generator, n: int, width: int, tail: bool) -> np.ndarray:
        return np.minimum(rng.choice(values, size=n, p=p), width).astype(np.int64)

    return draw


@dataclass(frozen=True)
class Scale:
    ranks: int
    batch: int  # trainer: sequences per global batch
    width: int  # trainer: micro-batch budget; offline: row width
    rows_per_rank: int  # offline
    tail: bool  # issue 41's case has the long tail


SCALES = (
    Scale(8, 256, 16_384, 2, False),
    Scale(64, 2_048, 16_384, 2, False),
    Scale(512, 8_192, 32_768, 2, True),
    Scale(1_024, 16_384, 131_072, 1, True),
)


def mixes(scale: Scale) -> list[tuple[str, bool]]:
    """(mix, long tail) pairs measured at ``scale``: the issue's case first."""
    out = [("chat", scale.tail)]
    if scale.tail:
        out.append(("chat", False))
    return out + [("wikipedia", False), ("squad", False)]


def tail_label(scale: Scale, tail: bool) -> str:
    return f"{TAIL_FROM:,} to {scale.width:,}" if tail else "none"


# ----------------------------------------------------------------------------
# measuring


def ratio(rank_costs: np.ndarray) -> float:
    return float(rank_costs.max() / rank_costs.mean())


def bound(heaviest: float, rank_costs: np.ndarray) -> float:
    return max(1.0, float(heaviest / rank_costs.mean()))


def lpt(costs: np.ndarray, ranks: int, per_rank: int) -> np.ndarray:
    """``(ranks,)`` loads of ``costs`` dealt heaviest first to the least loaded rank with room."""
    heap = [(0.0, r) for r in range(ranks)]
    loads = np.zeros(ranks)
    taken = np.zeros(ranks, np.int64)
    for c in np.sort(costs)[::-1]:
        load, r = heapq.heappop(heap)
        loads[r] = load + c
        taken[r] += 1
        if taken[r] < per_rank:
            heapq.heappush(heap, (loads[r], r))
    return loads


def trainer_case(scale: Scale, mix: str, tail: bool, steps: int, draw: Callable, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    got: dict[str, list[float]] = {"tokens": [], "attention": [], "bound": [], "mb": []}
    for _ in range(steps):
        lengths = draw(rng, scale.batch, scale.width, tail)
        flops = sequence_flops(lengths)
        for cost in ("tokens", "attention"):
            plan = plan_microbatches(lengths, scale.width, dp_size=scale.ranks, cost=cost)
            owner = np.empty(lengths.shape[0], np.int64)
            for r, microbatches in enumerate(plan.microbatches):
                for mb in microbatches:
                    owner[mb] = r
            per_rank = np.bincount(owner, weights=flops, minlength=scale.ranks)
            got[cost].append(ratio(per_rank))
            if cost == "tokens":
                got["bound"].append(bound(flops.max(), per_rank))
                got["mb"].append(plan.num_microbatches)
    return {
        "ranks": scale.ranks,
        "batch": scale.batch,
        "width": scale.width,
        "mix": mix,
        "tail": tail_label(scale, tail),
        "tokens": statistics.fmean(got["tokens"]),
        "tokens_worst": max(got["tokens"]),
        "attention": statistics.fmean(got["attention"]),
        "attention_worst": max(got["attention"]),
        "bound": statistics.fmean(got["bound"]),
        "microbatches": statistics.fmean(got["mb"]),
        "steps": steps,
    }


def offline_case(scale: Scale, mix: str, tail: bool, steps: int, draw: Callable, seed: int) -> dict:
    """A dataset of about ``steps`` steps of rows, packed and dealt as today (see the docstring)."""
    rng = np.random.default_rng(seed)
    w, k = scale.ranks, scale.rows_per_rank
    probe = draw(rng, 100_000, scale.width, tail)
    n = int(np.ceil(w * k * steps * scale.width / probe.mean() * 1.02))  # rows are ~99% full
    lengths = draw(rng, n, scale.width, tail)
    plan = plan_rows(lengths, max_seq_len=scale.width)  # what `sftpack prepack` plans
    starts = plan.row_offsets[:-1]
    row_tokens = np.add.reduceat(plan.lengths, starts)
    row_flops = np.add.reduceat(sequence_flops(plan.lengths), starts)
    # PrepackedDataset(shuffle=True, seed=0, rank=r, world_size=w) with balance="tokens": row_costs()
    # are the rows' real tokens, the rank reads epoch_rows(...) of them; OfflineSource takes k a step
    shards = [epoch_rows(row_tokens, epoch=0, seed=0, shuffle=True, rank=r, world_size=w) for r in range(w)]
    epoch_steps = min(s.shape[0] for s in shards) // k
    today, by_cost, bounds = [], [], []
    for step in range(epoch_steps):
        mine = np.stack([s[step * k : (step + 1) * k] for s in shards])  # (w, k) global rows
        costs = row_flops[mine]
        per_rank = costs.sum(axis=1)
        today.append(ratio(per_rank))
        by_cost.append(ratio(lpt(costs.ravel(), w, k)))
        bounds.append(bound(costs.max(), per_rank))
    return {
        "ranks": w,
        "width": scale.width,
        "per_rank": k,
        "mix": mix,
        "tail": tail_label(scale, tail),
        "sequences": n,
        "rows": plan.num_rows,
        "fill": float(plan.lengths.sum()) / (plan.num_rows * scale.width),
        "today": statistics.fmean(today),
        "today_worst": max(today),
        "lpt": statistics.fmean(by_cost),
        "lpt_worst": max(by_cost),
        "bound": statistics.fmean(bounds),
        "steps": epoch_steps,
    }


def plan_time(repeats: int) -> list[dict]:
    rng = np.random.default_rng(41)
    lengths = chat(rng, 16_384, 131_072, True)
    out = []
    for cost in ("tokens", "attention"):
        plan_microbatches(lengths, 131_072, dp_size=1_024, cost=cost)  # warm-up (numba cache load)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan_microbatches(lengths, 131_072, dp_size=1_024, cost=cost)
            times.append(time.perf_counter() - t0)
        out.append(
            {"cost": cost, "median": statistics.median(times), "best": min(times), "worst": max(times), "n": repeats}
        )
    return out


# ----------------------------------------------------------------------------
# output

TRAINER_COLUMNS = [
    ("ranks", "ranks", "{:,}"),
    ("batch", "global batch", "{:,}"),
    ("width", "micro-batch budget", "{:,}"),
    ("mix", "lengths", "{}"),
    ("tail", "long tail", "{}"),
    ("tokens", '`cost="tokens"` (default)', "{:.3f}"),
    ("attention", '`cost="attention"`', "{:.3f}"),
    ("bound", "bound without CP", "{:.3f}"),
    ("tokens_worst", "worst step, tokens", "{:.3f}"),
    ("attention_worst", "worst step, attention", "{:.3f}"),
    ("microbatches", "micro-batches per rank", "{:.2f}"),
    ("steps", "steps", "{:,}"),
]

OFFLINE_COLUMNS = [
    ("ranks", "ranks", "{:,}"),
    ("width", "row width", "{:,}"),
    ("per_rank", "rows per rank per step", "{:,}"),
    ("mix", "lengths", "{}"),
    ("tail", "long tail", "{}"),
    ("today", "dealt as today", "{:.3f}"),
    ("lpt", "dealt by cost (LPT)", "{:.3f}"),
    ("bound", "bound (heaviest row)", "{:.3f}"),
    ("today_worst", "worst step, today", "{:.3f}"),
    ("lpt_worst", "worst step, LPT", "{:.3f}"),
    ("fill", "row fill", "{:.2%}"),
    ("rows", "rows", "{:,}"),
    ("steps", "steps", "{:,}"),
]

TIME_COLUMNS = [
    ("cost", "cost", "{}"),
    ("median", "median s", "{:.3f}"),
    ("best", "best s", "{:.3f}"),
    ("worst", "worst s", "{:.3f}"),
    ("n", "runs", "{:,}"),
]


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores (one used), {platform.system()} {platform.machine()}; "
        f"load average {load_average():.1f} at start; python {platform.python_version()}, numpy {np.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 trainer steps, offline datasets of 4 steps")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per case (default 64, 4 with --quick)")
    parser.add_argument(
        "--offline-steps",
        type=int,
        default=None,
        help="offline dataset size, in steps of rows (default 32, 4 with --quick)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="plan timing runs (default 9, 3 with --quick)")
    add_flag(parser)
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 64)
    offline_steps = args.offline_steps or (4 if args.quick else 32)
    repeats = args.repeats or (3 if args.quick else 9)

    where = machine()
    print(f"machine: {where}")
    draws = {"chat": chat, "wikipedia": histogram("wikipedia_512.csv"), "squad": histogram("squad11_384.csv")}
    t0 = time.perf_counter()
    plan_microbatches(np.array([3, 5, 1, 3]), 8, dp_size=2)  # compile or load the numba cache before anything
    plan_rows(np.array([3, 5, 1, 3]), max_seq_len=8)
    print(f"first calls (numba compile or cache load): {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    trainer, offline = [], []
    for i, scale in enumerate(SCALES):
        for j, (mix, tail) in enumerate(mixes(scale)):
            t = time.perf_counter()
            trainer.append(trainer_case(scale, mix, tail, steps, draws[mix], seed=100 * i + j))
            offline.append(offline_case(scale, mix, tail, offline_steps, draws[mix], seed=100 * i + j + 50))
            print(
                f"  {scale.ranks:>5} ranks, {mix:9s} tail {tail_label(scale, tail):18s}: "
                f"trainer {trainer[-1]['tokens']:.3f} / {trainer[-1]['attention']:.3f} (bound "
                f"{trainer[-1]['bound']:.3f}), offline {offline[-1]['today']:.3f} / LPT {offline[-1]['lpt']:.3f} "
                f"(bound {offline[-1]['bound']:.3f}); {time.perf_counter() - t:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    timing = plan_time(repeats)

    body = "\n\n".join(
        [
            f"Trainer path: `plan_microbatches` over each step's global batch, max/mean of the ranks' FLOPs, "
            f"mean over {steps} steps per case.",
            formatted_table(trainer, TRAINER_COLUMNS),
            f"Offline path: rows by BFD (`plan_rows`, as `sftpack prepack`) over a dataset of about "
            f"{offline_steps} steps of rows, dealt as `OfflineSource` deals them today, or by cost (LPT); max/mean "
            "of the ranks' FLOPs, mean over the steps of the first epoch.",
            formatted_table(offline, OFFLINE_COLUMNS),
            "Planning time: `plan_microbatches` of 16,384 sequences (chat, long tail 16,384 to 131,072) at 1,024 ranks, "
            "budget 131,072 (goal: under 1 s).",
            formatted_table(timing, TIME_COLUMNS),
        ]
    )
    print()
    print(body)
    if not args.no_results:
        title = (
            "Issue 41's baseline: max/mean of the data-parallel ranks' cost per step with today's planners, "
            f"on a FLOP model of a 7B decoder (L={LAYERS}, d={HIDDEN}, N={PARAMS:.1e}: 6·N·l + 6·L·d·l² per "
            f"sequence); chat = lognormal(ln {CHAT_MEDIAN}, {CHAT_SIGMA}), long tail = {TAIL_SHARE:.0%} of "
            f"sequences uniform in [{TAIL_FROM:,}, width]; seeded. 1.000 = no straggler."
        )
        write_section(__file__, body, where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
