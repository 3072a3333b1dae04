"""The loader path inside Megatron-Energon: a ``TaskEncoder`` that packs with sftpack.

Energon's packing hooks, per worker: it fills a buffer of
``packing_buffer_size`` encoded samples, calls ``select_samples_to_pack(buffer)``
once, then ``pack_selected_samples(group)`` for each group it got back, and
refills while it emits. :class:`PackingTaskEncoder` plugs in the same rule as
:class:`~sftpack.loader.PackingDataset` with ``max_wait=0``
(:func:`~sftpack.handoff.pack_rows`: BFD on ``padded_lengths``, buffer order kept
in a row) and the same row builder, so for the same buffer both lay the same
rows. Energon silently drops any buffered sample the selector leaves out:
``pack_rows`` places every one of them, always.

Energon encodes one sample into one sample, so the encoder cannot split a
conversation longer than a row. Under the default over-long policy
(``overlong="split"``, every layer's default: no token lost unasked) such a
conversation raises :class:`~sftpack.sample.OverlongError` naming it and the
fixes; pass ``overlong="truncate"`` or ``"drop"`` to cut or skip it instead.

Recipe (``pip install 'sftpack[loader]'``)::

    energon prepare chats.jsonl                      # writes the index chats.jsonl.idx
    encoder = PackingTaskEncoder(tokenizer, max_seq_len=4096, pad_multiple=4)
    ds = get_train_dataset("chats.jsonl", worker_config=WorkerConfig(rank=r, world_size=w, num_workers=2,
                           global_error_handler=reraise_exception), batch_size=1, packing_buffer_size=256,
                           shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=encoder)
    loader = get_savable_loader(ds)                   # loader.save_state_rank() / restore_state_rank(state)
    for batch in loader:                              # a PackedBatch of batch_size rows laid end to end
        params = batch.to_packed_seq_params(pad_between_seqs=False)

What Energon needs, all done here (each pitfall reproduced on this machine with Energon 7.4.1):
``batch()`` is overridden (the default would call ``PackedBatch.from_samples``
on the rows); the cooker, ``encode_sample``, ``pack_selected_samples`` and
``batch`` are ``@stateless`` (Energon restores by re-reading and re-packing,
so they must be deterministic); the samples they return are Energon
``Sample`` subclasses built with ``derive_from`` (else the restore key is
lost); the batch is an :class:`EnergonPackedBatch`, a ``PackedBatch`` that
carries Energon's ``__key__`` and ``__restore_key__``, so
``loader.restore_sample(batch.__restore_key__)`` rebuilds it exactly (Energon's
wrappers and loader write the key only onto an object that already has the
attribute; a plain ``PackedBatch`` raised ``AttributeError`` there).
``shuffle_buffer_size`` and ``max_samples_per_sequence`` are required
keywords of ``get_train_dataset``, and Energon logs and skips a failing sample
unless the worker config has a re-raising error handler.

Conversations with images take the same encoder (one for samples with and without
images): a crude WebDataset sample is a ``KEY.json`` conversation in the Hugging Face
multimodal chat format with its image files beside it (an image part names one by the
part of its name after the key: ``{"type": "image", "path": "img0.png"}``; the encoder
sets ``decoder = None``, so the files arrive as bytes and sftpack decodes them). Such a
conversation is tokenized for a model family (``family=``, default Qwen2-VL) with
:func:`sftpack.multimodal.tokenize_media_conversation`, each buffer is planned under the token
and the optional patch budget (``max_patches_per_row``), and a row holding media is laid
by :meth:`sftpack.PackedBatch.from_samples`. A sample with media (or a conversation
tokenized for the family) that is left out (a bad image or record under
``on_bad_row="skip"``, over-long under ``overlong="drop"``, over the patch budget) is
counted in the batch's ``dropped`` as ``(id, reason)``. See docs/energon_multimodal.md.

This module imports ``megatron.energon``; ``import sftpack.loader`` does not
(``sftpack.loader.PackingTaskEncoder`` loads it on first use).
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

import numpy as np
from megatron.energon import (
    Cooker,
    Sample,
    SkipSample,
    basic_sample_keys,
    edataclass,
    stateless,
)

from .._base import check_width, choose, positive_int
from .._types import Tokenizer
from ..chat import tokenize_conversation
from ..handoff import PackedBatch, build_row, pack_rows
from ..handoff.layout import check_pad_id
from ..multimodal import (
    BadImageError,
    BadImageReason,
    Family,
    check_patch_budget,
    family_for,
    load_image,
    tokenize_media_conversation,
)
from ..sample import DEFAULT_OVERLONG, Overlong, OverlongError, overlong_spans
from ..sample import Sample as SftSample
from ._energon_base import CheckedTaskEncoder, crude_json, sample_where
from ._energon_batch import EnergonPackedBatch
from ._source import media_options
from ._stats import OVERLONG

__all__ = [
    "ConversationSample",
    "EnergonPackedBatch",
    "PackedRowSample",
    "PackingTaskEncoder",
    "TokenizedSample",
    "cook_conversation",
]


@edataclass
class ConversationSample(Sample):
    """One chat conversation read from the dataset (``{"messages": [...], "id": ...}``): ``media`` the
    sample's other files by name (``{"img0.png": b"..."}``, named by its image parts), ``bad`` what is
    wrong with a record that could not be read (its JSON), else None."""

    messages: list
    conversation_id: Any = None
    media: dict | None = None
    bad: str | None = None


@edataclass
class TokenizedSample(Sample):
    """One tokenized conversation: ``input_ids`` ``(L,)`` int64, ``loss_mask`` ``(L,)`` bool, ``media``
    its :class:`~sftpack.handoff.payload.Media` (None: text only); or one left out (``dropped`` its
    reason, no tokens)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    conversation_id: Any = None
    media: Any = None
    dropped: str | None = None


