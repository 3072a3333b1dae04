"""Loss normalisation that makes packing invisible to the loss.

Packing changes how tokens are grouped into rows and micro-batches; the loss
must not notice. Two normalisations are exact:

- **Token mean** (the usual SFT loss): the sum of per-token losses over every
  supervised target of the global batch, divided by the *global* number of
  supervised targets. Each micro-batch contributes ``sum_mb / N_global``, where
  ``N_global`` counts targets over all micro-batches of the step and all
  data-parallel (and context-parallel) ranks, all-reduced once per step
  (:func:`count_label_tokens`). Summing the micro-batch losses then equals the
  unpacked loss exactly, however the sequences were grouped.
- **Sequence mean**: every sequence's own token mean, averaged over the
  sequences that have at least one target (:func:`sequence_mean_loss`). The
  sequences are found from the packed boundaries, never from rows.

Per-sequence log-probabilities (what preference objectives such as DPO read,
:mod:`sftpack.objectives`) are the same reduction with the sign turned:
:func:`sequence_logprob_sums` is minus :func:`sequence_loss_sums`, one value per
sequence of the packed row, whichever consumer form ran the model (Hugging Face
kwargs, ``PackedSeqParams``, flash-attn kwargs: they change how the model is
called, not the boundaries the reduction reads). On a context-parallel shard each
rank holds part of every sequence; :func:`all_reduce_sequence_sums` puts the sums
back together over the CP group, differentiably.

**Per-token weights** (:attr:`sftpack.PackedBatch.weights`, from
:attr:`sftpack.Sample.weights`: importance weights, or signed advantages for RL). One rule
for every mean: *a weighted mean divides the sum of* ``w * loss`` *by the sum of* ``|w|``
*over the same targets*. The token mean of the global batch is therefore

    sum over every target t of the step, on every rank:  w_t * loss_t
    -----------------------------------------------------------------
    sum over the same targets:                           |w_t|

with the denominator all-reduced once per step like the unweighted count
(:func:`count_label_tokens` returns it; :func:`token_mean_loss` and
:func:`token_losses` multiply by ``w``). Each micro-batch contributes its
numerator over the global denominator, so the sum over micro-batches, gradient
accumulation steps and data-parallel ranks is the whole batch's value exactly,
however the sequences were packed, as without weights. Why this rule:

- no weights is weight 1 on every target, and then ``sum |w|`` is the target count:
  the unweighted loss is the special case, not a second rule (a row without weights
  gives the same bits as before weights existed);
- a weight of 0 contributes to neither sum, so it is exactly a target that is not
  trained (``loss_mask`` False): zeroing a token's weight never dilutes the others;
- signed advantages (GRPO-style) cannot cancel in the denominator: ``sum |w|`` is
  positive whenever any target weighs anything, so the loss never divides by a sum
  near 0 or flips sign; a group whose advantages are all 0 drops out of both sums;
- scaling every weight by ``c > 0`` leaves the loss unchanged: the weights say how
  the batch's tokens share one unit of loss, not the step size.

The sequence mean follows the same rule: each sequence's ``sum w * loss / sum |w|``,
averaged over the sequences whose ``sum |w|`` is positive (:func:`count_sequences`);
:func:`sequence_loss_sums` gives ``(sum w * loss, sum |w|)`` per sequence on a weighted
row.

**Which mean** (:class:`~sftpack.sample.WeightNormalisation`, one rule with a choice): the
*token* mean above (the default); the *sequence* mean (each sequence's weighted mean, then the
mean over the step's sequences); the *group* mean (each group's mean over its sequences, a
group being a GRPO prompt's completions or a pair, ``Sample.meta["group"]``; then the mean over
the step's groups). :func:`normalise_weights` turns each choice into the token rule on
per-token coefficients (``w / sum |w|`` of the sequence, and ``/ n_g`` for its group's
``n_g`` trained sequences) over a counted denominator (the step's trained sequences, or
groups), all-reduced once per step: one code path for the loss, exact over micro-batches,
gradient accumulation and ranks, and a group may span all three.

What is *not* exact, and a bug seen in the wild: averaging per-row (or
per-micro-batch) means. A row holding one long answer and one short one weighs
them differently from the unpacked batch, and the loss moves when the packing
changes (one report: 3x higher with packing).

Gradient averaging: DDP and FSDP *average* gradients over the data-parallel
ranks, i.e. divide by ``dp_size`` after the sum. With a global denominator that
average must be undone: pass ``average_over_ranks=dp_size``. Megatron with
``calculate_per_token_loss`` (a sum all-reduce) needs ``1``.

Typical step::

    n = count_label_tokens(micro_batches, group=dp_group)      # one all-reduce
    for mb in micro_batches:
        logits = model(mb.input_ids, mb.position_ids, packed=mb)
        token_mean_loss(logits, mb, n, average_over_ranks=dp_size).backward()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from ._base import choose
from .handoff import CPShard, PackedBatch, segment_ids
from .sample import IGNORE_INDEX, WeightNormalisation

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = [
    "all_reduce_sequence_sums",
    "count_label_tokens",
    "count_sequences",
    "loss_dtype",
    "normalise_weights",
    "sequence_logprob_means",
    "sequence_logprob_sums",
    "sequence_loss_sums",
    "sequence_mean_loss",
    "token_losses",
    "token_mean_loss",
]


def _labels_of(labels: torch.Tensor | PackedBatch) -> torch.Tensor:
    return labels.labels if isinstance(labels, PackedBatch) else labels


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a loss is computed in for logits of ``dtype``: float64 stays float64,
    everything else (float32, bfloat16, float16) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_losses(logits: torch.Tensor, labels: torch.Tensor | PackedBatch) -> torch.Tensor:
    """Per-slot cross-entropy, 0 where there is no target; times the slot's weight when
    ``labels`` is a batch with :attr:`~sftpack.PackedBatch.weights`.

    Args:
        logits: ``(T, V)`` (or ``(1, T, V)`` from a Hugging Face model) for the slots
            of a packed row; any float dtype (computed in float32, or in float64 for
            float64 logits: :func:`loss_dtype`).
        labels: ``(T,)`` int64 already-shifted labels (``PackedBatch.labels``), or the
            batch itself (its ``weights`` then multiply each slot's loss). ``-100`` = no target.

    Returns:
        ``(T,)`` float32 (float64 for float64 logits).
    """
    lab = _labels_of(labels).reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] != lab.shape[0]:
        raise ValueError(f"logits cover {flat.shape[0]} slots but labels has {lab.shape[0]}")
    per_slot = F.cross_entropy(flat.to(loss_dtype(flat.dtype)), lab, ignore_index=IGNORE_INDEX, reduction="none")
    weights = labels.weights if isinstance(labels, PackedBatch) else None
    return per_slot if weights is None else per_slot * weights.to(per_slot.dtype)


def _target_mass(b: PackedBatch) -> torch.Tensor:
    """``(T,)`` what each slot adds to a mean's denominator: 1 on a target (int64) without
    weights, ``|w|`` (float64) with them (0 where there is no target either way)."""
    if b.weights is None:
        return (b.labels != IGNORE_INDEX).to(torch.int64)
    return b.weights.abs().to(torch.float64)


def _all_reduce_sum(t: torch.Tensor, group: ProcessGroup | Literal[False] | None) -> torch.Tensor:
    if group is not False and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return t


def _global_share(total: torch.Tensor, count: int | torch.Tensor, average_over_ranks: int) -> torch.Tensor:
    """``total / count * average_over_ranks``: one micro-batch's share of a mean whose ``count``
    is global (a count of 0 gives 0, not NaN: the total is then 0 too). ``count`` may be a
    weight sum below 1 (``sum |w|``), so only 0 is replaced."""
    denom: torch.Tensor | float
    if isinstance(count, torch.Tensor):
        denom = count.to(device=total.device, dtype=total.dtype)
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    else:
        denom = float(count) if count > 0 else 1.0
    return total / denom * average_over_ranks


def _batches(batches: PackedBatch | Iterable[PackedBatch]) -> list[PackedBatch]:
    items = [batches] if isinstance(batches, PackedBatch) else list(batches)
    if not items:
        raise ValueError("count: give at least one PackedBatch (the micro-batches of this rank's step)")
    return items


def count_label_tokens(
    batches: PackedBatch | Iterable[PackedBatch],
    *,
    group: ProcessGroup | Literal[False] | None = None,
    device: torch.device | str | None = None,
    weighted: bool | None = None,
) -> torch.Tensor:
    """Supervised targets of this step, over all micro-batches and ranks: the denominator of
    the token mean. With weights, the weighted count ``sum |w|`` over the same targets (a
    batch without weights counts 1 per target).

    Args:
        batches: this rank's micro-batches of the step (or one batch). CP shards
            count their own targets, so the CP group's sum is the row's count.
        group: the process group to sum over when ``torch.distributed`` is
            initialised: the data-parallel group (times the context-parallel one).
            ``None``: the default (world) group; ``False``: do not all-reduce.
        device: where the count lives (default: the first batch's device; with NCCL
            it must be the CUDA device).
        weighted: ``None``: a float64 weighted count when any of ``batches`` has weights,
            else the int64 count. Under data parallelism every rank must all-reduce the same
            dtype: a run whose data carries weights passes ``True`` (float64 on every rank,
            even one whose step has no weighted row), one without ``False`` (int64; weights
            refused).

    Returns:
        0-dim int64 tensor (float64 when weighted). No host sync: pass it straight to
        :func:`token_mean_loss`.
    """
    items = _batches(batches)
    dev = torch.device(device) if device is not None else items[0].device
    has = any(b.weights is not None for b in items)
    if weighted is False and has:
        raise ValueError(
            "count_label_tokens(weighted=False): a batch carries weights; pass weighted=True (every rank) "
            "so that the denominator is the weighted count sum |w|"
        )
    dtype = torch.float64 if (has if weighted is None else weighted) else torch.int64
    n = torch.zeros((), dtype=dtype, device=dev)
    for b in items:
        n = n + _target_mass(b).sum().to(device=dev, dtype=dtype)
    return _all_reduce_sum(n, group)


def normalise_weights(
    batches: PackedBatch | Iterable[PackedBatch],
    normalise: WeightNormalisation | str = WeightNormalisation.TOKEN,
    *,
    sequence_groups: Sequence[Sequence[int]] | None = None,
    num_groups: int | None = None,
    group: ProcessGroup | Literal[False] | None = None,
    device: torch.device | str | None = None,
) -> tuple[list[PackedBatch], torch.Tensor]:
    """The step's micro-batches with their weights turned into the coefficients of the
    ``normalise`` rule, and the step's global denominator: each micro-batch's
    ``token_mean_loss(logits, batch, n)`` (or the fused head given the batch's weights and
    ``n``) is then its share of the rule, and the shares summed over micro-batches and ranks
    are the rule over the whole step, however the sequences were split. One all-reduce per step,
    whichever the rule.

    With ``w`` a target's weight (1 on every target of a row without weights), ``S_i`` sequence
    ``i``'s ``sum |w|`` and ``n_g`` the sequences of group ``g`` in the step whose ``S_i > 0``:

    - ``"token"``: the weights as they are, over ``n = sum |w|`` of the step
      (:func:`count_label_tokens` ``weighted=True``);
    - ``"sequence"``: ``w / S_i`` on sequence ``i``'s targets, over ``n`` = the step's sequences
      with ``S_i > 0``: the mean over sequences of each one's ``sum w * loss / S_i``;
    - ``"group"``: ``w / (S_i * n_g)``, over ``n`` = the step's groups with ``n_g > 0``: the mean
      over groups of each group's mean over its sequences.

    The coefficients of a sequence (of a group) sum in ``|.|`` to 1, so ``n`` is ``sum |c|`` of
    the step: each rule is the token rule on the coefficients (a sequence or group weighted 0
    everywhere drops out, as a target weighted 0 does). ``n`` is counted, not summed, so it is an
    exact integer.

    Args:
        batches: this rank's micro-batches of the step (whole rows: a context-parallel shard holds
            part of each sequence and is refused by ``"sequence"`` and ``"group"``).
        normalise: :class:`~sftpack.sample.WeightNormalisation` or its value.
        sequence_groups: ``"group"`` only: for each batch, the group number of each of its
            sequences, in ``[0, num_groups)``, numbered over the whole step and the same on every
            rank (a sequence without a group gets a number of its own).
        num_groups: ``"group"`` only: the step's groups, on every rank.
        group: the process group to sum over, as in :func:`count_label_tokens` (``False``: none).
        device: where ``n`` lives (default: the first batch's).

    Returns:
        ``(batches, n)``: the batches with float64 :attr:`~sftpack.PackedBatch.weights` (the same
        objects for ``"token"``), and a 0-dim float64 ``n`` (0 when nothing is trained).

    >>> import torch
    >>> from sftpack import PackedBatch
    >>> b = PackedBatch.from_samples([[1, 2, 3, 4, 5], [6, 7]])  # 4 targets and 1
    >>> [c], n = normalise_weights([b], "sequence", group=False)
    >>> c.weights.tolist(), float(n)
    ([0.25, 0.25, 0.25, 0.25, 0.0, 1.0, 0.0], 2.0)
    >>> [c], n = normalise_weights([b], "group", sequence_groups=[[0, 0]], num_groups=1, group=False)
    >>> c.weights.tolist(), float(n)  # one group of two sequences
    ([0.125, 0.125, 0.125, 0.125, 0.0, 0.5, 0.0], 1.0)
    """
    items = _batches(batches)
    rule = choose(WeightNormalisation, normalise, "normalise")
    dev = torch.device(device) if device is not None else items[0].device
    if rule is WeightNormalisation.TOKEN:
        return items, count_label_tokens(items, group=group, device=dev, weighted=True)
    shards = [i for i, b in enumerate(items) if isinstance(b, CPShard)]
    if shards:
        raise ValueError(
            f"normalise_weights({str(rule)!r}): batch {shards[0]} is a context-parallel shard holding part of each "
            "sequence; normalise the whole rows, then shard them (sftpack.handoff.shard_for_cp)"
        )
    masses = [_sequence_mass(b) for b in items]
    if rule is WeightNormalisation.SEQUENCE:
        n = torch.zeros((), dtype=torch.float64, device=dev)
        for m in masses:
            n = n + (m > 0).sum().to(device=dev, dtype=torch.float64)
        return [_scaled(b, m) for b, m in zip(items, masses)], _all_reduce_sum(n, group)
    numbers = _group_numbers(items, sequence_groups, num_groups)
    assert num_groups is not None  # _group_numbers checked it
    sizes = torch.zeros(num_groups, dtype=torch.float64, device=dev)
    for m, g in zip(masses, numbers):
        sizes.index_add_(0, g.to(dev), (m > 0).to(device=dev, dtype=torch.float64))
    sizes = _all_reduce_sum(sizes, group)  # every rank's sequences: each group's n_g over the step
    out = [
        _scaled(b, m * sizes.to(m.device).index_select(0, g.to(m.device))) for b, m, g in zip(items, masses, numbers)
    ]
    return out, (sizes > 0).sum().to(torch.float64)


def _sequence_mass(b: PackedBatch) -> torch.Tensor:
    """``(N,)`` float64 ``sum |w|`` of each sequence of ``b`` (its target count without weights)."""
    mass = _target_mass(b).to(torch.float64)
    return torch.zeros(b.num_sequences, dtype=torch.float64, device=mass.device).index_add(0, segment_ids(b), mass)


def _scaled(b: PackedBatch, divisor: torch.Tensor) -> PackedBatch:
    """``b`` with weights ``w / divisor[its sequence]`` (0 where the divisor is 0: nothing trained there)."""
    w = b.weights.to(torch.float64) if b.weights is not None else (b.labels != IGNORE_INDEX).to(torch.float64)
    d = divisor.index_select(0, segment_ids(b))
    coef = torch.where(d > 0, w / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(w))
    return dataclasses.replace(b, weights=coef)


def _group_numbers(
    items: list[PackedBatch], sequence_groups: Sequence[Sequence[int]] | None, num_groups: int | None
) -> list[torch.Tensor]:
    """Each batch's ``(N,)`` int64 group numbers, checked against the batches and ``num_groups``."""
    if sequence_groups is None or num_groups is None:
        raise ValueError(
            "normalise_weights('group'): give sequence_groups (each batch's group number per sequence) and "
            "num_groups (the step's groups, numbered the same on every rank)"
        )
    if len(sequence_groups) != len(items):
        raise ValueError(
            f"normalise_weights('group'): sequence_groups has {len(sequence_groups)} entries for {len(items)} batches"
        )
    out = []
    for i, (b, g) in enumerate(zip(items, sequence_groups)):
        t = torch.as_tensor(list(g), dtype=torch.int64)
        if t.shape != (b.num_sequences,):
            raise ValueError(
                f"normalise_weights('group'): sequence_groups[{i}] has {t.numel()} numbers but batch {i} holds "
                f"{b.num_sequences} sequences: give one group number per sequence"
            )
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_groups):
            raise ValueError(
                f"normalise_weights('group'): sequence_groups[{i}] holds {int(t.min())}..{int(t.max())}, outside "
                f"[0, num_groups={num_groups})"
            )
        out.append(t)
    return out


