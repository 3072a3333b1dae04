"""Items (sequences, rows) dealt to data-parallel ranks so the slowest rank is as close to the mean as allowed.

:func:`assign` is the one balancer every path uses: the trainer path deals a step's
sequences (then packs each rank's share into micro-batches), the offline and loader paths
deal a step's rows (``per_rank`` each). Two stages:

1. **LPT**, longest processing time first: items by cost, heaviest first, each to the
   least loaded rank (that still has room, with ``per_rank``). Ties go to the lower item
   index and the lower rank, so the deal is the same on every rank and every run.
2. **Refinement**: while the most loaded rank is above the bound, move one of its items to
   the least loaded rank (without ``per_rank``), or swap one of its items with a lighter
   one of another rank, choosing the move that brings the pair closest to even. Each
   accepted move lowers the heavier of the two ranks, so the maximum never rises.

The bound is :func:`lower_bound`: no deal does better than the mean, nor than the heaviest
single item (a sequence cannot be split over ranks without context parallelism; see
:func:`sftpack.balance.dynamic_cp`).

Cost: ``O(n log n + moves * k log k)`` for ``n`` items, ``k`` per rank: 16,384 sequences
over 1,024 ranks in milliseconds.
"""

from __future__ import annotations

import heapq

import numpy as np
from numpy.typing import ArrayLike

from ..binpack import Groups

__all__ = ["BalanceError", "assign", "deal", "lower_bound", "max_over_mean"]

#: refinement stops once the slowest rank is within this factor of the bound (1 + 1e-4)
_CLOSE = 1e-4


class BalanceError(ValueError):
    """Items that cannot be dealt as asked (the message says why and the fix)."""


def max_over_mean(loads: ArrayLike) -> float:
    """The slowest rank's load over the mean (1.0: no straggler)."""
    a = np.asarray(loads, dtype=np.float64)
    m = float(a.mean()) if a.size else 0.0
    return float(a.max() / m) if m > 0 else 1.0


def lower_bound(costs: ArrayLike, ranks: int, per_rank: int | None = None) -> float:
    """What :func:`max_over_mean` can reach at best: ``max(1, heaviest item / mean rank load)``.

    With ``per_rank`` (every rank takes exactly that many items: a step's rows), also the
    rank holding the heaviest item holds ``per_rank - 1`` others, each at least the lightest:
    ``(heaviest + (per_rank - 1) * lightest) / mean rank load``.

    >>> lower_bound([9, 1, 1, 1], 2), lower_bound([9, 5, 5, 1], 2, per_rank=2)
    (1.5, 1.0)
    >>> lower_bound([9, 4, 4, 3], 2, per_rank=2)  # the rank with 9 holds 3 more at least
    1.2
    """
    c = np.asarray(costs, dtype=np.float64)
    total = float(c.sum())
    if total <= 0:
        return 1.0
    heaviest = float(c.max())
    if per_rank is not None and per_rank > 1:
        heaviest += (per_rank - 1) * float(c.min())
    return max(1.0, heaviest * ranks / total)


def assign(
    costs: ArrayLike,
    ranks: int,
    *,
    per_rank: int | None = None,
    refine: bool = True,
    groups: ArrayLike | None = None,
) -> np.ndarray:
    """``(n,)`` int64: the rank each item goes to.

    Args:
        costs: ``(n,)`` cost of each item (>= 0; a :class:`~sftpack.balance.SequenceCost`'s).
        ranks: data-parallel ranks.
        per_rank: every rank takes exactly this many items (``n == ranks * per_rank``);
            ``None``: any number (every rank at least one when ``n >= ranks``).
        refine: run the refinement after LPT (``False``: LPT alone, for comparison).
        groups: ``(n,)`` integer group id per item (a DPO pair, a prompt's GRPO
            completions): a group's members go to one rank. The groups are dealt as
            items costing their members' sum (:class:`sftpack.binpack.Groups`), then
            expanded; ``None``: every item alone (the same deal as singleton groups).
            Not with ``per_rank`` (which counts items).

    >>> assign([5, 4, 3, 3, 2, 1], 2).tolist()
    [0, 1, 1, 0, 1, 0]
    >>> assign([5, 4, 3, 3, 2, 1], 2, groups=[0, 1, 0, 2, 1, 2]).tolist()  # 0: 8, 1: 6, 2: 4
    [0, 1, 0, 1, 1, 1]
    >>> assign([8, 1, 1, 1, 1, 1, 1, 2], 2, per_rank=4).tolist()
    [0, 1, 1, 1, 0, 0, 0, 1]
    """
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1:
        raise BalanceError(f"costs must be 1-D, got shape {c.shape}")
    n = c.shape[0]
    if ranks < 1:
        raise BalanceError(f"ranks must be >= 1, got {ranks}")
    if n and (not np.isfinite(c).all() or c.min() < 0):
        i = int(np.flatnonzero(~np.isfinite(c) | (c < 0))[0])
        raise BalanceError(f"costs[{i}] = {c[i]}: every cost must be a finite number >= 0")
    if groups is not None:
        if per_rank is not None:
            raise BalanceError(
                f"per_rank={per_rank} counts items, which groups of several items cannot meet exactly: "
                "deal groups without per_rank, or give each item its own group"
            )
        try:
            grouped = Groups.of(groups, n)
        except ValueError as e:
            raise BalanceError(str(e)) from None
        return assign(grouped.sum(c), ranks, refine=refine)[grouped.unit]
    if per_rank is not None and n != ranks * per_rank:
        raise BalanceError(
            f"{n} items cannot give {ranks} ranks {per_rank} each ({ranks * per_rank} needed): "
            "make the step's item count a multiple of the ranks"
        )
    owner = _lpt(c, ranks, per_rank)
    if refine and ranks > 1 and n > 1:
        _refine(c, owner, ranks, fixed_count=per_rank is not None)
    return owner


