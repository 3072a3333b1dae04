"""The offline path: pack once, write rows to disk, re-read them identically every epoch.

``sftpack prepack`` (:func:`prepack`) turns conversations into a prepack
directory in three separable stages, then publishes it atomically:

1. read + tokenize (``_inputs``, ``_stage``; conversations with images: ``_encode``): samples
   stream into flat staging files (with their images' resized uint8 pixels); only the lengths
   (and conversation numbers, and each image's 40-byte record) stay in memory;
2. pack (``_plan``): :func:`sftpack.binpack.pack` on the padded lengths
   (:func:`sftpack.handoff.padded_lengths`, the row builder's own cost) gives
   a :class:`RowPlan` that fixes every sequence's place on disk (with images, their vision
   patches are the packer's weights under ``max_patches_per_row``);
3. write (``_write``): any range of rows from any token source, at the
   offsets the plan fixed, the images' media columns beside the tokens; then the index,
   checksums and manifest (``_format``, ``_fingerprint``) and the rename (``_publish``).

:class:`PrepackedDataset` (``_dataset``) reads a row back as the contract's
:class:`~sftpack.PackedBatch` (width ``max_seq_len``, tail folded into the last
segment, real and padded boundaries both kept; a prepack's images through
``_row_images``), in one epoch-seeded order of all rows whatever the world size, each step's
rows dealt to the data-parallel ranks by cost (``_shard``). ``_describe`` summarises a
prepack for ``sftpack inspect``; ``_bridge`` and ``_packed_jsonl`` convert to
and from Megatron-Bridge's packed Parquet and the upstream packed JSONL.

``prepack(..., images=True)`` writes conversations with images through the same stages:
their tokens as above, their images as resized uint8 pixels in row order (three more
files), read back by :class:`PrepackedDataset` as :class:`~sftpack.PackedBatch` rows with
``media``, the same bytes for any engine and ``num_proc``.

One driver (``_driver``) runs every prepack over an engine that runs stages 1
and 3: the local one (``_local``) or Ray's (``_ray``), the same bytes either
way; the options are one validated :class:`PrepackOptions` (``_options``). The
engine interface and the stage parts, for writing another engine, are the
extension module :mod:`sftpack.offline.engine`. What ``sftpack prepack`` and ``inspect`` take
besides, importable from here (never from the private modules: a contract in
``pyproject.toml``) and out of ``__all__``: ``check_row_width``, ``check_out_outside_inputs``,
``KnownLength`` and ``input_total`` (the tokenize bar's total), ``tokenizer_fingerprint``,
``input_fingerprints`` and ``save_histograms_png``.

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

from . import engine as engine  # the extension module, sftpack.offline.engine
from ._bridge import export_megatron_bridge, import_megatron_bridge
from ._dataset import PrepackedDataset
from ._describe import describe
from ._describe import save_histograms_png as save_histograms_png
from ._fingerprint import input_fingerprints as input_fingerprints
from ._fingerprint import tokenizer_fingerprint as tokenizer_fingerprint
from ._format import PrepackError, read_manifest
from ._format import check_row_width as check_row_width
from ._inputs import KnownLength as KnownLength
from ._inputs import check_out_outside_inputs as check_out_outside_inputs
from ._inputs import input_total as input_total
from ._options import PrepackOptions
from ._packed_jsonl import export_packed_jsonl, import_packed_jsonl
from ._plan import plan_rows as plan_rows  # not in __all__: benchmarks/bench_ray.py imports it here
from ._prepack import prepack, prepack_samples
from ._ray import prepack_ray
from ._result import PrepackResult

__all__ = [
    "PrepackError",
    "PrepackOptions",
    "PrepackResult",
    "PrepackedDataset",
    "describe",
    "export_megatron_bridge",
    "export_packed_jsonl",
    "import_megatron_bridge",
    "import_packed_jsonl",
    "prepack",
    "prepack_ray",
    "prepack_samples",
    "read_manifest",
]
