"""The batch the Energon task encoder (:mod:`sftpack.loader.energon`) returns, apart so that
the package names it without importing Megatron-Energon."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..handoff import PackedBatch

__all__ = ["EnergonPackedBatch"]


@dataclass(eq=False, repr=False)
class EnergonPackedBatch(PackedBatch):
    """A :class:`~sftpack.PackedBatch` that carries Energon's sample metadata (the contract's
    fields unchanged; the two extra fields have defaults, as the contract allows).

    Attributes:
        __key__: the Energon ``__key__`` of each row's first sample, one per row.
        __restore_key__: set by Energon's batcher and loader as the batch passes through them;
            ``loader.restore_sample(batch.__restore_key__)`` re-reads the row's samples and
            re-packs them into an equal batch (same tokens, labels, boundaries, ids and media).
        dropped: ``(id, reason)`` of each sample left out and counted in the buffers of these rows
            (``on_bad_row="skip"``, a sample with media over-long under ``overlong="drop"`` or over
            the patch budget); empty for text.
    """

    __key__: tuple = ()
    __restore_key__: tuple = field(default=())
    dropped: tuple = ()
