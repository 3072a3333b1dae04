"""A multimodal conversation to one or more samples with media: render, tokenize, expand, mask.

Per conversation (Hugging Face multimodal chat format: a message's ``content`` is
a string or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image", ...}`` /
``{"type": "video", ...}`` parts), for a model family (:class:`~sftpack.multimodal.Family`,
default Qwen2-VL)::

    text  = the chat template (the tokenizer's own, else the family's default), contents as
            parts, each media part written as the family's mark
            (Qwen2-VL: <|vision_start|><|image_pad|><|vision_end|>; LLaVA-1.5: <image>;
            Gemma 3: <start_of_image>, rewritten as its processor does into
            \n\n<start_of_image><image_soft_token><end_of_image>\n\n)
    spans = the text path's trainable characters (sftpack.chat.ChatRenderer: each
            assistant content and its end-of-turn token)
    ids   = tokenizer(text), content as text    (one placeholder per image or video)
    ids   = each placeholder repeated as many times as the family says the item takes
    mask  = tokens starting in a span (never a placeholder)

and the sample's ``media`` is the family's payload of its images and videos (pixels, each
item's placeholder run, and its position rule). For Qwen2-VL that is what
``Qwen2VLProcessor`` does to the same text (its ``replace_image_token`` rule), for Gemma 3
what ``Gemma3Processor`` does (the tests compare with the real processors).

Content text is plain text, as on the text path (:mod:`sftpack.chat`, whose
``special_tokens_in_content="text"`` default this follows): the special-token strings of
the contents are swapped for markers before the template renders, so the template's own
special tokens (turn tokens, media marks) are the only control tokens, and the text
between them is encoded by a copy of the tokenizer that reads special-token strings as
text. So ``"<|im_end|>"`` typed in a content, whole or split over text parts
(``"Blue.<|im"`` + ``"_end|>"``), stays characters: it can never forge a turn inside the
loss mask, nor add a vision token or an image placeholder.

Over-long samples are never cut inside a media block: ``split`` cuts at the last
text boundary that fits, each piece with its own media; a block longer than a row
drops the sample (counted).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..chat import (
    ROLES,
    FormattedMessages,
    RowFormat,
    RowProblem,
    TemplateError,
    TrainOn,
    checked_tool_calls,
    checked_tools,
    encode_pieces,
    mask_from_offsets,
    render_spans,
)
from ..sample import Overlong, OverlongError, Sample
from ._family import MEDIA_KINDS, EncodedImages, Family, family_for
from ._images import BadImageError, load_image

__all__ = ["MediaTokenizeStats", "tokenize_media_conversation", "tokenize_media_conversations"]


# ------------------------------------------------------------------ rendering
_PARTS = ("text", *MEDIA_KINDS)


def _parts(content: Any, record: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"record {record!r}, {where}: content must be a string or a list of parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _PARTS:
            raise ValueError(
                f"record {record!r}, {where}[{j}]: a part must be {{'type': 'text'|'image'|'video', ...}}, "
                f"got {part!r:.80}"
            )
    return content


@dataclass
class _Rendering:
    """A conversation rendered by the chat template: its ``text``, the trainable character
    ``spans``, where the template put its own special tokens (``controls``; everything else is
    content, plain text), and the media parts of each kind in order with their field names."""

    text: str
    spans: list[tuple[int, int]]
    controls: list[tuple[int, int]]
    media: dict[str, list[tuple[dict, str]]]


def _render(messages: list[dict], record: Any, family: Family, renderer: Any, tokenizer: Any) -> _Rendering:
    """``messages`` through the family's chat template (contents as lists of parts; each media
    part handed to the template as ``{"type": kind}``) by the text path's rendering
    (:func:`sftpack.chat.render_spans`): the same roles, ``tools`` (the messages'
    attribute, as the reader gives them) and ``tool_calls``, the same spans, every special-token
    text of the data kept as text, a template that ignores the tools refused."""
    if not messages:
        raise ValueError(f"record {record!r}: no messages")
    shown: list[dict] = []
    media: dict[str, list[tuple[dict, str]]] = {kind: [] for kind in MEDIA_KINDS}
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise ValueError(
                f"record {record!r}, messages[{i}].role: {role!r} is not one of {', '.join(sorted(ROLES))}"
            )
        extra = {k: v for k, v in msg.items() if k not in ("role", "content") and v is not None}
        content = msg.get("content")
        if extra.get("tool_calls") is not None:
            try:
                extra["tool_calls"] = checked_tool_calls(extra["tool_calls"], i, role)
            except RowProblem as bad:
                raise ValueError(f"record {record!r}, {bad.detail} ({bad.fix})") from None
            content = "" if content is None else content  # a turn that only calls tools
        parts: list[dict] = []
        for j, part in enumerate(_parts(content, record, f"messages[{i}].content")):
            where = f"messages[{i}].content[{j}]"
            kind = part["type"]
            if kind == "text":
                t = part.get("text")
                if not isinstance(t, str):
                    raise ValueError(f"record {record!r}, {where}.text: must be a string")
                parts.append({"type": "text", "text": t})  # plain text, special-token strings included
                continue
            if role == "assistant":
                raise ValueError(f"record {record!r}, {where}: {kind}s in assistant turns are not supported")
            if kind == "video" and not family.video_block:
                raise ValueError(
                    f"record {record!r}, {where}: the {family.name} family takes no video parts "
                    "(give images, or a model of a family with video)"
                )
            media[kind].append((part, where))
            parts.append({"type": kind})
        shown.append({**extra, "role": role, "content": parts})
    if not any(m["role"] == "assistant" for m in shown):
        raise ValueError(f"record {record!r}: no assistant message, nothing to train on")
    tools = getattr(messages, "tools", None)
    if tools:
        shown = FormattedMessages(shown, RowFormat.MESSAGES, tools=tools)
    try:
        text, spans, controls = render_spans(renderer, shown, TrainOn.ALL_ASSISTANT, tokenizer, keep_special_text=True)
    except TemplateError as e:
        raise ValueError(f"record {record!r}: {e}") from None
    assert controls is not None
    if not spans:
        raise ValueError(f"record {record!r}: the chat template leaves no assistant text to train on")
    return _Rendering(text, spans, controls, media)


def _rewrite_marks(r: _Rendering, record: Any, family: Family, encoded: dict[str, EncodedImages]) -> _Rendering:
    """Each media mark the template wrote, replaced by the family's :meth:`~Family.media_text`
    (its block tokens control tokens, the rest plain text); the spans and controls moved to match."""
    kinds = {token: kind for kind, token in family.marks().items()}
    block = sorted({*family.image_block, *family.video_block}, key=len, reverse=True)
    tokens = re.compile("|".join(re.escape(t) for t in block))
    seen = dict.fromkeys(MEDIA_KINDS, 0)
    pieces: list[str] = []
    controls: list[tuple[int, int]] = []
    moves: list[tuple[int, int]] = []  # (end of a rewritten mark in the old text, shift from then on)
    pos = shift = 0
    for a, b in r.controls:
        kind = kinds.get(r.text[a:b])
        rep = None if kind is None else family.media_text(kind, seen[kind], encoded[kind])
        if kind is not None:
            seen[kind] += 1
        if rep is None:
            controls.append((a + shift, b + shift))
            continue
        pieces.append(r.text[pos:a])
        controls.extend((a + shift + m.start(), a + shift + m.end()) for m in tokens.finditer(rep))
        pieces.append(rep)
        pos = b
        shift += len(rep) - (b - a)
        moves.append((b, shift))
    for kind in MEDIA_KINDS:
        if seen[kind] != len(r.media[kind]):
            raise ValueError(
                f"record {record!r}: the chat template wrote {seen[kind]} {kind} marks for {len(r.media[kind])} "
                f"{kind} parts: use a template that writes each {kind} part once"
            )
    if not moves:
        return dataclasses.replace(r, controls=controls)
    pieces.append(r.text[pos:])
    ends = [e for e, _ in moves]

    def moved(p: int) -> int:
        k = bisect.bisect_right(ends, p)
        return p + (moves[k - 1][1] if k else 0)

    spans = [(moved(a), moved(b)) for a, b in r.spans]
    return _Rendering("".join(pieces), spans, controls, r.media)


def _ids_and_mask(r: _Rendering, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """``r.text``'s token ids, control tokens only where the template put them (the text path's
    piecewise encoding, :mod:`sftpack.chat`), and True where a token starts inside one of the
    trained character spans."""
    ids, offsets = encode_pieces(r.text, r.controls, tokenizer)
    return ids, mask_from_offsets(offsets, r.spans)


@dataclass
class _Encoded:
    """One conversation's tokens, loss mask, and per media kind its encoding, placeholder id and runs."""

    ids: np.ndarray
    mask: np.ndarray
    encoded: dict[str, EncodedImages]
    token_id: dict[str, int]
    runs: dict[str, np.ndarray]


