"""Preference objectives on packed rows: pairs, the DPO loss, SimPO, and their normalisation.

A preference pair is two sequences of one group: the *chosen* answer and the *rejected*
one (each with the shared prompt before it, the prompt untrained). Packed, the two are
ordinary sequences of a row; what the objective needs from the packed forward is each
sequence's summed (or mean) log-probability of its trained tokens, read from the packed
boundaries (:func:`sftpack.loss.sequence_logprob_sums`, ``sequence_logprob_means``), and
which sequences form a pair (:func:`pairs_of`, from each sequence's group and role).

- :func:`dpo_loss`: sigmoid DPO with a frozen reference model,
  ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))`` per pair, ``p``/``r`` the policy's and
  the reference's summed log-probabilities of the chosen (``c``) and rejected (``r``) answer.
- :func:`simpo_loss`: the reference-free variant, SimPO: length-normalised (mean per token)
  log-probabilities and a target margin ``gamma``,
  ``-log sigmoid(beta * (mc - mr) - gamma)``.

The normalisation rule: a step's loss is the **mean over its pairs**, over every
micro-batch and every rank. Each micro-batch contributes ``sum of its pair losses / P``,
``P`` the global pair count (:func:`count_pairs`, all-reduced once per step, as
:func:`sftpack.loss.count_label_tokens` is for tokens): the shares then sum to the global
mean exactly, however the pairs were grouped into rows, micro-batches and ranks
(:func:`pair_mean`). A pair must be whole in one micro-batch (both sequences in the same
:class:`~sftpack.PackedBatch`): :func:`pairs_of` refuses a half pair.

Context parallelism: every CP rank holds a part of every sequence; the sums are put back
together over the CP group (``cp_group=`` of the log-prob functions) and every rank of the
group then holds all the pairs. Counting pairs over the data-parallel x context-parallel
group counts each pair ``cp_size`` times, so each rank contributes ``1/cp_size`` of each
pair's loss: the shares summed over all ranks are the mean again, and the differentiable
all-reduce's backward (a sum) hands each rank's chunks exactly their gradient.

Typical step (the policy trained, the reference frozen)::

    pairs = [pairs_of(mb, meta) for mb in micro_batches]
    n = count_pairs(pairs, group=dp_group)                       # one all-reduce
    for mb, pr in zip(micro_batches, pairs):
        logp, _ = sequence_logprob_sums(policy_logits(mb), mb)
        with torch.no_grad():
            ref, _ = sequence_logprob_sums(reference_logits(mb), mb)
        out = dpo_loss(logp[pr.chosen], logp[pr.rejected], ref[pr.chosen], ref[pr.rejected], beta=0.1)
        pair_mean(out.losses, n, average_over_ranks=dp_size).backward()
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from .handoff import PackedBatch
from .loss import _all_reduce_sum, _global_share

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = [
    "CHOSEN",
    "REJECTED",
    "Pairs",
    "PreferenceLosses",
    "count_pairs",
    "dpo_loss",
    "pair_mean",
    "pair_sequences",
    "pairs_of",
    "simpo_loss",
]

#: The two roles of a preference pair's sequences (``Sample.meta["role"]``).
CHOSEN = "chosen"
REJECTED = "rejected"


@dataclass(frozen=True)
class Pairs:
    """Which sequences of a packed batch form each preference pair.

    Attributes:
        chosen: ``(P,)`` int64, the segment index of each pair's chosen sequence.
        rejected: ``(P,)`` int64, the segment index of each pair's rejected sequence.
        groups: the ``P`` group ids, in the order their first sequence appears in the batch.

    Index per-sequence values with them: ``logps[pairs.chosen]``, ``logps[pairs.rejected]``.
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    groups: tuple[Hashable, ...]

    def __len__(self) -> int:
        return len(self.groups)


