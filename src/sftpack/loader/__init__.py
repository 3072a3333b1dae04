"""The loader path: pack while streaming, into rows of exactly ``max_seq_len``.

The second packing moment. A bounded buffer of tokenized samples is
bin-packed into rows that are always ``max_seq_len`` wide; each sequence is
padded to a multiple (``2 * CP``) and the kernel gets the padded boundary
array for both ``cu_seqlens`` and ``cu_seqlens_padded`` (``pad_between_seqs=False``,
:meth:`PackingDataset.packed_seq_params`), which keeps Transformer Engine's
FlashAttention-2 usable. Streaming::

    samples ──▶ share of (rank, worker) ──▶ buffer (buffer_size) ──pack_rows──▶ rows ──build_row──▶ PackedBatch
                                                 ▲                    │
                                                 └── under-filled rows wait (≤ max_wait rounds)

One concept per module:

- ``_source``: a worker's share of an epoch, by source index; the over-long
  policy (:class:`sftpack.sample.Overlong`) applied before costing.
- ``_hold``: ``hold_back``, which under-filled rows wait; the rows themselves
  come from the one row planner, :func:`sftpack.handoff.pack_rows` (BFD on
  ``padded_lengths``, the cost the builder lays).
- ``_settings``: :class:`LoaderSettings <sftpack.loader._settings.LoaderSettings>`, the
  dataset's arguments checked once into a frozen object (what a state's ``config`` records).
- ``_cut``: a source item (a sample with or without media, or a conversation tokenized in
  the worker) to buffer items under the over-long policy and the patch budget.
- ``_round``: one buffer planned into rows, the under-filled ones held back (``_hold``).
- ``_row``: a decided row of items laid as a :class:`~sftpack.PackedBatch` (its media too).
- ``_decided``: :class:`DecidedRow`, a decided row not yet laid (its lengths and ids; ``build()``
  lays it): :meth:`PackingDataset.decided_rows` yields them, so ranks sharing one stream lay
  only their own rows.
- ``_stream``: the streaming engine, one share's position (epoch, cursor, buffer, decided
  rows, counts) and the rounds that move it.
- ``_dataset``: :class:`PackingDataset`, the engine over a source: shares, ``iter()``, exact
  resume; samples with or without media (any mix), or conversations tokenized in the worker
  (rows with ``media`` planned under a token and a patch budget, ``max_patches_per_row``);
  with ``groups=True``, each group (a preference pair) read, dealt and planned as one unit, in
  one row; per-token weights laid into the row's ``weights``.
- ``_state``: the index-only state and its checks (:class:`StateError`).
- ``_stats``: :class:`LoaderStats` (samples in, rows out, fill, images and patches out,
  split / truncated / dropped by reason).
- ``resume``: :class:`StatefulLoader`, torchdata's ``StatefulDataLoader`` with a
  clear error for a state of another ``num_workers`` (needs ``torchdata``).
- ``energon``: :class:`PackingTaskEncoder`, the same rule in Megatron-Energon's
  packing hooks, for conversations with or without images; its batches are
  :class:`EnergonPackedBatch` (a ``PackedBatch`` with Energon's restore key and the
  samples left out) (needs ``megatron-energon``; both load on first use).
- ``_example``: :func:`worked_example_row`, the contract's worked example.

>>> row = worked_example_row()
>>> row.num_tokens, row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist()
(36, [0, 5, 15], [0, 8, 36])
"""

from __future__ import annotations

import importlib
from typing import Any

from ..sample import Overlong as Overlong  # an alias of sftpack.sample.Overlong, listed in sftpack._ALIASES
from ._dataset import PAD_BETWEEN_SEQS, PackingDataset
from ._decided import DecidedRow
from ._example import worked_example_row
from ._state import StateError
from ._stats import LoaderStats

_LAZY = {
    "StatefulLoader": "resume",
    "saved_num_workers": "resume",
    "PackingTaskEncoder": "energon",
    "EnergonPackedBatch": "energon",
}

__all__ = [
    "PAD_BETWEEN_SEQS",
    "DecidedRow",
    "EnergonPackedBatch",
    "LoaderStats",
    "PackingDataset",
    "PackingTaskEncoder",
    "StateError",
    "StatefulLoader",
    "saved_num_workers",
    "worked_example_row",
]


def __getattr__(name: str) -> Any:
    """Optional parts (torchdata, megatron-energon) load on first use."""
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
