"""Micro-batches of at most ``max_seq_len`` padded tokens, dealt evenly to data-parallel ranks.

A global batch of sequences is split into micro-batches whose padded tokens fit
the row width ``max_seq_len`` (one packed row each, built at the step by
:func:`~sftpack.trainer.pack_step`). The bins come from
:func:`sftpack.binpack.pack` with ``cost_multiple=pad_multiple``: the planner
charges every sequence exactly what ``pack_step`` will pad it to, so a planned
micro-batch can never overflow (a mismatch between the two is a bug seen in the
wild: "expanded size 517 vs 502").

Every rank must run the same number of micro-batches (the gradient all-reduce
waits for all of them), so the bin count is a multiple of the data-parallel
size (``bins_multiple_of``; bins are split when there are too few). Bins are
then dealt longest-processing-time first: heaviest bin to the least loaded rank
that still has room, which keeps the slowest rank within one bin of the mean.
``cost="attention"`` weighs a bin by the sum of its squared lengths (causal
attention FLOPs) instead of its tokens.

Samples with images bring a second size, their vision patches (what the vision
tower's activations grow with): given ``patches`` and ``max_patches_per_row``
(``sftpack train --max-patches-per-row``), every micro-batch holds at most that many
(the bin packer's second budget), so one image-heavy micro-batch cannot exhaust the
tower's memory while its neighbours hold none.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .. import binpack
from .._base import StrEnum, choose, positive_int, renamed, round_up, warn_renamed

__all__ = ["CostModel", "MicrobatchPlan", "PlanError", "plan_microbatches"]


class CostModel(StrEnum):
    """What "balanced" means across data-parallel ranks."""

    TOKENS = "tokens"  #: padded tokens per rank: linear layers, MLP, memory
    ATTENTION = "attention"  #: sum of squared padded lengths: causal attention FLOPs


class PlanError(ValueError):
    """The global batch cannot be planned as asked (the message says why and how to fix it)."""


@dataclass
class MicrobatchPlan:
    """Micro-batches per data-parallel rank.

    Attributes:
        microbatches: ``microbatches[rank][i]`` is a 1-D int64 array of indices into
            the planned ``lengths``: the sequences of that rank's ``i``-th micro-batch.
            Every index appears exactly once over all ranks.
        loads: ``(dp_size, M)`` int64 cost of each micro-batch under ``cost``.
        tokens: ``(dp_size, M)`` int64 padded tokens of each micro-batch
            (``<= max_seq_len``).
        max_seq_len, pad_multiple, cost: the settings it was planned with (``token_budget``:
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
    cost: CostModel
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
    def num_microbatches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.microbatches[0])

    @property
    def rank_loads(self) -> np.ndarray:
        """``(dp_size,)`` total cost per rank."""
        return self.loads.sum(axis=1)

    @property
    def imbalance(self) -> float:
        """Slowest rank's load over the mean load (1.0 is perfect)."""
        r = self.rank_loads
        return float(r.max() / r.mean()) if r.mean() > 0 else 1.0

    def __getitem__(self, rank: int) -> list[np.ndarray]:
        return self.microbatches[rank]


