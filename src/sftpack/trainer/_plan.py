"""Micro-batches of at most ``max_seq_len`` padded tokens, balanced over data-parallel ranks.

A global batch of sequences is split into micro-batches whose padded tokens fit
the row width ``max_seq_len`` (one packed row each, built at the step by
:func:`~sftpack.trainer.pack_step`). Planning goes ranks first, then rows:

1. **The ranks' shares**: every sequence priced by the cost model
   (:class:`sftpack.balance.SequenceCost`: ``"tokens"``, ``"attention"``, a model size,
   a model's config) and dealt by :func:`sftpack.balance.assign` (LPT, then moves and
   swaps), so the slowest rank is as close to the mean as the heaviest sequence allows.
   A rank's work is the sum of its sequences' whatever the micro-batches they land in,
   so balancing sequences, not bins, is what lets every rank end even.
2. **Each share's micro-batches**: the rank's sequences packed by
   :func:`sftpack.binpack.pack` with ``cost_multiple=pad_multiple`` (the planner charges
   every sequence exactly what ``pack_step`` will pad it to, so a planned micro-batch can
   never overflow: a mismatch between the two is a bug seen in the wild, "expanded size
   517 vs 502"). Every rank must run the same number of micro-batches (the gradient
   all-reduce waits for all of them): the ranks that need fewer split theirs
   (``min_bins``), and a rank with fewer sequences than that number takes the cheapest
   ones of the rank with the most. Each rank's micro-batches go heaviest first, so the
   ``i``-th of every rank are alike.

Samples with images bring a second size, their vision patches (what the vision
tower's activations grow with): given ``patches`` and ``max_patches_per_row``
(``sftpack train --max-patches-per-row``), every micro-batch holds at most that many
(the bin packer's second budget), so one image-heavy micro-batch cannot exhaust the
tower's memory while its neighbours hold none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .. import binpack
from .._base import positive_int, renamed, round_up, warn_renamed
from ..balance import CostError, SequenceCost, StepPlan, assign, lower_bound, sequence_cost

__all__ = ["MicrobatchPlan", "PlanError", "plan_microbatches"]


class PlanError(ValueError):
    """The global batch cannot be planned as asked (the message says why and how to fix it)."""


@dataclass
class MicrobatchPlan(StepPlan):
    """Micro-batches per data-parallel rank.

    Attributes:
        microbatches: ``microbatches[rank][i]`` is a 1-D int64 array of indices into
            the planned ``lengths``: the sequences of that rank's ``i``-th micro-batch.
            Every index appears exactly once over all ranks.
        loads: ``(dp_size, M)`` float64 cost of each micro-batch under ``cost``.
        tokens: ``(dp_size, M)`` int64 padded tokens of each micro-batch
            (``<= max_seq_len``).
        max_seq_len, pad_multiple, cost: the settings it was planned with (``cost``: the
            :class:`~sftpack.balance.SequenceCost`) (``token_budget``:
            the deprecated name of ``max_seq_len``, read with a ``DeprecationWarning`` until
            the next release).
        patches: ``(dp_size, M)`` vision patches of each micro-batch, when planned with
            ``patches`` (else ``None``).
    """

    microbatches: list[list[np.ndarray]]
    loads: np.ndarray
    tokens: np.ndarray
    max_seq_len: int
    pad_multiple: int
    cost: SequenceCost
    meta: dict[str, Any] = field(default_factory=dict)
    #: ``(dp_size, M)`` vision patches of each micro-batch (``None``: planned without ``patches``)
    patches: np.ndarray | None = None

    @property
    def token_budget(self) -> int:
        """Deprecated: :attr:`max_seq_len` (the same value)."""
        warn_renamed("MicrobatchPlan", "token_budget", "max_seq_len", stacklevel=3)
        return self.max_seq_len

    @property
    def dp_size(self) -> int:
        return len(self.microbatches)

    @property
    def imbalance(self) -> float:
        """Slowest rank's load over the mean load (1.0 is perfect): :attr:`max_over_mean`."""
        return self.max_over_mean


