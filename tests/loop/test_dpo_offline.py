"""``objective="dpo"`` on the offline path (issue 42): a prepack of preference pairs, each pair whole in
one row, trained by the loop; step 1's loss equals the DPO loss computed one sequence at a time.

Data (tests.helpers.preference_data, as tests/loop/test_dpo_train.py's): five string pairs read and
tokenized with the embedded tokenizer, ids compacted; policy a tiny float64 Llama (seed 0), reference
another (seed 1) saved to a folder. The samples are prepacked (``prepack_samples``: rows of 64 slots,
pad multiple 4, each pair one group of the planner), the loop reads ``batch_size=2`` rows a step
(``--batch-size`` counts rows on the offline path, as for SFT) in two micro-batches of one row
(``grad_accum=2``), and logs step 1's loss, the mean over the step's pairs (all of its rows).

Alone: each of the step's sequences through the same two models as its own ``(1, L)`` batch
(``tests.helpers.dpo_loss_alone``), for both boundary modes (``real``: padding slots skipped;
``padded``: the padded boundaries, FlashAttention-2's mode).

Tolerance, fixed: 1e-9 in float64, tests/loop/test_dpo_train.py's derivation, which holds as is: the
same models, vocabulary <= 97 ids and <= 32 targets per sequence (asserted by preference_data), so
<= 2.3e-10 per pair and for their mean. Measured: 1.1e-16 (printed), both modes.

Negative control: the alone computation with every chosen answer against the first pair's rejected
one (partners mismatched) moves the loss by more than BUG = 1e-5 (measured: 1.1e-2); and the same
samples planned into rows without their groups (the SFT planner) split pairs over rows, which the
loss refuses, naming the half pair.

Two gloo ranks (each step's 2 rows dealt one a rank, the pair count all-reduced) train like one
process on the same rows: losses and parameters over 2 steps within 1e-10 (tests/loop/test_distributed.py's
derivation: the same computation in another summation order, DDP's all-reduce one rounding more).

``sftpack train prefs.jsonl --objective dpo --packing offline`` (a temporary prepack of the pairs):
two steps, step 1's loss log 2 (the reference is the starting weights).
"""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sftpack import PackedBatch
from sftpack.handoff import pack_rows
from sftpack.loop import TrainConfig, build_model, load_model, make_source, train
from sftpack.loop._preference import pairs_in
from sftpack.offline import PrepackedDataset, prepack_samples
from sftpack.sample import pair_sequence_id
from tests.helpers import DPO_MODEL, PREFERENCE_PAIRS, dpo_loss_alone, max_loss_diff, max_param_diff, preference_data
from tests.loop.conftest import run_ranks

pytest.importorskip("transformers")

F64 = torch.float64
BETA = 0.1
TOL = 1e-9  # float64; see the docstring
BUG = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Any, int, Any, Any]:
    """The samples, the vocabulary size, the reference folder and a prepack of the pairs."""
    root = tmp_path_factory.mktemp("dpo_offline")
    samples, vocab, ref_dir = preference_data(root)
    path = prepack_samples(samples, root / "rows", max_seq_len=64, pad_multiple=4).path
    return samples, vocab, ref_dir, path


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_step_one_loss_is_the_dpo_loss_of_each_sequence_alone(data, boundaries, tmp_path) -> None:
    samples, vocab, ref_dir, path = data
    cfg = TrainConfig(
        packing="offline",
        objective="dpo",
        beta=BETA,
        reference_model=str(ref_dir),
        boundaries=boundaries,
        steps=1,
        batch_size=2,
        grad_accum=2,
        max_seq_len=32,  # a preference run's rows: 2 x max_seq_len = the prepack's 64
        pad_multiple=4,
        lr=1e-2,
        **DPO_MODEL,
    )
    source = make_source(cfg, prepacked=path)
    out = train(cfg, source=source, model=build_model(vocab, **DPO_MODEL, seed=0, dtype=F64), log=tmp_path / "l")
    rec = out.logs[0]
    seen = out.conversations[0]
    groups = list(dict.fromkeys(g for g, _ in seen))
    assert rec.micro_batches == 2 and rec.pairs == len(groups) >= 2 and rec.sequences == 2 * len(groups)
    assert sorted(seen) == sorted((g, r) for g in groups for r in ("chosen", "rejected"))
    by_id = {(s.meta["group"], s.meta["role"]): s for s in samples}
    pairs = [(by_id[(g, "chosen")], by_id[(g, "rejected")]) for g in groups]

    policy = build_model(vocab, **DPO_MODEL, seed=0, dtype=F64)  # the starting weights
    reference = load_model(str(ref_dir), dtype=F64)
    expected = dpo_loss_alone(policy, reference, pairs, BETA)
    diff = abs(rec.loss - expected)
    mismatched = [(c, pairs[0][1]) for c, _ in pairs]
    control = abs(rec.loss - dpo_loss_alone(policy, reference, mismatched, BETA))
    print(f"{boundaries}: step 1 loss {rec.loss!r}, alone {expected!r}: |diff| {diff:.1e}; mismatched {control:.1e}")
    assert diff <= TOL
    assert control > BUG
    assert not math.isclose(rec.loss, math.log(2), abs_tol=1e-6)  # the reference is not the policy


