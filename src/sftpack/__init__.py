"""sftpack: exact sequence packing of SFT conversations for variable-length attention.

Three moments to pack (``sftpack.offline``, ``sftpack.loader``, ``sftpack.trainer``),
one handoff (:class:`PackedBatch`, in ``sftpack.handoff``), one unit they all
consume (:class:`Sample`, in the torch-free ``sftpack.sample``).

The package face is lazy: ``import sftpack``, ``import sftpack.binpack`` and
``import sftpack.chat`` load no torch. ``sftpack.Sample`` and
``sftpack.IGNORE_INDEX`` come from ``sftpack.sample`` (numpy only);
``sftpack.PackedBatch`` loads the handoff (and torch) on first use, through the
module ``__getattr__`` below. ``_ALIASES`` lists every object reachable under a
second public path (these three among them), and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sample import IGNORE_INDEX, Sample

__all__ = ["IGNORE_INDEX", "PackedBatch", "Sample", "__version__"]
__version__ = "0.1.0"

#: Every object reachable under a second public path, on purpose: the second path -> the home.
#: Nothing else is exported twice (tests/test_public_api.py checks both directions).
_ALIASES = {
    # the top-level conveniences
    "sftpack.IGNORE_INDEX": "sftpack.sample.IGNORE_INDEX",
    "sftpack.Sample": "sftpack.sample.Sample",
    "sftpack.PackedBatch": "sftpack.handoff.PackedBatch",
    # the sample moved out of the handoff (torch-free); its old paths keep working
    "sftpack.handoff.IGNORE_INDEX": "sftpack.sample.IGNORE_INDEX",
    "sftpack.handoff.Sample": "sftpack.sample.Sample",
    "sftpack.handoff.as_sample": "sftpack.sample.as_sample",
    # the one over-long policy, where each layer's users look for it
    "sftpack.chat.Overlong": "sftpack.sample.Overlong",
    "sftpack.chat.OverlongError": "sftpack.sample.OverlongError",
    "sftpack.loader.Overlong": "sftpack.sample.Overlong",
    # names the contract (section 3) gives the trainer path
    "sftpack.trainer.shard_for_cp": "sftpack.handoff.shard_for_cp",
    "sftpack.trainer.unpack": "sftpack.handoff.unpack",
}

if TYPE_CHECKING:  # pragma: no cover
    from .handoff import PackedBatch


def __getattr__(name: str) -> Any:
    """``PackedBatch`` on first use: importing the handoff loads torch, which takes seconds."""
    if name == "PackedBatch":
        from .handoff import PackedBatch  # start-up: the handoff loads torch; `import sftpack` must not

        return PackedBatch
    raise AttributeError(f"module 'sftpack' has no attribute {name!r}")