def plan_microbatches(
    lengths: ArrayLike,
    max_seq_len: int | None = None,
    *,
    dp_size: int = 1,
    cost: CostModel | str = "tokens",
    pad_multiple: int = 1,
    algorithm: str = "bfd",
    min_microbatches: int | None = None,
    max_sequences_per_microbatch: int | None = None,
    seed: int = 0,
    patches: ArrayLike | None = None,
    max_patches_per_row: int | None = None,
    token_budget: int | None = None,
    max_patches_per_microbatch: int | None = None,
) -> MicrobatchPlan:
    """Split a global batch into micro-batches of at most ``max_seq_len`` padded tokens,
    balanced over ranks.

    Args:
        lengths: ``(n,)`` real lengths of the global batch's sequences (>= 1 each).
        max_seq_len: padded tokens one micro-batch may hold: its packed row width, the
            ``max_seq_len`` of :func:`~sftpack.trainer.pack_step` (required).
        dp_size: data-parallel ranks; each gets the same number of micro-batches.
        cost: ``"tokens"`` or ``"attention"`` (:class:`CostModel`): what is balanced
            across ranks. Bins are always bounded by tokens (memory).
        pad_multiple: the ``pad_multiple`` given to ``pack_step``; every sequence
            costs its length rounded up to it.
        algorithm: bin-packing algorithm of :func:`sftpack.binpack.pack`.
        min_microbatches: at least this many micro-batches per rank (e.g. the
            pipeline-parallel depth).
        max_sequences_per_microbatch: cap on sequences per micro-batch.
        seed: for shuffling algorithms.
        patches: ``(n,)`` vision patches of each sequence (``sample.num_patches``: 0
            for one without images), the second size of multimodal samples.
        max_patches_per_row: the second budget: a micro-batch's patches sum to
            at most this (needs ``patches``). ``None``: patches only counted.
        token_budget, max_patches_per_microbatch: the deprecated spellings of
            ``max_seq_len`` and ``max_patches_per_row`` (accepted, with a
            ``DeprecationWarning``, until the next release).

    Returns:
        :class:`MicrobatchPlan`.

    Raises:
        PlanError: fewer sequences than ``dp_size * min_microbatches`` (some rank
            would get nothing), a sequence over ``max_seq_len`` once padded (or over the
            patch budget), bad options.

    >>> plan = plan_microbatches([5, 10, 3, 8, 6, 7], max_seq_len=16, dp_size=2, pad_multiple=4)
    >>> [[mb.tolist() for mb in rank] for rank in plan.microbatches]
    [[[0, 3], [1]], [[4, 5], [2]]]
    >>> plan.tokens.tolist()  # padded tokens per micro-batch (each <= 16)
    [[16, 12], [16, 4]]
    """
    cost = choose(CostModel, cost, "cost", PlanError)
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
    need = dp_size * per_rank
    if n < need:
        raise PlanError(
            f"{n} sequences cannot give {dp_size} data-parallel ranks {per_rank} micro-batch(es) each ({need} "
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
    try:
        bins = binpack.pack(
            arr,
            int(max_seq_len),
            algorithm,
            cost_multiple=int(pad_multiple),
            max_items_per_bin=max_sequences_per_microbatch,
            min_bins=need,
            bins_multiple_of=dp_size,
            seed=seed,
            weights=patch_w,
            max_weight_per_bin=cap,
        )
    except ValueError as e:
        # Typically: the sequences need more micro-batches than can be dealt evenly
        # (3 long sequences, 2 ranks: 4 micro-batches needed, only 3 sequences).
        raise PlanError(
            f"cannot give {dp_size} data-parallel ranks the same number of micro-batches of <= {max_seq_len} "
            f"tokens from {n} sequences: {e}"
        ) from e
    nb = len(bins)
    if nb % dp_size or nb < need or any(len(b) == 0 for b in bins):
        raise PlanError(f"binpack returned {nb} bins for dp_size={dp_size} (needed a non-empty multiple); a bug")
    tokens = np.array([int(padded[b].sum()) for b in bins], dtype=np.int64)
    weights = tokens if cost is CostModel.TOKENS else np.array([int((padded[b] ** 2).sum()) for b in bins], np.int64)
    if tokens.max() > max_seq_len:
        raise PlanError(f"binpack returned a bin of {int(tokens.max())} tokens over max_seq_len={max_seq_len}; a bug")

    # Longest processing time first, with a cardinality cap: heaviest bin to the
    # least loaded rank that still has room for one more micro-batch.
    per = nb // dp_size
    heap = [(0, r) for r in range(dp_size)]
    assigned: list[list[int]] = [[] for _ in range(dp_size)]
    for b in np.argsort(-weights, kind="stable"):
        load, r = heapq.heappop(heap)
        assigned[r].append(int(b))
        if len(assigned[r]) < per:
            heapq.heappush(heap, (load + int(weights[b]), r))
    return MicrobatchPlan(
        microbatches=[[np.asarray(bins[b], dtype=np.int64) for b in rank] for rank in assigned],
        loads=np.array([[weights[b] for b in rank] for rank in assigned], dtype=np.int64),
        tokens=np.array([[tokens[b] for b in rank] for rank in assigned], dtype=np.int64),
        max_seq_len=int(max_seq_len),
        pad_multiple=int(pad_multiple),
        cost=cost,
        meta={"algorithm": str(algorithm), "bins": nb},
        patches=None
        if patch_w is None
        else np.array([[int(patch_w[bins[b]].sum()) for b in rank] for rank in assigned], dtype=np.int64),
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
