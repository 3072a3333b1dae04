"""``sftpack train``: train a causal LM on rows from any packing path, or on padded batches.

sftpack train --packing trainer --steps 50 --batch-size 8 --max-seq-len 1024 --log run.jsonl --plot run.png
torchrun --nproc-per-node 2 -m sftpack.cli train --packing loader ...      # data parallel (gloo on CPU)
sftpack train my_images.jsonl --steps 20 --log vlm.jsonl     # conversations with image parts: a tiny Qwen2-VL
sftpack train --corpus vqa --packing none --steps 20         # the embedded easy-vqa conversations with images

Data with images (INPUT files whose conversations hold image parts, found by reading
their first records, or ``--corpus vqa``) takes the same command and the same loop:
its samples carry their images (``sample.media``), the model is the vision-language
family's tiny model built from a config (Qwen2-VL; ``--dim``/``--layers``/``--heads``/
``--kv-heads``, over the tokenizer's ids or, with ``--vocab data``, the data's), every
packing path, checkpoints and ``--resume``, ``torchrun``, and ``--max-patches-per-row``
(the vision-patch budget of a packed row or micro-batch). The JSONL log adds ``images``
per step.

The command is parse -> :class:`~sftpack.loop.RunConfig` -> build -> run -> report: the
flags are the config's settings (:mod:`._train_options`), every rule between them is
checked by the config (its :class:`~sftpack.loop.ConfigError` shown in flag
spelling, exit 2), and the run (:class:`~sftpack.loop._run.Run`) says its lines through
``print``. The loop's settings and ``Run`` load no torch; the loop imports torch when the
command runs, so ``sftpack --help`` and the other commands build this parser without paying for it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..loop import RunConfig
from ._common import Terminated, sigterm_deferred
from ._train_options import add_arguments

#: ``(phase, time.perf_counter())`` at the end of each start-up phase of the last
#: :func:`run` (``benchmarks/bench_startup.py`` reads it; nothing is printed)
MARKS: list[tuple[str, float]] = []


def _mark(phase: str) -> None:
    MARKS.append((phase, time.perf_counter()))


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train",
        arguments=add_arguments,
        help="train a causal LM on packed rows (offline, loader, trainer) or padded batches (none)",
        description="A small training loop (AdamW, LR schedule, gradient accumulation, clipping, the global "
        "token-mean loss, DDP under torchrun, checkpoints with exact resume). Data: the embedded corpus by default, "
        "chat files, or a prepacked directory. Model: a small Llama built from a config (nothing downloaded) or "
        "--model DIR.",
    )
    t.set_defaults(func=run, exit_at_once=True)  # as the command: no interpreter teardown (sftpack.cli.main)


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run the flags give: each flag is the setting of its name (``--clip-norm 0``: off;
    neither ``--steps`` nor ``--epochs``: the command's default, :meth:`~sftpack.loop.RunConfig.from_flags`)."""
    return RunConfig.from_flags(vars(args))


def stopped_line(result: Any, model: Any = None) -> str:
    """What a run that SIGTERM stopped says (its loop ended after the step it was in); ``model``:
    the ``--save-model`` folder written at the stop."""
    steps = result.logs[-1].step if result.logs else result.resumed_from
    line = f"stopped by SIGTERM after step {steps}"
    saved = f"the model of step {steps} saved in {model}"
    if not result.stopped:  # it came in the last step, after the loop had asked
        return f"{line}, the last one" + (f"; {saved}" if model is not None else "")
    if result.checkpoint is not None:  # written at the end of that step
        return f"{line}; checkpoint saved in {result.checkpoint}; rerun with --resume to continue"
    if model is not None:
        return f"{line}; {saved} (no --checkpoint-dir: the run cannot be resumed)"
    return (
        f"{line}; nothing saved (give --checkpoint-dir to resume after a stop, or --save-model DIR to keep the model)"
    )


def run(args: argparse.Namespace) -> int:
    MARKS.clear()
    _mark("start")
    config = run_config(args)
    job = config.build(say=print, mark=_mark)
    try:  # a ConfigError (a device this machine lacks, a model too small for the tokenizer...): exit 2
        result = job.run(stop=sigterm_deferred)  # SIGTERM: the loop ends at the end of a step
    except Terminated:
        if all(phase != "train" for phase, _ in MARKS):
            raise Terminated("stopped by SIGTERM before the first step; nothing was saved") from None
        raise
    if job.stopped:
        raise Terminated(stopped_line(result, job.saved))
    return 0
