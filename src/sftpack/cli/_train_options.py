"""The options of ``sftpack train``: its argument parser, declared here, read by :mod:`._train`.

Kept apart from the command's run so that both stay readable (the options are most of
the command's length). The run's settings are :class:`~sftpack.loop.TrainConfig`'s
fields, each declared there once (:func:`~._common.add_settings`); the options here
that are not a field are the command's own. :func:`add_arguments` imports the loop
(torch), so the command adds them when it is first used (:class:`sftpack.cli._Parser`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ._common import INPUTS_HELP, UsageError, add_settings, positive

__all__ = ["IMAGE_SIDES", "VQA_LIMIT", "add_arguments", "check_options"]

#: conversations of a default ``--corpus vqa`` run (``--limit``): a 20-step CPU run takes seconds
VQA_LIMIT = 64
#: the default seeded image sizes of ``--corpus vqa``, px a side (up to 256 patches an image: the vision
#: tower's attention grows with the square of an image's patches, so 448 px images cost 16x as much on CPU)
IMAGE_SIDES = (56, 224)


def add_arguments(t: argparse.ArgumentParser) -> None:
    """Every option of ``sftpack train`` on its parser ``t``."""
    from ..chat._options import NO_PROGRESS_HELP, InputOptions
    from ..loop._options import TrainConfig

    t.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help=f"chat files: {INPUTS_HELP} (default: the embedded corpus)",
    )
    add_settings(t, InputOptions, "on_bad_row", "split", "chat_template", "allow_outside_images")
    add_settings(t, TrainConfig, "packing")
    t.add_argument(
        "--prepacked",
        metavar="DIR",
        help="--packing offline: a directory from sftpack prepack (default: prepack the data into a temporary "
        "directory first); its row width, pad multiple and tokenizer come from its manifest",
    )
    add_settings(t, TrainConfig, "steps", "epochs", "batch_size", "max_seq_len", "seed")
    t.add_argument("--log", metavar="FILE.jsonl", help="write one JSON object per step")
    t.add_argument("--plot", metavar="FILE.png", help="draw the loss (and eval loss) and tokens/s curves")
    t.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write the loss, learning rate, grad norm, real tokens/s, fill and eval loss of every step as "
        "TensorBoard scalars in DIR (needs: pip install 'sftpack[tensorboard]'); the --log file is unchanged",
    )
    t.add_argument(
        "--save-model",
        metavar="DIR",
        help="at the end (or at SIGTERM), write the trained model as a Hugging Face folder (config, safetensors "
        "weights, tokenizer with its chat template): AutoModelForCausalLM.from_pretrained(DIR) loads it; DIR is "
        "checked before training (a new or empty folder), written beside it and renamed into place",
    )
    t.add_argument(
        "--overwrite-model",
        action="store_true",
        help="--save-model DIR may be a folder with files in it (a model saved before, or any other folder): it "
        "is replaced whole, nothing of it kept",
    )
    t.add_argument("--limit", type=positive, help="use the first N conversations only")
    t.add_argument("--no-progress", dest="progress", action="store_false", help=NO_PROGRESS_HELP)  # as prepack's
    add_settings(
        t.add_argument_group("optimisation"),
        TrainConfig,
        *("lr", "warmup_steps", "schedule", "min_lr_ratio", "weight_decay", "grad_accum", "clip_norm", "on_nonfinite"),
    )
    e = t.add_argument_group("evaluation")
    add_settings(e, TrainConfig, "eval_fraction")
    e.add_argument(
        "--eval-file",
        metavar="PATH",
        help="evaluate on the conversations of this chat file (tokenized as the training data) instead of holding "
        "out --eval-fraction of them",
    )
    add_settings(e, TrainConfig, "eval_every")
    add_settings(
        t.add_argument_group("packing"),
        TrainConfig,
        *("pad_multiple", "boundaries", "buffer_size", "max_patches_per_row", "allow_inexact_packing"),
    )
    m = t.add_argument_group("model")
    m.add_argument(
        "--model",
        metavar="DIR",
        help="a local model folder (default: a small Llama from a config)",
    )
    m.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer folder (default: the --model folder's own when it has one, else the embedded Qwen BPE)",
    )
    m.add_argument(
        "--vocab",
        choices=["tokenizer", "data"],
        default="tokenizer",
        help="the default model's vocabulary: the tokenizer's (151,646 ids for the embedded one) or only the "
        "ids that occur in the data, renumbered (a much cheaper head on CPU; a different model)",
    )
    m.add_argument(
        "--model-impl",
        choices=["torch", "transformers"],
        help="the default model's code: torch (SmallLlama: transformers' LlamaForCausalLM op for op in plain "
        "torch, the same weights for the same seed, about 4 s quicker to start; the default) or transformers "
        "(LlamaForCausalLM itself); not with --model, which always loads with transformers",
    )
    add_settings(m, TrainConfig, "dim", "layers", "heads", "kv_heads", "device", "fsdp")
    m.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        help="the model's dtype (default float32; float64 makes packed and padded runs agree to 1e-10); a "
        "checkpoint resumes only in the dtype it was written in",
    )
    c = t.add_argument_group("checkpoints")
    c.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where checkpoints go (one run per folder: a fresh run refuses a folder that holds another run's "
        "checkpoints); with it, SIGTERM saves one at the end of the current step before the run stops",
    )
    add_settings(c, TrainConfig, "checkpoint_every")
    c.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir (there must be one; it is verified "
        "against its checksums, and the optimisation options must be the checkpoint's)",
    )
    c.add_argument(
        "--resume-if-any",
        action="store_true",
        help="like --resume, but start at step 1 when --checkpoint-dir holds no checkpoint yet "
        "(re-running the same command after a preemption)",
    )
    c.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="start a fresh run (step 1) in a --checkpoint-dir that holds another run's checkpoints: they are "
        "deleted once this run has written its first checkpoint",
    )
    t.add_argument(
        "--num-proc",
        type=positive,
        help="tokenizer worker processes (default: the CPUs this process may use, at most 4; the samples do not "
        "depend on it)",
    )
    k = t.add_argument_group("tokenized-data cache")
    k.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where tokenized samples are kept between runs, keyed by the tokenizer, options, input bytes and "
        "sftpack's code (default: $SFTPACK_CACHE_DIR, else $XDG_CACHE_HOME/sftpack, else ~/.cache/sftpack)",
    )
    k.add_argument(
        "--no-cache",
        action="store_true",
        help="tokenize again and write nothing to the cache",
    )
    k.add_argument(
        "--cache-max-size",
        metavar="SIZE",
        type=_cache_size,
        help="the cache's size limit, e.g. 10G, 500M (binary units; 0: no limit; default: 10G, the entry of a "
        "2-billion-token data set at 5 bytes a token): the entries used least recently make room for a new one",
    )
    t.add_argument(
        "--corpus",
        choices=["chat", "vqa"],
        default="chat",
        help="the embedded data when no INPUT is given: chat conversations (default) or easy-vqa conversations "
        "with images, which trains a tiny Qwen2-VL",
    )
    v = t.add_argument_group("images (INPUT files with image parts, or --corpus vqa)")
    v.add_argument(
        "--image-sides",
        nargs=2,
        type=positive,
        metavar=("MIN", "MAX"),
        help=f"--corpus vqa: each image is resized to a seeded size within MIN..MAX px a side (default "
        f"{IMAGE_SIDES[0]} {IMAGE_SIDES[1]}); --limit caps the conversations (default {VQA_LIMIT})",
    )


def check_options(args: argparse.Namespace) -> None:
    """The run's length, evaluation and export options, checked before any work (usage errors)."""
    from ..loop._options import CLI_STEPS

    if args.steps is not None and args.epochs is not None:
        raise UsageError(f"give --steps or --epochs, not both (--steps {args.steps}, --epochs {args.epochs})")
    if args.steps is None and args.epochs is None:
        args.steps = CLI_STEPS
    if args.eval_fraction and args.eval_file is not None:
        raise UsageError("give --eval-fraction or --eval-file, not both")
    if args.eval_every is not None and not args.eval_fraction and args.eval_file is None:
        raise UsageError("--eval-every needs an eval set: give --eval-fraction F or --eval-file PATH")
    if args.eval_fraction and args.prepacked:
        raise UsageError(
            "--eval-fraction holds out conversations before packing, but a --prepacked folder's rows are already "
            "packed: give --eval-file PATH, or prepack only the training conversations"
        )
    if args.eval_file is not None and not Path(args.eval_file).exists():
        raise UsageError(f"--eval-file {args.eval_file}: no such file")
    if args.eval_file is not None and args.vocab == "data":
        raise UsageError("--eval-file with --vocab data: the eval file's ids are not the data's; use --eval-fraction")
    for flag, given in (("--split", args.split), ("--chat-template", args.chat_template)):
        if given is not None and args.prepacked:
            raise UsageError(
                f"{flag}: a --prepacked folder's conversations were read and tokenized by sftpack prepack: give "
                f"{flag} to sftpack prepack, or train on the INPUT files"
            )
    if args.split is not None and not args.inputs:
        raise UsageError("--split picks the split of a saved DatasetDict among the INPUT files: give INPUT files")
    if args.save_model is not None and args.vocab == "data":
        raise UsageError(
            "--save-model with --vocab data: that model's ids are the data's, renumbered, not the tokenizer's, so "
            "the saved folder could not be used with its tokenizer; train with --vocab tokenizer (the default)"
        )
    if args.overwrite_model and args.save_model is None:
        raise UsageError("--overwrite-model replaces the folder of --save-model DIR: give --save-model")
    if args.save_model is not None:  # a path that cannot take the model costs no training
        from ..loop import check_model_dir

        try:
            check_model_dir(args.save_model, overwrite=args.overwrite_model)
        except ValueError as e:
            raise UsageError(f"--save-model {e}") from None


def _cache_size(text: str) -> int:
    """``--cache-max-size``: bytes (:func:`~sftpack.chat._cache_entry.parse_size`)."""
    from ..chat._cache_entry import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
