"""Multimodal SFT packing: conversations with images, for a vision-language model family.

A sample with images is a :class:`~sftpack.Sample` whose ``media`` is one payload
(:mod:`sftpack.handoff.payload`: the pixels, each image's placeholder run and, for
models with their own positions, the multimodal positions); the row builder
(:meth:`sftpack.PackedBatch.from_samples`) lays it with the tokens, and the row's
``media`` does the rest (validation, concatenation, devices, ``to_hf_kwargs``).

The pieces, in pipeline order:

* :class:`Family` / :func:`family_for`: the one seam a model family implements (its image
  block and placeholder counts, image processor, media and position rule, what its
  vision tower needs, a tiny model from a config). Qwen2-VL (the default), Qwen2.5-VL,
  Qwen3-VL, LLaVA-1.5 and Gemma 3 are the families (``sftpack.multimodal.families``, one module each); anything
  else is refused in one line by :class:`UnsupportedModelError`.
* :func:`load_image`: an image content part (path, bytes or PIL image; never a URL) to a
  PIL image; bad images raise :class:`BadImageError` naming the record and field
  (:class:`BadImageReason` when counted).
* Files: the one conversation reader, :func:`sftpack.chat.read_conversations`, reads
  conversations with image parts from JSONL, Parquet or saved Hugging Face datasets (image
  paths relative to the file; image bytes; an ``images`` column; bad rows counted or named).
* :func:`tokenize_media_conversation` / :func:`tokenize_media_conversations`: conversations in
  the Hugging Face multimodal chat format to samples with media (counted in
  :class:`MediaTokenizeStats`). Over-long samples split at text boundaries only; special-token
  text in a content stays text (as on the text path).
* :func:`plan_rows`: which samples share a row, under a token and a patch budget
  (:class:`PatchBudgetError` for a sample no row can hold).
* Video parts (Qwen-VL families): :class:`VideoSampling` (how frames are taken from a file,
  PyAV decoding) and :class:`EncodedVideos` (a conversation's videos as patches).
* :func:`check_packed` / :class:`PackedCheck`: the exactness harness (packed equals alone,
  through the family's own model).
* :func:`cp_hidden` / :func:`cp_vision_outputs`: a context-parallel rank's share of a packed
  row with media (:func:`sftpack.handoff.shard_for_cp`) through a Qwen-VL model.
* :func:`vqa_corpus`: the easy-vqa conversations (the embedded multimodal default).

The three paths build on these; see docs/multimodal.md. The parts they take besides, importable
from here too (never from the private modules: a contract in ``pyproject.toml``) and out of
``__all__``:

* the registry: ``family_names`` (every command's ``--family`` choices) and ``DEFAULT_FAMILY``
  (the family of a run that names none);
* per record and per sample: ``tokenize_record`` (one record to its samples or its drop reason),
  ``split_sample`` (the over-long policy), ``check_patch_budget`` and its drop reason
  ``OVER_PATCH_BUDGET``, ``EncodedImages`` (a conversation's images, encoded);
* the stored pixels of a prepack: ``processor_settings`` / ``processor_from_settings`` (the
  image processor as plain values and back), ``reproduces`` (whether the fast road is the
  processor's own output), ``pixel_table``, ``PixelRecorder``, ``stored_items``,
  ``image_values``, ``patchify_pixels``, ``patchify_frames``;
* ``compare_packed_alone``: the packed-equals-alone comparison of :func:`check_packed`.
"""

from __future__ import annotations

from ._cp import cp_hidden, cp_vision_outputs
from ._exactness import PackedCheck, check_packed
from ._exactness import compare_packed_alone as compare_packed_alone
from ._family import DEFAULT_FAMILY as DEFAULT_FAMILY
from ._family import EncodedImages as EncodedImages
from ._family import Family, UnsupportedModelError, family_for
from ._family import family_names as family_names
from ._images import BadImageError, BadImageReason, load_image
from ._images import patchify_pixels as patchify_pixels
from ._images import pixel_table as pixel_table
from ._images import processor_from_settings as processor_from_settings
from ._images import processor_settings as processor_settings
from ._images import reproduces as reproduces
from ._plan import OVER_PATCH_BUDGET as OVER_PATCH_BUDGET
from ._plan import PatchBudgetError, plan_rows
from ._plan import check_patch_budget as check_patch_budget
from ._stored import PixelRecorder as PixelRecorder
from ._stored import image_values as image_values
from ._stored import stored_items as stored_items
from ._tokenize import MediaTokenizeStats, tokenize_media_conversation, tokenize_media_conversations
from ._tokenize import split_sample as split_sample
from ._tokenize import tokenize_record as tokenize_record
from ._video import EncodedVideos, VideoSampling
from ._video import patchify_frames as patchify_frames
from ._vqa import vqa_corpus

__all__ = [
    "BadImageError",
    "BadImageReason",
    "EncodedVideos",
    "Family",
    "MediaTokenizeStats",
    "PackedCheck",
    "PatchBudgetError",
    "UnsupportedModelError",
    "VideoSampling",
    "check_packed",
    "cp_hidden",
    "cp_vision_outputs",
    "family_for",
    "load_image",
    "plan_rows",
    "tokenize_media_conversation",
    "tokenize_media_conversations",
    "vqa_corpus",
]