def _encode(messages: list[dict], record: Any, tokenizer: Any, processor: Any, family: Family) -> _Encoded:
    r = _render(messages, record, family, family.renderer(tokenizer), tokenizer)
    encoded = {
        "image": family.encode_images([load_image(p, record, where) for p, where in r.media["image"]], processor)
    }
    if r.media["video"]:
        parts, fields = zip(*r.media["video"])
        encoded["video"] = family.encode_videos(list(parts), processor, record=record, fields=list(fields))
    r = _rewrite_marks(r, record, family, encoded)
    ids, mask = _ids_and_mask(r, tokenizer)
    placeholders = {"image": family.placeholder, "video": family.video_placeholder}
    token_id = {k: int(tokenizer.convert_tokens_to_ids(placeholders[k])) for k in encoded}
    token_id["image"] = family.placeholder_id(tokenizer)
    reps = np.ones(ids.shape, dtype=np.int64)
    where = {}
    for kind, enc in encoded.items():
        at = where[kind] = np.flatnonzero(ids == token_id[kind])
        if at.size != len(enc.tokens):  # content text never makes one: only the template's marks do
            raise ValueError(
                f"record {record!r}: {at.size} {kind} placeholders in the text for {len(enc.tokens)} encoded: "
                f"the chat template or {family.name}'s media_text writes the wrong number"
            )
        reps[at] = enc.tokens
    trained = np.isin(ids, list(token_id.values()), invert=True)
    out_mask: np.ndarray = np.repeat(mask & trained, reps)
    out_ids: np.ndarray = np.repeat(ids, reps)
    new_start = np.cumsum(reps) - reps
    runs = {
        kind: np.stack([new_start[at], reps[at]], axis=1) if at.size else np.zeros((0, 2), np.int64)
        for kind, at in where.items()
    }
    return _Encoded(out_ids, out_mask, encoded, token_id, runs)


