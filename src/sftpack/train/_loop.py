"""The training loop: AdamW, a warm-up + decay schedule, gradient accumulation,
clipping, the global token-mean loss, data parallelism and exact resume.

One optimizer step, on every rank::

    micro-batches = source.next_step()                 # this rank's share of the global batch
    n = all_reduce(sum of supervised targets)          # one count for the whole step, all ranks
    for mb in micro-batches:                           # DDP syncs gradients on the last one only
        (sum of token losses(mb) / n * world).backward()   # DDP averages over ranks: undo it
    clip, AdamW step, LR step; log loss, real tokens, slots, tokens/s

The loss of a step is the token mean over the whole global batch, however the
conversations were grouped into rows, micro-batches and ranks, so the packed
paths and the padded baseline train the same model from the same conversations
(tests/train: per-step losses and final parameters agree within fp32 noise).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from ._data import Source
from ._model import LossModule
from ._options import TrainConfig

__all__ = ["StepLog", "TrainResult", "dist_info", "init_distributed", "train"]


def dist_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default group, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def init_distributed() -> tuple[int, int]:
    """Join the ``torchrun`` group when ``WORLD_SIZE > 1`` (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist_info()


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

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    logs: list[StepLog]
    model: Any
    #: this rank's conversation ids per step (in micro-batch order)
    conversations: list[list[Any]] = field(default_factory=list)
    resumed_from: int = 0

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.logs]


def _step_of(line: str) -> float:
    """The ``step`` of a log line; a line cut short by a kill counts as after any checkpoint."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _allreduce(t: torch.Tensor) -> torch.Tensor:
    if dist_info()[1] > 1:
        torch.distributed.all_reduce(t)
    return t


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device:
        return torch.device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train(
    config: TrainConfig,
    *,
    source: Source,
    model: Any,
    log: str | os.PathLike[str] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = False,
    on_step: Callable[[StepLog], None] | None = None,
) -> TrainResult:
    """Train ``model`` on ``source`` for ``config.steps`` optimizer steps.

    Args:
        config: :class:`TrainConfig`.
        source: this rank's micro-batches per step (:mod:`sftpack.train` ``make_source``).
        model: a Hugging Face causal LM (``build_model`` / ``load_model``), trained in place.
        log: JSONL file, one :class:`StepLog` per line (rank 0 writes it).
        checkpoint_dir: where ``config.checkpoint_every`` saves (and ``resume`` reads).
        resume: continue from the latest checkpoint in ``checkpoint_dir`` if there is one.
        stop_after: stop after this optimizer step (a simulated interruption), as if killed.
        progress: a tqdm bar with the loss and real tokens/s (rank 0).
        on_step: called with each :class:`StepLog`.

    Returns:
        :class:`TrainResult`.

    Raises:
        CheckpointError: ``resume`` found a checkpoint of other data (fingerprint) or world size.
    """
    rank, world = dist_info()
    device = _device(config)
    model.to(device)
    loss_module = LossModule(
        model, pad_between_seqs=config.pad_between_seqs, average_over_ranks=world
    )
    runner: torch.nn.Module = loss_module
    if world > 1:
        runner = torch.nn.parallel.DistributedDataParallel(loss_module)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=tuple(config.betas),
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, config.lr_factor)
    fingerprint = source.fingerprint()

    start = 0
    if resume:
        if checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint directory (--checkpoint-dir)")
        path = latest_checkpoint(checkpoint_dir)
        if path is not None:
            shared, mine = load_checkpoint(
                path, rank=rank, world=world, fingerprint=fingerprint
            )
            model.load_state_dict(shared["model"])
            opt.load_state_dict(shared["optimizer"])
            sched.load_state_dict(shared["scheduler"])
            source.load_state_dict(mine["data"])
            set_rng_state(mine["rng"])
            start = int(shared["step"])

    writer = None
    if log is not None and rank == 0:
        kept = []
        if (
            start and Path(log).is_file()
        ):  # keep the lines of the steps up to the checkpoint
            kept = [
                ln for ln in Path(log).read_text().splitlines() if _step_of(ln) <= start
            ]
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        writer = open(log, "w")  # noqa: SIM115 - closed in finally
        writer.writelines(ln + "\n" for ln in kept)
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=config.steps,
            initial=start,
            desc=f"train ({config.packing})",
            unit="step",
        )

    logs: list[StepLog] = []
    conversations: list[list[Any]] = []
    t_start = time.perf_counter()
    last = config.steps if stop_after is None else min(config.steps, stop_after)
    try:
        for step in range(start, last):
            t0 = time.perf_counter()
            mbs = [mb.to(device) for mb in source.next_step()]
            n = _allreduce(
                torch.tensor(
                    sum(mb.num_label_tokens for mb in mbs),
                    dtype=torch.int64,
                    device=device,
                )
            )
            opt.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float32, device=device)
            for i, mb in enumerate(mbs):
                sync = world == 1 or i == len(mbs) - 1
                ctx = contextlib.nullcontext() if sync else runner.no_sync()  # type: ignore[operator]
                with ctx:
                    loss = runner(mb, n)
                    loss.backward()
                step_loss += loss.detach()
            if config.clip_norm is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, config.clip_norm)
            else:
                grad_norm = torch.nn.utils.get_total_norm(
                    [p.grad for p in params if p.grad is not None]
                )
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            counts = torch.tensor(
                [
                    float(step_loss) / world,
                    sum(mb.num_real_tokens for mb in mbs),
                    sum(mb.num_tokens for mb in mbs),
                    sum(len(mb.sequence_ids or ()) for mb in mbs),
                ],
                dtype=torch.float64,
                device=device,
            )
            _allreduce(counts)
            dt = time.perf_counter() - t0
            real, slots = int(counts[1]), int(counts[2])
            rec = StepLog(
                step=step + 1,
                loss=float(counts[0]),
                real_tokens=real,
                slots=slots,
                label_tokens=int(n),
                sequences=int(counts[3]),
                micro_batches=len(mbs),
                padding=1.0 - real / max(slots, 1),
                tokens_per_s=real / dt,
                step_time=dt,
                time=time.perf_counter() - t_start,
                lr=float(lr),
                grad_norm=float(grad_norm),
            )
            logs.append(rec)
            conversations.append([c for mb in mbs for c in (mb.sequence_ids or ())])
            if writer is not None:
                writer.write(json.dumps(rec.as_dict()) + "\n")
                writer.flush()
            if bar is not None:
                bar.set_postfix(
                    loss=f"{rec.loss:.4f}", tok_s=f"{rec.tokens_per_s:,.0f}"
                )
                bar.update(1)
            if on_step is not None:
                on_step(rec)
            every = config.checkpoint_every
            if checkpoint_dir is not None and every and (step + 1) % every == 0:
                shared = None
                if rank == 0:
                    shared = {
                        "step": step + 1,
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "config": config.as_dict(),
                        "fingerprint": fingerprint,
                        "world": world,
                    }
                save_checkpoint(
                    checkpoint_dir,
                    step + 1,
                    shared=shared,
                    rank=rank,
                    per_rank={"data": source.state_dict(), "rng": rng_state()},
                )
    finally:
        if writer is not None:
            writer.close()
        if bar is not None:
            bar.close()
    return TrainResult(logs, model, conversations, resumed_from=start)