@edataclass
class PackedRowSample(Sample):
    """One packed row (``row`` is a :class:`~sftpack.PackedBatch` of ``max_seq_len`` slots) and the
    samples of its buffer left out beside it (``dropped``: ``(id, reason)``)."""

    row: PackedBatch
    dropped: tuple = ()


@stateless
def cook_conversation(sample: dict) -> ConversationSample:
    """A crude sample (a JSONL line, or a WebDataset ``KEY.json`` with the sample's image files as raw
    bytes) as a :class:`ConversationSample`; the id defaults to the sample's ``__key__``. A record that
    cannot be read (no ``.json``, JSON that does not parse, no ``messages``) comes out with ``bad`` set:
    the encoder raises on it by name (its key and shard) or, with ``on_bad_row="skip"``, counts it as
    ``bad_record``. (Energon's own JSONL reader parses each line before the cooker sees it: a bad line
    there raises Energon's error.)"""
    key = sample.get("__key__")
    data, problem = crude_json(sample)
    files = {k: v for k, v in sample.items() if k != "json" and not (k.startswith("__") and k.endswith("__"))}
    if data is None:
        return ConversationSample(
            **basic_sample_keys(sample), messages=[], conversation_id=key, media=files, bad=problem
        )
    cid = data.get("id", key)
    return ConversationSample(**basic_sample_keys(sample), messages=data["messages"], conversation_id=cid, media=files)


def _where(sample: Any, cid: Any) -> str:
    return f"{sample_where(sample.__key__, getattr(sample, '__sources__', None))} (id {cid!r})"


def _has_images(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") == "image"
        for msg in messages
        if isinstance(msg, dict) and isinstance(msg.get("content"), list)
        for part in msg["content"]
    )


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


