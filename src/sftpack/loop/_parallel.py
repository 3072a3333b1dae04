"""How the ranks share the model: one :class:`Parallel` chosen once per run (:func:`choose_parallel`).

- :class:`Alone`: one process, the loss module as it is;
- :class:`DDP`: ``torch.nn.parallel.DistributedDataParallel``, the model replicated on every
  rank, gradients all-reduced after the step's last micro-batch;
- :class:`FSDP`: FSDP2 (:mod:`~sftpack.loop._fsdp`): each decoder layer one unit, the loss
  module the root, every rank holding its shards; on one process in a one-rank group.

Each does the same jobs its own way, so the loop and its parts ask without knowing which:
run a micro-batch's forward and backward (:meth:`~Parallel.backward`), agree on flags
about the parameters (:meth:`~Parallel.agree`), gather the full states a checkpoint holds
(:meth:`~Parallel.full_states`: the same files whatever the choice), load them back
(:meth:`~Parallel.load_model`, :meth:`~Parallel.load_optimizer`) and evaluate
(:meth:`~Parallel.evaluate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ._fsdp import ensure_group, full_state, load_state, optimizer_state, shard
from ._micro_batch import MicroBatch
from ._options import TrainConfig

__all__ = ["DDP", "FSDP", "Alone", "LossFactory", "Parallel", "all_reduce", "choose_parallel"]

#: builds the loss module: ``loss_module(model, pad_between_seqs=..., average_over_ranks=...)``
LossFactory = Callable[..., nn.Module]


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks of the initialised default group, in place (alone: itself)."""
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        torch.distributed.all_reduce(t)
    return t


class Parallel(Protocol):
    """The loss module over the ranks, and what the loop and its parts ask of it."""

    #: the loss module (``forward(micro_batch, num_label_tokens)``), wrapped or sharded
    module: nn.Module

    def backward(self, mb: MicroBatch, n: torch.Tensor, *, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch (``n``: the step's global count of
        supervised targets; ``last``: the step's last micro-batch, after which the
        gradients are synchronised); returns its detached share of the loss."""
        ...

    def agree(self, flags: list[bool]) -> list[bool]:
        """Flags each rank computed about its own parameters, made the same on every rank."""
        ...

    def full_states(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The full model and optimizer state dicts, as ``state_dict()`` gives them unsharded,
        on rank 0 (``None`` on the others); every rank calls it."""
        ...

    def load_model(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        """Load a checkpoint's full model state (``saved["model"]``) into ``model``; a sharded
        model takes its shards of the optimizer state (``saved["optimizer"]``) with it."""
        ...

    def load_optimizer(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        """Load the checkpoint's optimizer state, where :meth:`load_model` did not."""
        ...

    def evaluate(self, loss: Callable[[LossFactory], float]) -> float:
        """``loss(loss_module)``: an evaluation through the loss module this choice evaluates with."""
        ...


class Alone:
    """One process: the loss module as it is."""

    def __init__(self, module: nn.Module, loss_module: LossFactory, *, rank: int = 0) -> None:
        self.module = module
        self.rank = rank
        self._loss_module = loss_module

    def backward(self, mb: MicroBatch, n: torch.Tensor, *, last: bool) -> torch.Tensor:
        loss: torch.Tensor = self.module(mb, n)
        loss.backward()
        return loss.detach()

    def agree(self, flags: list[bool]) -> list[bool]:
        return flags  # every rank holds the same whole parameters

    def full_states(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        return (model.state_dict(), optimizer.state_dict()) if self.rank == 0 else None

    def load_model(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        model.load_state_dict(saved["model"])

    def load_optimizer(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        optimizer.load_state_dict(saved["optimizer"])

    def evaluate(self, loss: Callable[[LossFactory], float]) -> float:
        return loss(self._loss_module)  # a loss module of its own, not averaged over ranks


class DDP(Alone):
    """Every rank a replica: gradients all-reduced (averaged) after the last micro-batch."""

    def __init__(self, module: nn.Module, loss_module: LossFactory, *, rank: int) -> None:
        super().__init__(module, loss_module, rank=rank)
        # a vision-language model's tower gets no gradient from a micro-batch without images
        unused = bool(getattr(module, "counts_images", False))
        self.runner = nn.parallel.DistributedDataParallel(module, find_unused_parameters=unused)

    def backward(self, mb: MicroBatch, n: torch.Tensor, *, last: bool) -> torch.Tensor:
        with contextlib.nullcontext() if last else self.runner.no_sync():
            loss: torch.Tensor = self.runner(mb, n)
            loss.backward()
        return loss.detach()


class FSDP:
    """FSDP2: each decoder layer one unit, the loss module the root (:func:`~sftpack.loop._fsdp.shard`);
    gradients reduce-scattered after the last micro-batch, averaged like DDP's."""

    def __init__(self, module: nn.Module, model: nn.Module, device: torch.device, *, rank: int, world: int) -> None:
        shard(module, model, device)
        self.module = module
        self.device = device
        self.rank = rank
        self.world = world

    def backward(self, mb: MicroBatch, n: torch.Tensor, *, last: bool) -> torch.Tensor:
        self.module.set_requires_gradient_sync(self.world == 1 or last)  # type: ignore[operator]
        loss: torch.Tensor = self.module(mb, n)
        loss.backward()
        return loss.detach()

    def agree(self, flags: list[bool]) -> list[bool]:
        # each rank checked its shards: the flags meet in an all-reduce, so every rank acts alike
        summed = all_reduce(torch.tensor(flags, dtype=torch.int64, device=self.device))
        return [bool(f) for f in summed.tolist()]

    def full_states(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        # gathered to rank 0 (every rank takes part): the same files as without FSDP
        weights = full_state(model)
        moments = optimizer_state(model, optimizer)
        return (weights, moments) if self.rank == 0 else None

    def load_model(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        # the sharded parameters' optimizer takes its shards of the saved state
        load_state(model, optimizer, saved["model"], saved["optimizer"])

    def load_optimizer(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        pass  # loaded with the model

    def evaluate(self, loss: Callable[[LossFactory], float]) -> float:
        # through the sharded root (it gathers its parameters), not averaged over ranks
        self.module.average_over_ranks = 1  # type: ignore[assignment]
        try:
            return loss(lambda *a, **k: self.module)
        finally:
            self.module.average_over_ranks = self.world  # type: ignore[assignment]
            self.module.reshard()  # type: ignore[operator]


def choose_parallel(
    config: TrainConfig,
    model: nn.Module,
    loss_module: LossFactory,
    *,
    device: torch.device,
    rank: int,
    world: int,
) -> Parallel:
    """The loss module of ``model`` (``loss_module(model, ...)``, averaged over ``world``
    ranks), shared over the ranks as ``config.fsdp`` and ``world`` say: the run's one choice."""

    def build() -> nn.Module:
        return loss_module(model, pad_between_seqs=config.pad_between_seqs, average_over_ranks=world)

    if config.fsdp:
        ensure_group(device)  # FSDP needs a group, even on one process
        return FSDP(build(), model, device, rank=rank, world=world)
    if world > 1:
        return DDP(build(), loss_module, rank=rank)
    return Alone(build(), loss_module)
