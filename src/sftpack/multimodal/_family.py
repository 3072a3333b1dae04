"""The seam a vision-language model family implements: :class:`Family`, and :func:`family_for`.

Everything that differs between VLM families sits behind this one class, in two sides:
its data side (:class:`FamilyData`: rendering, placeholders, media encoding, positions;
what tokenizing and packing take) and its model side (:class:`FamilyModel`: building the
model, its vision outputs, the packed forward; what training and checking take). The
tokenizer, the row builder, the paths, the loop, the CLI and the report call its methods,
typed by the side they use, and know no family. A family says:

- (the data side) how a conversation is written: by the chat template (the tokenizer's, as a model
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
- (the model side) how its model runs a packed row and one sample alone (:meth:`Family.packed_hidden`, the
  language model's hidden states of the row, which :meth:`Family.packed_logits` and the
  training loop's loss put the head over; :meth:`Family.alone_logits`: what the vision
  tower needs), a tiny model built from a config (:meth:`Family.tiny_model`), and which
  parameters are its vision part.

The families live in :mod:`sftpack.multimodal.families`, one module each, named in
:data:`FAMILIES` and imported only when asked for: no path or loop imports them (an
import-linter contract). :func:`family_for` takes a family name, a Hugging Face
``model_type``, a config, a model or a model folder, and refuses anything else in one
line naming it and the supported families; :func:`family_names` lists the registry's names
(every command's ``--family`` choices).
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from .. import _optional
from ._family_data import MEDIA_KINDS, EncodedImages, FamilyData, ImageProcessor, PatchProcessor, UnsupportedModelError
from ._family_model import FamilyModel, VisionLanguageModel, seeded_model, text_kwargs

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "MEDIA_KINDS",
    "EncodedImages",
    "Family",
    "FamilyData",
    "FamilyModel",
    "ImageProcessor",
    "PatchProcessor",
    "UnsupportedModelError",
    "VisionLanguageModel",
    "family_for",
    "family_names",
    "seeded_model",
    "text_kwargs",
]


#: family name -> "module:class" (imported on first use); each family's model_types map here too.
FAMILIES: dict[str, str] = {
    "qwen2_vl": "sftpack.multimodal.families.qwen2_vl:Qwen2VL",
    "qwen2_5_vl": "sftpack.multimodal.families.qwen2_5_vl:Qwen25VL",
    "llava": "sftpack.multimodal.families.llava:Llava",
    "gemma3": "sftpack.multimodal.families.gemma3:Gemma3",
    "qwen3_vl": "sftpack.multimodal.families.qwen3_vl:Qwen3VL",
}

#: The family of a run that names none (no ``--family``, no model folder): Qwen2-VL.
DEFAULT_FAMILY = "qwen2_vl"


class Family(FamilyData, FamilyModel):
    """One vision-language model family (subclass per family; see the module text): its data
    side (:class:`FamilyData`) and its model side (:class:`FamilyModel`). A caller that needs
    one side takes that side's type.

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


def family_names() -> tuple[str, ...]:
    """The names of the families sftpack packs, in the registry's order (:data:`FAMILIES`): what
    every command's ``--family`` takes, and what :func:`family_for` takes besides model types.

    >>> family_names()
    ('qwen2_vl', 'qwen2_5_vl', 'llava', 'gemma3', 'qwen3_vl')
    """
    return tuple(FAMILIES)


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
        return _load(DEFAULT_FAMILY)()
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
