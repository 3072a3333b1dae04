"""The JSONL log (``train(log=PATH)``): one :class:`~sftpack.loop._parts.StepLog` per line, rank 0.

A resumed run keeps the lines of the steps up to its checkpoint and writes on from
there; a line cut short by a kill counts as after any checkpoint, so it goes too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TextIO

from ._parts import LoopState, Part, StepLog

__all__ = ["JsonlLog"]


def _step_of(line: str) -> float:
    """The ``step`` of a log line; a line cut short by a kill counts as after any checkpoint."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


class JsonlLog(Part):
    """Writes each step's record to ``path`` as a JSON line, flushed at once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None

    def on_start(self, state: LoopState) -> None:
        kept = []
        if state.start and self.path.is_file():  # keep the lines of the steps up to the checkpoint
            kept = [ln for ln in self.path.read_text().splitlines() if _step_of(ln) <= state.start]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")  # noqa: SIM115 - closed in on_end
        self._file.writelines(ln + "\n" for ln in kept)

    def on_step(self, state: LoopState, record: StepLog) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record.as_dict()) + "\n")
        self._file.flush()

    def on_end(self, state: LoopState) -> None:
        if self._file is not None:
            self._file.close()
