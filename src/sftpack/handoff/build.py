"""``build_row``: one contract row from flat arrays, the one row builder every path uses.

The offline path reads a row's sequences from memory-mapped arrays, the loader
from its buffer; neither materialises :class:`~sftpack.Sample` objects. Both
hand :func:`build_row` the sequences' tokens and masks laid end to end and their
lengths; :func:`~sftpack.handoff.layout.lay_row` computes the row in numpy
(below the batch module) and :meth:`PackedBatch.from_row` makes it tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike

from .._base import renamed
from .batch import PackedBatch
from .layout import fit_parts, join_parts, lay_row, lay_weights, split_weights

__all__ = ["build_parts", "build_row", "wrap_parts"]


def build_row(
    input_ids: ArrayLike,
    loss_mask: ArrayLike,
    lengths: ArrayLike,
    *,
    max_seq_len: int | None = None,
    pad_multiple: int = 1,
    pad_id: int = 0,
    sequence_ids: Sequence[Any] | None = None,
    device: torch.device | str | None = None,
    row_width: int | None = None,
    weights: ArrayLike | None = None,
) -> PackedBatch:
    """One contract row from flat arrays, as a :class:`~sftpack.PackedBatch`.

    The arguments, the layout and the refusals (:class:`PackedBatchError`) are those of
    :func:`~sftpack.handoff.layout.lay_row`, which computes the row in numpy; ``device``
    says where to put the tensors (default: CPU). Per-slot fields are ``int64``,
    boundaries ``int32``. ``row_width``: the deprecated spelling of ``max_seq_len``
    (accepted, with a ``DeprecationWarning``, until the next release). ``weights``: optional
    ``(L,)`` float per token, laid end to end like ``input_ids`` (each token's, as
    :attr:`sftpack.Sample.weights`); the row's :attr:`~sftpack.PackedBatch.weights` are then
    each slot's target's (:func:`~sftpack.handoff.layout.lay_weights`). ``None``: no weights
    (the row is what it was before weights existed).

    >>> import numpy as np
    >>> b = build_row(np.arange(1, 16), np.ones(15, bool), [5, 10], max_seq_len=36, pad_multiple=4)
    >>> b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist(), b.max_seqlen
    ([0, 5, 15], [0, 8, 36], 28)
    """
    max_seq_len = renamed("build_row", "max_seq_len", max_seq_len, "row_width", row_width)
    row = lay_row(
        input_ids,
        loss_mask,
        lengths,
        max_seq_len=max_seq_len,
        pad_multiple=pad_multiple,
        pad_id=pad_id,
        sequence_ids=sequence_ids,
    )
    batch = PackedBatch.from_row(row, sequence_ids=sequence_ids)
    if weights is not None:
        lens = np.diff(row.cu_seqlens).tolist()
        parts: list[np.ndarray | None] = list(split_weights(weights, lens, "build_row"))
        batch.weights = torch.from_numpy(lay_weights(parts, lens, row.cu_seqlens_padded, row.labels))
    return batch.to(device) if device is not None else batch


def build_parts(
    id_parts: Sequence[np.ndarray],
    mask_parts: Sequence[np.ndarray],
    lengths: Sequence[int],
    *,
    max_seq_len: int | None = None,
    pad_multiple: int = 1,
    pad_id: int = 0,
    sequence_ids: Sequence[Any] | None = None,
    row_width: int | None = None,
) -> PackedBatch:
    """The row :func:`build_row` builds, from each sequence's own arrays (not laid end to end
    first), for a caller that has already checked them: nothing is validated here but the fit
    of the padded sequences (:func:`~sftpack.handoff.layout.fit_parts`). The loader builds its
    rows by its steps; the boundaries are made ``int32`` directly.

    Args:
        id_parts: ``N`` 1-D integer arrays, the token ids of each sequence, all ``>= 0``.
        mask_parts: ``N`` 1-D bool (or 0/1) arrays, the loss mask of each sequence.
        lengths: ``N`` Python ints ``>= 1``, each the length of its parts.
        max_seq_len, pad_multiple, pad_id, sequence_ids: as for :func:`build_row`; the padded
            sequences must fit ``max_seq_len``.
        row_width: the deprecated spelling of ``max_seq_len`` (accepted, with a
            ``DeprecationWarning``, until the next release).

    >>> b = build_parts([np.arange(1, 6), np.arange(6, 16)], [np.ones(5, bool), np.ones(10, bool)], [5, 10],
    ...                 max_seq_len=36, pad_multiple=4)
    >>> b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist(), b.max_seqlen
    ([0, 5, 15], [0, 8, 36], 28)
    """
    max_seq_len = renamed("build_parts", "max_seq_len", max_seq_len, "row_width", row_width)
    padded = fit_parts(lengths, max_seq_len, pad_multiple)
    ids, labels, positions = join_parts(id_parts, mask_parts, lengths, padded, pad_id)
    return wrap_parts(ids, labels, positions, lengths, padded, sequence_ids)


def wrap_parts(
    input_ids: np.ndarray,
    labels: np.ndarray,
    position_ids: np.ndarray,
    lengths: Sequence[int],
    padded: Sequence[int],
    sequence_ids: Sequence[Any] | None = None,
) -> PackedBatch:
    """The :class:`~sftpack.PackedBatch` of a row laid by
    :func:`~sftpack.handoff.layout.join_parts` (``padded`` from
    :func:`~sftpack.handoff.layout.fit_parts`): the arrays as tensors without a copy,
    the boundaries made ``int32`` directly."""
    return PackedBatch(
        torch.from_numpy(input_ids),
        torch.from_numpy(labels),
        torch.from_numpy(position_ids),
        torch.from_numpy(np.array([0, *accumulate(lengths)], dtype=np.int32)),
        torch.from_numpy(np.array([0, *accumulate(padded)], dtype=np.int32)),
        max(padded),
        tuple(sequence_ids) if sequence_ids is not None else None,
    )
