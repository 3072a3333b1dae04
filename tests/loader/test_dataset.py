"""PackingDataset: the worked example, rows of max_seq_len, every sample once, the wait bound, stats."""

from __future__ import annotations

import functools
import operator
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sftpack import Sample
from sftpack.binpack import Bins
from sftpack.handoff import pack_rows, padded_lengths
from sftpack.loader import (
    PAD_BETWEEN_SEQS,
    LoaderStats,
    PackingDataset,
    worked_example_row,
)
from sftpack.loader._hold import hold_back
from sftpack.testing import samples_from_lengths

PAD = 999  # a pad id no sample uses (samples_from_lengths ids are >= 1000; pad ids must be >= 0)


def lengths_of(n: int, hi: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, hi, n).tolist()


def unpacked_ids(row) -> list[np.ndarray]:
    """The real tokens of each segment of a row."""
    cu, cup = row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist()
    ids = row.input_ids.numpy()
    return [ids[cup[i] : cup[i] + cu[i + 1] - cu[i]] for i in range(row.num_sequences)]


# ------------------------------------------------------------------ worked example
def test_worked_example_comes_out_of_packing_dataset():
    row = worked_example_row()
    assert row.num_tokens == 36
    assert row.cu_seqlens.tolist() == [0, 5, 15]
    assert row.cu_seqlens_padded.tolist() == [0, 8, 36]
    assert row.sequence_ids == ("A", "B")  # input order kept: A before B
    assert row.input_ids[:5].tolist() == [1, 2, 3, 4, 5] and row.input_ids[8:18].tolist() == list(range(101, 111))
    row.validate()


def test_the_loader_hands_the_padded_boundaries_for_both_by_default():
    assert PAD_BETWEEN_SEQS is False
    ds = PackingDataset(samples_from_lengths([5, 10]), max_seq_len=36, buffer_size=4, pad_multiple=4)
    row = next(iter(ds))
    p = ds.packed_seq_params(row)
    assert p.cu_seqlens_q is p.cu_seqlens_kv is p.cu_seqlens_q_padded is p.cu_seqlens_kv_padded
    assert p.cu_seqlens_q.tolist() == [0, 8, 36]
    both = PackingDataset(
        samples_from_lengths([5, 10]), max_seq_len=36, buffer_size=4, pad_multiple=4, pad_between_seqs=True
    )
    q = both.packed_seq_params(next(iter(both)))
    assert q.cu_seqlens_q.tolist() == [0, 5, 15] and q.cu_seqlens_q_padded.tolist() == [0, 8, 36]


# ------------------------------------------------------------------ rows and samples
@pytest.mark.parametrize("pad_multiple", [1, 4, 8])
def test_every_sample_once_in_full_width_rows_in_input_order(pad_multiple):
    lengths = lengths_of(300, 200, seed=pad_multiple)
    samples = samples_from_lengths(lengths)
    ds = PackingDataset(samples, max_seq_len=256, buffer_size=24, pad_multiple=pad_multiple, pad_id=PAD)
    rows = list(ds)
    seen = []
    for row in rows:
        row.validate()
        assert row.num_tokens == 256
        assert (row.padded_seqlens[:-1] % pad_multiple == 0).all()
        ids = list(row.sequence_ids)
        assert ids == sorted(ids)  # buffer (= input) order within a row
        for sid, toks in zip(ids, unpacked_ids(row)):  # self-describing: sample i holds 1000*(i+1)+arange
            assert np.array_equal(toks, samples[sid].input_ids)
        assert (row.input_ids[~row.real_token_mask] == PAD).all()
        seen += ids
    assert sorted(seen) == list(range(len(lengths)))
    s = ds.stats
    assert (s.samples_in, s.rows_out, s.sequences_out) == (300, len(rows), 300)
    assert s.real_tokens == sum(lengths) and s.slots == 256 * len(rows)
    assert s.fill == pytest.approx(sum(lengths) / (256 * len(rows)))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=60),
    pad_multiple=st.sampled_from([1, 2, 4, 8]),
    buffer_size=st.integers(1, 16),
    max_wait=st.integers(0, 3),
)
def test_rows_never_overflow_and_hold_every_sample_once(lengths, pad_multiple, buffer_size, max_wait):
    """The bin cost is the width build_row lays: a planned row always builds."""
    ds = PackingDataset(
        samples_from_lengths(lengths),
        max_seq_len=64,
        buffer_size=buffer_size,
        pad_multiple=pad_multiple,
        max_wait=max_wait,
    )
    rows = list(ds)
    assert sorted(i for r in rows for i in r.sequence_ids) == list(range(len(lengths)))
    for r in rows:
        assert int(padded_lengths(r.seqlens.numpy(), pad_multiple).sum()) <= 64
        assert r.num_tokens == 64


