"""What a run does with NaN and infinity.

A step whose loss or gradient norm is not finite raises :class:`NonFiniteError` before
the optimizer step (``config.on_nonfinite="error"``) or is skipped (``"skip"``): either
way its update is never applied. A checkpoint is written only of finite parameters.
"""

from __future__ import annotations

import math

from torch import nn

from ._fsdp import local
from ._options import NonFinite, TrainConfig
from ._parallel import Parallel

__all__ = ["NonFiniteError", "check_finite_params", "check_finite_step"]


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite (the message names the step).

    Raised before the optimizer step, so the parameters, the optimizer state and
    every checkpoint written so far are untouched."""


def check_finite_step(config: TrainConfig, step: int, loss: float, norm: float, lr: float) -> bool:
    """Whether step ``step``'s summed ``loss`` and gradient ``norm`` are finite; when not,
    :class:`NonFiniteError` unless ``config.on_nonfinite`` skips such steps. The numbers are
    the same on every rank, so every rank takes the same decision."""
    if math.isfinite(loss) and math.isfinite(norm):
        return True
    if config.on_nonfinite is NonFinite.ERROR:
        raise NonFiniteError(
            f"step {step}: the loss is {loss} and the gradient norm {norm} (not finite), at "
            f"learning rate {lr:.3g}: lower --lr (or raise --warmup-steps), or pass --on-nonfinite "
            f"skip to skip such steps; step {step} was not applied and nothing of it was saved"
        )
    return False


def check_finite_params(model: nn.Module, step: int, parallel: Parallel) -> None:
    """Every parameter finite (each rank checks what it holds; the flags agree over the
    ranks, so every rank raises alike), else :class:`NonFiniteError` naming the first."""
    named = list(model.named_parameters())
    bad = parallel.agree([not bool(local(p).isfinite().all()) for _, p in named])
    for (name, _), b in zip(named, bad):
        if b:
            raise NonFiniteError(
                f"step {step}: parameter {name} holds NaN or infinite values; no checkpoint was written (lower --lr)"
            )
