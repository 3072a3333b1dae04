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
- **After**: :func:`sftpack.report.balance.plan_paths`, what ``sftpack plan`` prints: the
  trainer path's ``plan_microbatches`` (sequences dealt to ranks by cost, then each
  share packed), priced with the 7B model (and with ``cost="tokens"``, the default of
  ``sftpack train`` without a model); the offline and loader paths' steps of rows dealt
  by cost (:func:`sftpack.balance.deal`); dynamic context parallelism with ``--cp 8``
  (:func:`sftpack.balance.dynamic_cp`) where the case has a long tail. The bound is
  :func:`sftpack.balance.lower_bound`: the heaviest sequence (trainer) over the mean
  rank, or (offline) the heaviest row plus ``k - 1`` of the lightest (the rank holding
  that row holds ``k`` rows), which no deal without context parallelism beats.

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
from sftpack import binpack
from sftpack.balance import SequenceCost, dynamic_cp, max_over_mean
from sftpack.offline import plan_rows
from sftpack.report.balance import plan_paths
from sftpack.trainer import plan_microbatches

DATA = Path(__file__).resolve().parent / "data"

#: the one cost model: planners after issue 41 plan with it, and every ratio here is measured in it
COST = SequenceCost.named("7b")
#: the largest context-parallel group of the dynamic-CP columns
MAX_CP = 8


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
# before: the deals of e7dffec, re-implemented (the code they ran is gone from sftpack)


def lpt(costs: np.ndarray, ranks: int, per_rank: int) -> np.ndarray:
    """``(len(costs),)`` owner of each item: heaviest first to the least loaded rank with room."""
    heap = [(0.0, r) for r in range(ranks)]
    owner = np.empty(costs.shape[0], np.int64)
    taken = np.zeros(ranks, np.int64)
    for i in np.argsort(-costs, kind="stable"):
        load, r = heapq.heappop(heap)
        owner[i] = r
        taken[r] += 1
        if taken[r] < per_rank:
            heapq.heappush(heap, (load + float(costs[i]), r))
    return owner


