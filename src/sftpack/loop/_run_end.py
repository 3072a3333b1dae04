"""The ends of a :class:`~sftpack.loop._run.Run`: its eval set (:func:`eval_samples`), what it
says after the loop (:func:`report`) and the model folder it writes (:func:`save`). Each says
its lines through the run's ``say``; nothing here prints."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..chat import read_conversations
from ._options import ConfigError
from ._plot import plot_training, read_log
from ._run_parts import RunState

if TYPE_CHECKING:
    from ._loop import TrainResult

__all__ = ["eval_samples", "report", "save"]


def eval_samples(run: RunState, samples: Any, tokenize: Callable[[Any], list[Any]]) -> tuple[Any, Any]:
    """``(training samples, eval samples or None)``: ``eval_fraction`` of the conversations held
    out (:func:`~sftpack.loop._eval.split_eval`), or ``eval_file`` tokenized by ``tokenize(conversations)``."""
    from ._eval import split_eval  # start-up: loads torch; `import sftpack.loop._run` (RunConfig.build) must not
    from ._setup import supervised_targets  # start-up: loads torch

    cfg, inp = run.config.train, run.config.input
    if cfg.eval_fraction:
        try:
            samples, held = split_eval(cfg, samples)
        except ValueError as e:
            raise ConfigError(f"{{eval_fraction}}: {e}") from None
        what = f"{len({s.conversation_id for s in held}):,} conversations held out"
        never = ", never trained on"
    elif inp.eval_file is not None:
        try:
            held = tokenize(
                read_conversations(
                    [inp.eval_file], on_bad_row=inp.on_bad_row, allow_outside_images=inp.allow_outside_images
                )
            )
        except ValueError as e:
            raise ValueError(f"--eval-file {inp.eval_file}: {e}") from None
        what, never = f"{len({s.conversation_id for s in held}):,} conversations of {inp.eval_file}", ""
    else:
        return samples, None
    run.say(f"eval: {what} ({len(held):,} samples, {supervised_targets(held):,} supervised targets){never}")
    return samples, held


def save(run: RunState, result: TrainResult, note: str | None = None, **tokenizer: Any) -> str | None:
    """``save_model``: the trained model as a Hugging Face folder (rank 0); ``note``: a line said
    after it (what loading the folder needs). Returns the folder, or ``None`` when nothing was
    trained (or nothing asked)."""
    out = run.config.output
    if out.save_model is None or not result.logs:
        return None
    state = None
    if run.config.train.fsdp:  # the sharded weights gathered first: every rank takes part
        from ._fsdp import full_state  # start-up: loads torch

        state = full_state(result.model)
    if run.rank != 0:
        return out.save_model
    from ._export import save_model  # start-up: loads torch

    try:
        path = save_model(result.model, out.save_model, state=state, overwrite=out.overwrite_model, **tokenizer)
    except ValueError as e:  # the folder changed since the check before training
        raise ValueError(f"--save-model {e}; the trained model was not saved") from None
    run.say(f"wrote {path} (a Hugging Face model folder)")
    if note:
        run.say(note)
    return out.save_model


def report(run: RunState, result: TrainResult) -> None:
    """The lines after a run (resumed, skipped steps, the losses and speed; the log and the plot)."""
    cfg, out, say = run.config.train, run.config.output, run.say
    logs = result.logs
    if result.resumed_from:
        say(
            f"resumed from step {result.resumed_from}"
            + ("" if logs else f": nothing left to do ({result.steps} steps)")
        )
    elif run.config.resume == "auto" and out.checkpoint_dir:
        say(f"no checkpoint in {out.checkpoint_dir} yet: started at step 1")
    reasons = {
        "nonfinite": "a non-finite loss or gradient (--on-nonfinite skip)",
        "no_targets": "no supervised target in the batch",
    }
    for why, steps in sorted(result.skipped_steps.items()):
        shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
        say(f"skipped {len(steps):,} of {len(logs):,} step(s), {reasons.get(why, why)}: step {shown}")
    applied = [r for r in logs if not r.skipped]
    if run.rank == 0 and applied:
        real = sum(r.real_tokens for r in logs)
        slots = sum(r.slots for r in logs)
        secs = sum(r.step_time for r in logs)
        images = sum(r.images or 0 for r in logs)
        say(
            f"loss {applied[0].loss:.4f} (step {applied[0].step}) -> {applied[-1].loss:.4f} (step {applied[-1].step}); "
            f"{real / secs:,.0f} real tokens/s, {1 - real / max(slots, 1):.1%} padding"
            + (f", {images:,} images" if logs[0].images is not None else "")
            + f" over {len(logs)} steps"
            + (f" ({cfg.epochs} epoch{'s' if cfg.epochs > 1 else ''})" if cfg.epochs else "")
        )
        evals = [r for r in logs if r.eval_loss is not None]
        if evals:
            say(
                f"eval loss {evals[-1].eval_loss:.4f} (step {evals[-1].step})"
                + (f", first {evals[0].eval_loss:.4f} (step {evals[0].step})" if len(evals) > 1 else "")
            )
    if run.rank == 0 and logs:
        if out.log:
            say(f"wrote {out.log}")
        if out.plot:
            records = read_log(out.log) if out.log else [r.as_dict() for r in logs]
            say(f"wrote {plot_training({str(cfg.packing): records}, out.plot)}")
    if logs and not applied:
        raise ValueError(
            f"not one of the {len(logs):,} steps was applied (all skipped, see above): nothing was learned"
        )
