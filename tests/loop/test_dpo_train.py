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

from sftpack.chat import ConversationSamples, read_conversations, tokenize_conversations, tokenize_pair
from sftpack.data import default_tokenizer
from sftpack.loop import TrainConfig, build_model, compact_vocabulary, make_source, train
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

    for packing in ("none",):
        with pytest.raises(ValueError, match=f"objective dpo runs on the packed paths only, not packing {packing}"):
            TrainConfig(packing=packing, objective="dpo")
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n", encoding="utf-8")
    assert main(["train", str(path), "--objective", "dpo", "--packing", "none", "--steps", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "sftpack train: --objective dpo runs on the packed paths only, not --packing none: use --packing "
        "trainer, offline or loader (each keeps every pair whole)"
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


def test_over_long_pairs_follow_overlong_whole_on_the_trainer_path(tmp_path) -> None:
    """A pair longer than max_seq_len follows ``overlong`` as one unit (sftpack.chat's rule) and the
    trainer path trains what is left: ``drop`` leaves the pair out (counted once, as one dropped
    conversation), ``truncate`` cuts each over-long member to its head (both members kept, the pair
    dropped when a member would keep no answer: a prompt that alone fills the row), ``split`` is
    refused naming the pair. A pair's two members, each at most max_seq_len, share one micro-batch of
    2 x max_seq_len slots (the preference default; a narrower micro_batch_tokens is refused at
    config time), so no pair is refused at the step: step 1 of the truncated data, all its pairs in
    one step, equals DPO computed one sequence at a time (TOL: the derivation above; max_seq_len 24 < 64)."""
    from sftpack.chat import OverlongError
    from sftpack.loop import load_model

    long_answer = {"prompt": "Tell a story.", "chosen": " Once" + " upon a time" * 12 + ".", "rejected": " No."}
    long_prompt = {"prompt": "Repeat: " + "la " * 40, "chosen": " la", "rejected": " no"}
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in [*PAIRS, long_answer, long_prompt]), encoding="utf-8")
    rows = list(read_conversations([str(path)]))
    limit = 24
    with pytest.raises(OverlongError, match=r"preference pair .*prefs.jsonl:6.* never split"):
        tokenize_conversations(rows, default_tokenizer(), max_seq_len=limit, overlong="split").to_list()
    dropped = tokenize_conversations(rows, default_tokenizer(), max_seq_len=limit, overlong="drop")
    kept = dropped.to_list()
    assert dropped.stats.dropped == 2 and len(kept) == 2 * len(PAIRS)
    cut = tokenize_conversations(rows, default_tokenizer(), max_seq_len=limit, overlong="truncate")
    samples = cut.to_list()
    assert cut.stats.truncated == 1 and cut.stats.dropped == 1 and len(samples) == 2 * (len(PAIRS) + 1)
    story = [s for s in samples if str(s.conversation_id).endswith(":6")]
    assert [(s.meta["role"], len(s)) for s in story] == [("chosen", limit), ("rejected", len(story[1]))]
    assert story[0].meta["truncated_from"] > limit and "truncated_from" not in story[1].meta
    assert all(s.loss_mask[1:].any() for s in story)  # the truncated member keeps answer tokens
    assert sum(len(s) for s in story) > limit  # the pair fits no micro-batch of max_seq_len slots

    samples, ids = compact_vocabulary(samples)
    vocab = len(ids)
    ref_dir = tmp_path / "reference"
    build_model(vocab, **MODEL, seed=1, dtype=F64).save_pretrained(ref_dir)
    n = len(PAIRS) + 1
    cfg = TrainConfig(
        packing="trainer", objective="dpo", reference_model=str(ref_dir), steps=1, batch_size=n, grad_accum=2,
        max_seq_len=limit, lr=1e-2, **MODEL,
    )  # fmt: skip
    out = train(cfg, source=make_source(cfg, samples=samples), model=build_model(vocab, **MODEL, seed=0, dtype=F64))
    rec = out.logs[0]
    assert rec.pairs == n and rec.sequences == 2 * n
    with pytest.raises(ValueError, match=r"micro_batch_tokens 24 cannot hold a preference pair.* at least 48"):
        TrainConfig(objective="dpo", max_seq_len=limit, micro_batch_tokens=limit)
    by_id = {(s.meta["group"], s.meta["role"]): s for s in samples}
    groups = list(dict.fromkeys(g for g, _ in out.conversations[0]))
    pairs = [(by_id[(g, "chosen")], by_id[(g, "rejected")]) for g in groups]
    expected = _alone_loss(build_model(vocab, **MODEL, seed=0, dtype=F64), load_model(str(ref_dir), dtype=F64), pairs)
    print(f"truncated pairs: step 1 loss {rec.loss!r}, alone {expected!r}: |diff| {abs(rec.loss - expected):.1e}")
    assert abs(rec.loss - expected) <= TOL


def test_sftpack_train_simpo_runs_without_a_reference(tmp_path, capsys) -> None:
    """``--objective simpo``: no reference model (step 1's loss is not DPO's log 2 at the starting
    weights), SimPO's beta and gamma by default (2.0, 1.0: its saved config says so); a reference
    model is refused in one line."""
    from sftpack.cli import main

    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS), encoding="utf-8")
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    argv = ["train", str(path), "--objective", "simpo", "--steps", "2", "--batch-size", "2", "--no-progress"]
    argv += ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--no-cache", "--log", str(log)]
    assert main([*argv, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]) == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["pairs"] for x in lines] == [2, 2] and all(np.isfinite(x["loss"]) for x in lines)
    assert abs(lines[0]["loss"] - math.log(2)) > 1e-3 and lines[0]["chosen_reward"] < 0  # beta * mean log-prob
    saved = torch.load(next(ckpt.rglob("state.pt")), weights_only=False)["config"]  # the run's own checkpoint
    assert (saved["objective"], saved["beta"], saved["gamma"]) == ("simpo", 2.0, 1.0)
    capsys.readouterr()
    assert main([*argv, "--reference-model", str(tmp_path)]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [
        "sftpack train: --objective simpo is reference-free: leave --reference-model out (or use --objective dpo)"
    ]
