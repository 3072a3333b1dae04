"""Each step's numbers as TensorBoard scalars (``train(tensorboard=DIR)``, ``sftpack train --tensorboard DIR``).

One event file per run in ``DIR``, written through ``torch.utils.tensorboard.SummaryWriter``
(the ``tensorboard`` package: ``pip install 'sftpack[tensorboard]'``). The scalars are the
JSONL log's numbers of the same step, under the log's names: ``loss``, ``lr``,
``grad_norm``, ``tokens_per_s`` (real tokens), ``fill`` (``1 - padding``: the share of
slots holding real tokens) and, on the steps that evaluate, ``eval_loss``. TensorBoard
stores a scalar as float32, so each value read back is the log's rounded to float32.
A resumed run drops the events after its checkpoint's step (``purge_step``), as the
JSONL log drops those lines.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from .._optional import MissingDependency
from ._parts import LoopState, Part, StepLog

__all__ = ["SCALARS", "TensorBoard", "TensorBoardScalars"]

#: the scalar names, each a function of the step's log record (``StepLog.as_dict()``)
SCALARS = {
    "loss": lambda r: r["loss"],
    "lr": lambda r: r["lr"],
    "grad_norm": lambda r: r["grad_norm"],
    "tokens_per_s": lambda r: r["tokens_per_s"],
    "fill": lambda r: 1.0 - r["padding"],
}


class TensorBoardScalars:
    """A ``SummaryWriter`` in ``log_dir``; :meth:`write` adds one step's scalars."""

    def __init__(self, log_dir: str | os.PathLike[str], *, resumed_from: int = 0) -> None:
        try:
            importlib.import_module("tensorboard")
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise MissingDependency(
                "--tensorboard needs the tensorboard package: pip install 'sftpack[tensorboard]'"
            ) from e
        # purge_step: the events of the steps after a resumed run's checkpoint are dropped
        self.writer = SummaryWriter(str(log_dir), purge_step=resumed_from + 1 if resumed_from else None)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for name, value in SCALARS.items():
            self.writer.add_scalar(name, float(value(record)), step)
        if record.get("eval_loss") is not None:
            self.writer.add_scalar("eval_loss", float(record["eval_loss"]), step)

    def close(self) -> None:
        self.writer.close()


class TensorBoard(Part):
    """The part (rank 0): a :class:`TensorBoardScalars` in ``log_dir`` from the start, fed each step."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = log_dir
        self._scalars: TensorBoardScalars | None = None

    def on_start(self, state: LoopState) -> None:
        self._scalars = TensorBoardScalars(self.log_dir, resumed_from=state.start)

    def on_step(self, state: LoopState, record: StepLog) -> None:
        assert self._scalars is not None
        self._scalars.write(record.as_dict())

    def on_end(self, state: LoopState) -> None:
        if self._scalars is not None:
            self._scalars.close()
