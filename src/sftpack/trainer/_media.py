"""The trainer path with images: a padded multimodal batch packed into one row at the step.

A collator for a Qwen2-VL-style model hands the step a right-padded batch and its media::

    input_ids, labels, attention_mask   (B, S)   labels unshifted, -100 = not trained (Hugging Face)
    mrope_position_ids                   (3, B, S) each sample's own MRoPE positions (rope_index), from 0
    pixel_values                         (P, D)   every image's patches, in batch order
    image_grid_thw                       (I, 3)   each image's (t, h, w) patch grid, in batch order

:func:`pack_media_step` packs the text exactly as :func:`~sftpack.trainer.pack_step`
does and adds the row's media fields (see :class:`~sftpack.PackedBatch`): the MRoPE
positions gathered with the tokens (a segment's padding continuing from its largest
position), the patches and grids unchanged (the rows keep their batch order, so the
images keep theirs), the vision tower's per-frame boundaries, and each image's
placeholder run: image ``i`` owns the ``i``-th run of ``t*h*w / merge**2``
placeholders in row-major order, which is how the model itself assigns image
features to placeholders. The result is field for field what
:func:`sftpack.multimodal.build_multimodal_row` builds from the same samples
(tested), on the batch's device, in vectorised tensor operations.

:func:`collate_media` is the collator: samples (``sftpack.multimodal.MultimodalSample``)
to that padded batch. This module imports only the handoff (and, lazily, the
multimodal sample's rope rule and row class).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..handoff import PackedBatch, PackedBatchError
from ..sample import IGNORE_INDEX
from ._step import pack_step

if TYPE_CHECKING:  # pragma: no cover
    from ..multimodal._row import MultimodalBatch
    from ..multimodal._sample import MultimodalSample

__all__ = ["PaddedMediaBatch", "collate_media", "pack_media_step"]


@dataclass(eq=False)
class PaddedMediaBatch:
    """A right-padded multimodal batch, what :func:`collate_media` returns.

    Attributes:
        input_ids, labels, attention_mask: ``(B, S)``; labels unshifted (Hugging Face:
            ``labels[b, t]`` is ``input_ids[b, t]`` where token ``t`` is trained, else -100).
        mrope_position_ids: ``(3, B, S)`` int64, each row's own MRoPE positions; padding
            continues from the row's largest position.
        pixel_values: ``(P, D)``; image_grid_thw: ``(I, 3)`` int64; both in batch order.
        image_token_id, spatial_merge_size: the placeholder id and the merge window side.
        sequence_ids: one id per row.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    mrope_position_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_token_id: int
    spatial_merge_size: int
    sequence_ids: tuple

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def to(self, device: torch.device | str) -> PaddedMediaBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return PaddedMediaBatch(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **moved})

    def pack(self, **kwargs: Any) -> MultimodalBatch:
        """:func:`pack_media_step` of this batch (``kwargs``: its packing options)."""
        return pack_media_step(
            self.input_ids,
            self.attention_mask,
            self.labels,
            self.mrope_position_ids,
            self.pixel_values,
            self.image_grid_thw,
            image_token_id=self.image_token_id,
            spatial_merge_size=self.spatial_merge_size,
            sequence_ids=self.sequence_ids,
            **kwargs,
        )


