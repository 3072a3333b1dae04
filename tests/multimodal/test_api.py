"""The public face of sftpack.multimodal, pinned (the lead adds it to tests/test_public_api.py's API)."""

from __future__ import annotations

import sftpack.multimodal as mm

API = [
    "IMAGE_PAD",
    "QWEN2VL_SPECIALS",
    "VISION_END",
    "VISION_START",
    "BadImageError",
    "BadImageReason",
    "ImagePatches",
    "MultimodalBatch",
    "MultimodalSample",
    "MultimodalStats",
    "PackedCheck",
    "alone_logits",
    "build_multimodal_row",
    "check_packed",
    "image_processor",
    "load_image",
    "packed_logits",
    "plan_rows",
    "process_images",
    "qwen2vl_tokenizer",
    "rope_index",
    "tiny_qwen2vl",
    "tokenize_multimodal",
    "tokenize_multimodal_conversations",
    "vqa_corpus",
]


def test_all_is_pinned():
    assert sorted(mm.__all__) == sorted(API) and len(set(mm.__all__)) == len(API)
    for name in API:
        assert getattr(mm, name) is not None
