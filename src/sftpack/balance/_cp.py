"""Dynamic context parallelism: each sequence of a step on as many ranks as it needs.

With a long tail, one sequence can cost more than a rank's share of the step: no deal of
whole sequences gets below :func:`~sftpack.balance.lower_bound` (5.2 at 1,024 ranks with
2% of the sequences at 16k to 131k tokens). Context parallelism (CP) spreads that sequence
over several ranks; *dynamic* CP does it for the long ones only and runs the rest whole
(CP=1), each step afresh. :func:`dynamic_cp` plans one step's global batch:

1. **Group size.** Sequence ``i`` gets the smallest power of two ``g`` in ``1 .. max_cp``
   such that (a) its padded length over ``g`` fits a rank's micro-batch,
   ``padded(l, g) / g <= max_seq_len``, and (b) its cost over ``g`` is at most the mean
   rank load, ``cost(padded(l, g)) / g <= total cost / ranks`` (so no rank holds more than
   an even share in one piece). A sequence that fits (a) only with ``max_cp`` but not (b)
   takes ``max_cp``; one that does not fit (a) even then is an error. Padding: a sequence
   on ``g > 1`` ranks is padded to a multiple of ``2 * g * pad_multiple`` (each of the
   ``2g`` chunks of :func:`~sftpack.handoff.shard_for_cp` equal; the same arithmetic as
   ``pad_multiple_for(cp_size=g).seq_multiple``), one on a single rank to ``pad_multiple``
   (:func:`cp_pad_multiple`).
2. **Groups.** A sequence of group size ``g`` runs on an *aligned* group, ranks
   ``g*k .. g*k+g-1``, so groups nest (a group of 2 lies inside one of 4) and a consumer
   creates every group once at start-up (:func:`cp_groups`), as Megatron's hybrid
   data/context-parallel groups are (one per power of two, aligned).
3. **Placement**, by cost per rank, heaviest first (LPT): a CP sequence's share
   ``cost / g`` goes to the aligned group whose most loaded rank is least loaded, a CP=1
   sequence to the least loaded rank. Every rank's cost is what it runs: its CP shares
   plus its whole sequences.
4. **Micro-batches.** A CP sequence is a micro-batch of its own, at the *same index on
   every rank of its group* (its collectives pair up); larger groups first: in that order
   the ranks of a group have always placed the same number of CP micro-batches before it
   (groups nest), so the indices are ``0, 1, ...`` with no gaps. Then each rank's CP=1
   sequences are packed into micro-batches of at most ``max_seq_len`` padded tokens
   (:func:`sftpack.binpack.pack`), heaviest first. Every rank runs the same number of
   micro-batches: ranks with fewer split theirs, and a rank with fewer sequences than
   that takes the cheapest CP=1 sequences of the rank with the most to spare.

Executing micro-batches in index order cannot deadlock: the ranks of a group meet at the
same index, and every rank goes up the indices. What a consumer reads for micro-batch
``m`` of rank ``r``, ``plan[r][m]`` (:class:`CPMicrobatch`): ``sequences`` (the batch's
indices, one packed row), ``local_cp_size`` (Megatron's ``PackedSeqParams.local_cp_size``),
``cp_group_ranks`` (the ranks of the group: the ``cp_group`` to hand ``PackedSeqParams``,
created with ``dist.new_group(cp_group_ranks)``) and ``cp_rank`` (this rank's place in it,
the ``cp_rank`` of :func:`~sftpack.handoff.shard_for_cp`).

Cost: ``O(n log n + CP sequences * ranks)`` plus one bin packing per rank; 16,384
sequences over 1,024 ranks in a fraction of a second.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from .. import binpack
from .._base import round_up
from ._assign import BalanceError
from ._cost import CostError, SequenceCost, sequence_cost
from ._plan import StepPlan

__all__ = ["CPMicrobatch", "DynamicCPPlan", "cp_groups", "cp_pad_multiple", "dynamic_cp"]


def cp_pad_multiple(cp_size: int, pad_multiple: int = 1) -> int:
    """The multiple a sequence on ``cp_size`` ranks is padded to: ``2 * cp_size * pad_multiple``
    (``pad_multiple`` alone for ``cp_size`` 1), what ``pack_step(pad_multiple=...)`` takes for
    its row. ``pad_multiple`` is what every sequence needs whatever its CP (e.g. the tensor-parallel
    size with sequence parallelism): ``handoff.pad_multiple_for(cp_size, tp, True).seq_multiple``
    is ``cp_pad_multiple(cp_size, tp)``.

    >>> [cp_pad_multiple(g) for g in (1, 2, 4, 8)], cp_pad_multiple(4, 2)
    ([1, 4, 8, 16], 16)
    """
    return (2 * cp_size if cp_size > 1 else 1) * pad_multiple


def cp_groups(ranks: int, max_cp: int) -> list[tuple[int, ...]]:
    """Every aligned group a plan over ``ranks`` with ``max_cp`` can use, in one fixed order
    (sizes ``2, 4, .. max_cp``, then by first rank): create them all at start-up, on every
    rank in this order (``dist.new_group`` is collective), and look each micro-batch's
    ``cp_group_ranks`` up among them.

    >>> cp_groups(4, 4)
    [(0, 1), (2, 3), (0, 1, 2, 3)]
    """
    _check_layout(ranks, max_cp)
    out: list[tuple[int, ...]] = []
    g = 2
    while g <= max_cp:
        out.extend(tuple(range(k, k + g)) for k in range(0, ranks, g))
        g *= 2
    return out


@dataclass(frozen=True, eq=False)  # arrays inside: compare their fields, not the objects
class CPMicrobatch:
    """One micro-batch of one rank: a packed row of ``sequences``, sharded over ``local_cp_size`` ranks.

    Attributes:
        sequences: ``(k,)`` int64 indices into the planned lengths, the row's sequences in order.
        local_cp_size: ranks the row is sharded over (``PackedSeqParams.local_cp_size``); 1: whole.
        cp_group_ranks: the group's ranks, ``g*k .. g*k+g-1`` (``(rank,)`` for 1): ``cp_group``
            of ``PackedSeqParams`` is the process group of these ranks.
        cp_rank: this rank's place in the group (``shard_for_cp(row, local_cp_size, cp_rank)``).
        tokens: padded tokens this rank holds (the row's padded length over ``local_cp_size``).
        cost: this rank's share of the row's cost (the row's cost over ``local_cp_size``).
    """

    sequences: np.ndarray
    local_cp_size: int
    cp_group_ranks: tuple[int, ...]
    cp_rank: int
    tokens: int
    cost: float


@dataclass(eq=False)
class DynamicCPPlan(StepPlan):
    """One step's global batch over ``ranks`` ranks with dynamic context parallelism.

    Attributes:
        microbatches: ``microbatches[rank][m]``, the same count ``M`` on every rank; a CP
            sequence's micro-batch is at the same ``m`` on every rank of its group.
        group_size: ``(n,)`` int64, each sequence's CP group size ``g``.
        first_rank: ``(n,)`` int64, the first rank of each sequence's group (its rank for ``g`` 1).
        loads: ``(ranks, M)`` float64, each micro-batch's cost on its rank.
        tokens: ``(ranks, M)`` int64, each micro-batch's padded tokens on its rank (``<= max_seq_len``).
        max_seq_len, max_cp, pad_multiple, cost: the settings it was planned with.
    """

    microbatches: list[list[CPMicrobatch]]
    group_size: np.ndarray
    first_rank: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray
    max_seq_len: int
    max_cp: int
    pad_multiple: int
    cost: SequenceCost
    meta: dict[str, float] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return len(self.microbatches)

    @property
    def bound_without_cp(self) -> float:
        """The best any plan of whole sequences reaches (:func:`~sftpack.balance.lower_bound`
        of the sequences' costs at ``pad_multiple``)."""
        return self.meta["bound_without_cp"]


def _check_layout(ranks: object, max_cp: object) -> tuple[int, int]:
    if not isinstance(ranks, (int, np.integer)) or isinstance(ranks, bool) or ranks < 1:
        raise BalanceError(f"ranks must be an int >= 1, got {ranks!r}")
    if not isinstance(max_cp, (int, np.integer)) or isinstance(max_cp, bool) or max_cp < 1 or max_cp & (max_cp - 1):
        raise BalanceError(f"max_cp must be a power of two >= 1 (1, 2, 4, 8, ...), got {max_cp!r}")
    if ranks % max_cp:
        raise BalanceError(
            f"max_cp={max_cp} does not divide ranks={ranks}: the CP groups are aligned blocks of ranks; "
            f"use a max_cp that divides the data-parallel size"
        )
    return int(ranks), int(max_cp)


def _positive(name: str, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise BalanceError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def dynamic_cp(
    lengths: ArrayLike,
    *,
    ranks: int,
    max_cp: int,
    max_seq_len: int,
    cost: SequenceCost | str | Path = "tokens",
    pad_multiple: int = 1,
    min_microbatches: int = 1,
) -> DynamicCPPlan:
    """Plan one step's global batch over ``ranks`` ranks, long sequences context-parallel.

    Args:
        lengths: ``(n,)`` real lengths of the step's sequences (>= 1 each).
        ranks: ranks that share the step (data parallel times context parallel: every
            rank is a data-parallel rank for its CP=1 sequences).
        max_cp: the largest CP group, a power of two dividing ``ranks`` (1: no CP, a plain
            balanced deal).
        max_seq_len: padded tokens one rank holds in one micro-batch (its memory budget);
            a CP sequence counts its padded length over its group size.
        cost: what is balanced: a :class:`~sftpack.balance.SequenceCost` or a spelling of one
            (:func:`~sftpack.balance.sequence_cost`), charged on padded lengths.
        pad_multiple: the multiple every sequence is padded to (see :func:`cp_pad_multiple`).
        min_microbatches: at least this many micro-batches per rank.

    Returns:
        :class:`DynamicCPPlan` (the rules: this module's docstring).

    Raises:
        BalanceError: a sequence that does not fit ``max_seq_len`` even over ``max_cp``
            ranks, too few sequences for every rank's micro-batches, bad settings.

    >>> plan = dynamic_cp([100, 6, 5, 4, 3, 2, 1, 1], ranks=4, max_cp=4, max_seq_len=32)
    >>> plan.group_size.tolist()  # 100 tokens (padded to 104) over 4 ranks: 26 each
    [4, 1, 1, 1, 1, 1, 1, 1]
    >>> mb = plan[2][0]
    >>> mb.sequences.tolist(), mb.local_cp_size, mb.cp_group_ranks, mb.cp_rank, mb.tokens
    ([0], 4, (0, 1, 2, 3), 2, 26)
    >>> [[m.sequences.tolist() for m in rank[1:]] for rank in plan.microbatches]
    [[[1]], [[2, 7]], [[3, 6]], [[4, 5]]]
    """
    ranks, max_cp = _check_layout(ranks, max_cp)
    width = _positive("max_seq_len", max_seq_len)
    pad = _positive("pad_multiple", pad_multiple)
    per_rank = _positive("min_microbatches", min_microbatches)
    try:
        model = sequence_cost(cost)
    except CostError as e:
        raise BalanceError(str(e)) from None
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BalanceError(f"lengths must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    n = arr.shape[0]
    if n and arr.min() < 1:
        i = int(np.flatnonzero(arr < 1)[0])
        raise BalanceError(f"lengths[{i}] = {int(arr[i])}: drop empty sequences before planning")
    if n < ranks * per_rank:
        raise BalanceError(
            f"{n} sequences cannot give {ranks} ranks {per_rank} micro-batch(es) each: some rank would get "
            "nothing and the gradient all-reduce would hang; grow the global batch or use fewer ranks"
        )

    g, padded, share = _group_sizes(arr, ranks, max_cp, width, pad, model)
    total = float((share * g).sum())
    first = _place(share, g, ranks)
    microbatches, loads, tokens = _microbatches(arr, g, first, padded, share, ranks, width, pad, per_rank, model)
    whole = model(round_up(arr, pad))
    mean = total / ranks
    return DynamicCPPlan(
        microbatches=microbatches,
        group_size=g,
        first_rank=first,
        loads=loads,
        tokens=tokens,
        max_seq_len=width,
        max_cp=max_cp,
        pad_multiple=pad,
        cost=model,
        meta={
            "bound": max(1.0, float(share.max()) / mean) if mean > 0 else 1.0,
            "bound_without_cp": max(1.0, float(whole.max()) * ranks / float(whole.sum())),
        },
    )


def _group_sizes(
    arr: np.ndarray, ranks: int, max_cp: int, width: int, pad: int, model: SequenceCost
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(g, padded, share)``: each sequence's group size, padded length and cost per rank."""
    sizes = [1 << k for k in range(max_cp.bit_length())]
    padded = np.stack([round_up(arr, cp_pad_multiple(s, pad)) for s in sizes])  # (K, n)
    size_col = np.asarray(sizes, dtype=np.int64)[:, None]
    share = model(padded) / size_col
    target = float(share[0].sum()) / ranks  # the mean rank load
    fits = padded <= width * size_col
    ok = fits & (share <= target)
    ok[-1] |= fits[-1]  # too costly even over max_cp: max_cp, the least a rank can hold of it
    if not ok[-1].all():
        i = int(np.flatnonzero(~ok[-1])[0])
        raise BalanceError(
            f"sequence {i} has {int(arr[i])} tokens, {int(padded[-1, i])} once padded for CP={max_cp}: "
            f"{int(padded[-1, i]) // max_cp} per rank, more than max_seq_len={width}; raise max_seq_len or max_cp, "
            "or truncate it when tokenizing"
        )
    k = np.argmax(ok, axis=0)  # the first (smallest) size that fits
    cols = np.arange(arr.shape[0])
    return size_col[k, 0], padded[k, cols], share[k, cols]


def _place(share: np.ndarray, g: np.ndarray, ranks: int) -> np.ndarray:
    """``(n,)`` first rank of each sequence's group: LPT over ranks and aligned groups."""
    first = np.empty(share.shape[0], np.int64)
    loads = np.zeros(ranks)
    heap = [(0.0, r) for r in range(ranks)]  # lazy: an entry is live while its load is the rank's
    for i in np.lexsort((np.arange(share.shape[0]), -share)).tolist():
        size, c = int(g[i]), float(share[i])
        if size == 1:
            while True:
                load, r = heapq.heappop(heap)
                if load == loads[r]:
                    break
            first[i] = r
            loads[r] = load + c
            heapq.heappush(heap, (float(loads[r]), r))
        else:
            block = int(np.argmin(loads.reshape(-1, size).max(axis=1)))
            start = block * size
            first[i] = start
            loads[start : start + size] += c
            for r in range(start, start + size):
                heapq.heappush(heap, (float(loads[r]), r))
    return first


def _microbatches(
    arr: np.ndarray,
    g: np.ndarray,
    first: np.ndarray,
    padded: np.ndarray,
    share: np.ndarray,
    ranks: int,
    width: int,
    pad: int,
    per_rank: int,
    model: SequenceCost,
) -> tuple[list[list[CPMicrobatch]], np.ndarray, np.ndarray]:
    cp_items = np.flatnonzero(g > 1)
    cp_count = np.zeros(ranks, np.int64)
    cp_rows: list[list[int]] = [[] for _ in range(ranks)]  # CP sequences of each rank, in index order
    for i in cp_items[np.lexsort((cp_items, -g[cp_items]))].tolist():  # larger groups first
        s, size = int(first[i]), int(g[i])
        for r in range(s, s + size):
            cp_rows[r].append(i)
        cp_count[s : s + size] += 1

    single = np.flatnonzero(g == 1)
    shares = [np.sort(single[first[single] == r]) for r in range(ranks)]
    costs = share  # for g == 1, the whole sequence's cost
    bins = [_bins(arr[idx], width, pad, 1) if idx.size else [] for idx in shares]
    m = max(per_rank, max(int(cp_count[r]) + len(bins[r]) for r in range(ranks)))
    need = m - cp_count
    if int(need.sum()) > single.size:
        raise BalanceError(
            f"every rank needs {m} micro-batches (the most CP sequences on one rank plus its own), but "
            f"{single.size} CP=1 sequences cannot fill the other ranks' {int(need.sum())}: grow the global batch, "
            "or lower max_cp"
        )
    for r in range(ranks):  # the cheapest CP=1 sequences of the ranks with the most to spare
        while shares[r].size < need[r]:
            donor = max(range(ranks), key=lambda q: (shares[q].size - int(need[q]), -q))
            d = shares[donor]
            k = int(np.lexsort((d, costs[d]))[0])
            shares[r] = np.sort(np.append(shares[r], d[k]))
            shares[donor] = np.delete(d, k)
            first[d[k]] = r  # in place: the plan's first_rank

    out: list[list[CPMicrobatch]] = []
    loads = np.zeros((ranks, m))
    tokens = np.zeros((ranks, m), np.int64)
    for r in range(ranks):
        row: list[CPMicrobatch] = []
        for i in cp_rows[r]:
            size, s = int(g[i]), int(first[i])
            row.append(
                CPMicrobatch(
                    sequences=np.array([i], np.int64),
                    local_cp_size=size,
                    cp_group_ranks=tuple(range(s, s + size)),
                    cp_rank=r - s,
                    tokens=int(padded[i]) // size,
                    cost=float(share[i]),
                )
            )
        idx = shares[r]
        if need[r] == 0:
            got: list[np.ndarray] = []
        elif len(bins[r]) == need[r] and sum(b.size for b in bins[r]) == idx.size:
            got = bins[r]
        else:
            got = _bins(arr[idx], width, pad, int(need[r]))
        if len(got) != need[r]:
            raise BalanceError(
                f"rank {r}: {idx.size} CP=1 sequences pack into {len(got)} micro-batches of <= {width} tokens, "
                f"not the {int(need[r])} it needs; grow the global batch or raise max_seq_len"
            )
        parts = [idx[b] for b in got]
        part_cost = [float(costs[p].sum()) for p in parts]
        for k in sorted(range(len(parts)), key=lambda k: (-part_cost[k], k)):  # heaviest first
            p = parts[k]
            row.append(
                CPMicrobatch(
                    sequences=p,
                    local_cp_size=1,
                    cp_group_ranks=(r,),
                    cp_rank=0,
                    tokens=int(padded[p].sum()),
                    cost=part_cost[k],
                )
            )
        loads[r] = [mb.cost for mb in row]
        tokens[r] = [mb.tokens for mb in row]
        out.append(row)
    return out, loads, tokens


def _bins(lengths: np.ndarray, width: int, pad: int, at_least: int) -> list[np.ndarray]:
    """Micro-batches of ``lengths`` (positions into it), each of <= ``width`` padded tokens."""
    if at_least <= 1 and int(round_up(lengths, pad).sum()) <= width:
        return [np.arange(lengths.shape[0], dtype=np.int64)]
    got = binpack.pack(lengths, width, "bfd", cost_multiple=pad, min_bins=at_least)
    return [np.asarray(b, dtype=np.int64) for b in got]