def pair_sequences(
    groups: Sequence[Hashable], roles: Sequence[str], *, device: torch.device | str | None = None
) -> Pairs:
    """The pairs of a batch from each sequence's group id and role (``"chosen"`` / ``"rejected"``).

    Every group must hold exactly one chosen and one rejected sequence.

    Raises:
        ValueError: ``groups`` and ``roles`` of different lengths, a role that is neither,
            a group with two sequences of one role, or a half pair (naming the group and
            the sequence index): a pair must be packed whole into one micro-batch.

    >>> p = pair_sequences(["a", "b", "a", "b"], ["chosen", "rejected", "rejected", "chosen"])
    >>> p.chosen.tolist(), p.rejected.tolist(), p.groups
    ([0, 3], [2, 1], ('a', 'b'))
    """
    if len(groups) != len(roles):
        raise ValueError(
            f"pair_sequences: {len(groups)} group ids but {len(roles)} roles; give one of each per sequence"
        )
    slots: dict[Hashable, dict[str, int]] = {}
    for i, (g, role) in enumerate(zip(groups, roles)):
        if role not in (CHOSEN, REJECTED):
            raise ValueError(
                f"pair_sequences: sequence {i} (group {g!r}) has role {role!r}; a preference pair's roles are "
                f"{CHOSEN!r} and {REJECTED!r}"
            )
        seen = slots.setdefault(g, {})
        if role in seen:
            raise ValueError(
                f"pair_sequences: group {g!r} has two {role!r} sequences ({seen[role]} and {i}); a pair is one "
                f"{CHOSEN!r} and one {REJECTED!r} sequence: give each pair its own group id"
            )
        seen[role] = i
    for g, seen in slots.items():
        if len(seen) != 2:
            (role, i), missing = next(iter(seen.items())), REJECTED if CHOSEN in seen else CHOSEN
            raise ValueError(
                f"pair_sequences: group {g!r} has its {role!r} sequence ({i}) but no {missing!r} one in this batch; "
                "a pair must be packed whole into one micro-batch (both sequences in the same PackedBatch)"
            )
    dev = torch.device(device) if device is not None else None
    chosen = torch.tensor([s[CHOSEN] for s in slots.values()], dtype=torch.int64, device=dev)
    rejected = torch.tensor([s[REJECTED] for s in slots.values()], dtype=torch.int64, device=dev)
    return Pairs(chosen=chosen, rejected=rejected, groups=tuple(slots))


def pairs_of(packed: PackedBatch, meta: Mapping[Any, Mapping[str, Any]]) -> Pairs:
    """The pairs of a packed batch: each sequence's ``meta["group"]`` and ``meta["role"]``,
    looked up by its id (``packed.sequence_ids``, the samples' ``conversation_id``).

    Args:
        packed: the micro-batch (rows laid end to end, or a CP shard: it keeps the ids).
        meta: sequence id -> that sample's ``meta`` (e.g. ``{s.conversation_id: s.meta for s in samples}``).

    Raises:
        ValueError: the batch carries no ``sequence_ids``, an id has no meta, or a meta lacks
            ``group`` / ``role``; and what :func:`pair_sequences` refuses.
    """
    ids = packed.sequence_ids
    if ids is None:
        raise ValueError(
            "pairs_of: the packed batch carries no sequence_ids, so its sequences cannot be matched to their "
            "pairs; build it with PackedBatch.from_samples (or pass sequence_ids=) from samples with ids"
        )
    groups, roles = [], []
    for i, sid in enumerate(ids):
        m = meta.get(sid)
        if m is None:
            raise ValueError(f"pairs_of: sequence {i} has id {sid!r}, which the meta mapping lacks")
        for key in ("group", "role"):
            if key not in m:
                raise ValueError(
                    f"pairs_of: sequence {i} (id {sid!r}) has no meta[{key!r}]; a preference sample carries its "
                    f"pair's group id and its role ({CHOSEN!r} or {REJECTED!r}) in Sample.meta"
                )
        groups.append(m["group"])
        roles.append(m["role"])
    return pair_sequences(groups, roles, device=packed.device)


