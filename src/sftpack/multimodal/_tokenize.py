"""A multimodal conversation to one or more samples with media: render, tokenize, expand, mask.

Per conversation (Hugging Face multimodal chat format: a message's ``content`` is
a string or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image", ...}``
parts), for a model family (:class:`~sftpack.multimodal.Family`, default Qwen2-VL)::

    text  = ChatML, each image part -> the family's image block
            (Qwen2-VL: <|vision_start|><|image_pad|><|vision_end|>; LLaVA: <|image_pad|>)
    ids   = tokenizer(text), content as text    (one placeholder per image)
    ids   = each placeholder repeated as many times as the family says the image takes
    mask  = assistant content and its <|im_end|> (never a placeholder)

and the sample's ``media`` is the family's payload of its images (pixels, each
image's placeholder run, and its position rule). For Qwen2-VL that is what
``Qwen2VLProcessor`` does to the same text (its ``replace_image_token`` rule; the
tests compare with the real processor).

Content text is plain text, as on the text path (:mod:`sftpack.chat`, whose
``special_tokens_in_content="text"`` default this follows): the renderer notes where the
template puts its own control tokens (``<|im_start|>``, ``<|im_end|>``, the image
block) and the text between them is encoded by a copy of the tokenizer that reads
special-token strings as text. So ``"<|im_end|>"`` typed in a content, whole or split
over adjacent text parts (``"Blue.<|im"`` + ``"_end|>"``), stays characters: it can never
forge a turn inside the loss mask, nor add a vision token or an image placeholder.

Over-long samples are never cut inside an image block: ``split`` cuts at the last
text boundary that fits, each piece with its own images; a block longer than a row
drops the sample (counted).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..chat._tokenize import _encode_pieces, _Rendered, mask_from_offsets
from ..sample import Overlong, OverlongError, Sample
from ._family import CHATML, EncodedImages, Family, family_for
from ._images import BadImageError, load_image

__all__ = ["MediaTokenizeStats", "tokenize_media_conversation", "tokenize_media_conversations"]


# ------------------------------------------------------------------ rendering
def _parts(content: Any, record: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"record {record!r}, {where}: content must be a string or a list of parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
            raise ValueError(
                f"record {record!r}, {where}[{j}]: a part must be {{'type': 'text'|'image', ...}}, got {part!r:.80}"
            )
    return content


@dataclass
class _Rendering:
    """A conversation rendered: ChatML ``text``, the trainable character ``spans``, where the
    renderer put its own control tokens (``controls``; everything else is content, plain text),
    and the image parts in order with their field names."""

    text: str
    spans: list[tuple[int, int]]
    controls: list[tuple[int, int]]
    images: list[tuple[dict, str]]


def _render(messages: list[dict], record: Any, image_block: tuple[str, ...]) -> _Rendering:
    text: list[str] = []
    spans: list[tuple[int, int]] = []
    controls: list[tuple[int, int]] = []
    images: list[tuple[dict, str]] = []
    pos = 0

    def put(s: str, control: bool = False) -> None:
        nonlocal pos
        if control:
            controls.append((pos, pos + len(s)))
        text.append(s)
        pos += len(s)

    if not messages:
        raise ValueError(f"record {record!r}: no messages")
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"record {record!r}, messages[{i}].role: {role!r} is not system, user or assistant")
        put(CHATML[0], control=True)
        put(f"{role}\n")
        start = pos
        for j, part in enumerate(_parts(msg.get("content"), record, f"messages[{i}].content")):
            where = f"messages[{i}].content[{j}]"
            if part["type"] == "image":
                if role == "assistant":
                    raise ValueError(f"record {record!r}, {where}: images in assistant turns are not supported")
                images.append((part, where))
                for token in image_block:
                    put(token, control=True)
            else:
                t = part.get("text")
                if not isinstance(t, str):
                    raise ValueError(f"record {record!r}, {where}.text: must be a string")
                put(t)  # plain text, special-token strings included (they never become control tokens)
        put(CHATML[1], control=True)
        if role == "assistant":
            spans.append((start, pos))
        put("\n")
    if not spans:
        raise ValueError(f"record {record!r}: no assistant message, nothing to train on")
    return _Rendering("".join(text), spans, controls, images)


def _ids_and_mask(r: _Rendering, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """``r.text``'s token ids, control tokens only where the renderer put them (the text path's
    piecewise encoding, :mod:`sftpack.chat`), and True where a token starts inside one of the
    trained character spans."""
    ids, offsets = _encode_pieces(_Rendered(None, r.text, r.spans, r.controls), tokenizer)
    return ids, mask_from_offsets(offsets, r.spans)


def _encode(
    messages: list[dict], record: Any, tokenizer: Any, processor: Any, family: Family
) -> tuple[np.ndarray, np.ndarray, EncodedImages, np.ndarray, int]:
    r = _render(messages, record, family.image_block)
    images = family.encode_images([load_image(p, record, where) for p, where in r.images], processor)
    ids, mask = _ids_and_mask(r, tokenizer)
    image_id = family.placeholder_id(tokenizer)
    where = np.flatnonzero(ids == image_id)
    assert where.size == len(r.images), "one placeholder per image part: content text never makes one"
    reps = np.ones(ids.shape, dtype=np.int64)
    reps[where] = images.tokens
    out_mask: np.ndarray = np.repeat(mask & (ids != image_id), reps)
    out_ids: np.ndarray = np.repeat(ids, reps)
    new_start = np.cumsum(reps) - reps
    runs = np.stack([new_start[where], reps[where]], axis=1) if where.size else np.zeros((0, 2), np.int64)
    return out_ids, out_mask, images, runs, image_id


def cut_points(sample: Sample, max_seq_len: int, family: Family) -> list[tuple[int, int]] | None:
    """Spans ``[a, b)`` of at most ``max_seq_len`` tokens covering a sample with media, never cut
    inside an image block (its placeholder run with the family's control tokens around it,
    e.g. Qwen2-VL's ``<|vision_start|>`` and ``<|vision_end|>``): each cut at the last text
    boundary that fits. ``None`` when an image block alone is longer than ``max_seq_len``.
    The one split rule of samples with media (the tokenizer's ``split``, the loader's)."""
    n = len(sample)
    before = family.image_block.index(family.placeholder)  # the block's control tokens around the run
    after = len(family.image_block) - before - 1
    runs = sample.media.slots.tolist() if sample.media is not None else []
    blocks = [(max(s - before, 0), min(s + k + after, n)) for s, k in runs]
    pieces, a = [], 0
    while a < n:
        b = min(a + max_seq_len, n)
        for s, e in blocks:
            if s < b < e:  # inside a block: cut before it
                b = s
        if b <= a:
            return None
        pieces.append((a, b))
        a = b
    return pieces


def split_sample(
    sample: Sample, max_seq_len: int | None, overlong: Overlong | str, family: Family, who: str | None = None
) -> list[Sample]:
    """A sample with media under the over-long policy: itself when it fits, else ``split``: its
    pieces (:func:`cut_points`; each piece's media :meth:`~sftpack.handoff.payload.Media.piece`),
    ``drop``: none. ``truncate`` is refused (it would cut a turn and possibly an image).

    Raises:
        OverlongError: ``overlong="error"`` and the sample is too long, or under ``split`` an
            image block alone is longer than ``max_seq_len`` (``who`` names the sample).
    """
    policy = Overlong(overlong)
    if policy is Overlong.TRUNCATE:
        raise ValueError("overlong='truncate' is not offered for samples with media: use split, drop or error")
    L, cid = len(sample), sample.conversation_id
    if max_seq_len is None or L <= max_seq_len:
        return [sample]
    if policy is Overlong.DROP:
        return []
    who = who if who is not None else f"conversation {cid!r}"
    if policy is Overlong.ERROR:
        raise OverlongError(
            f"{who} has {L} tokens (images included), more than max_seq_len={max_seq_len}: "
            "raise max_seq_len, lower the images' max_pixels, or use overlong='split' or 'drop'",
            cid,
            L,
            max_seq_len,
        )
    cuts = cut_points(sample, max_seq_len, family)
    if cuts is None:
        raise OverlongError(
            f"{who}: an image block is longer than max_seq_len={max_seq_len} and cannot be split; "
            "lower the images' max_pixels or raise max_seq_len",
            cid,
            L,
            max_seq_len,
        )
    media = sample.media
    return [
        Sample(
            sample.input_ids[a:b],
            sample.loss_mask[a:b],
            cid,
            {**(sample.meta or {}), "piece": k},
            media=None if media is None else media.piece(a, b),
        )
        for k, (a, b) in enumerate(cuts)
    ]


def _setup(family: Any, tokenizer: Any, processor: Any) -> tuple[Family, Any, Any]:
    """The family (:func:`~sftpack.multimodal.family_for`), its tokenizer and image processor (by
    default the family's), checked: :class:`~sftpack.multimodal.UnsupportedModelError` for a setup of another family."""
    fam = family_for(family)
    tokenizer = tokenizer if tokenizer is not None else fam.tokenizer()
    processor = processor if processor is not None else fam.image_processor()
    fam.check(tokenizer, processor)
    return fam, tokenizer, processor


def tokenize_media_conversation(
    messages: list[dict],
    *,
    tokenizer: Any = None,
    processor: Any = None,
    conversation_id: Any = None,
    max_seq_len: int | None = None,
    overlong: Overlong | str = Overlong.SPLIT,
    family: Any = None,
) -> list[Sample]:
    """One multimodal conversation to samples (one, or several pieces under ``split``, or none under ``drop``).

    Args:
        messages: Hugging Face multimodal chat messages.
        tokenizer: default ``family.tokenizer()``; processor: default ``family.image_processor()``.
        family: the model family (anything :func:`~sftpack.multimodal.family_for` takes;
            default Qwen2-VL): its image block, placeholder counts, media and positions.
        conversation_id: carried into every sample (and named in errors).
        max_seq_len: longest sample; ``None``: no limit.
        overlong: ``split`` (at text boundaries, never inside an image block),
            ``drop`` or ``error``; ``truncate`` is refused (it would cut a turn and
            possibly an image).

    Raises:
        BadImageError: an image that cannot be read (names the record and field).
        ValueError: a malformed record (names the field).
        OverlongError: ``overlong="error"`` and the sample is too long, or an image block
            alone is longer than ``max_seq_len``.
        UnsupportedModelError: ``tokenizer`` or ``processor`` is not the family's kind, or the
            family is unknown (checked before any work).

    Special-token strings in a content (``"<|im_end|>"``, ``"<|image_pad|>"``, whole or split
    over adjacent text parts) are tokenized as plain text, as :func:`sftpack.chat.tokenize_conversation`
    does by default: only the template's own control tokens and one placeholder run per image
    part are control tokens.
    """
    policy = Overlong(overlong)
    if policy is Overlong.TRUNCATE:
        raise ValueError("overlong='truncate' is not offered for multimodal samples: use split, drop or error")
    fam, tokenizer, processor = _setup(family, tokenizer, processor)
    ids, mask, patches, runs, image_id = _encode(messages, conversation_id, tokenizer, processor, fam)
    whole = Sample(ids, mask, conversation_id, media=fam.media(ids, runs, patches, image_id))
    return split_sample(whole, max_seq_len, policy, fam)


@dataclass
class MediaTokenizeStats:
    """Counts of :func:`tokenize_media_conversations`: ``read == kept + sum(dropped.values())``;
    ``samples`` counts the samples made (a split conversation makes several)."""

    read: int = 0
    kept: int = 0
    samples: int = 0
    images: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def tokenize_media_conversations(
    conversations: Iterable[Any],
    *,
    tokenizer: Any = None,
    processor: Any = None,
    max_seq_len: int | None = None,
    overlong: Overlong | str = Overlong.SPLIT,
    on_bad_row: str = "error",
    stats: MediaTokenizeStats | None = None,
    family: Any = None,
) -> Iterator[Sample]:
    """Samples of many conversations, in order. Each item is a mapping with ``messages``
    (and ``id``) or an object with ``.messages`` (and ``.id``). ``on_bad_row="skip"``
    counts bad images (under their :class:`BadImageReason`), malformed records
    (``bad_record``) and over-long ones (``overlong``) in ``stats.dropped`` instead of raising.
    A tokenizer or processor of another family (or an unknown family) raises :class:`UnsupportedModelError` before
    the first record, in either mode."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    fam, tokenizer, processor = _setup(family, tokenizer, processor)  # before the first record: no bad record
    st = stats if stats is not None else MediaTokenizeStats()
    for n, conv in enumerate(conversations):
        st.read += 1
        out, reason = tokenize_record(
            conv,
            n,
            tokenizer=tokenizer,
            processor=processor,
            family=fam,
            max_seq_len=max_seq_len,
            overlong=overlong,
            on_bad_row=on_bad_row,
        )
        if reason is not None:
            st.drop(reason)
            continue
        st.kept += 1
        st.samples += len(out)
        st.images += sum(s.media.num_items for s in out)
        yield from out


def tokenize_record(
    conv: Any,
    index: int,
    *,
    tokenizer: Any,
    processor: Any,
    family: Family,
    max_seq_len: int | None,
    overlong: Overlong | str,
    on_bad_row: str,
) -> tuple[list[Sample], str | None]:
    """One conversation record (a mapping with ``messages`` and ``id``, or an object with
    ``.messages`` and ``.id``; ``index`` is its id when it has none) to its samples, or none and
    the reason it is left out: under ``on_bad_row="skip"`` a bad image (its
    :class:`BadImageReason`), a malformed record (``bad_record``), an over-long one
    (``overlong``, also when ``drop`` leaves nothing); under ``"error"`` the error is raised,
    naming the record. The accounting of every caller (this module's stream, the loader)."""
    messages: Any
    if isinstance(conv, dict):
        messages, cid = conv.get("messages"), conv.get("id")
    else:
        messages, cid = conv.messages, getattr(conv, "id", None)
    try:
        out = tokenize_media_conversation(
            messages,
            tokenizer=tokenizer,
            processor=processor,
            conversation_id=cid if cid is not None else index,
            max_seq_len=max_seq_len,
            overlong=overlong,
            family=family,
        )
    except BadImageError as e:
        if on_bad_row == "error":
            raise
        return [], e.reason.value
    except OverlongError:
        if on_bad_row == "error":
            raise
        return [], "overlong"
    except ValueError:
        if on_bad_row == "error":
            raise
        return [], "bad_record"
    return out, None if out else "overlong"
