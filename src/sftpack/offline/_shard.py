"""Which rows a step trains on, and which of them each data-parallel rank reads.

One global stream, whatever the number of ranks:

- **the epoch's order**: every epoch has one seeded order of all ``R`` rows
  (:func:`epoch_order`: a permutation seeded by ``(seed, epoch)``, or row order
  without ``shuffle``), the same for 1 rank or 1,024;
- **the step's rows**: step ``s`` of an epoch trains on positions
  ``[s * B, (s + 1) * B)`` of it, ``B`` the step's rows over all ranks; the last
  ``R mod B`` rows of an epoch wait for a later epoch's order;
- **the deal** (:func:`deal_rows`): those ``B`` rows go to the ``W`` ranks by their
  cost (:func:`sftpack.balance.deal`: ``B / W`` each, the slowest rank as close to
  the mean as the rows allow), each rank's rows heaviest first, so its ``i``-th row
  runs in its ``i``-th micro-batch slot beside the other ranks' ``i``-th rows. The
  deal is a function of the rows' costs only: every rank computes the same one and
  keeps its own line. One rank keeps the step's rows in stream order.

So a step's set of rows never depends on ``W``, and a run's position is
``(epoch, rows consumed)``: a run stopped at ``N`` ranks continues on ``M`` ranks
with exactly the rows it would have trained on next (``B`` a multiple of both).

A row's cost is a :class:`~sftpack.balance.SequenceCost` summed over its sequences
(:meth:`~sftpack.balance.SequenceCost.of_groups`): ``"tokens"``, ``"attention"``, a
model size (``"7b"``) or a model directory.

Cost: one permutation per epoch, O(R); a deal per step, O(B log B) (16 rows over 8
ranks in tens of microseconds).
"""

from __future__ import annotations

import numpy as np

from ..balance import deal

__all__ = ["deal_rows", "epoch_order"]


def epoch_order(num_rows: int, *, epoch: int = 0, seed: int = 0, shuffle: bool = False) -> np.ndarray:
    """``(num_rows,)`` int64: the epoch's one order of all rows (the global stream).

    >>> epoch_order(5).tolist()
    [0, 1, 2, 3, 4]
    >>> sorted(epoch_order(5, epoch=1, seed=3, shuffle=True).tolist())
    [0, 1, 2, 3, 4]
    """
    if not shuffle:
        return np.arange(num_rows, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_rows).astype(np.int64)


def deal_rows(rows: np.ndarray, costs: np.ndarray, world_size: int) -> np.ndarray:
    """``(world_size, len(rows) // world_size)`` int64: one step's global ``rows`` dealt by
    ``costs`` (the cost of every row of the prepack, indexed by global row); line ``r`` is
    rank ``r``'s rows, heaviest first. One rank: ``rows`` as they are.

    >>> deal_rows(np.array([7, 3, 5, 1]), np.array([0, 2, 0, 1, 0, 3, 0, 4]), 2).tolist()
    [[7, 3], [5, 1]]
    """
    rows = np.asarray(rows, dtype=np.int64)
    if world_size < 1 or rows.shape[0] % world_size:
        raise ValueError(
            f"{rows.shape[0]} rows cannot be dealt evenly to {world_size} rank(s): a step's rows must be a "
            "multiple of the world size"
        )
    if world_size == 1:
        return rows.reshape(1, -1).copy()
    return rows[deal(np.asarray(costs, dtype=np.float64)[rows], world_size, rows.shape[0] // world_size)]
