"""What every plan of one step's work over data-parallel ranks answers, whichever planner made it."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._assign import max_over_mean

__all__ = ["StepPlan"]


class StepPlan:
    """The questions a step's plan answers (a mixin of :class:`~sftpack.trainer.MicrobatchPlan`
    and :class:`DynamicCPPlan`): it holds ``microbatches[rank][i]`` (the same count on every
    rank), ``loads`` (``(ranks, M)``, each micro-batch's cost on its rank) and ``meta["bound"]``
    (the best :attr:`max_over_mean` any plan of its items reaches)."""

    microbatches: list[list[Any]]
    loads: np.ndarray
    meta: dict[str, Any]

    def __getitem__(self, rank: int) -> list[Any]:
        return self.microbatches[rank]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.microbatches[0])

    @property
    def rank_loads(self) -> np.ndarray:
        """``(ranks,)`` each rank's cost in the step."""
        return self.loads.sum(axis=1)

    @property
    def max_over_mean(self) -> float:
        """The slowest rank's cost over the mean (1.0: no straggler)."""
        return max_over_mean(self.rank_loads)

    @property
    def bound(self) -> float:
        """The best :attr:`max_over_mean` any plan of these items reaches (1.0 when unknown)."""
        return float(self.meta.get("bound", 1.0))
