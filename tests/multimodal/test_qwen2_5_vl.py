"""Qwen2.5-VL: a packed row equals each sample run alone on Hugging Face's own
``Qwen2_5_VLForConditionalGeneration`` (built from a config, tiny), in float64.

Qwen2.5-VL is Qwen2-VL's family for images (the same tokens, patches, ``PatchMedia`` and
MRoPE positions) with another vision tower: its blocks attend within 112-px windows
(8 x 8 patches, computed from each image's grid, so no window crosses an image) and its
last block within each image (the row's ``vision_cu_seqlens``). The samples here are six
easy-vqa conversations (56 to 112 px, one window each) and three of random noise with
images of several windows (252 x 140 px: 2 x 3 windows; 224 x 196 px: 2 x 2), some
conversations with two images; they are laid in several rows and run as one flat run.

Packed: the vision tower over the run's images (per-image boundaries, windows per image),
the language model over sftpack's varlen training attention with the run's per-sample
MRoPE positions, both boundary modes. Alone: each sample through Hugging Face's own path
(``get_rope_index``, its own vision tower). Compared: logits of every real token, the
token-mean loss (one shared count of targets) and the gradient of every parameter of the
language model and of the vision tower.

Tolerance, fixed: 1e-10 in float64, the derivation of tests/multimodal/test_exactness.py
(u = 2**-53 = 1.1e-16; an n-term sum in any order is off by at most n*u of its terms'
magnitude sum, Higham, Accuracy and Stability, section 3.1). The longest chain of roundings
in one forward and backward pass here is n <= 4,000: the patch embedding's 1,176-term dot
products, width 32 over 2 vision and 2 text layers, windows of <= 64 patches and images of
<= 224 patches (the tower's attention sums; its weight gradients sum over <= 1,000 patches
a row, asserted), segments <= 160 tokens (asserted), <= 128 vocabulary ids. So each run is off by
<= 4.4e-13 relative, the two by <= 8.9e-13, on logits and gradients of magnitude <= 10
(asserted): <= 8.9e-12; 1e-10 is 11x that (observed: below 1e-15). The rotary angles are float32 from the
integer positions: identical positions give identical angles in both runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sftpack import PackedBatch
from sftpack.handoff.payload import PatchMedia
from sftpack.multimodal import check_packed, family_for, tokenize_media_conversations, vqa_corpus
from tests.multimodal.conftest import Renumbered, assert_exact_with_tower, noise_conversations, positions_1d

TOL = 1e-10  # float64; see the docstring
# What a wrong position moves something by, at least: 1-D positions 1e6 x TOL; transposed ones
# (only the rotary dimensions the MRoPE sections give to height and width, 2 of 8 here) 1e4 x TOL
# (observed: 2.5e-5), both far above any rounding.
BUG = {"positions-1d": 1e-4, "positions-transposed": 1e-6}
WINDOW = 8  # patches a side of a 112-px window (14-px patches)


@pytest.fixture(scope="module")
def qwen25():
    fam = family_for("qwen2_5_vl")
    convs = [
        *noise_conversations({"wide": (252, 140), "two": (224, 196, 84, 56), "tall": (140, 252)}),
        *vqa_corpus(seed=2, limit=6, min_side=56, max_side=112),
    ]
    samples = list(tokenize_media_conversations(convs, family=fam))
    return Renumbered(samples, family="qwen2_5_vl")


@pytest.fixture(scope="module")
def model(qwen25):
    m = qwen25.model()
    assert type(m).__name__ == "Qwen2_5_VLForConditionalGeneration" and m.dtype == torch.float64
    assert m.config.vision_config.window_size == 112 and family_for(m).name == "qwen2_5_vl"
    return m


def _windows(grid) -> int:
    """The 112-px windows of an image of patch grid (t, h, w)."""
    _, h, w = grid
    return -(-h // WINDOW) * -(-w // WINDOW)


def test_the_samples_cover_several_windows_and_sizes(qwen25):
    items = qwen25.samples
    grids = [tuple(g) for s in items for g in s.media.grid_thw.tolist()]
    assert all(isinstance(s.media, PatchMedia) for s in items)
    assert (1, 10, 18) in grids and (1, 14, 16) in grids and (1, 18, 10) in grids  # 252x140, 224x196, 140x252
    assert sorted({_windows(g) for g in grids}) == [1, 4, 6]
    assert len(set(grids)) >= 6 and sum(s.media.num_items for s in items) >= 10


def _rows(items):
    return [items[:3], items[3:6], items[6:]]


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_packed_equals_alone(qwen25, model, pad_between_seqs, pad_multiple):
    items = qwen25.samples
    width = max(sum(-(-len(s) // pad_multiple) * pad_multiple for s in r) for r in _rows(items)) + 4 * pad_multiple
    rows = [PackedBatch.from_samples(r, pad_multiple=pad_multiple, row_width=width, pad_id=qwen25.pad_id)
            for r in _rows(items)]  # fmt: skip
    assert max(r.media.num_patches for r in rows) <= 1000 and max(len(s) for s in items) <= 160  # premises
    assert_exact_with_tower(
        model,
        items,
        TOL,
        pad_between_seqs=pad_between_seqs,
        pad_multiple=pad_multiple,
        row_width=width,
        pad_id=qwen25.pad_id,
    )


def _positions_transposed(b: PackedBatch) -> PackedBatch:
    """The bug: the height and width rows of the positions swapped (images read transposed)."""
    pos = b.media.positions[[0, 2, 1]].clone()
    return dataclasses.replace(b, media=dataclasses.replace(b.media, positions=pos))


@pytest.mark.parametrize(
    "name, tamper", [("positions-1d", positions_1d), ("positions-transposed", _positions_transposed)]
)
def test_tampered_positions_fail(qwen25, model, name, tamper):
    r = check_packed(model, qwen25.samples, pad_id=qwen25.pad_id, rows=3, tamper=tamper)
    assert not r.within(TOL) and max(r.logits, r.loss, r.grads["language"], r.grads["vision"]) > BUG[name], r
