"""The loader's row builder: one decided row of buffer items laid as a :class:`~sftpack.PackedBatch`.

Every item's arrays are a sample's (int64 ids, a bool mask; ``cut_overlong``) and the row
was planned on ``padded_lengths``, so the row is laid from the items' own arrays without
concatenating them first (``build_parts``' steps: ``fit_parts``, ``join_parts``,
``wrap_parts``), and the ids are checked once, on the laid row before it becomes tensors
(padding is ``>= 0``). A row holding media gets their payload laid in row order, as
:meth:`PackedBatch.from_samples <sftpack.PackedBatch.from_samples>` lays them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..handoff import PackedBatch
from ..handoff.build import wrap_parts
from ..handoff.errors import PackedBatchError
from ..handoff.layout import fit_parts, join_parts, lay_weights
from ._source import Item, first_negative

__all__ = ["lay_items"]


def lay_items(row: Sequence[Item], *, max_seq_len: int, pad_multiple: int, pad_id: int) -> PackedBatch:
    """The ``max_seq_len``-wide row of ``row``'s items, each padded to ``pad_multiple`` with ``pad_id``.

    Raises:
        ValueError: an item holds a negative token id (naming its sample and position).
        PackedBatchError: ``pad_id`` is the media placeholder id of the row's media.
    """
    lengths = [it.length for it in row]
    padded = fit_parts(lengths, max_seq_len, pad_multiple)
    ids, labels, positions = join_parts(
        [it.input_ids for it in row], [it.loss_mask for it in row], lengths, padded, pad_id
    )
    if np.minimum.reduce(ids) < 0:
        raise first_negative(list(row))
    batch = wrap_parts(ids, labels, positions, lengths, padded, [it.sequence_id for it in row])
    weights = [it.weights for it in row]
    if any(w is not None for w in weights):  # label-aligned, as build_row lays them (none: the row as it was)
        starts = np.concatenate(([0], np.cumsum(padded)[:-1])).tolist()
        batch.weights = torch.from_numpy(lay_weights(weights, lengths, starts, labels))
    parts = [it.media for it in row]
    first = next((m for m in parts if m is not None), None)
    if first is not None:  # the media in row order, as PackedBatch.from_samples lays them
        if pad_id == first.token_id:
            raise PackedBatchError(
                f"PackingDataset: pad_id {pad_id} is the media placeholder id; pad with another token"
            )
        cup = batch.cu_seqlens_padded.tolist()
        batch.media = type(first).lay(parts, lengths=lengths, offsets=cup[:-1], widths=padded, segments=[1] * len(row))
    return batch
