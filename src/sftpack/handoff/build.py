"""``build_row``: one contract row from flat arrays, the one row builder every path uses.

The offline path reads a row's sequences from memory-mapped arrays, the loader
from its buffer; neither materialises :class:`~sftpack.Sample` objects. Both
hand :func:`build_row` the sequences' tokens and masks laid end to end and their
lengths; :func:`~sftpack.handoff.layout.lay_row` computes the row in numpy
(below the batch module) and :meth:`PackedBatch.from_row` makes it tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from numpy.typing import ArrayLike

from .batch import PackedBatch
from .layout import lay_row

__all__ = ["build_row"]


def build_row(
    input_ids: ArrayLike,
    loss_mask: ArrayLike,
    lengths: ArrayLike,
    *,
    row_width: int | None = None,
    pad_multiple: int = 1,
    pad_id: int = 0,
    sequence_ids: Sequence[Any] | None = None,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """One contract row from flat arrays.

    Args:
        input_ids: ``(L,)`` the sequences' token ids laid end to end (numpy array or
            memmap slice of any integer dtype), ``L = sum(lengths)``.
        loss_mask: ``(L,)`` bool (or 0/1): True on tokens the model is trained to
            produce. The target of token ``j`` is trainable iff token ``j+1`` is and
            belongs to the same sequence.
        lengths: ``(N,)`` real length of each sequence, each ``>= 1``.
        row_width: fixed row width ``T`` (a multiple of ``pad_multiple``); the tail
            padding is folded into the last segment. ``None``: exactly as wide as
            the padded sequences.
        pad_multiple: pad each sequence to a multiple of this (``2*CP``).
        pad_id: integer id written into padding slots.
        sequence_ids: ``N`` ids, one per sequence (the conversation each holds).
        device: where to put the tensors (default: CPU).

    Returns:
        A :class:`~sftpack.PackedBatch` (``int64`` per-slot fields, ``int32``
        boundaries).

    Raises:
        PackedBatchError: mismatched sizes, a non-integer dtype, a negative token id or
            ``pad_id``, an empty sequence,
            a ``row_width`` that is not a multiple of ``pad_multiple``, or padded
            sequences that do not fit ``row_width`` (the message gives the numbers).

    >>> import numpy as np
    >>> b = build_row(np.arange(1, 16), np.ones(15, bool), [5, 10], row_width=36, pad_multiple=4)
    >>> b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist(), b.max_seqlen
    ([0, 5, 15], [0, 8, 36], 28)
    """
    row = lay_row(
        input_ids,
        loss_mask,
        lengths,
        row_width=row_width,
        pad_multiple=pad_multiple,
        pad_id=pad_id,
        sequence_ids=sequence_ids,
    )
    return PackedBatch.from_row(row, sequence_ids=sequence_ids, device=device)
