"""The offline path: pack once, write rows to disk, re-read them identically every epoch.

``sftpack prepack`` (:func:`prepack`) turns conversations into a prepack
directory in three separable stages, then publishes it atomically:

1. read + tokenize (``_stage``): samples stream into flat staging files; only
   the lengths (and conversation numbers) stay in memory;
2. pack (``_plan``): :func:`sftpack.binpack.pack` on the padded lengths
   (:func:`sftpack.handoff.padded_lengths`, the row builder's own cost) gives
   a :class:`RowPlan` that fixes every sequence's place on disk;
3. write (``_write``): any range of rows from any token source, at the
   offsets the plan fixed; then the index, checksums and manifest (``_format``,
   ``_fingerprint``) and the rename (``_publish``).

:class:`PrepackedDataset` (``_dataset``) reads a row back as the contract's
:class:`~sftpack.PackedBatch` (width ``max_seq_len``, tail folded into the last
segment, real and padded boundaries both kept), with epoch-seeded order and
data-parallel shards balanced by tokens (``_shard``). ``_describe`` summarises a
prepack for ``sftpack inspect``; ``_bridge`` and ``_packed_jsonl`` convert to
and from Megatron-Bridge's packed Parquet and the upstream packed JSONL.

The format (one row of two conversations, ``max_seq_len=16``)::

    tokens.npy     ... A0 A1 A2 A3 A4 B0 B1 B2 B3 B4 B5 B6 B7 B8 B9 ...   uint8/16/32, no padding
    loss_mask.npy  ... F  F  T  T  T  F  F  T  T  T  T  T  T  T  T  ...   bool
    sequences.npy  (start=s, length=5, conversation=c, piece=0), (start=s+5, length=10, conversation=c+1, piece=0)
    rows.npy       (sequence=i, token=s), then the next row's (i+2, s+15)
    row read back  A A A A A B B B B B B B B B B .     cu_seqlens [0, 5, 15]  cu_seqlens_padded [0, 5, 16]

>>> import tempfile, numpy as np
>>> from sftpack import Sample
>>> a = Sample(np.arange(1, 6), np.ones(5, bool), "A")
>>> b = Sample(np.arange(101, 111), np.ones(10, bool), "B")
>>> out = prepack_samples([a, b], tempfile.mkdtemp() + "/ab", max_seq_len=16).path
>>> ds = PrepackedDataset(out, verify="full")
>>> len(ds), ds[0].cu_seqlens_padded.tolist(), ds.manifest["counts"]["fill"]
(1, [0, 5, 16], 0.9375)
"""

from __future__ import annotations

from ._bridge import export_megatron_bridge, import_megatron_bridge
from ._dataset import PrepackedDataset, Verify
from ._describe import Description, describe
from ._fingerprint import tokenizer_fingerprint
from ._format import FORMAT_VERSION, PrepackError, read_manifest
from ._packed_jsonl import export_packed_jsonl, import_packed_jsonl, split_packed_messages
from ._plan import RowPlan, plan_from_membership, plan_rows
from ._prepack import Engine, PrepackResult, prepack, prepack_samples
from ._ray import RayPrepackResult, prepack_ray, ray_session
from ._shard import Balance, epoch_rows
from ._stage import StagedSamples, StagingSource, stage_samples
from ._write import allocate, write_index, write_rows

__all__ = [
    "FORMAT_VERSION",
    "Balance",
    "Description",
    "Engine",
    "PrepackError",
    "PrepackResult",
    "PrepackedDataset",
    "RayPrepackResult",
    "RowPlan",
    "StagedSamples",
    "StagingSource",
    "Verify",
    "allocate",
    "describe",
    "epoch_rows",
    "export_megatron_bridge",
    "export_packed_jsonl",
    "import_megatron_bridge",
    "import_packed_jsonl",
    "plan_from_membership",
    "plan_rows",
    "prepack",
    "prepack_ray",
    "prepack_samples",
    "ray_session",
    "read_manifest",
    "split_packed_messages",
    "stage_samples",
    "tokenizer_fingerprint",
    "write_index",
    "write_rows",
]
