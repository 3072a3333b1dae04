"""The handoff: what every packing path gives the model, and every operation on it.

Every path (:mod:`sftpack.offline`, :mod:`sftpack.loader`, :mod:`sftpack.trainer`)
ends here and every consumer (:mod:`sftpack.attention`, :mod:`sftpack.loss`,
Megatron, Hugging Face, flash-attn) starts here. The paths take these names from
this package, never from each other.

- ``sample``: :class:`Sample`, one tokenized conversation; ``IGNORE_INDEX``.
- ``errors``: :class:`PackedBatchError`.
- ``build``: the row layout in numpy (``lay_row``), :func:`padded_lengths` (the
  bin cost that equals what it lays) and :func:`pack_rows` (the one row planner
  on that cost). Below ``batch``: it never imports it.
- ``batch``: :class:`PackedBatch`, its validation and kernel adapters, and
  :func:`build_row` (a row from flat arrays, as tensors).
- ``align``: :func:`pad_multiple_for`, the multiples CP / TP / FP8 need.
- ``cp``: :func:`shard_for_cp`, :func:`unshard_cp`, :class:`CPShard`.
- ``slots``: :func:`segment_ids`, :func:`real_token_mask` from the boundaries.
- ``unpack``: :func:`unpack`, :func:`unpack_padded`.
"""

from __future__ import annotations

from ..sample import IGNORE_INDEX, Sample, as_sample
from .align import Alignment, AlignmentError, FP8Recipe, pad_multiple_for
from .batch import PackedBatch, build_row
from .build import pack_rows, padded_lengths
from .cp import CPShard, cp_slot_indices, shard_for_cp, unshard_cp
from .errors import PackedBatchError
from .slots import real_token_mask, segment_ids, slot_layout
from .unpack import unpack, unpack_padded

__all__ = [
    "IGNORE_INDEX",
    "Alignment",
    "AlignmentError",
    "CPShard",
    "FP8Recipe",
    "PackedBatch",
    "PackedBatchError",
    "Sample",
    "as_sample",
    "build_row",
    "pack_rows",
    "cp_slot_indices",
    "pad_multiple_for",
    "padded_lengths",
    "real_token_mask",
    "segment_ids",
    "shard_for_cp",
    "slot_layout",
    "unpack",
    "unpack_padded",
    "unshard_cp",
]
