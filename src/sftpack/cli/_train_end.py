"""The end of ``sftpack train``: what a run says (:func:`report`, :func:`stopped_line`), the
model folder it writes (:func:`save`, ``--save-model``), and its eval set (:func:`eval_samples_of`,
``--eval-fraction`` / ``--eval-file``); kept apart from :mod:`._train` so that both stay readable."""

from __future__ import annotations

import argparse
from typing import Any, Literal

from ._common import UsageError

__all__ = ["eval_samples_of", "report", "save", "stopped_line"]


def stopped_line(result: Any, model: Any = None) -> str:
    """What a run that SIGTERM stopped says (its loop ended after the step it was in); ``model``:
    the ``--save-model`` folder written at the stop."""
    steps = result.logs[-1].step if result.logs else result.resumed_from
    line = f"stopped by SIGTERM after step {steps}"
    saved = f"the model of step {steps} saved in {model}"
    if not result.stopped:  # it came in the last step, after the loop had asked
        return f"{line}, the last one" + (f"; {saved}" if model is not None else "")
    if result.checkpoint is not None:  # written at the end of that step
        return f"{line}; checkpoint saved in {result.checkpoint}; rerun with --resume to continue"
    if model is not None:
        return f"{line}; {saved} (no --checkpoint-dir: the run cannot be resumed)"
    return (
        f"{line}; nothing saved (give --checkpoint-dir to resume after a stop, or --save-model DIR to keep the model)"
    )


def eval_samples_of(args: argparse.Namespace, cfg: Any, samples: list[Any], tokenize: Any, say: Any) -> tuple[Any, Any]:
    """``(training samples, eval samples or None)``: ``--eval-fraction`` of the conversations held
    out (:func:`~sftpack.loop._eval.split_eval`), or ``--eval-file`` tokenized by ``tokenize(conversations)``."""
    from ..loop._eval import split_eval
    from ..loop._setup import supervised_targets

    if cfg.eval_fraction:
        try:
            samples, held = split_eval(cfg, samples)
        except ValueError as e:
            raise UsageError(f"--eval-fraction: {e}") from None
        what = f"{len({s.conversation_id for s in held}):,} conversations held out"
        never = ", never trained on"
    elif args.eval_file is not None:
        from ..chat import read_conversations

        try:
            held = tokenize(
                read_conversations(
                    [args.eval_file], on_bad_row=args.on_bad_row, allow_outside_images=args.allow_outside_images
                )
            )
        except ValueError as e:
            raise ValueError(f"--eval-file {args.eval_file}: {e}") from None
        what, never = f"{len({s.conversation_id for s in held}):,} conversations of {args.eval_file}", ""
    else:
        return samples, None
    say(f"eval: {what} ({len(held):,} samples, {supervised_targets(held):,} supervised targets){never}")
    return samples, held


def save(args: argparse.Namespace, result: Any, rank: int, say: Any, note: str | None = None, **tokenizer: Any) -> None:
    """``--save-model DIR``: the trained model as a Hugging Face folder (rank 0); ``note``: a line
    said after it (what loading the folder needs)."""
    if args.save_model is None or not result.logs:
        return
    state = None
    if getattr(args, "fsdp", False):  # the sharded weights gathered first: every rank takes part
        from ..loop._fsdp import full_state

        state = full_state(result.model)
    if rank != 0:
        return
    from ..loop._export import save_model

    try:
        out = save_model(result.model, args.save_model, state=state, overwrite=args.overwrite_model, **tokenizer)
    except ValueError as e:  # the folder changed since the check before training
        raise ValueError(f"--save-model {e}; the trained model was not saved") from None
    say(f"wrote {out} (a Hugging Face model folder)")
    if note:
        say(note)


def report(
    args: argparse.Namespace, cfg: Any, result: Any, resume: bool | Literal["auto"], rank: int, say: Any
) -> None:
    """The lines after a run (resumed, skipped steps, the losses and speed; the log and the plot)."""
    from ..loop import plot_training
    from ..loop._plot import read_log

    logs = result.logs
    if result.resumed_from:
        say(
            f"resumed from step {result.resumed_from}"
            + ("" if logs else f": nothing left to do ({result.steps} steps)")
        )
    elif resume == "auto" and args.checkpoint_dir:
        say(f"no checkpoint in {args.checkpoint_dir} yet: started at step 1")
    skipped = result.skipped_steps
    reasons = {
        "nonfinite": "a non-finite loss or gradient (--on-nonfinite skip)",
        "no_targets": "no supervised target in the batch",
    }
    for why, steps in sorted(skipped.items()):
        shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
        say(f"skipped {len(steps):,} of {len(logs):,} step(s), {reasons.get(why, why)}: step {shown}")
    applied = [r for r in logs if not r.skipped]
    if rank == 0 and applied:
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
    if rank == 0 and logs:
        if args.log:
            say(f"wrote {args.log}")
        if args.plot:
            records = read_log(args.log) if args.log else [r.as_dict() for r in logs]
            say(f"wrote {plot_training({str(cfg.packing): records}, args.plot)}")
    if logs and not applied:
        raise ValueError(
            f"not one of the {len(logs):,} steps was applied (all skipped, see above): nothing was learned"
        )
