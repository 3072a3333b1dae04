"""Deprecated: the training loop is :mod:`sftpack.loop` (this alias goes in the next release).

``sftpack.train`` was easy to mistake for :mod:`sftpack.trainer` (the path that
packs at the step). Importing it warns with a ``DeprecationWarning`` and gives
every name it used to export, so code written against it keeps working for one
release; change ``from sftpack.train import X`` to ``from sftpack.loop import X``
(the names outside ``sftpack.loop.__all__`` live in its private modules now).
The ``sftpack train`` command is unchanged.
"""

from __future__ import annotations

import warnings

from .loop._checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint
from .loop._hf import PackingCollator, PaddedCollator, RowsCollator, hf_row_kwargs
from .loop._loop import NonFiniteError, StepLog, TrainResult, dist_info, init_distributed, resolve_device, train
from .loop._model import (
    TRAIN_ATTENTION,
    LossModule,
    build_model,
    default_attention,
    load_model,
    register_train_attention,
)
from .loop._options import Boundaries, NonFinite, Packing, Schedule, TrainConfig
from .loop._plot import plot_training, read_log
from .loop._setup import (
    check_targets,
    compact_vocabulary,
    make_source,
    model_vocab_size,
    supervised_targets,
    tokenized_samples,
)
from .loop._sources import (
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

warnings.warn(
    "sftpack.train is deprecated and will be removed in the next release: import the training loop from "
    "sftpack.loop instead (the `sftpack train` command is unchanged)",
    DeprecationWarning,
    stacklevel=2,
)