def test_the_row_planner_costs_with_the_row_builders_padding():
    rows = pack_rows([5, 10, 30, 20], max_seq_len=36, pad_multiple=4)
    assert [r.tolist() for r in rows] == [[2], [1, 3], [0]]  # costs 8, 12, 32, 20: 12 + 20 = 32 fits, 8 does not
    # Unpadded, 5 + 30 = 35 would fit one row; padded it costs 8 + 32 = 40 > 36.
    assert all(int(padded_lengths(np.array([5, 10, 30, 20])[r], 4).sum()) <= 36 for r in rows)


def test_hold_back_waits_only_under_filled_rows_within_budget_and_age():
    rows = Bins(np.arange(5), np.array([0, 1, 3, 4, 5]))  # rows [0], [1, 2], [3], [4]
    costs = np.array([36, 20, 12, 8, 4])
    young = np.zeros(5, int)
    kw = {"max_seq_len": 36, "min_fill": 0.99, "max_items": 3}
    assert hold_back(rows, costs, young, max_wait=2, max_seq_len=36, min_fill=0.99, max_items=4).tolist() == [
        False,
        True,
        True,
        True,
    ]
    # the emptiest wait first; the 2-sample row no longer fits the budget of 3
    assert hold_back(rows, costs, young, max_wait=2, **kw).tolist() == [False, False, True, True]
    old = np.array([0, 0, 0, 2, 0])
    assert hold_back(rows, costs, old, max_wait=2, **kw).tolist() == [False, True, False, True]
    assert not hold_back(rows, costs, young, max_wait=0, **kw).any()


@pytest.mark.parametrize("max_wait", [0, 1, 3])
def test_a_sample_is_decided_within_the_stated_bound(max_wait):
    """Decided (and emitted) before its worker reads (max_wait + 1) * buffer_size more samples."""
    lengths = lengths_of(400, 120, seed=max_wait)
    B = 16
    ds = PackingDataset(samples_from_lengths(lengths), max_seq_len=128, buffer_size=B, max_wait=max_wait, min_fill=1.0)
    emitted_at = {}
    for row in ds:
        for sid in row.sequence_ids:
            emitted_at[sid] = ds.stats.samples_in  # samples read when the row came out
    late = {p: emitted_at[p] - (p + 1) for p in range(len(lengths))}
    assert max(late.values()) <= (max_wait + 1) * B
    assert ds.stats.max_waited <= max_wait
    if max_wait:
        assert ds.stats.held_rows > 0 and ds.stats.max_waited == max_wait  # min_fill=1.0: the bound is reached


def test_waiting_fills_rows_better_than_packing_each_buffer_whole():
    lengths = lengths_of(2000, 400, seed=5)
    fills = {}
    for w in (0, 2):
        ds = PackingDataset(samples_from_lengths(lengths), max_seq_len=512, buffer_size=32, max_wait=w)
        rows = sum(1 for _ in ds)
        fills[w] = ds.stats.fill
        assert rows == ds.stats.rows_out
    assert fills[2] > fills[0] + 0.005


# ------------------------------------------------------------------ over-long samples
def test_overlong_policies_are_applied_before_costing_and_counted():
    lengths = [10, 70, 20, 150, 5]
    samples = samples_from_lengths(lengths, trainable_from=1)

    split = PackingDataset(samples, max_seq_len=64, buffer_size=8, pad_multiple=4)
    rows = list(split)
    pieces = {}
    for r in rows:
        for sid, toks in zip(r.sequence_ids, unpacked_ids(r)):
            pieces.setdefault(sid, []).append(toks)
    for sid in range(len(lengths)):  # pieces rejoin to the sample, in order
        joined = np.concatenate(sorted(pieces[sid], key=lambda t: int(t[0])))
        assert np.array_equal(joined, samples[sid].input_ids)
    assert (split.stats.split, split.stats.extra_pieces) == (2, 1 + 2)
    assert split.stats.samples_packed == 5 and split.stats.real_tokens == sum(lengths)

    trunc = PackingDataset(samples, max_seq_len=64, buffer_size=8, overlong="truncate")
    list(trunc)
    assert (trunc.stats.truncated, trunc.stats.tokens_truncated) == (2, 6 + 86)
    assert trunc.stats.real_tokens == sum(lengths) - 92

    drop = PackingDataset(samples, max_seq_len=64, buffer_size=8, overlong="drop")
    kept = sorted(i for r in drop for i in r.sequence_ids)
    assert kept == [0, 2, 4]
    assert (drop.stats.dropped, drop.stats.tokens_dropped, drop.stats.samples_in) == (2, 220, 5)
    assert drop.stats.samples_in == drop.stats.samples_packed + drop.stats.dropped

    with pytest.raises(
        ValueError,
        match=r"sample 1 \(conversation 1\) has 70 tokens, more than max_seq_len=64.*"
        r"overlong='split'",
    ):
        list(PackingDataset(samples, max_seq_len=64, buffer_size=8, overlong="error"))


