"""A multimodal conversation to one or more :class:`MultimodalSample`: render, tokenize, expand, mask.

Per conversation (Hugging Face multimodal chat format: a message's ``content`` is
a string or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image", ...}``
parts)::

    text  = ChatML, each image part -> <|vision_start|><|image_pad|><|vision_end|>
    ids   = tokenizer(text), content as text    (one <|image_pad|> per image)
    ids   = each <|image_pad|> repeated grid_t*grid_h*grid_w / merge**2 times
    mask  = assistant content and its <|im_end|> (never an image token)

which is what ``Qwen2VLProcessor`` does to the same text (its
``replace_image_token`` rule; the tests compare with the real processor). That
processor cannot be built as shipped without torchvision (its constructor checks
the video processor's class), so the image side here is its
``Qwen2VLImageProcessorPil``.

Content text is plain text, as on the text path (:mod:`sftpack.chat`, whose
``special_tokens_in_content="text"`` default this follows): the renderer notes where the
template puts its own control tokens (``<|im_start|>``, ``<|im_end|>``, the vision
tokens) and the text between them is encoded by a copy of the tokenizer that reads
special-token strings as text. So ``"<|im_end|>"`` typed in a content, whole or split
over adjacent text parts (``"Blue.<|im"`` + ``"_end|>"``), stays characters: it can never
forge a turn inside the loss mask, nor add a vision token or an image placeholder.

Over-long samples are never cut inside an image block (``<|vision_start|>`` ..
``<|vision_end|>``): ``split`` cuts at the last text boundary that fits, each
piece with its own images; a block longer than a row drops the sample (counted).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from ..chat._tokenize import _backend, _encode_pieces, _Rendered, mask_from_offsets
from ..handoff.media import check_pixel_values
from ..sample import Overlong, OverlongError, Sample
from ._images import BadImageError, ImagePatches, image_processor, load_image, process_images

__all__ = [
    "IMAGE_PAD",
    "QWEN2VL_SPECIALS",
    "VISION_END",
    "VISION_START",
    "MultimodalSample",
    "MultimodalStats",
    "UnsupportedModelError",
    "qwen2vl_tokenizer",
    "rope_index",
    "tokenize_multimodal",
    "tokenize_multimodal_conversations",
]

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
#: Qwen2-VL's special tokens after ``<|im_end|>``, in id order (151646 ... 151656).
QWEN2VL_SPECIALS = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    "<|vision_pad|>",
    IMAGE_PAD,
    "<|video_pad|>",
)
_QWEN2VL_IDS = dict(zip(QWEN2VL_SPECIALS, range(151646, 151657)))
#: The control tokens the renderer writes itself (ChatML and the image block); content text never makes them.
_TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", VISION_START, IMAGE_PAD, VISION_END)


class UnsupportedModelError(TypeError):
    """A tokenizer, image processor or model config of a family sftpack does not pack. One line
    naming it and what is supported, raised before any record is read: the setup is wrong, not
    a record, so ``on_bad_row="skip"`` never turns it into a count."""


def _check_setup(tokenizer: Any, processor: Any) -> None:
    """``tokenizer`` has Qwen2-VL's ChatML and image tokens, ``processor`` is a Qwen2-VL-style
    patch processor; else :class:`UnsupportedModelError`."""
    sizes = [getattr(processor, a, None) for a in ("patch_size", "temporal_patch_size", "merge_size")]
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes)
    if not ints or "image_grid_thw" not in (getattr(processor, "model_input_names", None) or ()):
        raise UnsupportedModelError(
            f"{type(processor).__name__} is not a Qwen2-VL image processor (integer patch_size, "
            "temporal_patch_size and merge_size; image_grid_thw out): tokenize_multimodal packs Qwen2-VL-style "
            "models (Qwen2-VL, Qwen2.5-VL: sftpack.multimodal.image_processor()) and tokenize_llava LLaVA "
            "(CLIP or SigLIP tower); Gemma 3, Idefics3, SmolVLM, Mistral3, InternVL and LLaVA-NeXT / -OneVision "
            "are not supported"
        )
    _check_tokenizer(tokenizer)


def _check_tokenizer(tokenizer: Any) -> None:
    """``tokenizer`` is a fast tokenizer with every token the renderer writes (:data:`_TEMPLATE_TOKENS`)."""
    backend = _backend(tokenizer)
    missing = [t for t in _TEMPLATE_TOKENS if backend.token_to_id(t) is None]
    if missing:
        raise UnsupportedModelError(
            f"{type(tokenizer).__name__} lacks the tokens {missing} of Qwen2-VL's ChatML and image block: use "
            "sftpack.multimodal.qwen2vl_tokenizer() or the Qwen2-VL model's own tokenizer"
        )


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from ..data import default_tokenizer

    tok = copy.deepcopy(default_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": list(QWEN2VL_SPECIALS)}, replace_extra_special_tokens=False)
    got = dict(zip(QWEN2VL_SPECIALS, tok.convert_tokens_to_ids(list(QWEN2VL_SPECIALS))))
    if got != _QWEN2VL_IDS:
        raise RuntimeError(f"Qwen2-VL special token ids {got} differ from Qwen2-VL's {_QWEN2VL_IDS}")
    return tok


def qwen2vl_tokenizer() -> Any:
    """The embedded Qwen BPE (:func:`sftpack.data.default_tokenizer`) plus Qwen2-VL's special
    tokens at Qwen2-VL's ids (``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653,
    ``<|image_pad|>`` 151655); 151,657 tokens. Shared within the process."""
    return _tokenizer()


@dataclass(eq=False)
class MultimodalSample(Sample):
    """A :class:`~sftpack.Sample` with its images.

    Attributes (beyond ``input_ids``, ``loss_mask``, ``conversation_id``, ``meta``):
        pixel_values: ``(P, D)`` float32 (or float16) patches of this sample's images, in order,
            finite; ``D = 3 * t * p**2`` (1176 on Qwen2-VL); ``(P, 0)`` when the pixels travel apart.
        image_grid_thw: ``(I, 3)`` int64 ``(t, h, w)`` patch grid of each image.
        image_runs: ``(I, 2)`` int64 ``(start, length)`` of each image's placeholder run
            in ``input_ids`` (``length = t*h*w // merge**2``).
        image_token_id: the placeholder id; merge_size: the vision merge window side.
    """

    pixel_values: np.ndarray = field(default_factory=lambda: np.zeros((0, 1176), np.float32))
    image_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    image_runs: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    image_token_id: int = _QWEN2VL_IDS[IMAGE_PAD]
    merge_size: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pixel_values = np.asarray(self.pixel_values)
        self.image_grid_thw = np.asarray(self.image_grid_thw, dtype=np.int64).reshape(-1, 3)
        self.image_runs = np.asarray(self.image_runs, dtype=np.int64).reshape(-1, 2)
        who = self.conversation_id
        name = f"MultimodalSample {who!r}: pixel_values"
        check_pixel_values(self.pixel_values, name, patches=True, placeholders=True, error=ValueError)
        n_img = self.image_grid_thw.shape[0]
        if self.image_runs.shape[0] != n_img:
            raise ValueError(f"MultimodalSample {who!r}: {self.image_runs.shape[0]} image runs for {n_img} grids")
        if int(self.image_grid_thw.prod(axis=1).sum()) != self.pixel_values.shape[0]:
            raise ValueError(
                f"MultimodalSample {who!r}: grids hold {int(self.image_grid_thw.prod(axis=1).sum())} patches "
                f"but pixel_values has {self.pixel_values.shape[0]}"
            )
        want = (self.image_grid_thw.prod(axis=1) // (self.merge_size**2)).tolist()
        _check_image_runs(self, f"MultimodalSample {who!r}", want, "placeholder")

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])


def _check_image_runs(sample: Any, who: str, lengths: list[int] | None, word: str) -> None:
    """``sample.image_runs`` are runs of ``sample.image_token_id`` in ``input_ids``
    (each of ``lengths[i]`` tokens when given, else at least one), those runs hold
    every such token, and none of them is trainable; else a ``ValueError`` naming
    ``who`` and the run (``word`` names the token: "placeholder", "image")."""
    is_img = sample.input_ids == sample.image_token_id
    marked = np.zeros_like(is_img)
    for i, (s, n) in enumerate(sample.image_runs.tolist()):
        bad_length = n < 1 if lengths is None else n != lengths[i]
        if bad_length or s < 0 or s + n > len(sample) or not bool(is_img[s : s + n].all()):
            what = f"a run of {word} tokens" if lengths is None else f"{lengths[i]} {word} tokens"
            raise ValueError(
                f"{who}: image {i} run (start {s}, length {n}) is not {what} {sample.image_token_id} in input_ids"
            )
        marked[s : s + n] = True
    if not np.array_equal(marked, is_img):
        raise ValueError(f"{who}: {word} tokens outside the image runs")
    if bool((sample.loss_mask & is_img).any()):
        raise ValueError(f"{who}: {word} tokens of an image run are marked trainable")


def rope_index(sample: MultimodalSample) -> np.ndarray:
    """Qwen2-VL's 3-D MRoPE positions ``(3, L)`` of one sample alone, starting at 0.

    The rule of ``Qwen2VLModel.get_rope_index`` (transformers 5.24), re-implemented in
    numpy and tested equal to it: a text token takes ``(p, p, p)`` and advances ``p``
    by one; an image of grid ``(t, h, w)`` with ``h' = h/merge``, ``w' = w/merge``
    takes ``(p + i_t, p + i_h, p + i_w)`` over its ``t x h' x w'`` placeholders in
    row-major order, then ``p`` advances by ``max(h, w) // merge``.
    """
    L = len(sample)
    out = np.empty((3, L), dtype=np.int64)
    m = sample.merge_size
    p, t0 = 0, 0
    for (s, n), (gt, gh, gw) in zip(sample.image_runs.tolist(), sample.image_grid_thw.tolist()):
        out[:, t0:s] = np.arange(p, p + s - t0)
        p += s - t0
        hh, ww = gh // m, gw // m
        tt, yy, xx = np.meshgrid(np.arange(gt), np.arange(hh), np.arange(ww), indexing="ij")
        out[0, s : s + n] = tt.reshape(-1) + p
        out[1, s : s + n] = yy.reshape(-1) + p
        out[2, s : s + n] = xx.reshape(-1) + p
        p += max(gh, gw) // m
        t0 = s + n
    out[:, t0:] = np.arange(p, p + L - t0)
    return out


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


def _render(messages: list[dict], record: Any) -> _Rendering:
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
        put("<|im_start|>", control=True)
        put(f"{role}\n")
        start = pos
        for j, part in enumerate(_parts(msg.get("content"), record, f"messages[{i}].content")):
            where = f"messages[{i}].content[{j}]"
            if part["type"] == "image":
                if role == "assistant":
                    raise ValueError(f"record {record!r}, {where}: images in assistant turns are not supported")
                images.append((part, where))
                for token in (VISION_START, IMAGE_PAD, VISION_END):
                    put(token, control=True)
            else:
                t = part.get("text")
                if not isinstance(t, str):
                    raise ValueError(f"record {record!r}, {where}.text: must be a string")
                put(t)  # plain text, special-token strings included (they never become control tokens)
        put("<|im_end|>", control=True)
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
    messages: list[dict], record: Any, tokenizer: Any, processor: Any
) -> tuple[np.ndarray, np.ndarray, ImagePatches, np.ndarray]:
    r = _render(messages, record)
    images = [load_image(p, record, where) for p, where in r.images]
    patches = process_images(images, processor)
    ids, mask = _ids_and_mask(r, tokenizer)
    image_id = int(tokenizer.convert_tokens_to_ids(IMAGE_PAD))
    where = np.flatnonzero(ids == image_id)
    assert where.size == len(images), "one placeholder per image part: content text never makes one"
    merge = int(processor.merge_size)
    reps = np.ones(ids.shape, dtype=np.int64)
    reps[where] = patches.tokens_per_image(merge)
    out_mask: np.ndarray = np.repeat(mask & (ids != image_id), reps)
    out_ids: np.ndarray = np.repeat(ids, reps)
    new_start = np.cumsum(reps) - reps
    runs = np.stack([new_start[where], reps[where]], axis=1) if where.size else np.zeros((0, 2), np.int64)
    return out_ids, out_mask, patches, runs


def _cut_points(sample_len: int, blocks: list[tuple[int, int]], max_seq_len: int) -> list[tuple[int, int]] | None:
    """Pieces of at most ``max_seq_len`` tokens, no cut inside a block ``[a, b)``; None if impossible."""
    pieces, a = [], 0
    while a < sample_len:
        b = min(a + max_seq_len, sample_len)
        for s, e in blocks:
            if s < b < e:  # inside a block: cut before it
                b = s
        if b <= a:
            return None
        pieces.append((a, b))
        a = b
    return pieces


def _piece(
    ids: np.ndarray, mask: np.ndarray, patches: ImagePatches, runs: np.ndarray, a: int, b: int, **kw: Any
) -> MultimodalSample:
    keep = [i for i, (s, n) in enumerate(runs.tolist()) if a <= s and s + n <= b]
    per_img = patches.image_grid_thw.prod(axis=1)
    off = np.concatenate([[0], np.cumsum(per_img)])
    pv = np.concatenate([patches.pixel_values[off[i] : off[i + 1]] for i in keep]) if keep else patches.pixel_values[:0]
    r = runs[keep].copy()
    r[:, 0] -= a
    return MultimodalSample(
        ids[a:b], mask[a:b], pixel_values=pv, image_grid_thw=patches.image_grid_thw[keep], image_runs=r, **kw
    )


def tokenize_multimodal(
    messages: list[dict],
    *,
    tokenizer: Any = None,
    processor: Any = None,
    conversation_id: Any = None,
    max_seq_len: int | None = None,
    overlong: Overlong | str = Overlong.SPLIT,
) -> list[MultimodalSample]:
    """One multimodal conversation to samples (one, or several pieces under ``split``, or none under ``drop``).

    Args:
        messages: Hugging Face multimodal chat messages.
        tokenizer: default :func:`qwen2vl_tokenizer`; processor: default
            :func:`~sftpack.multimodal.image_processor`.
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
        UnsupportedModelError: ``tokenizer`` or ``processor`` is not Qwen2-VL's kind (checked
            before any work).

    Special-token strings in a content (``"<|im_end|>"``, ``"<|image_pad|>"``, whole or split
    over adjacent text parts) are tokenized as plain text, as :func:`sftpack.chat.tokenize_conversation`
    does by default: only the template's own control tokens and one placeholder run per image
    part are control tokens.
    """
    policy = Overlong(overlong)
    if policy is Overlong.TRUNCATE:
        raise ValueError("overlong='truncate' is not offered for multimodal samples: use split, drop or error")
    tokenizer = tokenizer if tokenizer is not None else qwen2vl_tokenizer()
    processor = processor if processor is not None else image_processor()
    _check_setup(tokenizer, processor)
    ids, mask, patches, runs = _encode(messages, conversation_id, tokenizer, processor)
    kw = dict(
        conversation_id=conversation_id,
        image_token_id=int(tokenizer.convert_tokens_to_ids(IMAGE_PAD)),
        merge_size=int(processor.merge_size),
    )
    L = len(ids)
    if max_seq_len is None or L <= max_seq_len:
        return [_piece(ids, mask, patches, runs, 0, L, **kw)]
    if policy is Overlong.DROP:
        return []
    who = f"conversation {conversation_id!r}"
    if policy is Overlong.ERROR:
        raise OverlongError(
            f"{who} has {L} tokens (images included), more than max_seq_len={max_seq_len}: "
            "raise max_seq_len, lower the images' max_pixels, or use overlong='split' or 'drop'",
            conversation_id,
            L,
            max_seq_len,
        )
    blocks = [(int(s) - 1, int(s + n) + 1) for s, n in runs.tolist()]  # with <|vision_start|> / <|vision_end|>
    cuts = _cut_points(L, blocks, max_seq_len)
    if cuts is None:
        raise OverlongError(
            f"{who}: an image block is longer than max_seq_len={max_seq_len} and cannot be split; "
            "lower the images' max_pixels or raise max_seq_len",
            conversation_id,
            L,
            max_seq_len,
        )
    return [_piece(ids, mask, patches, runs, a, b, meta={"piece": k}, **kw) for k, (a, b) in enumerate(cuts)]


@dataclass
class MultimodalStats:
    """Counts of :func:`tokenize_multimodal_conversations`: ``read == kept + sum(dropped.values())``;
    ``samples`` counts the samples made (a split conversation makes several)."""

    read: int = 0
    kept: int = 0
    samples: int = 0
    images: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def tokenize_multimodal_conversations(
    conversations: Iterable[Any],
    *,
    tokenizer: Any = None,
    processor: Any = None,
    max_seq_len: int | None = None,
    overlong: Overlong | str = Overlong.SPLIT,
    on_bad_row: str = "error",
    stats: MultimodalStats | None = None,
) -> Iterator[MultimodalSample]:
    """Samples of many conversations, in order. Each item is a mapping with ``messages``
    (and ``id``) or an object with ``.messages`` (and ``.id``). ``on_bad_row="skip"``
    counts bad images (under their :class:`BadImageReason`), malformed records
    (``bad_record``) and over-long ones (``overlong``) in ``stats.dropped`` instead of raising.
    A tokenizer or processor of another family raises :class:`UnsupportedModelError` before
    the first record, in either mode."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    tokenizer = tokenizer if tokenizer is not None else qwen2vl_tokenizer()
    processor = processor if processor is not None else image_processor()
    _check_setup(tokenizer, processor)  # before the first record: a wrong setup is no bad record
    st = stats if stats is not None else MultimodalStats()
    for n, conv in enumerate(conversations):
        st.read += 1
        messages = conv["messages"] if isinstance(conv, dict) else conv.messages
        cid = (conv.get("id") if isinstance(conv, dict) else getattr(conv, "id", None)) or n
        try:
            out = tokenize_multimodal(
                messages,
                tokenizer=tokenizer,
                processor=processor,
                conversation_id=cid,
                max_seq_len=max_seq_len,
                overlong=overlong,
            )
        except BadImageError as e:
            if on_bad_row == "error":
                raise
            st.drop(e.reason.value)
            continue
        except OverlongError:
            if on_bad_row == "error":
                raise
            st.drop("overlong")
            continue
        except ValueError:
            if on_bad_row == "error":
                raise
            st.drop("bad_record")
            continue
        if not out:
            st.drop("overlong")
            continue
        st.kept += 1
        st.samples += len(out)
        st.images += sum(s.num_images for s in out)
        yield from out
