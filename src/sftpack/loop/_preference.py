"""The loss module of the preference objectives on packed pairs, the trainer path: ``objective="dpo"``
(sigmoid DPO, with a frozen reference) and ``objective="simpo"`` (SimPO, reference-free).

A step's micro-batches hold whole pairs (:class:`~sftpack.loop._sources.TrainerSource` with
``pairs=True`` plans each pair into one micro-batch of one rank, and names each sequence
``(group, role)``: :func:`sftpack.sample.pair_sequence_id`). For each micro-batch
:class:`PreferenceLossModule` runs

1. the policy over the packed row and its head over **every** slot (full logits: the SFT
   loss's fused head never forms them), then each sequence's summed log-probability of its
   trained tokens (:func:`sftpack.loss.sequence_logprob_sums`);
2. DPO: the frozen reference model the same way, without gradients; SimPO: no reference, and
   each sequence's *mean* log-probability instead (:func:`sftpack.loss.sequence_logprob_means`);
3. :func:`sftpack.objectives.pairs_of` and :func:`sftpack.objectives.dpo_loss` (or
   :func:`~sftpack.objectives.simpo_loss`), and returns the
   micro-batch's share of the step's mean over pairs (:func:`sftpack.objectives.pair_mean`
   over the global pair count the loop all-reduces once a step, times ``average_over_ranks``
   as the SFT loss is: DDP averages the gradients).

The step's mean chosen / rejected rewards and reward accuracy are kept as shares too
(:meth:`PreferenceLossModule.take_stats`); summed over the ranks they are the means over
the step's pairs, which the loop logs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..loss import sequence_logprob_means, sequence_logprob_sums
from ..objectives import Pairs, PreferenceLosses, dpo_loss, pair_mean, pairs_of, simpo_loss
from ..sample import pair_meta
from ._model import _body_and_head, load_model, packed_hidden
from ._options import DEFAULT_BETA, DEFAULT_GAMMA, Objective, TrainConfig

__all__ = ["PreferenceLossModule", "pairs_in", "preference_loss_module"]


def pairs_in(mb: Any) -> Pairs:
    """The preference pairs of a packed micro-batch of a pairs source (its ``(group, role)`` ids)."""
    if not hasattr(mb, "cu_seqlens_padded"):
        raise TypeError(f"a preference objective trains packed rows (the trainer path), not {type(mb).__name__}")
    return pairs_of(mb, pair_meta(mb.sequence_ids or ()))


def full_logits(model: Any, mb: Any, *, pad_between_seqs: bool) -> torch.Tensor:
    """``(T, V)`` logits of ``model`` over every slot of the packed row ``mb``."""
    _, head = _body_and_head(model)
    logits: torch.Tensor = head(packed_hidden(model, mb, pad_between_seqs=pad_between_seqs))
    return logits


class PreferenceLossModule(nn.Module):
    """The policy and its preference objective as one module (DDP wraps its forward): sigmoid DPO
    with a frozen reference, or SimPO without one.

    ``forward(mb, num_pairs)``: the micro-batch's share of the step's mean loss over pairs,
    ``sum of its pair losses / num_pairs * average_over_ranks`` (0-dim, the model's dtype).

    Args:
        model: the policy (trained in place); its parameters are this module's.
        pad_between_seqs: the run's boundary mode.
        average_over_ranks: the ranks DDP averages gradients over.
        objective: :attr:`Objective.DPO` or :attr:`Objective.SIMPO`.
        beta: DPO's inverse temperature, SimPO's reward scale (``None``: the objective's default).
        gamma: SimPO's target margin (``None``: its default); DPO takes none (``None``).
        reference: DPO's frozen reference model (``None``: a copy of ``model``'s weights now);
            kept outside the module's parameters (never trained, never in a checkpoint). SimPO
            has none (refused).
    """

    def __init__(
        self,
        model: Any,
        *,
        pad_between_seqs: bool,
        average_over_ranks: int = 1,
        objective: Objective | str = Objective.DPO,
        beta: float | None = None,
        gamma: float | None = None,
        reference: Any = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.pad_between_seqs = pad_between_seqs
        self.average_over_ranks = average_over_ranks
        self.objective = Objective(objective)
        if not self.objective.preference:
            raise ValueError(f"PreferenceLossModule: objective {self.objective} is not a preference objective")
        self.beta = DEFAULT_BETA[self.objective] if beta is None else beta
        self.gamma = gamma
        ref = None
        if self.objective is Objective.SIMPO:
            if reference is not None:
                raise ValueError("PreferenceLossModule: SimPO is reference-free: give no reference")
            self.gamma = DEFAULT_GAMMA if gamma is None else gamma
        else:
            if gamma is not None:
                raise ValueError("PreferenceLossModule: gamma is SimPO's margin; DPO takes none")
            ref = copy.deepcopy(model) if reference is None else reference
            ref.requires_grad_(False)
        object.__setattr__(self, "reference", ref)  # not a submodule: no parameter of it trains or syncs
        self._stats: torch.Tensor | None = None

    def forward(self, mb: Any, num_pairs: torch.Tensor) -> torch.Tensor:
        pairs = pairs_in(mb)
        logits = full_logits(self.model, mb, pad_between_seqs=self.pad_between_seqs)
        out = self._simpo(logits, mb, pairs) if self.reference is None else self._dpo(logits, mb, pairs)
        shares = torch.stack(
            [
                pair_mean(v.to(torch.float64), num_pairs)
                for v in (out.chosen_rewards, out.rejected_rewards, out.reward_accuracies)
            ]
        ).detach()
        self._stats = shares if self._stats is None else self._stats + shares
        return pair_mean(out.losses, num_pairs, average_over_ranks=self.average_over_ranks)

    def _dpo(self, logits: torch.Tensor, mb: Any, pairs: Pairs) -> PreferenceLosses:
        policy, _ = sequence_logprob_sums(logits, mb)
        with torch.no_grad():
            ref_logits = full_logits(self.reference, mb, pad_between_seqs=self.pad_between_seqs)
            reference, _ = sequence_logprob_sums(ref_logits, mb)
        return dpo_loss(
            policy[pairs.chosen],
            policy[pairs.rejected],
            reference[pairs.chosen],
            reference[pairs.rejected],
            beta=self.beta,
        )

    def _simpo(self, logits: torch.Tensor, mb: Any, pairs: Pairs) -> PreferenceLosses:
        means = sequence_logprob_means(logits, mb)
        assert self.gamma is not None
        return simpo_loss(means[pairs.chosen], means[pairs.rejected], beta=self.beta, gamma=self.gamma)

    def take_stats(self) -> torch.Tensor:
        """``(3,)`` float64: this rank's shares of the step's mean chosen reward, rejected reward
        and reward accuracy (summed over the ranks: the means), reset for the next step."""
        stats = self._stats
        self._stats = None
        return stats if stats is not None else torch.zeros(3, dtype=torch.float64)


def preference_loss_module(config: TrainConfig, model: Any) -> Any:
    """The loss-module factory of a preference run (``loss_module(model, pad_between_seqs=, average_over_ranks=)``):
    DPO's reference is ``config.reference_model`` loaded in the model's dtype onto its device, or a
    copy of ``model``'s weights as they are now (the starting weights); SimPO has none."""
    reference = None if config.objective is Objective.SIMPO else _reference(config, model)

    def build(m: Any, *, pad_between_seqs: bool, average_over_ranks: int = 1) -> PreferenceLossModule:
        return PreferenceLossModule(
            m,
            pad_between_seqs=pad_between_seqs,
            average_over_ranks=average_over_ranks,
            objective=config.objective,
            beta=config.beta,
            gamma=config.gamma if config.objective is Objective.SIMPO else None,
            reference=reference,
        )

    return build


def _reference(config: TrainConfig, model: Any) -> Any:
    """DPO's frozen reference: ``config.reference_model`` loaded in ``model``'s dtype onto its
    device (of the same vocabulary), or a copy of ``model``'s weights now."""
    if config.reference_model is None:
        return copy.deepcopy(model)
    param = next(model.parameters())
    reference = load_model(config.reference_model, dtype=param.dtype).to(param.device)
    if reference.get_input_embeddings().num_embeddings != model.get_input_embeddings().num_embeddings:
        raise ValueError(
            f"reference model {config.reference_model}: its vocabulary "
            f"({reference.get_input_embeddings().num_embeddings:,} ids) is not the model's "
            f"({model.get_input_embeddings().num_embeddings:,}): give a reference of the same tokenizer"
        )
    return reference
