"""The handoff's PackedBatch carries LLaVA media too (the design is not Qwen-shaped).

A LLaVA row (one fixed-size pixel tensor per image, 1-D positions, no patch grid: an
:class:`~sftpack.handoff.payload.ImageMedia`) validates, concatenates like any row, and its
``to_hf_kwargs()`` goes straight into the Hugging Face LLaVA (sdpa: boundaries from the
position restarts): each sample's logits equal it alone within ``TOL`` (1e-10, derived in
tests/multimodal/test_llava.py). Bad media is refused by name.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sftpack.handoff import PackedBatch, PackedBatchError
from sftpack.handoff.payload import ImageMedia, PatchMedia
from sftpack.multimodal import family_for
from sftpack.sample import Sample
from tests.multimodal.test_llava import TOL, compact, llava_samples, model, sdpa_model  # noqa: F401


def test_packedbatch_carries_llava_media(compact, sdpa_model):  # noqa: F811
    rows = [
        PackedBatch.from_samples(compact.samples[:3], pad_multiple=4, pad_id=compact.pad_id),
        PackedBatch.from_samples(compact.samples[3:], pad_multiple=4, pad_id=compact.pad_id),
    ]
    n0 = sum(s.media.num_items for s in compact.samples[:3])
    assert rows[0].has_media and rows[0].num_media_items == n0 and isinstance(rows[0].media, ImageMedia)
    assert rows[0].media.vision_cu_seqlens is None  # the tower sees one image per batch entry
    run = PackedBatch.concat(rows).validate()
    one = PackedBatch.from_samples(compact.samples, pad_multiple=4, pad_id=compact.pad_id)
    for f in ("input_ids", "position_ids"):
        assert torch.equal(getattr(run, f), getattr(one, f)), f
    for f in ("pixel_values", "slots", "sequence"):
        assert torch.equal(getattr(run.media, f), getattr(one.media, f)), f
    kw = run.to_hf_kwargs()
    assert kw["position_ids"].shape == (1, run.num_tokens) and kw["pixel_values"] is run.media.pixel_values
    family = family_for(sdpa_model)
    with torch.no_grad():
        lg = sdpa_model(**{k: kw[k] for k in ("input_ids", "position_ids", "pixel_values", "use_cache")}).logits[0]
        cu, cup = run.cu_seqlens.tolist(), run.cu_seqlens_padded.tolist()
        for i, s in enumerate(compact.samples):
            alone = family.alone_logits(sdpa_model, s)
            assert float((lg[cup[i] : cup[i] + cu[i + 1] - cu[i]] - alone).abs().max()) <= TOL


def _patch_row(token_id: int) -> PackedBatch:
    """A one-sample Qwen2-VL-shaped row (patches, a grid, MRoPE positions) with the same placeholder id."""
    ids = np.array([1, token_id, token_id, 2])
    media = PatchMedia(
        pixel_values=torch.zeros(8, 1176),
        slots=[[1, 2]],
        sequence=[0],
        token_id=token_id,
        grid_thw=[[1, 2, 4]],
        positions=torch.tensor([[0, 1, 1, 3], [0, 1, 1, 3], [0, 1, 2, 3]]),
    )
    return PackedBatch.from_samples([Sample(ids, np.array([0, 0, 0, 1], bool), "q", media=media)])


def test_packedbatch_refuses_bad_llava_media(compact):  # noqa: F811
    one = PackedBatch.from_samples(compact.samples, pad_multiple=4, pad_id=compact.pad_id)
    m = one.media
    bad = dataclasses.replace(one, media=dataclasses.replace(m, slots=m.slots.flip(0), sequence=m.sequence.flip(0)))
    with pytest.raises(PackedBatchError, match="row order"):
        bad.validate()
    with pytest.raises(PackedBatchError, match=r"pixel_values must be \(images, channels, height, width\)"):
        # one pixel tensor (C, H, W) per image
        dataclasses.replace(one, media=dataclasses.replace(m, pixel_values=m.pixel_values.flatten(1))).validate()
    # A LLaVA row carries no patch-tower fields at all (no merge size, grid or positions to half-set) ...
    with pytest.raises(TypeError, match="merge_size"):
        dataclasses.replace(m, merge_size=2)
    # ... and one run never mixes the two kinds of media: one vision tower per row.
    with pytest.raises(PackedBatchError, match="kinds ImageMedia and PatchMedia"):
        PackedBatch.concat([one, _patch_row(m.token_id)])
