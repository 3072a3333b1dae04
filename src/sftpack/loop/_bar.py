"""The progress bar (``train(progress=True)``, rank 0): the steps, the loss and real tokens/s."""

from __future__ import annotations

from .._progress import Bar
from ._parts import LoopState, Part, StepLog

__all__ = ["ProgressBar"]


class ProgressBar(Part):
    """A tqdm bar over the run's steps (from a resumed run's start), showing the last step's
    loss and real tokens/s and, when the run evaluates, the last ``eval_loss`` (``-`` before one)."""

    def __init__(self, *, evaluating: bool) -> None:
        self.evaluating = evaluating
        self._bar: Bar | None = None

    def on_start(self, state: LoopState) -> None:
        self._bar = Bar(total=state.steps, initial=state.start, desc=f"train ({state.config.packing})", unit="step")

    def on_step(self, state: LoopState, record: StepLog) -> None:
        assert self._bar is not None
        shown = {"loss": f"{record.loss:.4f}", "tok_s": f"{record.tokens_per_s:,.0f}"}
        if self.evaluating:
            last_eval = next((r.eval_loss for r in reversed(state.logs) if r.eval_loss is not None), None)
            shown["eval_loss"] = "-" if last_eval is None else f"{last_eval:.4f}"
        self._bar.set_postfix(**shown)
        self._bar.update(1)

    def on_end(self, state: LoopState) -> None:
        if self._bar is not None:
            self._bar.close()
