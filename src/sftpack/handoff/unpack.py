"""Per-slot values back to sequences: the inverse of packing, on real tokens.

:func:`unpack` gives one tensor per sequence (logits, per-token losses,
log-probs, hidden states); :func:`unpack_padded` a right-padded ``[B, S, ...]``
batch (the exact inverse of :func:`sftpack.trainer.pack_step`). Both read the
boundaries, never ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batch import PackedBatch
from .cp import CPShard
from .errors import PackedBatchError
from .slots import slot_layout

__all__ = ["unpack", "unpack_padded"]


def _real_slots(packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return slot_layout(packed.cu_seqlens, packed.cu_seqlens_padded, packed.num_tokens)


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

    >>> b = PackedBatch.from_samples([[7, 8], [9, 9, 9]], pad_multiple=2)
    >>> b.input_ids.tolist()
    [7, 8, 9, 9, 9, 0]
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

    The exact inverse of :func:`sftpack.trainer.pack_step` on real tokens:
    ``unpack_padded(b.input_ids, b, seq_len=S)`` gives back ``input_ids`` with
    ``padding_value`` after each row's real tokens (and in rows ``pack_step``
    skipped because they were empty).

    Args:
        values: ``(T, ...)`` per-slot values of ``packed``.
        packed: the batch they belong to.
        rows: the batch row of each sequence (``N`` distinct entries). Default:
            ``packed.source_rows`` when the batch records them (``pack_step``
            does), else sequence ``i`` goes to row ``i``.
        batch_size: ``B``; default ``packed.source_batch_size`` when recorded,
            else ``max(rows) + 1``.
        seq_len: ``S``; default the longest real length.
        padding_value: written after each row's real tokens (and into empty rows).

    Returns:
        ``(B, S, *values.shape[1:])``, same dtype and device as ``values``.
    """
    _check_values(values, packed, "unpack_padded")
    seg, offset, real = _real_slots(packed)
    n = packed.num_sequences
    dev = values.device
    if rows is None and packed.source_rows is not None:
        rows = packed.source_rows
        if batch_size is None:
            batch_size = packed.source_batch_size
    if rows is None:
        row_of = torch.arange(n, device=dev)
    else:
        row_of = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows, device=dev).long()
        if row_of.shape != (n,):
            raise PackedBatchError(f"unpack_padded: rows has {tuple(row_of.shape)} entries for N={n} sequences")
        if torch.unique(row_of).numel() != n:
            raise PackedBatchError(
                f"unpack_padded: rows {row_of.tolist()} name a batch row twice; each sequence needs its own row"
            )
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
