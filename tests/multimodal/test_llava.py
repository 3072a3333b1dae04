"""A second model family: a packed LLaVA row equals each sample run alone, in float64.

LLaVA is not Qwen-shaped: each image is one fixed-size pixel tensor, its token is
repeated a fixed number of times, the language model's embeddings at those slots are
replaced by the projected vision features, and positions are 1-D. The same row
machinery (the text row of ``PackedBatch.from_samples``, media in row order with their
slots and segments, ``cu_seqlens`` boundaries) makes it exact.

Packed: one row of six easy-vqa samples (one or two images each, images through CLIP's
processing to 32x32, 16 image tokens each), the vision tower once over the row's
images, the features scattered into the row's image slots in row order, the language
model on sftpack's varlen training attention (both boundary modes) or on Hugging Face's
sdpa (boundaries from the position restarts). Alone: each sample through the model's own
``model(input_ids, pixel_values)``. Compared: logits of every real token, the token-mean
loss (one shared count of targets) and the gradient of every parameter (language model,
projector, vision tower).

Tolerance, fixed: 1e-10 in float64, derived as in tests/multimodal/test_exactness.py
(Higham's n*u bound on sums in any order, u = 2**-53). Here the longest chain of
roundings is shorter than there (the patch embedding's 3*8*8 = 192-term dot products,
then width 16 over 2 vision layers and width 32 over 2 text layers, segments <= 160
tokens, <= 60 vocabulary ids), so the same n <= 4,000 bound holds: each run off by <=
4.4e-13 relative, the two by <= 8.9e-13, on logits and gradients of magnitude <= 10
(asserted), <= 8.9e-12; 1e-10 is 11x that. The rotary angles are float32 from the
integer positions: identical positions give identical angles in both runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sftpack.handoff import PackedBatchError
from sftpack.multimodal import (
    LlavaRow,
    LlavaSample,
    build_llava_row,
    check_llava_packed,
    llava_alone_logits,
    llava_image_processor,
    llava_image_tokens,
    qwen2vl_tokenizer,
    tiny_llava,
    tokenize_llava,
    vqa_corpus,
)
from sftpack.sample import IGNORE_INDEX

TOL = 1e-10  # float64; see the docstring
# What a wrong image order, a position that does not restart or a crossing label moves
# something by, at least: 1e6 x TOL, far above any rounding.
BUG = 1e-4
IMAGE_TOKENS = 16  # (32 px / 8 px patches)**2, the class token dropped
SPECIAL_IDS = (151643, 151652, 151653, 151655)  # <|endoftext|> (the pad), <|vision_start|>, <|vision_end|>, image


class Compact:
    """LLaVA samples over a compact vocabulary (the ids they use, in sorted order), and the
    tiny model for it: a 151,657-row embedding would make each float64 pass cost seconds."""

    def __init__(self, samples: list[LlavaSample]) -> None:
        self.vocab = np.unique(np.concatenate([s.input_ids for s in samples] + [np.array(SPECIAL_IDS)]))
        self.samples = [
            LlavaSample(
                np.searchsorted(self.vocab, s.input_ids),
                s.loss_mask,
                s.conversation_id,
                pixel_values=s.pixel_values,  # float32: the float64 model casts it, exactly
                image_runs=s.image_runs,
                image_token_id=self.id(151655),
            )
            for s in samples
        ]

    def id(self, token_id: int) -> int:
        return int(np.searchsorted(self.vocab, token_id))

    @property
    def pad_id(self) -> int:
        return self.id(151643)

    def model(self, text_attention: str | None = None):
        return tiny_llava(
            len(self.vocab), image_token_id=self.id(151655), dtype=torch.float64, text_attention=text_attention
        )


@pytest.fixture(scope="module")
def llava_samples():
    """Six easy-vqa conversations (three with two images under seed 2), as LLaVA samples."""
    convs = list(vqa_corpus(seed=2, limit=6, min_side=56, max_side=112))
    tok, proc = qwen2vl_tokenizer(), llava_image_processor(32)
    return [tokenize_llava(c["messages"], image_tokens=IMAGE_TOKENS, tokenizer=tok, processor=proc,
                           conversation_id=c["id"]) for c in convs]  # fmt: skip


@pytest.fixture(scope="module")
def compact(llava_samples):
    return Compact(llava_samples)


@pytest.fixture(scope="module")
def model(compact):
    return compact.model()


@pytest.fixture(scope="module")
def sdpa_model(compact, model):
    """The same weights, the language model on Hugging Face's sdpa (boundaries from the position restarts)."""
    return compact.model(text_attention="sdpa")  # the same seed: the same weights (tested below)


