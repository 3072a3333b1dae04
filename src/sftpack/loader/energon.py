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
(``overlong="split"``, every layer's default: nothing lost unasked) such a
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

Conversations with images: :class:`MultimodalPackingTaskEncoder` (in
``sftpack.loader._energon_media``, loaded on first use from here) reads a crude
WebDataset of ``KEY.json`` conversations in the Hugging Face multimodal chat format
with their image files beside them, tokenizes them for Qwen2-VL, plans each buffer
with :func:`sftpack.multimodal.plan_rows` (token and patch budgets) and lays each
row with :func:`sftpack.multimodal.build_multimodal_row`; its batches are
:class:`EnergonMultimodalBatch` (media fields set, samples left out counted in
``dropped``). See docs/energon_multimodal.md.

This module imports ``megatron.energon``; ``import sftpack.loader`` does not
(``sftpack.loader.PackingTaskEncoder`` loads it on first use).
"""

from __future__ import annotations

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
from ..sample import DEFAULT_OVERLONG, Overlong, OverlongError, overlong_spans
from ._energon_base import CheckedTaskEncoder, crude_json, sample_where
from ._energon_batch import EnergonPackedBatch

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
    """One chat conversation read from the dataset (``{"messages": [...]}``)."""

    messages: list
    conversation_id: Any = None


@edataclass
class TokenizedSample(Sample):
    """One tokenized conversation: ``input_ids`` ``(L,)`` int64, ``loss_mask`` ``(L,)`` bool."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    conversation_id: Any = None


@edataclass
class PackedRowSample(Sample):
    """One packed row (``row`` is a :class:`~sftpack.PackedBatch` of ``max_seq_len`` slots)."""

    row: PackedBatch


@stateless
def cook_conversation(sample: dict) -> ConversationSample:
    """A JSONL line ``{"messages": [...], "id": ...}`` (Energon's crude sample) as a
    :class:`ConversationSample`; the id defaults to the sample's ``__key__``. A sample whose JSON does
    not parse or has no ``messages`` raises a ``ValueError`` naming its key and shard. (Energon's own
    JSONL reader parses each line before the cooker sees it: a bad line there raises Energon's error.)"""
    data, problem = crude_json(sample)
    if data is None:
        raise ValueError(
            f"{sample_where(sample.get('__key__'), sample.get('__sources__'))}: {problem}: fix or remove the sample "
            "and prepare the dataset again"
        )
    cid = data.get("id", sample.get("__key__"))
    return ConversationSample(**basic_sample_keys(sample), messages=data["messages"], conversation_id=cid)


class PackingTaskEncoder(CheckedTaskEncoder):
    """Tokenize conversations and pack them into ``max_seq_len`` rows in Energon's packing hooks.

    Args:
        tokenizer: a Hugging Face fast tokenizer with a chat template.
        max_seq_len: row width, a multiple of ``pad_multiple``.
        pad_multiple: per-sequence pad multiple (``2 * CP``).
        algorithm: a :func:`sftpack.binpack.pack` algorithm.
        overlong: conversations longer than a row: ``"split"`` (the default of every
            layer; Energon cannot split, so such a conversation raises
            :class:`~sftpack.sample.OverlongError`), ``"truncate"``, ``"drop"``
            (Energon skips the sample) or ``"error"``.
        train_on: as :func:`sftpack.chat.tokenize_conversation`.
        pad_id: token id of padding slots.

    Samples may also arrive tokenized (an Energon ``Sample`` with ``input_ids``
    and ``loss_mask``): ``encode_sample`` then only applies the over-long policy.
    """

    cookers = (Cooker(cook_conversation),)

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

    @stateless
    def encode_sample(self, sample: Any) -> TokenizedSample:
        if hasattr(sample, "input_ids"):
            ids = np.asarray(sample.input_ids, dtype=np.int64)
            mask = np.asarray(sample.loss_mask, dtype=bool)
            cid = getattr(sample, "conversation_id", None)
        else:
            if self.tokenizer is None:
                raise TypeError(
                    "PackingTaskEncoder: a sample of messages needs a tokenizer: pass PackingTaskEncoder(tokenizer, ...)"
                )
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

    def select_samples_to_pack(self, samples: list[TokenizedSample]) -> list[list[TokenizedSample]]:
        """Every buffered sample in exactly one group: :func:`~sftpack.handoff.pack_rows` on the buffer."""
        lengths = np.fromiter((s.input_ids.shape[0] for s in samples), dtype=np.int64, count=len(samples))
        rows = pack_rows(
            lengths, max_seq_len=self.max_seq_len, pad_multiple=self.pad_multiple, algorithm=self.algorithm
        )
        return [[samples[i] for i in row.tolist()] for row in rows]

    @stateless
    def pack_selected_samples(self, samples: list[TokenizedSample]) -> PackedRowSample:
        row = build_row(
            np.concatenate([s.input_ids for s in samples]),
            np.concatenate([s.loss_mask for s in samples]),
            np.fromiter((s.input_ids.shape[0] for s in samples), dtype=np.int64, count=len(samples)),
            row_width=self.max_seq_len,
            pad_multiple=self.pad_multiple,
            pad_id=self.pad_id,
            sequence_ids=[s.conversation_id for s in samples],
        )
        return PackedRowSample.derive_from(samples[0], row=row)

    @stateless
    def batch(self, samples: list[PackedRowSample]) -> EnergonPackedBatch:
        """``batch_size`` rows laid end to end in one :class:`EnergonPackedBatch` (THD has no row
        axis); Energon fills in its ``__restore_key__``."""
        row = PackedBatch.concat([s.row for s in samples])
        return EnergonPackedBatch(
            **{f.name: getattr(row, f.name) for f in fields(PackedBatch)},
            __key__=tuple(s.__key__ for s in samples),
        )


# ---------------------------------------------------------------- conversations with images
_MULTIMODAL = (
    "EncodedMultimodalSample",
    "EnergonMultimodalBatch",
    "MultimodalConversationSample",
    "MultimodalPackingTaskEncoder",
    "MultimodalRowSample",
    "cook_multimodal",
)
__all__ += list(_MULTIMODAL)


def __getattr__(name: str) -> Any:
    """The multimodal encoder and its types (``sftpack.loader._energon_media``, which builds on this
    module's :class:`EnergonPackedBatch`), loaded on first use."""
    if name in _MULTIMODAL:
        from . import _energon_media

        return getattr(_energon_media, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
