"""The choices and settings of a training run, validated up front."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .._base import StrEnum, choose, positive_int
from ..balance import SequenceCost, sequence_cost
from ..chat import DEFAULT_MAX_SEQ_LEN
from ..sample import WeightNormalisation

__all__ = ["Boundaries", "ConfigError", "NonFinite", "Objective", "Packing", "Schedule", "TrainConfig"]


class ConfigError(ValueError):
    """Settings that cannot work (together). ``template`` names each setting as ``{name}``
    (``settings``: those names, in order): ``str()`` spells it as the setting's name,
    :meth:`spelled` as anything else (``sftpack train``'s flag: ``--name``)."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.settings = tuple(dict.fromkeys(re.findall(r"\{([a-z_]+)\}", template)))
        super().__init__(self.spelled(lambda name: name))

    def spelled(self, spell: Callable[[str], str]) -> str:
        return re.sub(r"\{([a-z_]+)\}", lambda m: spell(m.group(1)), self.template)


class Packing(StrEnum):
    """When the rows are packed (or not at all)."""

    OFFLINE = "offline"  #: rows written once by ``sftpack prepack`` and re-read (``sftpack.offline``)
    LOADER = "loader"  #: rows packed while streaming, from a bounded buffer (``sftpack.loader``)
    TRAINER = "trainer"  #: a padded ``[B, S]`` batch packed at the step (``sftpack.trainer``)
    NONE = "none"  #: right-padded ``[B, S]`` batches: the unpacked baseline


class Objective(StrEnum):
    """What a step minimises."""

    SFT = "sft"  #: the token-mean cross-entropy of the global batch (conversations)
    #: sigmoid DPO over preference pairs (:func:`sftpack.objectives.dpo_loss`), the mean over the step's pairs;
    #: every packed path
    DPO = "dpo"
    #: SimPO, reference-free, over preference pairs (:func:`sftpack.objectives.simpo_loss`: each answer's mean
    #: token log-probability), the mean over the step's pairs; every packed path
    SIMPO = "simpo"

    @property
    def preference(self) -> bool:
        """A preference objective (DPO or SimPO): the data are pairs, a step's loss their mean."""
        return self in (Objective.DPO, Objective.SIMPO)


#: A preference objective's ``beta`` when none is given: DPO's inverse temperature, SimPO's reward scale.
DEFAULT_BETA = {Objective.DPO: 0.1, Objective.SIMPO: 2.0}
#: SimPO's target reward margin when none is given (:func:`sftpack.objectives.simpo_loss`'s default).
DEFAULT_GAMMA = 1.0


class Boundaries(StrEnum):
    """What the attention kernel is given for a packed row."""

    REAL = "real"  #: real and padded boundaries (``pad_between_seqs=True``): padding slots skipped
    PADDED = "padded"  #: the padded boundaries for both (``pad_between_seqs=False``): FlashAttention-2 friendly


class Schedule(StrEnum):
    """Learning-rate shape after the linear warm-up."""

    COSINE = "cosine"  #: cosine decay to ``min_lr_ratio * lr`` at the last step
    LINEAR = "linear"  #: linear decay to ``min_lr_ratio * lr`` at the last step
    CONSTANT = "constant"  #: ``lr`` throughout


class NonFinite(StrEnum):
    """What a step whose loss or gradient norm is NaN or infinite does."""

    ERROR = "error"  #: stop with :class:`~sftpack.loop.NonFiniteError` naming the step (nothing applied or saved)
    SKIP = "skip"  #: skip the optimizer step (parameters and optimizer state untouched), counted in the log


#: optimizer steps of a run given neither ``steps`` nor ``epochs`` (the library's default)
DEFAULT_STEPS = 20
#: ... and of ``sftpack train`` given neither ``--steps`` nor ``--epochs``
CLI_STEPS = 50

#: Each path's own boundary mode (``docs/contract.md``, section 1): offline and trainer hand the
#: kernel real + padded boundaries, the loader the padded array for both.
PATH_BOUNDARIES = {
    Packing.OFFLINE: Boundaries.REAL,
    Packing.TRAINER: Boundaries.REAL,
    Packing.LOADER: Boundaries.PADDED,
    Packing.NONE: Boundaries.PADDED,
}


@dataclass
class TrainConfig:
    """Everything that decides a run (the data itself is passed beside it).

    Attributes:
        packing: :class:`Packing`.
        steps: optimizer steps (default :data:`DEFAULT_STEPS` unless ``epochs`` is given).
        epochs: instead of ``steps``: this many passes over the data, each as many
            optimizer steps as the source's epoch holds (``Source.epoch_steps``;
            :meth:`with_epoch_steps`, called by the loop, fixes ``steps``).
        batch_size: per optimizer step, over all ranks: *conversations* for
            ``trainer`` and ``none`` (the same conversations for both, given the
            seed), *rows* of ``max_seq_len`` slots for ``offline`` and ``loader``.
        max_seq_len: the row width, sftpack's one name for it: the slots of one packed
            row (offline, loader) or micro-batch (trainer, unless ``micro_batch_tokens``);
            conversations are split to at most this long.
        grad_accum: micro-batches per rank per step, at least (gradient accumulation).
            The trainer path may use more: its micro-batches are token-budget bins.
        micro_batch_tokens: the trainer path only: the row width of one packed
            micro-batch when it should be wider than ``max_seq_len`` (default: ``max_seq_len``),
            while conversations are still split at ``max_seq_len``: a distinct setting
            (docs/contract.md, "One name for the row width"). Wider micro-batches mean
            fewer forward passes (less per-call overhead, more activation memory). A preference
            objective's micro-batch holds a whole pair, two sequences of up to ``max_seq_len``
            tokens: its default is ``2 * max_seq_len``, and a smaller one is refused
            (:attr:`micro_batch_width`).
        cost: several ranks: what a conversation (trainer path) or a row (loader and offline
            paths) costs when each step's work is dealt to the ranks
            (:func:`sftpack.balance.sequence_cost`'s spellings: ``"tokens"``; ``"attention"``; a
            size such as ``"7b"``; a model folder or its ``config.json``; a
            :class:`~sftpack.balance.SequenceCost`). ``None`` (the default): the run's model's own
            (``make_source(model_cost=)``: ``sftpack train`` and :class:`RunConfig` pass the cost
            of the model they train, its linear work per token and its attention per token
            squared); without one, ``"tokens"`` on the trainer and loader paths and
            ``"attention"`` on the offline path (a prepack's rows are all nearly full: tokens
            cannot tell them apart). It decides only which rank and micro-batch each
            conversation or row lands in, never what a step trains on (so checkpoints do not
            depend on it); on one rank it changes nothing but the micro-batches' order.
        max_patches_per_row: data with images: the vision patches one packed row or
            micro-batch may hold (the bin packer's second budget, on the trainer and
            loader paths; ``None``: tokens alone decide).
        lr, weight_decay, betas, eps: AdamW.
        warmup_steps, schedule, min_lr_ratio: the learning-rate schedule.
        clip_norm: gradient-norm clipping (``None``: off).
        weight_normalisation: :class:`~sftpack.sample.WeightNormalisation`: how a step's
            (weighted) losses are averaged, :func:`sftpack.loss.normalise_weights`'s one rule:
            ``"token"`` (the default), ``"sequence"`` (the SFT objective on a packed path: whole
            sequences) or ``"group"`` (SFT on the trainer and loader paths: they know their samples'
            groups, each kept whole in one micro-batch or row).
        pad_multiple: pad every sequence to a multiple of this (``2 * CP``).
        boundaries: :class:`Boundaries`; ``None``: the path's own default.
        buffer_size: the loader's packing buffer (sequences).
        seed: model init, data order, everything.
        dim, layers, heads, kv_heads: the default model's shape (ignored with a model folder).
        checkpoint_every: save every this many steps (``None``/0: never).
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when present).
        on_nonfinite: :class:`NonFinite`: stop (default) or skip a step whose loss
            or gradient norm is not finite.
        eval_fraction: the share of the conversations held out for evaluation
            (:func:`~sftpack.loop._eval.split_eval`; 0: none held out).
        eval_every: evaluate the held-out set every this many steps (and after the last).
        fsdp: shard the model over the ranks (:mod:`~sftpack.loop._fsdp`: FSDP2) instead of DDP.
        allow_inexact_packing: train packed even when packing is not exact on the model (its
            layers carry state across sequence boundaries: :func:`sftpack.exactness.require_exact_packing`
            refuses it otherwise), with a one-line warning.
        objective: :class:`Objective`: ``"sft"`` (the default), or a preference objective
            (:attr:`preference`): ``"dpo"`` or ``"simpo"``, on preference pairs
            (:func:`sftpack.chat.tokenize_pair`'s samples), on every packed path, each pair kept
            whole in one row or micro-batch of one rank (:attr:`row_width`: two sequences of
            ``max_seq_len``); ``batch_size`` counts *pairs* on the trainer path and rows on the
            offline and loader paths, and a step's loss is the mean of :func:`sftpack.objectives.dpo_loss` (or
            :func:`~sftpack.objectives.simpo_loss`) over its pairs.
        beta: the preference objective's beta (> 0): DPO's inverse temperature, SimPO's reward
            scale (0, the default: the objective's own, :data:`DEFAULT_BETA`: 0.1 for DPO and 2.0
            for SimPO; set to it by the constructor).
        gamma: SimPO's target reward margin (>= 0; default :data:`DEFAULT_GAMMA`); SimPO only (DPO
            refuses another value).
        reference_model: DPO's frozen reference model, a local model folder (``None``: a
            frozen copy of the starting weights of the model trained); SimPO has none.

    A field with ``"help"`` in its metadata is a flag of ``sftpack train``, declared
    there once (:func:`sftpack.cli._common.add_settings` reads it: the help, and
    ``"cli_default"`` where the command's default differs, ``"min"``, ``"metavar"``).
    """

    packing: Packing | str = field(
        default=Packing.TRAINER,
        metadata={"help": "when rows are packed; none = padded batches, the baseline (default {default})"},
    )
    steps: int | None = field(
        default=None,
        metadata={
            "help": f"optimizer steps (default {CLI_STEPS}; not with --epochs)",
            "cli_default": None,
            "min": 1,
        },
    )
    epochs: int | None = field(
        default=None,
        metadata={
            "help": "train for N passes over the data instead of --steps: N x the optimizer steps of one epoch "
            "(trainer/none: conversations // --batch-size; offline, loader: this rank's rows of the first epoch "
            "// rows per step), fixed before the first step",
            "min": 1,
            "metavar": "N",
        },
    )
    batch_size: int = field(
        default=8,
        metadata={
            "help": "per step, over all ranks: conversations (trainer, none) or rows (offline, loader); "
            "default {default}",
            "min": 1,
        },
    )
    max_seq_len: int = field(
        default=DEFAULT_MAX_SEQ_LEN,
        metadata={
            "help": "the row width: slots per packed row (offline, loader) or micro-batch (trainer); longer "
            "conversations are split (default {default}; with --prepacked: the prepack's)",
            "cli_default": None,
            "min": 1,
        },
    )
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per rank per step, at least", "min": 1})
    micro_batch_tokens: int | None = None
    cost: str | SequenceCost | None = field(
        default=None,
        metadata={
            "help": "several ranks: what a conversation (trainer path) or a row (loader, offline) costs when each "
            "step's work is dealt to the ranks: tokens, attention (tokens squared), a model size (1b, 3b, 7b, 8b, "
            "13b, 70b) or a model folder (its config.json: linear work per token plus attention per token "
            "squared); default: the trained model's own; what a step trains on never changes",
            "metavar": "tokens|attention|SIZE|DIR",
        },
    )
    max_patches_per_row: int | None = field(
        default=None,
        metadata={
            "help": "data with images: at most P vision patches per packed row (loader, offline) or micro-batch "
            "(trainer), the bin packer's second budget (default: tokens alone)",
            "min": 1,
            "metavar": "P",
        },
    )
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (default {default})"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW's weight decay (default {default})"})
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps (default {default})", "min": 0})
    schedule: Schedule | str = field(
        default=Schedule.COSINE, metadata={"help": "the learning rate after the warm-up (default {default})"}
    )
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final LR as a fraction of --lr (default {default})"})
    clip_norm: float | None = field(
        default=1.0, metadata={"help": "gradient-norm clipping; 0 = off (default {default})"}
    )
    weight_normalisation: WeightNormalisation | str = field(
        default=WeightNormalisation.TOKEN,
        metadata={
            "help": "how a step's losses (times their weight or advantage column) are averaged: token (sum w*loss "
            "/ sum |w| over the step's targets), sequence (each sequence's weighted mean, then their mean) or "
            "group (each group's mean over its sequences, then their mean; --packing trainer or loader) (default {default})"
        },
    )
    pad_multiple: int = field(
        default=1,
        metadata={
            "help": "pad each sequence to a multiple (2*CP; default {default}; with --prepacked: the prepack's)",
            "cli_default": None,
            "min": 1,
        },
    )
    boundaries: Boundaries | str | None = field(
        default=None,
        metadata={"help": "kernel boundaries: real+padded or padded for both (default: the path's own)"},
    )
    buffer_size: int = field(default=256, metadata={"help": "loader packing buffer (sequences)", "min": 1})
    seed: int = field(default=0, metadata={"help": "model init, data order, everything (default {default})"})
    dim: int = field(default=64, metadata={"help": "the default model's hidden size", "min": 1})
    layers: int = field(default=2, metadata={"help": "the default model's layers", "min": 1})
    heads: int = field(default=4, metadata={"help": "the default model's attention heads", "min": 1})
    kv_heads: int = field(default=2, metadata={"help": "the default model's key/value heads", "min": 1})
    checkpoint_every: int | None = field(
        default=None, metadata={"help": "save every K steps (0: never)", "cli_default": 0, "min": 0}
    )
    device: str | None = field(default=None, metadata={"help": "cpu or cuda (default: cuda when present)"})
    on_nonfinite: NonFinite | str = field(
        default=NonFinite.ERROR,
        metadata={
            "help": "a step whose loss or gradient norm is NaN/inf: stop with an error naming the step (default), or "
            "skip its update (counted in the log and the summary)"
        },
    )
    eval_fraction: float = field(
        default=0.0,
        metadata={
            "help": "hold out this fraction of the conversations (0 <= F < 1, chosen by --seed, never trained on) and "
            "log their eval_loss: the same token mean as the training loss, over the whole held-out set (default "
            "{default}: none)",
            "metavar": "F",
        },
    )
    eval_every: int | None = field(
        default=None,
        metadata={
            "help": "with --eval-fraction or --eval-file: evaluate every K steps (default: after the last step only; "
            "the last step is always evaluated)",
            "min": 1,
            "metavar": "K",
        },
    )
    fsdp: bool = field(
        default=False,
        metadata={
            "help": "shard the model, its gradients and the optimizer state over the ranks (FSDP2, under torchrun; "
            "one process works too); checkpoints stay whole and resume with or without it; text models only"
        },
    )
    allow_inexact_packing: bool = field(
        default=False,
        metadata={
            "help": "train packed even when packing is not exact on the model (a layer that carries state across "
            "sequence boundaries, e.g. a Mamba2 mixer or a short conv: the run's first check refuses it otherwise); "
            "a warning says so"
        },
    )
    objective: Objective | str = field(
        default=Objective.SFT,
        metadata={
            "help": "what a step minimises: sft, or dpo or simpo (reference-free) on preference pairs "
            "(prompt/chosen/rejected; every packed path; --batch-size counts pairs on the trainer path, rows on the "
            "offline and loader paths; rows are 2 x --max-seq-len, a pair whole) (default {default})"
        },
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": f"--objective dpo: the inverse temperature (default {DEFAULT_BETA[Objective.DPO]}); simpo: the "
            f"reward scale (default {DEFAULT_BETA[Objective.SIMPO]})"
        },
    )
    gamma: float = field(
        default=DEFAULT_GAMMA,
        metadata={"help": "--objective simpo: the target reward margin (default {default})"},
    )
    reference_model: str | None = field(
        default=None,
        metadata={
            "help": "--objective dpo: the frozen reference model, a local model folder (default: the starting "
            "weights of the model trained); simpo has none",
            "metavar": "DIR",
        },
    )
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.packing = choose(Packing, self.packing, "packing")
        self.objective = choose(Objective, self.objective, "objective")
        if isinstance(self.reference_model, os.PathLike):
            self.reference_model = str(self.reference_model)
        if self.preference:
            self._check_dpo()
        self.schedule = choose(Schedule, self.schedule, "schedule")
        self.on_nonfinite = choose(NonFinite, self.on_nonfinite, "on_nonfinite")
        self.weight_normalisation = choose(WeightNormalisation, self.weight_normalisation, "weight_normalisation")
        rule = self.weight_normalisation
        if rule is not WeightNormalisation.TOKEN and (
            self.objective is not Objective.SFT
            or self.packing is Packing.NONE
            or (rule is WeightNormalisation.GROUP and self.packing not in (Packing.TRAINER, Packing.LOADER))
        ):
            raise ConfigError(
                f"{{weight_normalisation}} {rule} averages whole packed sequences"
                + (" and needs their samples' groups" if rule is WeightNormalisation.GROUP else "")
                + f": not {{packing}} {self.packing} with {{objective}} {self.objective}; use "
                + ("{packing} trainer or loader" if rule is WeightNormalisation.GROUP else "a packed path")
                + " with {objective} sft, or {weight_normalisation} token"
            )
        self.boundaries = (
            PATH_BOUNDARIES[self.packing]
            if self.boundaries is None
            else choose(Boundaries, self.boundaries, "boundaries")
        )
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                f"TrainConfig: steps={self.steps} and epochs={self.epochs} both given: give one (--steps or --epochs)"
            )
        if self.steps is None and self.epochs is None:
            self.steps = DEFAULT_STEPS
        if self.steps is not None:
            self.steps = positive_int("steps", self.steps, who="TrainConfig")
        if self.epochs is not None:
            self.epochs = positive_int("epochs", self.epochs, who="TrainConfig")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(
                f"TrainConfig: eval_fraction must be at least 0 and below 1 (the share of conversations held out; 0: none), "
                f"got {self.eval_fraction!r}"
            )
        if self.eval_every is not None:
            self.eval_every = positive_int("eval_every", self.eval_every, who="TrainConfig")
        for name in (
            "batch_size",
            "max_seq_len",
            "grad_accum",
            "pad_multiple",
            "buffer_size",
        ):
            setattr(self, name, positive_int(name, getattr(self, name), who="TrainConfig"))
        if self.micro_batch_tokens is not None:
            self.micro_batch_tokens = positive_int("micro_batch_tokens", self.micro_batch_tokens, who="TrainConfig")
            if self.micro_batch_tokens < self.max_seq_len:
                raise ValueError(
                    f"TrainConfig: micro_batch_tokens={self.micro_batch_tokens} is below max_seq_len="
                    f"{self.max_seq_len}: a conversation of max_seq_len tokens must fit one micro-batch"
                )
            if self.preference and self.micro_batch_tokens < 2 * self.max_seq_len:
                raise ConfigError(
                    f"{{micro_batch_tokens}} {self.micro_batch_tokens} cannot hold a preference pair, two sequences of "
                    f"up to {{max_seq_len}} {self.max_seq_len} tokens that are never split over micro-batches: give at "
                    f"least {2 * self.max_seq_len}, or leave it out (the default: 2 x max_seq_len)"
                )
        if isinstance(self.cost, os.PathLike):
            self.cost = str(self.cost)
        try:
            if self.cost is not None:
                sequence_cost(self.cost)  # a spelling that names no cost model is refused here, before any work
        except ValueError as e:
            raise ValueError(f"TrainConfig: {e}") from None
        if self.max_patches_per_row is not None:
            self.max_patches_per_row = positive_int("max_patches_per_row", self.max_patches_per_row, who="TrainConfig")
        for name in ("dim", "layers", "heads", "kv_heads"):
            setattr(self, name, positive_int(name, getattr(self, name), who="TrainConfig"))
        if self.max_seq_len % self.pad_multiple:
            raise ValueError(
                f"TrainConfig: max_seq_len={self.max_seq_len} is not a multiple of pad_multiple={self.pad_multiple}; "
                f"use max_seq_len={self.max_seq_len // self.pad_multiple * self.pad_multiple}"
            )
        if self.warmup_steps < 0 or not isinstance(self.warmup_steps, int):
            raise ValueError(f"TrainConfig: warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"TrainConfig: lr must be a positive number, got {self.lr!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"TrainConfig: clip_norm must be > 0 or None, got {self.clip_norm!r}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise ValueError(f"TrainConfig: checkpoint_every must be >= 0, got {self.checkpoint_every!r}")
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"TrainConfig: dim={self.dim} must be a multiple of heads={self.heads}, and heads a multiple of "
                f"kv_heads={self.kv_heads}"
            )

    def _check_dpo(self) -> None:
        """A preference objective (DPO, SimPO) runs on every packed path (trainer, offline, loader), one process's model
        whole, without a held-out set; its ``beta`` and ``gamma`` are resolved and checked here."""
        objective = Objective(self.objective)
        if self.beta == 0:  # the default: the objective's own
            self.beta = DEFAULT_BETA[objective]
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"TrainConfig: beta must be a positive number, got {self.beta!r}")
        if objective is Objective.SIMPO:
            if self.reference_model is not None:
                raise ConfigError(
                    "{objective} simpo is reference-free: leave {reference_model} out (or use {objective} dpo)"
                )
            if not (self.gamma >= 0 and math.isfinite(self.gamma)):
                raise ValueError(f"TrainConfig: gamma (SimPO's margin) must be a number >= 0, got {self.gamma!r}")
        elif self.gamma != DEFAULT_GAMMA:
            raise ConfigError("{gamma} is SimPO's margin: leave it out with {objective} dpo (or use {objective} simpo)")
        if self.packing is Packing.NONE:
            raise ConfigError(
                f"{{objective}} {objective} runs on the packed paths only, not {{packing}} {self.packing}: use "
                "{packing} trainer, offline or loader (each keeps every pair whole)"
            )
        for name, on in (("fsdp", self.fsdp), ("eval_fraction", self.eval_fraction), ("eval_every", self.eval_every)):
            if on:
                raise ConfigError(f"{{objective}} {objective} does not take {{{name}}} yet: leave it out")

    @property
    def preference(self) -> bool:
        """A preference objective (DPO or SimPO): the data are pairs (``batch_size`` counts them on the
        trainer path, rows on the others), and a step's loss is the mean over its pairs."""
        return Objective(self.objective).preference

    @property
    def row_width(self) -> int:
        """The slots of a packed row on every path (the loader's rows, a temporary prepack's, the
        trainer path's default micro-batch): ``max_seq_len``, or for a preference objective
        ``2 * max_seq_len``: ``max_seq_len`` bounds each sequence (as TRL's ``max_length`` does), so a
        pair (each member at most ``max_seq_len`` tokens once ``overlong`` has cut or dropped it, a
        multiple of ``pad_multiple`` padded) always fits one row whole."""
        return 2 * self.max_seq_len if self.preference else self.max_seq_len

    @property
    def micro_batch_width(self) -> int:
        """The trainer path's micro-batch width: ``micro_batch_tokens``, else :attr:`row_width`."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return self.row_width

    @property
    def pad_between_seqs(self) -> bool:
        return self.boundaries is Boundaries.REAL

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("packing", "schedule", "boundaries", "on_nonfinite", "objective"):
            d[k] = str(d[k])
        if self.weight_normalisation is WeightNormalisation.TOKEN:  # the default: the saved config stays what it was
            del d["weight_normalisation"]
        else:
            d["weight_normalisation"] = str(d["weight_normalisation"])
        if self.objective is Objective.SFT:  # an SFT run's saved config stays what it was
            del d["objective"], d["beta"]
        if self.objective is not Objective.SIMPO:  # SimPO's alone: a DPO run's saved config stays what it was
            del d["gamma"]
        if d["reference_model"] is None:
            del d["reference_model"]
        d["betas"] = list(d["betas"])
        if d["cost"] is None:  # the default: a run's saved config stays what it was
            del d["cost"]
        for name in ("max_patches_per_row", "epochs", "eval_fraction", "eval_every", "fsdp", "allow_inexact_packing"):
            if not d[name]:  # a run without them: its saved config stays what it was
                del d[name]
        return d

    def with_epoch_steps(self, per_epoch: int) -> TrainConfig:
        """This config with ``steps`` fixed: ``epochs`` epochs of ``per_epoch`` optimizer steps
        (itself when ``steps`` is given). The training loop calls it once its source says how
        many steps an epoch holds."""
        if self.epochs is None:
            return self
        if per_epoch < 1:
            raise ValueError(
                f"an epoch of this data holds no full optimizer step ({per_epoch}): lower --batch-size, or give --steps"
            )
        return dataclasses.replace(self, steps=self.epochs * per_epoch, epochs=None)

    @property
    def total_steps(self) -> int:
        """``steps`` (set by :meth:`with_epoch_steps` for a run given in ``epochs``)."""
        if self.steps is None:
            raise ValueError(
                f"TrainConfig: epochs={self.epochs}: the steps are known once the data is (with_epoch_steps)"
            )
        return self.steps

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` for optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule is Schedule.CONSTANT:
            return 1.0
        span = max(self.total_steps - self.warmup_steps - 1, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        lo = self.min_lr_ratio
        if self.schedule is Schedule.LINEAR:
            return 1.0 - (1.0 - lo) * progress
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))
