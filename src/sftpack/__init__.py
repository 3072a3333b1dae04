"""sftpack: exact sequence packing of SFT conversations for variable-length attention.

Three moments to pack (``sftpack.offline``, ``sftpack.loader``, ``sftpack.trainer``),
one handoff (:class:`PackedBatch`). Submodules import lazily so that
``import sftpack`` stays cheap (megatron-core and transformers are only loaded
by the adapters that need them).
"""

from __future__ import annotations

from .batch import PackedBatch
from .sample import IGNORE_INDEX, Sample

__all__ = ["IGNORE_INDEX", "PackedBatch", "Sample", "__version__"]
__version__ = "0.1.0"
