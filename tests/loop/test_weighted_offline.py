"""Weighted (and signed-advantage) samples through the training loop's offline path (issue 42).

The samples of tests/loop/test_weighted_train.py (weights 2.5, 0, -0.75, per token, none) are
prepacked (``weights.npy``: each token's weight) and trained with ``packing="offline"``: rows of
128 slots, several conversations a row, ``batch_size=4`` rows a step. The loop must divide by the
weighted count (the source's ``step_weighted``), so step by step the losses and the parameters
equal a reference that runs every conversation of each step alone (one micro-batch each, no
packing) under the same rule, sum(w * loss) / sum(|w|) over the step; step 1's loss also equals
the rule by hand, one conversation at a time through the model's forward and ``F.cross_entropy``.

Tolerance, float64: 1e-10, tests/loop/test_weighted_train.py's derivation with the step's targets
grown from 4 x 60 to 4 x 128 (four rows): n grows by < 4%, the one-step bound 2.5 * 1.5e-11 * 1.04
= 3.9e-11, and 1e-10 is 2.6x that (6 steps here, AdamW's amplification well under that over 20).

Negative control: the same conversations with their weights dropped (the TRL #5951 bug) move step 1's
loss by more than 1e-3. ``sftpack train weighted.jsonl --packing offline`` (a temporary prepack
that keeps the weights) runs and differs from the file without its weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sftpack import Sample
from sftpack.loop import make_source, train
from sftpack.offline import prepack_samples
from tests.helpers import (
    WeightedAlone,
    max_loss_diff,
    max_param_diff,
    tiny_config,
    tiny_model,
    weighted_chat,
    weighted_cli_args,
    weighted_rule_by_hand,
    weighted_samples,
)

F64 = torch.float64
TOL = 1e-10  # float64; see the docstring
BUG = 1e-3


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_weighted_offline_path_equals_each_conversation_alone(samples, grad_accum, tmp_path):
    data = weighted_samples(samples)
    path = prepack_samples(data, tmp_path / "rows", max_seq_len=128, pad_multiple=4).path
    cfg = tiny_config(packing="offline", pad_multiple=4, grad_accum=grad_accum, steps=6)
    source = make_source(cfg, prepacked=path)
    assert source.step_weighted
    run = train(cfg, source=source, model=tiny_model(dtype=F64))
    assert all(len(step) > 4 for step in run.conversations)  # several conversations a row
    by_id = {s.conversation_id: s for s in data}
    steps = [[by_id[c] for c in step] for step in run.conversations]

    ref = train(tiny_config(packing="trainer", steps=6), source=WeightedAlone(steps), model=tiny_model(dtype=F64))
    dl, dp = max_loss_diff(run.losses, ref.losses), max_param_diff(run.model, ref.model)
    print(f"weighted offline float64: max |dloss| {dl:.2e}, max |dparam| {dp:.2e} (tolerance {TOL:.0e})")
    assert dl <= TOL and dp <= TOL, (dl, dp)
    assert abs(run.losses[0] - weighted_rule_by_hand(tiny_model(dtype=F64), steps[0])) <= TOL

    plain = [Sample(s.input_ids, s.loss_mask, s.conversation_id) for s in steps[0]]
    assert abs(run.losses[0] - weighted_rule_by_hand(tiny_model(dtype=F64), plain)) > BUG


def test_sftpack_train_offline_keeps_a_jsonls_weights(chat, tmp_path):
    from sftpack.cli import main

    (tmp_path / "tok").symlink_to(chat / "tok")
    run = tmp_path / "run"
    run.mkdir()
    weighted_file = weighted_chat(chat, tmp_path / "weighted.jsonl")
    assert main([*weighted_cli_args(weighted_file, run, "weighted", "offline"), "--no-cache"]) == 0
    assert main([*weighted_cli_args(chat / "chat.jsonl", run, "plain", "offline"), "--no-cache"]) == 0
    w, p = ([json.loads(x) for x in (run / f"{n}.jsonl").read_text().splitlines()] for n in ("weighted", "plain"))
    assert [r["step"] for r in w] == [1, 2] and all(np.isfinite(r["loss"]) for r in w)
    assert w[0]["label_tokens"] == p[0]["label_tokens"]  # the same rows and targets
    assert abs(w[0]["loss"] - p[0]["loss"]) > BUG  # the weights were used


def test_renumbered_rows_keep_their_weights_and_the_weighted_step(samples, tmp_path):
    """A model over the data's ids reads the prepack renumbered (``vocab=``): the rows keep their
    weights and the step stays weighted."""
    path = prepack_samples(weighted_samples(samples), tmp_path / "rows", max_seq_len=128, pad_multiple=4).path
    cfg = tiny_config(packing="offline", pad_multiple=4, steps=1)
    plain = make_source(cfg, prepacked=path).next_step()
    source = make_source(cfg, prepacked=path, vocab=np.arange(97))
    rows = source.next_step()
    assert source.step_weighted
    assert all(torch.equal(a.weights, b.weights) for a, b in zip(rows, plain))  # type: ignore[arg-type]
