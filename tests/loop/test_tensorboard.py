"""``--tensorboard DIR``: every step's loss, learning rate, grad norm, real tokens/s, fill and eval
loss as TensorBoard scalars, read back with TensorBoard's own reader and compared with the JSONL log
of the same run (which the option leaves as it was)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sftpack.cli import main
from sftpack.loop._tensorboard import SCALARS
from tests.helpers import train_args


def _args(chat, tmp_path, *extra):
    evals = ["--eval-fraction", "0.25", "--eval-every", "2"]
    return train_args(chat / "chat.jsonl", *evals, *extra, tokenizer=chat / "tok", steps=4, max_seq_len=256)


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_are_the_logs_numbers(chat, tmp_path, capsys):
    log, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    assert main(_args(chat, tmp_path, "--log", str(log), "--tensorboard", str(tb))) == 0
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    got = _scalars(tb)
    assert set(got) == {*SCALARS, "eval_loss"}
    for name, value in SCALARS.items():
        # TensorBoard stores a scalar as a float32: each is the log's number rounded to float32, exactly
        assert got[name] == [(r["step"], float(np.float32(value(r)))) for r in recs], name
    assert got["eval_loss"] == [(r["step"], float(np.float32(r["eval_loss"]))) for r in recs if "eval_loss" in r]
    assert [s for s, _ in got["eval_loss"]] == [2, 4]
    assert got["fill"] == [(r["step"], float(np.float32(1 - r["padding"]))) for r in recs]
    # negative control: the losses of the log one step later are not what was written
    assert [v for _, v in got["loss"][1:]] != [float(np.float32(r["loss"])) for r in recs[:-1]]


def test_the_log_is_the_same_with_and_without_tensorboard(chat, tmp_path, capsys):
    """The JSONL log's keys and its numbers that do not depend on the clock are unchanged."""
    with_tb, without = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(_args(chat, tmp_path, "--log", str(with_tb), "--tensorboard", str(tmp_path / "tb"))) == 0
    assert main(_args(chat, tmp_path, "--log", str(without))) == 0
    clock = {"tokens_per_s", "step_time", "time"}
    a = [json.loads(x) for x in with_tb.read_text().splitlines()]
    b = [json.loads(x) for x in without.read_text().splitlines()]
    assert [r.keys() for r in a] == [r.keys() for r in b]
    assert [{k: v for k, v in r.items() if k not in clock} for r in a] == [
        {k: v for k, v in r.items() if k not in clock} for r in b
    ]


def test_a_preference_runs_rewards_in_tensorboard_and_the_plot(tmp_path, capsys, monkeypatch):
    """``--objective dpo``: the step log's pairs, chosen / rejected rewards and reward accuracy are
    TensorBoard scalars (the log's numbers in float32) and two more panels of ``--plot`` (the
    log's numbers, drawn per step); an SFT run has neither (the test above: exactly SCALARS and
    eval_loss; tests/cli/test_newcomer.py: two panels)."""
    from matplotlib.figure import Figure

    from sftpack.loop._tensorboard import PREFERENCE_SCALARS
    from tests.loop.test_dpo_train import PAIRS

    drawn: list[dict[str, Any]] = []
    save = Figure.savefig

    def recording_savefig(fig, *a, **k):  # the real savefig; then what each panel drew
        out = save(fig, *a, **k)
        for ax in fig.axes:
            drawn.append({"title": ax.get_title(), "lines": {ln.get_label(): list(ln.get_ydata()) for ln in ax.lines}})
        return out

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS), encoding="utf-8")
    log, tb, png = tmp_path / "run.jsonl", tmp_path / "tb", tmp_path / "curves.png"
    argv = ["train", str(path), "--objective", "dpo", "--steps", "3", "--batch-size", "2", "--lr", "0.05"]
    argv += ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--no-cache", "--no-progress"]
    assert main([*argv, "--log", str(log), "--tensorboard", str(tb), "--plot", str(png)]) == 0
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    got = _scalars(tb)
    assert set(got) == {*SCALARS, *PREFERENCE_SCALARS}
    for name in PREFERENCE_SCALARS:
        assert got[name] == [(r["step"], float(np.float32(r[name]))) for r in recs], name
    # the reference is the starting weights: step 1's rewards are 0; later ones are not
    assert recs[0]["chosen_reward"] == recs[0]["rejected_reward"] == 0.0
    assert any(r["chosen_reward"] != r["rejected_reward"] for r in recs[1:])
    panels = {d["title"]: d["lines"] for d in drawn}
    assert list(panels) == ["loss", "throughput", "rewards", "reward accuracy"]
    assert panels["rewards"] == {
        "trainer chosen": [r["chosen_reward"] for r in recs],
        "trainer rejected": [r["rejected_reward"] for r in recs],
    }
    assert panels["reward accuracy"] == {"trainer": [r["reward_accuracy"] for r in recs]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