def plan_microbatches(
    lengths: ArrayLike,
    max_seq_len: int | None = None,
    *,
    dp_size: int = 1,
    cost: SequenceCost | str | Path = "tokens",
    pad_multiple: int = 1,
    algorithm: str = "bfd",
    min_microbatches: int | None = None,
    max_sequences_per_microbatch: int | None = None,
    seed: int = 0,
    patches: ArrayLike | None = None,
    max_patches_per_row: int | None = None,
    token_budget: int | None = None,
    max_patches_per_microbatch: int | None = None,
    groups: ArrayLike | None = None,
) -> MicrobatchPlan:
    """Split a global batch into micro-batches of at most ``max_seq_len`` padded tokens,
    balanced over ranks.

    Args:
        lengths: ``(n,)`` real lengths of the global batch's sequences (>= 1 each).
        max_seq_len: padded tokens one micro-batch may hold: its packed row width, the
            ``max_seq_len`` of :func:`~sftpack.trainer.pack_step` (required).
        dp_size: data-parallel ranks; each gets the same number of micro-batches.
        cost: what is balanced across ranks: a :class:`~sftpack.balance.SequenceCost`, or
            a spelling of one (``"tokens"``, ``"attention"``, a size such as ``"7b"``, a model
            directory; :func:`~sftpack.balance.sequence_cost`), charged on padded lengths.
            Micro-batches are always bounded by tokens (memory).
        pad_multiple: the ``pad_multiple`` given to ``pack_step``; every sequence
            costs its length rounded up to it.
        algorithm: bin-packing algorithm of :func:`sftpack.binpack.pack` (within each rank).
        min_microbatches: at least this many micro-batches per rank (e.g. the
            pipeline-parallel depth).
        max_sequences_per_microbatch: cap on sequences per micro-batch.
        seed: for shuffling bin-packing algorithms.
        patches: ``(n,)`` vision patches of each sequence (``sample.num_patches``: 0
            for one without images), the second size of multimodal samples.
        max_patches_per_row: the second budget: a micro-batch's patches sum to
            at most this (needs ``patches``). ``None``: patches only counted.
        groups: ``(n,)`` integer group id per sequence (a DPO pair, a prompt's GRPO
            completions): a group's members land in one micro-batch of one rank. The
            ranks get whole groups (:func:`sftpack.balance.assign` with ``groups``) and
            each share is packed with whole groups (:func:`sftpack.binpack.pack` with
            ``groups``); ``max_sequences_per_microbatch`` counts members. ``None``:
            every sequence alone (the same plan as singleton groups).
        token_budget, max_patches_per_microbatch: the deprecated spellings of
            ``max_seq_len`` and ``max_patches_per_row`` (accepted, with a
            ``DeprecationWarning``, until the next release).

    Returns:
        :class:`MicrobatchPlan`.

    Raises:
        PlanError: fewer sequences (groups) than ``dp_size * min_microbatches`` (some
            rank would get nothing), a sequence (group) over ``max_seq_len`` once padded
            (or over the patch budget), bad options.

    >>> plan = plan_microbatches([5, 10, 3, 8, 6, 7], max_seq_len=16, dp_size=2, pad_multiple=4)
    >>> [[mb.tolist() for mb in rank] for rank in plan.microbatches]
    [[[1, 2], [4]], [[0, 3], [5]]]
    >>> plan.tokens.tolist()  # padded tokens per micro-batch (each <= 16)
    [[16, 8], [16, 8]]
    >>> pairs = [0, 1, 1, 2, 0, 2, 3, 3]  # (0, 4), (1, 2), (3, 5), (6, 7): each in one micro-batch
    >>> plan = plan_microbatches([5, 10, 3, 8, 6, 7, 2, 1], 16, dp_size=2, pad_multiple=4, groups=pairs)
    >>> [[mb.tolist() for mb in rank] for rank in plan.microbatches]
    [[[0, 4], [3, 5]], [[1, 2], [6, 7]]]
    """
    try:
        model = sequence_cost(cost)
    except CostError as e:
        raise PlanError(str(e)) from None
    width = renamed("plan_microbatches", "max_seq_len", max_seq_len, "token_budget", token_budget)
    max_seq_len = positive_int("max_seq_len", width, error=PlanError, who="plan_microbatches")
    dp_size = positive_int("dp_size", dp_size, error=PlanError)
    pad_multiple = positive_int("pad_multiple", pad_multiple, error=PlanError)
    per_rank = 1 if min_microbatches is None else int(min_microbatches)
    if per_rank < 1:
        raise PlanError(f"min_microbatches must be >= 1, got {min_microbatches}")
    arr = np.asarray(lengths.detach().cpu().numpy() if hasattr(lengths, "detach") else lengths)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise PlanError(f"lengths must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    n = arr.shape[0]
    grouped = _groups(groups, n)
    units = n if grouped is None else len(grouped)
    noun = "sequences" if grouped is None else f"groups ({n} sequences, a group never split)"
    need = dp_size * per_rank
    if units < need:
        raise PlanError(
            f"{units} {noun} cannot give {dp_size} data-parallel ranks {per_rank} micro-batch(es) each ({need} "
            "needed): some rank would get nothing and the gradient all-reduce would hang; grow the global batch "
            "or shrink dp_size / min_microbatches"
        )
    if n and arr.min() < 1:
        i = int(np.flatnonzero(arr < 1)[0])
        raise PlanError(f"lengths[{i}] = {int(arr[i])}: drop empty sequences before planning")
    padded = round_up(arr, pad_multiple)
    over = np.flatnonzero(padded > max_seq_len)
    if over.size:
        i = int(over[0])
        raise PlanError(
            f"sequence {i} has {int(arr[i])} tokens, {int(padded[i])} once padded to a multiple of {pad_multiple}, "
            f"more than max_seq_len={max_seq_len}: truncate it when tokenizing or raise max_seq_len to "
            f"{int(padded[i])}"
        )

    per_row = renamed(
        "plan_microbatches",
        "max_patches_per_row",
        max_patches_per_row,
        "max_patches_per_microbatch",
        max_patches_per_microbatch,
    )
    patch_w, cap = _patches(patches, per_row, n)
    if grouped is not None:
        _check_groups(grouped, padded, max_seq_len, max_sequences_per_microbatch, patch_w, cap)
    costs = model(padded)
    owner = assign(costs, dp_size, groups=None if grouped is None else grouped.unit)
    unit = np.arange(n, dtype=np.int64) if grouped is None else grouped.unit
    shares = [np.flatnonzero(owner == r) for r in range(dp_size)]

    def bins_of(idx: np.ndarray, at_least: int) -> list[np.ndarray]:
        if (
            at_least == 1
            and padded[idx].sum() <= max_seq_len
            and (max_sequences_per_microbatch is None or idx.size <= max_sequences_per_microbatch)
            and (cap is None or patch_w is None or patch_w[idx].sum() <= cap)
        ):
            return [idx]  # the whole share fits one micro-batch
        try:
            got = binpack.pack(
                arr[idx],
                int(max_seq_len),
                algorithm,
                cost_multiple=int(pad_multiple),
                max_items_per_bin=max_sequences_per_microbatch,
                min_bins=at_least,
                seed=seed,
                weights=None if patch_w is None else patch_w[idx],
                max_weight_per_bin=cap,
                groups=None if grouped is None else unit[idx],
            )
        except ValueError as e:
            raise PlanError(
                f"cannot give {dp_size} data-parallel ranks the same number of micro-batches of <= {max_seq_len} "
                f"tokens from {n} sequences: {e}"
            ) from e
        return [idx[np.asarray(b, dtype=np.int64)] for b in got]

    per_share = [bins_of(idx, per_rank) for idx in shares]
    m = max(len(b) for b in per_share)
    _even_out(shares, m, costs, unit, dp_size, max_seq_len, noun)
    planned: list[list[np.ndarray]] = []
    for idx, bins in zip(shares, per_share):
        got = bins if len(bins) == m and sum(b.size for b in bins) == idx.size else bins_of(idx, m)
        if len(got) != m or any(b.size == 0 for b in got):
            raise PlanError(
                f"cannot give {dp_size} data-parallel ranks the same number of micro-batches of <= {max_seq_len} "
                f"tokens from {n} sequences: a share of {idx.size} sequences packs into {len(got)} micro-batches, "
                f"not {m}; grow the global batch or raise max_seq_len"
            )
        # heaviest first: the i-th micro-batches of all ranks run together
        loads = [float(costs[b].sum()) for b in got]
        planned.append([got[k] for k in sorted(range(m), key=lambda k: (-loads[k], k))])
    tokens = np.array([[int(padded[b].sum()) for b in rank] for rank in planned], dtype=np.int64)
    if tokens.max() > max_seq_len:
        raise PlanError(f"binpack returned a bin of {int(tokens.max())} tokens over max_seq_len={max_seq_len}; a bug")
    return MicrobatchPlan(
        microbatches=planned,
        loads=np.array([[float(costs[b].sum()) for b in rank] for rank in planned], dtype=np.float64),
        tokens=tokens,
        max_seq_len=int(max_seq_len),
        pad_multiple=int(pad_multiple),
        cost=model,
        meta={
            "algorithm": str(algorithm),
            "bins": m * dp_size,
            "bound": lower_bound(costs if grouped is None else grouped.sum(costs), dp_size),
        },
        patches=None
        if patch_w is None
        else np.array([[int(patch_w[b].sum()) for b in rank] for rank in planned], dtype=np.int64),
    )


def _even_out(
    shares: list[np.ndarray], m: int, costs: np.ndarray, unit: np.ndarray, dp_size: int, width: int, noun: str
) -> None:
    """Give every share at least ``m`` units (``unit``: each sequence's group, or itself; each
    micro-batch needs one), taking the cheapest unit (then the lowest number) of the share with
    the most; in place."""
    units = int(np.unique(unit).size)
    if units < m * dp_size:
        raise PlanError(
            f"cannot give {dp_size} data-parallel ranks the same number of micro-batches of <= {width} tokens "
            f"from {units} {noun}: {m} micro-batches per rank need {m * dp_size} {noun.split()[0]}; grow the "
            "global batch, raise max_seq_len or use fewer ranks"
        )

    def count(share: np.ndarray) -> int:  # units in a share: its size when every sequence is its own
        return int(share.size) if units == unit.size else int(np.unique(unit[share]).size)

    for r in range(dp_size):
        while count(shares[r]) < m:
            donor = max(range(dp_size), key=lambda q: (count(shares[q]), -q))
            d = shares[donor]
            ids, inverse = np.unique(unit[d], return_inverse=True)
            k = ids[int(np.lexsort((ids, np.bincount(inverse.reshape(-1), weights=costs[d])))[0])]
            take = unit[d] == k
            shares[r] = np.sort(np.append(shares[r], d[take]))
            shares[donor] = d[~take]


def _groups(groups: ArrayLike | None, n: int) -> binpack.Groups | None:
    """``groups`` as :class:`sftpack.binpack.Groups` of the ``n`` sequences (``None``: none)."""
    if groups is None:
        return None
    try:
        return binpack.Groups.of(groups, n)
    except (ValueError, TypeError) as e:
        raise PlanError(str(e)) from None


def _check_groups(
    grouped: binpack.Groups,
    padded: np.ndarray,
    width: int,
    max_sequences: int | None,
    patch_w: np.ndarray | None,
    cap: int | None,
) -> None:
    """Every group fits one micro-batch: its padded tokens, its sequence count and its patches."""
    for what, sums, limit, fix in (
        ("padded tokens", grouped.sum(padded), width, "raise max_seq_len to"),
        ("sequences", grouped.sizes, max_sequences, "raise max_sequences_per_microbatch to"),
        ("vision patches", None if patch_w is None else grouped.sum(patch_w), cap, "raise max_patches_per_row to"),
    ):
        if sums is None or limit is None or not len(grouped) or int(sums.max()) <= limit:
            continue
        g = int(np.flatnonzero(sums > limit)[0])
        raise PlanError(
            f"{grouped.describe(g)} has {int(sums[g]):,} {what} in all, more than one micro-batch holds "
            f"({limit:,}): a group is never split over micro-batches; drop or truncate its sequences, or "
            f"{fix} at least {int(sums[g])}"
        )


def _patches(patches: ArrayLike | None, cap: int | None, n: int) -> tuple[np.ndarray | None, int | None]:
    """``patches`` as ``(n,)`` int64 and the budget, checked (every sequence within it)."""
    if patches is None:
        if cap is not None:
            raise PlanError("max_patches_per_row needs patches: the vision patches of each sequence")
        return None, None
    budget = None if cap is None else positive_int("max_patches_per_row", cap, error=PlanError)
    w = np.asarray(patches.detach().cpu().numpy() if hasattr(patches, "detach") else patches)
    if w.shape != (n,) or w.dtype.kind not in "iu":
        raise PlanError(f"patches must be a 1-D integer array of {n} entries, got shape {w.shape} dtype {w.dtype}")
    w = w.astype(np.int64)
    if n and w.min() < 0:
        i = int(np.flatnonzero(w < 0)[0])
        raise PlanError(f"patches[{i}] = {int(w[i])}: a sequence holds 0 or more vision patches")
    if budget is not None and n and w.max() > budget:
        i = int(np.argmax(w))
        raise PlanError(
            f"sequence {i} has {int(w[i]):,} vision patches, more than max_patches_per_row={budget:,}: no "
            f"micro-batch can hold it; raise the patch budget to at least {int(w[i]):,} (--max-patches-per-row) "
            "or make its images smaller"
        )
    return w, budget
