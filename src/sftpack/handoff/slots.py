"""Per-slot facts read from the boundaries: which segment a slot belongs to, its
offset in that segment, and whether it holds a real token or padding.

One implementation for every caller (the batch's ``real_token_mask``, unpacking,
the loss, the reference attention). Everything is computed from
``cu_seqlens`` / ``cu_seqlens_padded`` with tensor operations and no host sync
(``T`` comes from a tensor shape), never from ``position_ids``: a CP shard or a
user's own positions may differ from the offsets.

    cu_seqlens          [0, 5, 15]
    cu_seqlens_padded   [0, 8, 20]
    segment_ids         0 0 0 0 0 0 0 0 1 1 1 1 1 1 1 1 1 1 1 1
    offsets             0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7 8 9 10 11
    real                T T T T T F F F T T T T T T T T T T F  F
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Segmented", "real_token_mask", "segment_ids", "slot_layout"]


class Segmented(Protocol):
    """What :func:`segment_ids` reads of a row: a :class:`~sftpack.PackedBatch` (typed by this
    protocol, not by the class, so that ``slots`` stays below ``batch`` and never imports it)."""

    @property
    def cu_seqlens_padded(self) -> torch.Tensor: ...
    @property
    def num_tokens(self) -> int: ...


def _segment_of(cu_seqlens_padded: torch.Tensor, num_tokens: int) -> torch.Tensor:
    padded = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long()
    n = padded.shape[0]
    return torch.repeat_interleave(torch.arange(n, device=padded.device), padded, output_size=num_tokens)


def segment_ids(packed: Segmented) -> torch.Tensor:
    """``(T,)`` int64: the segment (sequence) index of every slot of ``packed`` (a
    :class:`~sftpack.PackedBatch`), padding included; no host sync (the tensor
    shapes give ``T``).

    >>> from sftpack import PackedBatch
    >>> segment_ids(PackedBatch.from_samples([[7, 8], [9, 9, 9]])).tolist()
    [0, 0, 1, 1, 1]
    """
    return _segment_of(packed.cu_seqlens_padded, packed.num_tokens)


def slot_layout(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(segment, offset, real)`` per slot, each ``(T,)``: segment index (int64),
    offset of the slot in its segment (int64), and whether it is a real token (bool)."""
    seg = _segment_of(cu_seqlens_padded, num_tokens)
    offset = torch.arange(num_tokens, device=seg.device) - cu_seqlens_padded.long().index_select(0, seg)
    real = offset < (cu_seqlens[1:] - cu_seqlens[:-1]).long().index_select(0, seg)
    return seg, offset, real


def real_token_mask(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``(T,)`` bool: True on real tokens, False on padding slots.

    >>> real_token_mask(torch.tensor([0, 1, 3]), torch.tensor([0, 2, 4]), 4).tolist()
    [True, False, True, True]
    """
    return slot_layout(cu_seqlens, cu_seqlens_padded, num_tokens)[2]
