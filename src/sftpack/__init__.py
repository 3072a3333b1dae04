"""sftpack: exact sequence packing of SFT conversations for variable-length attention.

Three moments to pack (``sftpack.offline``, ``sftpack.loader``, ``sftpack.trainer``),
one handoff (:class:`PackedBatch`, in ``sftpack.handoff``). The package face is
lazy: ``import sftpack`` and ``import sftpack.binpack`` load no torch;
``sftpack.PackedBatch`` loads the handoff (and torch) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["IGNORE_INDEX", "PackedBatch", "Sample", "__version__"]
__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from .handoff import IGNORE_INDEX, PackedBatch, Sample


def __getattr__(name: str) -> Any:
    if name in ("IGNORE_INDEX", "PackedBatch", "Sample"):
        from . import handoff

        return getattr(handoff, name)
    raise AttributeError(f"module 'sftpack' has no attribute {name!r}")
