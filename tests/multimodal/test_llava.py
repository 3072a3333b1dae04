"""A second model family: a packed LLaVA row equals each sample run alone, in float64.

LLaVA is not Qwen-shaped: each image is one fixed-size pixel tensor, its token is
repeated a fixed number of times, the language model's embeddings at those slots are
replaced by the projected vision features, and positions are 1-D. The same row
machinery (``PackedBatch.from_samples`` laying the samples' ``ImageMedia`` in row order
with their slots and segments, ``cu_seqlens`` boundaries) makes it exact.

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

from sftpack import PackedBatch, Sample
from sftpack.handoff import PackedBatchError
from sftpack.handoff.payload import ImageMedia
from sftpack.multimodal import check_packed, family_for, tokenize_media_conversation, vqa_corpus
from sftpack.multimodal.families.llava import IMAGE, Llava, llava_image_tokens, llava_tokenizer, tiny_llava
from sftpack.sample import IGNORE_INDEX

TOL = 1e-10  # float64; see the docstring
# What a wrong image order, a position that does not restart or a crossing label moves
# something by, at least: 1e6 x TOL, far above any rounding.
BUG = 1e-4
IMAGE_TOKENS = 16  # (32 px / 8 px patches)**2, the class token dropped
PAD_ID = llava_tokenizer().pad_token_id  # <|endoftext|>
IMAGE_ID = llava_tokenizer().convert_tokens_to_ids(IMAGE)
SPECIAL_IDS = (PAD_ID, IMAGE_ID)


class Compact:
    """LLaVA samples over a compact vocabulary (the ids they use, in sorted order), and the
    tiny model for it: a 151,657-row embedding would make each float64 pass cost seconds."""

    def __init__(self, samples: list[Sample]) -> None:
        self.vocab = np.unique(np.concatenate([s.input_ids for s in samples] + [np.array(SPECIAL_IDS)]))
        self.samples = [
            Sample(
                np.searchsorted(self.vocab, s.input_ids),
                s.loss_mask,
                s.conversation_id,
                # the media as it is (pixels float32: the float64 model casts them, exactly), its placeholder renumbered
                media=dataclasses.replace(s.media, token_id=self.id(IMAGE_ID)),
            )
            for s in samples
        ]

    def id(self, token_id: int) -> int:
        return int(np.searchsorted(self.vocab, token_id))

    @property
    def pad_id(self) -> int:
        return self.id(PAD_ID)

    def model(self, text_attention: str | None = None):
        return tiny_llava(
            len(self.vocab), image_token_id=self.id(IMAGE_ID), dtype=torch.float64, text_attention=text_attention
        )


@pytest.fixture(scope="module")
def llava_samples():
    """Six easy-vqa conversations (three with two images under seed 2), as LLaVA samples."""
    convs = list(vqa_corpus(seed=2, limit=6, min_side=56, max_side=112))
    family = Llava(image_tokens=IMAGE_TOKENS, image_size=32)
    tok, proc = family.tokenizer(), family.image_processor()
    out = []
    for c in convs:
        (s,) = tokenize_media_conversation(
            c["messages"], family=family, tokenizer=tok, processor=proc, conversation_id=c["id"]
        )
        out.append(s)
    return out


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
    """One fixed-size tensor per image, a fixed run of image tokens, LLaVA-1.5's own text
    (``USER: <image>\\n... ASSISTANT: ...</s>``, no ChatML), never a loss on an image token; the
    run length is what the model's feature select gives."""
    assert llava_image_tokens(model.config) == IMAGE_TOKENS
    read = Llava(image_tokens=IMAGE_TOKENS, image_size=32, image_token_id=model.config.image_token_id)
    assert family_for(model) == read  # read from the model's config
    assert sum(s.media.num_items for s in llava_samples) >= 8
    tok = family_for("llava").tokenizer()
    for s in llava_samples:
        m = s.media
        assert isinstance(m, ImageMedia) and s.num_patches == m.num_placeholders
        assert m.pixel_values.shape[1:] == (3, 32, 32) and m.pixel_values.dtype == torch.float32
        assert m.slots[:, 1].tolist() == [IMAGE_TOKENS] * m.num_items
        assert not s.loss_mask[s.input_ids == IMAGE_ID].any() and s.loss_mask.any()
        first = int(s.media.slots[0, 0])
        assert tok.decode(s.input_ids[:first]).endswith("USER: ") and s.input_ids[first + IMAGE_TOKENS] != IMAGE_ID
        text = tok.decode(s.input_ids[s.input_ids != IMAGE_ID])
        assert text.startswith("USER: \n") and " ASSISTANT: " in text and text.endswith("</s>")
        assert "<|im_start|>" not in text and tok.decode(s.input_ids[s.loss_mask]).endswith("</s>")


def test_the_row(compact):
    """Text from PackedBatch.from_samples (1-D positions restarting, no MRoPE); images in row order."""
    items = compact.samples
    b = PackedBatch.from_samples(items, pad_multiple=4, pad_id=compact.pad_id).validate()
    m = b.media
    assert isinstance(m, ImageMedia) and not hasattr(m, "positions")  # no multimodal positions
    assert b.to_hf_kwargs()["position_ids"].shape == (1, b.num_tokens)  # the text's 1-D ones
    assert b.position_ids.tolist() == [t for n in b.padded_seqlens.tolist() for t in range(n)]
    assert b.num_media_items == sum(s.media.num_items for s in items) == m.sequence.shape[0]
    assert m.num_placeholders == IMAGE_TOKENS * b.num_media_items
    assert torch.equal(m.pixel_values, torch.cat([s.media.pixel_values for s in items]))
    cup = b.cu_seqlens_padded.tolist()
    want = [(cup[i] + a, n) for i, s in enumerate(items) for a, n in s.media.slots.tolist()]
    assert m.slots.tolist() == [list(w) for w in want]
    assert not bool((b.labels == m.token_id).any())
    assert b.num_label_tokens == sum(int(s.loss_mask[1:].sum()) for s in items)