def deal(costs: ArrayLike, ranks: int, per_rank: int) -> np.ndarray:
    """``(ranks, per_rank)`` int64: the items of one step (rows) dealt by cost, ``per_rank`` each.

    Row ``r`` lists rank ``r``'s items heaviest first (ties: lower index first), so the
    ``i``-th micro-batches of all ranks, which run together, are alike. The deal is
    :func:`assign` with ``per_rank``: the same on every rank, from the costs alone.

    >>> deal([4, 1, 3, 2], 2, 2).tolist()
    [[0, 1], [2, 3]]
    """
    c = np.asarray(costs, dtype=np.float64)
    owner = assign(c, ranks, per_rank=per_rank)
    order = np.lexsort((np.arange(c.shape[0]), -c, owner))  # by rank, then heaviest first, then index
    return order.reshape(ranks, per_rank).astype(np.int64)


def _lpt(c: np.ndarray, ranks: int, per_rank: int | None) -> np.ndarray:
    owner = np.empty(c.shape[0], np.int64)
    heap = [(0.0, r) for r in range(ranks)]
    taken = [0] * ranks
    for i in np.argsort(-c, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        owner[i] = r
        taken[r] += 1
        if per_rank is None or taken[r] < per_rank:
            heapq.heappush(heap, (load + float(c[i]), r))
    return owner


def _refine(c: np.ndarray, owner: np.ndarray, ranks: int, *, fixed_count: bool) -> None:
    """Moves and swaps from the most loaded rank while they bring it down (in place)."""
    loads = np.bincount(owner, weights=c, minlength=ranks)
    members: list[list[int]] = [[] for _ in range(ranks)]
    for i, r in enumerate(owner.tolist()):
        members[r].append(i)
    bound = lower_bound(c, ranks) * float(loads.mean()) if c.sum() > 0 else 0.0
    for _ in range(8 * ranks + 64):
        hi = int(np.argmax(loads))
        if loads[hi] <= bound * (1 + _CLOSE):
            return
        # the lightest ranks first: the best partner is almost always among them
        partners = np.argsort(loads, kind="stable")[: min(ranks - 1, 8)]
        for lo in partners.tolist():
            if lo == hi:
                continue
            if _improve(c, owner, members, loads, hi, lo, fixed_count=fixed_count):
                break
        else:
            return


def _improve(
    c: np.ndarray,
    owner: np.ndarray,
    members: list[list[int]],
    loads: np.ndarray,
    hi: int,
    lo: int,
    *,
    fixed_count: bool,
) -> bool:
    """The best move or swap from ``hi`` to ``lo`` that lowers ``hi``'s load below its own; applied."""
    gap = float(loads[hi] - loads[lo])
    if gap <= 0:
        return False
    mine = np.asarray(members[hi], dtype=np.int64)
    theirs = np.asarray(members[lo], dtype=np.int64)
    best_d, best = 0.0, None  # delta moved from hi to lo, and (i, j or -1)
    target = gap / 2
    cm = c[mine]
    if not fixed_count and mine.size > 1:
        ok = (cm > 0) & (cm < gap)
        if ok.any():
            k = int(np.argmin(np.where(ok, np.abs(cm - target), np.inf)))
            best_d, best = float(cm[k]), (int(mine[k]), -1)
    if theirs.size:
        order = np.argsort(c[theirs], kind="stable")
        ct = c[theirs][order]
        # swap i (hi) with j (lo): delta = c_i - c_j in (0, gap), nearest gap/2
        want = cm - target
        pos = np.clip(np.searchsorted(ct, want), 0, ct.size - 1)
        for cand in (pos, np.maximum(pos - 1, 0)):
            d = cm - ct[cand]
            ok = (d > 0) & (d < gap)
            if ok.any():
                k = int(np.argmin(np.where(ok, np.abs(d - target), np.inf)))
                if best is None or abs(float(d[k]) - target) < abs(best_d - target):
                    best_d, best = float(d[k]), (int(mine[k]), int(theirs[order[cand[k]]]))
    if best is None:
        return False
    i, j = best
    members[hi].remove(i)
    members[lo].append(i)
    owner[i] = lo
    if j >= 0:
        members[lo].remove(j)
        members[hi].append(j)
        owner[j] = hi
    loads[hi] -= best_d
    loads[lo] += best_d
    return True
