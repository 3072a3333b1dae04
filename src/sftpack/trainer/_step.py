"""``pack_step``: a right-padded ``[B, S]`` batch packed into one flat row at the step.

Vectorised tensor operations over the ``T`` output slots, the same code on CPU
and CUDA; one small host transfer for the output shape and the checks. Rows with
media (images) hand their samples' :class:`~sftpack.handoff.payload.Media` along
(``media=``): laid at the packed offsets by :meth:`Media.lay
<sftpack.handoff.payload.Media.lay>`, as :meth:`PackedBatch.from_samples
<sftpack.PackedBatch.from_samples>` lays them.

The steps, each its own unit: the input checked (``_step_input``: the options, each row's
length), the row laid (``_step_layout``: the shape in one host transfer, the boundaries, the
slots), the media checked and laid (``_step_payload``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._base import renamed
from ..handoff import PackedBatch, PackedBatchError
from ..handoff.payload import Media
from ..handoff.slots import slot_layout
from ..sample import IGNORE_INDEX
from ._step_input import check_options, check_padding, source_lengths
from ._step_layout import gather_slots, read_shape, segment_offsets
from ._step_payload import check_media, lay_media

__all__ = ["pack_step"]


def pack_step(
    input_ids: torch.Tensor,
    lengths: torch.Tensor | Sequence[int] | np.ndarray | None = None,
    loss_mask: torch.Tensor | None = None,
    *,
    pad_multiple: int = 1,
    pad_to_multiple_of: int | None = None,
    max_seq_len: int | None = None,
    pad_id: int = 0,
    sequence_ids: Sequence[Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    media: Sequence[Media | None] | None = None,
    pad_to: int | None = None,
    weights: torch.Tensor | None = None,
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
        max_seq_len: fixed row width ``T`` (pipeline parallelism needs one width for
            every micro-batch; the ``max_seq_len`` the micro-batches were planned with,
            :func:`~sftpack.trainer.plan_microbatches`). Must be a multiple of
            ``pad_multiple`` and of ``pad_to_multiple_of``; raises if the padded
            sequences do not fit. ``None``: as wide as the padded sequences.
        pad_id: integer id written into padding slots.
        sequence_ids: optional ``B`` ids, one per batch row (the conversation each
            row holds); the result's ``sequence_ids`` keeps those of the non-empty
            rows. Default ``None``.
        attention_mask: ``(B, S)``, nonzero on real tokens; must be right-padded
            (ones then zeros in every row). Alternative to ``lengths``.
        labels: ``(B, S)`` int, Hugging Face convention (unshifted, -100 = ignore):
            ``labels[b, t] != -100`` marks token ``t`` trainable and is its target
            value (normally ``input_ids[b, t]``). Alternative to ``loss_mask``.
        media: optional ``B`` entries, one per batch row: the
            :class:`~sftpack.handoff.payload.Media` of the sample the row holds
            (``sample.media``: slots relative to the sample, multimodal positions of its
            own tokens) or ``None`` for a row without media. The row's media
            (``batch.media``) is theirs laid at the packed offsets
            (:meth:`Media.lay <sftpack.handoff.payload.Media.lay>`), on ``input_ids.device``.
            Cheap checks only (counts, kinds, widths, ``pad_id``); :meth:`PackedBatch.validate
            <sftpack.PackedBatch.validate>` checks every run against the tokens.
        pad_to: the deprecated spelling of ``max_seq_len`` (accepted, with a
            ``DeprecationWarning``, until the next release).
        weights: optional ``(B, S)`` float32 / float64 per-token weights (or advantages),
            ``weights[b, t]`` belonging to token ``t`` of row ``b`` like ``loss_mask``
            (:attr:`sftpack.Sample.weights`); the result's :attr:`~sftpack.PackedBatch.weights`
            hold each slot's target's (the next token's), 0 where the label is -100, as
            :meth:`PackedBatch.from_samples` lays them. Read on real tokens only; finite there.

    Returns:
        A :class:`~sftpack.PackedBatch` on ``input_ids.device``: the ``N`` non-empty
        rows in batch order, each padded to ``pad_multiple``, the row's tail folded
        into the last segment. ``source_rows`` holds each segment's batch row
        and ``source_batch_size`` is ``B`` (what :func:`unpack_padded` reads).
        Identical to ``PackedBatch.from_samples`` on the same sequences (their media included).

    Rows of length 0 are skipped (they hold no tokens and no targets; a data-parallel
    rank that pads its batch with empty rows keeps working): ``N`` is the number of
    non-empty rows and ``source_rows`` says which rows they were. A batch whose
    rows are all empty raises.

    Raises:
        PackedBatchError: bad shapes or options, a length outside ``[0, S]``, a
            mask that is not right-padded, or a batch that does not fit ``max_seq_len``;
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
    max_seq_len = renamed("pack_step", "max_seq_len", max_seq_len, "pad_to", pad_to)
    opts = check_options(input_ids, pad_id=pad_id, sequence_ids=sequence_ids)
    parts = check_media(media, opts.B, pad_id)
    opts = check_padding(
        opts, pad_multiple=pad_multiple, pad_to_multiple_of=pad_to_multiple_of, max_seq_len=max_seq_len
    )
    if lengths is not None and attention_mask is not None:
        raise PackedBatchError("pack_step: give lengths or attention_mask, not both")
    if loss_mask is not None and labels is not None:
        raise PackedBatchError("pack_step: give loss_mask or labels, not both")
    lens_src, not_right_padded = source_lengths(opts, lengths, attention_mask)
    shape = read_shape(lens_src, not_right_padded, opts)
    off = segment_offsets(lens_src, shape, opts)
    slots = gather_slots(input_ids, off, shape.width, opts, loss_mask=loss_mask, labels=labels)
    batch = PackedBatch(
        input_ids=slots.input_ids,
        labels=slots.labels,
        position_ids=slots.position_ids,
        cu_seqlens=off.cu.to(torch.int32),
        cu_seqlens_padded=off.cup.to(torch.int32),
        max_seqlen=int(shape.max_seqlen),
        sequence_ids=None if sequence_ids is None else tuple(sequence_ids[r] for r in off.source_rows),
        source_rows=off.source_rows,
        source_batch_size=opts.B,
    )
    if parts is not None:
        batch.media = lay_media(parts, batch, opts.device)
    if weights is not None:
        batch.weights = _slot_weights(weights, batch, off.rows, opts.B, opts.S)
    return batch


def _slot_weights(weights: torch.Tensor, batch: PackedBatch, rows: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """``(T,)`` the packed row's weights: slot ``j`` of a segment takes its source row's
    ``weights[j + 1]`` (its target's), 0 where the label is -100."""
    if not isinstance(weights, torch.Tensor) or weights.shape != (B, S):
        shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise PackedBatchError(f"pack_step: weights must be a ({B}, {S}) tensor like input_ids, got {shape}")
    if weights.dtype not in (torch.float32, torch.float64):
        raise PackedBatchError(f"pack_step: weights must be float32 or float64, got {weights.dtype}")
    seg, offset, _ = slot_layout(batch.cu_seqlens, batch.cu_seqlens_padded, batch.num_tokens)
    src = (offset + 1 + rows.to(seg.device).index_select(0, seg) * S).clamp_(max=B * S - 1)
    w = weights.to(batch.device).reshape(-1).index_select(0, src)
    out = torch.where(batch.labels != IGNORE_INDEX, w, torch.zeros_like(w))
    bad = torch.nonzero(~torch.isfinite(out)).reshape(-1)
    if bad.numel():
        k = int(bad[0])
        raise PackedBatchError(
            f"pack_step: weights of batch row {int(rows[seg[k]])}, token {int(offset[k]) + 1} is {float(out[k])}: "
            "every weight must be finite"
        )
    return out