# ------------------------------------------------------------------ sources, epochs, seeds
class Stream:
    """A re-iterable source without len() or [i] (like a lazy tokenizer output)."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def test_iterable_and_map_style_sources_give_the_same_rows():
    samples = samples_from_lengths(lengths_of(120, 90))
    kw = {"max_seq_len": 128, "buffer_size": 16, "pad_multiple": 2}
    a = [r.input_ids for r in PackingDataset(samples, **kw)]
    b = [r.input_ids for r in PackingDataset(Stream(samples), **kw)]
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="shuffle=True needs a map-style source"):
        PackingDataset(Stream(samples), shuffle=True, **kw)
    once = PackingDataset(iter(samples), num_epochs=2, **kw)
    with pytest.raises(ValueError, match="one-shot iterator"):
        list(once)


def test_dicts_and_bare_id_lists_are_samples_too():
    ds = PackingDataset(
        [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "conversation_id": "x"}, [7, 8]], max_seq_len=8, buffer_size=2
    )
    (row,) = list(ds)
    assert row.sequence_ids == ("x", 1)
    assert row.labels.tolist()[:5] == [2, 3, -100, 8, -100]


def test_shuffled_epochs_are_seeded_and_each_holds_every_sample_once():
    samples = samples_from_lengths(lengths_of(200, 100))
    kw = {"max_seq_len": 128, "buffer_size": 16, "shuffle": True, "num_epochs": 2}
    run1 = list(PackingDataset(samples, seed=7, **kw))
    run2 = list(PackingDataset(samples, seed=7, **kw))
    other = list(PackingDataset(samples, seed=8, **kw))
    assert len(run1) == len(run2) and all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(run1, run2))
    assert [r.sequence_ids for r in run1] != [r.sequence_ids for r in other]
    ids = [i for r in run1 for i in r.sequence_ids]
    assert set(Counter(ids).values()) == {2}
    # rows never mix epochs: the first rows hold every sample exactly once
    first_epoch = []
    for r in run1:
        first_epoch += r.sequence_ids
        if len(first_epoch) == 200:
            break
    assert sorted(first_epoch) == list(range(200))


def test_set_epoch_and_continuing_iteration():
    samples = samples_from_lengths(lengths_of(60, 100))
    ds = PackingDataset(samples, max_seq_len=128, buffer_size=8, shuffle=True, seed=1)
    e0 = [r.sequence_ids for r in ds]
    e1 = [r.sequence_ids for r in ds]  # the next iter() is the next epoch
    assert ds.epoch == 2 and ds.stats.epochs == 2 and e0 != e1
    ds.set_epoch(0)
    assert [r.sequence_ids for r in ds] == e0


# ------------------------------------------------------------------ ranks and options
def test_ranks_read_disjoint_shares_whose_union_is_every_sample():
    samples = samples_from_lengths(lengths_of(101, 60))
    seen = []
    for rank in range(3):
        ds = PackingDataset(samples, max_seq_len=64, buffer_size=8, rank=rank, world_size=3, shuffle=True)
        seen.append([i for r in ds for i in r.sequence_ids])
    assert sorted(functools.reduce(operator.iadd, seen, [])) == list(range(101))
    assert [len(s) for s in seen] == [34, 34, 33]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_seq_len": 30, "pad_multiple": 4}, r"max_seq_len=30 is not a multiple of pad_multiple=4.*32 or 28"),
        ({"buffer_size": 0}, "buffer_size must be a positive integer, got 0"),
        ({"algorithm": "best"}, "algorithm='best' is not valid: choose one of 'bfd'"),
        ({"overlong": "cut"}, "overlong='cut' is not valid: choose one of 'split', 'truncate', 'drop', 'error'"),
        ({"max_wait": -1}, "max_wait must be a non-negative integer"),
        ({"min_fill": 1.5}, r"min_fill must be a fraction in \[0, 1\]"),
        ({"rank": 2, "world_size": 2}, "rank=2 must be below world_size=2"),
    ],
)
def test_bad_options_are_refused_with_the_fix(kwargs, message):
    args = {"max_seq_len": 32, "buffer_size": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        PackingDataset(samples_from_lengths([3]), **args)


def test_stats_add_over_workers():
    a = LoaderStats(samples_in=3, rows_out=1, real_tokens=30, slots=64, max_waited=1)
    b = LoaderStats(samples_in=2, rows_out=1, real_tokens=34, slots=64, max_waited=2)
    total = LoaderStats.from_state({"w0": {"stats": a.as_dict()}, "w1": {"stats": b.as_dict()}})
    assert (total.samples_in, total.rows_out, total.fill, total.max_waited) == (5, 2, 0.5, 2)
    with pytest.raises(ValueError, match="no sftpack.loader.PackingDataset state"):
        LoaderStats.from_state({"x": 1})


def test_samples_are_sample_objects_with_any_ids():
    s = [Sample(np.arange(1, 4), np.ones(3, bool), "c0"), Sample(np.arange(5, 7), np.ones(2, bool), None)]
    (row,) = list(PackingDataset(s, max_seq_len=8, buffer_size=2))
    assert row.sequence_ids == ("c0", 1)  # no conversation id: the source index


# ------------------------------------------------------------------ negative ids (issue 16, item 10)
def test_negative_token_ids_and_pad_ids_are_refused_on_intake():
    """As the prepack path refuses ids outside [0, 2**32) at staging, the loader refuses a negative
    id before any row holding it is emitted (it checks each laid row's ids, one pass while they
    are in cache), naming the source index, the conversation and the position in the sample."""
    samples = samples_from_lengths([4, 6, 3])
    bad = Sample(np.array([11, 12, -5, 14]), np.ones(4, bool), "chat.jsonl:7")
    ds = PackingDataset([*samples, bad], max_seq_len=16, buffer_size=8)
    with pytest.raises(
        ValueError,
        match=r"sample 3 \(conversation 'chat.jsonl:7'\) holds token id -5 at position 2: "
        r"token ids must be non-negative",
    ):
        list(ds)
    with pytest.raises(ValueError, match=r"sample 1 \(conversation 1\) holds token id -1 at position 0"):
        list(PackingDataset([[3, 4], [-1, 2]], max_seq_len=8, buffer_size=2))  # bare id lists: index as id
    with pytest.raises(
        ValueError,
        match=r"PackingDataset: pad_id must be a non-negative integer, got -1; padding slots are fed to the "
        r"embedding.*token id >= 0",
    ):
        PackingDataset(samples, max_seq_len=16, buffer_size=8, pad_id=-1)
    assert len(list(PackingDataset(samples, max_seq_len=16, buffer_size=8, pad_id=0))) == 1  # the same, valid


def test_a_negative_id_in_a_later_piece_is_named_at_its_position_in_the_sample():
    """A split sample's pieces are checked on their rows: the position counts from the sample's start,
    and the row that holds it is never emitted (the rows of earlier buffers are)."""
    ids = np.arange(1, 21)
    ids[13] = -7  # piece 1 of 8-token pieces, 6th token of that piece
    bad = Sample(ids, np.ones(20, bool), "long")
    ds = PackingDataset([*samples_from_lengths([8] * 4), bad], max_seq_len=8, buffer_size=4, max_wait=0)
    emitted = []
    with pytest.raises(
        ValueError, match=r"sample 4 \(conversation 'long'\) holds token id -7 at position 13: token ids"
    ):
        for row in ds:
            emitted.append(row)
    assert [r.sequence_ids for r in emitted[:4]] == [(0,), (1,), (2,), (3,)]
    assert all(int(r.input_ids.min()) >= 0 for r in emitted) and ds.stats.rows_out == len(emitted) <= 6


def test_lookahead_takes_and_puts_back_in_order():
    from sftpack.loader._source import Lookahead

    la = Lookahead(iter([(i, f"s{i}") for i in range(6)]))
    assert la.take(2) == [(0, "s0"), (1, "s1")]
    taken = la.take(3)
    assert taken == [(2, "s2"), (3, "s3"), (4, "s4")]
    la.unread(taken[1:])  # (3, 4) go back in front of (5)
    assert la.take(0) == [] and not la.done
    assert la.pop() == (3, "s3") and la.take(9) == [(4, "s4"), (5, "s5")]
    assert la.done and la.take(1) == []
