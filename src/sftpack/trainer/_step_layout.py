"""How :func:`~sftpack.trainer.pack_step` lays a ``[B, S]`` batch into one row, in three steps.

1. :func:`read_shape`: one small host transfer (where ``lengths`` live: a host-side
   ``lengths`` costs no device sync) for everything the output shape and the checks need,
   then the row width ``T`` (the padded sequences, rounded up to the row multiple, or the
   fixed ``max_seq_len``) and the tail the last segment absorbs.
2. :func:`segment_offsets`: the kept (non-empty) rows and the boundaries, real
   (``cu_seqlens``) and padded (``cu_seqlens_padded``: each sequence padded to the multiple,
   the last one to the row's end), on the batch's device.
3. :func:`gather_slots`: the ``T`` slots' ids, labels and positions by vectorised gathers
   (no Python loop over sequences or tokens; the same code on CPU and CUDA).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._base import round_up
from ..handoff import PackedBatchError
from ..sample import IGNORE_INDEX
from ._step_input import StepOptions, batch_tensor

__all__ = ["Offsets", "RowShape", "Slots", "gather_slots", "read_shape", "segment_offsets"]


class RowShape(NamedTuple):
    """The row's shape: ``n`` non-empty rows in ``width`` slots (``total`` of them the padded
    sequences', ``tail`` the rest), and the longest padded segment ``max_seqlen``."""

    n: int
    total: int
    width: int
    tail: int
    max_seqlen: int


class Offsets(NamedTuple):
    """The kept rows' batch indices (``rows`` on the device, ``source_rows`` on the host), their
    real lengths ``lens``, padded widths ``padded``, and boundaries ``cu`` and ``cup`` (int64)."""

    rows: torch.Tensor
    source_rows: tuple[int, ...]
    lens: torch.Tensor
    padded: torch.Tensor
    cu: torch.Tensor
    cup: torch.Tensor


class Slots(NamedTuple):
    """The row's per-slot tensors: ``input_ids``, shifted ``labels`` and ``position_ids``."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def read_shape(lens_src: torch.Tensor, not_right_padded: torch.Tensor | None, opts: StepOptions) -> RowShape:
    """The row's shape from the rows' lengths (one host transfer), every length in ``[0, S]``,
    every mask right-padded, some row non-empty and the row within ``max_seq_len`` checked."""
    B, S, m = opts.B, opts.S, opts.m
    padded_src = round_up(lens_src, m)
    nonempty = lens_src > 0
    last = torch.argmax(nonempty.to(torch.int64) * torch.arange(1, B + 1, device=lens_src.device))
    parts = [padded_src.sum(), nonempty.sum(), padded_src.max(), padded_src[last], lens_src.min(), lens_src.max()]
    if not_right_padded is not None:
        parts.append(not_right_padded.any().to(torch.int64))
    stats = torch.stack(parts).tolist()
    total, n, max_padded, last_padded, lmin, lmax = (int(x) for x in stats[:6])
    if lmin < 0 or lmax > S:
        bad = int(torch.nonzero((lens_src < 0) | (lens_src > S))[0, 0])
        raise PackedBatchError(
            f"pack_step: lengths[{bad}] = {int(lens_src[bad])} is outside [0, S={S}]; each row holds at most S tokens"
        )
    if not_right_padded is not None and stats[6]:
        bad = int(torch.nonzero(not_right_padded)[0, 0])
        raise PackedBatchError(
            f"pack_step: attention_mask row {bad} is not right-padded (its ones are not a prefix); pack_step takes "
            "right-padded batches: pad on the right in the collator, or give lengths of left-aligned rows"
        )
    if n == 0:
        raise PackedBatchError(f"pack_step: every row of the [{B}, {S}] batch is empty; nothing to pack")
    T = total
    if opts.row_multiple is not None:
        T = round_up(T, opts.row_multiple)
    if opts.width is not None:
        if total > opts.width:
            raise PackedBatchError(
                f"pack_step: {n} sequences take {total} slots after padding each to a multiple of {m}, more than "
                f"max_seq_len={opts.width}: plan smaller micro-batches (plan_microbatches(max_seq_len="
                f"{opts.width}, pad_multiple={m})) or raise max_seq_len"
            )
        T = opts.width
    tail = T - total
    return RowShape(n, total, T, tail, max(max_padded, last_padded + tail))


def segment_offsets(lens_src: torch.Tensor, shape: RowShape, opts: StepOptions) -> Offsets:
    """The kept rows and their boundaries on the batch's device (the tail folded into the last segment)."""
    dev, B = opts.device, opts.B
    lens = lens_src.to(dev, non_blocking=True)
    if shape.n < B:  # rare: drop empty rows (one more read where `lengths` lives, only on this path)
        kept = torch.nonzero(lens_src > 0).reshape(-1)
        source_rows: tuple[int, ...] = tuple(kept.tolist())
        rows = kept.to(dev, non_blocking=True)
        lens = lens.index_select(0, rows)
    else:
        rows = torch.arange(B, device=dev)
        source_rows = tuple(range(B))
    padded = round_up(lens, opts.m)
    if shape.tail:
        padded = torch.cat([padded[:-1], padded[-1:] + shape.tail])
    cup = torch.zeros(shape.n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(padded, 0, out=cup[1:])
    cu = torch.zeros(shape.n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lens, 0, out=cu[1:])
    return Offsets(rows, source_rows, lens, padded, cu, cup)


def gather_slots(
    input_ids: torch.Tensor,
    off: Offsets,
    width: int,
    opts: StepOptions,
    *,
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
) -> Slots:
    """The ``width`` slots of the row: each real slot's token, its target (the next token where
    that one is trainable, else ``IGNORE_INDEX``) and its position in its sequence."""
    dev, B, S = opts.device, opts.B, opts.S
    # index_select rather than x[idx]: the generic advanced-indexing kernel is ~6x
    # slower on CPU for 1-D gathers, and these gathers are most of the work.
    seg = torch.repeat_interleave(torch.arange(off.lens.shape[0], device=dev), off.padded, output_size=width)
    pos = torch.arange(width, device=dev) - off.cup.index_select(0, seg)
    seg_len = off.lens.index_select(0, seg)
    real = pos < seg_len
    # Flat index of each slot's source token in the [B, S] batch. Padding slots may
    # point past their row; clamp keeps them in bounds and `real` overwrites them.
    src = (pos + (off.rows * S).index_select(0, seg)).clamp_(max=B * S - 1)
    out_ids = torch.where(real, input_ids.reshape(-1).index_select(0, src).to(torch.int64), opts.pad_id)
    # Real tokens are contiguous in the row, so "the next token" of a real slot is the
    # next slot whenever it is still real in the same sequence: shift, don't re-gather.
    ok = torch.zeros_like(real)
    ok[:-1] = (pos[:-1] + 1) < seg_len[:-1]
    target = torch.empty_like(out_ids)
    target[-1] = IGNORE_INDEX
    if labels is not None:
        lab = batch_tensor("labels", labels, opts).reshape(-1).index_select(0, src).to(torch.int64)
        target[:-1] = lab[1:]
        ok &= target != IGNORE_INDEX
    else:
        target[:-1] = out_ids[1:]
        if loss_mask is not None:
            lm = batch_tensor("loss_mask", loss_mask, opts).reshape(-1).index_select(0, src)
            ok[:-1] &= lm[1:].bool()
    return Slots(out_ids, torch.where(ok, target, IGNORE_INDEX), pos)
