"""Weighted (and signed-advantage) samples through the training loop's trainer path.

The rule (sftpack.loss, docs/contract.md): a step's loss is sum(w * loss) / sum(|w|) over every
target of the step (all micro-batches, all ranks). ``make_source`` + ``train`` on the trainer path
(conversations packed into rows, several micro-batches) must give, step by step, the losses and
parameters of a reference that runs every conversation alone (one micro-batch per conversation,
no packing) under the same rule; step 1's loss must also equal the rule computed by hand, one
conversation at a time through the model's own forward and ``F.cross_entropy``.

Tolerance, float64: 1e-10, tests/loop/test_equality.py's derivation (one step's loss off by at
most 1.5e-11 for a chain of n <= 1.5e4 roundings; AdamW's amplification over 20 steps 4.5e-14)
with tests/consumers/test_weights.py's addition for the weights: one more rounding per term
(w * loss) and the sum of |w| over <= 4 x 60 targets (n grows by < 2%), magnitudes times
|w| <= 2.5: the one-step bound becomes 2.5 * 1.5e-11 * 1.02 = 3.8e-11, and 1e-10 is 2.6x that.

Negative control: dropping the weights (the bug of TRL #5951: packing strips the column) moves
the first step's loss by more than 1e-3 (asserted), seven orders over the tolerance.

The three choices of the rule (``TrainConfig.weight_normalisation``, sftpack.loss.normalise_weights):
"token" (above), "sequence" and "group" (GRPO-style groups in ``Sample.meta["group"]``, spanning
micro-batches and ranks: ``TrainerSource(groups=False)``; the default keeps each group whole,
tests/loop/test_grpo_groups.py) run through the same loop: each equals the conversations alone under the
same choice (20 steps, grad_accum 1 and 2), step 1 equals the choice's definition by hand, and 2
gloo ranks equal 1 after 2 steps. Tolerance: the same 1e-10; the coefficients add two roundings per
target (w / (S_i * n_g)) and the counted denominators none, so the one-step bound stays within
3.8e-11 * (1 + 2/1.5e4); the all-reduces of 2 ranks add one rounding per value
(tests/loop/test_distributed.py). Negative control: "sequence" and "group" each move step 1's loss
away from the token mean by more than 1e-3.
"""

from __future__ import annotations

import json
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sftpack import Sample
from sftpack.loop import make_source, train
from sftpack.loop._sources import TrainerSource
from sftpack.sample import WeightNormalisation
from tests.helpers import WeightedAlone as Alone
from tests.helpers import max_loss_diff, max_param_diff, tiny_config, tiny_model, tiny_samples, with_groups
from tests.helpers import weighted_chat as _weighted_chat
from tests.helpers import weighted_cli_args as _cli
from tests.helpers import weighted_rule_by_hand as rule_by_hand
from tests.helpers import weighted_samples as weighted
from tests.loop.conftest import run_ranks

F64 = torch.float64
TOL = 1e-10  # float64; see the docstring
BUG = 1e-3


def grouped(samples: list[Sample]) -> list[Sample]:
    """GRPO-style groups (a prompt's completions): 6 groups, conversation i in group i % 6, but
    every 7th conversation has none (a group of its own). A step draws several members of a group."""
    return with_groups(samples, lambda i: None if i % 7 == 0 else f"g{i % 6}")


