"""The seam a vision-language model family implements: :class:`Family`, and :func:`family_for`.

Everything that differs between VLM families sits behind this one class; the
tokenizer, the row builder, the paths, the loop, the CLI and the report call its
methods and know no family. A family says:

- how an image part is written into the text (:attr:`Family.image_block`: the control
  tokens around the placeholder) and how many placeholder tokens each image takes
  (:meth:`Family.encode_images`, which also makes its pixels with the image processor:
  the one in the user's model folder when given, :meth:`Family.image_processor`);
- its media payload and position rule (:meth:`Family.media`: a
  :class:`~sftpack.handoff.payload.PatchMedia` with MRoPE positions, or an
  :class:`~sftpack.handoff.payload.ImageMedia` with the text's 1-D ones);
- what its tokenizer must hold and which image processors it takes (:meth:`Family.check`)
  and which tokenizer to use by default (:meth:`Family.tokenizer`);
- how its model runs a packed row and one sample alone (:meth:`Family.packed_hidden`, the
  language model's hidden states of the row, which :meth:`Family.packed_logits` and the
  training loop's loss put the head over; :meth:`Family.alone_logits`: what the vision
  tower needs), a tiny model built from a config (:meth:`Family.tiny_model`), and which
  parameters are its vision part.

The families live in :mod:`sftpack.multimodal.families`, one module each, named in
:data:`FAMILIES` and imported only when asked for: no path or loop imports them (an
import-linter contract). :func:`family_for` takes a family name, a Hugging Face
``model_type``, a config, a model or a model folder, and refuses anything else in one
line naming it and the supported families.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from .. import _optional
from ..chat._tokenize import _backend
from ..exactness import norms_in_model_dtype
from ..handoff.payload import ImageMedia, Media

__all__ = ["FAMILIES", "EncodedImages", "Family", "UnsupportedModelError", "family_for"]

#: family name -> "module:class" (imported on first use); each family's model_types map here too.
FAMILIES: dict[str, str] = {
    "qwen2_vl": "sftpack.multimodal.families.qwen2_vl:Qwen2VL",
    "qwen2_5_vl": "sftpack.multimodal.families.qwen2_5_vl:Qwen25VL",
    "llava": "sftpack.multimodal.families.llava:Llava",
}

#: The ChatML control tokens every family's renderer writes.
CHATML = ("<|im_start|>", "<|im_end|>")


class UnsupportedModelError(TypeError):
    """A tokenizer, image processor, model or config of a family sftpack does not pack. One line
    naming it and what is supported, raised before any record is read: the setup is wrong, not
    a record, so ``on_bad_row="skip"`` never turns it into a count."""


@dataclass
class EncodedImages:
    """One conversation's images, encoded by a family: ``pixel_values`` of every image in order
    (patches, or one tensor per image), the placeholder ``tokens`` each takes, and (patch families) each ``grid_thw`` and the tower's ``merge_size``.
    :meth:`Family.media` makes the sample's payload of them (a split sample's pieces then take
    :meth:`~sftpack.handoff.payload.Media.piece` of it)."""

    pixel_values: np.ndarray
    tokens: np.ndarray
    grid_thw: np.ndarray | None = None
    merge_size: int = 1


class Family:
    """One vision-language model family (subclass per family; see the module text)."""

    #: the family's name (a key of :data:`FAMILIES`)
    name: ClassVar[str] = ""
    #: the Hugging Face ``model_type`` values of its configs
    model_types: ClassVar[tuple[str, ...]] = ()
    #: what each image part becomes in the text: control tokens around exactly one placeholder
    image_block: ClassVar[tuple[str, ...]] = ("<|image_pad|>",)
    #: the placeholder token (one of :attr:`image_block`)
    placeholder: ClassVar[str] = "<|image_pad|>"
    #: what :meth:`takes_processor` asks of an image processor, and which one each family
    #: takes: the end of :meth:`check`'s error, ``(what it asks): the fix``
    processor_wanted: ClassVar[str] = ""
    #: the class of the family's media payload (:meth:`media`): by default one pixel tensor per image
    media_class: ClassVar[type[Media]] = ImageMedia
    #: the Hugging Face class of its models (a name in ``transformers``)
    model_class: ClassVar[str] = ""
    #: its RMSNorm classes, computed in float64 in a float64 model (``None``: Llama's)
    norm_classes: ClassVar[tuple[str, ...] | None] = None

    # ------------------------------------------------------------ building
    @classmethod
    def from_config(cls, config: Any) -> Family:
        """The family configured for ``config`` (a Hugging Face config of one of its
        :attr:`model_types`); the default takes nothing from it."""
        return cls()

    def tokenizer(self, model_dir: str | os.PathLike | None = None) -> Any:
        """The tokenizer to use: the one in ``model_dir``, else the embedded default."""
        if model_dir is None:
            return self._default_tokenizer()
        return _optional.transformers().AutoTokenizer.from_pretrained(os.fspath(model_dir))

    def image_processor(self, model_dir: str | os.PathLike | None = None) -> Any:
        """The image processor: the one in ``model_dir`` (the slow, PIL/numpy one), else the family's default."""
        if model_dir is None:
            return self._default_image_processor()
        return _optional.transformers().AutoImageProcessor.from_pretrained(os.fspath(model_dir), use_fast=False)

    def pretrained(
        self, model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32, vision_attention: str = "sdpa"
    ) -> Any:
        """The family's model in the local folder ``model_dir`` (``save_pretrained``; never
        downloads), as :func:`seeded_model` prepares a tiny one: the language model on sftpack's
        training attention, the vision tower on ``vision_attention``, in training mode and ``dtype``."""
        from .._train_attention import register_train_attention

        name = register_train_attention()
        model_class = getattr(_optional.transformers(), self.model_class)
        try:
            model = model_class.from_pretrained(
                os.fspath(model_dir),
                local_files_only=True,
                dtype=dtype,
                attn_implementation={"": name, "text_config": name, "vision_config": vision_attention},
            )
        except (OSError, ValueError) as e:
            raise ValueError(
                f"cannot load a {self.model_class} from {os.fspath(model_dir)!r} ({' '.join(str(e).split())[:200]}); "
                "give a local folder written by model.save_pretrained()"
            ) from None
        return _prepared(model, dtype, self.norm_classes)

    def _default_tokenizer(self) -> Any:  # pragma: no cover - per family
        raise NotImplementedError

    def _default_image_processor(self) -> Any:  # pragma: no cover - per family
        raise NotImplementedError

    # ---------------------------------------------------------- tokenizing
    def check(self, tokenizer: Any, processor: Any) -> None:
        """Raise :class:`UnsupportedModelError` unless ``processor`` is one of this family's image
        processors (:meth:`takes_processor`) and ``tokenizer`` holds every token the renderer
        writes for this family."""
        if not self.takes_processor(processor):
            raise UnsupportedModelError(
                f"{type(processor).__name__} is not a {self.name} image processor {self.processor_wanted}"
            )
        backend = _backend(tokenizer)
        missing = [t for t in (*CHATML, *self.image_block) if backend.token_to_id(t) is None]
        if missing:
            raise UnsupportedModelError(
                f"{type(tokenizer).__name__} lacks the tokens {missing} of {self.name}'s ChatML and image block: "
                f"use {self.name}'s own tokenizer (Family.tokenizer(model_dir))"
            )

    def takes_processor(self, processor: Any) -> bool:
        """Whether ``processor`` is an image processor of this family (:attr:`processor_wanted`)."""
        return True

    def placeholder_id(self, tokenizer: Any) -> int:
        return int(tokenizer.convert_tokens_to_ids(self.placeholder))

    def token_ids(self, tokenizer: Any) -> dict[str, int]:
        """The token ids a model config of this family names, by config key (the placeholder's;
        a family with more control tokens adds them)."""
        return {"image_token_id": self.placeholder_id(tokenizer)}

    def encode_images(self, images: list[Any], processor: Any) -> EncodedImages:  # pragma: no cover
        """Pixels and placeholder counts of one conversation's images (PIL, in order)."""
        raise NotImplementedError

    def media(self, input_ids: np.ndarray, runs: np.ndarray, images: EncodedImages, token_id: int) -> Media:
        """The media payload of one sample (a :attr:`media_class`): its images (``runs[i]`` =
        image ``i``'s placeholder run ``(start, length)`` in ``input_ids``, all in sequence 0)
        and what the family adds (:meth:`_media_fields`: its grid and position rule)."""
        return self.media_class(
            pixel_values=torch.from_numpy(images.pixel_values),
            slots=torch.from_numpy(runs),
            sequence=torch.zeros(len(runs), dtype=torch.int64),
            token_id=token_id,
            **self._media_fields(input_ids, runs, images),
        )

    def _media_fields(self, input_ids: np.ndarray, runs: np.ndarray, images: EncodedImages) -> dict[str, Any]:
        """The fields of :attr:`media_class` beyond the base :class:`~sftpack.handoff.payload.Media`'s."""
        return {}

    # ------------------------------------------------------------- the model
    def tiny_model(
        self,
        tokenizer: Any = None,
        *,
        vocab_size: int | None = None,
        token_ids: dict[str, int] | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        text_attention: str | None = None,
        **sizes: Any,
    ) -> Any:
        """A small randomly initialised model of this family built from a config (seeded, nothing
        downloaded), for tests, the demo and CPU training.

        ``vocab_size`` (default the tokenizer's) and ``token_ids`` (default the tokenizer's, see
        :meth:`token_ids`; a renumbered vocabulary passes its own) size and name its vocabulary;
        the tokenizer defaults to :meth:`tokenizer`. ``dtype=torch.float64`` also makes the
        RMSNorms compute in float64. ``text_attention``: the language model's attention (default
        sftpack's training attention; ``"sdpa"`` makes Hugging Face find the boundaries from the
        restarts of the position row). ``sizes``: the family's own (:meth:`_tiny_model`).
        """
        if token_ids is None or vocab_size is None:
            tokenizer = tokenizer if tokenizer is not None else self.tokenizer()
        ids = token_ids if token_ids is not None else self.token_ids(tokenizer)
        vocab = int(vocab_size) if vocab_size is not None else len(tokenizer)
        build = {"seed": seed, "dtype": dtype, "text_attention": text_attention}
        return self._tiny_model(vocab, ids, build, sizes)

    def _tiny_model(self, vocab_size: int, ids: dict[str, int], build: dict[str, Any], sizes: dict[str, Any]) -> Any:
        """:meth:`tiny_model` over ``vocab_size`` ids, its config naming the token ``ids``;
        ``build``: ``seed``, ``dtype`` and ``text_attention`` (:func:`seeded_model`'s)."""
        raise NotImplementedError  # pragma: no cover - per family

    def vision_outputs(self, model: Any, media: Any) -> Any:  # pragma: no cover - per family
        """The vision tower over a row's media, in the form the model takes precomputed
        (``mm_encoder_outputs``), for a family whose tower runs apart from the language model."""
        raise NotImplementedError(f"the {self.name} family does not run its vision tower apart from its model")

    def packed_hidden(self, model: Any, batch: Any, *, pad_between_seqs: bool = True) -> Any:  # pragma: no cover
        """``(T, H)`` hidden states of the language model over a packed row
        (:class:`~sftpack.PackedBatch` with media), before the output head."""
        raise NotImplementedError

    def packed_logits(self, model: Any, batch: Any, *, pad_between_seqs: bool = True) -> Any:
        """``(T, V)`` logits of a packed row: the model's output head over :meth:`packed_hidden`."""
        return model.get_output_embeddings()(self.packed_hidden(model, batch, pad_between_seqs=pad_between_seqs))

    def alone_logits(self, model: Any, sample: Any) -> Any:
        """``(L, V)`` logits of one sample run alone, the model's own way: ``model(input_ids,
        ...)`` with what its vision tower takes of the sample's images (:meth:`_alone_media`)."""
        ids = torch.from_numpy(sample.input_ids).unsqueeze(0)
        kw: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        media = sample.media
        if media is not None and media.num_items:
            kw.update(self._alone_media(model, ids, media))
        return model(**kw).logits[0]

    def _alone_media(self, model: Any, input_ids: torch.Tensor, media: Any) -> dict[str, Any]:  # pragma: no cover
        """The keyword arguments of a sample's images for the model's own forward (``input_ids`` ``(1, L)``)."""
        raise NotImplementedError

    def part_of(self, parameter: str) -> str:
        """Which part of the model a parameter belongs to (the exactness report groups by it)."""
        return "language"


