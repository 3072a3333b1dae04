"""The seam between the training loop and its parts.

:func:`~sftpack.loop.train` is a short loop (set up, resume, step, hand each step's
:class:`StepLog` on); everything else a run does is a :class:`Part` it calls:

1. ``Evaluation`` (every rank): the held-out loss into ``StepLog.eval_loss``;
2. ``TensorBoard`` (rank 0, ``tensorboard=``): the step's scalars;
3. ``JsonlLog`` (rank 0, ``log=``): one JSON line per step;
4. ``ProgressBar`` (rank 0, ``progress=True``): a tqdm bar;
5. ``OnStep`` (every rank): the ``on_step=`` callback;
6. a caller's own parts (every rank, ``parts=``);
7. ``Checkpoints`` (every rank): saves every N steps and when the run is stopped.

The loop calls them in that order (``Checkpoints`` also resumes the run, before any part starts). How the
ranks share the model (one process, DDP or FSDP) is not a part but one
:class:`~sftpack.loop._parallel.Parallel` chosen once, which the loop and the parts ask.

A new feature (another logger, say) is a new :class:`Part` in a file of its own and one
line where :func:`~sftpack.loop._loop.train` assembles its parts (or, from outside,
``train(..., parts=[MyPart()])``)::

    class Losses(Part):  # each step's loss, on every rank
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_step(self, state: LoopState, record: StepLog) -> None:
            self.losses.append(record.loss)

(``tests/loop/test_parts.py`` runs such a part).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ._optimizer import Optimization
from ._options import TrainConfig
from ._parallel import Parallel
from ._sources import Source

__all__ = ["LoopState", "OnStep", "Part", "StepLog"]


@dataclass
class StepLog:
    """One line of the JSONL log (global numbers, all ranks summed)."""

    step: int  #: optimizer steps done (1-based)
    loss: float  #: token-mean loss of the global batch
    real_tokens: int  #: real (non-padding) tokens processed
    slots: int  #: token slots processed, padding included
    label_tokens: int  #: supervised targets (the loss denominator)
    sequences: int  #: conversations in the step
    micro_batches: int  #: forward/backward passes per rank
    padding: float  #: fraction of slots that are padding
    tokens_per_s: float  #: real tokens per second of this step
    step_time: float  #: seconds of this step
    time: float  #: seconds since the start (of this process)
    lr: float
    grad_norm: float
    #: "" for a step that was applied; "nonfinite" (loss or gradient not finite,
    #: ``on_nonfinite="skip"``) or "no_targets" (no supervised target in the whole
    #: global batch) for a step whose optimizer update was skipped
    skipped: str = ""
    #: images in the step (all ranks); ``None`` (and not in the log line) on text data
    images: int | None = None
    #: the held-out set's token-mean loss after this step; ``None`` (and not in the log line)
    #: on a step that did not evaluate
    eval_loss: float | None = None
    #: ``objective="dpo"``: the step's preference pairs (all ranks; the loss's denominator), their
    #: mean implicit rewards ``beta * (policy - reference)`` of the chosen and of the rejected
    #: answers, and the share of pairs whose chosen reward is above the rejected one; ``None``
    #: (and not in the log line) for SFT
    pairs: int | None = None
    chosen_reward: float | None = None
    rejected_reward: float | None = None
    reward_accuracy: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not (k in _OPTIONAL and v is None)}


#: the fields a log line leaves out when they are ``None``
_OPTIONAL = ("images", "eval_loss", "pairs", "chosen_reward", "rejected_reward", "reward_accuracy")


@dataclass
class LoopState:
    """What the parts see of the run (one per rank)."""

    config: TrainConfig  #: the run's options (``epochs`` resolved into ``steps``)
    steps: int  #: the run's optimizer steps
    rank: int
    world: int
    device: torch.device
    model: nn.Module  #: the model being trained (sharded with FSDP)
    source: Source
    parallel: Parallel  #: how the ranks share the model
    optimization: Optimization  #: the optimizer and its schedule
    start: int = 0  #: the step a resumed run continues after (0: a fresh run)
    logs: list[StepLog] = field(default_factory=list)  #: every step's record so far, this one included
    stopping: bool = False  #: this step ends the run (``stop()`` was true on some rank)
    checkpoint: Path | None = None  #: the last checkpoint this run wrote


class Part(Protocol):
    """A piece of a run the loop calls: at the start, after every step and at the end.

    Every hook does nothing unless a part defines it (subclass ``Part`` to inherit them).
    The loop calls them on every rank where the part is; a part that writes files asks
    for rank 0 where it is assembled, or checks ``state.rank``."""

    def on_start(self, state: LoopState) -> None:
        """Once, after the setup and the resume (``state.start``), before the first step."""
        return None

    def on_step(self, state: LoopState, record: StepLog) -> None:
        """After each step, in the parts' order (a part may add to ``record``: the evaluation's
        ``eval_loss``; the parts after it see it)."""
        return None

    def on_end(self, state: LoopState) -> None:
        """Once the loop ends, after the last step or on an error; only when :meth:`on_start` ran."""
        return None


class OnStep(Part):
    """``fn(record)`` after each step (``train(on_step=fn)``)."""

    def __init__(self, fn: Callable[[StepLog], None]) -> None:
        self.fn = fn

    def on_step(self, state: LoopState, record: StepLog) -> None:
        self.fn(record)
