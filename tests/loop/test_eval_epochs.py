"""Evaluation and epochs: ``TrainConfig.eval_fraction`` / ``eval_every`` / ``epochs``
(``sftpack train --eval-fraction F --eval-file PATH --eval-every K --epochs N``).

The held-out conversations never train; the eval loss is the global token mean over the whole
held-out set (the training loss's normalisation), equal in float64 to each held-out conversation
run alone; an epoch is as many steps as the source's own epoch holds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sftpack.cli import main
from sftpack.loop import TrainConfig, make_source, train
from sftpack.loop._eval import EvalSet, split_eval
from sftpack.offline import prepack_samples
from sftpack.sample import Sample
from tests.helpers import tiny_config, tiny_model, train_args
from tests.loop.test_equality import LOSS_TOL_64


def _alone(model, samples) -> tuple[float, float]:
    """``(global token mean, mean of per-conversation means)`` of ``model`` over ``samples``, each
    conversation run alone, unpacked and unpadded (the reference)."""
    total, count, means = 0.0, 0, []
    model.eval()
    with torch.no_grad():
        for s in samples:
            ids = torch.as_tensor(s.input_ids)[None]
            keep = torch.as_tensor(s.loss_mask[1:])  # the target of slot t is token t+1
            logits = model(ids).logits[0, :-1][keep]
            losses = F.cross_entropy(logits.double(), ids[0, 1:][keep], reduction="none")
            total, count = total + float(losses.sum()), count + int(keep.sum())
            if keep.any():
                means.append(float(losses.mean()))
    model.train()
    return total / count, float(np.mean(means))


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_eval_loss_is_the_global_token_mean_of_the_held_out_set(samples, boundaries):
    cfg = tiny_config(steps=4, eval_fraction=0.25, eval_every=2, boundaries=boundaries)
    train_part, held = split_eval(cfg, samples)
    model = tiny_model(dtype=torch.float64)
    checked = []

    def check(rec):  # called after the step's evaluation, with the model of that moment
        if rec.eval_loss is not None:
            ref, mean_of_means = _alone(model, held)
            # float64: the eval loss is one forward pass's loss over the held-out set, grouped into
            # packed micro-batches instead of one conversation at a time; tests/loop/test_equality.py
            # derives the bound of a step's loss under regrouping (LOSS_TOL_64, 1e-10).
            assert abs(rec.eval_loss - ref) <= LOSS_TOL_64, (rec.eval_loss, ref)
            # negative control: the other normalisation (a mean of per-conversation means) fails it
            assert abs(rec.eval_loss - mean_of_means) > 1e3 * LOSS_TOL_64
            checked.append(rec.step)

    out = train(cfg, source=make_source(cfg, samples=train_part), model=model, eval_samples=held, on_step=check)
    assert checked == [2, 4]
    assert [r.step for r in out.logs if r.eval_loss is not None] == [2, 4]
    assert "eval_loss" not in out.logs[0].as_dict() and "eval_loss" in out.logs[1].as_dict()


def test_split_is_by_conversation_and_seeded(samples):
    # a conversation split into two pieces (one conversation id) goes to one side, whole
    pieces = [Sample(s.input_ids, s.loss_mask, f"c{i // 2}") for i, s in enumerate(samples)]
    cfg = TrainConfig(eval_fraction=0.25, seed=5)
    train_part, held = split_eval(cfg, pieces)
    held_ids = {s.conversation_id for s in held}
    assert len(held_ids) == round(0.25 * 36) and len(held) == 2 * len(held_ids)
    assert not held_ids & {s.conversation_id for s in train_part}
    assert len(train_part) + len(held) == len(pieces)
    again = split_eval(TrainConfig(eval_fraction=0.25, seed=5), pieces)[1]
    other = split_eval(TrainConfig(eval_fraction=0.25, seed=6), pieces)[1]
    assert [s.conversation_id for s in again] == [s.conversation_id for s in held]
    assert {s.conversation_id for s in other} != held_ids


def _trained_ids(out) -> set:
    return {c for step in out.conversations for c in step}


@pytest.mark.parametrize("packing", ["trainer", "none", "loader", "offline"])
def test_no_held_out_conversation_ever_trains(samples, packing, tmp_path):
    rows = packing in ("loader", "offline")  # one epoch of rows of 256 slots: every conversation once
    kw = {"batch_size": 2, "max_seq_len": 256, "epochs": 1} if rows else {"epochs": 2}
    cfg = tiny_config(steps=None, eval_fraction=0.25, packing=packing, **kw)
    train_part, held = split_eval(cfg, samples)
    held_ids = {s.conversation_id for s in held}

    def run(data):
        prepacked = None
        if packing == "offline":
            prepacked = prepack_samples(data, tmp_path / f"rows{len(data)}", max_seq_len=256, seed=0).path
        return train(
            cfg,
            source=make_source(cfg, samples=data, prepacked=prepacked),
            model=tiny_model(),
            eval_samples=held,
        )

    trained = _trained_ids(run(train_part))
    assert trained and not trained & held_ids
    if not rows:  # two epochs of the seeded order saw every training conversation
        assert trained == {s.conversation_id for s in train_part}
    if packing == "trainer":  # negative control: the same check on a run over all conversations fails
        assert _trained_ids(run(samples)) & held_ids


def test_epochs_are_the_sources_own_epochs(samples):
    # trainer: an epoch is conversations // batch_size steps (the seeded order drops the last partial batch)
    cfg = tiny_config(steps=None, epochs=2)
    out = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model())
    assert out.steps == len(out.logs) == 2 * (len(samples) // 4)
    first = [c for step in out.conversations[: len(samples) // 4] for c in step]
    assert len(set(first)) == len(first) == len(samples) // 4 * 4  # no conversation twice in one epoch
    # loader: the first epoch's rows are counted by packing it once; the run then starts where a run
    # given the same number of steps starts: every step's loss the same number
    lcfg = tiny_config(steps=None, epochs=1, packing="loader", batch_size=2)
    by_epochs = train(lcfg, source=make_source(lcfg, samples=samples), model=tiny_model())
    scfg = tiny_config(steps=by_epochs.steps, packing="loader", batch_size=2)
    by_steps = train(scfg, source=make_source(scfg, samples=samples), model=tiny_model())
    assert [r.loss for r in by_epochs.logs] == [r.loss for r in by_steps.logs]
    rows = sum(len(step) for step in by_epochs.conversations)
    assert rows >= len(samples) * 0.99  # one epoch holds about every conversation once


def test_settings_are_checked():
    with pytest.raises(ValueError, match="steps=5 and epochs=2 both given"):
        TrainConfig(steps=5, epochs=2)
    with pytest.raises(ValueError, match="eval_fraction must be at least 0 and below 1"):
        TrainConfig(eval_fraction=1.0)
    assert TrainConfig().steps == 20 and TrainConfig(epochs=3).steps is None
    with pytest.raises(ValueError, match="pass the held-out samples as eval_samples"):
        train(tiny_config(eval_fraction=0.5), source=None, model=None)


def _cli(chat, tmp_path, *extra):
    log = ["--log", str(tmp_path / "run.jsonl")]
    return train_args(chat / "chat.jsonl", *log, *extra, tokenizer=chat / "tok", steps=None, max_seq_len=256)


def test_cli_epochs_and_eval(chat, tmp_path, capsys):
    png = tmp_path / "curves.png"
    argv = _cli(chat, tmp_path, "--epochs", "2", "--eval-fraction", "0.25", "--eval-every", "3", "--plot", str(png))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "eval: 10 conversations held out (10 samples" in out and "(2 epochs)" in out
    recs = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * (30 // 4)  # 40 conversations, 10 held out: 7 steps an epoch
    assert [r["step"] for r in recs if "eval_loss" in r] == [3, 6, 9, 12, 14]
    assert f"eval loss {recs[-1]['eval_loss']:.4f} (step 14)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an eval file: its conversations, evaluated after the last step
    assert main(_cli(chat, tmp_path, "--steps", "2", "--eval-file", str(chat / "chat.jsonl"))) == 0
    assert "eval: 40 conversations of" in capsys.readouterr().out
    assert [
        r["step"] for r in map(json.loads, (tmp_path / "run.jsonl").read_text().splitlines()) if "eval_loss" in r
    ] == [2]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "3", "--epochs", "1"], "give --steps or --epochs, not both"),
        (["--eval-every", "2"], "--eval-every needs an eval set"),
        (["--eval-fraction", "0.2", "--eval-file", "x.jsonl"], "give --eval-fraction or --eval-file, not both"),
        (["--eval-fraction", "1.5"], "eval_fraction must be at least 0 and below 1"),
        (["--eval-file", "no/such.jsonl"], "--eval-file no/such.jsonl: no such file"),
    ],
)
def test_cli_refusals_are_one_line(chat, tmp_path, capsys, extra, message):
    assert main(_cli(chat, tmp_path, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def _ranks_config():
    return tiny_config(packing="trainer", steps=None, epochs=1, batch_size=8, eval_fraction=0.25, eval_every=3)


def _rank_worker(rank: int, init_file: str, out_file: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from tests.helpers import tiny_samples

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=300)
    )
    try:
        cfg = _ranks_config()
        train_part, held = split_eval(cfg, tiny_samples())
        source = make_source(cfg, samples=train_part, rank=rank, world=2)
        out = train(cfg, source=source, model=tiny_model(dtype=torch.float64), eval_samples=held)
        if rank == 0:
            torch.save([(r.step, r.loss, r.eval_loss) for r in out.logs], out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_evaluate_and_count_epochs_like_one(samples, tmp_path):
    """Each rank evaluates its share of the held-out micro-batches; the all-reduced sum over the global
    count is the one-rank eval loss (float64, tests/loop/test_distributed.py's 1e-10: the same sums in
    another order), at the same steps of the same number of epoch steps."""
    from tests.loop.conftest import run_ranks

    cfg = _ranks_config()
    train_part, held = split_eval(cfg, samples)
    one = train(
        cfg, source=make_source(cfg, samples=train_part), model=tiny_model(dtype=torch.float64), eval_samples=held
    )
    run_ranks(_rank_worker, (str(tmp_path / "init"), str(tmp_path / "rank0.pt")))
    two = torch.load(tmp_path / "rank0.pt")
    assert [s for s, _, _ in two] == [r.step for r in one.logs] == list(range(1, len(train_part) // 8 + 1))
    n = len(one.logs)
    assert [r.step for r in one.logs if r.eval_loss is not None] == sorted({*range(3, n + 1, 3), n})
    assert [s for s, _, e in two if e is not None] == [r.step for r in one.logs if r.eval_loss is not None]
    evals = [(r.eval_loss, e) for r, (_, _, e) in zip(one.logs, two) if r.eval_loss is not None]
    assert max(abs(a - b) for a, b in evals) <= LOSS_TOL_64
    # negative control: rank 0's share alone (no all-reduce; dist is not initialised here) is not it
    share = EvalSet(cfg, held, rank=0, world=2).loss(one.model)
    assert abs(share - one.logs[-1].eval_loss) > 1e3 * LOSS_TOL_64
