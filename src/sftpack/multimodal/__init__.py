"""Multimodal SFT packing: conversations with images, Qwen2-VL (and LLaVA).

The pieces, in pipeline order:

* :func:`load_image` / :func:`image_processor`: an image content part (path, bytes
  or PIL image; never a URL) to Qwen2-VL patches, through transformers'
  PIL/numpy ``Qwen2VLImageProcessorPil`` (no torchvision). Bad images raise
  :class:`BadImageError` naming the record and field, or are counted.
* :func:`read_multimodal` / :func:`read_multimodal_jsonl`: conversations from JSONL,
  Parquet or saved Hugging Face datasets (image paths relative to the file; image bytes;
  an ``images`` column; bad rows counted or named by file, line or row and field).
* :func:`tokenize_multimodal`: one conversation in the Hugging Face multimodal
  chat format to :class:`MultimodalSample` (a :class:`~sftpack.Sample` with
  ``pixel_values``, ``image_grid_thw`` and each image's placeholder run), with
  :func:`qwen2vl_tokenizer` (the embedded Qwen BPE plus Qwen2-VL's special
  tokens). Over-long samples split at text boundaries only; special-token text in a
  content stays text (as on the text path). A tokenizer, processor or config of another
  model family raises :class:`UnsupportedModelError` (one line) before any work.
* :func:`rope_index`: Qwen2-VL's MRoPE positions of one sample alone.
* :func:`plan_rows`: which samples share a row, under a token and a patch budget.
* :func:`build_multimodal_row`: samples to a :class:`~sftpack.PackedBatch` with its media
  fields set (media in row order, per-sample MRoPE positions); a ``MultimodalBatch``,
  its subclass with no fields of its own.
* :func:`tiny_qwen2vl`, :func:`packed_logits`, :func:`alone_logits`,
  :func:`check_packed`: the exactness harness (packed equals alone).
* :func:`vqa_corpus`: the easy-vqa conversations (the embedded multimodal default).
* A second model family, LLaVA (:func:`tokenize_llava`, :func:`build_llava_row`,
  :func:`tiny_llava`, :func:`check_llava_packed`): fixed image-token runs replaced by
  projected features, 1-D positions; see docs/multimodal_llava.md.

The three paths build on these (``sftpack.trainer.pack_media_step``,
``sftpack.loader.MultimodalPackingDataset``, ``sftpack.offline.prepack_multimodal``);
see docs/multimodal.md.
"""

from __future__ import annotations

from ._exactness import PackedCheck, check_packed
from ._images import (
    MAX_ASPECT_RATIO,
    MAX_IMAGE_BYTES,
    BadImageError,
    BadImageReason,
    ImagePatches,
    image_processor,
    is_url,
    load_image,
    process_images,
    reproduces,
)
from ._llava import (
    LlavaCheck,
    LlavaRow,
    LlavaSample,
    build_llava_row,
    check_llava_packed,
    llava_alone_logits,
    llava_image_processor,
    llava_image_tokens,
    llava_packed_logits,
    tiny_llava,
    tokenize_llava,
)
from ._model import alone_logits, packed_logits, tiny_qwen2vl
from ._plan import plan_rows
from ._read import MultimodalReadStats, read_multimodal, read_multimodal_jsonl
from ._row import MultimodalBatch, build_multimodal_row
from ._sample import (
    IMAGE_PAD,
    QWEN2VL_SPECIALS,
    VISION_END,
    VISION_START,
    MultimodalSample,
    MultimodalStats,
    UnsupportedModelError,
    qwen2vl_tokenizer,
    rope_index,
    tokenize_multimodal,
    tokenize_multimodal_conversations,
)
from ._vqa import vqa_corpus

__all__ = [
    "IMAGE_PAD",
    "QWEN2VL_SPECIALS",
    "VISION_END",
    "VISION_START",
    "MAX_ASPECT_RATIO",
    "MAX_IMAGE_BYTES",
    "BadImageError",
    "BadImageReason",
    "ImagePatches",
    "LlavaCheck",
    "LlavaRow",
    "LlavaSample",
    "MultimodalBatch",
    "MultimodalReadStats",
    "MultimodalSample",
    "MultimodalStats",
    "PackedCheck",
    "UnsupportedModelError",
    "alone_logits",
    "build_llava_row",
    "build_multimodal_row",
    "check_llava_packed",
    "check_packed",
    "image_processor",
    "is_url",
    "llava_alone_logits",
    "llava_image_processor",
    "llava_image_tokens",
    "llava_packed_logits",
    "load_image",
    "packed_logits",
    "plan_rows",
    "process_images",
    "qwen2vl_tokenizer",
    "read_multimodal",
    "read_multimodal_jsonl",
    "reproduces",
    "rope_index",
    "tiny_llava",
    "tiny_qwen2vl",
    "tokenize_llava",
    "tokenize_multimodal",
    "tokenize_multimodal_conversations",
    "vqa_corpus",
]