def text_kwargs(model: Any, batch: Any, inputs: dict[str, Any], *, pad_between_seqs: bool) -> dict[str, Any]:
    """The language model's keyword arguments for a packed row: ``inputs`` (its ids or
    embeddings and its positions), no cache and, under sftpack's training attention, the row's
    boundaries (``cu_seq_lens_q/k`` padded, ``max_length_q/k``, and with ``pad_between_seqs``
    the real ones as ``sftpack_cu_seqlens_real``). Any other attention gets nothing more:
    Hugging Face finds the boundaries where the text position row restarts."""
    from .._train_attention import TRAIN_ATTENTION

    kw: dict[str, Any] = {**inputs, "use_cache": False}
    if model.config.get_text_config()._attn_implementation == TRAIN_ATTENTION:
        kw.update(
            cu_seq_lens_q=batch.cu_seqlens_padded,
            cu_seq_lens_k=batch.cu_seqlens_padded,
            max_length_q=int(batch.max_seqlen),
            max_length_k=int(batch.max_seqlen),
        )
        if pad_between_seqs:
            kw["sftpack_cu_seqlens_real"] = batch.cu_seqlens
    return kw


def seeded_model(
    model_class: Any,
    config: Any,
    *,
    seed: int,
    dtype: torch.dtype,
    text_attention: str | None = None,
    vision_attention: str = "sdpa",
    norm_classes: tuple[str, ...] | None = None,
) -> Any:
    """``model_class`` built from ``config`` with seeded random weights (the global RNG left as
    it was), in training mode and ``dtype``: the language model on ``text_attention`` (default
    sftpack's training attention), the vision tower on ``vision_attention``; in float64 its
    ``norm_classes`` (default Llama's) compute in float64 too."""
    from .._train_attention import register_train_attention

    name = text_attention or register_train_attention()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class._from_config(
            config, attn_implementation={"": name, "text_config": name, "vision_config": vision_attention}
        )
    return _prepared(model, dtype, norm_classes)