def token_mean_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | PackedBatch,
    num_label_tokens: int | torch.Tensor,
    *,
    average_over_ranks: int = 1,
) -> torch.Tensor:
    """This micro-batch's share of the global token-mean loss.

    ``sum(token_losses) / num_label_tokens * average_over_ranks``. Summed over the
    micro-batches of every rank (and divided by ``average_over_ranks`` by the
    gradient average, if any) it is the token mean of the whole global batch. With
    weights (``labels`` a batch with :attr:`~sftpack.PackedBatch.weights`) the numerator is
    ``sum(w * loss)`` and ``num_label_tokens`` must be the weighted count ``sum |w|``
    (:func:`count_label_tokens` of the same batches): the module's one rule.

    Args:
        logits: ``(T, V)`` or ``(1, T, V)``.
        labels: ``(T,)`` shifted labels or the :class:`~sftpack.PackedBatch`.
        num_label_tokens: the *global* count (:func:`count_label_tokens`); a step
            with no target at all (or all weights 0) gives 0 (and zero gradients), not NaN.
        average_over_ranks: ranks the gradient all-reduce averages over (DDP/FSDP:
            the data-parallel size); 1 for a sum all-reduce or a single process.

    Returns:
        0-dim float32 tensor (float64 for float64 logits).
    """
    return _global_share(token_losses(logits, labels).sum(), num_label_tokens, average_over_ranks)


