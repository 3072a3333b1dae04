"""Balance across data-parallel ranks: one cost model, one balancer, for every path.

A training step is as slow as its slowest rank: the gradient all-reduce waits for it.
This package prices work and deals it out:

- :class:`SequenceCost` (:func:`sequence_cost` reads its spellings): what a sequence of
  ``l`` tokens costs, ``per_token * l + per_token_squared * l**2``, from a model's config,
  a named size, or measured step times;
- :func:`assign`: items (sequences or rows) to ranks, LPT then moves and swaps, within
  :func:`lower_bound` (the heaviest item, or the mean) as closely as the items allow;
  :func:`deal`: one step's rows to ranks, the same number each;
- :func:`dynamic_cp`: one step's sequences over ranks with dynamic context parallelism,
  the long ones sharded over aligned groups of ranks (:class:`DynamicCPPlan`), which
  breaks the bound that the heaviest whole sequence sets.

It needs numpy only (no torch, no path): the trainer, offline and loader paths, ``sftpack
plan`` and the benchmarks all call it.
"""

from ._assign import BalanceError, assign, deal, lower_bound, max_over_mean
from ._cost import NAMED_SIZES, CostError, SequenceCost, sequence_cost
from ._cp import CPMicrobatch, DynamicCPPlan, cp_groups, cp_pad_multiple, dynamic_cp
from ._plan import StepPlan

__all__ = [
    "NAMED_SIZES",
    "BalanceError",
    "CPMicrobatch",
    "CostError",
    "DynamicCPPlan",
    "SequenceCost",
    "StepPlan",
    "assign",
    "cp_groups",
    "cp_pad_multiple",
    "deal",
    "dynamic_cp",
    "lower_bound",
    "max_over_mean",
    "sequence_cost",
]
