"""The media of a :func:`~sftpack.trainer.pack_step` batch: checked against it, then laid at the packed offsets.

``media`` holds one entry per batch row: the :class:`~sftpack.handoff.payload.Media` of the
sample the row holds (slots relative to the sample) or ``None``. :func:`check_media` makes the
cheap checks (counts, one kind and placeholder id, never ``pad_id``); :func:`lay_media` lays
the kept rows' media at their packed offsets (:meth:`Media.lay
<sftpack.handoff.payload.Media.lay>`), as :meth:`PackedBatch.from_samples
<sftpack.PackedBatch.from_samples>` lays them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..handoff import PackedBatch, PackedBatchError
from ..handoff.payload import Media

__all__ = ["check_media", "lay_media"]


def check_media(media: Sequence[Media | None] | None, B: int, pad_id: int) -> list[Media | None] | None:
    """``media`` checked against the batch: ``B`` entries of one kind and placeholder id
    (never ``pad_id``); ``None`` when no row has media."""
    if media is None:
        return None
    if isinstance(media, Media) or not isinstance(media, Sequence):
        raise PackedBatchError(
            f"pack_step: media must be a sequence of B={B} entries (a Media or None per row), got "
            f"{type(media).__name__}"
        )
    parts = list(media)
    if len(parts) != B:
        raise PackedBatchError(f"pack_step: media has {len(parts)} entries for a batch of B={B} rows; give one per row")
    real = [(b, m) for b, m in enumerate(parts) if m is not None]
    for b, m in real:
        if not isinstance(m, Media):
            raise PackedBatchError(f"pack_step: media[{b}] is a {type(m).__name__}, not a Media or None")
    if not real:
        return None
    b0, first = real[0]
    for b, m in real:
        if type(m) is not type(first) or int(m.token_id) != int(first.token_id):
            raise PackedBatchError(
                f"pack_step: media[{b0}] is a {type(first).__name__} with placeholder {first.token_id} but "
                f"media[{b}] a {type(m).__name__} with placeholder {m.token_id}: one row feeds one vision tower"
            )
    if int(pad_id) == int(first.token_id):
        raise PackedBatchError(
            f"pack_step: pad_id {pad_id} is the media placeholder id; pad with another token (the tokenizer's pad)"
        )
    return parts


def lay_media(parts: list[Media | None], batch: PackedBatch, dev: torch.device) -> Media | None:
    """The rows' media laid at their packed offsets (on the host, where the samples' media
    live; one transfer of the boundaries), then moved to ``dev``."""
    assert batch.source_rows is not None
    cup = batch.cu_seqlens_padded.tolist()
    lens = batch.seqlens.tolist()
    kept = [parts[r] for r in batch.source_rows]
    kept_rows = set(batch.source_rows)
    dropped = [r for r, m in enumerate(parts) if m is not None and m.num_items and r not in kept_rows]
    if dropped:
        raise PackedBatchError(f"pack_step: row {dropped[0]} is empty (length 0) but media[{dropped[0]}] has items")
    for r, m, L in zip(batch.source_rows, kept, lens):
        pos = getattr(m, "positions", None)
        if pos is not None and tuple(pos.shape) != (3, L):
            raise PackedBatchError(
                f"pack_step: media[{r}].positions has shape {tuple(pos.shape)} but row {r} holds {L} tokens: "
                f"give each row its own sample's media, (3, {L}) positions"
            )
    if all(m is None for m in kept):  # media only on empty rows, without items
        return None
    out = Media.lay(
        kept,
        lengths=lens,
        offsets=cup[:-1],
        widths=[b - a for a, b in zip(cup[:-1], cup[1:])],
        segments=[1] * len(kept),
    )
    return out.to(dev) if out.device != dev else out
