"""The demo's speed comparison: training steps of the paths interleaved, and each ratio checked against its bound.

:class:`Turns` runs the training steps of several :func:`~sftpack.loop.train` runs one
at a time in a fixed rotation (each run in its own thread, waiting for its turn between
steps), so that every path sees the same machine load: on a shared machine, paths run one
after the other would each be timed under another load. Each run's first step is a
warm-up (it also waits for its first turn and builds the optimizer) and is not timed.

:func:`speed_note` says, on a path's line of the table, why its measured ratio over
padded batches is above its bound (:func:`~sftpack.report.flops.flop_bound`) or below 1,
or nothing when it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["Turns", "speed_note"]


class Turns:
    """A fixed rotation of named runs that take one step each in turn.

    A run waits for its first turn in its source's ``next_step`` (:meth:`source`), and
    hands the turn on at the end of each step (:meth:`on_step`, given to ``train``) and
    waits there for its next one, so the step that ``train`` times runs alone. A run
    that ends (its last step, or an error) leaves the rotation (:meth:`leave`).
    """

    def __init__(self, names: Sequence[str]):
        self.order = list(names)
        self.turn = 0
        self.cond = threading.Condition()
        #: each run's micro-batches, step by step (what it was timed on)
        self.batches: dict[str, list[Any]] = {n: [] for n in names}

    def _wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.order or self.order[self.turn] == name)

    def _pass(self, name: str) -> None:
        with self.cond:
            if name in self.order:
                self.turn = (self.order.index(name) + 1) % len(self.order)
                self.cond.notify_all()

    def source(self, name: str, inner: Any) -> Any:
        """``inner`` (a :class:`~sftpack.loop._sources.Source`) whose first ``next_step`` waits for
        ``name``'s first turn; every step's micro-batches are kept in :attr:`batches`."""
        return _TurnSource(self, name, inner)

    def on_step(self, name: str, steps: int) -> Any:
        """``train``'s ``on_step`` for run ``name`` of ``steps`` steps: hand the turn on, wait for the next."""

        def done(rec: Any) -> None:
            if rec.step >= steps:
                self.leave(name)
                return
            self._pass(name)
            self._wait(name)

        return done

    def leave(self, name: str) -> None:
        """``name`` takes no more turns (its run ended or failed): the others go on."""
        with self.cond:
            if name not in self.order:
                return
            i = self.order.index(name)
            ours = self.order[self.turn] == name
            self.order.pop(i)
            if self.order:
                if ours:
                    self.turn = i % len(self.order)
                elif i < self.turn:
                    self.turn -= 1
            self.cond.notify_all()


class _TurnSource:
    def __init__(self, turns: Turns, name: str, inner: Any):
        self._turns, self._name, self._inner = turns, name, inner
        self._started = False

    def next_step(self) -> list[Any]:
        if not self._started:
            self._started = True
            self._turns._wait(self._name)
        mbs = self._inner.next_step()
        self._turns.batches[self._name].append(mbs)
        return mbs

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


def speed_note(ratio: float, bound: float, step_ratios: Sequence[float], calls: tuple[int, int]) -> str:
    """Why a path's measured speed over padded batches breaks what the FLOPs say, or ``""``
    (the ``why`` column of the demo's table: short).

    ``ratio``: the path's real tokens/s over padded batches'; ``bound``: its
    :func:`~sftpack.report.flops.flop_bound`; ``step_ratios``: the same ratio step by step
    (the interleaved steps, so each pair ran under the same load); ``calls``: attention
    calls a step (the path's: one per conversation and layer; padded batches': one per
    micro-batch and layer).

    >>> speed_note(1.8, 2.5, [1.7, 1.9], (40, 2))
    ''
    >>> speed_note(2.7, 2.5, [2.2, 3.1], (40, 2))
    'above bound by timing noise: steps 2.20-3.10x'
    >>> speed_note(0.9, 2.5, [0.85, 0.95], (40, 2))
    'slower: 40 attention calls a step vs 2'
    """
    lo, hi = (min(step_ratios), max(step_ratios)) if step_ratios else (ratio, ratio)
    steps = f"steps {lo:.2f}-{hi:.2f}x"
    if ratio > bound:
        if lo <= bound:
            return f"above bound by timing noise: {steps}"
        return f"above bound on every step ({steps}): padding costs more than its FLOPs here"
    if ratio < 1.0:
        path_calls, padded_calls = calls
        if path_calls > padded_calls:
            return f"slower: {path_calls:,} attention calls a step vs {padded_calls:,}"
        if hi >= 1.0:
            return f"slower by timing noise: {steps}"
        return f"slower on every step ({steps}): not explained by FLOPs or calls"
    return ""