def collate_media(
    samples: Sequence[MultimodalSample], *, pad_id: int = 151643, seq_len: int | None = None
) -> PaddedMediaBatch:
    """Right-pad multimodal samples into one batch (row ``i`` holds sample ``i``), with each
    sample's own MRoPE positions (:func:`sftpack.multimodal.rope_index`) and the images in
    batch order. ``S`` defaults to the longest sample.

    Raises:
        ValueError: no samples, a sample longer than ``seq_len``, samples with different
            image token ids or merge sizes, or ``pad_id`` equal to the image token id.
    """
    from ..multimodal._sample import rope_index  # lazily: the trainer path needs only the rope rule

    items = list(samples)
    if not items:
        raise ValueError("collate_media needs at least one sample, got none")
    img = {int(s.image_token_id) for s in items}
    merge = {int(s.merge_size) for s in items}
    if len(img) != 1 or len(merge) != 1:
        raise ValueError(f"collate_media: samples use different image token ids {img} or merge sizes {merge}")
    image_token_id = img.pop()
    if pad_id == image_token_id:
        raise ValueError(f"collate_media: pad_id {pad_id} is the image placeholder id; pad with another token")
    lengths = [len(s) for s in items]
    S = max(lengths) if seq_len is None else int(seq_len)
    if max(lengths) > S:
        i = int(np.argmax(lengths))
        raise ValueError(f"collate_media: sample {i} has {lengths[i]} tokens, more than seq_len={S}")
    B = len(items)
    ids = np.full((B, S), pad_id, dtype=np.int64)
    labels = np.full((B, S), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((B, S), dtype=np.int64)
    mrope = np.empty((3, B, S), dtype=np.int64)
    for b, s in enumerate(items):
        L = len(s)
        ids[b, :L] = s.input_ids
        labels[b, :L] = np.where(s.loss_mask, s.input_ids, IGNORE_INDEX)
        mask[b, :L] = 1
        pos = rope_index(s)
        mrope[:, b, :L] = pos
        mrope[:, b, L:] = int(pos.max()) + 1 + np.arange(S - L)
    pv = np.concatenate([s.pixel_values for s in items])
    grid = np.concatenate([s.image_grid_thw for s in items]).astype(np.int64).reshape(-1, 3)
    return PaddedMediaBatch(
        input_ids=torch.from_numpy(ids),
        labels=torch.from_numpy(labels),
        attention_mask=torch.from_numpy(mask),
        mrope_position_ids=torch.from_numpy(mrope),
        pixel_values=torch.from_numpy(np.ascontiguousarray(pv)),
        image_grid_thw=torch.from_numpy(grid),
        image_token_id=image_token_id,
        spatial_merge_size=merge.pop(),
        sequence_ids=tuple(s.conversation_id for s in items),
    )


def pack_media_step(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    mrope_position_ids: torch.Tensor,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
    pad_multiple: int = 1,
    pad_to_multiple_of: int | None = None,
    pad_to: int | None = None,
    pad_id: int = 151643,
    sequence_ids: Sequence[Any] | None = None,
) -> MultimodalBatch:
    """Pack a right-padded multimodal batch into one row with its media (a ``MultimodalBatch``).

    Args:
        input_ids, attention_mask, labels: ``(B, S)`` as for :func:`~sftpack.trainer.pack_step`
            (labels unshifted, Hugging Face's convention; the mask right-padded).
        mrope_position_ids: ``(3, B, S)`` each row's own MRoPE positions (starting at 0).
        pixel_values: ``(P, D)`` the images' patches in batch order; image_grid_thw: ``(I, 3)``.
        image_token_id: the placeholder id; spatial_merge_size: the merge window side.
        pad_multiple, pad_to_multiple_of, pad_to, pad_id, sequence_ids: as for ``pack_step``.

    Raises:
        PackedBatchError: shapes that do not match, placeholders that do not match the
            grids (count, or a run that is not contiguous), ``pad_id`` equal to the
            image token id; the message names the numbers.
    """
    from ..multimodal._row import MultimodalBatch  # lazily: the row class only

    if pad_id == image_token_id:
        raise PackedBatchError(f"pack_media_step: pad_id {pad_id} is the image placeholder id; pad with another token")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise PackedBatchError("pack_media_step: input_ids must be a (B, S) tensor")
    B, S = (int(x) for x in input_ids.shape)
    dev = input_ids.device
    if tuple(mrope_position_ids.shape) != (3, B, S):
        raise PackedBatchError(
            f"pack_media_step: mrope_position_ids has shape {tuple(mrope_position_ids.shape)}, expected (3, {B}, {S})"
        )
    grid = image_grid_thw.reshape(-1, 3).to(device=dev, dtype=torch.int64)
    for name, t in (("mrope_position_ids", mrope_position_ids), ("pixel_values", pixel_values)):
        if t.device != dev:
            raise PackedBatchError(f"pack_media_step: {name} is on {t.device} but input_ids is on {dev}; move it first")
    text = pack_step(
        input_ids,
        attention_mask=attention_mask,
        labels=labels,
        pad_multiple=pad_multiple,
        pad_to_multiple_of=pad_to_multiple_of,
        pad_to=pad_to,
        pad_id=pad_id,
        sequence_ids=sequence_ids,
    )
    T, n = text.num_tokens, text.num_sequences
    assert text.source_rows is not None
    rows = torch.tensor(text.source_rows, dtype=torch.int64, device=dev)
    cup = text.cu_seqlens_padded.to(torch.int64)
    lens = text.seqlens.to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(n, device=dev), cup[1:] - cup[:-1], output_size=T)
    pos = text.position_ids
    seg_len = lens.index_select(0, seg)
    real = pos < seg_len
    src = (pos + (rows * S).index_select(0, seg)).clamp_(max=B * S - 1)
    gathered = mrope_position_ids.reshape(3, B * S).to(torch.int64).index_select(1, src)
    # each segment's largest real position: its padding continues from there (as build_multimodal_row)
    top = torch.full((n,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=dev)
    top = top.scatter_reduce(0, seg[real], gathered[:, real].amax(0), reduce="amax")
    mrope = torch.where(real, gathered, top.index_select(0, seg) + 1 + pos - seg_len)

    per = grid.prod(-1)
    merge2 = int(spatial_merge_size) ** 2
    runs = per // merge2
    placeholders = torch.nonzero(real & (text.input_ids == int(image_token_id))).reshape(-1)
    stats = torch.stack([placeholders.new_tensor(placeholders.numel()), runs.sum(), per.sum()]).tolist()
    if stats[0] != stats[1]:
        raise PackedBatchError(
            f"pack_media_step: the batch holds {stats[0]} image placeholders (id {image_token_id}) but the "
            f"{grid.shape[0]} grids give {stats[1]} (t*h*w/{merge2} each): give every image's grid, in batch order"
        )
    if stats[2] != int(pixel_values.shape[0]):
        raise PackedBatchError(
            f"pack_media_step: pixel_values has {int(pixel_values.shape[0])} patches but the grids hold {stats[2]}"
        )
    first = torch.zeros_like(runs)
    torch.cumsum(runs[:-1], 0, out=first[1:])
    starts = placeholders.index_select(0, first)
    ends = placeholders.index_select(0, first + runs - 1)
    if grid.shape[0] and bool(((ends - starts) != runs - 1).any()):
        i = int(torch.nonzero((ends - starts) != runs - 1)[0, 0])
        raise PackedBatchError(
            f"pack_media_step: image {i} (grid {grid[i].tolist()}) should own {int(runs[i])} consecutive "
            "placeholders but they are not one run: the grids are not in the order of the images in the batch"
        )
    vcu = torch.zeros(int(grid[:, 0].sum()) + 1 if grid.shape[0] else 1, dtype=torch.int64, device=dev)
    if grid.shape[0]:
        torch.cumsum(torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]), 0, out=vcu[1:])
    return MultimodalBatch(
        **{f.name: getattr(text, f.name) for f in fields(PackedBatch) if getattr(text, f.name) is not None},
        mrope_position_ids=mrope,
        pixel_values=pixel_values,
        image_grid_thw=grid,
        vision_cu_seqlens=vcu.to(torch.int32),
        image_slots=torch.stack([starts, runs], dim=1).reshape(-1, 2),
        image_sequence=seg.index_select(0, starts),
        image_token_id=int(image_token_id),
        spatial_merge_size=int(spatial_merge_size),
    )
