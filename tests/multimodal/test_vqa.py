"""The easy-vqa corpus: real images and questions, multi-turn, some with two images, seeded sizes."""

from __future__ import annotations

import json

import pytest

from sftpack.multimodal import load_image, vqa_corpus


def test_same_seed_same_conversations_other_seed_other_sizes():
    a = list(vqa_corpus(seed=7, limit=40))
    assert json.dumps(a) == json.dumps(list(vqa_corpus(seed=7, limit=40)))
    b = list(vqa_corpus(seed=8, limit=40))
    assert json.dumps(a) != json.dumps(b)


def test_conversations_are_multi_turn_some_with_two_images_and_varied_sizes():
    convs = list(vqa_corpus(seed=0, limit=200, min_side=56, max_side=448))
    assert len(convs) == 200
    images, sizes, turns = [], set(), []
    for c in convs:
        roles = [m["role"] for m in c["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        parts = [p for m in c["messages"] for p in m["content"] if p["type"] == "image"]
        images.append(len(parts))
        turns.append(len(roles) // 2)
        for p in parts:
            w, h = p["resize"]
            assert 56 <= w <= 448 and 56 <= h <= 448
            sizes.add((w, h))
        for m in c["messages"]:
            if m["role"] == "assistant":
                assert m["content"][0]["text"].endswith(".")
    assert set(images) == {1, 2} and 0.1 < images.count(2) / len(images) < 0.4  # two_image_share=0.25
    assert max(turns) > 1 and len(sizes) > 150
    ids = [i for c in convs for i in c["id"].split(":")[-1].split("+")]
    assert ids == [str(i) for i in range(len(ids))]  # every image once, in order


def test_images_load_at_their_seeded_size():
    (c,) = vqa_corpus(split="test", seed=1, limit=1, min_side=60, max_side=61)
    part = c["messages"][0]["content"][0]
    img = load_image(part)
    assert img.size == tuple(part["resize"]) and img.mode == "RGB"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="split"):
        next(vqa_corpus(split="dev"))
    with pytest.raises(ValueError, match="min_side"):
        next(vqa_corpus(min_side=100, max_side=50))
