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
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sftpack import Sample
from sftpack.loop import make_source, train
from tests.helpers import WeightedAlone as Alone
from tests.helpers import max_loss_diff, max_param_diff, tiny_config, tiny_model
from tests.helpers import weighted_chat as _weighted_chat
from tests.helpers import weighted_cli_args as _cli
from tests.helpers import weighted_rule_by_hand as rule_by_hand
from tests.helpers import weighted_samples as weighted

F64 = torch.float64
TOL = 1e-10  # float64; see the docstring
BUG = 1e-3


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


def test_unweighted_steps_keep_their_int_count(samples):
    """A run without weights divides by the int64 target count, as before weights existed."""
    cfg = tiny_config(packing="trainer", pad_multiple=4, steps=1)
    src = make_source(cfg, samples=samples)
    mbs = src.next_step()
    assert not src.step_weighted and all(mb.weights is None for mb in mbs)


@pytest.mark.parametrize("packing", ["none", "loader"])
def test_paths_that_would_drop_weights_refuse_them(samples, packing):
    data = weighted(samples)
    cfg = tiny_config(packing=packing, batch_size=4, steps=1, **({"buffer_size": 16} if packing == "loader" else {}))
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
    first loss is the weighted one (not the file's loss without its weights); the other paths refuse."""
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
    capsys.readouterr()
    for packing in ("loader",):  # offline carries them: tests/loop/test_weighted_offline.py
        assert main(_cli(weighted_file, run, packing, packing)) != 0
        assert "carries per-token weights" in capsys.readouterr().err