def spanning_source(cfg, data: list[Sample], rank: int = 0, world: int = 1) -> TrainerSource:
    """``make_source``'s trainer source with ``groups=False``: a group's members drawn as any
    conversations (so they span steps, micro-batches and ranks) rather than whole."""
    return TrainerSource(
        data,
        micro_batch_tokens=cfg.micro_batch_width,
        pad_multiple=cfg.pad_multiple,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        rank=rank,
        world=world,
        grad_accum=cfg.grad_accum,
        groups=False,
    )


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_weighted_trainer_path_equals_each_conversation_alone(samples, grad_accum):
    data = weighted(samples)
    cfg = tiny_config(packing="trainer", pad_multiple=4, grad_accum=grad_accum)
    run = train(cfg, source=make_source(cfg, samples=data), model=tiny_model(dtype=F64))
    assert all(len(step) > 1 for step in run.conversations)
    by_id = {s.conversation_id: s for s in data}
    steps = [[by_id[c] for c in step] for step in run.conversations]
    assert any(by_id[c].weights is not None and by_id[c].weights[0] < 0 for step in run.conversations for c in step)

    ref = train(tiny_config(packing="trainer"), source=Alone(steps), model=tiny_model(dtype=F64))
    dl, dp = max_loss_diff(run.losses, ref.losses), max_param_diff(run.model, ref.model)
    print(f"weighted float64: max |dloss| {dl:.2e}, max |dparam| {dp:.2e} (tolerance {TOL:.0e})")
    assert dl <= TOL and dp <= TOL, (dl, dp)

    by_hand = rule_by_hand(tiny_model(dtype=F64), steps[0])
    assert abs(run.losses[0] - by_hand) <= TOL, (run.losses[0], by_hand)

    # negative control: the same conversations with their weights dropped
    plain = [Sample(s.input_ids, s.loss_mask, s.conversation_id) for s in steps[0]]
    assert abs(run.losses[0] - rule_by_hand(tiny_model(dtype=F64), plain)) > BUG


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("rule", ["sequence", "group"])
def test_sequence_and_group_means_equal_each_conversation_alone(samples, rule, grad_accum):
    """The same loop, the same fused head, the other two choices: packed == alone (whose groups span
    one-conversation micro-batches) over 20 steps, step 1 == the choice by hand; not the token mean."""
    data = grouped(weighted(samples))
    cfg = tiny_config(packing="trainer", pad_multiple=4, grad_accum=grad_accum, weight_normalisation=rule)
    run = train(cfg, source=spanning_source(cfg, data), model=tiny_model(dtype=F64))
    by_id = {s.conversation_id: s for s in data}
    steps = [[by_id[c] for c in step] for step in run.conversations]
    assert any(len({s.meta.get("group") for s in step if s.meta}) < sum(bool(s.meta) for s in step) for step in steps)

    ref_cfg = tiny_config(packing="trainer", weight_normalisation=rule)
    ref = train(ref_cfg, source=Alone(steps), model=tiny_model(dtype=F64))
    dl, dp = max_loss_diff(run.losses, ref.losses), max_param_diff(run.model, ref.model)
    print(f"{rule} float64: max |dloss| {dl:.2e}, max |dparam| {dp:.2e} (tolerance {TOL:.0e})")
    assert dl <= TOL and dp <= TOL, (dl, dp)

    by_hand = rule_by_hand(tiny_model(dtype=F64), steps[0], rule)
    assert abs(run.losses[0] - by_hand) <= TOL, (run.losses[0], by_hand)
    # negative control: the token mean of the same step
    assert abs(run.losses[0] - rule_by_hand(tiny_model(dtype=F64), steps[0])) > BUG


def test_sequence_mean_without_weights(samples):
    """No weight column: "sequence" is the plain per-conversation mean (weight 1 on every target)."""
    cfg = tiny_config(packing="trainer", pad_multiple=4, steps=1, weight_normalisation="sequence")
    run = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(dtype=F64))
    by_id = {s.conversation_id: s for s in samples}
    step = [by_id[c] for c in run.conversations[0]]
    want = rule_by_hand(tiny_model(dtype=F64), step, "sequence")
    assert abs(run.losses[0] - want) <= TOL, (run.losses[0], want)
    assert abs(run.losses[0] - rule_by_hand(tiny_model(dtype=F64), step)) > BUG


def test_sequence_mean_on_the_loader_path(samples):
    """ "sequence" needs whole sequences, not the trainer path: the loader's rows (no weights there)
    give the per-conversation mean of the step's conversations."""
    cfg = tiny_config(packing="loader", batch_size=2, buffer_size=16, steps=1, weight_normalisation="sequence")
    run = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(dtype=F64))
    by_id = {s.conversation_id: s for s in samples}
    step = [by_id[c] for c in run.conversations[0]]
    assert len(step) > 2
    want = rule_by_hand(tiny_model(dtype=F64), step, "sequence")
    assert abs(run.losses[0] - want) <= TOL, (run.losses[0], want)
    assert abs(run.losses[0] - rule_by_hand(tiny_model(dtype=F64), step)) > BUG


@pytest.mark.parametrize("packing", ["none", "offline"])
def test_group_refuses_the_other_paths(packing):
    with pytest.raises(ValueError, match=f"weight_normalisation group .* groups: not packing {packing} with"):
        tiny_config(packing=packing, weight_normalisation="group")


