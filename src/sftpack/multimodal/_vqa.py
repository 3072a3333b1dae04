"""The embedded multimodal default: easy-vqa's images and questions as multi-turn conversations.

``easy-vqa`` (MIT) ships 64x64 PNGs of coloured shapes with questions and one-word
answers (train: 4,000 images, 38,575 questions; test: 1,000 / 9,673). Each
conversation holds one image and 1 to ``max_turns`` of its questions; a seeded share
``two_image_share`` of them take the next image too, introduced in a later turn with
its own questions. Every image gets a seeded size (each side drawn uniformly from
``[min_side, max_side]`` px) through the part's ``"resize"`` key, so vision runs
differ in length as in real data. Same arguments, same conversations, always.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _optional

__all__ = ["vqa_corpus"]


def _easy_vqa() -> Any:
    return _optional._need("easy_vqa", "multimodal", "the easy-vqa corpus")


def _question(q: str) -> str:
    q = q.strip()
    return q[0].upper() + q[1:] if q else q


def vqa_corpus(
    *,
    split: str = "train",
    seed: int = 0,
    limit: int | None = None,
    max_turns: int = 3,
    two_image_share: float = 0.25,
    min_side: int = 56,
    max_side: int = 448,
) -> Iterator[dict]:
    """Conversations ``{"id": "easy-vqa:<split>:<image id>", "messages": [...]}`` in image-id order.

    Args:
        split: ``"train"`` or ``"test"``.
        seed: drives the turns per conversation, the two-image choice and the sizes.
        limit: yield at most this many conversations.
        max_turns: questions per image, 1 to this many (as the image has).
        two_image_share: probability that a conversation also takes the next image.
        min_side, max_side: bounds of each side of the resized images, in pixels.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 1 <= min_side <= max_side:
        raise ValueError(f"need 1 <= min_side <= max_side, got {min_side}, {max_side}")
    ev = _easy_vqa()
    texts, answers, image_ids = ev.get_train_questions() if split == "train" else ev.get_test_questions()
    paths = ev.get_train_image_paths() if split == "train" else ev.get_test_image_paths()
    by_image: dict[int, list[tuple[str, str]]] = {}
    for q, a, i in zip(texts, answers, image_ids):
        by_image.setdefault(int(i), []).append((q, a))
    order = sorted(i for i in by_image if i in paths)
    rng = np.random.default_rng(seed)
    k, made = 0, 0
    while k < len(order) and (limit is None or made < limit):
        take = [order[k]]
        if k + 1 < len(order) and rng.random() < two_image_share:
            take.append(order[k + 1])
        messages: list[dict] = []
        for j, img in enumerate(take):
            qa = by_image[img]
            turns = int(rng.integers(1, min(max_turns, len(qa)) + 1))
            picks = rng.choice(len(qa), size=turns, replace=False)
            w, h = (int(x) for x in rng.integers(min_side, max_side + 1, size=2))
            for t, p in enumerate(picks.tolist()):
                q, a = qa[p]
                content: list[dict] = []
                if t == 0:
                    content.append({"type": "image", "path": paths[img], "resize": [w, h]})
                    if len(take) > 1:
                        content.append({"type": "text", "text": f"Image {j + 1}. "})
                content.append({"type": "text", "text": _question(q)})
                messages.append({"role": "user", "content": content})
                messages.append({"role": "assistant", "content": [{"type": "text", "text": a.capitalize() + "."}]})
        yield {"id": f"easy-vqa:{split}:{'+'.join(map(str, take))}", "messages": messages}
        made += 1
        k += len(take)
