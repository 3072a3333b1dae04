"""``objective="dpo"`` through the training loop, trainer path (issue 42): step 1's loss equals the DPO
loss computed one sequence at a time.

Data: five string preference pairs (TRL's ``prompt`` / ``chosen`` / ``rejected``) in a JSONL file,
read and tokenized with the embedded tokenizer (each pair two samples, the prompt untrained), the
token ids compacted to the ones the data uses (a small head: the full logits DPO reads stay small).
Policy: a tiny float64 Llama (``build_model``, seed 0); reference: another one (seed 1) saved to a
folder and given as ``reference_model`` (were it the starting weights, every log-ratio of step 1
would be 0 and the loss log 2 whatever the packing). The loop draws 4 pairs (``batch_size`` counts
pairs), plans them into 2 micro-batches (``grad_accum=2``), each pair whole in one, and logs step 1's
loss, the mean over the step's pairs.

Alone: each of those 8 sequences through the same two models as its own ``(1, L)`` batch, its
log-probability gathered from ``log_softmax`` at its next tokens where the loss mask trains them,
the loss written out as ``log1p(exp(-z))``, ``z = beta * ((pc - rc) - (pr - rr))``, averaged.

Tolerance, fixed: 1e-9 in float64. Derivation (as tests/consumers/test_dpo.py's): per logit, each
side is within n*u*20 = 2e3 * 1.1e-16 * 20 = 4.4e-12 of the exact value (the same model in another
summation order, n <= 2e3 roundings on values below 20: this model is smaller, dim 16, one layer),
so the two sides differ by <= 8.8e-12. A token's log-probability is the target logit minus the
log-sum-exp over V <= 97 ids (asserted): <= 8.8e-12 + 8.8e-12 + 97 * 1.1e-16 * 20 < 1.8e-11 per
token. A sequence's sum over <= 32 targets (asserted): <= 5.8e-10. The pair loss is 1-Lipschitz in
its argument beta * (four sums), beta = 0.1: <= 0.4 * 5.8e-10 = 2.3e-10 per pair and for their mean,
under 1e-9. Measured: 3.3e-16 (printed).

Negative control: the same alone computation with every chosen answer matched to the first pair's
rejected one (partners mismatched; a cyclic shift would keep the mean of the arguments) moves the loss by more than BUG = 1e-5 (1e4 x TOL; measured 5.5e-4); and
a micro-batch that holds half a pair is refused by the loss module, naming the group.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import numpy as np
import pytest
import torch

from sftpack.chat import ConversationSamples, tokenize_pair
from sftpack.loop import TrainConfig, build_model, make_source, train
from sftpack.loop._preference import PreferenceLossModule
from sftpack.loop._sources import TrainerSource
from sftpack.sample import Sample
from sftpack.testing import tiny_chat_tokenizer
from sftpack.trainer import pack_step, padded_batch
from tests.helpers import DPO_MODEL as MODEL
from tests.helpers import PREFERENCE_PAIRS as PAIRS
from tests.helpers import dpo_loss_alone as _alone_loss
from tests.helpers import preference_data

pytest.importorskip("transformers")

F64 = torch.float64
BETA = 0.1
TOL = 1e-9  # float64; see the docstring
BUG = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[list[Sample], int, Any]:
    """The pairs' samples (ids compacted), the vocabulary size, and the reference model's folder."""
    return preference_data(tmp_path_factory.mktemp("dpo"))


def test_step_one_loss_is_the_dpo_loss_of_each_sequence_alone(data, tmp_path) -> None:
    samples, vocab, ref_dir = data
    cfg = TrainConfig(
        packing="trainer",
        objective="dpo",
        beta=BETA,
        reference_model=str(ref_dir),
        steps=1,
        batch_size=4,
        grad_accum=2,
        max_seq_len=64,
        lr=1e-2,
        **MODEL,
    )
    out = train(
        cfg,
        source=make_source(cfg, samples=samples),
        model=build_model(vocab, **MODEL, seed=0, dtype=F64),
        log=tmp_path / "log.jsonl",
    )
    rec = out.logs[0]
    assert rec.micro_batches == 2 and rec.sequences == 8 and rec.pairs == 4
    # the step's pairs, by (group, role) id; each pair whole in one micro-batch
    by_id = {(s.meta["group"], s.meta["role"]): s for s in samples}
    seen = out.conversations[0]
    groups = list(dict.fromkeys(g for g, _ in seen))
    assert len(groups) == 4 and sorted(seen) == sorted((g, r) for g in groups for r in ("chosen", "rejected"))
    pairs = [(by_id[(g, "chosen")], by_id[(g, "rejected")]) for g in groups]

    policy = build_model(vocab, **MODEL, seed=0, dtype=F64)  # the starting weights
    from sftpack.loop import load_model

    reference = load_model(str(ref_dir), dtype=F64)
    expected = _alone_loss(policy, reference, pairs)
    diff = abs(rec.loss - expected)
    mismatched = [(c, pairs[0][1]) for c, _ in pairs]  # every chosen answer against the first pair's rejected one
    control = abs(rec.loss - _alone_loss(policy, reference, mismatched))
    print(f"step 1 loss {rec.loss!r}, alone {expected!r}: |diff| {diff:.1e}; partners mismatched {control:.1e}")
    assert diff <= TOL
    assert control > BUG
    assert not math.isclose(rec.loss, math.log(2), abs_tol=1e-6)  # the reference is not the policy
    line = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert line["pairs"] == 4 and line["loss"] == rec.loss
    assert 0.0 <= line["reward_accuracy"] <= 1.0 and line["chosen_reward"] != line["rejected_reward"]


def test_a_micro_batch_with_half_a_pair_is_refused(data) -> None:
    samples, vocab, _ = data
    model = build_model(vocab, **MODEL, seed=0, dtype=F64)
    module = PreferenceLossModule(model, pad_between_seqs=True, beta=BETA)
    half = [samples[0], samples[1], samples[2]]  # pair 0 whole, pair 1's chosen answer alone
    ids, lens, mask = padded_batch(half, pad_id=0)
    row = pack_step(ids, lens, mask, sequence_ids=[(s.meta["group"], s.meta["role"]) for s in half])
    with pytest.raises(ValueError, match="no 'rejected' one in this batch"):
        module(row, torch.tensor(2))


def test_sft_refuses_a_pair_as_its_conversation_is_read() -> None:
    """Without objective dpo, conversations still being tokenized: the first pair read is refused,
    before the step finds it has too few conversations; objective dpo takes the same pair."""
    chosen, rejected = tokenize_pair(PAIRS[0], tiny_chat_tokenizer("chatml"), conversation_id="p0")
    for pairs in (False, True):
        data = ConversationSamples(1)
        source = TrainerSource(data, micro_batch_tokens=64, batch_size=8 if not pairs else 1, seed=0, pairs=pairs)
        timer = threading.Timer(0.1, data._put, (0, [chosen, rejected]))
        timer.start()
        try:
            if pairs:
                (row,) = source.next_step()
                assert row.sequence_ids == (("p0", "chosen"), ("p0", "rejected"))
            else:
                with pytest.raises(ValueError, match="'p0' is the chosen answer of a preference pair"):
                    source.next_step()
        finally:
            timer.join()


def test_other_paths_refuse_dpo_in_one_line(tmp_path, capsys) -> None:
    from sftpack.cli import main

    for packing in ("loader", "none"):  # offline: tests/loop/test_dpo_offline.py
        with pytest.raises(
            ValueError, match=f"objective dpo runs on the trainer and offline paths only, not packing {packing}"
        ):
            TrainConfig(packing=packing, objective="dpo")
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n", encoding="utf-8")
    assert main(["train", str(path), "--objective", "dpo", "--packing", "loader", "--steps", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "sftpack train: --objective dpo runs on the trainer and offline paths only, not --packing loader: use "
        "--packing trainer or offline (they keep each pair in one micro-batch)"
    ]


def test_sftpack_train_dpo_runs_two_steps(tmp_path) -> None:
    from sftpack.cli import main

    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS), encoding="utf-8")
    log = tmp_path / "log.jsonl"
    argv = ["train", str(path), "--objective", "dpo", "--packing", "trainer", "--steps", "2", "--batch-size", "2"]
    argv += ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--no-cache", "--log", str(log)]
    assert main(argv) == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(x["pairs"] == 2 and x["sequences"] == 4 for x in lines)
    assert abs(lines[0]["loss"] - math.log(2)) < 1e-6  # the reference is the starting weights: log 2 at step 1
    assert np.isfinite(lines[1]["loss"]) and lines[1]["loss"] != lines[0]["loss"]
