"""The training loop: AdamW, a warm-up + decay schedule, gradient accumulation,
clipping, the global token-mean loss, data parallelism and exact resume.

One optimizer step, on every rank::

    micro-batches = source.next_step()                 # this rank's share of the global batch
    n = all_reduce(sum of supervised targets)          # one count for the whole step, all ranks
    for mb in micro-batches:                           # DDP (or FSDP) syncs gradients on the last one only
        (sum of token losses(mb) / n * world).backward()   # both average over ranks: undo it
    clip, AdamW step, LR step; log loss, real tokens, slots, tokens/s

With weights, or ``config.weight_normalisation`` "sequence" / "group", the rows' weights are first
turned into the rule's coefficients and ``n`` into its count (:func:`sftpack.loss.normalise_weights`,
one all-reduce), and the same loop runs.

The loss of a step is the token mean over the whole global batch, however the
conversations were grouped into rows, micro-batches and ranks, so the packed
paths and the padded baseline train the same model from the same conversations
(``tests/loop/test_equality.py``: per-step losses and final parameters agree to a
fixed float64 tolerance derived there). With ``config.fsdp`` the model is sharded
over the ranks (FSDP2, :mod:`~sftpack.loop._fsdp`) instead of replicated by DDP: the
same step, the same numbers to that tolerance (``tests/loop/test_fsdp.py``), and
checkpoints of the same format (the full state gathered to rank 0).

:func:`train` itself only sets up, resumes, steps and hands each step's record on: how
the ranks share the model is one :class:`~sftpack.loop._parallel.Parallel` chosen once,
and the log, TensorBoard, the evaluation, the progress bar and the checkpoints are
parts (:mod:`~sftpack.loop._parts`: the list, their order, and how to add one).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..handoff import PackedBatch
from ..loss import normalise_weights
from ..sample import Sample, WeightNormalisation
from ._bar import ProgressBar
from ._checkpointing import Checkpoints
from ._eval import EvalSet, Evaluation
from ._finite import NonFiniteError, check_finite_step
from ._log import JsonlLog
from ._micro_batch import MicroBatch
from ._model import LossModule, require_exact
from ._optimizer import Optimization
from ._options import TrainConfig
from ._parallel import all_reduce, choose_parallel
from ._parts import LoopState, OnStep, Part, StepLog
from ._preference import pairs_in, preference_loss_module
from ._sources import Source
from ._tensorboard import TensorBoard

__all__ = [
    "NonFiniteError",
    "StepLog",
    "TrainResult",
    "dist_info",
    "init_distributed",
    "resolve_device",
    "train",
]


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


def _check_ids(mbs: list[MicroBatch], vocab: int, step: int) -> None:
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
    parts: Sequence[Part] = (),
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
        parts: parts of the caller's own (:class:`~sftpack.loop._parts.Part`: another logger...),
            called on every rank: ``on_start`` after the resume, ``on_step`` with each
            :class:`StepLog` after the built-in parts and the ``on_step`` callback and before the
            step's checkpoint, ``on_end`` once at the end (also after an error).

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
    checkpoints = Checkpoints(checkpoint_dir, resume=resume, overwrite=overwrite)  # before anything slow
    rank, world = dist_info()
    device = resolve_device(config.device)
    config = _with_epoch_steps(config, source, device, world)
    evals = None if eval_samples is None else EvalSet(config, eval_samples, rank=rank, world=world)
    model.to(device)
    require_exact(model, config)  # before any step: no model trains packed unless packing is exact on it
    if config.preference and loss_module is LossModule:
        loss_module = preference_loss_module(config, model)  # the reference: the starting weights, or a folder
    parallel = choose_parallel(config, model, loss_module, device=device, rank=rank, world=world)
    optimization = Optimization(model, config)  # built in the background while the first step computes
    state = LoopState(config, config.total_steps, rank, world, device, model, source, parallel, optimization)
    state.start = checkpoints.resume(state)
    assembled: list[Part] = [] if evals is None else [Evaluation(evals)]
    if rank == 0:  # the files and the bar
        assembled += [TensorBoard(tensorboard)] if tensorboard is not None else []
        assembled += [JsonlLog(log)] if log is not None else []
        assembled += [ProgressBar(evaluating=evals is not None)] if progress else []
    assembled += [OnStep(on_step)] if on_step is not None else []
    assembled += [*parts, checkpoints]  # the checkpoint last: of a step every part has seen

    vocab = model.get_input_embeddings().num_embeddings
    last = state.steps if stop_after is None else min(state.steps, stop_after)
    conversations: list[list[Any]] = []
    started: list[Part] = []
    try:
        for part in assembled:
            part.on_start(state)
            started.append(part)
        t_start = time.perf_counter()
        for step in range(state.start + 1, last + 1):
            mbs, record = _step(state, step, vocab, stop, t_start)
            state.logs.append(record)
            conversations.append([c for mb in mbs for c in (mb.sequence_ids or ())])
            for part in assembled:
                part.on_step(state, record)
            if state.stopping:
                break
    finally:
        for part in started:
            part.on_end(state)
    return TrainResult(
        state.logs,
        model,
        conversations,
        resumed_from=state.start,
        stopped=state.stopping,
        checkpoint=state.checkpoint,
        steps=state.steps,
    )


def _with_epoch_steps(config: TrainConfig, source: Source, device: torch.device, world: int) -> TrainConfig:
    """``config`` with ``config.epochs`` counted in steps: the fewest of any rank, so every rank takes as many."""
    if config.epochs is None:
        return config
    per_epoch = torch.tensor(source.epoch_steps(), dtype=torch.int64)
    if world > 1:
        per_epoch = per_epoch.to(device)
        torch.distributed.all_reduce(per_epoch, op=torch.distributed.ReduceOp.MIN)
    return config.with_epoch_steps(int(per_epoch))


def _step(
    state: LoopState, step: int, vocab: int, stop: Callable[[], bool] | None, t_start: float
) -> tuple[list[MicroBatch], StepLog]:
    """Optimizer step ``step`` (1-based), on every rank: this rank's micro-batches and the step's record."""
    t0 = time.perf_counter()
    mbs = state.source.next_step()
    _check_ids(mbs, vocab, step)
    mbs = [mb.to(state.device) for mb in mbs]
    dpo = state.config.preference  # DPO or SimPO: the step counts pairs
    labels = sum(mb.num_label_tokens for mb in mbs)
    # the loss's denominator, over the whole step on every rank: supervised targets, or (dpo) pairs
    local = sum(len(pairs_in(mb)) for mb in mbs) if dpo else labels
    n = all_reduce(torch.tensor(local, dtype=torch.int64, device=state.device))
    # with weights (sft), or a sequence / group mean: the weights turned into the rule's coefficients
    # and its global denominator (sftpack.loss.normalise_weights; step_weighted and the rule are the
    # same on every rank, so every rank all-reduces float64 alike)
    denom = n
    rule = state.config.weight_normalisation
    if not dpo and (rule is not WeightNormalisation.TOKEN or getattr(state.source, "step_weighted", False)):
        mbs, denom = _normalised(state, mbs, rule)
    state.optimization.zero_grad()
    # n is global: every rank agrees on a step with no supervised target at all (or all weighted 0)
    skipped = "" if int(n) and bool(denom) else "no_targets"
    step_loss = torch.zeros((), dtype=torch.float32, device=state.device)
    grad_norm: torch.Tensor | float = 0.0
    if not skipped:
        step_loss, grad_norm = _backward(state, mbs, denom)
    opt, sched = state.optimization.get()
    lr = opt.param_groups[0]["lr"]
    counts = torch.tensor(
        [
            float(step_loss) / state.world,
            sum(mb.num_real_tokens for mb in mbs),
            sum(mb.num_tokens for mb in mbs),
            sum(len(mb.sequence_ids or ()) for mb in mbs),
            sum(getattr(mb, "num_media_items", 0) for mb in mbs),
            float(stop is not None and stop()),  # any rank asked to stop: every rank stops
        ],
        dtype=torch.float64,
        device=state.device,
    )
    if dpo:  # the supervised targets, and the shares of the mean rewards and reward accuracy
        stats = state.parallel.module.take_stats().to(state.device)  # type: ignore[operator]
        counts = torch.cat([counts, torch.tensor([float(labels)], dtype=torch.float64, device=state.device), stats])
    all_reduce(counts)
    # The summed loss (all ranks) and the norm of the synchronised gradients are
    # the same on every rank, so every rank takes the same decision.
    loss_sum, norm = float(counts[0]), float(grad_norm)
    if not skipped and not check_finite_step(state.config, step, loss_sum, norm, lr):
        skipped = "nonfinite"
    if skipped:
        opt.zero_grad(set_to_none=True)  # the parameters and AdamW's moments stay as they are
    else:
        opt.step()
    sched.step()  # a skipped step still counts: the schedule follows the step number
    state.stopping = bool(counts[5])
    dt = time.perf_counter() - t0
    real, slots = int(counts[1]), int(counts[2])
    record = StepLog(
        step=step,
        loss=loss_sum,
        real_tokens=real,
        slots=slots,
        label_tokens=int(counts[6]) if dpo else int(n),
        sequences=int(counts[3]),
        micro_batches=len(mbs),
        padding=1.0 - real / max(slots, 1),
        tokens_per_s=real / dt,
        step_time=dt,
        time=time.perf_counter() - t_start,
        lr=float(lr),
        grad_norm=norm,
        skipped=skipped,
        images=int(counts[4]) if getattr(state.parallel.module, "counts_images", False) else None,
    )
    if dpo:
        record.pairs = int(n)
        record.chosen_reward, record.rejected_reward, record.reward_accuracy = (float(x) for x in counts[7:10])
    return mbs, record


def _normalised(
    state: LoopState, mbs: list[MicroBatch], rule: WeightNormalisation | str
) -> tuple[list[MicroBatch], torch.Tensor]:
    """The step's rows with their weights as ``rule``'s coefficients, and its global denominator
    (one all-reduce); ``"group"`` reads the source's groups of the step's sequences."""
    rows = [mb for mb in mbs if isinstance(mb, PackedBatch)]
    if len(rows) < len(mbs):  # TrainConfig refuses it first: a padded batch has no sequence boundaries
        raise ValueError(f"weight_normalisation {rule}: the micro-batches must be packed rows (--packing trainer)")
    groups: dict[str, Any] = {}
    if rule is WeightNormalisation.GROUP:
        known = getattr(state.source, "step_groups", None)
        if known is None:
            raise ValueError(
                f"weight_normalisation group: {type(state.source).__name__} does not know its samples' groups; "
                "use the trainer path's source (make_source, --packing trainer)"
            )
        groups = {"sequence_groups": known[0], "num_groups": known[1]}
    out, n = normalise_weights(rows, rule, device=state.device, **groups)
    return list(out), n


def _backward(state: LoopState, mbs: list[MicroBatch], n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward and backward passes of the step's micro-batches: their summed loss and the
    norm of the synchronised gradients (clipped to ``config.clip_norm`` when it is set)."""
    step_loss = torch.zeros((), dtype=torch.float32, device=state.device)
    for i, mb in enumerate(mbs):
        # a float64 model's loss stays float64
        step_loss = step_loss + state.parallel.backward(mb, n, last=i == len(mbs) - 1)
    params = state.optimization.params
    if state.config.clip_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, state.config.clip_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    return step_loss, grad_norm