def test_tiny_llava_is_seeded(compact, model, sdpa_model):
    """Nothing downloaded, and the same seed gives the same weights whatever the attention."""
    a, b = model.state_dict(), sdpa_model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == torch.float64 for v in a.values() if v.is_floating_point())
    assert model.config.text_config._attn_implementation == "sftpack_varlen_train"
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_samples_are_llava_shaped(llava_samples, model):
    """One fixed-size tensor per image, a fixed run of image tokens, no Qwen vision brackets,
    never a loss on an image token; the run length is what the model's feature select gives."""
    assert llava_image_tokens(model.config) == IMAGE_TOKENS
    assert sum(s.num_images for s in llava_samples) >= 8
    tok = qwen2vl_tokenizer()
    for s in llava_samples:
        assert s.pixel_values.shape[1:] == (3, 32, 32) and s.pixel_values.dtype == np.float32
        assert s.image_runs[:, 1].tolist() == [IMAGE_TOKENS] * s.num_images
        assert not np.isin(s.input_ids, [151652, 151653]).any()
        assert not s.loss_mask[s.input_ids == 151655].any() and s.loss_mask.any()
        text = tok.decode(s.input_ids[s.input_ids != 151655])
        assert text.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in text


def test_the_row(compact):
    """Text from PackedBatch.from_samples (1-D positions restarting, no MRoPE); images in row order."""
    items = compact.samples
    row = build_llava_row(items, pad_multiple=4, pad_id=compact.pad_id).validate()
    b = row.batch
    assert b.mrope_position_ids is None and not b.has_media
    assert b.position_ids.tolist() == [t for n in b.padded_seqlens.tolist() for t in range(n)]
    assert row.num_images == sum(s.num_images for s in items) == row.image_sequence.shape[0]
    assert row.num_image_tokens == IMAGE_TOKENS * row.num_images
    assert torch.equal(row.pixel_values, torch.from_numpy(np.concatenate([s.pixel_values for s in items])))
    cup = b.cu_seqlens_padded.tolist()
    want = [(cup[i] + a, n) for i, s in enumerate(items) for a, n in s.image_runs.tolist()]
    assert row.image_slots.tolist() == [list(w) for w in want]
    assert not bool((b.labels == row.image_token_id).any())
    assert b.num_label_tokens == sum(int(s.loss_mask[1:].sum()) for s in items)