def _prepared(model: Any, dtype: torch.dtype, norm_classes: tuple[str, ...] | None) -> Any:
    """``model`` in training mode and ``dtype``; in float64 its ``norm_classes`` (default
    Llama's) compute in float64 too."""
    model = model.to(dtype).train()
    if dtype != torch.float64:
        return model
    return norms_in_model_dtype(model, norm_classes) if norm_classes else norms_in_model_dtype(model)


def _load(name: str) -> type[Family]:
    mod, _, cls = FAMILIES[name].partition(":")
    family: type[Family] = getattr(importlib.import_module(mod), cls)
    return family


def _by_model_type() -> dict[str, str]:
    out = {}
    for name in FAMILIES:
        out[name] = name
        for t in _load(name).model_types:
            out[t] = name
    return out


def _supported() -> str:
    return ", ".join(f"{n} (model_type {'/'.join(_load(n).model_types)})" for n in FAMILIES)


def family_for(spec: Any = None) -> Family:
    """The family of ``spec``: a :class:`Family` (returned as is), a family name or Hugging Face
    ``model_type`` (``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"llava"``), a config or a model (its
    ``model_type``; the family configured from it), or a model folder (its ``config.json``).
    ``None``: Qwen2-VL, the default.

    Raises:
        UnsupportedModelError: anything else, in one line naming it and the supported families.

    >>> family_for("qwen2_vl").name, family_for("llava").name
    ('qwen2_vl', 'llava')
    """
    if isinstance(spec, Family):
        return spec
    if spec is None:
        return _load("qwen2_vl")()
    config = getattr(spec, "config", spec)
    folder = isinstance(spec, (str, os.PathLike)) and os.path.isdir(spec)
    if folder:
        path = os.path.join(spec, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                kind = json.load(f).get("model_type")
        except (OSError, ValueError) as e:
            raise UnsupportedModelError(
                f"{path}: cannot read the model's config ({e}); supported: {_supported()}"
            ) from None
        config = None
    elif isinstance(spec, str):
        kind, config = spec, None
    else:
        kind = getattr(config, "model_type", None)
    name = _by_model_type().get(kind) if isinstance(kind, str) else None
    if name is None:
        what = f"model type {kind!r}" + (f" ({type(config).__name__})" if config is not None else "")
        raise UnsupportedModelError(
            f"{what} is not a vision-language family sftpack packs; supported: {_supported()} (Gemma 3, "
            "Idefics3, SmolVLM, Mistral3, InternVL and LLaVA-NeXT / -OneVision are not)"
        )
    cls = _load(name)
    if folder:  # the folder's own config (local files only), so a family sized by it is sized right
        config = _optional.transformers().AutoConfig.from_pretrained(os.fspath(spec), local_files_only=True)
    return cls.from_config(config) if config is not None else cls()