class PackingTaskEncoder(CheckedTaskEncoder):
    """Tokenize conversations (with or without images) and pack them into ``max_seq_len`` rows in
    Energon's packing hooks.

    Args:
        tokenizer: a Hugging Face fast tokenizer with a chat template, for text conversations (or, with
            images, the family's tokenizer; default the family's ``tokenizer()``).
        max_seq_len: row width (vision placeholders count), a multiple of ``pad_multiple``.
        pad_multiple: per-sequence pad multiple (``2 * CP``).
        algorithm: a :func:`sftpack.binpack.pack` algorithm.
        overlong: conversations longer than a row: ``"split"`` (the default of every
            layer; Energon cannot split, so such a conversation raises
            :class:`~sftpack.sample.OverlongError`), ``"truncate"`` (text only: refused for a
            sample with media), ``"drop"`` (Energon skips a text sample; one with media is
            counted in ``dropped``) or ``"error"``.
        train_on: as :func:`sftpack.chat.tokenize_conversation`.
        pad_id: token id of padding slots (never a media placeholder).
        max_patches_per_row: vision patches per row, the second budget (``None``: tokens only); a
            sample over it is dropped and counted as ``over_patch_budget`` (``overlong="error"``:
            refused), as on every path.
        family: the model family of conversations with images (anything
            :func:`~sftpack.multimodal.family_for` takes; default Qwen2-VL). Given (or with a
            ``processor``), every conversation is tokenized for it with
            :func:`~sftpack.multimodal.tokenize_media_conversation`; else only those with an image part
            (and all of them without a ``tokenizer``), the others with the tokenizer's chat template.
        processor: the family's image processor (default its ``image_processor()``).
        on_bad_row: ``"error"`` (default; a bad image or record raises by name) or ``"skip"``
            (counted in ``dropped`` under its reason: ``bad_record``, or a
            :class:`~sftpack.multimodal.BadImageReason`).

    Samples may also arrive tokenized (an Energon ``Sample`` with ``input_ids``
    and ``loss_mask``, and optionally ``media``): ``encode_sample`` then only applies the
    over-long policy (and the patch budget).
    """

    cookers = (Cooker(cook_conversation),)
    decoder = None  # a sample's files reach the cooker as the shard's bytes; sftpack decodes the images

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        max_seq_len: int,
        pad_multiple: int = 1,
        algorithm: str = "bfd",
        overlong: str | Overlong = DEFAULT_OVERLONG,
        train_on: str = "all_assistant",
        pad_id: int = 0,
        max_patches_per_row: int | None = None,
        family: Any = None,
        processor: Any = None,
        on_bad_row: str = "error",
    ) -> None:
        super().__init__()
        who = "PackingTaskEncoder"
        self.overlong = choose(Overlong, overlong, "overlong")
        self.pad_multiple = positive_int("pad_multiple", pad_multiple, who=who)
        self.max_seq_len = check_width(positive_int("max_seq_len", max_seq_len, who=who), self.pad_multiple, who=who)
        self.tokenizer = tokenizer
        self.algorithm = algorithm
        self.train_on = train_on
        self.pad_id = check_pad_id(pad_id, "PackingTaskEncoder", ValueError)
        self.max_patches_per_row, self.on_bad_row = media_options(who, max_patches_per_row, self.overlong, on_bad_row)
        self.family: Family = family_for(family)
        self.processor = processor
        self._for_family = family is not None or processor is not None

    def _drop(self, sample: Any, cid: Any, reason: str) -> TokenizedSample:
        empty = np.zeros(0, dtype=np.int64)
        return TokenizedSample.derive_from(
            sample, input_ids=empty, loss_mask=empty.astype(bool), conversation_id=cid, dropped=reason
        )

    @stateless
    def encode_sample(self, sample: Any) -> TokenizedSample:
        if hasattr(sample, "input_ids"):
            ids = np.asarray(sample.input_ids, dtype=np.int64)
            mask = np.asarray(sample.loss_mask, dtype=bool)
            cid = getattr(sample, "conversation_id", None)
            media = getattr(sample, "media", None)
            if media is not None:
                return self._encoded_media(sample, SftSample(ids, mask, cid, media=media), cid)
        else:
            cid = getattr(sample, "conversation_id", None)
            bad = getattr(sample, "bad", None)
            if bad is not None:
                record = _where(sample, sample.__key__ if cid is None else cid)
                if self.on_bad_row == "error":
                    raise ValueError(
                        f"{record}: {bad}: fix or remove the sample and prepare the dataset again, or pass "
                        "on_bad_row='skip' to count it as a bad_record"
                    )
                return self._drop(sample, cid, "bad_record")
            if self._for_family or self.tokenizer is None or _has_images(sample.messages):
                return self._encode_media(sample)
            s = tokenize_conversation(
                sample.messages, self.tokenizer, train_on=self.train_on, conversation_id=sample.conversation_id
            )
            ids, mask, cid = s.input_ids, s.loss_mask, s.conversation_id
        n = int(ids.shape[0])
        spans = overlong_spans(n, self.max_seq_len, self.overlong, f"conversation {cid!r}", cid)
        if not spans:
            raise SkipSample()
        if len(spans) > 1:
            raise OverlongError(
                f"conversation {cid!r} has {n} tokens, more than max_seq_len={self.max_seq_len}, and Energon "
                "encodes one sample into one sample, so PackingTaskEncoder cannot split it: pass "
                "overlong='truncate' (keep the head) or 'drop', raise max_seq_len, or pack with "
                "sftpack.loader.PackingDataset (which splits)",
                cid,
                n,
                self.max_seq_len,
            )
        (a, b) = spans[0]
        ids, mask = ids[a:b], mask[a:b]
        return TokenizedSample.derive_from(sample, input_ids=ids, loss_mask=mask, conversation_id=cid)

    def _encode_media(self, sample: Any) -> TokenizedSample:
        """A conversation tokenized for the family (its image parts resolved to the sample's files)."""
        cid = getattr(sample, "conversation_id", None)
        cid = sample.__key__ if cid is None else cid
        record = _where(sample, cid)
        if self.overlong is Overlong.TRUNCATE:
            raise ValueError(
                f"{record}: overlong='truncate' is not offered for a conversation tokenized with its images (it "
                "could cut an image): use 'split', 'drop' or 'error'"
            )
        try:
            messages = _resolve(sample.messages, getattr(sample, "media", None) or {}, record)
            (s,) = tokenize_media_conversation(
                messages, tokenizer=self.tokenizer, processor=self.processor, conversation_id=cid, family=self.family
            )
        except BadImageError as e:
            if self.on_bad_row == "error":
                raise
            return self._drop(sample, cid, e.reason.value)
        except ValueError:
            if self.on_bad_row == "error":
                raise
            return self._drop(sample, cid, "bad_record")
        return self._encoded_media(sample, s, cid, record)

    def _encoded_media(self, sample: Any, s: SftSample, cid: Any, record: str | None = None) -> TokenizedSample:
        """The over-long policy and the patch budget of one sample with media (counted when left out)."""
        record = record if record is not None else _where(sample, cid)
        n = len(s)
        if n > self.max_seq_len:
            if self.overlong is Overlong.DROP:  # the reasons of PackingDataset's counts
                return self._drop(sample, cid, OVERLONG)
            cannot = (
                ", and Energon encodes one sample into one sample, so PackingTaskEncoder cannot split it"
                if self.overlong is Overlong.SPLIT
                else ""
            )
            if self.overlong is Overlong.TRUNCATE:
                cannot = ", and overlong='truncate' is not offered for a sample with media (it could cut an image)"
            raise OverlongError(
                f"{record} has {n} tokens (images included), more than max_seq_len={self.max_seq_len}{cannot}: "
                "pass overlong='drop' (counted in each batch's dropped), raise the budget, or lower the images' "
                "max_pixels",
                cid,
                n,
                self.max_seq_len,
            )
        reason = check_patch_budget([s], self.max_patches_per_row, self.overlong, who=str(record))  # every path's
        if reason is not None:
            return self._drop(sample, cid, reason)
        return TokenizedSample.derive_from(
            sample, input_ids=s.input_ids, loss_mask=s.loss_mask, conversation_id=cid, media=s.media
        )

    def select_samples_to_pack(self, samples: list[TokenizedSample]) -> list[list[TokenizedSample]]:
        """Every buffered sample in exactly one group: :func:`~sftpack.handoff.pack_rows` on the buffer
        (under the patch budget too when it holds media); the left-out ones ride with the first row."""
        kept = [s for s in samples if getattr(s, "dropped", None) is None]
        left = [s for s in samples if getattr(s, "dropped", None) is not None]
        if not kept:
            shown = ", ".join(f"{s.conversation_id} ({s.dropped})" for s in left[:10])
            more = f" and {len(left) - 10:,} more" if len(left) > 10 else ""
            warnings.warn(  # the one place these samples can be named: no row carries their count
                f"Energon buffer of {len(samples)} samples has no sample to pack (left out: {shown}{more}): "
                "no row to report them on",
                UserWarning,
                stacklevel=2,
            )
            raise SkipSample()
        lengths = np.fromiter((s.input_ids.shape[0] for s in kept), dtype=np.int64, count=len(kept))
        cap = self.max_patches_per_row
        patches = None
        if cap is not None and any(getattr(s, "media", None) is not None for s in kept):  # the second budget
            patches = np.array([0 if s.media is None else s.media.num_patches for s in kept], dtype=np.int64)
        rows = pack_rows(
            lengths,
            max_seq_len=self.max_seq_len,
            pad_multiple=self.pad_multiple,
            algorithm=self.algorithm,
            patches=patches,
            max_patches_per_row=None if patches is None else cap,
        )
        groups = [[kept[i] for i in row.tolist()] for row in rows]
        groups[0].extend(left)
        return groups

    @stateless
    def pack_selected_samples(self, samples: list[TokenizedSample]) -> PackedRowSample:
        kept = [s for s in samples if getattr(s, "dropped", None) is None]
        dropped = tuple((s.conversation_id, s.dropped) for s in samples if getattr(s, "dropped", None) is not None)
        if any(getattr(s, "media", None) is not None for s in kept):  # laid with their media, in row order
            row = PackedBatch.from_samples(
                [SftSample(s.input_ids, s.loss_mask, s.conversation_id, media=s.media) for s in kept],
                max_seq_len=self.max_seq_len,
                pad_multiple=self.pad_multiple,
                pad_id=self.pad_id,
            )
        else:
            row = build_row(
                np.concatenate([s.input_ids for s in kept]),
                np.concatenate([s.loss_mask for s in kept]),
                np.fromiter((s.input_ids.shape[0] for s in kept), dtype=np.int64, count=len(kept)),
                max_seq_len=self.max_seq_len,
                pad_multiple=self.pad_multiple,
                pad_id=self.pad_id,
                sequence_ids=[s.conversation_id for s in kept],
            )
        return PackedRowSample.derive_from(kept[0], row=row, dropped=dropped)

    @stateless
    def batch(self, samples: list[PackedRowSample]) -> EnergonPackedBatch:
        """``batch_size`` rows laid end to end (their media too) in one :class:`EnergonPackedBatch` (THD
        has no row axis); Energon fills in its ``__restore_key__``."""
        row = PackedBatch.concat([s.row for s in samples])
        return EnergonPackedBatch(
            **{f.name: getattr(row, f.name) for f in fields(PackedBatch)},
            __key__=tuple(s.__key__ for s in samples),
            dropped=tuple(d for s in samples for d in getattr(s, "dropped", ())),
        )
