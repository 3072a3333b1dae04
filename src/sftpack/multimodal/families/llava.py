"""LLaVA: one fixed-size image per tower entry, its features replacing a fixed run of image tokens, 1-D positions.

The second family behind :class:`~sftpack.multimodal.Family` (``family_for("llava")``,
or ``family_for(config)`` of a ``model_type`` ``"llava"`` config), and nothing
Qwen-shaped carries over to it:

- each image is one fixed-size pixel tensor ``(3, H, W)`` (no patch grid), and the
  vision tower (CLIP-style, with a class token) sees one image per batch entry;
- an image part is one image token (``<image>``, no vision block around it)
  repeated a fixed number of times per image, ``(H / patch)**2`` (the class token
  dropped, LLaVA's ``"default"`` feature select), and the language model's input
  embeddings at those slots are *replaced* by the projected vision features; the
  token's id is the config's ``image_token_index`` (a folder whose tokenizer puts
  ``<image>`` elsewhere is refused);
- conversations are written by the folder's own chat template (LLaVA-1.5's:
  ``USER: <image>\\n... ASSISTANT: ...``), else by :data:`LLAVA_TEMPLATE`;
- the media is an :class:`~sftpack.handoff.payload.ImageMedia`; positions are the
  text's 1-D ones, restarting per sample (no MRoPE).

The row is the one :meth:`sftpack.PackedBatch.from_samples` builds for every family;
the language model runs sftpack's training attention on ``cu_seqlens`` (either
boundary mode), and the exactness check compares with each sample run alone through
the model's own forward (``model(input_ids, pixel_values)``).

The embedded default (nothing downloaded) is a LLaVA-1.5-style tokenizer: the embedded
Qwen BPE (:func:`sftpack.data.default_tokenizer`) plus ``<image>`` and ``</s>`` (its
end of turn) as special tokens, with :data:`LLAVA_TEMPLATE`, the LLaVA-1.5 conversation
format (``USER: <image>\\nWhat is it? ASSISTANT: Red.</s>``; images first in a
message, as Hugging Face's LLaVA-1.5 template writes them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
import torch

from ... import _optional
from ...data import default_tokenizer
from ...exactness import small_text_config
from ...handoff import PackedBatch, PackedBatchError
from ...handoff.payload import ImageMedia
from .._family import (
    EncodedImages,
    Family,
    ImageProcessor,
    UnsupportedModelError,
    VisionLanguageModel,
    seeded_model,
    text_kwargs,
)

__all__ = ["IMAGE", "LLAVA_TEMPLATE", "Llava", "llava_image_tokens", "llava_tokenizer"]

IMAGE = "<image>"

#: LLaVA-1.5's conversation format: a system text then a space, ``USER: `` and ``ASSISTANT: ``
#: turns, each message's images first (``<image>\n`` each) then its texts; a user turn ends
#: with a space, an assistant turn with the end-of-turn token (the tokenizer's ``eos_token``).
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] if message['content'] is string "
    "else message['content'] %}"
    "{% if message['role'] == 'system' %}"
    "{% for part in parts if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}{{ ' ' }}"
    "{% else %}"
    "{{ message['role'].upper() + ': ' }}"
    "{% for part in parts if part['type'] == 'image' %}{{ '<image>\\n' }}{% endfor %}"
    "{% for part in parts if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{{ eos_token if message['role'] == 'assistant' else ' ' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    tok = copy.deepcopy(default_tokenizer())
    tok.add_special_tokens(
        {"eos_token": "</s>", "additional_special_tokens": [IMAGE]}, replace_extra_special_tokens=False
    )
    tok.chat_template = LLAVA_TEMPLATE
    return tok


def llava_tokenizer() -> Any:
    """The llava family's embedded tokenizer: the embedded Qwen BPE plus ``</s>`` (``eos_token``)
    and ``<image>`` as special tokens, with :data:`LLAVA_TEMPLATE`. Shared within the process."""
    return _tokenizer()


def _crop_side(processor: ImageProcessor) -> int | None:
    """The side of a CLIP-style processor's square crop (``None``: not one)."""
    crop = getattr(processor, "crop_size", None)
    h = crop.get("height") if isinstance(crop, dict) else getattr(crop, "height", None)
    w = crop.get("width") if isinstance(crop, dict) else getattr(crop, "width", None)
    return int(h) if isinstance(h, int) and h == w else None


@lru_cache(maxsize=8)
def _image_processor(size: int) -> Any:
    """LLaVA's image processing (CLIP's: shortest edge to ``size``, bicubic; centre crop to
    ``size x size``; CLIP mean and std), transformers' PIL/numpy ``CLIPImageProcessorPil``."""
    hf = _optional.transformers()
    return hf.CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


#: The vision towers :func:`llava_image_tokens` counts for, and whether each puts a class token first.
_LLAVA_TOWERS = {"clip_vision_model": True, "siglip_vision_model": False}


