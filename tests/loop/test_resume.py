"""Checkpoint and resume: a run stopped after step 7 and resumed from its step-6
checkpoint continues with exactly the uninterrupted run's losses, step for step,
for each path's data state (sample order, loader state_dict, offline position);
a checkpoint of other data is refused; a half-written checkpoint is never used."""

from __future__ import annotations

import json

import pytest

from sftpack.loop import CheckpointError, make_source, train
from sftpack.loop._checkpoint import latest_checkpoint
from sftpack.offline import prepack_samples
from tests.helpers import max_param_diff, tiny_config, tiny_model, tiny_samples


def _source(cfg, samples, prepacked):
    return make_source(cfg, samples=samples, prepacked=prepacked)


@pytest.fixture(scope="module")
def prepacked(samples, tmp_path_factory):
    return prepack_samples(samples, tmp_path_factory.mktemp("prepack") / "rows", max_seq_len=128).path


@pytest.mark.parametrize("packing", ["trainer", "loader", "offline"])
def test_resume_continues_the_same_run(samples, prepacked, packing, tmp_path):
    batch = 4 if packing == "trainer" else 2
    cfg = tiny_config(packing=packing, steps=12, batch_size=batch, checkpoint_every=3, buffer_size=16)
    full = train(cfg, source=_source(cfg, samples, prepacked), model=tiny_model())

    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    first = train(
        cfg,
        source=_source(cfg, samples, prepacked),
        model=tiny_model(),
        checkpoint_dir=ckpt,
        log=log,
        stop_after=7,
    )  # killed after step 7: the latest checkpoint is step 6
    assert latest_checkpoint(ckpt).name == "step_000006"
    (ckpt / "step_000009.tmp").mkdir()  # a checkpoint that died while being written is ignored
    second = train(
        cfg,
        source=_source(cfg, samples, prepacked),
        model=tiny_model(seed=1),
        checkpoint_dir=ckpt,
        log=log,
        resume=True,
    )
    assert second.resumed_from == 6
    assert [r.step for r in second.logs] == list(range(7, 13))
    assert second.losses == full.losses[6:]  # bit for bit: same data, same RNG, same arithmetic
    assert second.conversations == full.conversations[6:]
    assert max_param_diff(second.model, full.model) == 0.0
    assert first.losses == full.losses[:7]
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(1, 13))  # the log of the resumed run continues the first one's


def test_checkpoint_of_other_data_is_refused(samples, tmp_path):
    cfg = tiny_config(packing="trainer", steps=4, checkpoint_every=2)
    train(
        cfg,
        source=make_source(cfg, samples=samples),
        model=tiny_model(),
        checkpoint_dir=tmp_path,
    )
    other = tiny_samples(seed=11)
    with pytest.raises(CheckpointError, match="other data or data options"):
        train(
            cfg,
            source=make_source(cfg, samples=other),
            model=tiny_model(),
            checkpoint_dir=tmp_path,
            resume=True,
        )
    bigger = tiny_config(packing="trainer", steps=4, checkpoint_every=2, batch_size=8)
    with pytest.raises(CheckpointError, match="--batch-size"):
        train(
            bigger,
            source=make_source(bigger, samples=samples),
            model=tiny_model(),
            checkpoint_dir=tmp_path,
            resume=True,
        )
