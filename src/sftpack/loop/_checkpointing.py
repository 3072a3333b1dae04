"""The checkpoints of a run (``train(checkpoint_dir=..., resume=..., overwrite=...)``): resume
from the latest one, save every ``config.checkpoint_every`` steps and when the run is stopped
(a preempted job), one run per folder. The files and their checks: :mod:`~sftpack.loop._checkpoint`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

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
from ._finite import check_finite_params
from ._parts import LoopState, Part, StepLog

__all__ = ["Checkpoints"]

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


class Checkpoints(Part):
    """Resumes a run from ``directory`` (:meth:`resume`) and saves into it (the part, every
    rank, last after each step). ``directory=None``: a run that neither resumes nor saves.

    Made before anything slow: it refuses at once a fresh run in another run's folder
    (without ``overwrite``) and ``resume`` without a folder."""

    def __init__(
        self, directory: str | os.PathLike[str] | None, *, resume: bool | Literal["auto"], overwrite: bool
    ) -> None:
        if resume and directory is None:
            raise ValueError("resume needs a checkpoint directory (--checkpoint-dir)")
        if directory is not None and not resume and not overwrite:
            check_new_run(directory)
        self.directory = directory
        self.resuming = resume
        self.overwrite = overwrite
        self._replace = False  # another run's checkpoints go once this run has one
        # asked for only when a checkpoint is read or written: a source still receiving
        # its samples (sftpack train tokenizing in the background) then waits for them all
        self._fingerprint: str | None = None

    def resume(self, state: LoopState) -> int:
        """Load the latest checkpoint into the model, the optimizer and its schedule, the
        source and the RNGs (with ``resume``; ``"auto"``: if there is one); returns its step
        (0: none, a fresh run)."""
        self._replace = self.overwrite
        if not self.resuming or self.directory is None:
            return 0
        self._fingerprint = state.source.fingerprint()
        path = latest_checkpoint(self.directory)
        if path is None and self.resuming is True:
            found = sorted(p.name for p in Path(self.directory).glob("step_*") if p.is_dir())
            raise CheckpointError(
                f"{self.directory} holds no checkpoint to resume from (no 'latest' pointer"
                + (f"; folders {', '.join(found[-3:])} are there" if found else "")
                + "): check the --checkpoint-dir path, or use --resume-if-any (resume='auto') to start at step "
                "1 when there is none"
            )
        if path is None:
            return 0
        shared, mine = load_checkpoint(
            path,
            rank=state.rank,
            world=state.world,
            fingerprint=self._fingerprint,
            model=state.model,
            elastic=state.source.elastic,  # its position is global: any number of ranks
        )
        _check_resume_options(path, shared.get("config") or {}, state.config.as_dict())
        opt, sched = state.optimization.get()
        try:
            state.parallel.load_model(state.model, opt, shared)
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"{path / 'state.pt'} holds another model's weights ({' '.join(str(e).split())[:160]}): "
                "resume with the same --model or --dim/--layers/--heads/--kv-heads/--vocab"
            ) from None
        state.parallel.load_optimizer(opt, shared)
        sched.load_state_dict(shared["scheduler"])
        state.source.load_state_dict(mine["data"])
        set_rng_state(mine["rng"])
        self._replace = False
        return int(shared["step"])

    def on_step(self, state: LoopState, record: StepLog) -> None:
        every = state.config.checkpoint_every
        if self.directory is not None and (state.stopping or (every and record.step % every == 0)):
            state.checkpoint = self._save(state, record.step)

    def _save(self, state: LoopState, step: int) -> Path:
        assert self.directory is not None
        check_finite_params(state.model, step, state.parallel)  # never a checkpoint that cannot train on
        if self._fingerprint is None:
            self._fingerprint = state.source.fingerprint()
        opt, sched = state.optimization.get()
        full = state.parallel.full_states(state.model, opt)  # every rank takes part; rank 0 writes them
        to_save: dict[str, Any] | None = None
        if full is not None:
            to_save = {
                "step": step,
                "model": full[0],
                "optimizer": full[1],
                "scheduler": sched.state_dict(),
                "config": state.config.as_dict(),
                "fingerprint": self._fingerprint,
                "world": state.world,
                "dtype": model_dtype(state.model),
            }
        path = save_checkpoint(
            self.directory,
            step,
            shared=to_save,
            rank=state.rank,
            per_rank={"data": state.source.state_dict(), "rng": rng_state()},
        )
        if self._replace:
            if state.rank == 0:
                remove_other_checkpoints(self.directory, keep=path)
            self._replace = False
        return path