def test_the_row_refuses_bad_media(compact):
    row = build_llava_row(compact.samples, pad_id=compact.pad_id)
    swapped = dataclasses.replace(row, image_slots=row.image_slots.flip(0), image_sequence=row.image_sequence.flip(0))
    with pytest.raises(PackedBatchError, match="row order"):
        swapped.validate()
    short = dataclasses.replace(row, image_slots=row.image_slots[1:], image_sequence=row.image_sequence[1:])
    with pytest.raises(PackedBatchError, match="images but image_slots"):
        short.validate()
    with pytest.raises(PackedBatchError, match="image token id"):
        build_llava_row(compact.samples, pad_id=compact.samples[0].image_token_id)


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
@pytest.mark.parametrize("pad_multiple, extra", [(1, 0), (4, 8)])
def test_packed_equals_alone(compact, model, pad_between_seqs, pad_multiple, extra):
    """sftpack's varlen attention, boundaries from cu_seqlens, both boundary modes."""
    items = compact.samples
    width = sum(-(-len(s) // pad_multiple) * pad_multiple for s in items) + extra if extra else None
    r = check_llava_packed(
        model, items, pad_between_seqs=pad_between_seqs, pad_multiple=pad_multiple, row_width=width,
        pad_id=compact.pad_id,
    )  # fmt: skip
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r  # the premise of TOL
    assert r.within(TOL), r


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
def test_two_fixed_width_rows_in_one_run_equal_alone(compact, model, pad_between_seqs):
    """Two rows of a fixed width (tail padding folded into each row's last segment) laid end to end."""
    items = compact.samples
    width = max(sum(-(-len(s) // 4) * 4 for s in part) for part in (items[:3], items[3:])) + 12
    r = check_llava_packed(model, items, pad_between_seqs=pad_between_seqs, pad_multiple=4, row_width=width,
                           rows=2, pad_id=compact.pad_id)  # fmt: skip
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r
    assert r.within(TOL), r
    run = LlavaRow.concat([build_llava_row(p, row_width=width, pad_multiple=4, pad_id=compact.pad_id)
                           for p in (items[:3], items[3:])]).validate()  # fmt: skip
    assert run.batch.num_tokens == 2 * width and run.num_images == sum(s.num_images for s in items)
    assert run.image_sequence.tolist() == [i for i, s in enumerate(items) for _ in range(s.num_images)]


def test_packed_equals_alone_with_hf_boundaries_from_positions(compact, sdpa_model):
    """Hugging Face's sdpa, given only the embeddings and the 1-D positions: it finds the
    boundaries where the positions restart."""
    r = check_llava_packed(sdpa_model, compact.samples, pad_multiple=4, pad_id=compact.pad_id)
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r
    assert r.within(TOL), r


def _images_reversed(row: LlavaRow) -> LlavaRow:
    """The bug: the images in the wrong order (their slots unchanged)."""
    return dataclasses.replace(row, pixel_values=row.pixel_values.flip(0))


def _positions_not_restarted(row: LlavaRow) -> LlavaRow:
    """The bug: positions of the whole row as one sequence."""
    b = row.batch
    return dataclasses.replace(row, batch=dataclasses.replace(b, position_ids=torch.arange(b.num_tokens)))


def _label_across(row: LlavaRow) -> LlavaRow:
    """The bug: the last real token of the first sample is trained to predict the next sample's first token."""
    b = row.batch
    labels = b.labels.clone()
    last = int(b.cu_seqlens[1]) - 1
    assert int(labels[last]) == IGNORE_INDEX
    labels[last] = b.input_ids[int(b.cu_seqlens_padded[1])]
    return dataclasses.replace(row, batch=dataclasses.replace(b, labels=labels))


@pytest.mark.parametrize("tamper", [_images_reversed, _label_across], ids=["images-reversed", "label-across"])
def test_negative_controls_fail(compact, model, tamper):
    r = check_llava_packed(model, compact.samples, pad_id=compact.pad_id, tamper=tamper)
    assert r.worst > BUG, r
    if tamper is _images_reversed:  # the wrong features reach the projector and the tower's gradients too
        assert r.grads_projector > BUG and r.grads_vision > BUG, r


def test_positions_not_restarted_with_cu_seqlens_fail_only_through_float32_angles(compact, model):
    """With boundaries from cu_seqlens, positions that do not restart shift each sample's positions
    by a constant, which RoPE cannot see in exact arithmetic (its scores depend on position
    differences): the control fails only through the model's float32 rotary angles (observed
    2.4e-9, 24x TOL), as on Qwen2-VL. Kernels that read boundaries from positions break outright
    (the next test)."""
    r = check_llava_packed(model, compact.samples, pad_id=compact.pad_id, tamper=_positions_not_restarted)
    assert not r.within(TOL), r


@pytest.mark.parametrize(
    "tamper", [_positions_not_restarted, _images_reversed], ids=["positions-not-restarted", "images-reversed"]
)
def test_negative_controls_fail_with_hf_boundaries(compact, sdpa_model, tamper):
    """Kernels that read boundaries from positions: positions that do not restart join the
    samples into one causal sequence, and every sample after the first sees the ones before
    (the logits themselves move, not only the loss)."""
    r = check_llava_packed(sdpa_model, compact.samples, pad_id=compact.pad_id, tamper=tamper)
    assert r.logits > BUG, r


def test_alone_is_the_models_own_forward(compact, model):
    """The reference is Hugging Face's own path, and the images reach it: the same sample with
    blank images gives other logits."""
    s = compact.samples[0]
    ids = torch.from_numpy(s.input_ids)[None]
    pv = torch.from_numpy(s.pixel_values)
    with torch.no_grad():
        lg = llava_alone_logits(model, s)
        assert torch.equal(model(input_ids=ids, pixel_values=pv, use_cache=False).logits[0], lg)
        blank = model(input_ids=ids, pixel_values=torch.zeros_like(pv), use_cache=False).logits[0]
    assert float((blank - lg).abs().max()) > BUG
