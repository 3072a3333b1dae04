"""Each path's balance across data-parallel ranks, on paper: what ``sftpack plan`` shows.

A step is as slow as its slowest rank. :func:`plan_paths` takes the lengths of a
dataset's sequences and simulates every path, step by step over consecutive global
batches, with the paths' own planners and the one cost model
(:class:`~sftpack.balance.SequenceCost`):

- **trainer**: each step's global batch of ``global_batch`` sequences planned by
  :func:`sftpack.trainer.plan_microbatches` over ``dp`` ranks (micro-batches of at most
  ``max_seq_len`` tokens, the same number on every rank);
- **offline**: rows of ``max_seq_len`` slots filled by BFD over all the lengths, as
  ``sftpack prepack`` fills them (:func:`sftpack.offline.plan_rows`), taken
  ``dp * rows_per_rank`` a step in one order that does not depend on the world size, and
  each step's rows dealt to the ranks by cost (:func:`sftpack.balance.deal`);
- **loader**: the offline rows again: the loader's buffer packs a stream with the same
  planner (BFD on the padded lengths), so its rows are nearly the offline ones and they
  are dealt the same way; :mod:`sftpack.loader` offers no lengths-only packer to run here;
- **dynamic_cp**: the trainer path with context parallelism sized per sequence (``cp > 1``):
  each step's global batch planned by :func:`sftpack.balance.dynamic_cp` over the ``dp``
  ranks, a long sequence spread over an aligned group of up to ``cp`` of them.

Order: the lengths are read in a seeded permutation (``seed``; ``shuffle=False``: as
given), the permutation ``sftpack train`` draws its first epoch from; the offline rows in
a seeded permutation of the rows.

Per path (:class:`PathPlan`): ``max / mean`` of the ranks' cost per step (1.00: no
straggler), its mean and its worst step; the bound no plan of those items can beat
(:func:`~sftpack.balance.lower_bound`: the heaviest sequence or row, without context
parallelism); micro-batches (or rows) per rank; the padding (the share of the slots,
``max_seq_len`` each, that hold no real token); the ranks' loads in the worst step.
Sequences are charged on their length rounded up to the pad multiple (``2 * cp`` when
``cp > 1``), as the paths charge them.

>>> r = plan_paths([5, 10, 3, 8, 6, 7, 2, 9], dp=2, global_batch=4, max_seq_len=16, shuffle=False)
>>> t = r.paths["trainer"]
>>> t.steps, round(t.max_over_mean, 3), t.microbatches_per_rank  # 13 | 13, then 13 | 11 (no split is even)
(2, 1.042, 1.0)
>>> o = r.paths["offline"]
>>> o.available, o.steps, o.microbatches_per_rank
(True, 2, 1.0)
>>> r.paths["dynamic_cp"].available  # cp=1: nothing to spread a sequence over
False
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .._base import round_up
from .._optional import pyplot
from .._types import Tokenizer
from ..balance import SequenceCost, deal, dynamic_cp, lower_bound, max_over_mean, sequence_cost
from ..chat import ReadStats, TokenizeStats, read_conversations, tokenize_conversations
from ..offline import PrepackedDataset, plan_rows, read_manifest
from ..trainer import plan_microbatches

__all__ = [
    "PATHS",
    "Lengths",
    "LengthsError",
    "PathPlan",
    "PlanReport",
    "conversation_lengths",
    "data_kind",
    "draw_plan",
    "format_plan",
    "plan_paths",
    "read_lengths",
]

#: the paths :func:`plan_paths` reports, in its order
PATHS = ("trainer", "offline", "loader", "dynamic_cp")
#: steps simulated per path by default
DEFAULT_STEPS = 8


class LengthsError(ValueError):
    """Lengths that cannot be planned (the message names the file, line or index, and the fix)."""


# ---------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class PathPlan:
    """One path's balance over the simulated steps (``available=False``: ``reason`` says why
    it was not simulated, and the numbers are ``None``)."""

    path: str
    available: bool
    reason: str = ""  #: why the path was not simulated
    note: str = ""  #: how it was simulated, where that needs saying
    steps: int = 0
    max_over_mean: float | None = None  #: mean over steps of max / mean of the ranks' cost
    worst: float | None = None  #: the worst step's max / mean
    worst_step: int | None = None  #: its index (0-based)
    worst_bound: float | None = None  #: the worst step's bound
    bound: float | None = None  #: mean over steps of the best max / mean any plan of its items reaches
    microbatches_per_rank: float | None = None  #: mean over steps (offline, loader: rows per rank)
    padding: float | None = None  #: share of the slots (``max_seq_len`` per micro-batch or row) not holding a token
    loads: np.ndarray | None = field(default=None, repr=False)  #: ``(dp,)`` cost per rank of the worst step

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready fields; ``worst_step_loads``: the worst step's rank loads over their mean."""
        out: dict[str, Any] = {
            "available": self.available,
            "max_over_mean": self.max_over_mean,
            "worst": self.worst,
            "worst_step": self.worst_step,
            "worst_bound": self.worst_bound,
            "bound": self.bound,
            "microbatches_per_rank": self.microbatches_per_rank,
            "padding": self.padding,
            "steps": self.steps,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.note:
            out["note"] = self.note
        if self.loads is not None:
            mean = float(self.loads.mean())
            rel = self.loads / mean if mean > 0 else np.ones_like(self.loads)
            out["worst_step_loads"] = [round(float(v), 6) for v in rel]
        return out


@dataclass(frozen=True)
class PlanReport:
    """:func:`plan_paths`' settings and one :class:`PathPlan` per path (:data:`PATHS`)."""

    dp: int
    cp: int
    global_batch: int
    max_seq_len: int
    pad_multiple: int
    rows_per_rank: int
    cost: SequenceCost
    sequences: int
    tokens: int
    seed: int
    shuffle: bool
    paths: dict[str, PathPlan]

    def to_dict(self) -> dict[str, Any]:
        """What ``sftpack plan --json`` prints (besides the data's name)."""
        return {
            "settings": {
                "dp": self.dp,
                "cp": self.cp,
                "global_batch": self.global_batch,
                "max_seq_len": self.max_seq_len,
                "pad_multiple": self.pad_multiple,
                "rows_per_rank": self.rows_per_rank,
                "seed": self.seed,
                "shuffle": self.shuffle,
            },
            "cost": {
                "name": self.cost.name,
                "per_token": self.cost.per_token,
                "per_token_squared": self.cost.per_token_squared,
            },
            "sequences": self.sequences,
            "tokens": self.tokens,
            "paths": {name: p.to_dict() for name, p in self.paths.items()},
        }


# ---------------------------------------------------------------------------- the simulation


def plan_paths(
    lengths: ArrayLike,
    *,
    dp: int,
    cp: int = 1,
    global_batch: int,
    max_seq_len: int,
    cost: SequenceCost | str | Path | None = None,
    steps: int = DEFAULT_STEPS,
    rows_per_rank: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
) -> PlanReport:
    """Simulate every path on ``lengths`` (see the module's text).

    Args:
        lengths: ``(n,)`` sequence lengths (integers >= 1, each within ``max_seq_len`` once
            padded to ``2 * cp``).
        dp: data-parallel ranks; cp: context-parallel size (sequences padded to ``2 * cp``).
        global_batch: sequences per step (the trainer path).
        max_seq_len: the micro-batch budget and the row width, in tokens.
        cost: a :class:`~sftpack.balance.SequenceCost` or a spelling of one
            (:func:`~sftpack.balance.sequence_cost`; ``None``: tokens).
        steps: steps simulated per path, at most (fewer when the data runs out).
        rows_per_rank: offline and loader rows per rank per step; ``None``: the rows a
            global batch of sequences fills on average, per rank, at least 1.
        seed, shuffle: the order the lengths (and the rows) are taken in.
    """
    model = sequence_cost(cost)
    for name, v in (("dp", dp), ("cp", cp), ("global_batch", global_batch), ("max_seq_len", max_seq_len)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise LengthsError(f"{name} must be a whole number >= 1, got {v!r}")
    if not isinstance(steps, (int, np.integer)) or steps < 1:
        raise LengthsError(f"steps must be a whole number >= 1, got {steps!r}")
    pad = 2 * cp if cp > 1 else 1
    if max_seq_len % pad:
        raise LengthsError(
            f"max_seq_len {max_seq_len} is not a multiple of 2*cp = {pad} (the context-parallel padding): use "
            f"{max(pad, max_seq_len // pad * pad)}"
        )
    if global_batch < dp:
        raise LengthsError(
            f"global_batch {global_batch} is less than dp {dp}: every rank needs at least one sequence a step; "
            f"use a global batch of at least {dp}"
        )
    arr = _checked(lengths, max_seq_len, pad)
    n = int(arr.shape[0])
    order = np.random.default_rng([seed, 0]).permutation(n) if shuffle else np.arange(n)
    stream = arr[order]

    trainer = _trainer(stream, model, dp, global_batch, max_seq_len, pad, steps)
    rows = plan_rows(arr, max_seq_len=max_seq_len, pad_multiple=pad)
    if rows_per_rank is None:
        rows_per_rank = max(1, round(global_batch * rows.num_rows / (n * dp)))
    elif rows_per_rank < 1:
        raise LengthsError(f"rows_per_rank must be >= 1, got {rows_per_rank}")
    offline = _offline(rows, model, dp, rows_per_rank, max_seq_len, pad, steps, seed, shuffle)
    loader = dataclasses.replace(
        offline,
        path="loader",
        note="the offline rows: the loader's buffer packs the stream with the same planner (BFD on padded "
        "lengths), so its rows are nearly these; dealt by cost the same way",
    )
    paths = {
        "trainer": trainer,
        "offline": offline,
        "loader": loader,
        "dynamic_cp": _dynamic_cp(stream, model, dp, cp, global_batch, max_seq_len, steps),
    }
    return PlanReport(
        dp=int(dp),
        cp=int(cp),
        global_batch=int(global_batch),
        max_seq_len=int(max_seq_len),
        pad_multiple=pad,
        rows_per_rank=int(rows_per_rank),
        cost=model,
        sequences=n,
        tokens=int(arr.sum()),
        seed=int(seed),
        shuffle=bool(shuffle),
        paths=paths,
    )


def _checked(lengths: ArrayLike, max_seq_len: int, pad: int) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise LengthsError(f"lengths must be a 1-D array of whole numbers, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size == 0:
        raise LengthsError("no lengths to plan: give at least one sequence")
    if arr.min() < 1:
        i = int(np.flatnonzero(arr < 1)[0])
        raise LengthsError(f"lengths[{i}] = {int(arr[i])}: every sequence holds at least one token")
    over = np.flatnonzero(round_up(arr, pad) > max_seq_len)
    if over.size:
        i = int(over[0])
        raise LengthsError(
            f"lengths[{i}] = {int(arr[i])} is more than max_seq_len {max_seq_len} (once padded to a multiple of "
            f"{pad}): raise max_seq_len to {int(round_up(arr.max(), pad))}, or split the longer sequences"
        )
    return arr


def _summary(
    path: str,
    ratios: list[float],
    bounds: list[float],
    per_rank: list[float],
    real: int,
    slots: int,
    worst_loads: np.ndarray,
    worst_step: int,
) -> PathPlan:
    return PathPlan(
        path=path,
        available=True,
        steps=len(ratios),
        max_over_mean=float(np.mean(ratios)),
        worst=float(max(ratios)),
        worst_step=worst_step,
        worst_bound=float(bounds[worst_step]),
        bound=float(np.mean(bounds)),
        microbatches_per_rank=float(np.mean(per_rank)),
        padding=1.0 - real / slots if slots else 0.0,
        loads=worst_loads,
    )


def _trainer(
    stream: np.ndarray, model: SequenceCost, dp: int, batch: int, width: int, pad: int, steps: int
) -> PathPlan:
    def plan(lengths: np.ndarray) -> Any:
        return plan_microbatches(lengths, width, dp_size=dp, cost=model, pad_multiple=pad)

    return _global_batches("trainer", stream, plan, dp, batch, width, steps)


def _global_batches(
    path: str, stream: np.ndarray, plan_of: Any, dp: int, batch: int, width: int, steps: int
) -> PathPlan:
    """A path that plans each step's global batch of sequences: ``plan_of(lengths)`` returns a
    :class:`~sftpack.balance.StepPlan`."""
    n_steps = min(steps, stream.shape[0] // batch)
    if n_steps == 0:
        return PathPlan(
            path,
            False,
            reason=f"{stream.shape[0]:,} sequences, fewer than one global batch of {batch:,}: give more data or a "
            "smaller global batch",
        )
    ratios: list[float] = []
    bounds: list[float] = []
    mbs: list[float] = []
    real = slots = 0
    worst, worst_loads = 0, np.zeros(dp)
    for s in range(n_steps):
        lengths = stream[s * batch : (s + 1) * batch]
        plan = plan_of(lengths)
        ratios.append(plan.max_over_mean)
        bounds.append(plan.bound)
        mbs.append(float(plan.num_microbatches))
        real += int(lengths.sum())
        slots += dp * plan.num_microbatches * width
        if ratios[-1] > ratios[worst] or s == 0:
            worst, worst_loads = s, plan.rank_loads
    return _summary(path, ratios, bounds, mbs, real, slots, worst_loads, worst)


def _offline(
    rows: Any,
    model: SequenceCost,
    dp: int,
    k: int,
    width: int,
    pad: int,
    steps: int,
    seed: int,
    shuffle: bool,
) -> PathPlan:
    starts = rows.row_offsets[:-1]
    row_cost = model.of_groups(round_up(rows.lengths, pad), rows.row_offsets)
    row_tokens = np.add.reduceat(rows.lengths, starts)
    per_step = dp * k
    n_steps = min(steps, rows.num_rows // per_step)
    if n_steps == 0:
        return PathPlan(
            "offline",
            False,
            reason=f"{rows.num_rows:,} rows of {width:,} slots, fewer than one step's {per_step:,} ({dp:,} ranks x "
            f"{k} a rank): give more data, fewer ranks or a smaller max_seq_len",
        )
    order = np.random.default_rng([seed, 1]).permutation(rows.num_rows) if shuffle else np.arange(rows.num_rows)
    ratios: list[float] = []
    bounds: list[float] = []
    real = slots = 0
    worst, worst_loads = 0, np.zeros(dp)
    for s in range(n_steps):
        idx = order[s * per_step : (s + 1) * per_step]
        costs = row_cost[idx]
        dealt = deal(costs, dp, k)
        loads = costs[dealt].sum(axis=1)
        ratios.append(max_over_mean(loads))
        bounds.append(lower_bound(costs, dp, per_rank=k))
        real += int(row_tokens[idx].sum())
        slots += per_step * width
        if ratios[-1] > ratios[worst] or s == 0:
            worst, worst_loads = s, loads
    return _summary("offline", ratios, bounds, [float(k)] * n_steps, real, slots, worst_loads, worst)


def _dynamic_cp(
    stream: np.ndarray, model: SequenceCost, dp: int, cp: int, batch: int, width: int, steps: int
) -> PathPlan:
    """The trainer path with context parallelism sized per sequence (:func:`sftpack.balance.dynamic_cp`
    over the ``dp`` ranks, groups of up to ``cp``): each step's global batch, as :func:`_trainer`."""
    if cp == 1:
        return PathPlan("dynamic_cp", False, reason="cp 1: no context-parallel ranks to spread a long sequence over")

    def plan(lengths: np.ndarray) -> Any:
        return dynamic_cp(lengths, ranks=dp, max_cp=cp, max_seq_len=width, cost=model)

    return _global_batches("dynamic_cp", stream, plan, dp, batch, width, steps)


# ---------------------------------------------------------------------------- the inputs


@dataclass(frozen=True)
class Lengths:
    """Sequence lengths read from a file, with where each came from (for errors)."""

    values: np.ndarray  #: ``(n,)`` int64
    source: str  #: the file or directory, in words
    lines: np.ndarray | None = None  #: ``(n,)`` 1-based line of each value (a text file)

    def where(self, i: int) -> str:
        """Where value ``i`` was read: ``FILE line N``, ``FILE[i]``."""
        if self.lines is not None:
            return f"{self.source} line {int(self.lines[i])}"
        return f"{self.source}[{i}]"

    def check(self, max_seq_len: int, cp: int = 1) -> None:
        """Every length within ``max_seq_len`` once padded to ``2 * cp``; else a :class:`LengthsError`
        naming the first that is not."""
        pad = 2 * cp if cp > 1 else 1
        over = np.flatnonzero(round_up(self.values, pad) > max_seq_len)
        if over.size:
            i = int(over[0])
            raise LengthsError(
                f"{self.where(i)}: {int(self.values[i]):,} tokens, more than --max-seq-len {max_seq_len:,}"
                f"{f' once padded to a multiple of {pad}' if pad > 1 else ''} ({over.size:,} over it in all): raise "
                f"--max-seq-len to {int(round_up(self.values.max(), pad)):,}, or split the longer sequences"
            )


def data_kind(path: str | os.PathLike[str]) -> str:
    """``"prepack"`` (a directory with a manifest), ``"npy"``, ``"text"`` (``.txt``: one
    length a line) or ``"conversations"`` (anything else: chat files, folders, datasets)."""
    p = Path(path)
    if p.is_dir() and (p / "manifest.json").is_file():
        return "prepack"
    suffix = p.suffix.lower()
    if suffix == ".npy":
        return "npy"
    if suffix == ".txt":
        return "text"
    return "conversations"


def read_lengths(path: str | os.PathLike[str]) -> Lengths:
    """The lengths in a ``.txt`` file (one whole number a line; blank lines and ``#`` comments
    skipped), a ``.npy`` array, or a prepack directory (its stored sequences, pieces of split
    conversations each on their own)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    kind = data_kind(p)
    if kind == "prepack":
        read_manifest(p)  # a clear error for a directory that is not a whole prepack
        ds = PrepackedDataset(p, verify="size")
        return Lengths(np.asarray(ds.sequences["length"], dtype=np.int64), f"prepack {p}")
    if kind == "npy":
        return _read_npy(p)
    if kind == "text":
        return _read_text(p)
    raise LengthsError(f"{p}: not a lengths file (.txt one a line, or .npy) nor a prepack directory")


def _read_npy(p: Path) -> Lengths:
    try:
        arr = np.load(p, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise LengthsError(
            f"{p}: cannot read it as a .npy array of numbers ({' '.join(str(e).split())[:120]}); save the lengths "
            "with np.save(path, lengths), a 1-D integer array"
        ) from None
    if arr.ndim != 1:
        raise LengthsError(f"{p}: holds an array of shape {arr.shape}; save a 1-D array of lengths (np.save)")
    if arr.size and arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise LengthsError(f"{p}[{i}] = {arr[i]}: not a whole number of tokens; save integer lengths")
    elif arr.size and arr.dtype.kind not in "iu":
        raise LengthsError(f"{p}: holds {arr.dtype} values; save integer lengths (np.save(path, lengths))")
    values = arr.astype(np.int64)
    got = Lengths(values, str(p))
    _at_least_one(got)
    return got


def _read_text(p: Path) -> Lengths:
    values: list[int] = []
    lines: list[int] = []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LengthsError(f"{p}: not UTF-8 text; write one sequence length a line") from None
    for no, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            v = int(s.replace("_", "").replace(",", ""))
        except ValueError:
            raise LengthsError(
                f"{p} line {no}: {s[:40]!r} is not a whole number of tokens; write one sequence length a line "
                "(blank lines and lines starting with # are skipped)"
            ) from None
        values.append(v)
        lines.append(no)
    got = Lengths(np.asarray(values, dtype=np.int64), str(p), np.asarray(lines, dtype=np.int64))
    _at_least_one(got)
    return got


def _at_least_one(got: Lengths) -> None:
    if got.values.size == 0:
        raise LengthsError(f"{got.source}: holds no lengths; write one sequence length a line")
    bad = np.flatnonzero(got.values < 1)
    if bad.size:
        i = int(bad[0])
        raise LengthsError(
            f"{got.where(i)}: {int(got.values[i])} is not a sequence length; every sequence holds at least one token"
        )


def conversation_lengths(
    paths: str | os.PathLike[str] | Iterable[Any],
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    on_bad_row: str = "error",
    split: str | None = None,
    limit: int | None = None,
    progress: bool = False,
) -> tuple[np.ndarray, ReadStats, TokenizeStats]:
    """The lengths of the sequences ``sftpack prepack`` would make of these conversation files:
    read by :func:`~sftpack.chat.read_conversations`, tokenized by
    :func:`~sftpack.chat.tokenize_conversations` (over-long ones split at ``max_seq_len``).
    Returns the lengths, the read stats and the tokenize stats."""
    reader = read_conversations(paths, on_bad_row=on_bad_row, split=split)
    conversations: Iterable[Any] = reader
    if limit is not None:
        conversations = itertools.islice(reader, limit)
    tokenized = tokenize_conversations(
        conversations, tokenizer, max_seq_len=max_seq_len, on_bad_row=on_bad_row, progress=progress
    )
    lengths = np.fromiter((len(s) for s in tokenized), dtype=np.int64)
    return lengths, reader.stats, tokenized.stats


# ---------------------------------------------------------------------------- the faces' text and picture


def format_plan(report: PlanReport) -> str:
    """The table ``sftpack plan`` prints: one line per path."""
    head = ("path", "max/mean", "worst step", "bound", "mb/rank", "padding", "steps")
    rows = [head]
    notes = []
    for name, p in report.paths.items():
        if not p.available:
            rows.append((name, "-", "-", "-", "-", "-", "0"))
            notes.append(f"  {name}: not simulated: {p.reason}")
            continue
        assert p.max_over_mean is not None and p.worst is not None and p.bound is not None
        assert p.microbatches_per_rank is not None and p.padding is not None
        rows.append(
            (
                name,
                f"{p.max_over_mean:.3f}",
                f"{p.worst:.3f} (#{p.worst_step})",
                f"{p.bound:.3f}",
                f"{p.microbatches_per_rank:.2f}",
                f"{p.padding:.2%}",
                f"{p.steps:,}",
            )
        )
        if p.note:
            notes.append(f"  {name}: {p.note}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join([*lines, *notes])


def draw_plan(report: PlanReport, out: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """A PNG of each simulated path's worst step: every rank's cost over the mean (bars), the
    mean (1.0) and that step's bound. Returns ``out``."""
    plt = pyplot("the per-rank load (--png)")
    shown: Mapping[str, PathPlan] = {k: p for k, p in report.paths.items() if p.available and p.loads is not None}
    fig, axes = plt.subplots(max(1, len(shown)), 1, figsize=(10, 2.4 * max(1, len(shown))), squeeze=False)
    for ax, (name, p) in zip(axes[:, 0], shown.items()):
        assert p.loads is not None and p.worst_bound is not None
        mean = float(p.loads.mean()) or 1.0
        ax.bar(np.arange(p.loads.shape[0]), p.loads / mean, width=1.0, color="tab:blue", linewidth=0)
        ax.axhline(1.0, color="black", linewidth=0.8, label="mean")
        ax.axhline(p.worst_bound, color="tab:red", linestyle="--", linewidth=0.8, label=f"bound {p.worst_bound:.2f}")
        ax.set(ylabel="cost / mean", xlim=(-0.5, p.loads.shape[0] - 0.5))
        ax.set_title(f"{name}: worst step #{p.worst_step}, max/mean {p.worst:.3f}", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    if not shown:
        axes[0, 0].text(0.5, 0.5, "no path simulated", ha="center", va="center")
        axes[0, 0].set_axis_off()
    axes[-1, 0].set_xlabel(f"data-parallel rank (of {report.dp:,})")
    fig.suptitle(title or f"cost per rank ({report.cost.name}), worst step of each path", fontsize=11)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
