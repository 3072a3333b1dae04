"""The loss module of ``objective="dpo"``: sigmoid DPO on packed preference pairs, the trainer path.

A step's micro-batches hold whole pairs (:class:`~sftpack.loop._sources.TrainerSource` with
``pairs=True`` plans each pair into one micro-batch of one rank, and names each sequence
``(group, role)``: :func:`sftpack.sample.pair_sequence_id`). For each micro-batch
:class:`PreferenceLossModule` runs

1. the policy over the packed row and its head over **every** slot (full logits: the SFT
   loss's fused head never forms them), then each sequence's summed log-probability of its
   trained tokens (:func:`sftpack.loss.sequence_logprob_sums`);
2. the frozen reference model the same way, without gradients;
3. :func:`sftpack.objectives.pairs_of` and :func:`sftpack.objectives.dpo_loss`, and returns the
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

from ..loss import sequence_logprob_sums
from ..objectives import Pairs, dpo_loss, pair_mean, pairs_of
from ..sample import pair_meta
from ._model import _body_and_head, load_model, packed_hidden
from ._options import TrainConfig

__all__ = ["PreferenceLossModule", "pairs_in", "preference_loss_module"]


def pairs_in(mb: Any) -> Pairs:
    """The preference pairs of a packed micro-batch of a pairs source (its ``(group, role)`` ids)."""
    if not hasattr(mb, "cu_seqlens_padded"):
        raise TypeError(f"objective dpo trains packed rows (the trainer path), not {type(mb).__name__}")
    return pairs_of(mb, pair_meta(mb.sequence_ids or ()))


def full_logits(model: Any, mb: Any, *, pad_between_seqs: bool) -> torch.Tensor:
    """``(T, V)`` logits of ``model`` over every slot of the packed row ``mb``."""
    _, head = _body_and_head(model)
    logits: torch.Tensor = head(packed_hidden(model, mb, pad_between_seqs=pad_between_seqs))
    return logits


class PreferenceLossModule(nn.Module):
    """The policy, its frozen reference and sigmoid DPO, as one module (DDP wraps its forward).

    ``forward(mb, num_pairs)``: the micro-batch's share of the step's mean DPO loss over pairs,
    ``sum of its pair losses / num_pairs * average_over_ranks`` (0-dim, the model's dtype).

    Args:
        model: the policy (trained in place); its parameters are this module's.
        pad_between_seqs: the run's boundary mode.
        average_over_ranks: the ranks DDP averages gradients over.
        beta: DPO's inverse temperature.
        reference: the frozen reference model (``None``: a copy of ``model``'s weights now);
            kept outside the module's parameters (never trained, never in a checkpoint).
    """

    def __init__(
        self,
        model: Any,
        *,
        pad_between_seqs: bool,
        average_over_ranks: int = 1,
        beta: float = 0.1,
        reference: Any = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.pad_between_seqs = pad_between_seqs
        self.average_over_ranks = average_over_ranks
        self.beta = beta
        ref = copy.deepcopy(model) if reference is None else reference
        ref.requires_grad_(False)
        object.__setattr__(self, "reference", ref)  # not a submodule: no parameter of it trains or syncs
        self._stats: torch.Tensor | None = None

    def forward(self, mb: Any, num_pairs: torch.Tensor) -> torch.Tensor:
        pairs = pairs_in(mb)
        policy, _ = sequence_logprob_sums(full_logits(self.model, mb, pad_between_seqs=self.pad_between_seqs), mb)
        with torch.no_grad():
            ref_logits = full_logits(self.reference, mb, pad_between_seqs=self.pad_between_seqs)
            reference, _ = sequence_logprob_sums(ref_logits, mb)
        out = dpo_loss(
            policy[pairs.chosen],
            policy[pairs.rejected],
            reference[pairs.chosen],
            reference[pairs.rejected],
            beta=self.beta,
        )
        shares = torch.stack(
            [
                pair_mean(v.to(torch.float64), num_pairs)
                for v in (out.chosen_rewards, out.rejected_rewards, out.reward_accuracies)
            ]
        ).detach()
        self._stats = shares if self._stats is None else self._stats + shares
        return pair_mean(out.losses, num_pairs, average_over_ranks=self.average_over_ranks)

    def take_stats(self) -> torch.Tensor:
        """``(3,)`` float64: this rank's shares of the step's mean chosen reward, rejected reward
        and reward accuracy (summed over the ranks: the means), reset for the next step."""
        stats = self._stats
        self._stats = None
        return stats if stats is not None else torch.zeros(3, dtype=torch.float64)


def preference_loss_module(config: TrainConfig, model: Any) -> Any:
    """The loss-module factory of a DPO run (``loss_module(model, pad_between_seqs=, average_over_ranks=)``):
    the reference is ``config.reference_model`` loaded in the model's dtype onto its device, or a
    copy of ``model``'s weights as they are now (the starting weights)."""
    reference = None
    if config.reference_model is not None:
        param = next(model.parameters())
        reference = load_model(config.reference_model, dtype=param.dtype).to(param.device)
        if reference.get_input_embeddings().num_embeddings != model.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"reference model {config.reference_model}: its vocabulary "
                f"({reference.get_input_embeddings().num_embeddings:,} ids) is not the model's "
                f"({model.get_input_embeddings().num_embeddings:,}): give a reference of the same tokenizer"
            )
    reference = copy.deepcopy(model) if reference is None else reference

    def build(m: Any, *, pad_between_seqs: bool, average_over_ranks: int = 1) -> PreferenceLossModule:
        return PreferenceLossModule(
            m,
            pad_between_seqs=pad_between_seqs,
            average_over_ranks=average_over_ranks,
            beta=config.beta,
            reference=reference,
        )

    return build
