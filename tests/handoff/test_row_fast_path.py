"""The row builder's fast paths (issue 18, item 6) lay the very bytes the previous builder laid.

``lay_row`` now lays a row of few sequences by slice copies into preallocated
arrays (one block when no sequence but the last is padded), and the loader lays
its rows from each sample's own arrays by the steps of ``build_parts``
(nothing concatenated first, nothing validated twice; each array one
``np.concatenate`` of the sequences and padding runs). ``_previous_lay_row`` below
is the builder as it was before (its layout code verbatim, after the checks that
are unchanged), kept here as the reference: over many random rows (every
strategy, pad multiples of CP sizes 1 to 4 and an odd one, rows with and
without a fixed width, several id and mask dtypes) every array, dtype and
``max_seqlen`` must be equal, and so must what the kernels get in both boundary
modes and each CP rank's shard.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sftpack import IGNORE_INDEX, PackedBatch
from sftpack.handoff import build_row, shard_for_cp
from sftpack.handoff.build import build_parts
from sftpack.handoff.layout import RowArrays, lay_row

_PREVIOUS_SLICE_COPY_MAX = 32


def _previous_lay_row(ids, mask, real, *, max_seq_len, pad_multiple, pad_id) -> RowArrays:
    """The layout of ``lay_row`` before issue 18 (inputs already checked)."""
    real = np.asarray(real, dtype=np.int64)
    n = real.shape[0]
    n_tok = int(real.sum())
    m = pad_multiple
    padded = -(-real // m) * m
    total = int(padded.sum())
    if max_seq_len is not None:
        padded[-1] += max_seq_len - total
        total = max_seq_len
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(real, out=cu[1:])
    cup = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(padded, out=cup[1:])
    out_ids = np.full(total, pad_id, dtype=np.int64)
    ok = np.zeros(total, dtype=bool)
    mask_b = mask.astype(bool, copy=False)
    if n == 1 or bool((padded[:-1] == real[:-1]).all()):
        out_ids[:n_tok] = ids
        ok[: n_tok - 1] = mask_b[1:]
    elif n <= _PREVIOUS_SLICE_COPY_MAX:
        for i in range(n):
            a, b, p = int(cu[i]), int(cu[i + 1]), int(cup[i])
            out_ids[p : p + b - a] = ids[a:b]
            ok[p : p + b - a - 1] = mask_b[a + 1 : b]
    else:
        slot = np.arange(n_tok, dtype=np.int64) + np.repeat(cup[:-1] - cu[:-1], real)
        out_ids[slot] = ids
        ok[slot[:-1]] = mask_b[1:]
    ok[cup[:-1] + real - 1] = False
    labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(ok[:-1], out_ids[1:], IGNORE_INDEX)
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(cup[:-1], padded)
    return RowArrays(out_ids, labels, position_ids, cu, cup, int(padded.max()))


def assert_same_arrays(got: RowArrays, want: RowArrays) -> None:
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.tobytes() == w.tobytes(), name
    assert type(got.max_seqlen) is int and got.max_seqlen == want.max_seqlen


def assert_same_batch(got: PackedBatch, want: PackedBatch) -> None:
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous(), name
        assert g.numpy().tobytes() == w.numpy().tobytes(), name
    assert got.max_seqlen == want.max_seqlen and got.sequence_ids == want.sequence_ids


@st.composite
def rows(draw):
    """Random rows: up to 40 sequences (past the slice-copy limit of 32), lengths 1..60 (some
    multiples of the pad multiple, so one-block rows come up with multiples above 1 too)."""
    m = draw(st.sampled_from([1, 2, 4, 6, 8]))  # 2 * CP for CP 1..4, and a multiple that is no power of 2
    n = draw(st.integers(1, 40))
    whole = draw(st.booleans())
    lengths = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    if whole:
        lengths = [-(-k // m) * m for k in lengths]
    n_tok = sum(lengths)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    dtype = draw(st.sampled_from([np.int64, np.int32, np.uint16, np.uint32]))
    ids = rng.integers(0, np.iinfo(dtype).max if dtype == np.uint16 else 151_646, n_tok).astype(dtype)
    p_mask = draw(st.sampled_from([0.0, 0.5, 1.0]))
    mask = rng.random(n_tok) < p_mask
    mask_kind = draw(st.sampled_from(["bool", "uint8", "int64"]))
    if mask_kind != "bool":
        mask = mask.astype(mask_kind)
    padded = sum(-(-k // m) * m for k in lengths)
    width = draw(st.one_of(st.none(), st.integers(0, 5).map(lambda extra: padded + extra * m)))
    pad_id = draw(st.sampled_from([0, 7, 151_645, 2**40]))
    return ids, mask, lengths, width, m, pad_id


@settings(max_examples=250, deadline=None)
@given(rows())
def test_lay_row_lays_the_previous_bytes(case):
    ids, mask, lengths, width, m, pad_id = case
    kw = {"max_seq_len": width, "pad_multiple": m, "pad_id": pad_id}
    want = _previous_lay_row(ids, mask, lengths, **kw)
    assert_same_arrays(lay_row(ids, mask, lengths, **kw), want)
    # the tensors too (build_row), with sequence ids
    sids = [f"c{i}" for i in range(len(lengths))]
    assert_same_batch(
        build_row(ids, mask, lengths, sequence_ids=sids, **kw), PackedBatch.from_row(want, sequence_ids=sids)
    )


@settings(max_examples=250, deadline=None)
@given(rows())
def test_build_parts_lays_the_previous_bytes(case):
    """The loader's path: each sequence's own arrays (int64 ids, bool mask, as a Sample holds them)."""
    ids, mask, lengths, width, m, pad_id = case
    ids, mask = ids.astype(np.int64), mask.astype(bool)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    id_parts = [ids[a:b].copy() for a, b in zip(bounds[:-1], bounds[1:])]
    mask_parts = [mask[a:b].copy() for a, b in zip(bounds[:-1], bounds[1:])]
    kw = {"max_seq_len": width, "pad_multiple": m, "pad_id": pad_id}
    want = _previous_lay_row(ids, mask, lengths, **kw)
    sids = list(range(len(lengths)))
    got = build_parts(id_parts, mask_parts, lengths, sequence_ids=sids, **kw)
    assert_same_batch(got, PackedBatch.from_row(want, sequence_ids=sids))
    # the parts are read, never written
    assert all(p.tobytes() == ids[a:b].tobytes() for p, a, b in zip(id_parts, bounds[:-1], bounds[1:]))


@settings(max_examples=100, deadline=None)
@given(rows())
def test_build_parts_takes_any_integer_ids_and_0_1_masks(case):
    """Parts of other integer dtypes (ids) and 0/1 masks lay the bytes of int64 / bool parts."""
    ids, mask, lengths, width, m, pad_id = case
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    cut = list(zip(bounds[:-1], bounds[1:]))
    kw = {"max_seq_len": width, "pad_multiple": m, "pad_id": pad_id}
    want = _previous_lay_row(ids.astype(np.int64), mask.astype(bool), lengths, **kw)
    got = build_parts([ids[a:b] for a, b in cut], [mask[a:b] for a, b in cut], lengths, **kw)
    assert_same_batch(got, PackedBatch.from_row(want))


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("pad_between_seqs", [False, True])
def test_cp_shards_and_kernel_boundaries_are_the_previous_ones(cp, pad_between_seqs):
    """What a CP rank and the kernel get from a row is a function of its bytes: the same."""
    rng = np.random.default_rng(cp)
    m = 2 * cp
    for _ in range(20):
        lengths = rng.integers(1, 90, int(rng.integers(1, 8))).tolist()
        n_tok = sum(lengths)
        ids, mask = rng.integers(0, 50_000, n_tok), rng.random(n_tok) < 0.6
        width = sum(-(-k // m) * m for k in lengths) + m * int(rng.integers(0, 4))
        got = build_row(ids, mask, lengths, max_seq_len=width, pad_multiple=m)
        want = PackedBatch.from_row(_previous_lay_row(ids, mask, lengths, max_seq_len=width, pad_multiple=m, pad_id=0))
        got.validate()
        for rank in range(cp):
            a, b = shard_for_cp(got, cp, rank), shard_for_cp(want, cp, rank)
            for name in ("input_ids", "labels", "position_ids", "slot_index", "cu_seqlens_padded"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (rank, name)
        pg, pw = got.to_packed_seq_params(pad_between_seqs), want.to_packed_seq_params(pad_between_seqs)
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            assert torch.equal(getattr(pg, name), getattr(pw, name)), name
        assert pg.max_seqlen_q == pw.max_seqlen_q


def test_build_parts_refuses_a_row_that_does_not_fit():
    with pytest.raises(
        ValueError, match="take 16 slots after padding each to a multiple of 4, more than max_seq_len=12"
    ):
        build_parts(
            [np.arange(5), np.arange(7)], [np.ones(5, bool), np.ones(7, bool)], [5, 7], max_seq_len=12, pad_multiple=4
        )
