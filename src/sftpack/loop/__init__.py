"""Training end to end on rows from any path, and the same training as unpacked.

A small, readable loop for a Hugging Face causal LM (``sftpack train`` wraps it):
AdamW, warm-up + cosine/linear decay, gradient accumulation, clipping, the global
token-mean loss of :mod:`sftpack.loss`, seeded everything, DDP over
``torch.distributed`` (``torchrun``; gloo on CPU, NCCL on GPU), atomic
checksummed checkpoints with exact resume, and a JSONL log per step. A step whose
loss or gradient is not finite stops the run (or is skipped and counted), data
with no supervised target is refused, and a step with none is skipped and counted.

- ``_options``: :class:`TrainConfig`, :class:`Packing`, :class:`Boundaries`, :class:`Schedule`.
- ``_sources``: per-path sources of micro-batches with resumable positions
  (:class:`TrainerSource`, :class:`PaddedSource`, :class:`OfflineSource`,
  :class:`LoaderSource`, :class:`ReplaySource`).
- ``_model``: :func:`build_model` (a small Llama, nothing downloaded),
  :func:`load_model`, :class:`LossModule` (model + loss, one module for DDP).
- ``_setup``: :func:`make_source` (the chosen path's source), :func:`tokenized_samples`.
- ``_loop``: :func:`train`.
- ``_checkpoint``: atomic save, fingerprint-checked load.
- ``_hf``: Hugging Face ``Trainer`` integration (a packing collator, row wrappers,
  ``num_items_in_batch`` normalisation).
- ``_plot``: loss and tokens/s curves from the JSONL log.

Why the loss is the same whatever the packing: each step's loss is the sum of
token losses over the step's supervised targets divided by their *global* count
(all micro-batches, all ranks), so grouping conversations into rows changes
nothing but the floating-point summation order. Measured (tests/loop, 20 AdamW
steps, a tiny Llama, fp32): per-step losses within 2.6e-6 and final parameters
within 3.5e-5 of the unpacked run on the same conversations, for the three paths
and both boundary modes; the noise floor (two unpacked runs that only regroup the
micro-batches) is 9.5e-7 and 6.4e-6.

A training step in five lines:

>>> from sftpack.testing import samples_from_lengths
>>> samples = [s for s in samples_from_lengths([30, 12, 25, 7, 18, 9])]
>>> for s in samples: s.input_ids %= 97
>>> cfg = TrainConfig(packing="trainer", steps=2, batch_size=4, max_seq_len=64, dim=16, layers=1, heads=2, kv_heads=1)
>>> out = train(cfg, source=make_source(cfg, samples=samples), model=build_model(97, dim=16, layers=1, heads=2, kv_heads=1))
>>> [(r.step, r.sequences, r.real_tokens) for r in out.logs]
[(1, 4, 59), (2, 4, 67)]
"""

from __future__ import annotations

from ._checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint
from ._hf import PackingCollator, PaddedCollator, RowsCollator, hf_row_kwargs
from ._loop import (
    NonFiniteError,
    StepLog,
    TrainResult,
    dist_info,
    init_distributed,
    resolve_device,
    train,
)
from ._model import (
    TRAIN_ATTENTION,
    LossModule,
    build_model,
    default_attention,
    load_model,
    register_train_attention,
)
from ._options import Boundaries, NonFinite, Packing, Schedule, TrainConfig
from ._plot import plot_training, read_log
from ._setup import (
    check_targets,
    compact_vocabulary,
    make_source,
    model_vocab_size,
    supervised_targets,
    tokenized_samples,
)
from ._sources import (
    LoaderSource,
    OfflineSource,
    PaddedMicroBatch,
    PaddedSource,
    ReplaySource,
    SampleOrder,
    Source,
    TrainerSource,
    padded_micro_batch,
    samples_fingerprint,
)

__all__ = [
    "TRAIN_ATTENTION",
    "Boundaries",
    "CheckpointError",
    "LoaderSource",
    "LossModule",
    "NonFinite",
    "NonFiniteError",
    "OfflineSource",
    "Packing",
    "PackingCollator",
    "PaddedCollator",
    "PaddedMicroBatch",
    "PaddedSource",
    "ReplaySource",
    "RowsCollator",
    "SampleOrder",
    "Schedule",
    "Source",
    "StepLog",
    "TrainConfig",
    "TrainResult",
    "TrainerSource",
    "build_model",
    "check_targets",
    "compact_vocabulary",
    "default_attention",
    "dist_info",
    "hf_row_kwargs",
    "init_distributed",
    "latest_checkpoint",
    "load_model",
    "make_source",
    "model_vocab_size",
    "padded_micro_batch",
    "plot_training",
    "read_log",
    "register_train_attention",
    "resolve_device",
    "samples_fingerprint",
    "supervised_targets",
    "tokenized_samples",
    "train",
    "verify_checkpoint",
]
