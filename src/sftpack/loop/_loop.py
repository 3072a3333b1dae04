"""The training loop: AdamW, a warm-up + decay schedule, gradient accumulation,
clipping, the global token-mean loss, data parallelism and exact resume.

One optimizer step, on every rank::

    micro-batches = source.next_step()                 # this rank's share of the global batch
    n = all_reduce(sum of supervised targets)          # one count for the whole step, all ranks
    for mb in micro-batches:                           # DDP (or FSDP) syncs gradients on the last one only
        (sum of token losses(mb) / n * world).backward()   # both average over ranks: undo it
    clip, AdamW step, LR step; log loss, real tokens, slots, tokens/s

The loss of a step is the token mean over the whole global batch, however the
conversations were grouped into rows, micro-batches and ranks, so the packed
paths and the padded baseline train the same model from the same conversations
(``tests/loop/test_equality.py``: per-step losses and final parameters agree to a
fixed float64 tolerance derived there). With ``config.fsdp`` the model is sharded
over the ranks (FSDP2, :mod:`~sftpack.loop._fsdp`) instead of replicated by DDP: the
same step, the same numbers to that tolerance (``tests/loop/test_fsdp.py``), and
checkpoints of the same format (the full state gathered to rank 0).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .._progress import Bar
from ..sample import Sample
from ._checkpoint import (
    CheckpointError,
    check_new_run,
    latest_checkpoint,
    load_checkpoint,
    model_dtype,
    remove_other_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from ._eval import EvalSet, _allreduce
from ._fsdp import ensure_group, full_state, load_state, optimizer_state, shard
from ._fsdp import local as fsdp_local
from ._model import LossModule, require_exact
from ._options import NonFinite, TrainConfig
from ._sources import Source

__all__ = [
    "NonFiniteError",
    "StepLog",
    "TrainResult",
    "dist_info",
    "init_distributed",
    "resolve_device",
    "train",
]


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite (the message names the step).

    Raised before the optimizer step, so the parameters, the optimizer state and
    every checkpoint written so far are untouched."""


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
    #: "" for a step that was applied; "nonfinite" (loss or gradient not finite,
    #: ``on_nonfinite="skip"``) or "no_targets" (no supervised target in the whole
    #: global batch) for a step whose optimizer update was skipped
    skipped: str = ""
    #: images in the step (all ranks); ``None`` (and not in the log line) on text data
    images: int | None = None
    #: the held-out set's token-mean loss after this step; ``None`` (and not in the log line)
    #: on a step that did not evaluate
    eval_loss: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not (k in ("images", "eval_loss") and v is None)}


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    logs: list[StepLog]
    model: Any
    #: this rank's conversation ids per step (in micro-batch order)
    conversations: list[list[Any]] = field(default_factory=list)
    resumed_from: int = 0
    #: ``stop()`` asked the run to end early: it ended after the last step logged
    stopped: bool = False
    #: the last checkpoint this run wrote (``None``: none)
    checkpoint: Path | None = None
    #: the run's optimizer steps (``config.steps``, or what ``config.epochs`` came to)
    steps: int = 0

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.logs]

    @property
    def skipped_steps(self) -> dict[str, list[int]]:
        """The steps whose update was skipped, by reason (``"nonfinite"``, ``"no_targets"``)."""
        out: dict[str, list[int]] = {}
        for r in self.logs:
            if r.skipped:
                out.setdefault(r.skipped, []).append(r.step)
        return out


