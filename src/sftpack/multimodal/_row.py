"""Rows with media: several :class:`MultimodalSample` in one flat row, with their images.

The text side is an ordinary :class:`~sftpack.PackedBatch` built by
:func:`sftpack.handoff.build_row` (the one row builder): input ids, shifted labels,
text positions restarting per sample, ``cu_seqlens`` / ``cu_seqlens_padded``. Beside
it, in row order (samples in input order, images in order within each sample):

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..handoff import PackedBatch, PackedBatchError, build_row
from ._sample import MultimodalSample, rope_index

__all__ = ["MultimodalBatch", "build_multimodal_row"]


@dataclass(eq=False)
class MultimodalBatch:
    """One packed row (or rows laid end to end) with its media. See the module docstring."""

    text: PackedBatch
    mrope_position_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    vision_cu_seqlens: torch.Tensor
    image_slots: torch.Tensor
    image_sequence: torch.Tensor
    image_token_id: int

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def validate(self) -> MultimodalBatch:
        """Check the media against the text row; raises :class:`PackedBatchError` naming the field."""
        t = self.text.validate()
        T = t.num_tokens
        if tuple(self.mrope_position_ids.shape) != (3, T):
            raise PackedBatchError(
                f"mrope_position_ids has shape {tuple(self.mrope_position_ids.shape)}, want (3, {T})"
            )
        per = (self.image_grid_thw[:, 0] * self.image_grid_thw[:, 1] * self.image_grid_thw[:, 2]).to(torch.int64)
        if int(per.sum()) != self.pixel_values.shape[0]:
            raise PackedBatchError(
                f"pixel_values has {self.pixel_values.shape[0]} patches but image_grid_thw holds {int(per.sum())}"
            )
        frames = torch.repeat_interleave(
            self.image_grid_thw[:, 1] * self.image_grid_thw[:, 2], self.image_grid_thw[:, 0]
        )
        want = [0, *torch.cumsum(frames, 0).tolist()]
        if self.vision_cu_seqlens.tolist() != want:
            raise PackedBatchError(
                f"vision_cu_seqlens {self.vision_cu_seqlens.tolist()} != per-frame cumsum(h*w) {want}"
            )
        is_img = t.input_ids == self.image_token_id
        marked = torch.zeros_like(is_img)
        cup, cu = t.cu_seqlens_padded.tolist(), t.cu_seqlens.tolist()
        for i, ((s, L), seg) in enumerate(zip(self.image_slots.tolist(), self.image_sequence.tolist())):
            end = cup[seg] + cu[seg + 1] - cu[seg]
            if not (cup[seg] <= s and s + L <= end) or not bool(is_img[s : s + L].all()):
                raise PackedBatchError(f"image {i}: slots [{s}, {s + L}) are not placeholders inside segment {seg}")
            marked[s : s + L] = True
        if not torch.equal(marked, is_img):
            raise PackedBatchError("image placeholder tokens outside the image_slots")
        return self

    @classmethod
    def concat(cls, batches: Sequence[MultimodalBatch]) -> MultimodalBatch:
        """Rows laid end to end in one flat run (:meth:`PackedBatch.concat` for the text;
        media appended in order, image slots and segments shifted by the rows before)."""
        items = list(batches)
        if not items:
            raise PackedBatchError("MultimodalBatch.concat needs at least one batch, got none")
        if len({b.image_token_id for b in items}) != 1:
            raise PackedBatchError("MultimodalBatch.concat: the rows use different image token ids")
        slots, seqs, cus = [], [], [items[0].vision_cu_seqlens]
        t_off = n_off = 0
        for b in items:
            slots.append(b.image_slots + torch.tensor([t_off, 0]))
            seqs.append(b.image_sequence + n_off)
            t_off += b.text.num_tokens
            n_off += b.text.num_sequences
        for b in items[1:]:
            cus.append(b.vision_cu_seqlens[1:] + cus[-1][-1])
        return cls(
            text=PackedBatch.concat([b.text for b in items]),
            mrope_position_ids=torch.cat([b.mrope_position_ids for b in items], dim=1),
            pixel_values=torch.cat([b.pixel_values for b in items]),
            image_grid_thw=torch.cat([b.image_grid_thw for b in items]),
            vision_cu_seqlens=torch.cat(cus),
            image_slots=torch.cat(slots),
            image_sequence=torch.cat(seqs),
            image_token_id=items[0].image_token_id,
        )

    def to_hf_kwargs(self, *, pad_between_seqs: bool = True) -> dict[str, Any]:
        """Keyword arguments for ``Qwen2VLForConditionalGeneration`` on this row (without media:
        see :func:`sftpack.multimodal.packed_logits`, which runs the vision tower on
        ``vision_cu_seqlens`` and passes its output in).

        ``position_ids`` is ``(4, 1, T)``: the text positions (restarting per sample) on top
        of the three MRoPE rows, Qwen2-VL's packed form. ``cu_seq_lens_q/k`` are the padded
        boundaries; with ``pad_between_seqs`` the real ones ride along as
        ``sftpack_cu_seqlens_real`` (read by sftpack's training attention).
        """
        kw = self.text.to_hf_kwargs()
        kw.pop("labels")
        kw["position_ids"] = torch.cat([self.text.position_ids[None], self.mrope_position_ids]).unsqueeze(1)
        if pad_between_seqs:
            kw["sftpack_cu_seqlens_real"] = self.text.cu_seqlens
        return kw


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
    (``pad_id`` defaults to ``<|endoftext|>``). The samples must share the image token id.
    """
    items = list(samples)
    if not items:
        raise PackedBatchError("build_multimodal_row needs at least one sample, got none")
    img_ids = {s.image_token_id for s in items}
    if len(img_ids) != 1:
        raise PackedBatchError(f"samples use different image token ids {sorted(img_ids)}")
    image_token_id = img_ids.pop()
    if pad_id == image_token_id:
        raise PackedBatchError(f"pad_id {pad_id} is the image placeholder id; pad with another token")
    ids = [s.conversation_id for s in items]
    text = build_row(
        np.concatenate([s.input_ids for s in items]),
        np.concatenate([s.loss_mask for s in items]),
        np.fromiter((len(s) for s in items), dtype=np.int64, count=len(items)),
        row_width=row_width,
        pad_multiple=pad_multiple,
        pad_id=pad_id,
        sequence_ids=ids,
    )
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
    pv = np.concatenate([s.pixel_values for s in items])
    batch = MultimodalBatch(
        text=text,
        mrope_position_ids=torch.from_numpy(mrope),
        pixel_values=torch.from_numpy(np.ascontiguousarray(pv)),
        image_grid_thw=torch.from_numpy(grids),
        vision_cu_seqlens=torch.from_numpy(vcu.astype(np.int32)),
        image_slots=torch.tensor(slots, dtype=torch.int64).reshape(-1, 2),
        image_sequence=torch.tensor(seq, dtype=torch.int64),
        image_token_id=int(image_token_id),
    )
    if device is not None:
        batch = _to(batch, device)
    return batch


def _to(b: MultimodalBatch, device: torch.device | str) -> MultimodalBatch:
    return MultimodalBatch(
        text=b.text.to(device),
        mrope_position_ids=b.mrope_position_ids.to(device),
        pixel_values=b.pixel_values.to(device),
        image_grid_thw=b.image_grid_thw.to(device),
        vision_cu_seqlens=b.vision_cu_seqlens.to(device),
        image_slots=b.image_slots,
        image_sequence=b.image_sequence,
        image_token_id=b.image_token_id,
    )
