"""The options of ``sftpack train``: its argument parser, read by :mod:`._train`.

Every option but INPUT is a setting of :class:`~sftpack.loop.RunConfig`'s parts (the run's
input, data, model, training and output settings), declared there once, each on its field
(:func:`~._common.add_settings` reads them); here they are only put in the order and groups
``--help`` shows. The loop's settings load no torch (:mod:`sftpack.loop` loads its names lazily);
the command adds its options when it is first used (:class:`sftpack.cli._Parser`).
"""

from __future__ import annotations

import argparse

from ..loop import DataSettings, InputSettings, ModelSettings, OutputSettings, TrainConfig
from ._common import INPUTS_HELP, add_settings

__all__ = ["add_arguments"]


def add_arguments(t: argparse.ArgumentParser) -> None:
    """Every option of ``sftpack train`` on its parser ``t``."""
    t.add_argument(
        "inputs", nargs="*", metavar="INPUT", help=f"chat files: {INPUTS_HELP} (default: the embedded corpus)"
    )
    add_settings(t, InputSettings, "on_bad_row", "split", "chat_template", "allow_outside_images")
    add_settings(t, TrainConfig, "packing")
    add_settings(t, DataSettings, "prepacked")
    add_settings(t, TrainConfig, "steps", "epochs", "batch_size", "max_seq_len")
    add_settings(t, InputSettings, "overlong")
    add_settings(t, TrainConfig, "seed")
    add_settings(t, OutputSettings, "log", "plot", "tensorboard", "save_model", "overwrite_model")
    add_settings(t, InputSettings, "limit")
    add_settings(t, OutputSettings, "progress")
    add_settings(
        t.add_argument_group("optimisation"),
        TrainConfig,
        *("lr", "warmup_steps", "schedule", "min_lr_ratio", "weight_decay", "grad_accum", "clip_norm", "on_nonfinite"),
        "weight_normalisation",
    )
    e = t.add_argument_group("evaluation")
    add_settings(e, TrainConfig, "eval_fraction")
    add_settings(e, InputSettings, "eval_file")
    add_settings(e, TrainConfig, "eval_every")
    add_settings(t.add_argument_group("objective"), TrainConfig, "objective", "beta", "gamma", "reference_model")
    add_settings(
        t.add_argument_group("packing"),
        TrainConfig,
        *("pad_multiple", "boundaries", "buffer_size", "max_patches_per_row", "cost", "allow_inexact_packing"),
    )
    m = t.add_argument_group("model")
    add_settings(m, ModelSettings, "model", "tokenizer", "family")
    add_settings(m, DataSettings, "vocab")
    add_settings(m, ModelSettings, "model_impl")
    add_settings(m, TrainConfig, "dim", "layers", "heads", "kv_heads", "device", "fsdp")
    add_settings(m, ModelSettings, "dtype")
    c = t.add_argument_group("checkpoints")
    add_settings(c, OutputSettings, "checkpoint_dir")
    add_settings(c, TrainConfig, "checkpoint_every")
    add_settings(c, OutputSettings, "resume", "resume_if_any", "overwrite_checkpoints")
    add_settings(t, DataSettings, "num_proc")
    add_settings(t.add_argument_group("tokenized-data cache"), DataSettings, "cache_dir", "no_cache", "cache_max_size")
    add_settings(t, InputSettings, "corpus")
    add_settings(
        t.add_argument_group("images (INPUT files with image parts, or --corpus vqa)"), InputSettings, "image_sides"
    )