def before_trainer(lengths: np.ndarray, ranks: int, width: int) -> np.ndarray:
    """Rank of each sequence under the old ``plan_microbatches``: BFD bins split to a multiple of
    the ranks, then the bins dealt LPT by tokens."""
    bins = binpack.pack(lengths, width, "bfd", min_bins=ranks, bins_multiple_of=ranks)
    tokens = np.array([float(lengths[b].sum()) for b in bins])
    bin_owner = lpt(tokens, ranks, len(bins) // ranks)
    owner = np.empty(lengths.shape[0], np.int64)
    for k, b in enumerate(bins):
        owner[np.asarray(b, dtype=np.int64)] = bin_owner[k]
    return owner


def before_offline(row_tokens: np.ndarray, ranks: int, rank: int) -> np.ndarray:
    """The rows ``rank`` read in epoch 0 under the old ``epoch_rows(shuffle=True, seed=0)``: a
    snake deal of the epoch's rows by tokens, then the rank's share shuffled."""
    n = row_tokens.shape[0]
    rng = np.random.default_rng([0, 0])
    visit = rng.permutation(n)
    by_cost = visit[np.argsort(-row_tokens[visit], kind="stable")]
    k = np.arange(n)
    j = k % ranks
    mine = by_cost[np.where((k // ranks) % 2 == 0, j, ranks - 1 - j) == rank]
    return mine[rng.permutation(mine.shape[0])]


# ----------------------------------------------------------------------------
# measuring


def per_rank(owner: np.ndarray, costs: np.ndarray, ranks: int) -> np.ndarray:
    return np.bincount(owner, weights=costs, minlength=ranks)


def trainer_case(scale: Scale, mix: str, tail: bool, steps: int, draw: Callable, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    w, batch = scale.ranks, scale.batch
    lengths = draw(rng, steps * batch, scale.width, tail)
    before, tokens, worst_before = [], [], 0.0
    for s in range(steps):
        step = lengths[s * batch : (s + 1) * batch]
        c = COST(step)
        before.append(max_over_mean(per_rank(before_trainer(step, w, scale.width), c, w)))
        plan = plan_microbatches(step, scale.width, dp_size=w, cost="tokens")
        owner = np.empty(step.shape[0], np.int64)
        for r, mbs in enumerate(plan.microbatches):
            for mb in mbs:
                owner[mb] = r
        tokens.append(max_over_mean(per_rank(owner, c, w)))
        worst_before = max(worst_before, before[-1])
    common = {"dp": w, "global_batch": batch, "max_seq_len": scale.width, "cost": COST, "steps": steps}
    after = plan_paths(lengths, shuffle=False, **common).paths["trainer"]
    dyn = plan_paths(lengths, cp=MAX_CP, shuffle=False, **common).paths["dynamic_cp"]
    return {
        "ranks": w,
        "batch": batch,
        "width": scale.width,
        "mix": mix,
        "tail": tail_label(scale, tail),
        "before": statistics.fmean(before),
        "tokens": statistics.fmean(tokens),
        "after": after.max_over_mean,
        "bound": after.bound,
        "dynamic_cp": dyn.max_over_mean,
        "dynamic_cp_bound": dyn.bound,
        "before_worst": worst_before,
        "after_worst": after.worst,
        "dynamic_cp_worst": dyn.worst,
        "microbatches": after.microbatches_per_rank,
        "dynamic_cp_microbatches": dyn.microbatches_per_rank,
        "steps": steps,
    }


def offline_case(scale: Scale, mix: str, tail: bool, steps: int, draw: Callable, seed: int) -> dict:
    """A dataset of about ``steps`` steps of rows, dealt as before and as after (see the docstring)."""
    rng = np.random.default_rng(seed)
    w, k = scale.ranks, scale.rows_per_rank
    probe = draw(rng, 100_000, scale.width, tail)
    n = int(np.ceil(w * k * steps * scale.width / probe.mean() * 1.02))  # rows are ~99% full
    lengths = draw(rng, n, scale.width, tail)
    rows = plan_rows(lengths, max_seq_len=scale.width)  # what `sftpack prepack` plans
    starts = rows.row_offsets[:-1]
    row_tokens = np.add.reduceat(rows.lengths, starts)
    row_cost = COST.of_groups(rows.lengths, rows.row_offsets)
    shards = [before_offline(row_tokens, w, r) for r in range(w)]
    before_steps = min(x.shape[0] for x in shards) // k
    before = []
    for step in range(before_steps):
        mine = np.stack([x[step * k : (step + 1) * k] for x in shards])  # (w, k) global rows
        before.append(max_over_mean(row_cost[mine].sum(axis=1)))
    after = plan_paths(
        lengths, dp=w, global_batch=scale.batch, max_seq_len=scale.width, cost=COST, steps=steps, rows_per_rank=k
    ).paths["offline"]
    return {
        "ranks": w,
        "width": scale.width,
        "per_rank": k,
        "mix": mix,
        "tail": tail_label(scale, tail),
        "sequences": n,
        "rows": rows.num_rows,
        "fill": float(rows.lengths.sum()) / (rows.num_rows * scale.width),
        "before": statistics.fmean(before),
        "before_worst": max(before),
        "after": after.max_over_mean,
        "after_worst": after.worst,
        "bound": after.bound,
        "steps": after.steps,
    }


def plan_time(repeats: int) -> list[dict]:
    rng = np.random.default_rng(41)
    lengths = chat(rng, 16_384, 131_072, True)
    calls = {
        "plan_microbatches, cost 7b": lambda: plan_microbatches(lengths, 131_072, dp_size=1_024, cost=COST),
        "plan_microbatches, cost tokens": lambda: plan_microbatches(lengths, 131_072, dp_size=1_024),
        f"dynamic_cp, max_cp {MAX_CP}, cost 7b": lambda: dynamic_cp(
            lengths, ranks=1_024, max_cp=MAX_CP, max_seq_len=131_072, cost=COST
        ),
    }
    out = []
    for name, call in calls.items():
        call()  # warm-up (numba cache load)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out.append(
            {"call": name, "median": statistics.median(times), "best": min(times), "worst": max(times), "n": repeats}
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
    ("before", "before (bins by tokens)", "{:.3f}"),
    ("tokens", 'after, `cost="tokens"`', "{:.3f}"),
    ("after", 'after, `cost="7b"`', "{:.3f}"),
    ("bound", "bound without CP", "{:.3f}"),
    ("dynamic_cp", f"dynamic CP, max {MAX_CP}", "{:.3f}"),
    ("dynamic_cp_bound", "bound with CP", "{:.3f}"),
    ("before_worst", "worst step, before", "{:.3f}"),
    ("after_worst", "worst step, after", "{:.3f}"),
    ("dynamic_cp_worst", "worst step, dynamic CP", "{:.3f}"),
    ("microbatches", "micro-batches per rank", "{:.2f}"),
    ("dynamic_cp_microbatches", "micro-batches per rank, dynamic CP", "{:.2f}"),
    ("steps", "steps", "{:,}"),
]

OFFLINE_COLUMNS = [
    ("ranks", "ranks", "{:,}"),
    ("width", "row width", "{:,}"),
    ("per_rank", "rows per rank per step", "{:,}"),
    ("mix", "lengths", "{}"),
    ("tail", "long tail", "{}"),
    ("before", "before (snake by tokens)", "{:.3f}"),
    ("after", "after (each step dealt by cost)", "{:.3f}"),
    ("bound", "bound (heaviest row and k-1 lightest)", "{:.3f}"),
    ("before_worst", "worst step, before", "{:.3f}"),
    ("after_worst", "worst step, after", "{:.3f}"),
    ("fill", "row fill", "{:.2%}"),
    ("rows", "rows", "{:,}"),
    ("steps", "steps", "{:,}"),
]

TIME_COLUMNS = [
    ("call", "call", "{}"),
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
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per case (default 32, 4 with --quick)")
    parser.add_argument(
        "--offline-steps",
        type=int,
        default=None,
        help="offline dataset size, in steps of rows (default 32, 4 with --quick)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="plan timing runs (default 9, 3 with --quick)")
    add_flag(parser)
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 32)
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
                f"trainer {trainer[-1]['before']:.3f} -> {trainer[-1]['after']:.3f} (bound "
                f"{trainer[-1]['bound']:.3f}), dynamic CP {trainer[-1]['dynamic_cp']:.3f}; offline "
                f"{offline[-1]['before']:.3f} -> {offline[-1]['after']:.3f} (bound {offline[-1]['bound']:.3f}); "
                f"{time.perf_counter() - t:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    timing = plan_time(repeats)

    body = "\n\n".join(
        [
            f"Trainer path: each step's global batch planned before (BFD bins split to a multiple of the ranks, "
            f"dealt by tokens) and after (`plan_microbatches`: sequences dealt to ranks by cost, then packed; with "
            f'`cost="tokens"`, the default, and `cost="7b"`), and with dynamic context parallelism '
            f"(`dynamic_cp`, groups of up to {MAX_CP} of the same ranks); max/mean of the ranks' 7B FLOPs, mean "
            f"over {steps} steps per case.",
            formatted_table(trainer, TRAINER_COLUMNS),
            f"Offline path (the loader path's rows are dealt the same way): rows by BFD (`plan_rows`, as "
            f"`sftpack prepack`) over a dataset of about {offline_steps} steps of rows, dealt before (a snake "
            "deal of the epoch by tokens, each rank's share shuffled) and after (one world-size independent "
            "order, each step's rows dealt by cost: `balance.deal`); max/mean of the ranks' 7B FLOPs, mean over "
            "the steps.",
            formatted_table(offline, OFFLINE_COLUMNS),
            "Planning time: one global batch of 16,384 sequences (chat, long tail 16,384 to 131,072) at 1,024 "
            "ranks, budget 131,072 (goal: under 1 s).",
            formatted_table(timing, TIME_COLUMNS),
        ]
    )
    print()
    print(body)
    if not args.no_results:
        title = (
            "Issue 41, before and after: max/mean of the data-parallel ranks' cost per step, on the FLOP model of "
            f'a 7B decoder (`SequenceCost.named("7b")`: {COST.per_token:.3e}·l + {COST.per_token_squared:.3e}·l² '
            f"per sequence); chat = lognormal(ln {CHAT_MEDIAN}, {CHAT_SIGMA}), long tail = {TAIL_SHARE:.0%} of "
            f"sequences uniform in [{TAIL_FROM:,}, width]; seeded. 1.000 = no straggler."
        )
        write_section(__file__, body, where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
