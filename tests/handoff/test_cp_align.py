"""The handoff's alignment multiples and context-parallel sharding (worked example, properties, errors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sftpack import PackedBatch, Sample
from sftpack.handoff import (
    AlignmentError,
    CPShard,
    FP8Recipe,
    PackedBatchError,
    pad_multiple_for,
    shard_for_cp,
    unpack,
    unshard_cp,
)
from sftpack.handoff.cp import cp_slot_indices
from sftpack.testing import samples_from_lengths
from sftpack.trainer import pack_step
from tests.helpers import PAD, assert_same_batch, padded_batch


# ---------------------------------------------------------------- alignment
@pytest.mark.parametrize(
    "kwargs,seq,row",
    [
        (dict(), 1, 1),
        (dict(cp_size=2), 4, 4),
        (dict(cp_size=4), 8, 8),
        (dict(tp_size=4), 1, 1),  # TP without sequence parallelism does not split tokens
        (dict(tp_size=4, sequence_parallel=True), 4, 4),
        (dict(cp_size=2, tp_size=2, sequence_parallel=True), 8, 8),
        (dict(fp8="tensorwise"), 1, 16),
        (dict(fp8="delayed", cp_size=2), 4, 32),
        (dict(fp8="mxfp8", cp_size=2, tp_size=2, sequence_parallel=True), 8, 128),
        (dict(fp8=FP8Recipe.BLOCKWISE, cp_size=3), 6, 384),
    ],
)
def test_pad_multiple_for(kwargs, seq, row):
    a = pad_multiple_for(**kwargs)
    assert (a.seq_multiple, a.row_multiple) == (seq, row)
    assert a.row_multiple % a.seq_multiple == 0
    assert a.pack_step_kwargs() == {"pad_multiple": seq, "pad_to_multiple_of": row}


def test_alignment_errors_name_the_rule():
    valid = "'tensorwise', 'delayed', 'mxfp8', 'blockwise'"
    with pytest.raises(AlignmentError, match=f"fp8 \\(or None\\)='fp4' is not valid: choose one of {valid}"):
        pad_multiple_for(fp8="fp4")
    with pytest.raises(AlignmentError, match="cp_size must be a positive integer, got 0"):
        pad_multiple_for(cp_size=0)
    a = pad_multiple_for(cp_size=2, fp8="tensorwise")
    row = PackedBatch.from_samples(samples_from_lengths([5, 10]), pad_multiple=2)
    with pytest.raises(AlignmentError, match=r"segment 0 has padded length 6, not a multiple of 4 \(2\*CP = 4: cont"):
        a.check(row)
    row = PackedBatch.from_samples(samples_from_lengths([5, 10]), pad_multiple=4)
    fp8_rule = r"T=20 slots, not a multiple of 32 \(FP8 tensorwise needs each rank's rows to be a multiple of 16"
    with pytest.raises(AlignmentError, match=fp8_rule):
        a.check(row)
    ids, lens, _ = padded_batch(samples_from_lengths([5, 10]))
    assert a.check(pack_step(ids, lens, **a.pack_step_kwargs())).num_tokens == 32
    with pytest.raises(AlignmentError, match="row width 40 is not a multiple of 32.*use 64"):
        a.fixed_width(40)


# ---------------------------------------------------------------- context parallelism
def test_cp_worked_example():
    """REFERENCE: 5 and 10 tokens, CP=2, padded to 8 and 12: rank 0 holds A[0:2], A[6:8], B[0:3], B[9:12]."""
    ids, lens, _ = padded_batch(samples_from_lengths([5, 10]))
    row = pack_step(ids, lens, pad_multiple=4, pad_id=PAD)
    s0, s1 = (shard_for_cp(row, 2, r).validate() for r in range(2))
    assert isinstance(s0, CPShard) and isinstance(s0, PackedBatch)
    assert s0.slot_index.tolist() == [0, 1, 6, 7] + [8, 9, 10, 17, 18, 19]
    assert s0.input_ids.tolist() == [1000, 1001, PAD, PAD, 2000, 2001, 2002, 2009, PAD, PAD]
    assert s0.position_ids.tolist() == [0, 1, 6, 7, 0, 1, 2, 9, 10, 11]
    assert s0.cu_seqlens.tolist() == [0, 2, 6] and s0.cu_seqlens_padded.tolist() == [0, 4, 10]
    # B2's target B3 lives on rank 1: the label stays (the shard's loss is its share).
    assert s0.labels.tolist() == [1001, 1002, -100, -100, 2001, 2002, 2003, -100, -100, -100]
    assert s1.slot_index.tolist() == [2, 3, 4, 5, 11, 12, 13, 14, 15, 16]
    assert s1.input_ids.tolist() == [1002, 1003, 1004, PAD, 2003, 2004, 2005, 2006, 2007, 2008]
    assert s1.cu_seqlens.tolist() == [0, 3, 9] and s1.cu_seqlens_padded.tolist() == [0, 4, 10]
    assert s0.real_token_mask.tolist() == [True, True, False, False, True, True, True, True, False, False]
    assert s0.num_label_tokens + s1.num_label_tokens == row.num_label_tokens
    # Transformer Engine takes the whole sequences' boundaries on every CP rank.
    p = s0.to_packed_seq_params()
    assert p.cu_seqlens_q.tolist() == [0, 5, 15] and p.cu_seqlens_q_padded.tolist() == [0, 8, 20]
    assert p.max_seqlen_q == 12
    with pytest.raises(PackedBatchError, match="not a set of whole sequences"):
        s0.to_hf_kwargs()
    assert_same_batch(unshard_cp([s0, s1]), row)


@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    cp=st.sampled_from([1, 2, 4]),
    extra=st.integers(0, 3),
    seed=st.integers(0, 100),
)
@settings(max_examples=40, deadline=None)
def test_cp_shards_cover_every_slot_once_and_reassemble(lens, cp, extra, seed):
    rng = np.random.default_rng(seed)
    samples = [Sample(np.arange(n) + 100 * (i + 1), rng.random(n) < 0.7, i) for i, n in enumerate(lens)]
    ids, L, mask = padded_batch(samples, pad_id=PAD)
    m = pad_multiple_for(cp_size=cp).seq_multiple
    width = sum(-(-n // m) * m for n in lens) + extra * 2 * cp  # the tail keeps the last segment aligned
    row = pack_step(ids, L, mask, pad_multiple=m, max_seq_len=width, pad_id=PAD)
    shards = [shard_for_cp(row, cp, r).validate() for r in range(cp)]
    slots = torch.cat([s.slot_index for s in shards])
    assert sorted(slots.tolist()) == list(range(row.num_tokens))  # every slot exactly once
    for r, s in enumerate(shards):
        assert torch.equal(s.slot_index, cp_slot_indices(row, cp, r))
        assert torch.equal(s.input_ids, row.input_ids[s.slot_index])
        assert torch.equal(s.labels, row.labels[s.slot_index])
        assert torch.equal(s.position_ids, row.position_ids[s.slot_index])
        assert s.num_tokens * cp == row.num_tokens
        assert torch.equal(s.padded_seqlens * cp, row.padded_seqlens)
        assert int(s.real_token_mask.sum()) == s.num_real_tokens
    assert torch.equal(sum(s.seqlens for s in shards), row.seqlens)
    assert sum(s.num_label_tokens for s in shards) == row.num_label_tokens
    assert_same_batch(unshard_cp(shards), row)
    # Per-slot values (say, logits) computed per rank come back in row order.
    vals = torch.randn(row.num_tokens, 3)
    pieces = [vals[s.slot_index] for s in shards]
    assert torch.equal(unshard_cp(pieces, row), vals)
    assert torch.equal(unshard_cp(torch.stack(pieces), row, cp), vals)


def test_cp_errors():
    row = PackedBatch.from_samples(samples_from_lengths([5, 10]), pad_multiple=2)
    with pytest.raises(PackedBatchError, match=r"2\*CP = 4 chunks, but segment 0 has padded length 6"):
        shard_for_cp(row, 2, 0)
    row = PackedBatch.from_samples(samples_from_lengths([5, 10]), pad_multiple=4)
    with pytest.raises(PackedBatchError, match=r"cp_rank must be in \[0, cp_size=2\), got 2"):
        shard_for_cp(row, 2, 2)
    s0, s1 = shard_for_cp(row, 2, 0), shard_for_cp(row, 2, 1)
    with pytest.raises(PackedBatchError, match="piece 0 is rank 1"):
        unshard_cp([s1, s0])
    with pytest.raises(PackedBatchError, match=r"piece 1 has shape \(9,\), expected \(T/CP = 10, ...\)"):
        unshard_cp([torch.zeros(10), torch.zeros(9)], row)
    s0.labels[3] = 5  # a padding slot
    with pytest.raises(PackedBatchError, match=r"CPShard.labels\[3\] = 5 .*\(global slot 7\)"):
        s0.validate()
    s1.position_ids = s1.position_ids + 1
    with pytest.raises(PackedBatchError, match="CPShard.position_ids"):
        s1.validate()
    with pytest.raises(PackedBatchError, match="put the row back together first"):
        unpack(s0.input_ids, s0)


def test_shard_moves_to_device_with_its_maps():
    row = PackedBatch.from_samples(samples_from_lengths([5, 10]), pad_multiple=4)
    s = shard_for_cp(row, 2, 1).to("meta")
    assert isinstance(s, CPShard)
    moved = (s.input_ids, s.slot_index, s.global_cu_seqlens, s.global_cu_seqlens_padded)
    assert {t.device.type for t in moved} == {"meta"}
