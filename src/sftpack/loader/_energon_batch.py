"""The batch both Energon task encoders return (text: :mod:`sftpack.loader.energon`; with
images: ``sftpack.loader._energon_media``), apart so that neither module imports the other."""

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
            re-packs them into an equal batch (same tokens, labels, boundaries and ids).
    """

    __key__: tuple = ()
    __restore_key__: tuple = field(default=())
