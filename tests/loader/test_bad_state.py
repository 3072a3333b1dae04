"""A loader state is checked against the data before it is trusted (issue 16, item 10).

Before: a state loaded into a dataset over other data gave an ``IndexError`` (or a misleading
``build_row`` error), a duplicated buffer entry emitted a sample twice, and a negative cursor
silently cut the epoch (``order[-5:]``). Each case now raises a :class:`StateError` that names
the field, its value and the fix; the unedited state still resumes exactly.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from sftpack.loader import PackingDataset, StateError
from sftpack.testing import samples_from_lengths

LENGTHS = np.random.default_rng(3).integers(1, 200, 120).tolist()
SAMPLES = samples_from_lengths(LENGTHS)
KW = {"max_seq_len": 256, "buffer_size": 16, "pad_multiple": 4, "shuffle": True, "seed": 2, "num_epochs": 1}


class Stream:
    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def sig(row) -> tuple:
    return (row.input_ids.numpy().tobytes(), row.cu_seqlens_padded.tolist(), row.sequence_ids)


def saved(source=SAMPLES, kw=KW, k: int = 5) -> tuple[dict, list]:
    """The state after row k (with both a buffer and pending rows) and the rows after it."""
    full = [sig(r) for r in PackingDataset(source, **kw)]
    ds = PackingDataset(source, **kw)
    it = iter(ds)
    for _ in range(k):
        next(it)
    st = json.loads(json.dumps(ds.state_dict()))
    assert st["buffer"] and st["pending"] and st["cursor"] > 0
    return st, full[k:]


def test_the_unedited_state_still_resumes_exactly():
    st, rest = saved()
    again = PackingDataset(SAMPLES, **KW)
    again.load_state_dict(st)
    assert [sig(r) for r in again] == rest


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.update(cursor=-5),
            r"state\['cursor'\] must be a non-negative integer, got -5; the state is damaged",
        ),
        (lambda s: s.update(cursor=10_000), r"state\['cursor'\] = 10000 but share 0 of 1 holds 120 samples in epoch 0"),
        (
            lambda s: s.update(epoch=-1),
            r"state\['epoch'\] must be a non-negative integer, got -1; the state is damaged",
        ),
        (
            lambda s: s.update(cursor="3"),
            r"state\['cursor'\] must be a non-negative integer, got '3'; the state is damaged",
        ),
        (
            lambda s: s["buffer"].append(list(s["buffer"][0])),
            r"state\['buffer'\]\[\d+\] names sample \d+ piece 0, already named by state\['buffer'\]\[0\].*emitted twice",
        ),
        (
            lambda s: s["buffer"].append([*s["pending"][0][0], 0]),
            r"state\['pending'\]\[0\]\[0\] names sample \d+ piece 0, already named by state\['buffer'\]\[\d+\]",
        ),
        (lambda s: s["buffer"][0].__setitem__(2, 9), r"has waited 9 rounds, more than max_wait=2"),
        (lambda s: s["buffer"][0].__setitem__(0, -3), r"state\['buffer'\]\[0\] = \[-3, .*non-negative integers"),
        (lambda s: s["pending"].append([]), r"state\['pending'\]\[\d+\] = \[\]: a pending row is a non-empty list"),
        (lambda s: s.pop("buffer"), r"the PackingDataset state lacks buffer"),
        (
            lambda s: s["buffer"][0].__setitem__(0, 5000),
            r"state\['buffer'\]\[0\] = \[5000, 0, \d\] names sample 5000, which is not among the \d+ samples share 0 of "
            r"1 had read in epoch 0",
        ),
        (lambda s: s.update(end_epoch=s["epoch"] - 1 if s["epoch"] else -1), r"end_epoch"),
        (
            lambda s: s["lengths"].pop(),
            r"state\['lengths'\] must hold one token count \(>= 1\) per buffer and "
            r"pending entry",
        ),
    ],
)
def test_a_damaged_state_is_refused_naming_the_field(edit, message):
    st, _ = saved()
    bad = copy.deepcopy(st)
    edit(bad)
    with pytest.raises(StateError, match=message):
        PackingDataset(SAMPLES, **KW).load_state_dict(bad)


def test_a_state_over_other_data_is_refused_not_an_index_error():
    st, _ = saved()
    # fewer samples (the old failure: IndexError)
    with pytest.raises(
        StateError,
        match=r"saved over a source of 120 samples but this dataset's source holds 40: "
        r"resume with the same samples",
    ):
        PackingDataset(SAMPLES[:40], **KW).load_state_dict(st)
    # as many samples, other lengths: the re-read sequences do not match what was saved
    other = samples_from_lengths(np.random.default_rng(4).integers(1, 200, 120).tolist())
    ds = PackingDataset(other, **KW)
    ds.load_state_dict(st)
    with pytest.raises(
        StateError,
        match=r"sample \d+ piece 0 has \d+ tokens here but had \d+ when the state was "
        r"saved: the state was saved over other data",
    ):
        next(iter(ds))


def test_a_stream_state_over_shorter_data_is_refused():
    kw = KW | {"shuffle": False}
    st, _ = saved(Stream(SAMPLES), kw)
    short = PackingDataset(Stream(SAMPLES[: st["cursor"] - 3]), **kw)
    short.load_state_dict(st)
    with pytest.raises(
        StateError,
        match=rf"the state's cursor is {st['cursor']} but share 0 of 1 holds "
        rf"{st['cursor'] - 3} samples in this stream",
    ):
        next(iter(short))
    # a buffer entry beyond the cursor cannot have been read yet
    bad = copy.deepcopy(st)
    bad["buffer"][0][0] = st["cursor"] + 7
    with pytest.raises(
        StateError,
        match=rf"names sample {st['cursor'] + 7}, which is not among the {st['cursor']} "
        r"samples share 0 of 1 had read",
    ):
        PackingDataset(Stream(SAMPLES), **kw).load_state_dict(bad)


def test_a_piece_beyond_its_sample_and_an_overfull_pending_row_are_refused():
    st, _ = saved()
    bad = copy.deepcopy(st)
    src = bad["buffer"][0][0]
    bad["buffer"][0][1] = 2  # samples here are shorter than a row: one piece each
    ds = PackingDataset(SAMPLES, **KW)
    ds.load_state_dict(bad)
    with pytest.raises(StateError, match=rf"names piece 2 of sample {src}, which has 1 piece\(s\) here"):
        next(iter(ds))
    # move every buffered sequence into the first pending row: it no longer fits max_seq_len
    bad = copy.deepcopy(st)
    nb, n0 = len(bad["buffer"]), len(bad["pending"][0])
    for key in ("lengths", "digests"):  # one per buffer entry, then one per pending entry: keep them aligned
        v = bad[key]
        bad[key] = v[nb : nb + n0] + v[:nb] + v[nb + n0 :]
    bad["pending"][0] += [e[:2] for e in bad["buffer"]]
    bad["buffer"] = []
    ds = PackingDataset(SAMPLES, **KW)
    ds.load_state_dict(bad)
    with pytest.raises(
        StateError,
        match=r"state\['pending'\]\[0\] holds \d+ sequences of \d+ padded slots, more than "
        r"max_seq_len=256",
    ):
        next(iter(ds))
