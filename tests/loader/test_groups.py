"""The loader with groups (issue 42): a preference pair is one unit, its two samples in one row;
per-token weights ride into ``PackedBatch.weights``; decisions and resume stay exact.

Every check compares exactly (integers, and weights copied, never computed: ``torch.equal``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sftpack import PackedBatch, Sample
from sftpack.loader import PackingDataset, StateError
from sftpack.objectives import pairs_of
from sftpack.sample import Overlong, OverlongError, overlong_spans, pair_meta, pair_sequence_id


def pairs(n: int, *, seed: int = 0, weighted: bool = True, long: int = 0) -> list[Sample]:
    """``n`` pairs (chosen then rejected, one shared prompt), some answers weighted per token, some
    not; pair ``long`` (when ``long``) made longer than any row."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        prompt = rng.integers(1, 90, int(rng.integers(2, 9)))
        for k, role in enumerate(("chosen", "rejected")):
            size = 60 if (long and g == long) else int(rng.integers(2, 12))
            ids = np.concatenate([prompt, rng.integers(1, 90, size)])
            mask = np.r_[np.zeros(len(prompt), bool), np.ones(size, bool)]
            w = rng.uniform(-2, 2, len(ids)) if weighted and g % 3 and (g % 3 == 2 or k == 0) else None
            out.append(Sample(ids, mask, f"p{g}", {"group": f"p{g}", "role": role, "group_size": 2}, weights=w))
    return out


def by_id(samples: list[Sample]) -> dict:
    return {pair_sequence_id(s): s for s in samples}


def check_row(row: PackedBatch, samples: dict, max_seq_len: int, pad_multiple: int) -> None:
    """``row`` holds whole pairs (``pairs_of`` reads them) and is exactly the row of its samples
    laid by ``PackedBatch.from_samples`` (ids, labels, positions, boundaries and weights)."""
    pairs_of(row, pair_meta(row.sequence_ids))
    mine = [samples[sid] for sid in row.sequence_ids]
    want = PackedBatch.from_samples(mine, pad_multiple=pad_multiple, max_seq_len=max_seq_len)
    for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        assert torch.equal(getattr(row, f), getattr(want, f)), f
    if want.weights is None:
        assert row.weights is None
    else:
        assert row.weights is not None and row.weights.dtype == want.weights.dtype
        assert torch.equal(row.weights, want.weights)


def make(samples, **kw) -> PackingDataset:
    opts = {"max_seq_len": 48, "buffer_size": 6, "pad_multiple": 4, "shuffle": True, "groups": True, "seed": 3}
    return PackingDataset(samples, **{**opts, **kw})


@pytest.mark.parametrize(("buffer_size", "max_wait"), [(6, 2), (16, 0), (5, 1)])
def test_each_pair_shares_a_row_and_weights_read_back_exactly(buffer_size, max_wait) -> None:
    data = pairs(30)
    ids = by_id(data)
    ds = make(data, buffer_size=buffer_size, max_wait=max_wait, num_epochs=2)
    rows = list(ds)
    seen = [sid for r in rows for sid in r.sequence_ids]
    assert sorted(seen) == sorted(list(ids) * 2)  # every member once per epoch, pair ids in the rows
    assert any(len(r.sequence_ids) > 2 for r in rows)  # rows hold several pairs
    assert any(r.weights is not None for r in rows)
    for r in rows:
        check_row(r, ids, 48, 4)
    assert ds.stats.held_rows > 0 or max_wait == 0


def test_a_row_with_half_a_pair_fails_the_check() -> None:
    """Negative control: the row check above refuses a row holding one member of a pair."""
    data = pairs(2)
    half = PackedBatch.from_samples(data[:3], max_seq_len=48)
    half.sequence_ids = tuple(pair_sequence_id(s) for s in data[:3])
    with pytest.raises(ValueError, match="rejected"):
        check_row(half, by_id(data), 48, 1)


def test_decided_rows_agree_with_iter_for_pairs() -> None:
    data = pairs(25)
    a, b = make(data, num_epochs=2), make(data, num_epochs=2)
    rows = list(a)
    decided = []
    for d in b.decided_rows():
        decided.append(d)
    assert [d.sequence_ids for d in decided] == [r.sequence_ids for r in rows]
    assert [d.weighted for d in decided] == [r.weights is not None for r in rows]
    for d, r in zip(decided, rows):
        got = d.build()
        assert torch.equal(got.input_ids, r.input_ids) and torch.equal(got.labels, r.labels)
        assert (got.weights is None) == (r.weights is None)
        if got.weights is not None:
            assert torch.equal(got.weights, r.weights)
    assert a.state_dict() == b.state_dict()


