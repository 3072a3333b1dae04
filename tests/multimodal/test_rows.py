"""Rows with media: the text row is the handoff's, the media follow in row order, MRoPE restarts per sample."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sftpack.handoff import PackedBatchError
from sftpack.multimodal import MultimodalBatch, build_multimodal_row, rope_index
from sftpack.sample import IGNORE_INDEX


def test_rope_index_is_the_models_get_rope_index(renumbered, model):
    """Our numpy rule equals Qwen2VLModel.get_rope_index on every sample alone (one and two images,
    grids 4x4 to 8x8 patches)."""
    grids = set()
    for s in renumbered.samples:
        ids = torch.from_numpy(s.input_ids)[None]
        ref, _ = model.model.get_rope_index(ids, (ids == s.image_token_id).int(), torch.from_numpy(s.image_grid_thw))
        np.testing.assert_array_equal(rope_index(s), ref[:, 0].numpy())
        grids.update(map(tuple, s.image_grid_thw.tolist()))
    assert len(grids) >= 3  # the seeded sizes give runs of different lengths


@pytest.mark.parametrize("pad_multiple, extra", [(1, 0), (4, 0), (4, 12)])
def test_a_row_lays_samples_and_their_media_end_to_end(vqa_samples, pad_multiple, extra):
    items = vqa_samples[:4]
    lens = [len(s) for s in items]
    padded = [-(-n // pad_multiple) * pad_multiple for n in lens]
    width = sum(padded) + extra if extra else None
    b = build_multimodal_row(items, pad_multiple=pad_multiple, row_width=width).validate()
    t = b
    cu, cup = t.cu_seqlens.tolist(), t.cu_seqlens_padded.tolist()
    assert cu == [0, *np.cumsum(lens).tolist()]
    assert b.image_token_id == 151655
    for i, s in enumerate(items):
        a, e = cup[i], cup[i + 1]
        assert t.input_ids[a : a + lens[i]].tolist() == s.input_ids.tolist()
        assert t.position_ids[a:e].tolist() == list(range(e - a))  # text positions restart
        pos = rope_index(s)
        assert b.mrope_position_ids[:, a : a + lens[i]].tolist() == pos.tolist()  # MRoPE: the sample's own
        assert (
            b.mrope_position_ids[:, a + lens[i] : e].tolist()
            == [list(range(pos.max() + 1, pos.max() + 1 + e - a - lens[i]))] * 3
        )
        assert t.labels[a + lens[i] - 1 : e].tolist() == [IGNORE_INDEX] * (e - a - lens[i] + 1)  # nothing crosses
    # media in row order: samples in order, images in order within each
    np.testing.assert_array_equal(b.pixel_values.numpy(), np.concatenate([s.pixel_values for s in items]))
    assert b.image_grid_thw.tolist() == np.concatenate([s.image_grid_thw for s in items]).tolist()
    hw = [h * w for _, h, w in b.image_grid_thw.tolist()]
    assert b.vision_cu_seqlens.tolist() == [0, *np.cumsum(hw).tolist()] and b.vision_cu_seqlens.dtype == torch.int32
    assert b.image_sequence.tolist() == [i for i, s in enumerate(items) for _ in range(s.num_images)]
    starts = [cup[i] + r for i, s in enumerate(items) for r, _ in s.image_runs.tolist()]
    assert b.image_slots[:, 0].tolist() == starts
    hf = b.to_hf_kwargs()
    assert (
        hf["position_ids"].shape == (4, 1, t.num_tokens)
        and hf["position_ids"][0, 0].tolist() == t.position_ids.tolist()
    )
    assert hf["pixel_values"] is b.pixel_values and hf["image_grid_thw"] is b.image_grid_thw


def test_rows_concatenate_into_one_run(vqa_samples):
    a = build_multimodal_row(vqa_samples[:2], pad_multiple=4, row_width=160)
    b = build_multimodal_row(vqa_samples[2:5], pad_multiple=4, row_width=272)
    ab = MultimodalBatch.concat([a, b]).validate()
    whole = build_multimodal_row(vqa_samples[:5], pad_multiple=4)
    assert ab.num_tokens == 432 and ab.cu_seqlens.tolist() == whole.cu_seqlens.tolist()
    assert ab.mrope_position_ids[:, 160:].tolist() == b.mrope_position_ids.tolist()
    assert (
        torch.equal(ab.pixel_values, whole.pixel_values)
        and ab.vision_cu_seqlens.tolist() == whole.vision_cu_seqlens.tolist()
    )
    assert ab.image_slots.tolist() == [*a.image_slots.tolist(), *(b.image_slots + torch.tensor([160, 0])).tolist()]
    assert ab.image_sequence.tolist() == whole.image_sequence.tolist()


def test_validate_names_what_is_wrong(vqa_samples):
    b = build_multimodal_row(vqa_samples[:2])
    with pytest.raises(PackedBatchError, match="patches"):
        dataclasses.replace(b, pixel_values=b.pixel_values[1:]).validate()
    with pytest.raises(PackedBatchError, match="vision_cu_seqlens"):
        dataclasses.replace(b, vision_cu_seqlens=b.vision_cu_seqlens + 1).validate()
    with pytest.raises(PackedBatchError, match=r"image_slots\[0\]"):
        dataclasses.replace(b, image_slots=b.image_slots + 1).validate()
    with pytest.raises(PackedBatchError, match="mrope_position_ids"):
        dataclasses.replace(b, mrope_position_ids=b.mrope_position_ids[:, 1:]).validate()
    with pytest.raises(PackedBatchError, match="image placeholder id"):
        build_multimodal_row(vqa_samples[:2], pad_id=151655)
