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
    """One contract row from flat arrays, as a :class:`~sftpack.PackedBatch`.

    The arguments, the layout and the refusals (:class:`PackedBatchError`) are those of
    :func:`~sftpack.handoff.layout.lay_row`, which computes the row in numpy; ``device``
    says where to put the tensors (default: CPU). Per-slot fields are ``int64``,
    boundaries ``int32``.

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
