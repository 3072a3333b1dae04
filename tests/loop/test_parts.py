"""The loop is made of parts: a caller's own part (``train(parts=[...])``) starts after the
resume, sees every step's record (the one the log writes, ``eval_loss`` included) before the
step's checkpoint, and ends once, also when the run stops on an error."""

from __future__ import annotations

import json

import pytest

from sftpack.loop import make_source, train
from sftpack.loop._eval import split_eval
from sftpack.loop._parts import LoopState, Part, StepLog
from tests.helpers import tiny_config, tiny_model


class Recorder(Part):
    """Every hook call, in order, with what the part saw."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.records: list[StepLog] = []
        self.fail_at = fail_at

    def on_start(self, state: LoopState) -> None:
        self.calls.append(("start", state.start))

    def on_step(self, state: LoopState, record: StepLog) -> None:
        if record.step == self.fail_at:
            raise RuntimeError(f"the part fails at step {record.step}")
        # the step's checkpoint comes after every other part: not written yet
        self.calls.append(("step", record.step if state.checkpoint is None else -1))
        self.records.append(record)

    def on_end(self, state: LoopState) -> None:
        self.calls.append(("end", len(state.logs)))


def test_a_part_of_ones_own_sees_every_step_record(samples, tmp_path, capsys):
    cfg = tiny_config(packing="trainer", steps=4, eval_every=2, eval_fraction=0.25)
    train_samples, held = split_eval(cfg, samples)
    part, log = Recorder(), tmp_path / "log.jsonl"
    out = train(
        cfg,
        source=make_source(cfg, samples=train_samples),
        model=tiny_model(),
        log=log,
        eval_samples=held,
        progress=True,
        parts=[part],
    )
    assert part.calls == [("start", 0), ("step", 1), ("step", 2), ("step", 3), ("step", 4), ("end", 4)]
    assert part.records == out.logs
    assert [r.eval_loss is not None for r in part.records] == [False, True, False, True]
    assert [json.loads(line) for line in log.read_text().splitlines()] == [r.as_dict() for r in part.records]
    bar = capsys.readouterr().err.rsplit("\r", 1)[-1]  # the progress bar part, as it ends
    assert "4/4" in bar and f"eval_loss={out.logs[3].eval_loss:.4f}, loss={out.logs[3].loss:.4f}" in bar


def test_a_part_starts_after_the_resume_and_ends_on_an_error(samples, tmp_path):
    cfg = tiny_config(packing="trainer", steps=6, checkpoint_every=2)
    ckpt = tmp_path / "ckpt"
    train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(), checkpoint_dir=ckpt, stop_after=3)
    part = Recorder(fail_at=5)
    with pytest.raises(RuntimeError, match="the part fails at step 5"):
        train(
            cfg,
            source=make_source(cfg, samples=samples),
            model=tiny_model(),
            checkpoint_dir=ckpt,
            resume=True,
            parts=[part],
        )
    # resumed from step 2; the step-4 checkpoint is written after the part saw step 4
    assert part.calls == [("start", 2), ("step", 3), ("step", 4), ("end", 3)]
    assert (ckpt / "latest").read_text().strip() == "step_000004"


def test_resume_without_a_folder_is_refused_before_any_part_starts(samples):
    cfg = tiny_config(packing="trainer", steps=2)
    part = Recorder()
    with pytest.raises(ValueError, match=r"resume needs a checkpoint directory \(--checkpoint-dir\)"):
        train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(), resume="auto", parts=[part])
    assert part.calls == []