def test_resume_mid_stream_with_pairs_is_exact() -> None:
    data = pairs(24)
    full = make(data, num_epochs=2)
    states, rows = [], []
    for r in full:
        rows.append(r)
        states.append(full.state_dict())
    assert states[0]["config"]["groups"] is True
    assert any(s["buffer"] for s in states) and any(s["pending"] for s in states)
    for k in range(0, len(rows) - 1, 3):
        again = make(data, num_epochs=2)
        again.load_state_dict(states[k])
        rest = list(again)
        assert [r.sequence_ids for r in rest] == [r.sequence_ids for r in rows[k + 1 :]]
        for x, y in zip(rest, rows[k + 1 :]):
            assert torch.equal(x.input_ids, y.input_ids)
            assert (x.weights is None and y.weights is None) or torch.equal(x.weights, y.weights)
        assert again.state_dict() == full.state_dict()
    # the state fingerprints the weights: other weights are other data
    other = [Sample(s.input_ids, s.loss_mask, s.conversation_id, s.meta, weights=1.5) for s in data]
    mid = next(i for i, s in enumerate(states) if s["buffer"])
    moved = make(other, num_epochs=2)
    moved.load_state_dict(states[mid])
    with pytest.raises(StateError, match="other tokens or another id"):
        next(iter(moved))


def test_an_overlong_pair_is_dropped_whole_or_refused() -> None:
    data = pairs(8, long=3)  # pair 3: each answer 60 tokens, over a row of 48
    ds = make(data, overlong="drop")
    rows = list(ds)
    assert {g for r in rows for g, _ in r.sequence_ids} == {f"p{g}" for g in range(8) if g != 3}
    assert ds.stats.dropped == 2 and ds.stats.tokens_dropped == len(data[6]) + len(data[7])
    # members that fit a row each but not one row together
    fit = pairs(8)
    fit[6] = Sample(np.arange(1, 31), np.ones(30, bool), "p3", fit[6].meta)
    fit[7] = Sample(np.arange(1, 25), np.ones(24, bool), "p3", fit[7].meta)
    ds = make(fit, overlong="drop")
    assert sum(len(r.sequence_ids) for r in ds) == 14 and ds.stats.dropped == 2
    for overlong in ("split", "truncate", "error"):
        with pytest.raises(OverlongError, match=r"group 'p3' .* never split or truncated"):
            list(make(fit, overlong=overlong))


def test_pairs_need_groups_and_whole_pairs() -> None:
    data = pairs(4)
    with pytest.raises(ValueError, match=r"sample 0 \(conversation 'p0'\) is the chosen answer .* groups=True"):
        list(make(data, groups=False, shuffle=False))
    with pytest.raises(ValueError, match=r"group 'p1' \(sample 2\) has 1 member\(s\) .*group_size'\] = 2"):
        list(make(data[:3] + data[4:], shuffle=False))


def test_shares_deal_whole_pairs() -> None:
    data = pairs(20)
    ids = by_id(data)
    seen = []
    for rank in (0, 1):
        ds = make(data, rank=rank, world_size=2)
        for r in ds:
            check_row(r, ids, 48, 4)
            seen += r.sequence_ids
    assert sorted(seen) == sorted(ids)
    with pytest.raises(ValueError, match="groups=True deals whole groups to the 2 shares"):
        list(make(iter_of(data), shuffle=False, rank=0, world_size=2))
    one = list(make(iter_of(data), shuffle=False))  # an iterable in one share: read in order
    assert sorted(s for r in one for s in r.sequence_ids) == sorted(ids)


class iter_of:
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def test_sft_weights_ride_through_split_pieces() -> None:
    rng = np.random.default_rng(1)
    data = []
    for i in range(20):
        n = int(rng.integers(3, 70))
        w = None if i % 4 == 0 else (2.5 if i % 4 == 1 else rng.uniform(-1, 1, n))
        data.append(Sample(rng.integers(1, 90, n), rng.random(n) < 0.7, f"c{i}", weights=w))
    pieces = {}
    for s in data:
        for a, b in overlong_spans(len(s), 32, Overlong.SPLIT, "s", s.conversation_id):
            w = None if s.weights is None else s.weights[a:b]
            pieces[(s.conversation_id, s.input_ids[a:b].tobytes())] = Sample(
                s.input_ids[a:b], s.loss_mask[a:b], s.conversation_id, weights=w
            )
    ds = PackingDataset(data, max_seq_len=32, buffer_size=8, pad_multiple=2)
    rows = list(ds)
    assert ds.stats.split > 0
    for r in rows:
        starts, lens = r.cu_seqlens_padded.tolist(), r.cu_seqlens.diff().tolist()
        mine = [
            pieces[(sid, r.input_ids[a : a + n].numpy().tobytes())] for sid, a, n in zip(r.sequence_ids, starts, lens)
        ]
        want = PackedBatch.from_samples(mine, pad_multiple=2, max_seq_len=32)
        assert torch.equal(r.labels, want.labels)
        assert (r.weights is None) == (want.weights is None)
        if want.weights is not None:
            assert torch.equal(r.weights, want.weights)