def llava_image_tokens(config: Any) -> int:
    """Image tokens per image for a LLaVA config (``model_type`` ``"llava"``, a CLIP or SigLIP
    tower): the tower's ``(image_size / patch_size)**2`` patch features, plus CLIP's class
    token, less the first feature under the ``"default"`` feature select (LLaVA drops it
    whatever the tower). 576 for llava-1.5 (CLIP, 336 px, 14 px patches, ``"default"``).

    Raises:
        UnsupportedModelError: another family (LLaVA-NeXT and -OneVision tile images into a
            varying number of tokens; Gemma 3, Idefics3, SmolVLM, Mistral3, InternVL, Qwen2-VL
            are not LLaVA), another tower or feature select, all in one line.
    """
    kind = getattr(config, "model_type", None)
    supported = (
        "supported: model_type 'llava' with a CLIP or SigLIP vision tower ('clip_vision_model', "
        "'siglip_vision_model') and vision_feature_select_strategy 'default' or 'full'; Qwen2-VL-style "
        "models go through tokenize_media_conversation"
    )
    if kind != "llava":
        raise UnsupportedModelError(
            f"llava_image_tokens: model_type {kind!r} ({type(config).__name__}) is not {supported}"
        )
    v = getattr(config, "vision_config", None)
    tower = getattr(v, "model_type", None)
    strategy = getattr(config, "vision_feature_select_strategy", None)
    size, patch = getattr(v, "image_size", None), getattr(v, "patch_size", None)
    if tower not in _LLAVA_TOWERS or strategy not in ("default", "full"):
        raise UnsupportedModelError(
            f"llava_image_tokens: vision tower {tower!r} with feature select {strategy!r} is not {supported}"
        )
    if not (isinstance(size, int) and isinstance(patch, int)) or min(size, patch) < 1:
        raise UnsupportedModelError(
            f"llava_image_tokens: vision_config.image_size {size!r} and patch_size {patch!r} (not positive ints: "
            f"square images and patches) are not {supported}"
        )
    n = (size // patch) ** 2 + (1 if _LLAVA_TOWERS[tower] else 0)
    return n - (1 if strategy == "default" else 0)


@dataclass
class Llava(Family):
    """LLaVA (see the module text): ``image_tokens`` per image, ``image_size`` pixels square
    (the defaults fit :meth:`tiny_model`'s defaults; :meth:`from_config` reads a config's, and
    its ``image_token_index``, which the tokenizer's ``<image>`` must be)."""

    image_tokens: int = 16
    image_size: int = 32
    image_token_id: int | None = field(default=None, repr=False)  # from a config; checked against the tokenizer

    name: ClassVar[str] = "llava"
    model_types: ClassVar[tuple[str, ...]] = ("llava",)
    image_block: ClassVar[tuple[str, ...]] = (IMAGE,)
    placeholder: ClassVar[str] = IMAGE
    chat_template: ClassVar[str | None] = LLAVA_TEMPLATE
    processor_wanted: ClassVar[str] = (
        "(a CLIP-style processor with a square crop_size): the llava family takes CLIPImageProcessorPil "
        "(Family.image_processor()), the qwen2_vl and qwen2_5_vl families Qwen2VLImageProcessorPil"
    )
    model_class: ClassVar[str] = "LlavaForConditionalGeneration"

    @classmethod
    def from_config(cls, config: Any) -> Llava:
        return cls(
            image_tokens=llava_image_tokens(config),
            image_size=int(config.vision_config.image_size),
            image_token_id=int(config.image_token_id),
        )

    def _default_tokenizer(self) -> Any:
        return llava_tokenizer()

    def check(self, tokenizer: Any, processor: ImageProcessor) -> None:
        """The base checks, and the tokenizer's ``<image>`` at the config's ``image_token_index``."""
        super().check(tokenizer, processor)
        got = int(tokenizer.convert_tokens_to_ids(IMAGE))
        if self.image_token_id is not None and got != self.image_token_id:
            raise UnsupportedModelError(
                f"{type(tokenizer).__name__} has {IMAGE} at id {got}, the model's config at image_token_index "
                f"{self.image_token_id}: use the tokenizer saved with the model"
            )

    def _default_image_processor(self) -> Any:
        return _image_processor(self.image_size)

    def takes_processor(self, processor: ImageProcessor) -> bool:
        return _crop_side(processor) is not None

    def encode_images(self, images: list[Any], processor: ImageProcessor) -> EncodedImages:
        if images:
            pv = np.ascontiguousarray(processor(images=images, return_tensors="np")["pixel_values"], dtype=np.float32)
        else:
            size = _crop_side(processor) or self.image_size
            pv = np.zeros((0, 3, size, size), np.float32)
        n = pv.shape[0]
        return EncodedImages(pv, np.full(n, self.image_tokens, np.int64))

    # ------------------------------------------------------------- the model
    def _tiny_model(self, vocab_size: int, ids: dict[str, int], build: dict[str, Any], sizes: dict[str, Any]) -> Any:
        """A ``LlavaForConditionalGeneration`` of this family's image size and image tokens
        (``(image_size / patch)**2`` with ``patch = image_size / sqrt(image_tokens)``).
        ``sizes`` as :func:`tiny_llava`'s."""
        side = int(round(self.image_tokens**0.5))
        if side * side != self.image_tokens or self.image_size % side:
            raise ValueError(
                f"tiny_model: {self.image_tokens} image tokens on {self.image_size} px images: need a square "
                "number of tokens whose side divides the image size"
            )
        return tiny_llava(
            vocab_size,
            image_token_id=ids["image_token_id"],
            image_size=self.image_size,
            patch_size=self.image_size // side,
            **build,
            **sizes,
        )

    def packed_hidden(
        self, model: VisionLanguageModel, batch: PackedBatch, *, pad_between_seqs: bool = True
    ) -> torch.Tensor:
        """``(T, H)`` hidden states of a packed LLaVA row.

        The vision tower and projector run once over all the row's images (one image per
        batch entry, so images never see each other); their features, image after image,
        replace the embeddings at the row's image slots; the language model runs on those
        embeddings with the 1-D positions and the boundaries (sftpack's training attention:
        ``cu_seq_lens_q`` padded, and with ``pad_between_seqs`` the real ones as
        ``sftpack_cu_seqlens_real``). With any other attention only the embeddings and the
        positions go in, and Hugging Face finds the boundaries from the position restarts.
        """
        b = batch
        embeds = model.get_input_embeddings()(b.input_ids)
        media = b.media
        if isinstance(media, ImageMedia) and media.num_items:
            feats = model.model.get_image_features(pixel_values=media.pixel_values.to(embeds.dtype)).pooler_output
            flat = torch.cat(list(feats)).to(embeds.dtype)
            idx = torch.cat([torch.arange(s, s + n, device=b.device) for s, n in media.slots.tolist()])
            if flat.shape[0] != idx.shape[0]:
                raise PackedBatchError(
                    f"the vision tower gives {flat.shape[0]} features for the row's {idx.shape[0]} image slots: "
                    "build the samples with family_for(model.config), which takes llava_image_tokens(config) "
                    "tokens per image"
                )
            embeds = embeds.index_put((idx,), flat)
        inputs = {"inputs_embeds": embeds.unsqueeze(0), "position_ids": b.position_ids.unsqueeze(0)}
        return model.model(**text_kwargs(model, b, inputs, pad_between_seqs=pad_between_seqs)).last_hidden_state[0]

    def _alone_media(self, model: VisionLanguageModel, input_ids: torch.Tensor, media: ImageMedia) -> dict[str, Any]:
        """``model(input_ids, pixel_values)``: its vision tower, its own feature scatter, its own positions."""
        return {"pixel_values": media.pixel_values.to(model.dtype)}

    def part_of(self, parameter: str) -> str:
        if ".vision_tower." in parameter:
            return "vision"
        return "projector" if ".multi_modal_projector." in parameter else "language"


def tiny_llava(
    vocab_size: int,
    *,
    image_token_id: int,
    dim: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vision_dim: int = 16,
    vision_layers: int = 2,
    vision_heads: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    text_attention: str | None = None,
    vision_attention: str = "sdpa",
) -> Any:
    """A randomly initialised ``LlavaForConditionalGeneration`` (seeded, nothing downloaded):
    a CLIP vision tower (``image_size`` px, ``patch_size`` patches, features from its
    second-to-last layer, class token dropped) and a Llama language model.

    ``text_attention``: the language model's attention (default sftpack's training
    attention; ``"sdpa"`` makes Hugging Face find the boundaries from the restarts of the
    position row). ``dtype=torch.float64`` also makes the RMSNorms compute in float64
    (Llama's upcast them to float32 otherwise).
    """
    hf = _optional.transformers()
    cfg = hf.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=vision_dim,
            intermediate_size=2 * vision_dim,
            num_hidden_layers=vision_layers,
            num_attention_heads=vision_heads,
            image_size=image_size,
            patch_size=patch_size,
            num_channels=3,
            projection_dim=vision_dim,
            attention_dropout=0.0,
        ),
        text_config=dict(
            model_type="llama",
            **small_text_config(vocab_size, dim=dim, layers=layers, heads=heads, kv_heads=kv_heads),
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
        image_token_index=image_token_id,
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    return seeded_model(
        hf.LlavaForConditionalGeneration,
        cfg,
        seed=seed,
        dtype=dtype,
        text_attention=text_attention,
        vision_attention=vision_attention,
    )
