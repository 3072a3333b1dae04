"""AdamW and its learning-rate schedule over a model's trained parameters, built in the background.

Building an optimizer imports ``torch._dynamo`` (torch.optim's dynamo-disabling wrappers),
a fixed cost of the first step whatever the options: done in a thread, it runs while
the first forward and backward passes compute (torch's kernels release the GIL), and
the optimizer is taken when the first update (or a resume) needs it. It touches no RNG.
The import holds the GIL most of the time, so each kernel of those passes may wait up to
the interpreter's switch interval to get it back: still a net gain over importing first
(``benchmarks/bench_startup.py``, second runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch import nn

from ._options import TrainConfig

__all__ = ["Optimization"]

T = TypeVar("T")
Optimizers = tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]


class _Background(Generic[T]):
    """``fn()`` in a daemon thread; :meth:`result` waits and returns it (or raises its error)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._out: list[T] = []
        self._err: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), name="sftpack-optimizer", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._out.append(fn())
        except BaseException as e:  # handed to result()
            self._err.append(e)

    def result(self) -> T:
        self._thread.join()
        if self._err:
            raise self._err[0]
        return self._out[0]


class Optimization:
    """AdamW over ``model``'s parameters that require a gradient (taken as they are now: after
    sharding, its shards) and its ``LambdaLR`` schedule (``config.lr_factor``), building."""

    def __init__(self, model: nn.Module, config: TrainConfig) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._making = _Background(lambda: _adamw(self.params, config))
        self._built: Optimizers | None = None

    def get(self) -> Optimizers:
        """``(optimizer, scheduler)``, waiting for them the first time."""
        if self._built is None:
            self._built = self._making.result()
        return self._built

    def zero_grad(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)``, also while the optimizer is still being built."""
        if self._built is not None:
            self._built[0].zero_grad(set_to_none=True)
        else:
            for p in self.params:
                p.grad = None


def _adamw(params: list[nn.Parameter], config: TrainConfig) -> Optimizers:
    opt = torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(config.betas[0], config.betas[1]),
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, config.lr_factor)
