"""The trainer path: pack an already padded ``[B, S]`` batch at the training step.

The data loader hands the step an ordinary right-padded batch; :func:`pack_step`
turns it, on whatever device it lives, into one flat :class:`~sftpack.PackedBatch`
as wide as this batch needs. Batch ``[2, 10]`` with lengths 5 and 10, each
sequence padded to a multiple of 4 (context parallelism 2)::

    input_ids [B, S]          A A A A A . . . . .        pack_step        A A A A A . . . | B B B B B B B B B B . .
                              B B B B B B B B B B    ------------->       cu_seqlens        [0, 5, 15]
                                                                          cu_seqlens_padded [0, 8, 20]

Everything is a handful of vectorised tensor operations over the ``T`` output
slots (no Python loop over sequences or tokens), so the same code runs on CPU
and CUDA tensors. The only host synchronisation is the one the output shape
needs: ``T``, ``N`` and ``max_seqlen`` (plus the input checks) come back in one
small transfer. ``benchmarks/bench_trainer.py`` measures packing against a bare
boolean-mask gather of the real tokens, the least any packer must do (the numbers
are in ``benchmarks/RESULTS.md``).

The path itself:

- ``_step``: :func:`pack_step`, made of three units: ``_step_input`` (the batch,
  options and each row's length, checked), ``_step_layout`` (the row's shape in one
  host transfer, its boundaries, its slots) and ``_step_payload`` (the rows' media,
  checked and laid at the packed offsets).
- ``_plan``: :func:`plan_microbatches`, micro-batches of at most ``max_seq_len``
  padded tokens (the row width, as everywhere in sftpack) balanced over data-parallel
  ranks (bins from :mod:`sftpack.binpack`).
- ``_padded``: :func:`padded_batch`, samples to the right-padded ``[B, S]``
  batch an unpacked loader hands over (the input of :func:`pack_step`).

Samples with images are the same samples (``sample.media``): :func:`padded_batch`
pads their tokens like any others, and :func:`pack_step` takes their media with
``media=[s.media for s in samples]`` (one entry per padded row, ``None`` for a row
without) and lays it at the packed offsets, so the row is field for field what
:meth:`PackedBatch.from_samples <sftpack.PackedBatch.from_samples>` builds;
:func:`plan_microbatches` takes their vision patches as a second budget
(``patches=``, ``max_patches_per_row=``).

What every path shares lives in :mod:`sftpack.handoff` and is imported from
there (:func:`~sftpack.handoff.pad_multiple_for`, :func:`~sftpack.handoff.shard_for_cp`,
:func:`~sftpack.handoff.unpack`, ...). The contract names two of them here,
``sftpack.trainer.shard_for_cp`` and ``sftpack.trainer.unpack``: they stay
reachable as aliases (listed in ``sftpack._ALIASES``), not in ``__all__``. The
loss normalisation lives in :mod:`sftpack.loss`.
"""

from __future__ import annotations

from ..handoff import shard_for_cp as shard_for_cp  # the contract's names (sftpack._ALIASES)
from ..handoff import unpack as unpack
from ._padded import padded_batch
from ._plan import MicrobatchPlan, PlanError, plan_microbatches
from ._step import pack_step

__all__ = [
    "MicrobatchPlan",
    "PlanError",
    "pack_step",
    "padded_batch",
    "plan_microbatches",
]