def _blocks(family: Family) -> list[tuple[tuple[str, ...], str]]:
    """The family's media blocks with their placeholders (image, and video when it takes video)."""
    out = [(family.image_block, family.placeholder)]
    return out + [(family.video_block, family.video_placeholder)] if family.video_block else out


def cut_points(sample: Sample, max_seq_len: int, family: Family) -> list[tuple[int, int]] | None:
    """Spans ``[a, b)`` of at most ``max_seq_len`` tokens covering a sample with media, never cut
    inside a media block (its placeholder run with the family's control tokens around it,
    e.g. Qwen2-VL's ``<|vision_start|>`` and ``<|vision_end|>``): each cut at the last text
    boundary that fits. ``None`` when an image block alone is longer than ``max_seq_len``.
    The one split rule of samples with media (the tokenizer's ``split``, the loader's)."""
    n = len(sample)
    around = [(b.index(p), len(b) - b.index(p) - 1) for b, p in _blocks(family)]  # control tokens around a run
    before, after = max(x for x, _ in around), max(y for _, y in around)
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
    e = _encode(messages, conversation_id, tokenizer, processor, fam)
    image = e.encoded["image"], e.token_id["image"]
    media = fam.media(e.ids, e.runs["image"], *image, videos=e.encoded.get("video"), video_runs=e.runs.get("video"))
    whole = Sample(e.ids, e.mask, conversation_id, media=media)
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
        if isinstance(conv, dict):
            _no_weights(conv, messages, cid if cid is not None else index)
        if isinstance(conv, dict) and conv.get("tools") is not None and isinstance(messages, list):
            messages = _with_tools(messages, conv, cid if cid is not None else index)
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


def _no_weights(record: dict[str, Any], messages: Any, cid: Any) -> None:
    """Refuse a ``weight`` / ``advantage`` / ``group`` (the record's or a message's weight):
    samples with images do not carry per-token weights or RL groups yet, and neither is dropped
    unseen."""
    if record.get("group") is not None:
        raise ValueError(
            f"record {cid!r} carries a group ({record['group']!r}): conversations with images do not keep RL "
            "groups whole yet; drop the field, or train the text conversations apart"
        )
    weighted = [k for k in ("weight", "advantage") if record.get(k) is not None]
    if weighted or (
        isinstance(messages, list) and any(isinstance(m, dict) and m.get("weight") is not None for m in messages)
    ):
        raise ValueError(
            f"record {cid!r} carries a {'/'.join(weighted) or 'message weight'}: conversations with images do not "
            "carry per-token weights into their rows yet; drop the field, or train the text conversations apart"
        )


def _with_tools(messages: list[dict], record: dict[str, Any], cid: Any) -> FormattedMessages:
    """A record's messages carrying its ``tools`` column (checked as the reader checks it)."""
    try:
        tools = checked_tools(record)
    except RowProblem as bad:
        raise ValueError(f"record {cid!r}, {bad.detail} ({bad.fix})") from None
    return FormattedMessages(messages, RowFormat.MESSAGES, tools=tools)
