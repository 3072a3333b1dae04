"""sftpack: exact sequence packing of SFT conversations for variable-length attention.

Three moments to pack (``sftpack.offline``, ``sftpack.loader``, ``sftpack.trainer``),
one handoff (:class:`PackedBatch`, in ``sftpack.handoff``), one unit they all
consume (:class:`Sample`, in the torch-free ``sftpack.sample``).

The package face is lazy: ``import sftpack``, ``import sftpack.binpack`` and
``import sftpack.chat`` load no torch. ``sftpack.Sample`` and
``sftpack.IGNORE_INDEX`` come from ``sftpack.sample`` (numpy only);
``sftpack.PackedBatch`` loads the handoff (and torch) on first use, through the
module ``__getattr__`` below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sample import IGNORE_INDEX, Sample

__all__ = ["IGNORE_INDEX", "PackedBatch", "Sample", "__version__"]
__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from .handoff import PackedBatch


def __getattr__(name: str) -> Any:
    """``PackedBatch`` on first use: importing the handoff loads torch (~3 s)."""
    if name == "PackedBatch":
        from .handoff import PackedBatch

        return PackedBatch
    raise AttributeError(f"module 'sftpack' has no attribute {name!r}")
