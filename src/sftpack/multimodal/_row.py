"""Rows with media: several :class:`MultimodalSample` in one flat row, with their images.

The row is a :class:`~sftpack.PackedBatch` (a ``MultimodalBatch``, its subclass with
no fields of its own) whose text fields come from :meth:`sftpack.PackedBatch.from_samples`
(the one row builder): input ids, shifted labels, text positions restarting per
sample, ``cu_seqlens`` / ``cu_seqlens_padded``. Its media fields hold, in row order
(samples in input order, images in order within each sample):

- ``mrope_position_ids`` ``(3, T)``: each sample's own Qwen2-VL MRoPE positions
  (:func:`rope_index` of the sample alone) at its segment; a segment's padding slots
  continue from the sample's largest position (real tokens never attend to them).
- ``pixel_values`` ``(P, D)``: every image's patches concatenated.
- ``image_grid_thw`` ``(I, 3)``; ``vision_cu_seqlens`` ``(F+1,)`` int32: the vision
  tower's per-image boundaries (one per frame, as Qwen2-VL: ``cumsum`` of ``h * w``
  repeated ``t`` times; images have ``t = 1``).
- ``image_slots`` ``(I, 2)``: each image's placeholder run (start slot, length) in the
  row; ``image_sequence`` ``(I,)``: the segment each image belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import cast

import numpy as np
import torch

from ..handoff import PackedBatch, PackedBatchError
from ._sample import MultimodalSample, rope_index

__all__ = ["MultimodalBatch", "build_multimodal_row"]


class MultimodalBatch(PackedBatch):
    """A :class:`~sftpack.PackedBatch` built with media (what :func:`build_multimodal_row`
    returns): no fields of its own, the media fields are the handoff's. Any
    ``PackedBatch`` with media fields is used the same way (``PackedBatch.concat`` of
    these rows gives one)."""


def build_multimodal_row(
    samples: Sequence[MultimodalSample],
    *,
    row_width: int | None = None,
    pad_multiple: int = 1,
    pad_id: int = 151643,
    device: torch.device | str | None = None,
) -> MultimodalBatch:
    """Lay ``samples`` end to end in one row with their media (input order kept).

    ``row_width``, ``pad_multiple`` and ``pad_id`` as for :func:`sftpack.handoff.build_row`
    (``pad_id`` defaults to ``<|endoftext|>``). The samples must share the image token id
    and the merge size. A row without images still carries (empty) media fields.
    """
    items = list(samples)
    if not items:
        raise PackedBatchError("build_multimodal_row needs at least one sample, got none")
    img_ids = {s.image_token_id for s in items}
    if len(img_ids) != 1:
        raise PackedBatchError(f"samples use different image token ids {sorted(img_ids)}")
    merges = {s.merge_size for s in items}
    if len(merges) != 1:
        raise PackedBatchError(f"samples use different merge sizes {sorted(merges)}")
    widths = {s.pixel_values.shape[1] for s in items if s.num_patches}
    if len(widths) > 1:
        raise PackedBatchError(
            f"samples have patch widths {sorted(widths)}: one row feeds one vision tower, whose patches have "
            "one width (3 x temporal patch x patch side**2); tokenize them with one image processor"
        )
    image_token_id = img_ids.pop()
    if pad_id == image_token_id:
        raise PackedBatchError(f"pad_id {pad_id} is the image placeholder id; pad with another token")
    text = PackedBatch.from_samples(items, row_width=row_width, pad_multiple=pad_multiple, pad_id=pad_id)
    T = text.num_tokens
    cup = text.cu_seqlens_padded.tolist()
    mrope = np.empty((3, T), dtype=np.int64)
    slots, seq = [], []
    for i, s in enumerate(items):
        a, b, L = cup[i], cup[i + 1], len(s)
        pos = rope_index(s)
        mrope[:, a : a + L] = pos
        mrope[:, a + L : b] = int(pos.max()) + 1 + np.arange(b - a - L)
        for start, n in s.image_runs.tolist():
            slots.append((a + start, n))
            seq.append(i)
    grids = np.concatenate([s.image_grid_thw for s in items])
    per = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])  # one attention segment per frame, as Qwen2-VL
    vcu = np.zeros(len(per) + 1, dtype=np.int64)
    np.cumsum(per, out=vcu[1:])
    pv = np.concatenate([s.pixel_values for s in items if s.num_patches] or [items[0].pixel_values])
    batch = MultimodalBatch(
        **{f.name: getattr(text, f.name) for f in fields(PackedBatch) if getattr(text, f.name) is not None},
        mrope_position_ids=torch.from_numpy(mrope),
        pixel_values=torch.from_numpy(np.ascontiguousarray(pv)),
        image_grid_thw=torch.from_numpy(grids),
        vision_cu_seqlens=torch.from_numpy(vcu.astype(np.int32)),
        image_slots=torch.tensor(slots, dtype=torch.int64).reshape(-1, 2),
        image_sequence=torch.tensor(seq, dtype=torch.int64),
        image_token_id=int(image_token_id),
        spatial_merge_size=int(merges.pop()),
    )
    return cast(MultimodalBatch, batch.to(device)) if device is not None else batch
