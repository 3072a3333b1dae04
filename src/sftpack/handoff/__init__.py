"""The handoff: what every packing path gives the model, and every operation on it.

Every path (:mod:`sftpack.offline`, :mod:`sftpack.loader`, :mod:`sftpack.trainer`)
ends here and every consumer (:mod:`sftpack.attention`, :mod:`sftpack.loss`,
Megatron, Hugging Face, flash-attn) starts here. The paths take these names from
this package, never from each other. ``__all__`` is the face; the building
blocks (``cp_slot_indices``, ``real_token_mask``, ``slot_layout``, ``lay_row``)
stay in their modules. :class:`~sftpack.Sample`, ``as_sample`` and
``IGNORE_INDEX`` live in :mod:`sftpack.sample` and are reachable here too
(aliases listed in ``sftpack._ALIASES``).

- ``errors``: :class:`PackedBatchError`.
- ``layout``: the row layout in numpy (``lay_row``), :func:`padded_lengths` (the
  bin cost that equals what it lays) and :func:`pack_rows` (the one row planner
  on that cost). Below ``batch``: it never imports it.
- ``media``: the media fields of a row with images (``check_pixel_values``, the media
  part of validation and of ``concat``). Below ``batch``: it reads a row through a protocol.
- ``batch``: :class:`PackedBatch`, its validation and kernel adapters.
- ``build``: :func:`build_row`, a row from flat arrays (``layout`` then ``batch``).
- ``align``: :func:`pad_multiple_for`, the multiples CP / TP / FP8 need.
- ``cp``: :func:`shard_for_cp`, :func:`unshard_cp`, :class:`CPShard` (and ``cp_slot_indices``).
- ``slots``: :func:`segment_ids` (and ``real_token_mask``, ``slot_layout``) from the boundaries.
  Below ``batch``: it reads a row through a protocol.
- ``unpack``: :func:`unpack`, :func:`unpack_padded`.
"""

from __future__ import annotations

from ..sample import IGNORE_INDEX as IGNORE_INDEX  # aliases of sftpack.sample's (sftpack._ALIASES)
from ..sample import Sample as Sample
from ..sample import as_sample as as_sample
from .align import Alignment, AlignmentError, FP8Recipe, pad_multiple_for
from .batch import PackedBatch
from .build import build_row
from .cp import CPShard, shard_for_cp, unshard_cp
from .errors import PackedBatchError
from .layout import pack_rows, padded_lengths
from .slots import segment_ids
from .unpack import unpack, unpack_padded

__all__ = [
    "Alignment",
    "AlignmentError",
    "CPShard",
    "FP8Recipe",
    "PackedBatch",
    "PackedBatchError",
    "build_row",
    "pack_rows",
    "pad_multiple_for",
    "padded_lengths",
    "segment_ids",
    "shard_for_cp",
    "unpack",
    "unpack_padded",
    "unshard_cp",
]