@dataclass(frozen=True)
class PreferenceLosses:
    """Per-pair results of a preference objective, each ``(P,)``.

    Attributes:
        losses: the objective of each pair (minimise their mean: :func:`pair_mean`).
        chosen_rewards: the implicit reward of the chosen answer (DPO:
            ``beta * (pc - rc)``; SimPO: ``beta * mc``), detached.
        rejected_rewards: the same for the rejected answer, detached.
    """

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        """``chosen_rewards - rejected_rewards``."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def reward_accuracies(self) -> torch.Tensor:
        """1.0 where the chosen reward is strictly above the rejected one, else 0.0."""
        return (self.chosen_rewards > self.rejected_rewards).to(self.losses.dtype)


def _same_shape(name: str, *values: torch.Tensor) -> None:
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(
            f"{name}: give one (P,) tensor per role, all of one shape; got {[tuple(v.shape) for v in values]}"
        )


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
) -> PreferenceLosses:
    """Sigmoid DPO per pair: ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))``.

    Args:
        policy_chosen, policy_rejected: ``(P,)`` the trained model's summed log-probabilities
            of each pair's chosen / rejected answer (:func:`sftpack.loss.sequence_logprob_sums`).
        reference_chosen, reference_rejected: ``(P,)`` the same under the frozen reference model
            (no gradient needed).
        beta: the inverse temperature (> 0).

    Returns:
        :class:`PreferenceLosses`: losses, rewards ``beta * (policy - reference)``.

    >>> import torch
    >>> out = dpo_loss(torch.tensor([-3.0]), torch.tensor([-5.0]), torch.tensor([-4.0]), torch.tensor([-4.0]), beta=0.5)
    >>> round(float(out.losses[0]), 4), out.chosen_rewards.tolist(), out.rejected_rewards.tolist()
    (0.3133, [0.5], [-0.5])
    """
    _same_shape("dpo_loss", policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    if not beta > 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta!r}")
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return PreferenceLosses(losses, (beta * chosen).detach(), (beta * rejected).detach())


def simpo_loss(
    chosen_means: torch.Tensor, rejected_means: torch.Tensor, *, beta: float = 2.0, gamma: float = 1.0
) -> PreferenceLosses:
    """SimPO per pair (reference-free): ``-log sigmoid(beta * (mc - mr) - gamma)``.

    The scores are length-normalised: each answer's *mean* token log-probability
    (:func:`sftpack.loss.sequence_logprob_means`), so a long answer is not favoured for its
    length, and no reference model runs. ``gamma`` is the target reward margin in reward
    units (the SimPO paper's gamma; its ratio ``gamma / beta`` is TRL's ``simpo_gamma``);
    the defaults are the paper's usual ``beta = 2``, ``gamma / beta = 0.5``.

    Returns:
        :class:`PreferenceLosses`: losses, rewards ``beta * mean log-probability``.
    """
    _same_shape("simpo_loss", chosen_means, rejected_means)
    if not beta > 0:
        raise ValueError(f"simpo_loss: beta must be > 0, got {beta!r}")
    if not gamma >= 0:
        raise ValueError(f"simpo_loss: gamma (the target margin) must be >= 0, got {gamma!r}")
    losses = -F.logsigmoid(beta * (chosen_means - rejected_means) - gamma)
    return PreferenceLosses(losses, (beta * chosen_means).detach(), (beta * rejected_means).detach())


def count_pairs(
    pairs: Pairs | Iterable[Pairs],
    *,
    group: ProcessGroup | Literal[False] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Preference pairs of this step, over all micro-batches and ranks: the denominator of
    :func:`pair_mean`.

    Args:
        pairs: this rank's micro-batches' :class:`Pairs` (or one).
        group: the process group to sum over when ``torch.distributed`` is initialised: the
            data-parallel group (times the context-parallel one: each CP rank holds every pair
            of its rows and counts it, see the module docstring). ``None``: the default (world)
            group; ``False``: do not all-reduce.
        device: where the count lives (default: the first micro-batch's; with NCCL, the CUDA device).

    Returns:
        0-dim int64 tensor.
    """
    items = [pairs] if isinstance(pairs, Pairs) else list(pairs)
    if not items:
        raise ValueError("count_pairs: give at least one Pairs (the micro-batches of this rank's step)")
    dev = torch.device(device) if device is not None else items[0].chosen.device
    n = torch.tensor(sum(len(p) for p in items), dtype=torch.int64, device=dev)
    return _all_reduce_sum(n, group)


def pair_mean(values: torch.Tensor, num_pairs: int | torch.Tensor, *, average_over_ranks: int = 1) -> torch.Tensor:
    """This micro-batch's share of the step's mean over pairs: ``values.sum() / num_pairs * average_over_ranks``.

    For the loss (``out.losses``) and for what is logged beside it (rewards, margins, reward
    accuracies): summed over the micro-batches of every rank, the shares are the mean over
    the step's pairs, whatever the packing.

    Args:
        values: ``(P,)`` one value per pair of this micro-batch.
        num_pairs: the *global* count (:func:`count_pairs`); a step without pairs gives 0.
        average_over_ranks: ranks the gradient all-reduce averages over (DDP/FSDP: the
            data-parallel size); 1 for a sum all-reduce or a single process.
    """
    return _global_share(values.sum(), num_pairs, average_over_ranks)