def sequence_loss_sums(logits: torch.Tensor, packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence loss sums and target counts, from the packed boundaries.

    Returns:
        ``(sums, counts)``, each ``(N,)``: float32 (float64 for float64 logits) summed token loss and int64
        number of targets of every sequence (segment) of ``packed``. On a row with
        :attr:`~sftpack.PackedBatch.weights`: ``sum(w * loss)`` and the float64 weighted
        count ``sum |w|`` (the module's one rule). For a
        context-parallel shard, segment ``i`` is sequence ``i``'s chunks on this
        rank: all-reduce both over the CP group before dividing
        (:func:`all_reduce_sequence_sums`).
    """
    per_slot = token_losses(logits, packed)
    seg = segment_ids(packed)
    n = packed.num_sequences
    sums = torch.zeros(n, dtype=per_slot.dtype, device=per_slot.device).index_add(0, seg, per_slot)
    mass = _target_mass(packed)
    counts = torch.zeros(n, dtype=mass.dtype, device=seg.device).index_add(0, seg, mass)
    return sums, counts


def count_sequences(
    batches: PackedBatch | Iterable[PackedBatch],
    *,
    group: ProcessGroup | Literal[False] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Sequences with at least one target, over all micro-batches and ranks.

    The denominator of :func:`sequence_mean_loss`. Same ``group`` / ``device``
    rules as :func:`count_label_tokens` (not for CP shards: a sequence spans
    several; count on the whole rows). With weights: sequences whose ``sum |w|`` is
    positive (a sequence weighted 0 everywhere is not trained, as one without targets).
    """
    items = _batches(batches)
    dev = torch.device(device) if device is not None else items[0].device
    n = torch.zeros((), dtype=torch.int64, device=dev)
    for b in items:
        mass = _target_mass(b)
        counts = torch.zeros(b.num_sequences, dtype=mass.dtype, device=b.device).index_add(0, segment_ids(b), mass)
        n = n + (counts > 0).sum().to(dev)
    return _all_reduce_sum(n, group)


def sequence_mean_loss(
    logits: torch.Tensor,
    packed: PackedBatch,
    num_sequences: int | torch.Tensor,
    *,
    average_over_ranks: int = 1,
) -> torch.Tensor:
    """This micro-batch's share of the per-sequence mean loss.

    Each sequence's token-mean loss, summed over the sequences of ``packed`` that
    have a target, divided by the *global* number of such sequences
    (:func:`count_sequences`). Summed over micro-batches and ranks it equals the
    average over sequences of each sequence's own mean, exactly as unpacked. With
    weights each sequence's mean is ``sum(w * loss) / sum |w|``.

    Args:
        logits: ``(T, V)`` or ``(1, T, V)``.
        packed: the micro-batch (whole rows; see :func:`sequence_loss_sums` for CP).
        num_sequences: the global count; a step without targets gives 0.
        average_over_ranks: as in :func:`token_mean_loss`.

    Returns:
        0-dim float32 tensor (float64 for float64 logits).
    """
    sums, counts = sequence_loss_sums(logits, packed)
    return _global_share(_means(sums, counts).sum(), num_sequences, average_over_ranks)


def _means(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``sums / counts`` where ``counts > 0`` (a target count, or a weight sum below 1), else 0."""
    c = counts.to(sums.dtype)
    return torch.where(c > 0, sums / torch.where(c > 0, c, torch.ones_like(c)), torch.zeros_like(sums))


def all_reduce_sequence_sums(
    sums: torch.Tensor, counts: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Put a context-parallel shard's per-sequence sums back together: sum over ``group``.

    Segment ``i`` of every CP rank's shard is sequence ``i``'s chunks on that rank, so the
    sum over the CP group of each rank's ``(N,)`` sums and counts is the whole sequence's.
    ``sums`` are summed by ``torch.distributed.nn.functional.all_reduce``, whose backward
    sums the gradient over the group too: if every rank computes the same objective ``J``
    from the reassembled sums and contributes ``J / cp_size`` (what a pair count over the
    data-parallel x context-parallel group gives, :func:`sftpack.objectives.count_pairs`),
    each rank's chunks get exactly ``dJ/dsum``, and summing the parameter gradients over the
    ranks (as DDP / Megatron do over DP x CP) gives the unsharded gradient. ``counts`` carry
    no gradient (a plain all-reduce).

    Args:
        sums: ``(N,)`` float, this rank's per-sequence sums (:func:`sequence_loss_sums`).
        counts: ``(N,)`` int64, this rank's per-sequence target counts.
        group: the context-parallel process group (``torch.distributed.group.WORLD`` for all
            ranks); ``torch.distributed`` must be initialised.

    Returns:
        ``(sums, counts)`` of the whole sequences, the same on every rank of ``group``.
    """
    import torch.distributed as dist  # only where a group is given
    import torch.distributed.nn.functional as dist_fn

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "all_reduce_sequence_sums: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first, or read whole rows (no CP group)"
        )
    total = dist_fn.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    n = counts.clone()
    dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    return total, n


def sequence_logprob_sums(
    logits: torch.Tensor, packed: PackedBatch, *, cp_group: ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its labels, from one packed forward.

    ``log p(sequence i) = sum over its targets t of log softmax(logits[t])[labels[t]]``,
    computed as minus :func:`sequence_loss_sums` (one reduction, read from the packed
    boundaries). Targets are the trained tokens only (``labels != -100``): for a preference
    pair, the answer's tokens.

    Args:
        logits: ``(T, V)`` or ``(1, T, V)`` for the slots of ``packed``.
        packed: the row (or several rows laid end to end), or a :class:`~sftpack.handoff.CPShard`.
        cp_group: for a CP shard, the context-parallel group to reassemble the sequences
            over (:func:`all_reduce_sequence_sums`); ``None`` for whole rows. A shard of
            ``cp_size > 1`` without a group is refused (its sums would be partial).

    Returns:
        ``(logps, counts)``, each ``(N,)``: float32 (float64 for float64 logits) summed
        log-probabilities, and int64 number of targets, one per sequence of ``packed``
        (on a row with weights: ``sum(w * log p)`` and the float64 ``sum |w|``, the
        module's one rule).

    >>> import torch
    >>> from sftpack import PackedBatch
    >>> b = PackedBatch.from_samples([[1, 2, 3], [4, 5]])
    >>> logps, n = sequence_logprob_sums(torch.zeros(5, 8), b)  # uniform over 8 ids
    >>> [round(x, 4) for x in logps.tolist()], n.tolist()  # 2 and 1 targets of log(1/8)
    ([-4.1589, -2.0794], [2, 1])
    """
    if isinstance(packed, CPShard) and packed.cp_size > 1 and cp_group is None:
        raise ValueError(
            f"sequence_logprob_sums: packed is a context-parallel shard (cp_size={packed.cp_size}, "
            f"cp_rank={packed.cp_rank}) holding part of each sequence; pass cp_group=<the CP process group> "
            "to sum the sequences over the ranks"
        )
    if cp_group is not None and not isinstance(packed, CPShard):
        raise ValueError(
            "sequence_logprob_sums: cp_group given but packed is a whole row (not a CPShard from "
            "sftpack.handoff.shard_for_cp); summing whole rows over a group would count them several times"
        )
    sums, counts = sequence_loss_sums(logits, packed)
    if cp_group is not None:
        sums, counts = all_reduce_sequence_sums(sums, counts, cp_group)
    return -sums, counts


def sequence_logprob_means(
    logits: torch.Tensor, packed: PackedBatch, *, cp_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Each sequence's mean token log-probability (its sum over its number of targets).

    The length-normalised score of reference-free objectives (SimPO). A sequence with no
    target gets 0. Same arguments as :func:`sequence_logprob_sums`.

    Returns:
        ``(N,)`` float32 (float64 for float64 logits).
    """
    logps, counts = sequence_logprob_sums(logits, packed, cp_group=cp_group)
    return _means(logps, counts)
