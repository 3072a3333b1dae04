"""The seam a vision-language model family implements: :class:`Family`, and :func:`family_for`.

Everything that differs between VLM families sits behind this one class; the
tokenizer, the row builder, the paths, the loop, the CLI and the report call its
methods and know no family. A family says:

- how a conversation is written: by the chat template (the tokenizer's, as a model
  folder ships it, or the family's default, :meth:`Family.default_chat_template`), which
  writes each image part as the family's mark (:attr:`Family.image_mark`), which may be
  rewritten (:meth:`Family.media_text`) into the image block (:attr:`Family.image_block`:
  the control tokens around the placeholder); video parts likewise
  (:attr:`Family.video_block`, :attr:`Family.video_placeholder`);
- how many placeholder tokens each image takes (:meth:`Family.encode_images`, which also
  makes its pixels with the image processor: the one in the user's model folder when
  given, :meth:`Family.image_processor`), and each video (:meth:`Family.encode_videos`);
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
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
import torch

from .. import _optional
from ..attention import TRAIN_ATTENTION, register_train_attention
from ..chat import chat_template_of, fast_backend, renderer_for
from ..data import CHATML_TEMPLATE, chatml_template
from ..exactness import mark_exact, norms_in_model_dtype
from ..handoff.payload import ImageMedia, Media

__all__ = ["FAMILIES", "EncodedImages", "Family", "UnsupportedModelError", "family_for"]

#: family name -> "module:class" (imported on first use); each family's model_types map here too.
FAMILIES: dict[str, str] = {
    "qwen2_vl": "sftpack.multimodal.families.qwen2_vl:Qwen2VL",
    "qwen2_5_vl": "sftpack.multimodal.families.qwen2_5_vl:Qwen25VL",
    "llava": "sftpack.multimodal.families.llava:Llava",
    "gemma3": "sftpack.multimodal.families.gemma3:Gemma3",
    "qwen3_vl": "sftpack.multimodal.families.qwen3_vl:Qwen3VL",
}

#: What a family writes for a media part: image or video.
MEDIA_KINDS = ("image", "video")


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
    """One vision-language model family (subclass per family; see the module text).

    How a conversation with media becomes tokens (:func:`~sftpack.multimodal.tokenize_media_conversation`):

    1. the chat template (:meth:`renderer`) renders the messages, contents as lists of parts
       (``{"type": "text", "text": ...}``, ``{"type": "image"}``, ``{"type": "video"}``), and
       writes each media part as a special token of the tokenizer: an image part as
       :attr:`image_mark` (default: :attr:`placeholder`), a video part as
       :attr:`video_placeholder`; the trainable spans are the text path's
       (:class:`~sftpack.chat.ChatRenderer`: assistant content and its end-of-turn token);
    2. the media are encoded in order, per kind: :meth:`encode_images` (PIL images) and, for a
       family with a :attr:`video_block`, :meth:`encode_videos` (the video parts themselves,
       e.g. ``{"type": "video", "frames": [...]}``, paths absolute or relative to the working
       directory), each an :class:`EncodedImages` whose ``tokens`` holds one count per
       placeholder it needs;
    3. each mark is replaced by :meth:`media_text` of its part (``None``: it stays, the
       template wrote the whole block), whose special tokens are control tokens and the rest
       plain text; every placeholder (:attr:`placeholder`, :attr:`video_placeholder`) is then
       repeated its ``tokens`` count, placeholders of each kind taking the counts in order;
    4. :meth:`media` makes the sample's payload (the image runs, and for videos ``videos``
       and ``video_runs``).

    A family without video (:attr:`video_block` empty) refuses a video part in one line
    naming the family.
    """

    #: the family's name (a key of :data:`FAMILIES`)
    name: ClassVar[str] = ""
    #: the Hugging Face ``model_type`` values of its configs
    model_types: ClassVar[tuple[str, ...]] = ()
    #: what each image part becomes in the text: control tokens around exactly one placeholder
    image_block: ClassVar[tuple[str, ...]] = ("<|image_pad|>",)
    #: the placeholder token (one of :attr:`image_block`)
    placeholder: ClassVar[str] = "<|image_pad|>"
    #: the special token the chat template writes once per image part (``None``: :attr:`placeholder`)
    image_mark: ClassVar[str | None] = None
    #: what each video part becomes in the text (empty: the family takes no video)
    video_block: ClassVar[tuple[str, ...]] = ()
    #: the video placeholder token (one of :attr:`video_block`)
    video_placeholder: ClassVar[str] = ""
    #: the family's default chat template (``None``: ChatML writing the image and video blocks,
    #: :func:`sftpack.data.chatml_template`); a tokenizer's own template wins (:meth:`renderer`)
    chat_template: ClassVar[str | None] = None
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

    def media_settings(self) -> dict[str, Any]:
        """This family's configuration as plain JSON values: its instance attributes that are
        numbers or strings, or tuples of them (a config's image token count, Qwen2.5-VL's
        ``tokens_per_second``, Qwen3-VL's sizes). A prepack's manifest keeps them, and
        :meth:`from_media_settings` rebuilds the family its rows were written for."""
        plain = (bool, int, float, str)
        out: dict[str, Any] = {}
        for k, v in sorted(vars(self).items()):
            if isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(x, plain) for x in v)):
                out[k] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_media_settings(cls, settings: dict[str, Any]) -> Family:
        """The family configured as :meth:`media_settings` says (the class defaults for the rest).

        Raises:
            ValueError: a setting the family does not have."""
        family = cls()
        have = vars(family)
        for k, v in settings.items():
            if k not in have:
                raise ValueError(f"the {cls.name} family has no setting {k!r} (it has {sorted(have)})")
            setattr(family, k, tuple(v) if isinstance(have[k], tuple) else v)
        return family

    def tokenizer(self, model_dir: str | os.PathLike | None = None) -> Any:
        """The tokenizer to use: the one in ``model_dir``, else the embedded default. A folder
        whose tokenizer has no chat template but whose processor has one (``chat_template.json``,
        as LLaVA-1.5 folders ship it) gets the processor's, as ``AutoProcessor`` would use."""
        if model_dir is None:
            return self._default_tokenizer()
        tok = _optional.from_pretrained("AutoTokenizer", model_dir)
        path = os.path.join(os.fspath(model_dir), "chat_template.json")
        if not getattr(tok, "chat_template", None) and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
            if isinstance(template, str) and template:
                tok.chat_template = template
        return tok

    def image_processor(self, model_dir: str | os.PathLike | None = None) -> Any:
        """The image processor: the one in ``model_dir`` (the PIL/numpy one, ``backend="pil"``), else the family's default."""
        if model_dir is None:
            return self._default_image_processor()
        return _optional.from_pretrained("AutoImageProcessor", model_dir, backend="pil")

    def pretrained(
        self, model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32, vision_attention: str = "sdpa"
    ) -> Any:
        """The family's model in the local folder ``model_dir`` (``save_pretrained``; never
        downloads), as :func:`seeded_model` prepares a tiny one: the language model on sftpack's
        training attention, the vision tower on ``vision_attention``, in training mode and ``dtype``."""

        name = register_train_attention()
        try:
            model = _optional.from_pretrained(
                self.model_class,
                model_dir,
                local_files_only=True,
                dtype=dtype,
                attn_implementation={"": name, "text_config": name, "vision_config": vision_attention},
            )
        except _optional.CustomCodeError:
            raise
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
    def marks(self) -> dict[str, str]:
        """The special token the chat template writes for each media kind the family takes."""
        out = {"image": self.image_mark or self.placeholder}
        if self.video_block:
            out["video"] = self.video_placeholder
        return out

    def default_chat_template(self) -> str:
        """The family's chat template when the tokenizer brings none of its own
        (:attr:`chat_template`, else ChatML writing the image and video blocks)."""

        if self.chat_template is not None:
            return self.chat_template
        return chatml_template("".join(self.image_block), "".join(self.video_block))

    def chat_template_for(self, tokenizer: Any) -> str:
        """The chat template conversations with media are rendered with (:meth:`renderer`): the
        tokenizer's own (a model folder's), or :meth:`default_chat_template` when it has none or
        only sftpack's text ChatML (:data:`sftpack.data.CHATML_TEMPLATE`, which cannot write an
        image). A trained model is saved with it (``sftpack train --save-model``), so that its
        folder's ``apply_chat_template`` writes image parts as the run did."""

        own = chat_template_of(tokenizer)
        return own if own is not None and own != CHATML_TEMPLATE else self.default_chat_template()

    def renderer(self, tokenizer: Any) -> Any:
        """The :class:`~sftpack.chat.ChatRenderer` of a conversation with media, over
        :meth:`chat_template_for` the tokenizer.

        Raises:
            UnsupportedModelError: the template does not write one image mark (:meth:`marks`) for an
                image part (a template that writes no video is found at the first video part).
        """

        renderer = renderer_for(tokenizer, self.chat_template_for(tokenizer))
        bad = _probe(renderer, (("image", self.marks()["image"]),))  # video: counted per record
        if bad:
            raise UnsupportedModelError(
                f"the chat template of {type(tokenizer).__name__} {bad}: give {self.name}'s own tokenizer "
                f"(Family.tokenizer(model_dir)) or set tokenizer.chat_template to one that writes its media parts"
            )
        return renderer

    def media_text(self, kind: str, index: int, encoded: EncodedImages) -> str | None:
        """What replaces the template's mark of the ``index``-th ``kind`` part (its encoding is
        ``encoded``, all parts of that kind): ``None`` keeps the mark (the template wrote the whole
        block). A family whose processor rewrites the template's mark (Gemma 3) returns the block
        with its text around it; special-token strings in it are control tokens."""
        return None

    def check(self, tokenizer: Any, processor: Any) -> None:
        """Raise :class:`UnsupportedModelError` unless ``processor`` is one of this family's image
        processors (:meth:`takes_processor`), ``tokenizer`` holds every token of the family's
        image (and video) block as a special token, and its chat template writes the family's
        media parts (:meth:`renderer`)."""
        if not self.takes_processor(processor):
            raise UnsupportedModelError(
                f"{type(processor).__name__} is not a {self.name} image processor {self.processor_wanted}"
            )
        backend = fast_backend(tokenizer)
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        wanted = dict.fromkeys((*self.image_block, *self.marks().values(), *self.video_block))
        missing = [t for t in wanted if backend.token_to_id(t) is None or t not in specials]
        if missing:
            raise UnsupportedModelError(
                f"{type(tokenizer).__name__} lacks the special tokens {missing} of {self.name}'s media blocks: "
                f"use {self.name}'s own tokenizer (Family.tokenizer(model_dir))"
            )
        self.renderer(tokenizer)

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

    def video_processor(self, processor: Any) -> Any:
        """The processor whose rescale and normalisation make this family's video frames' values
        (a model folder's video settings may normalise otherwise than its image processor; a
        prepack stores frames and remakes their values by it): by default ``processor``."""
        return processor

    def encode_videos(
        self, videos: list[dict], processor: Any, *, record: Any = None, fields: list[str] | None = None
    ) -> EncodedImages:
        """Pixels and placeholder counts of one conversation's video parts (the part dicts, in
        order; ``record`` and each part's ``fields`` for errors), for a family with a
        :attr:`video_block`; ``tokens`` holds one count per video placeholder the parts' text
        has (one per part unless :meth:`media_text` writes more)."""
        raise UnsupportedModelError(f"the {self.name} family encodes no video")

    def media(
        self,
        input_ids: np.ndarray,
        runs: np.ndarray,
        images: EncodedImages,
        token_id: int,
        *,
        videos: EncodedImages | None = None,
        video_runs: np.ndarray | None = None,
    ) -> Media:
        """The media payload of one sample (a :attr:`media_class`): its images (``runs[i]`` =
        image ``i``'s placeholder run ``(start, length)`` in ``input_ids``, all in sequence 0)
        and what the family adds (:meth:`_media_fields`: its grid and position rule). A sample
        with videos passes them (``videos``, their runs ``video_runs``) on to
        ``_media_fields(input_ids, runs, images, videos=..., video_runs=...)``, which a family
        with video takes."""
        extra = {} if videos is None else {"videos": videos, "video_runs": video_runs}
        return self.media_class(
            pixel_values=torch.from_numpy(images.pixel_values),
            slots=torch.from_numpy(runs),
            sequence=torch.zeros(len(runs), dtype=torch.int64),
            token_id=token_id,
            **self._media_fields(input_ids, runs, images, **extra),
        )

    def _media_fields(
        self, input_ids: np.ndarray, runs: np.ndarray, images: EncodedImages, **videos: Any
    ) -> dict[str, Any]:
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

    def padded_kwargs(self, input_ids: torch.Tensor, media: Any) -> dict[str, Any]:
        """What the model's own forward takes beyond the media's ``hf_kwargs`` for right-padded
        rows ``input_ids`` ``(B, S)`` (Gemma 3: ``token_type_ids``, which make each image's soft
        tokens bidirectional); by default nothing."""
        return {}

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

    name = text_attention or register_train_attention()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class._from_config(
            config, attn_implementation={"": name, "text_config": name, "vision_config": vision_attention}
        )
    return mark_exact(_prepared(model, dtype, norm_classes))  # a family's tiny model: proven exact by the suite


def _prepared(model: Any, dtype: torch.dtype, norm_classes: tuple[str, ...] | None) -> Any:
    """``model`` in training mode and ``dtype``; in float64 its ``norm_classes`` (default
    Llama's) compute in float64 too."""
    model = model.to(dtype).train()
    if dtype != torch.float64:
        return model
    return norms_in_model_dtype(model, norm_classes) if norm_classes else norms_in_model_dtype(model)


@lru_cache(maxsize=64)
def _probe(renderer: Any, marks: tuple[tuple[str, str], ...]) -> str:
    """What is wrong with ``renderer``'s template for these media ``marks`` (kind, token), or ``""``:
    one conversation with one part of each kind must render with each mark exactly once."""
    parts: list[dict] = [{"type": kind} for kind, _ in marks]
    messages = [
        {"role": "user", "content": [*parts, {"type": "text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
    ]
    try:
        text = renderer.render(messages)
    except Exception as e:  # noqa: BLE001 - TemplateError, or a template that only takes string contents
        return f"cannot render a message with media parts ({' '.join(str(e).split())[:120]})"
    for kind, token in marks:
        n = text.count(token)
        if n != 1:
            return f"writes {token!r} {n} times for one {kind} part, not once"
    return ""


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
    ``model_type`` (``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"llava"``, ``"gemma3"``...), a config or a model (its
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
            f"{what} is not a vision-language family sftpack packs; supported: {_supported()} (Idefics3, "
            "SmolVLM, Mistral3, InternVL and LLaVA-NeXT / -OneVision are not)"
        )
    cls = _load(name)
    if folder:  # the folder's own config (local files only), so a family sized by it is sized right
        config = _optional.from_pretrained("AutoConfig", spec, local_files_only=True)
    return cls.from_config(config) if config is not None else cls()
