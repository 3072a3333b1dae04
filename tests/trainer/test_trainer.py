"""The trainer path: pack_step against the contract, unpack, micro-batch plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sftpack import IGNORE_INDEX, PackedBatch, Sample
from sftpack.handoff import PackedBatchError, pad_multiple_for, unpack, unpack_padded
from sftpack.testing import samples_from_lengths
from sftpack.trainer import PlanError, pack_step, plan_microbatches
from tests.helpers import PAD, assert_same_batch, padded_batch


# ---------------------------------------------------------------- worked example
def test_worked_example_trainer_row():
    """docs/contract.md section 2, trainer row: batch [2, 10], lengths 5 and 10, multiple of 4."""
    A, B = samples_from_lengths([5, 10])
    ids, lens, _ = padded_batch([A, B], S=10)
    b = pack_step(ids, lens, pad_multiple=4, pad_id=PAD).validate()
    assert b.num_tokens == 20
    assert b.cu_seqlens.tolist() == [0, 5, 15] and b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens_padded.tolist() == [0, 8, 20] and b.cu_seqlens_padded.dtype == torch.int32
    assert b.max_seqlen == 12 and b.source_rows == (0, 1)
    a, p = list(range(1000, 1005)), [PAD] * 3
    assert b.input_ids.tolist() == a + p + list(range(2000, 2010)) + [PAD] * 2
    assert b.labels.tolist() == (
        list(range(1001, 1005)) + [IGNORE_INDEX] * 4 + list(range(2001, 2010)) + [IGNORE_INDEX] * 3
    )
    assert b.position_ids.tolist() == list(range(8)) + list(range(12))
    assert b.source_rows == (0, 1)
    assert_same_batch(b, PackedBatch.from_samples([A, B], pad_multiple=4, pad_id=PAD))
    # kernel gets real + padded by default
    p = b.to_packed_seq_params()
    assert p.cu_seqlens_q.tolist() == [0, 5, 15] and p.cu_seqlens_q_padded.tolist() == [0, 8, 20]


def test_input_forms_agree():
    """lengths as tensor / list / numpy, or an attention_mask; loss_mask or HF labels."""
    samples = [Sample([5, 6, 7, 8], [0, 0, 1, 1], 0), Sample([9, 10], [0, 1], 1), Sample([11, 12, 13], [1, 0, 1], 2)]
    ids, lens, mask = padded_batch(samples, S=6)
    ref = pack_step(ids, lens, mask, pad_multiple=2, pad_id=PAD)
    assert_same_batch(ref, PackedBatch.from_samples(samples, pad_multiple=2, pad_id=PAD))
    am = torch.arange(6)[None, :] < lens[:, None]
    hf = torch.where(mask, ids, torch.full_like(ids, IGNORE_INDEX))
    for kw in (
        dict(lengths=lens.tolist(), loss_mask=mask),
        dict(lengths=lens.numpy(), loss_mask=mask),
        dict(attention_mask=am.long(), loss_mask=mask),
        dict(lengths=lens, labels=hf),
        dict(attention_mask=am, labels=hf),
    ):
        assert_same_batch(pack_step(ids, pad_multiple=2, pad_id=PAD, **kw), ref)
    # No mask at all: every token is trainable.
    all_on = [Sample(s.input_ids, np.ones(len(s), bool), i) for i, s in enumerate(samples)]
    assert_same_batch(
        pack_step(ids, lens, pad_multiple=2, pad_id=PAD), PackedBatch.from_samples(all_on, pad_multiple=2, pad_id=PAD)
    )
    # int32 ids are widened to the contract's int64
    assert pack_step(ids.int(), lens).input_ids.dtype == torch.int64


def test_row_width_options():
    A, B = samples_from_lengths([5, 10])
    ids, lens, _ = padded_batch([A, B], S=10)
    # FP8-style row multiple: 20 -> 32, the last segment absorbs the tail.
    b = pack_step(ids, lens, pad_multiple=4, pad_to_multiple_of=16).validate()
    assert b.cu_seqlens_padded.tolist() == [0, 8, 32] and b.max_seqlen == 24
    # Pipeline parallelism: one fixed width.
    b = pack_step(ids, lens, pad_multiple=4, max_seq_len=24, pad_id=PAD).validate()
    assert b.cu_seqlens_padded.tolist() == [0, 8, 24] and b.max_seqlen == 16
    assert_same_batch(b, PackedBatch.from_samples([A, B], pad_multiple=4, max_seq_len=24, pad_id=PAD))
    with pytest.raises(PackedBatchError, match=r"2 sequences take 20 slots .* multiple of 4, more than max_seq_len=16"):
        pack_step(ids, lens, pad_multiple=4, max_seq_len=16)
    with pytest.raises(
        PackedBatchError, match=r"max_seq_len=22 is not a multiple of pad_multiple=4.*use max_seq_len=24"
    ):
        pack_step(ids, lens, pad_multiple=4, max_seq_len=22)
    with pytest.raises(PackedBatchError, match=r"pad_to_multiple_of=6 is not a multiple of pad_multiple=4.*=12"):
        pack_step(ids, lens, pad_multiple=4, pad_to_multiple_of=6)
    with pytest.raises(PackedBatchError, match=r"max_seq_len=40 is not a multiple of pad_to_multiple_of=16"):
        pack_step(ids, lens, pad_multiple=4, pad_to_multiple_of=16, max_seq_len=40)


def test_empty_rows_are_skipped_and_recorded():
    samples = samples_from_lengths([3, 1, 4])
    ids, lens, _ = padded_batch(samples, S=5)
    ids = torch.cat([ids[:1], torch.full((1, 5), PAD), ids[1:], torch.full((1, 5), PAD)])
    lens = torch.tensor([3, 0, 1, 4, 0])
    b = pack_step(ids, lens, pad_multiple=2, pad_id=PAD).validate()
    assert b.source_rows == (0, 2, 3) and b.source_batch_size == 5
    assert b.sequence_ids is None  # pack_step knows no conversation ids unless given them
    assert_same_batch(b, PackedBatch.from_samples(samples, pad_multiple=2, pad_id=PAD))
    # unpack_padded reads the recorded rows by default: the skipped rows stay where they were.
    assert torch.equal(unpack_padded(b.input_ids, b, seq_len=5, padding_value=PAD), ids)
    back = unpack_padded(b.input_ids, b, rows=b.source_rows, batch_size=5, seq_len=5, padding_value=PAD)
    assert torch.equal(back, ids)
    # sequence_ids means one thing: the conversation each segment holds.
    named = pack_step(ids, lens, pad_multiple=2, pad_id=PAD, sequence_ids=["a", "-", "b", "c", "-"])
    assert named.sequence_ids == ("a", "b", "c")
    with pytest.raises(PackedBatchError, match="name a batch row twice"):
        unpack_padded(b.input_ids, b, rows=[0, 0, 1], seq_len=5)
    with pytest.raises(PackedBatchError, match=r"every row of the \[2, 5\] batch is empty"):
        pack_step(ids[:2, :] * 0, torch.tensor([0, 0]))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(lengths=[3, 11]), r"lengths\[1\] = 11 is outside \[0, S=10\]"),
        (dict(lengths=[-1, 2]), r"lengths\[0\] = -1 is outside"),
        (dict(lengths=[3]), "lengths has 1 entries for a batch of B=2 rows"),
        (dict(), "give lengths"),
        (dict(lengths=[1, 1], attention_mask=torch.ones(2, 10)), "not both"),
        (dict(lengths=[1, 1], loss_mask=torch.ones(2, 10), labels=torch.ones(2, 10)), "not both"),
        (dict(lengths=[1, 1], loss_mask=torch.ones(2, 9)), r"loss_mask has shape \(2, 9\)"),
        (dict(lengths=[1, 1], pad_multiple=0), "pad_multiple must be a positive integer"),
        (dict(lengths=[2.0, 1.0]), "lengths must be integers"),
    ],
)
def test_errors(kwargs, message):
    with pytest.raises(PackedBatchError, match=message):
        pack_step(torch.ones(2, 10, dtype=torch.long), **kwargs)


def test_left_padded_mask_is_refused():
    am = torch.tensor([[1, 1, 0], [0, 1, 1]])
    with pytest.raises(PackedBatchError, match="attention_mask row 1 is not right-padded"):
        pack_step(torch.ones(2, 3, dtype=torch.long), attention_mask=am)
    with pytest.raises(PackedBatchError, match=r"input_ids must be a \(B, S\) tensor"):
        pack_step(torch.ones(3, dtype=torch.long), [3])


# ---------------------------------------------------------------- properties
@st.composite
def batches(draw):
    B = draw(st.integers(1, 8))
    S = draw(st.integers(1, 24))
    lens = draw(st.lists(st.integers(0, S), min_size=B, max_size=B).filter(lambda ls: max(ls) > 0))
    m = draw(st.sampled_from([1, 2, 3, 4, 8]))
    width = draw(st.sampled_from(["tight", "multiple", "fixed"]))
    seed = draw(st.integers(0, 2**16))
    return lens, S, m, width, seed


@given(batches())
@example(([5, 10], 10, 4, "tight", 0))
@example(([0, 1, 0], 1, 1, "fixed", 3))
@settings(max_examples=150, deadline=None)
def test_pack_step_matches_contract_and_row_builder(case):
    lens, S, m, width, seed = case
    rng = np.random.default_rng(seed)
    B = len(lens)
    ids = torch.from_numpy(rng.integers(1, 1000, (B, S)))
    mask = torch.from_numpy(rng.random((B, S)) < 0.6)
    real = torch.arange(S)[None, :] < torch.tensor(lens)[:, None]
    ids = torch.where(real, ids, PAD)  # right padding the model must never see
    kept = [b for b in range(B) if lens[b] > 0]
    samples = [Sample(ids[b, : lens[b]].numpy(), mask[b, : lens[b]].numpy(), b) for b in kept]
    total = sum(-(-lens[b] // m) * m for b in kept)
    kw: dict = {}
    if width == "multiple":
        kw["pad_to_multiple_of"] = 4 * m
    elif width == "fixed":
        kw["max_seq_len"] = total + m * int(rng.integers(0, 4))
    b = pack_step(ids, torch.tensor(lens), mask, pad_multiple=m, pad_id=PAD, **kw).validate()

    # Field by field against the contract's row builder on the same sequences.
    ref = PackedBatch.from_samples(samples, pad_multiple=m, max_seq_len=b.num_tokens, pad_id=PAD)
    assert_same_batch(b, ref)
    assert b.source_rows == tuple(kept)
    assert (
        b.num_tokens
        == {"tight": total, "multiple": -(-total // (4 * m)) * 4 * m, "fixed": kw.get("max_seq_len")}[width]
    )
    assert b.cu_seqlens.tolist() == [0, *np.cumsum([lens[k] for k in kept]).tolist()]
    assert all(p % m == 0 for p in b.padded_seqlens.tolist())
    assert b.num_label_tokens == sum(int(s.loss_mask[1:].sum()) for s in samples)
    # Exact inverse on real tokens.
    assert [x.tolist() for x in unpack(b.input_ids, b)] == [s.input_ids.tolist() for s in samples]
    back = unpack_padded(b.input_ids, b, rows=b.source_rows, batch_size=B, seq_len=S, padding_value=PAD)
    assert torch.equal(back, ids)
    # Per-slot values with a trailing dimension travel the same way.
    feats = torch.stack([b.input_ids, b.position_ids], dim=-1).float()
    assert unpack_padded(feats, b, rows=b.source_rows, batch_size=B, seq_len=S).shape == (B, S, 2)


def test_unpack_is_differentiable_and_checks_shape():
    b = pack_step(torch.tensor([[1, 2, 0], [3, 4, 5]]), [2, 3], pad_multiple=4)
    x = torch.arange(8.0, requires_grad=True)
    parts = unpack(x * 2, b)
    assert [p.tolist() for p in parts] == [[0.0, 2.0], [8.0, 10.0, 12.0]]
    sum(p.sum() for p in parts).backward()
    assert x.grad.tolist() == [2, 2, 0, 0, 2, 2, 2, 0]
    with pytest.raises(PackedBatchError, match=r"shape \(T=8, ...\), got \(7,\)"):
        unpack(torch.zeros(7), b)
    with pytest.raises(PackedBatchError, match="seq_len=2 is shorter than the longest sequence"):
        unpack_padded(b.input_ids, b, seq_len=2)


# ---------------------------------------------------------------- micro-batch plans
@given(
    lens=st.lists(st.integers(1, 64), min_size=1, max_size=60),
    dp=st.integers(1, 4),
    m=st.sampled_from([1, 2, 4]),
    cost=st.sampled_from(["tokens", "attention"]),
    algorithm=st.sampled_from(["bfd", "next_fit", "first_fit_shuffle"]),
)
@settings(max_examples=80, deadline=None)
def test_plan_microbatches_properties(lens, dp, m, cost, algorithm):
    budget = 64
    if len(lens) < dp:
        with pytest.raises(PlanError, match=f"{len(lens)} sequences cannot give {dp} data-parallel ranks"):
            plan_microbatches(lens, budget, dp_size=dp, cost=cost, pad_multiple=m)
        return
    try:
        plan = plan_microbatches(lens, budget, dp_size=dp, cost=cost, pad_multiple=m, algorithm=algorithm)
    except PlanError as e:
        # Only when the micro-batches cannot be dealt evenly: more needed than a
        # multiple of dp that the sequences can fill.
        assert "the same number of micro-batches" in str(e) and len(lens) % dp, e
        return
    arr = np.asarray(lens)
    padded = -(-arr // m) * m
    assert plan.dp_size == dp
    M = plan.num_microbatches
    assert all(len(rank) == M and M >= 1 for rank in plan.microbatches)
    flat = np.concatenate([mb for rank in plan.microbatches for mb in rank])
    assert sorted(flat.tolist()) == list(range(len(lens)))  # every sequence exactly once
    for r, rank in enumerate(plan.microbatches):
        for i, mb in enumerate(rank):
            assert len(mb) >= 1
            assert plan.tokens[r, i] == padded[mb].sum() <= budget
            w = padded[mb].sum() if cost == "tokens" else (padded[mb] ** 2).sum()
            assert plan.loads[r, i] == w
    # Sequences dealt by LPT, then moves and swaps that never raise the heaviest rank nor
    # lower the lightest: the heaviest rank is at most one sequence above the lightest.
    loads = plan.rank_loads
    costs = padded.astype(float) if cost == "tokens" else padded.astype(float) ** 2
    assert loads.max() - loads.min() <= costs.max()


def test_plan_feeds_pack_step_at_a_fixed_width():
    """The planner charges what pack_step pads: every micro-batch fits max_seq_len=budget."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 30, 40)
    samples = [Sample(rng.integers(1, 50, n), np.ones(n, bool), i) for i, n in enumerate(lens)]
    a = pad_multiple_for(cp_size=2)
    plan = plan_microbatches(lens, 64, dp_size=2, cost="attention", pad_multiple=a.seq_multiple)
    for rank in plan.microbatches:
        for mb in rank:
            ids, L, mask = padded_batch([samples[i] for i in mb])
            b = pack_step(ids, L, mask, max_seq_len=64, **{"pad_multiple": a.seq_multiple}).validate()
            assert b.num_tokens == 64
            a.check(b)
    assert plan.imbalance < 1.5


def test_plan_errors():
    over = r"sequence 1 has 10 tokens, 12 once padded to a multiple of 4, more than max_seq_len=11"
    with pytest.raises(PlanError, match=over):
        plan_microbatches([5, 10], 11, pad_multiple=4)
    with pytest.raises(PlanError, match="cost 'flops': not 'tokens', 'attention', a model size"):
        plan_microbatches([5, 10], 16, cost="flops")
    with pytest.raises(PlanError, match="3 sequences cannot give 2 data-parallel ranks 2 micro-batch"):
        plan_microbatches([5, 10, 3], 16, dp_size=2, min_microbatches=2)
    with pytest.raises(PlanError, match=r"lengths\[1\] = 0: drop empty sequences"):
        plan_microbatches([5, 0, 3], 16)
    # Three sequences that each fill a micro-batch cannot be dealt evenly to 2 ranks: an error, not a hang.
    with pytest.raises(PlanError, match="cannot give 2 data-parallel ranks the same number of micro-batches"):
        plan_microbatches([16, 16, 16], 16, dp_size=2)