def test_sequence_refuses_padded_batches_and_dpo():
    with pytest.raises(
        ValueError, match="weight_normalisation sequence averages whole packed sequences: not packing none"
    ):
        tiny_config(packing="none", weight_normalisation="sequence")
    with pytest.raises(ValueError, match="weight_normalisation sequence .* with objective dpo"):
        tiny_config(packing="trainer", objective="dpo", weight_normalisation="sequence")
    with pytest.raises(ValueError, match="weight_normalisation='mean' is not valid"):
        tiny_config(weight_normalisation="mean")
    assert "weight_normalisation" not in tiny_config().as_dict()  # the default: saved configs unchanged
    assert tiny_config(weight_normalisation="group").as_dict()["weight_normalisation"] == "group"


def test_group_refused_on_a_source_without_groups(samples):
    class NoGroups(Alone):
        def next_step(self):
            out = super().next_step()
            self.step_groups = None
            return out

    cfg = tiny_config(packing="trainer", steps=1, weight_normalisation="group")
    with pytest.raises(ValueError, match="NoGroups does not know its samples' groups"):
        train(cfg, source=NoGroups([samples[:4]]), model=tiny_model(dtype=F64))


# ------------------------------------------------------------------ 2 gloo ranks == 1
WORLD = 2
RANK_STEPS = 2
RULES = [str(r) for r in WeightNormalisation]


def _rank_config(rule: str):
    return tiny_config(packing="trainer", steps=RANK_STEPS, batch_size=12, pad_multiple=2, weight_normalisation=rule)


def _rank_data():
    return grouped(weighted(tiny_samples()))


def _rank_worker(rank: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        out = {}
        for rule in RULES:
            cfg = _rank_config(rule)
            run = train(
                cfg, source=spanning_source(cfg, _rank_data(), rank=rank, world=WORLD), model=tiny_model(dtype=F64)
            )
            out[rule] = {
                "losses": run.losses,
                "params": [p.detach() for p in run.model.parameters()],
                "conversations": run.conversations,
            }
        torch.save(out, f"{out_file}.{rank}")
        dist.barrier()  # both ranks done before either tears gloo down (tests/loop/test_distributed.py)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_gloo_ranks_equal_one_under_every_choice(tmp_path):
    """Weighted, grouped data on the trainer path, 2 steps: 2 gloo ranks (whose groups span the
    ranks) give 1 rank's losses and parameters, for token, sequence and group."""
    ones = {}
    for rule in RULES:  # first: the forked ranks inherit the loaded modules
        cfg = _rank_config(rule)
        ones[rule] = train(cfg, source=spanning_source(cfg, _rank_data()), model=tiny_model(dtype=F64))
    out = str(tmp_path / "rank")
    run_ranks(_rank_worker, (str(tmp_path / "init"), out), WORLD)
    two = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    by_id = {s.conversation_id: s for s in _rank_data()}
    for rule in RULES:
        one = ones[rule]
        a, b = two[0][rule]["conversations"], two[1][rule]["conversations"]
        assert all(sorted(x + y) == sorted(z) for x, y, z in zip(a, b, one.conversations))
        groups = [
            {by_id[c].meta.get("group") for c in x} & {by_id[c].meta.get("group") for c in y} for x, y in zip(a, b)
        ]
        assert any(g - {None} for g in groups), "no group spans the two ranks"
        dl = max_loss_diff(two[0][rule]["losses"], one.losses)
        dp = max(float((p - q.detach()).abs().max()) for p, q in zip(two[0][rule]["params"], one.model.parameters()))
        print(f"{rule}, 2 ranks vs 1: max |dloss| {dl:.1e}, max |dparam| {dp:.1e} (tolerance {TOL:.0e})")
        assert dl <= TOL and dp <= TOL, (rule, dl, dp)
    assert abs(ones["sequence"].losses[0] - ones["token"].losses[0]) > BUG
    assert abs(ones["group"].losses[0] - ones["sequence"].losses[0]) > BUG


def test_unweighted_steps_keep_their_int_count(samples):
    """A run without weights divides by the int64 target count, as before weights existed."""
    cfg = tiny_config(packing="trainer", pad_multiple=4, steps=1)
    src = make_source(cfg, samples=samples)
    mbs = src.next_step()
    assert not src.step_weighted and all(mb.weights is None for mb in mbs)


@pytest.mark.parametrize("packing", ["none"])
def test_paths_that_would_drop_weights_refuse_them(samples, packing):
    data = weighted(samples)
    cfg = tiny_config(packing=packing, batch_size=4, steps=1)
    with pytest.raises(ValueError, match=r"carries per-token weights .* --packing trainer"):
        src = make_source(cfg, samples=data)
        for _ in range(len(data)):
            src.next_step()


def test_fused_head_weights_equal_the_weighted_cross_entropy():
    """The fused head (chunked, gradients formed in the forward) with weights: the value and the
    gradients of sum(w * CE) / sum(|w|), chunk size 3 rows so several chunks run (float64, 1e-12:
    <= 40 rows x 8 classes, a chain of < 100 roundings on values <= 10)."""
    from sftpack.head import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 5, dtype=F64, generator=g, requires_grad=True)
    w = torch.randn(8, 5, dtype=F64, generator=g, requires_grad=True)
    y = torch.randint(0, 8, (40,), generator=g)
    y[::7] = -100
    wt = torch.randn(40, dtype=F64, generator=g) * 2
    wt[1] = 0.0
    n = wt.abs()[y != -100].sum()
    got = fused_linear_cross_entropy(h, w, y, n, weights=wt, chunk_bytes=3 * 8 * 8, impl="torch")
    gh, gw = torch.autograd.grad(got, (h, w))
    ce = F.cross_entropy(h @ w.t(), y.clamp_min(0), reduction="none") * (y != -100)
    want = (ce * wt).sum() / n
    wh, ww = torch.autograd.grad(want, (h, w))
    assert abs(float(got - want)) <= 1e-12
    assert float((gh - wh).abs().max()) <= 1e-12 and float((gw - ww).abs().max()) <= 1e-12
    mean = fused_linear_cross_entropy(h, w, y, weights=wt, reduction="mean")
    assert abs(float(mean - want)) <= 1e-12  # reduction="mean": the weighted count of the call's targets
    for impl in ("liger", "cce"):
        with pytest.raises(ValueError, match="takes no per-token weights"):
            fused_linear_cross_entropy(h, w, y, n, weights=wt, impl=impl)  # type: ignore[arg-type]


