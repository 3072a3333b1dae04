"""Multimodal SFT inside Megatron-Energon: conversations with images, packed by sftpack's planner.

The sample format (a WebDataset tar prepared with ``energon prepare`` as a
``CrudeWebdataset``): one sample is a ``KEY.json`` holding
``{"id": ..., "messages": [...]}`` in the Hugging Face multimodal chat format,
plus the sample's image files (``KEY.img0.png``, ``KEY.img1.jpg``, ...). An image
part names one of those files by the part of its name after the key::

    {"type": "image", "path": "img0.png"}        (or "image": "img0.png"; "resize": [w, h] is kept)

so the images travel inside the shard with their conversation, in the order the
parts name them (Energon reads them as raw bytes: the encoder sets
``decoder = None``; sftpack decodes them with PIL). Energon's own VQA sample types
hold one image and one question, not a multi-turn conversation with several
images, hence the crude sample and the cooker :func:`cook_multimodal`. A dataset
whose ``sample_loader`` builds a :class:`MultimodalConversationSample` works too.

Per sample, :meth:`MultimodalPackingTaskEncoder.encode_sample` turns the
conversation into a :class:`~sftpack.multimodal.MultimodalSample`
(:func:`~sftpack.multimodal.tokenize_multimodal`: Qwen2-VL tokens with each
image's placeholder run expanded, its patches and grid). Per Energon buffer,
``select_samples_to_pack`` plans rows with :func:`~sftpack.multimodal.plan_rows`
(first-fit decreasing on the padded token cost, with an optional patch budget per
row) and ``pack_selected_samples`` lays each row with
:func:`~sftpack.multimodal.build_multimodal_row` (media in row order, MRoPE
positions per sample). ``batch`` lays ``batch_size`` rows end to end in one
:class:`EnergonMultimodalBatch`.

Bad samples: an image that cannot be read (a file the sample does not have,
undecodable or empty bytes), a malformed record, or a sample too long for a row.
With ``on_bad_row="error"`` (the default) the first raises
:class:`~sftpack.multimodal.BadImageError` naming the Energon shard, key, id and
the field; with ``"skip"`` it is left out and *counted*: the row packed from the
same buffer lists it in ``dropped`` as ``(id, reason)``, so every sample read is
either in a row's ``sequence_ids`` or in a batch's ``dropped`` (a buffer whose
samples are all bad has no row to carry them: it is skipped with a logged
warning). Over-long samples follow ``overlong`` as in the text encoder:
``"split"`` (the default) raises :class:`~sftpack.sample.OverlongError` since
Energon encodes one sample into one, ``"drop"`` counts it, ``"error"`` raises. A
sample over ``max_patches`` follows every path's rule
(:func:`sftpack.multimodal._plan.check_patch_budget`): dropped and counted as
``over_patch_budget`` under ``"split"`` and ``"drop"``, refused under ``"error"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from megatron.energon import Cooker, Sample, SkipSample, basic_sample_keys, edataclass, stateless

from .._base import check_width, choose, positive_int
from ..handoff import PackedBatch
from ..handoff.layout import check_pad_id
from ..multimodal import BadImageError, BadImageReason, build_multimodal_row, load_image, plan_rows, tokenize_multimodal
from ..multimodal._plan import check_patch_budget
from ..sample import DEFAULT_OVERLONG, Overlong, OverlongError
from ._energon_base import CheckedTaskEncoder, crude_json, sample_where
from ._energon_batch import EnergonPackedBatch

__all__ = [
    "EncodedMultimodalSample",
    "EnergonMultimodalBatch",
    "MultimodalConversationSample",
    "MultimodalPackingTaskEncoder",
    "MultimodalRowSample",
    "cook_multimodal",
]

_log = logging.getLogger(__name__)
_PAD = 151643  # <|endoftext|>, Qwen2-VL's pad


@edataclass
class MultimodalConversationSample(Sample):
    """One conversation with its image files: ``messages`` in the Hugging Face multimodal chat
    format, ``media`` the sample's files by name (``{"img0.png": b"..."}``), named by the image parts;
    ``bad`` what is wrong with a record that could not be read (its JSON), else None."""

    messages: list
    media: dict
    conversation_id: Any = None
    bad: str | None = None


@edataclass
class EncodedMultimodalSample(Sample):
    """One encoded conversation (``sample``), or a left-out one (``sample`` None, ``dropped`` its reason)."""

    sample: Any
    conversation_id: Any = None
    dropped: str | None = None


@edataclass
class MultimodalRowSample(Sample):
    """One packed row (a :class:`~sftpack.multimodal.MultimodalBatch`) and the samples left out beside it."""

    row: PackedBatch
    dropped: tuple = ()


@dataclass(eq=False, repr=False)
class EnergonMultimodalBatch(EnergonPackedBatch):
    """An :class:`~sftpack.loader.EnergonPackedBatch` with media (the handoff's media fields set)
    and ``dropped``: ``(id, reason)`` of each sample left out by ``on_bad_row="skip"`` or
    ``overlong="drop"`` in the buffers of these rows."""

    dropped: tuple = ()


@stateless
def cook_multimodal(sample: dict) -> MultimodalConversationSample:
    """A crude WebDataset sample (``json`` + image files, raw bytes) as a
    :class:`MultimodalConversationSample`; the id defaults to the sample's ``__key__``. A record that
    cannot be read (no ``.json``, JSON that does not parse, no ``messages``) comes out with ``bad`` set:
    the encoder raises on it by name or, with ``on_bad_row="skip"``, counts it as ``bad_record``."""
    key = sample.get("__key__")
    data, problem = crude_json(sample)
    media = {k: v for k, v in _files(sample).items() if k != "json"}
    if data is None:
        return MultimodalConversationSample(
            **basic_sample_keys(sample), messages=[], media=media, conversation_id=key, bad=problem
        )
    return MultimodalConversationSample(
        **basic_sample_keys(sample), messages=data["messages"], media=media, conversation_id=data.get("id", key)
    )


def _files(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if not (k.startswith("__") and k.endswith("__"))}


def _where(sample: Any, cid: Any) -> str:
    return f"{sample_where(sample.__key__, getattr(sample, '__sources__', None))} (id {cid!r})"


def _resolve(messages: Any, media: dict, record: str) -> list:
    """The messages with each image part's file name replaced by its decoded image (raises BadImageError)."""
    if not isinstance(messages, list):
        raise ValueError(f"{record}: messages must be a list, got {type(messages).__name__}")
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image":
                field = f"messages[{i}].content[{j}]"
                kind = "path" if part.get("path") is not None else "image"
                name = part.get(kind)
                if not isinstance(name, str):
                    raise BadImageError(
                        record, field, BadImageReason.NO_SOURCE, f"no file name in the part (keys {sorted(part)})"
                    )
                if name not in media:
                    raise BadImageError(
                        record,
                        f"{field}.{kind}",
                        BadImageReason.MISSING_FILE,
                        f"no file {name!r} in the sample (its files: {sorted(media)})",
                    )
                src = {kind: media[name], "resize": part.get("resize")}  # the member's bytes (or PIL image)
                part = {"type": "image", "image": load_image(src, record, field, name=name)}
            parts.append(part)
        out.append({**msg, "content": parts})
    return out


class MultimodalPackingTaskEncoder(CheckedTaskEncoder):
    """Tokenize conversations with images and pack them into ``max_seq_len`` rows with media.

    Args:
        max_seq_len: row width in tokens (vision placeholders included), a multiple of ``pad_multiple``.
        max_patches: vision patches per row (the vision tower's budget); ``None``: no limit.
        pad_multiple: per-sample pad multiple (``2 * CP``).
        pad_id: token id of padding slots (default ``<|endoftext|>``).
        tokenizer: default :func:`~sftpack.multimodal.qwen2vl_tokenizer` (built on first use; workers fork).
        processor: default :func:`~sftpack.multimodal.image_processor`.
        overlong: ``"split"`` (default: an over-long sample is refused by name, Energon cannot split),
            ``"drop"`` (counted) or ``"error"``; a sample with more patches than ``max_patches`` is
            dropped and counted as ``over_patch_budget`` (``"error"``: refused), as on every path.
        on_bad_row: ``"error"`` (default) or ``"skip"`` (bad images and malformed records counted).
    """

    cookers = (Cooker(cook_multimodal),)
    decoder = None  # the images reach encode_sample as the shard's bytes; sftpack decodes them

    def __init__(
        self,
        *,
        max_seq_len: int,
        max_patches: int | None = None,
        pad_multiple: int = 1,
        pad_id: int = _PAD,
        tokenizer: Any = None,
        processor: Any = None,
        overlong: str | Overlong = DEFAULT_OVERLONG,
        on_bad_row: str = "error",
    ) -> None:
        super().__init__()
        who = "MultimodalPackingTaskEncoder"
        self.overlong = choose(Overlong, overlong, "overlong")
        if self.overlong is Overlong.TRUNCATE:
            raise ValueError(
                f"{who}: overlong='truncate' is not offered for multimodal samples (it could cut an image): "
                "use 'split', 'drop' or 'error'"
            )
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"{who}: on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        self.pad_multiple = positive_int("pad_multiple", pad_multiple, who=who)
        self.max_seq_len = check_width(positive_int("max_seq_len", max_seq_len, who=who), self.pad_multiple, who=who)
        self.max_patches = None if max_patches is None else positive_int("max_patches", max_patches, who=who)
        self.pad_id = check_pad_id(pad_id, who, ValueError)
        self.tokenizer = tokenizer
        self.processor = processor
        self.on_bad_row = on_bad_row

    def _drop(self, sample: Any, cid: Any, reason: str) -> EncodedMultimodalSample:
        return EncodedMultimodalSample.derive_from(sample, sample=None, conversation_id=cid, dropped=reason)

    @stateless
    def encode_sample(self, sample: Any) -> EncodedMultimodalSample:
        cid = getattr(sample, "conversation_id", None)
        cid = sample.__key__ if cid is None else cid
        record = _where(sample, cid)
        bad = getattr(sample, "bad", None)
        if bad is not None:
            if self.on_bad_row == "error":
                raise ValueError(
                    f"{record}: {bad}: fix or remove the sample and prepare the dataset again, or pass "
                    "on_bad_row='skip' to count it as a bad_record"
                )
            return self._drop(sample, cid, "bad_record")
        try:
            messages = _resolve(sample.messages, sample.media, record)
            (s,) = tokenize_multimodal(
                messages, tokenizer=self.tokenizer, processor=self.processor, conversation_id=cid
            )
        except BadImageError as e:
            if self.on_bad_row == "error":
                raise
            return self._drop(sample, cid, e.reason.value)
        except ValueError:
            if self.on_bad_row == "error":
                raise
            return self._drop(sample, cid, "bad_record")
        n = len(s)
        if n > self.max_seq_len:
            if self.overlong is Overlong.DROP:  # the reasons of MultimodalPackingDataset's counts
                return self._drop(sample, cid, "overlong")
            cannot = (
                ", and Energon encodes one sample into one sample, so MultimodalPackingTaskEncoder cannot split it"
                if self.overlong is Overlong.SPLIT
                else ""
            )
            raise OverlongError(
                f"{record} has {n} tokens (images included), more than max_seq_len={self.max_seq_len}{cannot}: "
                "pass overlong='drop' (counted in each batch's dropped), raise the budget, or lower the images' "
                "max_pixels",
                cid,
                n,
                self.max_seq_len,
            )
        reason = check_patch_budget([s], self.max_patches, self.overlong, who=str(record))  # every path's rule
        if reason is not None:
            return self._drop(sample, cid, reason)
        return EncodedMultimodalSample.derive_from(sample, sample=s, conversation_id=cid)

    def select_samples_to_pack(self, samples: list[EncodedMultimodalSample]) -> list[list[EncodedMultimodalSample]]:
        """Every buffered sample in exactly one group: :func:`~sftpack.multimodal.plan_rows` over the
        kept samples (each row in buffer order); the left-out ones ride with the first row."""
        kept = [s for s in samples if s.sample is not None]
        left = [s for s in samples if s.sample is None]
        if not kept:
            _log.warning(
                "Energon buffer of %d samples has no sample to pack (left out: %s): no row to report them on",
                len(samples),
                [(s.conversation_id, s.dropped) for s in left],
            )
            raise SkipSample()
        lengths = [len(s.sample) for s in kept]
        patches = [s.sample.num_patches for s in kept]
        rows = plan_rows(
            lengths, patches, max_seq_len=self.max_seq_len, max_patches=self.max_patches, pad_multiple=self.pad_multiple
        )
        groups = [[kept[i] for i in row.tolist()] for row in rows]
        groups[0].extend(left)
        return groups

    @stateless
    def pack_selected_samples(self, samples: list[EncodedMultimodalSample]) -> MultimodalRowSample:
        kept = [s for s in samples if s.sample is not None]
        row = build_multimodal_row(
            [s.sample for s in kept], row_width=self.max_seq_len, pad_multiple=self.pad_multiple, pad_id=self.pad_id
        )
        dropped = tuple((s.conversation_id, s.dropped) for s in samples if s.sample is None)
        return MultimodalRowSample.derive_from(kept[0], row=row, dropped=dropped)

    @stateless
    def batch(self, samples: list[MultimodalRowSample]) -> EnergonMultimodalBatch:
        """``batch_size`` rows laid end to end (their media too) in one :class:`EnergonMultimodalBatch`."""
        row = PackedBatch.concat([s.row for s in samples])
        return EnergonMultimodalBatch(
            **{f.name: getattr(row, f.name) for f in fields(PackedBatch)},
            __key__=tuple(s.__key__ for s in samples),
            dropped=tuple(d for s in samples for d in s.dropped),
        )
