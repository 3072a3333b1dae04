"""The handoff's PackedBatch carries LLaVA media too (the design is not Qwen-shaped).

A LLaVA row (one fixed-size pixel tensor per image, 1-D positions, no patch grid) set on a
PackedBatch validates, concatenates like any row, and its ``to_hf_kwargs()`` goes straight
into the Hugging Face LLaVA (sdpa: boundaries from the position restarts): each sample's
logits equal it alone within ``TOL`` (1e-10, derived in tests/multimodal/test_llava.py).
Bad media is refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sftpack.handoff import PackedBatch, PackedBatchError
from sftpack.multimodal import build_llava_row, llava_alone_logits
from tests.multimodal.test_llava import TOL, compact, llava_samples, model, sdpa_model  # noqa: F401


def test_packedbatch_carries_llava_media(compact, sdpa_model):  # noqa: F811
    rows = [
        build_llava_row(compact.samples[:3], pad_multiple=4, pad_id=compact.pad_id),
        build_llava_row(compact.samples[3:], pad_multiple=4, pad_id=compact.pad_id),
    ]
    pbs = [r.packed_batch() for r in rows]
    assert pbs[0].has_media and pbs[0].num_images == rows[0].num_images and pbs[0].mrope_position_ids is None
    run = PackedBatch.concat(pbs).validate()
    one = build_llava_row(compact.samples, pad_multiple=4, pad_id=compact.pad_id).packed_batch()
    for f in ("input_ids", "pixel_values", "image_slots", "image_sequence", "position_ids"):
        assert torch.equal(getattr(run, f), getattr(one, f)), f
    kw = run.to_hf_kwargs()
    assert kw["position_ids"].shape == (1, run.num_tokens) and kw["pixel_values"] is run.pixel_values
    with torch.no_grad():
        lg = sdpa_model(**{k: kw[k] for k in ("input_ids", "position_ids", "pixel_values", "use_cache")}).logits[0]
        cu, cup = run.cu_seqlens.tolist(), run.cu_seqlens_padded.tolist()
        for i, s in enumerate(compact.samples):
            alone = llava_alone_logits(sdpa_model, s)
            assert float((lg[cup[i] : cup[i] + cu[i + 1] - cu[i]] - alone).abs().max()) <= TOL


def test_packedbatch_refuses_bad_llava_media(compact):  # noqa: F811
    one = build_llava_row(compact.samples, pad_multiple=4, pad_id=compact.pad_id).packed_batch()
    bad = dataclasses.replace(one, image_slots=one.image_slots.flip(0), image_sequence=one.image_sequence.flip(0))
    with pytest.raises(PackedBatchError, match="row order"):
        bad.validate()
    with pytest.raises(PackedBatchError, match="one pixel tensor per image"):
        dataclasses.replace(one, pixel_values=one.pixel_values.flatten(1)).validate()
    with pytest.raises(PackedBatchError, match="either all or none"):
        dataclasses.replace(one, spatial_merge_size=2).validate()