def _step_of(line: str) -> float:
    """The ``step`` of a log line; a line cut short by a kill counts as after any checkpoint."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def resolve_device(name: str | None) -> torch.device:
    """The torch device ``name`` names, checked to be usable here (``None``: CUDA when
    present, else the CPU).

    Raises:
        ValueError: not a device name, or a device this machine does not have (the
            message says which and what to use instead).
    """
    if not name:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device {name!r} is not a torch device name: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(
                f"device {name!r}: CUDA is not available here ({why}); use --device cpu, or leave --device "
                "out to use CUDA only when present"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    elif dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(
                f"device {name!r} is not usable here ({' '.join(str(e).split())[:100]}); use --device cpu"
            ) from None
    return dev


#: options whose saved values a resumed run keeps (the optimizer and scheduler
#: state restore them), so a different value now would be silently ignored
_RESUME_FIXED = {
    "lr": "--lr",
    "schedule": "--schedule",
    "warmup_steps": "--warmup-steps",
    "min_lr_ratio": "--min-lr-ratio",
    "weight_decay": "--weight-decay",
    "clip_norm": "--clip-norm",
    "betas": "betas",
    "eps": "eps",
}


def _check_resume_options(path: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    diffs = [
        f"{flag} {saved[k]!r} (checkpoint) vs {now[k]!r} (this run)"
        for k, flag in _RESUME_FIXED.items()
        if k in saved and saved[k] != now[k]
    ]
    if diffs:
        raise CheckpointError(
            f"{path}: a resumed run continues with the optimizer and schedule it saved, so these options "
            f"would be ignored: {'; '.join(diffs)}; resume with the checkpoint's values, or start a fresh "
            "--checkpoint-dir (from the saved model, to train on with new settings)"
        )


def _check_ids(mbs: list[Any], vocab: int, step: int) -> None:
    """Every token id of the step is a row of the model's embedding (else one clear error)."""
    for mb in mbs:
        ids = mb.input_ids
        if ids.numel() == 0:
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            bad = hi if hi >= vocab else lo
            who = ", ".join(str(c) for c in (mb.sequence_ids or ())[:3])
            raise ValueError(
                f"step {step}: token id {bad} is outside the model's vocabulary of {vocab:,} ids (conversations "
                f"{who}...): the data was tokenized with another tokenizer than the model's; use the model's "
                "tokenizer (--tokenizer) or a model with a large enough vocabulary"
            )


def _check_finite_params(model: Any, step: int, sharded: torch.device | None = None) -> None:
    """Every parameter finite; ``sharded`` (FSDP: the device of the ranks' flags): each rank
    checks its shards and the flags meet in an all-reduce, so every rank raises alike."""
    named = list(model.named_parameters())
    bad = [not bool(torch.isfinite(fsdp_local(p)).all()) for _, p in named]
    if sharded is not None:
        bad = [bool(f) for f in _allreduce(torch.tensor(bad, dtype=torch.int64, device=sharded)).tolist()]
    for (name, _), b in zip(named, bad):
        if b:
            raise NonFiniteError(
                f"step {step}: parameter {name} holds NaN or infinite values; no checkpoint was written (lower --lr)"
            )


