"""The data side of a vision-language model family: :class:`FamilyData`.

What tokenizing and packing a conversation with media takes of a family, and nothing of its
model: how a conversation is written (the chat template, :meth:`FamilyData.renderer`; the image
and video blocks and their placeholders), how its media are encoded (:meth:`FamilyData.encode_images`,
:meth:`FamilyData.encode_videos`, by the image processor :meth:`FamilyData.image_processor`),
its media payload and position rule (:meth:`FamilyData.media`), what its tokenizer and image
processor must be (:meth:`FamilyData.check`) and the settings a prepack keeps
(:meth:`FamilyData.media_settings`). The offline and loader paths take a family through this
side; the model side is :class:`~sftpack.multimodal._family_model.FamilyModel`, and
:class:`~sftpack.multimodal.Family` is both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import torch

from .. import _optional
from ..chat import ChatRenderer, chat_template_of, fast_backend, renderer_for
from ..data import CHATML_TEMPLATE, chatml_template
from ..handoff.payload import ImageMedia, Media
from ._images import pixel_table

_F = TypeVar("_F", bound="FamilyData")

__all__ = ["MEDIA_KINDS", "EncodedImages", "FamilyData", "ImageProcessor", "PatchProcessor", "UnsupportedModelError"]

#: What a family writes for a media part: image or video.
MEDIA_KINDS = ("image", "video")


class ImageProcessor(Protocol):
    """What sftpack takes of an image processor: a Hugging Face one (transformers'
    ``BaseImageProcessor``, the PIL/numpy backend), whose inputs it names. Which one a family
    takes is its :meth:`FamilyData.takes_processor`; what it reads of it beyond this (sizes,
    mean and std) the family's own encoding reads."""

    model_input_names: list[str]

    def __call__(self, images: Any, **kwargs: Any) -> Any: ...


class PatchProcessor(ImageProcessor, Protocol):
    """A patch family's image processor (Qwen-VL's ``Qwen2VLImageProcessorPil``): its patch sizes
    (what :meth:`FamilyData.takes_processor` of a patch family checks)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int


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


class FamilyData:
    """The data side of one vision-language model family (see the module text, and
    :class:`~sftpack.multimodal.Family` for how a conversation with media becomes tokens)."""

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
    #: how a prepack stores this family's media items, the name its manifest writes as
    #: ``media.kind`` (and a reader checks against the family the manifest names): by default
    #: each fixed-size image's resized uint8 pixels, its values remade through the processor's
    #: table; a patch family names the format of its patch processor's pixels
    stored_format: ClassVar[str] = "resized-uint8-hwc-table"

    # ------------------------------------------------------------ building
    @classmethod
    def from_config(cls: type[_F], config: Any) -> _F:
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
    def from_media_settings(cls: type[_F], settings: dict[str, Any]) -> _F:
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

    def image_processor(self, model_dir: str | os.PathLike | None = None) -> ImageProcessor:
        """The image processor: the one in ``model_dir`` (the PIL/numpy one, ``backend="pil"``), else the family's default."""
        if model_dir is None:
            return self._default_image_processor()
        return _optional.from_pretrained("AutoImageProcessor", model_dir, backend="pil")

    def _default_tokenizer(self) -> Any:  # pragma: no cover - per family
        raise NotImplementedError

    def _default_image_processor(self) -> ImageProcessor:  # pragma: no cover - per family
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

    def renderer(self, tokenizer: Any) -> ChatRenderer:
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

    def check(self, tokenizer: Any, processor: ImageProcessor) -> None:
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

    def takes_processor(self, processor: ImageProcessor) -> bool:
        """Whether ``processor`` is an image processor of this family (:attr:`processor_wanted`)."""
        return True

    # ------------------------------------------------------ stored media
    def check_stored(self, processor: ImageProcessor) -> None:
        """Raise ``ValueError`` unless a prepack can store the media ``processor`` makes as
        :attr:`stored_format` and remake their values bit for bit: by default the processor must
        rescale and normalise (its values are a table of each uint8 value, :func:`pixel_table`)."""
        pixel_table(processor)

    def stored_processor(self, processor: ImageProcessor, merge_size: int | None = None) -> dict[str, Any]:
        """What a prepack's manifest keeps beside the stored pixels to remake the values
        ``processor`` gives (its ``media`` entry's ``merge_size``, ``processor`` and the rest):
        by default the processor's rescale factor, mean and std and its value table
        (``pixel_table``); ``merge_size`` (the staged media's) is a patch family's."""
        proc: Any = processor
        return {
            "merge_size": 1,
            "processor": {
                "class": type(proc).__name__,
                "rescale_factor": float(proc.rescale_factor),
                "image_mean": [float(x) for x in proc.image_mean],
                "image_std": [float(x) for x in proc.image_std],
            },
            "pixel_table": pixel_table(processor).tolist(),
        }

    def stored_processors(self, entry: dict[str, Any]) -> tuple[ImageProcessor, ImageProcessor] | None:
        """The image and video processors that remake the values of a prepack's stored pixels from
        its manifest's ``media`` ``entry`` (what :meth:`stored_processor` wrote); ``None``: the
        values are remade through the entry's ``pixel_table`` (the default).

        Raises:
            ValueError: the installed processor remakes them otherwise (one line: the fix)."""
        return None

    def placeholder_id(self, tokenizer: Any) -> int:
        return int(tokenizer.convert_tokens_to_ids(self.placeholder))

    def encode_images(self, images: list[Any], processor: ImageProcessor) -> EncodedImages:  # pragma: no cover
        """Pixels and placeholder counts of one conversation's images (PIL, in order)."""
        raise NotImplementedError

    def video_processor(self, processor: ImageProcessor) -> ImageProcessor:
        """The processor whose rescale and normalisation make this family's video frames' values
        (a model folder's video settings may normalise otherwise than its image processor; a
        prepack stores frames and remakes their values by it): by default ``processor``."""
        return processor

    def encode_videos(
        self, videos: list[dict], processor: ImageProcessor, *, record: Any = None, fields: list[str] | None = None
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


@lru_cache(maxsize=64)
def _probe(renderer: ChatRenderer, marks: tuple[tuple[str, str], ...]) -> str:
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
