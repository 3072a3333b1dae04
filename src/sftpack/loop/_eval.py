"""Evaluation: a held-out share of the conversations, and its loss.

:func:`split_eval` holds out ``TrainConfig.eval_fraction`` of the *conversations*
(every piece of a split conversation goes to the same side, chosen by the seed),
so no held-out conversation is ever trained on. :class:`EvalSet` packs the held-out
samples once, as the trainer path packs a step (token-budget micro-batches dealt
over the ranks), and :meth:`EvalSet.loss` returns the same global token mean as the
training loss: the sum of token losses over every supervised target of the whole
set divided by their count (all micro-batches, all ranks), so it does not depend
on how the set is grouped into micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..handoff import PackedBatch
from ..sample import Sample
from ._model import LossModule
from ._options import TrainConfig
from ._parallel import all_reduce
from ._parts import LoopState, Part, StepLog
from ._sources import TrainerSource, supervised_targets

__all__ = ["EvalSet", "Evaluation", "split_eval"]


def split_eval(config: TrainConfig, samples: Sequence[Sample]) -> tuple[list[Sample], list[Sample]]:
    """``(train, held_out)``: the samples of ``round(config.eval_fraction * conversations)``
    conversations (at least one, at most all but one), drawn by ``config.seed``, held out;
    each list in the order of ``samples``. Conversations are told apart by
    ``Sample.conversation_id``: the pieces of a split conversation stay together.

    >>> from sftpack.testing import samples_from_lengths
    >>> train, held = split_eval(TrainConfig(eval_fraction=0.25), samples_from_lengths([3, 4, 5, 6]))
    >>> len(train), len(held)
    (3, 1)
    """
    fraction = config.eval_fraction
    if not fraction:
        return list(samples), []
    ids = list(dict.fromkeys(s.conversation_id for s in samples))  # each once, in order of appearance
    if len(ids) < 2:
        raise ValueError(
            f"eval_fraction={fraction}: the data holds {len(ids)} conversation(s), too few to hold any out "
            "(--eval-file gives a separate eval set)"
        )
    n = min(max(round(fraction * len(ids)), 1), len(ids) - 1)
    # a stream of its own ([seed, 1]): the training order's seeded permutations stay what they were
    picked = np.random.default_rng([config.seed, 1]).permutation(len(ids))[:n]
    held = {ids[i] for i in picked.tolist()}
    return [s for s in samples if s.conversation_id not in held], [s for s in samples if s.conversation_id in held]


class EvalSet:
    """The held-out samples, packed once into this rank's share of micro-batches (the trainer
    path's packing: ``config.micro_batch_tokens`` or ``max_seq_len`` tokens each, the same
    number per rank), and their global count of supervised targets."""

    def __init__(
        self, config: TrainConfig, samples: Sequence[Sample], *, rank: int = 0, world: int = 1, pad_id: int = 0
    ) -> None:
        if len(samples) < world:
            raise ValueError(
                f"the eval set holds {len(samples)} sample(s), fewer than the {world} ranks that share it: raise "
                "--eval-fraction or give a larger --eval-file"
            )
        long = [s for s in samples if len(s) > config.max_seq_len]
        if long:
            raise ValueError(
                f"eval sample {long[0].conversation_id!r} has {len(long[0])} tokens, more than max_seq_len="
                f"{config.max_seq_len}: tokenize it with the same max_seq_len"
            )
        self.targets = supervised_targets(samples)
        if not self.targets:
            raise ValueError(f"the eval set's {len(samples):,} samples hold no supervised target: nothing to evaluate")
        source = TrainerSource(
            samples,
            micro_batch_tokens=config.micro_batch_tokens or config.max_seq_len,
            pad_multiple=config.pad_multiple,
            max_patches_per_row=config.max_patches_per_row,
            batch_size=len(samples),
            seed=config.seed,
            rank=rank,
            world=world,
            pad_id=pad_id,
            groups=False,  # the eval loss is a token mean over every sample: no group needs keeping whole
        )
        # the eval loss is the plain token mean: weights (advantages) say how to train, not how well
        self.micro_batches = [
            dataclasses.replace(mb, weights=None) if isinstance(mb, PackedBatch) and mb.weights is not None else mb
            for mb in source.next_step()
        ]
        self.pad_between_seqs = config.pad_between_seqs

    def loss(
        self, model: Any, device: torch.device | None = None, loss_module: Callable[..., torch.nn.Module] = LossModule
    ) -> float:
        """The token-mean loss of ``model`` over the whole set (every rank calls it: the sums
        meet in an all-reduce), through ``loss_module`` (the training loop's). The model is put
        in eval mode for it and back after."""
        module = loss_module(model, pad_between_seqs=self.pad_between_seqs, average_over_ranks=1)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                n = torch.tensor(self.targets, dtype=torch.int64, device=device)
                total = torch.zeros((), dtype=torch.float64, device=device)  # each micro-batch's share, summed
                for mb in self.micro_batches:
                    total += module(mb.to(device) if device is not None else mb, n).double()
        finally:
            model.train(was_training)
        return float(all_reduce(total))


class Evaluation(Part):
    """The part (every rank): ``record.eval_loss`` of every ``config.eval_every``-th step and of the
    last, the loss of ``evals`` through the loss module the run's parallel choice evaluates with."""

    def __init__(self, evals: EvalSet) -> None:
        self.evals = evals

    def on_step(self, state: LoopState, record: StepLog) -> None:
        every = state.config.eval_every
        if record.step == state.steps or (every and record.step % every == 0):
            record.eval_loss = state.parallel.evaluate(
                lambda loss_module: self.evals.loss(state.model, state.device, loss_module)
            )
