"""The trainer path: pack an already padded ``[B, S]`` batch at the training step.

The data loader hands the step an ordinary right-padded batch; :func:`pack_step`
turns it, on whatever device it lives, into one flat :class:`~sftpack.PackedBatch`
as wide as this batch needs. Batch ``[2, 10]`` with lengths 5 and 10, each
sequence padded to a multiple of 4 (context parallelism 2)::

    input_ids [B, S]          A A A A A . . . . .        pack_step        A A A A A . . . | B B B B B B B B B B . .
                              B B B B B B B B B B    ------------->       cu_seqlens        [0, 5, 15]
                                                                          cu_seqlens_padded [0, 8, 20]

Everything is a handful of vectorised tensor operations over the ``T`` output
slots (no Python loop over sequences or tokens), so the same code runs on CPU
and CUDA tensors. The only host synchronisation is the one the output shape
needs: ``T``, ``N`` and ``max_seqlen`` (plus the input checks) come back in one
small transfer. On 2 CPU cores, ``B=64, S=4096`` with real SFT lengths (~55k
real tokens) packs in about 2 ms, about 2x a bare boolean-mask gather of the real
tokens, the least any packer must do (``benchmarks/bench_trainer.py``).

This module also holds what meets packing at the step:

- :func:`pad_multiple_for`: the per-sequence and per-row multiples that context
  parallelism, sequence parallelism and FP8 need.
- :func:`shard_for_cp` / :func:`unshard_cp` / :func:`cp_slot_indices`: a row cut
  for context parallelism and put back together.
- :func:`unpack` / :func:`unpack_padded`: per-slot values back to sequences.
- :func:`plan_microbatches`: token-budget micro-batches balanced over
  data-parallel ranks (bins from :mod:`sftpack.binpack`).
- The loss normalisation lives in :mod:`sftpack.loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ._trainer_align import Alignment, AlignmentError, FP8Recipe, pad_multiple_for
from ._trainer_cp import CPShard, cp_slot_indices, shard_for_cp, unshard_cp
from ._trainer_plan import CostModel, MicrobatchPlan, PlanError, plan_microbatches
from .batch import PackedBatch, PackedBatchError
from .sample import IGNORE_INDEX

__all__ = [
    "Alignment",
    "AlignmentError",
    "CPShard",
    "CostModel",
    "FP8Recipe",
    "MicrobatchPlan",
    "PlanError",
    "cp_slot_indices",
    "pack_step",
    "pad_multiple_for",
    "plan_microbatches",
    "segment_ids",
    "shard_for_cp",
    "unpack",
    "unpack_padded",
    "unshard_cp",
]


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise PackedBatchError(f"pack_step: {name} must be a positive integer, got {value!r}")
    return int(value)


def _batch_tensor(name: str, t: Any, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise PackedBatchError(f"pack_step: {name} must be a torch.Tensor of shape {shape}, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise PackedBatchError(
            f"pack_step: {name} has shape {tuple(t.shape)} but input_ids has shape {shape}; give one entry per token"
        )
    if t.device != device:
        raise PackedBatchError(f"pack_step: {name} is on {t.device} but input_ids is on {device}; move it first")
    return t


def pack_step(
    input_ids: torch.Tensor,
    lengths: torch.Tensor | Sequence[int] | np.ndarray | None = None,
    loss_mask: torch.Tensor | None = None,
    pad_multiple: int = 1,
    pad_to_multiple_of: int | None = None,
    pad_to: int | None = None,
    pad_id: int = 0,
    *,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> PackedBatch:
    """Pack a right-padded ``[B, S]`` batch into one flat row.

    Args:
        input_ids: ``(B, S)`` integer token ids, each row's real tokens first
            (right padding). Any device; the result lives on the same one.
        lengths: ``(B,)`` real length of each row, ``0 <= lengths[b] <= S``: a
            tensor on any device, a list or a numpy array. A host-side ``lengths``
            (list, numpy, CPU tensor) with CUDA ``input_ids`` costs no device sync
            at all. Give either ``lengths`` or ``attention_mask``.
        loss_mask: ``(B, S)`` bool, True on tokens the model is trained to produce
            (the assistant's tokens). The target of slot ``t`` is trainable iff
            token ``t+1`` is. ``None`` and no ``labels``: every token is trainable.
        pad_multiple: pad each sequence to a multiple of this (``2*CP`` for context
            parallelism; see :func:`pad_multiple_for`).
        pad_to_multiple_of: pad the whole row to a multiple of this (FP8 needs 16,
            32 or 128 per CP/TP rank). Must be a multiple of ``pad_multiple`` so the
            last segment, which absorbs the tail, stays aligned.
        pad_to: fixed row width ``T`` (pipeline parallelism needs one width for
            every micro-batch). Must be a multiple of ``pad_multiple`` and of
            ``pad_to_multiple_of``; raises if the padded sequences do not fit.
        pad_id: id written into padding slots.
        attention_mask: ``(B, S)``, nonzero on real tokens; must be right-padded
            (ones then zeros in every row). Alternative to ``lengths``.
        labels: ``(B, S)`` int, Hugging Face convention (unshifted, -100 = ignore):
            ``labels[b, t] != -100`` marks token ``t`` trainable and is its target
            value (normally ``input_ids[b, t]``). Alternative to ``loss_mask``.

    Returns:
        A :class:`~sftpack.PackedBatch` on ``input_ids.device``: the ``N`` non-empty
        rows in batch order, each padded to ``pad_multiple``, the row's tail folded
        into the last segment. ``sequence_ids`` holds each segment's batch row.
        Identical to ``PackedBatch.from_samples`` on the same sequences.

    Rows of length 0 are skipped (they hold no tokens and no targets; a data-parallel
    rank that pads its batch with empty rows keeps working): ``N`` is the number of
    non-empty rows and ``sequence_ids`` says which rows they were. A batch whose
    rows are all empty raises.

    Raises:
        PackedBatchError: bad shapes or options, a length outside ``[0, S]``, a
            mask that is not right-padded, or a batch that does not fit ``pad_to``;
            the message names the numbers.

    >>> ids = torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0, 0, 0],
    ...                     [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    >>> b = pack_step(ids, torch.tensor([5, 10]), pad_multiple=4)
    >>> b.num_tokens, b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist(), b.max_seqlen
    (20, [0, 5, 15], [0, 8, 20], 12)
    >>> b.input_ids.tolist()
    [1, 2, 3, 4, 5, 0, 0, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 0, 0]
    >>> b.labels.tolist()[:9]
    [2, 3, 4, 5, -100, -100, -100, -100, 12]
    >>> b.position_ids.tolist()[6:10]
    [6, 7, 0, 1]
    """
    # ------------------------------------------------------------ options
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise PackedBatchError(f"pack_step: input_ids must be a (B, S) tensor, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise PackedBatchError(f"pack_step: input_ids must hold integer ids, got {input_ids.dtype}")
    B, S = (int(x) for x in input_ids.shape)
    if B == 0 or S == 0:
        raise PackedBatchError(f"pack_step: the batch is empty (shape {(B, S)})")
    dev = input_ids.device
    m = _positive_int("pad_multiple", pad_multiple)
    row_mult = _positive_int("pad_to_multiple_of", pad_to_multiple_of, allow_none=True)
    width = _positive_int("pad_to", pad_to, allow_none=True)
    assert m is not None
    # The row's tail is folded into the last segment, so the tail itself must be a
    # multiple of the per-sequence multiple or the last segment loses its CP alignment.
    if row_mult is not None and row_mult % m:
        raise PackedBatchError(
            f"pack_step: pad_to_multiple_of={row_mult} is not a multiple of pad_multiple={m}; the last sequence "
            f"absorbs the row's tail and would lose its alignment: use pad_to_multiple_of={np.lcm(row_mult, m)}"
        )
    if width is not None and width % (row_mult or m):
        name, mult = ("pad_to_multiple_of", row_mult) if row_mult else ("pad_multiple", m)
        raise PackedBatchError(
            f"pack_step: pad_to={width} is not a multiple of {name}={mult}; the last sequence absorbs the row's "
            f"tail and would lose its alignment: use pad_to={int(-(-width // mult) * mult)}"
        )
    if lengths is not None and attention_mask is not None:
        raise PackedBatchError("pack_step: give lengths or attention_mask, not both")
    if loss_mask is not None and labels is not None:
        raise PackedBatchError("pack_step: give loss_mask or labels, not both")

    # ------------------------------------------------------------ lengths
    mask_not_right_padded = None
    if attention_mask is not None:
        am = _batch_tensor("attention_mask", attention_mask, (B, S), dev).bool()
        lens_src = am.sum(1)
        # Right-padded means no 0 -> 1 step along a row (one pass, cheaper than
        # comparing with "column < length").
        mask_not_right_padded = (am[:, 1:] > am[:, :-1]).any(1)
    elif lengths is not None:
        if isinstance(lengths, torch.Tensor):
            lens_src = lengths.reshape(-1)
        else:
            lens_src = torch.as_tensor(np.asarray(lengths).reshape(-1))
        if lens_src.dtype.is_floating_point or lens_src.dtype == torch.bool:
            raise PackedBatchError(f"pack_step: lengths must be integers, got {lens_src.dtype}")
        if lens_src.shape[0] != B:
            raise PackedBatchError(f"pack_step: lengths has {lens_src.shape[0]} entries for a batch of B={B} rows")
    else:
        raise PackedBatchError("pack_step: give lengths (B,) or attention_mask (B, S) to say where each row ends")
    lens_src = lens_src.to(torch.int64)

    # One host transfer for everything the output shape and the checks need. It
    # happens where `lengths` lives: a host-side lengths costs no device sync.
    padded_src = -(-lens_src // m) * m
    nonempty = lens_src > 0
    last = torch.argmax(nonempty.to(torch.int64) * torch.arange(1, B + 1, device=lens_src.device))
    stats_parts = [
        padded_src.sum(),
        nonempty.sum(),
        padded_src.max(),
        padded_src[last],
        lens_src.min(),
        lens_src.max(),
    ]
    if mask_not_right_padded is not None:
        stats_parts.append(mask_not_right_padded.any().to(torch.int64))
    stats = torch.stack(stats_parts).tolist()
    total, n, max_padded, last_padded, lmin, lmax = (int(x) for x in stats[:6])
    if lmin < 0 or lmax > S:
        bad = int(torch.nonzero((lens_src < 0) | (lens_src > S))[0, 0])
        raise PackedBatchError(
            f"pack_step: lengths[{bad}] = {int(lens_src[bad])} is outside [0, S={S}]; each row holds at most S tokens"
        )
    if mask_not_right_padded is not None and stats[6]:
        bad = int(torch.nonzero(mask_not_right_padded)[0, 0])
        raise PackedBatchError(
            f"pack_step: attention_mask row {bad} is not right-padded (its ones are not a prefix); pack_step takes "
            "right-padded batches: pad on the right in the collator, or give lengths of left-aligned rows"
        )
    if n == 0:
        raise PackedBatchError(f"pack_step: every row of the [{B}, {S}] batch is empty; nothing to pack")

    # ------------------------------------------------------------ row width
    T = total
    if row_mult is not None:
        T = -(-T // row_mult) * row_mult
    if width is not None:
        if total > width:
            raise PackedBatchError(
                f"pack_step: {n} sequences take {total} slots after padding each to a multiple of {m}, more than "
                f"pad_to={width}: lower the micro-batch token budget (plan_microbatches(token_budget={width}, "
                f"pad_multiple={m})) or raise pad_to"
            )
        T = width
    tail = T - total
    max_seqlen = max(max_padded, last_padded + tail)

    lens = lens_src.to(dev, non_blocking=True)
    if n < B:  # rare: drop empty rows (one more read where `lengths` lives, only on this path)
        kept = torch.nonzero(lens_src > 0).reshape(-1)
        sequence_ids: tuple = tuple(kept.tolist())
        rows = kept.to(dev, non_blocking=True)
        lens = lens.index_select(0, rows)
    else:
        rows = torch.arange(B, device=dev)
        sequence_ids = tuple(range(B))
    padded = -(-lens // m) * m
    if tail:
        padded = torch.cat([padded[:-1], padded[-1:] + tail])
    cup = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(padded, 0, out=cup[1:])
    cu = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lens, 0, out=cu[1:])

    # ------------------------------------------------------------ slots
    # index_select rather than x[idx]: the generic advanced-indexing kernel is ~6x
    # slower on CPU for 1-D gathers, and these gathers are most of the work.
    seg = torch.repeat_interleave(torch.arange(n, device=dev), padded, output_size=T)
    pos = torch.arange(T, device=dev) - cup.index_select(0, seg)
    seg_len = lens.index_select(0, seg)
    real = pos < seg_len
    # Flat index of each slot's source token in the [B, S] batch. Padding slots may
    # point past their row; clamp keeps them in bounds and `real` overwrites them.
    src = (pos + (rows * S).index_select(0, seg)).clamp_(max=B * S - 1)
    out_ids = torch.where(real, input_ids.reshape(-1).index_select(0, src).to(torch.int64), pad_id)
    # Real tokens are contiguous in the row, so "the next token" of a real slot is the
    # next slot whenever it is still real in the same sequence: shift, don't re-gather.
    ok = torch.zeros_like(real)
    ok[:-1] = (pos[:-1] + 1) < seg_len[:-1]
    target = torch.empty_like(out_ids)
    target[-1] = IGNORE_INDEX
    if labels is not None:
        lab = _batch_tensor("labels", labels, (B, S), dev).reshape(-1).index_select(0, src).to(torch.int64)
        target[:-1] = lab[1:]
        ok &= target != IGNORE_INDEX
    else:
        target[:-1] = out_ids[1:]
        if loss_mask is not None:
            lm = _batch_tensor("loss_mask", loss_mask, (B, S), dev).reshape(-1).index_select(0, src)
            ok[:-1] &= lm[1:].bool()
    out_labels = torch.where(ok, target, IGNORE_INDEX)

    return PackedBatch(
        input_ids=out_ids,
        labels=out_labels,
        position_ids=pos,
        cu_seqlens=cu.to(torch.int32),
        cu_seqlens_padded=cup.to(torch.int32),
        max_seqlen=int(max_seqlen),
        sequence_ids=sequence_ids,
    )


# ---------------------------------------------------------------- unpacking
def segment_ids(packed: PackedBatch) -> torch.Tensor:
    """``(T,)`` int64: the segment (sequence) index of every slot, padding included.

    Computed from ``cu_seqlens_padded`` without a host sync (``T`` is known from the
    tensor shapes).
    """
    padded = (packed.cu_seqlens_padded[1:] - packed.cu_seqlens_padded[:-1]).long()
    n = padded.shape[0]
    return torch.repeat_interleave(torch.arange(n, device=padded.device), padded, output_size=packed.num_tokens)


def _real_slots(packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(seg, offset, real)`` per slot: segment index, offset in the segment, real?

    Read from the boundaries, not from ``position_ids`` (never infer boundaries from
    positions: a CP shard or a user's own positions may differ).
    """
    seg = segment_ids(packed)
    offset = torch.arange(packed.num_tokens, device=seg.device) - packed.cu_seqlens_padded.long()[seg]
    real = offset < (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).long()[seg]
    return seg, offset, real


def _check_values(values: torch.Tensor, packed: PackedBatch, who: str) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() < 1 or values.shape[0] != packed.num_tokens:
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise PackedBatchError(
            f"{who}: values must have one entry per slot, shape (T={packed.num_tokens}, ...), got {shape}"
        )
    if isinstance(packed, CPShard):
        raise PackedBatchError(
            f"{who}: got a context-parallel shard; put the row back together first with unshard_cp(pieces, packed)"
        )


def unpack(values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Per-slot values back to one tensor per sequence, real tokens only.

    Args:
        values: ``(T, ...)`` anything computed per slot of ``packed`` (logits,
            per-token losses, log-probs, hidden states, ``packed.input_ids``).
        packed: the batch the values belong to.

    Returns:
        ``N`` tensors, sequence ``i`` of shape ``(l_i, ...)`` with ``l_i`` its real
        length; views into one gathered tensor (differentiable).

    >>> b = pack_step(torch.tensor([[7, 8, 0], [9, 9, 9]]), [2, 3], pad_multiple=2)
    >>> [x.tolist() for x in unpack(b.input_ids, b)]
    [[7, 8], [9, 9, 9]]
    """
    _check_values(values, packed, "unpack")
    _, _, real = _real_slots(packed)
    flat = values[real]
    return list(torch.split(flat, packed.seqlens.tolist()))


def unpack_padded(
    values: torch.Tensor,
    packed: PackedBatch,
    *,
    rows: Sequence[int] | torch.Tensor | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    padding_value: float | int = 0,
) -> torch.Tensor:
    """Per-slot values back to a right-padded ``(B, S, ...)`` batch.

    The exact inverse of :func:`pack_step` on real tokens:
    ``unpack_padded(b.input_ids, b, seq_len=S)`` gives back ``input_ids`` with
    ``padding_value`` after each row's real tokens.

    Args:
        values: ``(T, ...)`` per-slot values of ``packed``.
        packed: the batch they belong to.
        rows: the batch row of each sequence (``N`` entries). Default: sequence
            ``i`` goes to row ``i``. When ``pack_step`` skipped empty rows, pass
            ``rows=packed.sequence_ids`` (it records each segment's row there) and
            the original ``batch_size``.
        batch_size: ``B``; default ``max(rows) + 1``.
        seq_len: ``S``; default the longest real length.
        padding_value: written after each row's real tokens (and into empty rows).

    Returns:
        ``(B, S, *values.shape[1:])``, same dtype and device as ``values``.
    """
    _check_values(values, packed, "unpack_padded")
    seg, offset, real = _real_slots(packed)
    n = packed.num_sequences
    dev = values.device
    if rows is None:
        row_of = torch.arange(n, device=dev)
    else:
        row_of = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows, device=dev).long()
        if row_of.shape != (n,):
            raise PackedBatchError(f"unpack_padded: rows has {tuple(row_of.shape)} entries for N={n} sequences")
    B = int(row_of.max()) + 1 if batch_size is None else int(batch_size)
    S = int(packed.seqlens.max()) if seq_len is None else int(seq_len)
    longest = int(packed.seqlens.max())
    if S < longest:
        raise PackedBatchError(f"unpack_padded: seq_len={S} is shorter than the longest sequence ({longest} tokens)")
    if int(row_of.min()) < 0 or int(row_of.max()) >= B:
        raise PackedBatchError(f"unpack_padded: rows {row_of.tolist()} fall outside a batch of {B} rows")
    dest = row_of[seg[real]] * S + offset[real]
    out = values.new_full((B * S, *values.shape[1:]), padding_value)
    out = out.index_copy(0, dest, values[real])
    return out.view(B, S, *values.shape[1:])