def _ranks_config(ref_dir: Any) -> TrainConfig:
    return TrainConfig(
        packing="offline",
        objective="dpo",
        beta=BETA,
        reference_model=str(ref_dir),
        steps=2,
        batch_size=2,
        max_seq_len=32,  # rows of 2 x 32 = the prepack's 64
        pad_multiple=4,
        lr=1e-2,
        **DPO_MODEL,
    )


def _rank(rank: int, init_file: str, out_file: str, vocab: int, ref_dir: str, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=300)
    )
    try:
        cfg = _ranks_config(ref_dir)
        source = make_source(cfg, prepacked=path, rank=rank, world=2)
        result = train(cfg, source=source, model=build_model(vocab, **DPO_MODEL, seed=0, dtype=F64))
        if rank == 0:
            torch.save({"params": [p.detach() for p in result.model.parameters()], "losses": result.losses}, out_file)
    finally:
        dist.destroy_process_group()


def test_two_ranks_train_like_one(data, tmp_path) -> None:
    _, vocab, ref_dir, path = data
    out = tmp_path / "two.pt"
    run_ranks(_rank, (str(tmp_path / "init"), str(out), vocab, str(ref_dir), str(path)))
    two = torch.load(out)
    cfg = _ranks_config(ref_dir)
    one = train(cfg, source=make_source(cfg, prepacked=path), model=build_model(vocab, **DPO_MODEL, seed=0, dtype=F64))
    dl = max_loss_diff(two["losses"], one.losses)
    dp = max(float((a - b.detach()).abs().max()) for a, b in zip(two["params"], one.model.parameters()))
    print(f"dpo offline, 2 ranks vs 1: max |dloss| {dl:.1e}, max |dparam| {dp:.1e}")
    assert dl <= 1e-10 and dp <= 1e-10
    assert max_param_diff(one.model, build_model(vocab, **DPO_MODEL, seed=0, dtype=F64)) > 1e-4  # it trained


def test_rows_planned_without_the_pairs_split_them_and_are_refused(data) -> None:
    """Control: the same samples planned into rows without the groups (the SFT planner) split pairs
    over rows, and the loss refuses such a row, naming the half pair; the prepack's rows all pass."""
    samples, _, _, path = data
    ds = PrepackedDataset(path)
    assert all(2 * len(pairs_in(ds.row(r)).groups) == len(ds.row(r).sequence_ids) for r in range(ds.num_rows))
    refused = 0
    for picked in pack_rows([len(s) for s in samples], max_seq_len=64, pad_multiple=4):
        half = [samples[i] for i in picked.tolist()]
        row = PackedBatch.from_samples(half, max_seq_len=64, pad_multiple=4)
        row = dataclasses.replace(row, sequence_ids=tuple(pair_sequence_id(s) for s in half))
        try:
            pairs_in(row)
        except ValueError as e:
            assert "in this batch" in str(e)
            refused += 1
    assert refused > 0


def test_an_sft_prepack_is_refused_for_dpo_and_a_pair_prepack_for_sft(data, tmp_path) -> None:
    samples, _, _, path = data
    from sftpack import Sample

    plain = [Sample(s.input_ids, s.loss_mask, f"c{i}") for i, s in enumerate(samples)]
    sft = prepack_samples(plain, tmp_path / "sft", max_seq_len=64, pad_multiple=4).path
    base: dict[str, Any] = {"steps": 1, "batch_size": 2, "pad_multiple": 4}
    pref = {**base, "max_seq_len": 32}  # a preference run's rows are 2 x max_seq_len: the prepack's 64
    with pytest.raises(ValueError, match="holds SFT conversations, not preference pairs"):
        make_source(TrainConfig(packing="offline", objective="dpo", **pref), prepacked=sft)
    with pytest.raises(ValueError, match="holds preference pairs .* train it with --objective dpo"):
        make_source(TrainConfig(packing="offline", max_seq_len=64, **base), prepacked=path)
    # SimPO, the other preference objective, takes the prepack of pairs as DPO does
    assert make_source(TrainConfig(packing="offline", objective="simpo", **pref), prepacked=path).epoch_steps() > 0
    # rows of another width than 2 x max_seq_len: refused, naming both fixes
    with pytest.raises(ValueError, match=r"has rows of 64 slots.*2 x --max-seq-len = 128 slots; train it with "):
        make_source(TrainConfig(packing="offline", objective="dpo", max_seq_len=64, **base), prepacked=path)


def test_sftpack_train_dpo_offline_runs_two_steps(tmp_path) -> None:
    from sftpack.cli import main

    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PREFERENCE_PAIRS), encoding="utf-8")
    log = tmp_path / "log.jsonl"
    argv = ["train", str(path), "--objective", "dpo", "--packing", "offline", "--steps", "2", "--batch-size", "1"]
    # --max-seq-len 24 bounds each sequence (the longest has 17 tokens) but not a pair (the first has 14 + 17):
    # the temporary prepack's rows are 2 x 24 slots, as the loader's rows and the trainer's micro-batches
    argv += ["--max-seq-len", "24", "--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1"]
    assert main([*argv, "--no-cache", "--log", str(log)]) == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(x["pairs"] >= 1 for x in lines)
    assert all(x["sequences"] == 2 * x["pairs"] for x in lines)  # every row holds whole pairs
    assert abs(lines[0]["loss"] - math.log(2)) < 1e-6  # the reference is the starting weights: log 2 at step 1
    assert math.isfinite(lines[1]["loss"]) and lines[1]["loss"] != lines[0]["loss"]
