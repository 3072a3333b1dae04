"""Each step's numbers as TensorBoard scalars (``train(tensorboard=DIR)``, ``sftpack train --tensorboard DIR``).

One event file per run in ``DIR``, written through ``torch.utils.tensorboard.SummaryWriter``
(the ``tensorboard`` package: ``pip install 'sftpack[tensorboard]'``). The scalars are the
JSONL log's numbers of the same step, under the log's names: ``loss``, ``lr``,
``grad_norm``, ``tokens_per_s`` (real tokens), ``fill`` (``1 - padding``: the share of
slots holding real tokens), on the steps that evaluate, ``eval_loss``, and for a preference
objective (DPO, SimPO) ``pairs``, ``chosen_reward``, ``rejected_reward`` and ``reward_accuracy``
(:data:`PREFERENCE_SCALARS`, the means over the step's pairs). TensorBoard
stores a scalar as float32, so each value read back is the log's rounded to float32.
A resumed run drops the events after its checkpoint's step (``purge_step``), as the
JSONL log drops those lines.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from .._optional import MissingDependency
from ._parts import LoopState, Part, StepLog

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["PREFERENCE_SCALARS", "SCALARS", "TensorBoard"]

#: the scalar names, each a function of the step's log record (``StepLog.as_dict()``)
SCALARS = {
    "loss": lambda r: r["loss"],
    "lr": lambda r: r["lr"],
    "grad_norm": lambda r: r["grad_norm"],
    "tokens_per_s": lambda r: r["tokens_per_s"],
    "fill": lambda r: 1.0 - r["padding"],
}
#: the scalars of a preference objective's steps, under the log's names (absent from an SFT step's record)
PREFERENCE_SCALARS = ("pairs", "chosen_reward", "rejected_reward", "reward_accuracy")


class TensorBoard(Part):
    """The part (rank 0): a ``SummaryWriter`` in ``log_dir`` from the start, each step's scalars added."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = log_dir
        self._writer: SummaryWriter | None = None  # imported when the run starts: an optional dependency

    def on_start(self, state: LoopState) -> None:
        try:
            importlib.import_module("tensorboard")
            from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard (the tensorboard extra)
        except ImportError as e:
            raise MissingDependency(
                "--tensorboard needs the tensorboard package: pip install 'sftpack[tensorboard]'"
            ) from e
        # purge_step: the events of the steps after a resumed run's checkpoint are dropped
        self._writer = SummaryWriter(str(self.log_dir), purge_step=state.start + 1 if state.start else None)

    def on_step(self, state: LoopState, record: StepLog) -> None:
        assert self._writer is not None
        values = record.as_dict()
        for name, value in SCALARS.items():
            self._writer.add_scalar(name, float(value(values)), record.step)
        for name in ("eval_loss", *PREFERENCE_SCALARS):
            if values.get(name) is not None:
                self._writer.add_scalar(name, float(values[name]), record.step)

    def on_end(self, state: LoopState) -> None:
        if self._writer is not None:
            self._writer.close()