class _Background:
    """``fn()`` in a daemon thread; :meth:`result` waits and returns it (or raises its error)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._err: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), name="sftpack-optimizer", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._out.append(fn())
        except BaseException as e:  # handed to result()
            self._err.append(e)

    def result(self) -> Any:
        self._thread.join()
        if self._err:
            raise self._err[0]
        return self._out[0]


def train(
    config: TrainConfig,
    *,
    source: Source,
    model: Any,
    log: str | os.PathLike[str] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume: bool | Literal["auto"] = False,
    overwrite: bool = False,
    stop_after: int | None = None,
    stop: Callable[[], bool] | None = None,
    progress: bool = False,
    on_step: Callable[[StepLog], None] | None = None,
    loss_module: Callable[..., torch.nn.Module] = LossModule,
    eval_samples: Sequence[Sample] | None = None,
    tensorboard: str | os.PathLike[str] | None = None,
) -> TrainResult:
    """Train ``model`` on ``source`` for ``config.steps`` optimizer steps (or ``config.epochs``
    passes over its data: ``source.epoch_steps()`` each, the fewest of any rank).

    Args:
        config: :class:`TrainConfig`.
        source: this rank's micro-batches per step (:func:`~sftpack.loop.make_source`).
        model: a Hugging Face causal LM (``build_model`` / ``load_model``), trained in place.
            With ``config.fsdp`` its decoder layers and the loss module are sharded in place
            (``fully_shard``; on one process in a one-rank group that ``train`` starts when
            none is there): its parameters stay ``DTensor`` shards after the run, and
            :func:`~sftpack.loop._fsdp.full_state` gathers them (every rank calls it).
        log: JSONL file, one :class:`StepLog` per line (rank 0 writes it).
        checkpoint_dir: where ``config.checkpoint_every`` saves (and ``resume`` reads).
        resume: ``True``: continue from the latest checkpoint in ``checkpoint_dir``
            (there must be one); ``"auto"``: continue from it if there is one, else
            start at step 1 (a job re-run after preemption); ``False``: start at step 1,
            in a ``checkpoint_dir`` that holds no other run's checkpoints.
        overwrite: with ``resume=False``: start even when ``checkpoint_dir`` holds another
            run's checkpoints, and remove them once this run's first checkpoint is written.
        stop_after: stop after this optimizer step (a simulated interruption), as if killed.
        stop: asked once a step (after its backward passes; on every rank, any rank's
            ``True`` counts): ``True`` ends the run after that step, saving a checkpoint
            first when there is a ``checkpoint_dir`` (a preempted job: ``sftpack train``
            passes whether SIGTERM came); the result then says ``stopped``.
        progress: a tqdm bar with the loss and real tokens/s (rank 0).
        on_step: called with each :class:`StepLog`.
        loss_module: builds the module whose ``forward(micro_batch, num_label_tokens)``
            returns the micro-batch's share of the global loss, called as
            ``loss_module(model, pad_between_seqs=..., average_over_ranks=...)``: the
            :class:`LossModule` by default, for text and for a vision-language model on
            micro-batches with images alike (for such a model the log adds ``images``).
        eval_samples: held-out samples (:func:`~sftpack.loop._eval.split_eval`, or another file's):
            their token-mean loss is the ``eval_loss`` of every ``config.eval_every``-th
            step and of the last (:class:`~sftpack.loop._eval.EvalSet`). Required with
            ``config.eval_fraction`` or ``config.eval_every``.
        tensorboard: a folder for TensorBoard scalars of every step (rank 0;
            :mod:`~sftpack.loop._tensorboard`): the log's loss, lr, grad_norm,
            tokens_per_s, fill and eval_loss.

    Returns:
        :class:`TrainResult`.

    Raises:
        CheckpointError: ``resume`` found no checkpoint, a damaged one (a file that does
            not match its checksum), or one of other data (fingerprint), world size,
            model dtype or optimisation options; a fresh run (``resume=False``) found
            another run's checkpoints in ``checkpoint_dir`` (without ``overwrite``); a
            checkpoint could not be written (a full disk: the message names the folder
            and the cause, and the previous checkpoint stays ``latest``).
        NonFiniteError: a step's loss or gradient norm was not finite (with
            ``config.on_nonfinite="error"``).
        InexactPackingError: a packed run (``config.packing`` not ``"none"``) on a model whose packing
            is not exact (:func:`sftpack.exactness.require_exact_packing`: a Mamba2 mixer, a short conv...),
            before any step, unless ``config.allow_inexact_packing`` (then a warning).
        ValueError: an unusable ``config.device``, or a token id outside the model's vocabulary;
            ``config.fsdp`` with a vision-language model, or a model whose decoder layers
            are not found (:func:`~sftpack.loop._fsdp.decoder_layers`).
    """
    if resume not in (True, False, "auto"):
        raise ValueError(f"resume must be True, False or 'auto', got {resume!r}")
    if eval_samples is None and (config.eval_fraction or config.eval_every is not None):
        raise ValueError(
            "config.eval_fraction / eval_every: pass the held-out samples as eval_samples "
            "(sftpack.loop._eval.split_eval(config, samples))"
        )
    if checkpoint_dir is not None and not resume and not overwrite:
        check_new_run(checkpoint_dir)  # before anything slow
    rank, world = dist_info()
    device = resolve_device(config.device)
    if config.epochs is not None:  # the fewest steps of any rank: every rank takes as many
        per_epoch = torch.tensor(source.epoch_steps(), dtype=torch.int64)
        if world > 1:
            per_epoch = per_epoch.to(device)
            torch.distributed.all_reduce(per_epoch, op=torch.distributed.ReduceOp.MIN)
        config = config.with_epoch_steps(int(per_epoch))
    steps = config.total_steps
    evals = None if eval_samples is None else EvalSet(config, eval_samples, rank=rank, world=world)
    model.to(device)
    require_exact(model, config)  # before any step: no model trains packed unless packing is exact on it
    fsdp = bool(config.fsdp)
    if fsdp:
        ensure_group(device)
    module = loss_module(model, pad_between_seqs=config.pad_between_seqs, average_over_ranks=world)
    runner: torch.nn.Module = module
    if fsdp:  # each decoder layer one unit, the loss module the root; gradients averaged like DDP's
        shard(module, model, device)
    elif world > 1:
        # a vision-language model's tower gets no gradient from a micro-batch without images
        unused = bool(getattr(module, "counts_images", False))
        runner = torch.nn.parallel.DistributedDataParallel(module, find_unused_parameters=unused)
    params = [p for p in model.parameters() if p.requires_grad]

    def make_optimizer() -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=(config.betas[0], config.betas[1]),
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, config.lr_factor)

    # Building an optimizer imports torch._dynamo (torch.optim's dynamo-disabling wrappers),
    # a fixed cost of the first step whatever the options: done in a thread, it runs while
    # the first forward and backward passes compute (torch's kernels release the GIL), and
    # the optimizer is taken when the first update needs it. It touches no RNG. The import
    # holds the GIL most of the time, so each kernel of those passes may wait up to the
    # interpreter's switch interval to get it back: still a net gain over importing first
    # (benchmarks/bench_startup.py, second runs).
    making = _Background(make_optimizer)
    opt: Any = None
    sched: Any = None
    # asked for only when a checkpoint is read or written: a source still receiving
    # its samples (sftpack train tokenizing in the background) then waits for them all
    fingerprint: str | None = source.fingerprint() if resume else None

    start = 0
    if resume:
        if checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint directory (--checkpoint-dir)")
        path = latest_checkpoint(checkpoint_dir)
        if path is None and resume is True:
            found = sorted(p.name for p in Path(checkpoint_dir).glob("step_*") if p.is_dir())
            raise CheckpointError(
                f"{checkpoint_dir} holds no checkpoint to resume from (no 'latest' pointer"
                + (f"; folders {', '.join(found[-3:])} are there" if found else "")
                + "): check the --checkpoint-dir path, or use --resume-if-any (resume='auto') to start at step "
                "1 when there is none"
            )
        if path is not None:
            shared, mine = load_checkpoint(
                path, rank=rank, world=world, fingerprint=fingerprint or source.fingerprint(), model=model
            )
            _check_resume_options(path, shared.get("config") or {}, config.as_dict())
            if fsdp:  # the sharded parameters' optimizer takes its shards of the saved state
                opt, sched = making.result()
            try:
                if fsdp:
                    load_state(model, opt, shared["model"], shared["optimizer"])
                else:
                    model.load_state_dict(shared["model"])
            except (RuntimeError, KeyError, ValueError) as e:
                raise CheckpointError(
                    f"{path / 'state.pt'} holds another model's weights ({' '.join(str(e).split())[:160]}): "
                    "resume with the same --model or --dim/--layers/--heads/--kv-heads/--vocab"
                ) from None
            if not fsdp:
                opt, sched = making.result()
                opt.load_state_dict(shared["optimizer"])
            sched.load_state_dict(shared["scheduler"])
            source.load_state_dict(mine["data"])
            set_rng_state(mine["rng"])
            start = int(shared["step"])

    writer = None
    scalars = None
    if tensorboard is not None and rank == 0:
        from ._tensorboard import TensorBoardScalars

        scalars = TensorBoardScalars(tensorboard, resumed_from=start)
    if log is not None and rank == 0:
        kept = []
        if start and Path(log).is_file():  # keep the lines of the steps up to the checkpoint
            kept = [ln for ln in Path(log).read_text().splitlines() if _step_of(ln) <= start]
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        writer = open(log, "w")  # noqa: SIM115 - closed in finally
        writer.writelines(ln + "\n" for ln in kept)
    bar = None
    if progress and rank == 0:
        bar = Bar(
            total=steps,
            initial=start,
            desc=f"train ({config.packing})",
            unit="step",
        )

    vocab = model.get_input_embeddings().num_embeddings
    logs: list[StepLog] = []
    conversations: list[list[Any]] = []
    t_start = time.perf_counter()
    last = steps if stop_after is None else min(steps, stop_after)
    stopped = False
    saved: Path | None = None
    replace = overwrite and not start  # another run's checkpoints go once this run has one

    def checkpoint(step: int) -> Path:
        nonlocal fingerprint, replace
        _check_finite_params(model, step, device if fsdp else None)  # never a checkpoint that cannot train on
        to_save: dict[str, Any] | None = None  # rank 0 writes the shared state
        if fingerprint is None:
            fingerprint = source.fingerprint()
        # FSDP: the full states gathered to rank 0 (every rank takes part): the same files as without
        weights = full_state(model) if fsdp else None
        moments = optimizer_state(model, opt) if fsdp else None
        if rank == 0:
            to_save = {
                "step": step,
                "model": weights if fsdp else model.state_dict(),
                "optimizer": moments if fsdp else opt.state_dict(),
                "scheduler": sched.state_dict(),
                "config": config.as_dict(),
                "fingerprint": fingerprint,
                "world": world,
                "dtype": model_dtype(model),
            }
        assert checkpoint_dir is not None
        path = save_checkpoint(
            checkpoint_dir,
            step,
            shared=to_save,
            rank=rank,
            per_rank={"data": source.state_dict(), "rng": rng_state()},
        )
        if replace:
            if rank == 0:
                remove_other_checkpoints(checkpoint_dir, keep=path)
            replace = False
        return path

    try:
        for step in range(start, last):
            t0 = time.perf_counter()
            mbs = source.next_step()
            _check_ids(mbs, vocab, step + 1)
            mbs = [mb.to(device) for mb in mbs]
            n = _allreduce(
                torch.tensor(
                    sum(mb.num_label_tokens for mb in mbs),
                    dtype=torch.int64,
                    device=device,
                )
            )
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:  # the first step, the optimizer still being built: what zero_grad(set_to_none=True) does
                for p in params:
                    p.grad = None
            step_loss = torch.zeros((), dtype=torch.float32, device=device)
            # n is global: every rank agrees on a step with no supervised target at all
            skipped = "" if int(n) else "no_targets"
            grad_norm: Any = 0.0
            if not skipped:
                for i, mb in enumerate(mbs):
                    sync = world == 1 or i == len(mbs) - 1
                    if fsdp:  # gradients reduce-scattered after the last micro-batch only
                        runner.set_requires_gradient_sync(sync)  # type: ignore[operator]
                    ctx = contextlib.nullcontext() if sync or fsdp else runner.no_sync()  # type: ignore[operator]
                    with ctx:
                        loss = runner(mb, n)
                        loss.backward()
                    step_loss = step_loss + loss.detach()  # a float64 model's loss stays float64
                if config.clip_norm is not None:
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.clip_norm)
                else:
                    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                if hasattr(grad_norm, "full_tensor"):  # FSDP: a replicated DTensor
                    grad_norm = grad_norm.full_tensor()
            if opt is None:
                opt, sched = making.result()
            lr = opt.param_groups[0]["lr"]
            counts = torch.tensor(
                [
                    float(step_loss) / world,
                    sum(mb.num_real_tokens for mb in mbs),
                    sum(mb.num_tokens for mb in mbs),
                    sum(len(mb.sequence_ids or ()) for mb in mbs),
                    sum(getattr(mb, "num_media_items", 0) for mb in mbs),
                    float(stop is not None and stop()),  # any rank asked to stop: every rank stops
                ],
                dtype=torch.float64,
                device=device,
            )
            _allreduce(counts)
            # The summed loss (all ranks) and the norm of the synchronised gradients are
            # the same on every rank, so every rank takes the same decision.
            loss_sum, norm = float(counts[0]), float(grad_norm)
            if not skipped and not (math.isfinite(loss_sum) and math.isfinite(norm)):
                if config.on_nonfinite is NonFinite.ERROR:
                    raise NonFiniteError(
                        f"step {step + 1}: the loss is {loss_sum} and the gradient norm {norm} (not finite), at "
                        f"learning rate {lr:.3g}: lower --lr (or raise --warmup-steps), or pass --on-nonfinite "
                        f"skip to skip such steps; step {step + 1} was not applied and nothing of it was saved"
                    )
                skipped = "nonfinite"
            if skipped:
                opt.zero_grad(set_to_none=True)  # the parameters and AdamW's moments stay as they are
            else:
                opt.step()
            sched.step()  # a skipped step still counts: the schedule follows the step number
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
                grad_norm=norm,
                skipped=skipped,
                images=int(counts[4]) if getattr(module, "counts_images", False) else None,
            )
            every = config.eval_every
            if evals is not None and (step + 1 == steps or (every and (step + 1) % every == 0)):
                if fsdp:  # through the sharded root (it gathers its parameters), not averaged over ranks
                    module.average_over_ranks = 1  # type: ignore[assignment]
                    try:
                        rec.eval_loss = evals.loss(model, device, lambda *a, **k: module)
                    finally:
                        module.average_over_ranks = world  # type: ignore[assignment]
                        runner.reshard()  # type: ignore[operator]
                else:
                    rec.eval_loss = evals.loss(model, device, loss_module)
            logs.append(rec)
            conversations.append([c for mb in mbs for c in (mb.sequence_ids or ())])
            if writer is not None:
                writer.write(json.dumps(rec.as_dict()) + "\n")
                writer.flush()
            if scalars is not None:
                scalars.write(rec.as_dict())
            if bar is not None:
                shown = {"loss": f"{rec.loss:.4f}", "tok_s": f"{rec.tokens_per_s:,.0f}"}
                if evals is not None:
                    last_eval = next((r.eval_loss for r in reversed(logs) if r.eval_loss is not None), None)
                    shown["eval_loss"] = "-" if last_eval is None else f"{last_eval:.4f}"
                bar.set_postfix(**shown)
                bar.update(1)
            if on_step is not None:
                on_step(rec)
            stopped = bool(counts[5])
            if checkpoint_dir is not None and (
                stopped or (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0)
            ):
                saved = checkpoint(step + 1)
            if stopped:
                break
    finally:
        if writer is not None:
            writer.close()
        if scalars is not None:
            scalars.close()
        if bar is not None:
            bar.close()
    return TrainResult(logs, model, conversations, resumed_from=start, stopped=stopped, checkpoint=saved, steps=steps)
