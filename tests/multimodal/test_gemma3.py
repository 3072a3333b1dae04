"""Gemma 3 behind the family seam: its text is Gemma3Processor's, and a packed row equals each sample alone.

Gemma 3 is neither Qwen nor LLaVA: its template writes ``<start_of_image>``, which the
processor rewrites into ``\\n\\n<start_of_image>`` + soft tokens + ``<end_of_image>\\n\\n``;
each image's soft tokens see each other both ways (Hugging Face builds that from
``token_type_ids``), and half its layers look through a sliding window. The packed row
runs ``sdpa`` on dense masks from ``cu_seqlens_padded`` and the image runs
(``packed_masks``); alone is Hugging Face's own ``model(input_ids, pixel_values,
token_type_ids)``.

Tolerance, fixed: 1e-10 in float64 on logits, loss and every gradient, derived as in
tests/multimodal/test_llava.py (Higham's n*u bound, u = 2**-53; chains <= 4,000 roundings
here: the 3*8*8 = 192-term patch dot products, width 16 over 2 tower layers, width 32 over 2
text layers, samples <= 64 tokens, <= 64 vocabulary ids: each run off by <= 4.4e-13
relative, the two by <= 8.9e-13, at magnitudes <= 10, asserted) -> <= 8.9e-12; 1e-10 is 11x
that. The RMSNorms compute in float64 (Gemma's own upcast to float32, which would round).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from sftpack import PackedBatch, Sample
from sftpack.multimodal import check_packed, family_for, tokenize_media_conversation
from sftpack.multimodal.families import gemma3 as gemma3_module
from sftpack.multimodal.families.gemma3 import BOI, EOI, SOFT, TURN_END, Gemma3

TOL = 1e-10  # float64: see the docstring
BUG = 1e-6  # what a bug moves the logits by, at least (observed: 1e-2 and more)


def _image(colour, w=40, h=30):
    return {"type": "image", "image": Image.new("RGB", (w, h), colour)}


CONVS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [_image((200, 0, 0)), {"type": "text", "text": "Colour? <end_of_turn>"}]},
        {"role": "assistant", "content": "Red."},
    ],
    [
        {
            "role": "user",
            "content": [_image((0, 200, 0)), _image((0, 0, 200), 50, 50), {"type": "text", "text": "Both?"}],
        },
        {"role": "assistant", "content": "Green and blue."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes, quite sure of it."},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}],
    [
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, _image((90, 90, 0), 30, 60)]},
        {"role": "assistant", "content": "Olive."},
    ],
]


class Compact:
    """The samples over a compact vocabulary (the ids they use, sorted) and the tiny model for it."""

    def __init__(self, samples: list[Sample], tok) -> None:
        fam = family_for("gemma3")
        self.names = fam.token_ids(tok)
        self.vocab = np.unique(np.concatenate([s.input_ids for s in samples] + [np.array([*self.names.values(), 0])]))
        self.samples = [
            Sample(
                np.searchsorted(self.vocab, s.input_ids),
                s.loss_mask,
                s.conversation_id,
                media=dataclasses.replace(s.media, token_id=self.id(self.names["image_token_id"])),
            )
            for s in samples
        ]

    def id(self, token_id: int) -> int:
        return int(np.searchsorted(self.vocab, token_id))

    def model(self):
        ids = {k: self.id(v) for k, v in self.names.items()}
        return family_for("gemma3").tiny_model(vocab_size=len(self.vocab), token_ids=ids, dtype=torch.float64)


@pytest.fixture(scope="module")
def setup():
    fam = family_for("gemma3")
    tok, proc = fam.tokenizer(), fam.image_processor()
    samples = [
        tokenize_media_conversation(c, family=fam, tokenizer=tok, processor=proc, conversation_id=i)[0]
        for i, c in enumerate(CONVS)
    ]
    return fam, tok, proc, samples


@pytest.fixture(scope="module")
def compact(setup):
    return Compact(setup[3], setup[1])


@pytest.fixture(scope="module")
def model(compact):
    return compact.model()


def test_the_text_is_gemma3_processors(setup, tmp_path_factory):
    """Each sample's ids equal Gemma3Processor's on the template's text with the same images,
    its image runs are where the processor's token_type_ids mark them, its pixels the processor's."""
    import transformers as hf

    fam, tok, proc, samples = setup
    folder = tmp_path_factory.mktemp("gemma3-tok")
    tok.save_pretrained(folder)
    named = hf.AutoTokenizer.from_pretrained(
        folder, extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT}
    )
    hf_proc = hf.Gemma3Processor(image_processor=proc, tokenizer=named, image_seq_length=fam.image_tokens)
    for conv, s in zip(CONVS[1:], samples[1:]):  # the first types "<end_of_turn>", text here, a control token there
        shown = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                  [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})} for p in m["content"]]}
                 for m in conv]  # fmt: skip
        text = fam.renderer(tok).render(shown)
        images = [
            p["image"] for m in conv if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"
        ]
        out = hf_proc(text=[text], images=[images] if images else None, return_tensors="np")
        np.testing.assert_array_equal(s.input_ids, out["input_ids"][0])
        starts = [a for a, _ in s.media.slots.tolist()]
        assert np.flatnonzero(np.diff(np.r_[0, out["token_type_ids"][0]]) == 1).tolist() == starts
        if images:
            np.testing.assert_array_equal(s.media.pixel_values.numpy(), out["pixel_values"])


def test_the_mask_trains_the_models_answers_and_their_end_of_turn(setup):
    fam, tok, _, samples = setup
    end = tok.convert_tokens_to_ids(TURN_END)
    assert tok.decode(samples[0].input_ids[samples[0].loss_mask]) == "Red.<end_of_turn>"
    assert (
        tok.decode(samples[1].input_ids[samples[1].loss_mask])
        == "Green and blue.<end_of_turn>Yes, quite sure of it.<end_of_turn>"
    )
    # "<end_of_turn>" typed in a content stays text: one control token per turn, none inside the system + user turn
    assert int((samples[0].input_ids == end).sum()) == 2
    assert tok.decode(samples[0].input_ids).startswith("<bos><start_of_turn>user\nBe brief.\n\n\n\n<start_of_image>")


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
@pytest.mark.parametrize("pad_multiple, extra", [(1, 0), (4, 8)])
def test_packed_equals_alone(compact, model, pad_between_seqs, pad_multiple, extra):
    items = compact.samples
    assert max(len(s) for s in items) > model.config.text_config.sliding_window  # the window is exercised
    width = sum(-(-len(s) // pad_multiple) * pad_multiple for s in items) + extra if extra else None
    r = check_packed(
        model, items, pad_between_seqs=pad_between_seqs, pad_multiple=pad_multiple, row_width=width, pad_id=0
    )
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10 and max(map(len, items)) <= 64, r  # the premises of TOL
    assert r.within(TOL), r
    assert set(r.grads) == {"language", "projector", "vision"}


def test_two_rows_in_one_run_equal_alone(compact, model):
    items = compact.samples
    width = max(sum(-(-len(s) // 4) * 4 for s in part) for part in (items[:2], items[2:])) + 4
    r = check_packed(model, items, pad_multiple=4, row_width=width, rows=2, pad_id=0)
    assert r.within(TOL), r


def _images_reversed(b: PackedBatch) -> PackedBatch:
    return dataclasses.replace(b, media=dataclasses.replace(b.media, pixel_values=b.media.pixel_values.flip(0)))


def test_negative_control_images_reversed(compact, model):
    r = check_packed(model, compact.samples, pad_id=0, tamper=_images_reversed)
    assert r.logits > BUG and r.grads["vision"] > BUG and r.grads["projector"] > BUG, r


@pytest.mark.parametrize("bug", ["image tokens causal", "no sliding window"])
def test_negative_control_wrong_masks(compact, model, monkeypatch, bug):
    """The bugs a packed Gemma 3 row can have: its soft tokens causal as text (the mask of a
    text model), or its sliding-window layers seeing the whole sample."""
    real = gemma3_module.packed_masks

    def wrong(batch, window, runs):
        if bug == "image tokens causal":
            return real(batch, window, runs[:0])
        return real(batch, None, runs)

    monkeypatch.setattr(gemma3_module, "packed_masks", wrong)
    r = check_packed(model, compact.samples, pad_id=0)
    assert r.logits > BUG, r


def test_the_family_is_read_from_a_config(model, compact):
    fam = family_for(model)
    assert fam == Gemma3(image_tokens=4, image_size=32, image_token_id=compact.id(compact.names["image_token_id"]))
    assert model.config.text_config._attn_implementation == "sdpa"


def test_padded_rows_with_the_familys_kwargs_equal_alone(compact, model):
    """The padded baseline runs the model's own forward on right-padded rows: with
    ``padded_kwargs`` (token_type_ids) each sample's logits are its own; without them Hugging
    Face's mask is causal over the soft tokens too, and the logits move."""
    fam = family_for(model)
    items = compact.samples[:2]
    ids = torch.zeros(len(items), max(map(len, items)), dtype=torch.int64)
    for i, s in enumerate(items):
        ids[i, : len(s)] = torch.from_numpy(s.input_ids)
    kw = {
        "input_ids": ids,
        "pixel_values": torch.cat([s.media.pixel_values for s in items]).double(),
        "use_cache": False,
    }
    with torch.no_grad():
        right = model(**kw, **fam.padded_kwargs(ids, items[0].media)).logits
        causal = model(**kw).logits
        alone = [fam.alone_logits(model, s) for s in items]
    assert max(float((right[i, : len(s)] - a).abs().max()) for i, (s, a) in enumerate(zip(items, alone))) <= TOL
    assert max(float((causal[i, : len(s)] - a).abs().max()) for i, (s, a) in enumerate(zip(items, alone))) > BUG
