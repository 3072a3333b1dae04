"""The training loop: train a causal LM on rows from any packing path, or on padded batches.

Not to be confused with :mod:`sftpack.trainer`, the path that packs a padded
batch at the step: this package *uses* the three paths (``offline``, ``loader``,
``trainer``) and the unpacked baseline (``none``) to train. ``sftpack train``
wraps it.

A small, readable loop for a Hugging Face causal LM: AdamW, warm-up +
cosine/linear decay, gradient accumulation, clipping, the global token-mean loss
of :mod:`sftpack.loss`, seeded everything, DDP or FSDP2 (``TrainConfig.fsdp``) over
``torch.distributed`` (``torchrun``; gloo on CPU, NCCL on GPU), atomic checksummed checkpoints with
exact resume, a JSONL log per step (and TensorBoard scalars), a run given in steps or
in epochs, the loss of a held-out set every K steps, and the trained model written
as a Hugging Face folder at the end. A step whose loss or gradient is not
finite stops the run (or is skipped and counted), data with no supervised target
is refused, and a step with none is skipped and counted.

Samples with images (``sample.media``) take the same loop on every path: the
sources hand their media along (the trainer path to ``pack_step``, the padded
baseline in its micro-batch, the loader and offline rows laid by their builders),
the model is a vision-language family's tiny model built from a config
(``_model.build_media_model``), and the one :class:`~sftpack.loop._model.LossModule`
runs the family's vision tower before the same head and loss; checkpoints,
resume and DDP are the text run's (FSDP is text-only for now). The log adds ``images`` per step.

The public names (``__all__``):

- a whole run as ``sftpack train`` runs it: :class:`RunConfig` (``RunConfig(...).build().run()``)
  and its parts :class:`InputSettings`, :class:`DataSettings`, :class:`ModelSettings`,
  :class:`OutputSettings` (with :class:`TrainConfig`), :class:`ConfigError` (settings that
  cannot work together, naming them);
- run: :class:`TrainConfig` (every option, validated), :func:`train`, :func:`resolve_device`
  (the device a run trains on), :func:`check_model_dir` (a ``save_model`` folder, checked
  before training), :func:`require_exact` (the guard :func:`train` runs first: packing exact
  on the model, or refused);
- data: :func:`tokenized_samples` (the embedded corpus or your conversations),
  :func:`make_source` (the chosen path's micro-batches for this rank),
  :class:`ReplaySource` (given conversations per step: the unpacked reference of
  a packed run), :func:`compact_vocabulary`;
- model: :func:`build_model` (a small Llama, nothing downloaded: transformers'
  ``LlamaForCausalLM``, or with ``impl="torch"`` the same network in plain torch),
  :func:`load_model` (a local folder), :func:`default_attention`;
- images: :func:`media_samples` (conversations with images to samples), :func:`build_media_model`
  (a vision-language family's tiny model), :func:`media_token_ids` (the family's image and video
  token ids), :func:`padded_micro_batch` (the unpacked baseline's right-padded micro-batch);
- the run: :class:`RunConfig` (every setting of ``sftpack train``, its parts :class:`InputSettings`,
  :class:`DataSettings`, :class:`ModelSettings`, :class:`OutputSettings`, and :class:`ConfigError`),
  ``RunConfig.build()`` the runnable ``Run``; :mod:`sftpack.loop.inputs`, a public module: what a
  run reads before it trains (whether data holds images, the tokenizer, the family), shared by every command;
- Hugging Face ``Trainer``: :class:`PackingCollator`, :class:`RowsCollator`,
  :class:`PaddedCollator`;
- the loop's parts: :class:`Part` (hooks at the start, after every step and at the end: a
  logger of your own is a ``Part`` passed as ``train(parts=[...])`` or
  ``RunConfig.build().run(parts=[...])``), what it sees, :class:`LoopState`, and each step's
  record, :class:`StepLog`;
- errors to catch: :class:`CheckpointError`, :class:`NonFiniteError`;
- :func:`plot_training` (loss and tokens/s curves).

The parts behind them, importable from their modules (no second public path):

- ``_options``: the enums of :class:`TrainConfig`'s choices (``Packing``,
  ``Boundaries``, ``Schedule``, ``NonFinite``);
- ``_sources``: the per-path sources of micro-batches with resumable positions
  (``Source`` and one class per path); ``_micro_batch``: the baseline's right-padded
  ``PaddedMicroBatch``;
- ``_run_parts``: :class:`RunConfig`'s parts (``InputSettings``, ``DataSettings``, ``ModelSettings``,
  ``OutputSettings``); ``_run_config``: :class:`RunConfig`, its rules; ``_run``: ``Run``, what ``build()`` returns (one lane for text and
  images); ``_run_data``: its data side (``TextData``, ``MediaData``); ``_run_end``: the eval set, the
  report, the model folder; ``inputs`` (public: the other commands read their inputs with it too): whether data holds images, the tokenizer, the family;
- ``_setup``: from options and data to a source; the supervised-target checks;
  ``media_samples`` (conversations with images to samples);
- ``_model``: the attention registered with transformers, ``LossModule`` (model +
  loss, one module for DDP, text and images), ``build_media_model``; ``_llama``:
  ``SmallLlama``, ``build_model(impl="torch")``;
- ``_loop``: :func:`train`, its log record ``StepLog`` and result ``TrainResult``,
  the device and ``torch.distributed`` helpers;
- ``_checkpoint``: atomic save, checksum- and fingerprint-checked load;
- ``_fsdp``: FSDP2 sharding (each decoder layer a unit, the loss module the root) and
  the full model and optimizer states gathered for checkpoints and ``save_model``;
- ``_eval``: ``split_eval`` (hold out a seeded share of the conversations) and ``EvalSet``
  (their packed micro-batches and token-mean loss); ``_tensorboard``: the per-step scalars;
  ``_export``: ``save_model`` (the trained model, the default ``SmallLlama`` as a
  ``LlamaForCausalLM``, and its tokenizer as a Hugging Face folder); ``_model_dir``: where it
  goes, checked before training (``check_model_dir``), written beside it and renamed into place;
- ``_hf``: the collators; ``_plot``: the curves. The optional dependencies
  (transformers, matplotlib, flash-attn) are imported through :mod:`sftpack._optional`.

Why the loss is the same whatever the packing: each step's loss is the sum of
token losses over the step's supervised targets divided by their *global* count
(all micro-batches, all ranks), so grouping conversations into rows changes
nothing but the floating-point summation order. ``tests/loop/test_equality.py``
pins it: 20 AdamW steps in float64 agree with the unpacked run on the same
conversations to a fixed tolerance derived there, for the three paths and both
boundary modes.

A training step:

>>> from sftpack.loop import TrainConfig, build_model, make_source, train
>>> from sftpack.testing import samples_from_lengths
>>> samples = [s for s in samples_from_lengths([30, 12, 25, 7, 18, 9])]
>>> for s in samples: s.input_ids %= 97
>>> cfg = TrainConfig(packing="trainer", steps=2, batch_size=4, max_seq_len=64, dim=16, layers=1, heads=2, kv_heads=1)
>>> out = train(cfg, source=make_source(cfg, samples=samples), model=build_model(97, dim=16, layers=1, heads=2, kv_heads=1))
>>> [(r.step, r.sequences, r.real_tokens) for r in out.logs]
[(1, 4, 59), (2, 4, 67)]
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _TYPE_CHECKING:  # the names for type checkers; at run time __getattr__ loads them
    from ._checkpoint import CheckpointError as CheckpointError
    from ._hf import PackingCollator as PackingCollator
    from ._hf import PaddedCollator as PaddedCollator
    from ._hf import RowsCollator as RowsCollator
    from ._loop import NonFiniteError as NonFiniteError
    from ._loop import resolve_device as resolve_device
    from ._loop import train as train
    from ._micro_batch import padded_micro_batch as padded_micro_batch
    from ._model import build_media_model as build_media_model
    from ._model import build_model as build_model
    from ._model import default_attention as default_attention
    from ._model import load_model as load_model
    from ._model import media_token_ids as media_token_ids
    from ._model import require_exact as require_exact
    from ._model_dir import check_model_dir as check_model_dir
    from ._options import ConfigError as ConfigError
    from ._options import TrainConfig as TrainConfig
    from ._parts import LoopState as LoopState
    from ._parts import Part as Part
    from ._parts import StepLog as StepLog
    from ._plot import plot_training as plot_training
    from ._run_config import RunConfig as RunConfig
    from ._run_parts import DataSettings as DataSettings
    from ._run_parts import InputSettings as InputSettings
    from ._run_parts import ModelSettings as ModelSettings
    from ._run_parts import OutputSettings as OutputSettings
    from ._setup import compact_vocabulary as compact_vocabulary
    from ._setup import make_source as make_source
    from ._setup import media_samples as media_samples
    from ._setup import model_cost as model_cost
    from ._setup import tokenized_samples as tokenized_samples
    from ._sources import ReplaySource as ReplaySource

#: each public name's module: loaded when the name is first used, so that reading the
#: settings (``TrainConfig``: ``sftpack train``'s options are built from its fields) loads no torch
_HOMES = {
    "CheckpointError": "_checkpoint",
    "ConfigError": "_options",
    "DataSettings": "_run_parts",
    "InputSettings": "_run_parts",
    "ModelSettings": "_run_parts",
    "OutputSettings": "_run_parts",
    "LoopState": "_parts",
    "Part": "_parts",
    "StepLog": "_parts",
    "NonFiniteError": "_loop",
    "PackingCollator": "_hf",
    "PaddedCollator": "_hf",
    "ReplaySource": "_sources",
    "RowsCollator": "_hf",
    "RunConfig": "_run_config",
    "TrainConfig": "_options",
    "build_media_model": "_model",
    "build_model": "_model",
    "check_model_dir": "_model_dir",
    "compact_vocabulary": "_setup",
    "default_attention": "_model",
    "load_model": "_model",
    "make_source": "_setup",
    "media_samples": "_setup",
    "media_token_ids": "_model",
    "model_cost": "_setup",
    "padded_micro_batch": "_micro_batch",
    "plot_training": "_plot",
    "require_exact": "_model",
    "resolve_device": "_loop",
    "tokenized_samples": "_setup",
    "train": "_loop",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> _Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (loaded or not) and the private ones; not this module's own imports."""
    return sorted({*_HOMES, *(k for k in globals() if k.startswith("_"))})
