"""The handoff's error: a :class:`~sftpack.PackedBatch` (or the arrays of a row) breaks the contract.

Its own module, below both :mod:`.build` (which raises it while laying a row)
and :mod:`.batch` (which raises it while validating one), so neither imports the other
for it.
"""

from __future__ import annotations

__all__ = ["PackedBatchError"]


class PackedBatchError(ValueError):
    """A :class:`~sftpack.PackedBatch` field breaks the contract (the message names it)."""
