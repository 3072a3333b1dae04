"""The baseline's micro-batch: right-padded ``[b, S]`` rows (:class:`PaddedMicroBatch`), its
labels shifted within each row and its rows' media laid over its slots; and
:data:`MicroBatch`, what a source (:mod:`sftpack.loop._sources`) hands the loop: a packed
row or a padded batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..handoff import PackedBatch
from ..handoff.payload import Media
from ..sample import IGNORE_INDEX, Sample
from ..trainer import padded_batch

__all__ = ["MicroBatch", "PaddedMicroBatch", "media_of", "padded_micro_batch"]


@dataclass
class PaddedMicroBatch:
    """A right-padded ``[b, S]`` batch, the unpacked baseline's micro-batch.

    Attributes:
        input_ids: ``(b, S)`` int64, padding holds ``pad_id``.
        labels: ``(b, S)`` int64, already shifted like :attr:`PackedBatch.labels`:
            ``labels[i, t] = input_ids[i, t+1]`` when token ``t+1`` is real and
            trainable, else -100.
        lengths: ``(b,)`` int64 real lengths.
        sequence_ids: the conversation id of each row.
        media: the rows' media (samples with images) laid over the ``b * S`` slots
            row after row (:meth:`Media.lay <sftpack.handoff.payload.Media.lay>`: row
            ``i``'s runs at ``i * S``, its multimodal positions continuing through its
            padding); ``None`` without media.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor
    sequence_ids: tuple
    media: Media | None = None

    @property
    def num_media_items(self) -> int:
        return 0 if self.media is None else self.media.num_items

    @property
    def num_real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> PaddedMicroBatch:
        return PaddedMicroBatch(
            self.input_ids.to(device),
            self.labels.to(device),
            self.lengths,
            self.sequence_ids,
            None if self.media is None else self.media.to(device),
        )


#: what a source hands the loop: a packed row (the three paths) or a padded batch (the baseline)
MicroBatch = PackedBatch | PaddedMicroBatch


def padded_micro_batch(samples: Sequence[Sample], *, pad_id: int = 0) -> PaddedMicroBatch:
    """Right-pad ``samples`` to their longest and shift the labels within each row.

    >>> from sftpack.testing import samples_from_lengths
    >>> mb = padded_micro_batch(samples_from_lengths([2, 3]))
    >>> mb.labels.tolist()
    [[1001, -100, -100], [2001, 2002, -100]]
    """
    ids, lengths, mask = padded_batch(samples, pad_id=pad_id)
    S = ids.shape[1]
    nxt_real = torch.arange(1, S + 1)[None, :] < lengths[:, None]  # token t+1 exists
    nxt_mask = torch.zeros_like(mask)
    nxt_mask[:, :-1] = mask[:, 1:]
    nxt_ids = torch.full_like(ids, IGNORE_INDEX)
    nxt_ids[:, :-1] = ids[:, 1:]
    labels = torch.where(nxt_real & nxt_mask, nxt_ids, torch.full_like(ids, IGNORE_INDEX))
    return PaddedMicroBatch(
        ids, labels, lengths, tuple(s.conversation_id for s in samples), _padded_media(samples, S, pad_id)
    )


def _padded_media(samples: Sequence[Sample], S: int, pad_id: int) -> Media | None:
    """The samples' media laid over a right-padded ``[b, S]`` batch, row after row."""
    parts = [s.media for s in samples]
    first = next((m for m in parts if m is not None), None)
    if first is None:
        return None
    if int(pad_id) == int(first.token_id):
        raise ValueError(f"pad_id {pad_id} is the media placeholder id; pad with another token (the tokenizer's pad)")
    return first.lay(
        parts,
        lengths=[len(s) for s in samples],
        offsets=[i * S for i in range(len(samples))],
        widths=[S] * len(samples),
        segments=[1] * len(samples),
    )


def media_of(samples: Sequence[Sample]) -> list[Media | None] | None:
    """Each sample's media, for :func:`~sftpack.trainer.pack_step`'s ``media=`` (``None``: none has any)."""
    parts = [s.media for s in samples]
    return parts if any(m is not None for m in parts) else None
