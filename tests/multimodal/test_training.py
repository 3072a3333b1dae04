"""Training steps: packed rows and one-sample-at-a-time give the same losses step after step.

Two copies of the tiny float64 Qwen2-VL (same seed) take 4 SGD steps (lr 0.05) on the same
samples: one on packed rows (two rows per step, planned under a token and a patch budget,
laid end to end), the other on each sample alone, with the same token-mean loss over the
step's targets. Per-step losses and the final parameters must agree to 1e-10.

Bound: each step's loss and gradients are off by <= 8.9e-12 from rounding (the derivation
of test_exactness.py). The parameters then drift apart by <= lr * 8.9e-12 per step, 4 steps:
<= 1.8e-12, which moves a loss of this model (inputs and weights of magnitude <= 10, 4 layers
of gain <= 10 at this initialisation) by <= 1.8e-12 * 10 = 1.8e-11; with the rounding of the
step itself, <= 2.7e-11 per step, under 1e-10 (observed: about 1e-15).
"""

from __future__ import annotations

import torch

from sftpack import PackedBatch
from sftpack.loss import token_mean_loss
from sftpack.multimodal import family_for, plan_rows
from sftpack.sample import IGNORE_INDEX

TOL = 1e-10  # see the docstring
STEPS, LR = 4, 0.05


def _labels(s):
    ids, mask = torch.from_numpy(s.input_ids), torch.from_numpy(s.loss_mask)
    lab = torch.full_like(ids, IGNORE_INDEX)
    lab[:-1] = torch.where(mask[1:], ids[1:], IGNORE_INDEX)
    return lab


def test_packed_training_steps_equal_one_sample_at_a_time(renumbered):
    items = renumbered.samples
    rows = plan_rows([len(s) for s in items], [s.num_patches for s in items], max_seq_len=288, max_patches_per_row=400)
    assert len(rows) >= 2
    run = PackedBatch.concat(
        [PackedBatch.from_samples([items[i] for i in r], row_width=288, pad_id=renumbered.pad_id) for r in rows]
    ).validate()
    n = int((run.labels != IGNORE_INDEX).sum())
    packed_model, alone_model = renumbered.model(seed=1), renumbered.model(seed=1)
    family = family_for(packed_model)
    opt_p = torch.optim.SGD(packed_model.parameters(), lr=LR)
    opt_a = torch.optim.SGD(alone_model.parameters(), lr=LR)
    losses_p, losses_a = [], []
    for _ in range(STEPS):
        opt_p.zero_grad()
        loss_p = token_mean_loss(family.packed_logits(packed_model, run, pad_between_seqs=True), run.labels, n)
        loss_p.backward()
        opt_p.step()
        opt_a.zero_grad()
        loss_a = sum(token_mean_loss(family.alone_logits(alone_model, s), _labels(s), n) for s in items)
        loss_a.backward()
        opt_a.step()
        losses_p.append(loss_p.item())
        losses_a.append(loss_a.item())
    assert max(abs(a - b) for a, b in zip(losses_p, losses_a)) <= TOL, (losses_p, losses_a)
    assert losses_p[-1] < losses_p[0]  # it trains
    drift = max(
        float((p - q).detach().abs().max()) for p, q in zip(packed_model.parameters(), alone_model.parameters())
    )
    assert drift <= TOL
