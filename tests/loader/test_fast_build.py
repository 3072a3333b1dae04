"""The loader's fast row path (issue 18, item 6) emits the very rows, stats and states it emitted before.

``PackingDataset`` lays each row from its samples' own arrays (``build_parts``:
one ``np.concatenate`` per array, no second pass over the samples), reads a
buffer's worth of samples at a time (a ``Sample`` that fits is buffered inline),
checks the ids once on the laid row instead of when each sample is read, and
plans a round with fewer array passes. Here the loader runs twice over the same
random sources, once as it is and once with the previous read, round, build and
planning steps put back (the ``_previous_*`` functions below: the code as it was
before issue 18's loader work, the round and planner as they were before this
change); every row (every array and dtype, ``max_seqlen``, ``sequence_ids``), the
stats and the state after every row must be equal, over the over-long policies,
pad multiples, buffer sizes, waiting and shuffling. The previous builder's layout
is pinned against the new one in ``tests/handoff/test_row_fast_path.py``; here
the previous rows are laid by that reference.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sftpack.loader._dataset as dataset_mod
from sftpack import PackedBatch, Sample
from sftpack.binpack import Bins, pack
from sftpack.handoff import padded_lengths
from sftpack.loader import PackingDataset
from sftpack.loader._hold import hold_back
from sftpack.loader._source import Item, Lookahead
from sftpack.sample import Overlong, as_sample, overlong_spans

from ..handoff.test_row_fast_path import _previous_lay_row, assert_same_batch


def _previous_cut_overlong(index: int, obj: Any, max_seq_len: int, overlong: Overlong) -> tuple[list[Item], int]:
    s = obj if isinstance(obj, Sample) else as_sample(obj, index)
    sid = s.conversation_id if s.conversation_id is not None else index
    n = s.input_ids.shape[0]
    if n and int(s.input_ids.min()) < 0:
        raise ValueError(f"sample {index} holds a negative id")
    spans = overlong_spans(n, max_seq_len, overlong, f"sample {index} (conversation {sid!r})", sid)
    items = [Item((index, k), s.input_ids[a:b], s.loss_mask[a:b], sid, b - a) for k, (a, b) in enumerate(spans)]
    return items, n - sum(b - a for a, b in spans)


def _previous_fill(self: PackingDataset, stream: Lookahead) -> None:
    while len(self._buffer) < self.buffer_size and not stream.done:
        self._read(*stream.pop())


def _previous_read(self: PackingDataset, index: int, obj: Any) -> None:
    items, lost = _previous_cut_overlong(index, obj, self.max_seq_len, self.overlong)
    s = self._stats
    s.samples_in += 1
    self._cursor += 1
    self._last = (index, items)  # the last sample read, which a state records (state version 2)
    if len(items) > 1:
        s.split += 1
        s.extra_pieces += len(items) - 1
    elif items and lost:
        s.truncated += 1
        s.tokens_truncated += lost
    elif not items:
        s.dropped += 1
        s.tokens_dropped += lost
    self._buffer.extend(items)
    self._ages.extend([0] * len(items))


def _previous_pack_rows(lengths, *, max_seq_len, pad_multiple=1, algorithm="bfd", seed=0) -> Bins:
    bins = pack(padded_lengths(lengths, pad_multiple), max_seq_len, algorithm, seed=seed)
    if len(bins) == 0:
        return bins
    row_of = np.repeat(np.arange(len(bins), dtype=np.int64), bins.sizes)
    order = bins.order[np.lexsort((bins.order, row_of))]
    return Bins(order, bins.offsets)


def _previous_round(self: PackingDataset, *, flush: bool) -> None:
    buf = self._buffer
    lengths = np.fromiter((it.length for it in buf), dtype=np.int64, count=len(buf))
    costs = padded_lengths(lengths, self.pad_multiple)
    bins = _previous_pack_rows(
        lengths, max_seq_len=self.max_seq_len, pad_multiple=self.pad_multiple, algorithm=self.algorithm, seed=self.seed
    )
    order, offsets = bins.order, bins.offsets
    ages = np.asarray(self._ages, dtype=np.int64)
    n_rows = offsets.shape[0] - 1
    held = np.zeros(n_rows, dtype=bool)
    if not flush:
        held = hold_back(
            bins,
            costs,
            ages,
            max_seq_len=self.max_seq_len,
            min_fill=self.min_fill,
            max_wait=self.max_wait,
            max_items=self.buffer_size // 2,
        )
    row_of = np.repeat(np.arange(n_rows), np.diff(offsets))
    waits = held[row_of]
    keep = np.sort(order[waits])
    bounds = offsets.tolist()
    order_l = order.tolist()
    for i in np.flatnonzero(~held).tolist():
        self._pending.append([buf[j] for j in order_l[bounds[i] : bounds[i + 1]]])
    if (~waits).any():
        self._stats.max_waited = max(self._stats.max_waited, int(ages[order[~waits]].max()))
    self._buffer = [buf[i] for i in keep.tolist()]
    self._ages = (ages[keep] + 1).tolist()
    self._stats.rounds += 1
    self._stats.held_rows += int(held.sum())


def _previous_build(self: PackingDataset, row: list[Item]) -> PackedBatch:
    ids = np.concatenate([it.input_ids for it in row])
    mask = np.concatenate([it.loss_mask for it in row])
    lengths = np.fromiter((it.length for it in row), dtype=np.int64, count=len(row))
    laid = _previous_lay_row(
        ids, mask, lengths, max_seq_len=self.max_seq_len, pad_multiple=self.pad_multiple, pad_id=self.pad_id
    )
    return PackedBatch.from_row(laid, sequence_ids=[it.sequence_id for it in row])


def _previous(mp: pytest.MonkeyPatch) -> None:
    """Put the previous loader steps back (inside a monkeypatch context)."""
    mp.setattr(dataset_mod.PackingDataset, "_fill", _previous_fill)
    mp.setattr(dataset_mod.PackingDataset, "_read", _previous_read)
    mp.setattr(dataset_mod.PackingDataset, "_round", _previous_round)
    mp.setattr(dataset_mod.PackingDataset, "_build", _previous_build)


def _run(samples: Any, kw: dict[str, Any]) -> tuple[list[PackedBatch], list[dict], dict]:
    ds = PackingDataset(samples, **kw)
    rows, states = [], []
    for row in ds:
        rows.append(row)
        states.append(copy.deepcopy(ds.state_dict()))
    return rows, states, ds.stats.as_dict()


def _compare(samples: Any, kw: dict[str, Any]) -> None:
    new = _run(samples, kw)
    with pytest.MonkeyPatch.context() as mp:
        _previous(mp)
        old = _run(samples, kw)
    assert len(new[0]) == len(old[0]) > 0
    for a, b in zip(new[0], old[0]):
        assert_same_batch(a, b)
    assert json.dumps(new[1]) == json.dumps(old[1])  # the state after every row
    assert new[2] == old[2]  # the stats


@st.composite
def loader_cases(draw):
    m = draw(st.sampled_from([1, 2, 4, 8]))
    width = m * draw(st.integers(2, 24))
    n = draw(st.integers(1, 60))
    lengths = draw(st.lists(st.integers(1, 2 * width + 3), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**32 - 1))
    kw = {
        "max_seq_len": width,
        "pad_multiple": m,
        "buffer_size": draw(st.integers(1, 40)),
        "overlong": draw(st.sampled_from(["split", "truncate", "drop"])),
        "max_wait": draw(st.integers(0, 3)),
        "min_fill": draw(st.sampled_from([0.5, 0.99, 1.0])),
        "shuffle": draw(st.booleans()),
        "seed": seed % 1000,
        "num_epochs": draw(st.integers(1, 2)),
        "pad_id": draw(st.sampled_from([0, 3, 50_000])),
    }
    return lengths, seed, kw


def _samples(lengths: list[int], seed: int, kind: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    out: list[Any] = []
    for i, k in enumerate(lengths):
        ids, mask = rng.integers(0, 60_000, k), rng.random(k) < 0.7
        if kind == 0:
            out.append(Sample(ids, mask, f"c{i}"))
        elif kind == 1:
            out.append({"input_ids": ids.tolist(), "loss_mask": mask.tolist()})  # dicts: source index as the id
        else:
            out.append(ids.astype(np.int32))  # bare ids: every token trained on
    return out


@settings(max_examples=60, deadline=None)
@given(loader_cases(), st.integers(0, 2))
def test_loader_rows_stats_and_states_are_the_previous_ones(case, kind):
    lengths, seed, kw = case
    if kw["overlong"] == "drop" and all(k > kw["max_seq_len"] for k in lengths):
        lengths = [*lengths, 1]  # a share that emits no row is refused (tested elsewhere)
    _compare(_samples(lengths, seed, kind), kw)


def test_the_bench_loader_setting_is_the_previous_one():
    """The benchmark's setting (4,096 slots, buffer 256, ~5 samples a row), on a smaller set."""
    rng = np.random.default_rng(18)
    lengths = np.minimum(rng.lognormal(6.3, 0.9, 700).astype(int) + 1, 4096).tolist()
    _compare(_samples(lengths, 1, 0), {"max_seq_len": 4096, "buffer_size": 256})
    _compare(_samples(lengths, 2, 0), {"max_seq_len": 4096, "buffer_size": 64, "pad_multiple": 8})


def test_a_resumed_loader_continues_with_the_previous_rows(monkeypatch):
    """A state taken mid-epoch by the new loader resumes to the rows the previous loader emits."""
    samples = _samples(np.random.default_rng(5).integers(1, 300, 200).tolist(), 5, 0)
    kw = {"max_seq_len": 256, "buffer_size": 32, "pad_multiple": 4}
    ds = PackingDataset(samples, **kw)
    it = iter(ds)
    for _ in range(7):
        next(it)
    state = copy.deepcopy(ds.state_dict())
    fresh = PackingDataset(samples, **kw)
    fresh.load_state_dict(state)
    resumed = list(fresh)
    with monkeypatch.context() as mp:
        _previous(mp)
        old = list(PackingDataset(samples, **kw))[7:]
    assert len(resumed) == len(old) > 0
    for a, b in zip(resumed, old):
        assert_same_batch(a, b)