def test_the_row_refuses_bad_media(compact):
    row = PackedBatch.from_samples(compact.samples, pad_id=compact.pad_id)
    m = row.media
    swapped = dataclasses.replace(row, media=dataclasses.replace(m, slots=m.slots.flip(0), sequence=m.sequence.flip(0)))
    with pytest.raises(PackedBatchError, match="row order"):
        swapped.validate()
    short = dataclasses.replace(row, media=dataclasses.replace(m, slots=m.slots[1:], sequence=m.sequence[1:]))
    n = m.num_items
    with pytest.raises(PackedBatchError, match=rf"pixel_values must have shape \({n - 1}, .*got \({n}, 3, 32, 32\)"):
        short.validate()  # an image without a run
    with pytest.raises(PackedBatchError, match="placeholder id"):
        PackedBatch.from_samples(compact.samples, pad_id=compact.samples[0].media.token_id)


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
@pytest.mark.parametrize("pad_multiple, extra", [(1, 0), (4, 8)])
def test_packed_equals_alone(compact, model, pad_between_seqs, pad_multiple, extra):
    """sftpack's varlen attention, boundaries from cu_seqlens, both boundary modes."""
    items = compact.samples
    width = sum(-(-len(s) // pad_multiple) * pad_multiple for s in items) + extra if extra else None
    r = check_packed(
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
    r = check_packed(model, items, pad_between_seqs=pad_between_seqs, pad_multiple=4, row_width=width,
                     rows=2, pad_id=compact.pad_id)  # fmt: skip
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r
    assert r.within(TOL), r
    run = PackedBatch.concat([PackedBatch.from_samples(p, row_width=width, pad_multiple=4, pad_id=compact.pad_id)
                              for p in (items[:3], items[3:])]).validate()  # fmt: skip
    assert run.num_tokens == 2 * width and run.num_media_items == sum(s.media.num_items for s in items)
    assert run.media.sequence.tolist() == [i for i, s in enumerate(items) for _ in range(s.media.num_items)]


def test_packed_equals_alone_with_hf_boundaries_from_positions(compact, sdpa_model):
    """Hugging Face's sdpa, given only the embeddings and the 1-D positions: it finds the
    boundaries where the positions restart."""
    r = check_packed(sdpa_model, compact.samples, pad_multiple=4, pad_id=compact.pad_id)
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r
    assert r.within(TOL), r


def _images_reversed(b: PackedBatch) -> PackedBatch:
    """The bug: the images in the wrong order (their slots unchanged)."""
    return dataclasses.replace(b, media=dataclasses.replace(b.media, pixel_values=b.media.pixel_values.flip(0)))


def _positions_not_restarted(b: PackedBatch) -> PackedBatch:
    """The bug: positions of the whole row as one sequence."""
    return dataclasses.replace(b, position_ids=torch.arange(b.num_tokens))


def _label_across(b: PackedBatch) -> PackedBatch:
    """The bug: the last real token of the first sample is trained to predict the next sample's first token."""
    labels = b.labels.clone()
    last = int(b.cu_seqlens[1]) - 1
    assert int(labels[last]) == IGNORE_INDEX
    labels[last] = b.input_ids[int(b.cu_seqlens_padded[1])]
    return dataclasses.replace(b, labels=labels)


@pytest.mark.parametrize("tamper", [_images_reversed, _label_across], ids=["images-reversed", "label-across"])
def test_negative_controls_fail(compact, model, tamper):
    r = check_packed(model, compact.samples, pad_id=compact.pad_id, tamper=tamper)
    assert r.worst > BUG, r
    if tamper is _images_reversed:  # the wrong features reach the projector and the tower's gradients too
        assert r.grads["projector"] > BUG and r.grads["vision"] > BUG, r


def test_positions_not_restarted_with_cu_seqlens_fail_only_through_float32_angles(compact, model):
    """With boundaries from cu_seqlens, positions that do not restart shift each sample's positions
    by a constant, which RoPE cannot see in exact arithmetic (its scores depend on position
    differences): the control fails only through the model's float32 rotary angles (observed
    2.4e-9, 24x TOL), as on Qwen2-VL. Kernels that read boundaries from positions break outright
    (the next test)."""
    r = check_packed(model, compact.samples, pad_id=compact.pad_id, tamper=_positions_not_restarted)
    assert not r.within(TOL), r


@pytest.mark.parametrize(
    "tamper", [_positions_not_restarted, _images_reversed], ids=["positions-not-restarted", "images-reversed"]
)
def test_negative_controls_fail_with_hf_boundaries(compact, sdpa_model, tamper):
    """Kernels that read boundaries from positions: positions that do not restart join the
    samples into one causal sequence, and every sample after the first sees the ones before
    (the logits themselves move, not only the loss)."""
    r = check_packed(sdpa_model, compact.samples, pad_id=compact.pad_id, tamper=tamper)
    assert r.logits > BUG, r


def test_alone_is_the_models_own_forward(compact, model):
    """The reference is Hugging Face's own path, and the images reach it: the same sample with
    blank images gives other logits."""
    s = compact.samples[0]
    ids = torch.from_numpy(s.input_ids)[None]
    pv = s.media.pixel_values
    with torch.no_grad():
        lg = family_for(model).alone_logits(model, s)
        assert torch.equal(model(input_ids=ids, pixel_values=pv, use_cache=False).logits[0], lg)
        blank = model(input_ids=ids, pixel_values=torch.zeros_like(pv), use_cache=False).logits[0]
    assert float((blank - lg).abs().max()) > BUG
