"""Rows with media: the text row is the handoff's, the media follow in row order, MRoPE restarts per sample.

A row with images is :meth:`PackedBatch.from_samples` of samples whose ``media`` is a
:class:`~sftpack.handoff.payload.PatchMedia` (Qwen2-VL); the row's ``media`` lays them end to end.
(Each sample's own positions equal Hugging Face's ``get_rope_index``: tests/multimodal/test_family.py.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sftpack import PackedBatch
from sftpack.handoff import PackedBatchError
from sftpack.handoff.payload import PatchMedia
from sftpack.sample import IGNORE_INDEX

PAD = 151643  # <|endoftext|>, Qwen2-VL's pad


@pytest.mark.parametrize("pad_multiple, extra", [(1, 0), (4, 0), (4, 12)])
def test_a_row_lays_samples_and_their_media_end_to_end(vqa_samples, pad_multiple, extra):
    items = vqa_samples[:4]
    lens = [len(s) for s in items]
    padded = [-(-n // pad_multiple) * pad_multiple for n in lens]
    width = sum(padded) + extra if extra else None
    b = PackedBatch.from_samples(items, pad_multiple=pad_multiple, row_width=width, pad_id=PAD).validate()
    m = b.media
    assert isinstance(m, PatchMedia)
    cu, cup = b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist()
    assert cu == [0, *np.cumsum(lens).tolist()]
    assert m.token_id == 151655
    for i, s in enumerate(items):
        a, e = cup[i], cup[i + 1]
        assert b.input_ids[a : a + lens[i]].tolist() == s.input_ids.tolist()
        assert b.position_ids[a:e].tolist() == list(range(e - a))  # text positions restart
        pos = s.media.positions
        assert m.positions[:, a : a + lens[i]].tolist() == pos.tolist()  # MRoPE: the sample's own
        top = int(pos.max()) + 1
        assert m.positions[:, a + lens[i] : e].tolist() == [list(range(top, top + e - a - lens[i]))] * 3
        assert b.labels[a + lens[i] - 1 : e].tolist() == [IGNORE_INDEX] * (e - a - lens[i] + 1)  # nothing crosses
    # media in row order: samples in order, images in order within each
    np.testing.assert_array_equal(m.pixel_values.numpy(), np.concatenate([s.media.pixel_values for s in items]))
    assert m.grid_thw.tolist() == np.concatenate([s.media.grid_thw for s in items]).tolist()
    hw = [h * w for _, h, w in m.grid_thw.tolist()]
    assert m.vision_cu_seqlens.tolist() == [0, *np.cumsum(hw).tolist()] and m.vision_cu_seqlens.dtype == torch.int32
    assert m.sequence.tolist() == [i for i, s in enumerate(items) for _ in range(s.media.num_items)]
    starts = [cup[i] + r for i, s in enumerate(items) for r, _ in s.media.slots.tolist()]
    assert m.slots[:, 0].tolist() == starts
    hf = b.to_hf_kwargs()
    assert (
        hf["position_ids"].shape == (4, 1, b.num_tokens)
        and hf["position_ids"][0, 0].tolist() == b.position_ids.tolist()
    )
    assert hf["pixel_values"] is m.pixel_values and hf["image_grid_thw"] is m.grid_thw


def test_rows_concatenate_into_one_run(vqa_samples):
    a = PackedBatch.from_samples(vqa_samples[:2], pad_multiple=4, row_width=160, pad_id=PAD)
    b = PackedBatch.from_samples(vqa_samples[2:5], pad_multiple=4, row_width=272, pad_id=PAD)
    ab = PackedBatch.concat([a, b]).validate()
    whole = PackedBatch.from_samples(vqa_samples[:5], pad_multiple=4, pad_id=PAD)
    assert ab.num_tokens == 432 and ab.cu_seqlens.tolist() == whole.cu_seqlens.tolist()
    assert ab.media.positions[:, 160:].tolist() == b.media.positions.tolist()
    assert torch.equal(ab.media.pixel_values, whole.media.pixel_values)
    assert ab.media.vision_cu_seqlens.tolist() == whole.media.vision_cu_seqlens.tolist()
    assert ab.media.slots.tolist() == [*a.media.slots.tolist(), *(b.media.slots + torch.tensor([160, 0])).tolist()]
    assert ab.media.sequence.tolist() == whole.media.sequence.tolist()


def _media(b: PackedBatch, **kw) -> PackedBatch:
    return dataclasses.replace(b, media=dataclasses.replace(b.media, **kw))


def test_validate_names_what_is_wrong(vqa_samples):
    b = PackedBatch.from_samples(vqa_samples[:2], pad_id=PAD)
    m = b.media
    with pytest.raises(PackedBatchError, match="patches"):
        _media(b, pixel_values=m.pixel_values[1:]).validate()
    # The tower's boundaries (vision_cu_seqlens) are the grids' (one segment per frame), so they
    # cannot disagree with them: a grid that disagrees with the patches is what is refused.
    grid = m.grid_thw.clone()
    grid[0, 0] = 2
    with pytest.raises(PackedBatchError, match=r"grid_thw holds"):
        _media(b, grid_thw=grid).validate()
    with pytest.raises(PackedBatchError, match=r"media\.slots\[0\]"):
        _media(b, slots=m.slots + 1).validate()
    with pytest.raises(PackedBatchError, match=r"media\.positions must have shape"):
        _media(b, positions=m.positions[:, 1:]).validate()
    with pytest.raises(PackedBatchError, match="placeholder id"):
        PackedBatch.from_samples(vqa_samples[:2], pad_id=151655)
