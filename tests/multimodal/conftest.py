"""Shared pieces of the multimodal tests: the tokenizer, a few easy-vqa samples, a tiny Qwen2-VL (or Qwen2.5-VL).

The model's vocabulary is the ids the samples use (renumbered in sorted order, so the
order and the special tokens' roles are kept): a 151,657-row embedding would make a
float64 forward and backward pass cost seconds instead of milliseconds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("easy_vqa")
pytest.importorskip("PIL")

from sftpack import Sample  # noqa: E402
from sftpack.multimodal import family_for, tokenize_media_conversations, vqa_corpus  # noqa: E402


def noise_image(w: int, h: int, seed: int):
    """A ``w x h`` RGB image of seeded noise (PIL)."""
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def positions_1d(b):
    """The MRoPE bug: plain 1-D positions (restarting per sample) in all three rows; the grids ignored."""
    return dataclasses.replace(b, media=dataclasses.replace(b.media, positions=b.position_ids.expand(3, -1).clone()))


def assert_exact_with_tower(model, items, tol: float, **rows) -> None:
    """``check_packed(model, items, rows=3, **rows)`` within ``tol``, language model and vision
    tower both compared, on values under 10 (the premise of the tests' tolerances)."""
    from sftpack.multimodal import check_packed

    r = check_packed(model, items, rows=3, **rows)
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r  # the premise of TOL
    assert set(r.grads) == {"language", "vision"}
    assert r.within(tol), r


def noise_conversations(sizes: dict[str, tuple[int, ...]], *, text_only: bool = False) -> list[dict]:
    """Conversations with noise images: ``"wide"`` (one image of ``sizes["wide"]``), ``"two"``
    (two images, ``sizes["two"]`` = ``(w1, h1, w2, h2)``, and a second turn), ``"tall"``, and with
    ``text_only`` a conversation without images; sizes chosen by each family's patch grid."""

    def user(*parts):
        return {"role": "user", "content": list(parts)}

    def image(w, h, seed):
        return {"type": "image", "image": noise_image(w, h, seed)}

    def text(t):
        return {"type": "text", "text": t}

    w1, h1, w2, h2 = sizes["two"]
    out = [
        {"id": "wide", "messages": [user(image(*sizes["wide"], 1), text("What is this?")),
                                    {"role": "assistant", "content": "Noise, wide."}]},
        {"id": "two", "messages": [user(image(w1, h1, 2), text("And this?"), image(w2, h2, 3)),
                                   {"role": "assistant", "content": "Two noisy images."},
                                   user(text("Which is larger?")),
                                   {"role": "assistant", "content": "The first."}]},
    ]  # fmt: skip
    if text_only:
        out.append(
            {"id": "text", "messages": [user(text("No picture today.")), {"role": "assistant", "content": "Fine."}]}
        )
    out.append({"id": "tall", "messages": [user(text("Look:"), image(*sizes["tall"], 4)),
                                           {"role": "assistant", "content": "Tall noise."}]})  # fmt: skip
    return out


#: <|endoftext|> (the pad), <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>
SPECIAL_IDS = (151643, 151652, 151653, 151655, 151656)


class Renumbered:
    """Samples over a compact vocabulary, and the tiny model of a family (default Qwen2-VL) for it."""

    def __init__(self, samples: list[Sample], family: str = "qwen2_vl") -> None:
        self.family = family_for(family)
        self.vocab = np.unique(np.concatenate([s.input_ids for s in samples] + [np.array(SPECIAL_IDS)]))
        self.samples = [self.sample(s) for s in samples]

    def id(self, token_id: int) -> int:
        return int(np.searchsorted(self.vocab, token_id))

    def sample(self, s: Sample) -> Sample:
        # the media as it is (pixels float32: the float64 model's tower casts them, exactly), its placeholder renumbered
        return Sample(
            np.searchsorted(self.vocab, s.input_ids),
            s.loss_mask,
            s.conversation_id,
            media=dataclasses.replace(s.media, token_id=self.id(151655)),
        )

    @property
    def pad_id(self) -> int:
        return self.id(151643)

    def model(self, seed: int = 0, text_attention: str | None = None):
        return self.family.tiny_model(
            vocab_size=len(self.vocab),
            token_ids=dict(
                image_token_id=self.id(151655),
                vision_start_token_id=self.id(151652),
                vision_end_token_id=self.id(151653),
                video_token_id=self.id(151656),
            ),
            seed=seed,
            dtype=torch.float64,
            text_attention=text_attention,
        )


@pytest.fixture(scope="session")
def tok():
    return family_for("qwen2_vl").tokenizer()


@pytest.fixture(scope="session")
def proc():
    return family_for("qwen2_vl").image_processor()


@pytest.fixture(scope="session")
def vqa_samples(tok, proc):
    """Six easy-vqa conversations (three with two images under seed 2), images 56-112 px a side."""
    convs = list(vqa_corpus(seed=2, limit=6, min_side=56, max_side=112))
    return list(tokenize_media_conversations(convs, tokenizer=tok, processor=proc))


@pytest.fixture(scope="session")
def renumbered(vqa_samples):
    return Renumbered(vqa_samples)


@pytest.fixture(scope="session")
def model(renumbered):
    return renumbered.model()


@pytest.fixture(scope="session")
def sdpa_model(renumbered, model):
    """The same weights, the language model on Hugging Face's sdpa (boundaries from the text positions)."""
    m = renumbered.model(text_attention="sdpa")
    m.load_state_dict(model.state_dict())
    return m
