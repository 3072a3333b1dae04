"""A multimodal conversation to samples: Qwen2-VL's tokens, placeholder runs, patches, loss mask, bad images."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sftpack import Sample
from sftpack.handoff.payload import PatchMedia
from sftpack.multimodal import (
    BadImageError,
    MediaTokenizeStats,
    load_image,
    tokenize_media_conversation,
    tokenize_media_conversations,
)
from sftpack.multimodal.families.qwen2_vl import IMAGE_PAD, QWEN2VL_SPECIALS
from sftpack.sample import OverlongError
from tests.helpers import png_bytes


def _conv(*images: dict, answer: str = "A red square.") -> list[dict]:
    return [
        {"role": "user", "content": [*images, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": answer},
    ]


def test_special_tokens_sit_at_qwen2_vls_ids(tok):
    from transformers import Qwen2VLConfig

    cfg = Qwen2VLConfig()
    ids = dict(zip(QWEN2VL_SPECIALS, tok.convert_tokens_to_ids(list(QWEN2VL_SPECIALS))))
    assert ids[IMAGE_PAD] == cfg.image_token_id == 151655
    assert ids["<|vision_start|>"] == cfg.vision_start_token_id and ids["<|vision_end|>"] == cfg.vision_end_token_id
    assert ids["<|video_pad|>"] == cfg.video_token_id and len(tok) == 151657


def test_placeholders_expand_as_the_processor_does(tok, proc):
    """Qwen2VLProcessor replaces each <|image_pad|> in the text by grid.prod() // merge**2 copies and
    tokenizes the result (it cannot be built here without torchvision); the same on our side."""
    parts = [
        {"type": "image", "bytes": png_bytes(100, 60)},
        {"type": "image", "bytes": png_bytes(30, 200, (0, 0, 255))},
    ]
    (s,) = tokenize_media_conversation(_conv(*parts), tokenizer=tok, processor=proc, conversation_id="c")
    assert isinstance(s, Sample) and isinstance(s.media, PatchMedia)
    grids = s.media.grid_thw.tolist()
    n = [t * h * w // 4 for t, h, w in grids]
    assert [r[1] for r in s.media.slots.tolist()] == n
    # the processor's own count rule, from the (resized) image sizes
    assert n[0] == proc.get_number_of_image_patches(60, 100, {}) // 4
    text = (
        "<|im_start|>user\n<|vision_start|>"
        + IMAGE_PAD * n[0]
        + "<|vision_end|><|vision_start|>"
        + IMAGE_PAD * n[1]
        + "<|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\nA red square.<|im_end|>\n"
    )
    assert s.input_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    # patches: the processor's output for these images, concatenated in order
    imgs = [load_image(p) for p in parts]
    ref = proc(images=imgs, return_tensors="np")
    np.testing.assert_array_equal(s.media.pixel_values.numpy(), ref["pixel_values"])
    np.testing.assert_array_equal(s.media.grid_thw.numpy(), ref["image_grid_thw"])
    assert tuple(s.media.pixel_values.shape) == (sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14)
    assert s.num_patches == s.media.num_patches == s.media.pixel_values.shape[0]


def test_loss_mask_is_the_assistants_answers_only(tok, vqa_samples):
    """Trained: each assistant answer and its <|im_end|>; never a header, a question or an image."""
    from sftpack.multimodal import vqa_corpus

    convs = list(vqa_corpus(seed=2, limit=6, min_side=56, max_side=112))  # the conversations of vqa_samples
    for conv, s in zip(convs, vqa_samples):
        answers = [m["content"][0]["text"] for m in conv["messages"] if m["role"] == "assistant"]
        assert tok.decode(s.input_ids[s.loss_mask]) == "".join(a + "<|im_end|>" for a in answers)
        assert not bool(s.loss_mask[s.input_ids == s.media.token_id].any())


def test_resize_gives_images_their_own_sizes(tok, proc):
    part = {"type": "image", "bytes": png_bytes(64, 64), "resize": [112, 56]}
    (s,) = tokenize_media_conversation(_conv(part), tokenizer=tok, processor=proc)
    assert s.media.grid_thw.tolist() == [[1, 4, 8]]  # 56 / 14 rows, 112 / 14 columns


@pytest.mark.parametrize(
    "part, reason, field",
    [
        ({"type": "image", "path": "/nonexistent/x.png"}, "image_missing_file", "messages[0].content[0].path"),
        ({"type": "image", "bytes": b"not an image"}, "image_undecodable", "messages[0].content[0].bytes"),
        ({"type": "image", "bytes": b""}, "image_zero_size", "messages[0].content[0].bytes"),
        ({"type": "image", "url": "https://example.com/a.png"}, "image_url", "messages[0].content[0].url"),
        ({"type": "image"}, "image_no_source", "messages[0].content[0]"),
    ],
)
def test_a_bad_image_is_an_error_naming_record_and_field_or_a_count(tok, proc, part, reason, field):
    good = {"id": "good", "messages": _conv({"type": "image", "bytes": png_bytes(56, 56)})}
    bad = {"id": "bad-7", "messages": _conv(part)}
    with pytest.raises(BadImageError) as e:
        list(tokenize_media_conversations([good, bad], tokenizer=tok, processor=proc))
    assert "'bad-7'" in str(e.value) and field in str(e.value) and e.value.reason.value == reason
    st = MediaTokenizeStats()
    out = list(tokenize_media_conversations([good, bad], tokenizer=tok, processor=proc, on_bad_row="skip", stats=st))
    assert [s.conversation_id for s in out] == ["good"]
    assert (st.read, st.kept, st.dropped) == (2, 1, {reason: 1}) and st.read == st.kept + sum(st.dropped.values())


def test_a_malformed_record_names_its_field(tok, proc):
    with pytest.raises(ValueError, match=r"'r1', messages\[1\]\.role"):
        tokenize_media_conversation(
            [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}],
            conversation_id="r1",
            tokenizer=tok,
            processor=proc,
        )


def test_overlong_splits_only_at_text_boundaries(tok, proc):
    parts = [{"type": "image", "bytes": png_bytes(112, 112)}, {"type": "text", "text": "one two three " * 8}]
    msgs = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": "four five six " * 8},
        {
            "role": "user",
            "content": [{"type": "image", "bytes": png_bytes(84, 84, (9, 9, 9))}, {"type": "text", "text": "And?"}],
        },
        {"role": "assistant", "content": "seven."},
    ]
    (whole,) = tokenize_media_conversation(msgs, tokenizer=tok, processor=proc, conversation_id="w")
    vs, ve = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    for max_len in (24, 30, 41):
        pieces = tokenize_media_conversation(
            msgs, tokenizer=tok, processor=proc, conversation_id="w", max_seq_len=max_len
        )
        assert len(pieces) > 1 and all(len(p) <= max_len for p in pieces)
        assert np.concatenate([p.input_ids for p in pieces]).tolist() == whole.input_ids.tolist()
        assert np.concatenate([p.loss_mask for p in pieces]).tolist() == whole.loss_mask.tolist()
        assert sum(p.media.num_items for p in pieces) == 2
        np.testing.assert_array_equal(
            np.concatenate([p.media.pixel_values for p in pieces]), whole.media.pixel_values.numpy()
        )
        for p in pieces:  # every image block whole inside its piece
            ids = p.input_ids.tolist()
            assert ids.count(vs) == ids.count(ve) == p.media.num_items
            for s, n in p.media.slots.tolist():
                assert ids[s - 1] == vs and ids[s + n] == ve
    assert tokenize_media_conversation(msgs, tokenizer=tok, processor=proc, max_seq_len=24, overlong="drop") == []
    with pytest.raises(OverlongError, match="image block is longer"):
        tokenize_media_conversation(msgs, tokenizer=tok, processor=proc, max_seq_len=12)
    with pytest.raises(OverlongError, match="more than max_seq_len=24"):
        tokenize_media_conversation(msgs, tokenizer=tok, processor=proc, max_seq_len=24, overlong="error")
    with pytest.raises(ValueError, match="truncate"):
        tokenize_media_conversation(msgs, tokenizer=tok, processor=proc, max_seq_len=24, overlong="truncate")
    st = MediaTokenizeStats()
    convs = [{"id": "a", "messages": msgs}]
    assert (
        list(
            tokenize_media_conversations(
                convs, tokenizer=tok, processor=proc, max_seq_len=24, overlong="drop", stats=st
            )
        )
        == []
    )
    assert st.dropped == {"overlong": 1} and st.read == 1


def test_a_sample_refuses_runs_that_do_not_match_its_tokens(vqa_samples):
    s = vqa_samples[0]
    runs = s.media.slots.clone()
    runs[0, 1] -= 1
    with pytest.raises(ValueError, match=r"'x': media\.slots\[0\] has"):
        Sample(s.input_ids, s.loss_mask, "x", media=dataclasses.replace(s.media, slots=runs))
    with pytest.raises(ValueError, match="patches"):
        Sample(s.input_ids, s.loss_mask, "x", media=dataclasses.replace(s.media, pixel_values=s.media.pixel_values[1:]))


def test_ids_and_patches_equal_the_real_qwen2vl_processor(tok, proc, monkeypatch):
    """transformers' own Qwen2VLProcessor over the same text and images. Building it checks each
    part's class against the auto mappings, and the video one needs torchvision (not installable
    beside this torch): that check alone is switched off, the processor itself runs as shipped."""
    import transformers
    from transformers import processing_utils

    monkeypatch.setattr(processing_utils.ProcessorMixin, "check_argument_for_proper_class", lambda *a, **k: None)
    hf_proc = transformers.Qwen2VLProcessor(image_processor=proc, tokenizer=tok, video_processor=None)
    parts = [
        {"type": "image", "bytes": png_bytes(100, 60)},
        {"type": "image", "bytes": png_bytes(30, 200, (0, 0, 255))},
    ]
    (s,) = tokenize_media_conversation(_conv(*parts), tokenizer=tok, processor=proc)
    text = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
        "What is it?<|im_end|>\n<|im_start|>assistant\nA red square.<|im_end|>\n"
    )
    enc = hf_proc(text=[text], images=[load_image(p) for p in parts], return_tensors="np")
    assert enc["input_ids"][0].tolist() == s.input_ids.tolist()
    np.testing.assert_array_equal(enc["pixel_values"], s.media.pixel_values.numpy())
    np.testing.assert_array_equal(enc["image_grid_thw"], s.media.grid_thw.numpy())
    assert (enc["mm_token_type_ids"][0] == 1).tolist() == (s.input_ids == s.media.token_id).tolist()