def test_cli_trains_a_weighted_jsonl(chat, tmp_path, capsys):
    """``sftpack train`` on a JSONL with 'weight' / 'advantage' (trainer path): 2 steps whose
    first loss is the weighted one (not the file's loss without its weights); the offline and loader
    paths: tests/loop/test_weighted_offline.py, tests/loop/test_dpo_loader.py."""
    from sftpack.cli import main

    (tmp_path / "tok").symlink_to(chat / "tok")
    run = tmp_path / "run"
    run.mkdir()
    weighted_file = _weighted_chat(chat, tmp_path / "weighted.jsonl")
    assert main(_cli(weighted_file, run, "weighted")) == 0
    assert main(_cli(chat / "chat.jsonl", run, "plain")) == 0
    w, p = ([json.loads(line) for line in (run / f"{n}.jsonl").read_text().splitlines()] for n in ("weighted", "plain"))
    assert [r["step"] for r in w] == [1, 2] and all(np.isfinite(r["loss"]) for r in w)
    assert w[0]["label_tokens"] == p[0]["label_tokens"]  # the same conversations and targets
    assert abs(w[0]["loss"] - p[0]["loss"]) > BUG  # the weights were used


def test_cli_weight_normalisation(chat, tmp_path, capsys):
    """``sftpack train --weight-normalisation sequence`` on a weighted JSONL: the same conversations and
    targets as token, other updates (the flag reaches the run; the rule itself is tested above);
    ``group`` off the trainer path is refused in one line."""
    from sftpack.cli import main

    (tmp_path / "tok").symlink_to(chat / "tok")
    run = tmp_path / "run"
    run.mkdir()
    data = _weighted_chat(chat, tmp_path / "weighted.jsonl")
    assert main(_cli(data, run, "token")) == 0
    assert main([*_cli(data, run, "sequence"), "--weight-normalisation", "sequence"]) == 0
    t, s = ([json.loads(line) for line in (run / f"{n}.jsonl").read_text().splitlines()] for n in ("token", "sequence"))
    assert t[0]["label_tokens"] == s[0]["label_tokens"] and all(np.isfinite(r["loss"]) for r in s)
    # the untrained model's token losses are nearly equal, so the two means nearly agree at first; the
    # rule moves the updates, hence the later losses: by far more than float32's 5e-7 on losses ~5
    # (and a run repeats bit for bit), 1e-5 being 20x that
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(t, s)) > 1e-5
    capsys.readouterr()
    assert main([*_cli(chat / "chat.jsonl", run, "g", "offline"), "--weight-normalisation", "group"]) != 0
    err = capsys.readouterr().err
    assert "--weight-normalisation group averages whole packed sequences and needs their samples' groups" in err
