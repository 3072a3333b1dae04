"""``PackingDataset.decided_rows()``: the rows ``iter()`` yields, decided but not laid (issue 41).

Ranks that share one global stream (``sftpack train --packing loader``) run the packer's
decisions on every rank and lay only their own rows, so the decisions alone must be exactly
``iter()``'s: the same rows (``build()`` lays the very bytes), the same counts, the same state
after every row, a state of either resuming the other, with or without media, across epochs and
with over-long samples split.
"""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest

from sftpack.loader import DecidedRow, PackingDataset
from sftpack.testing import samples_from_lengths
from tests.helpers import assert_same_batch

LENGTHS = np.random.default_rng(7).integers(3, 90, size=60).tolist() + [150]  # some over-long: split
KW = dict(max_seq_len=64, buffer_size=12, pad_multiple=4, shuffle=True, seed=3, num_epochs=None, rank=0, world_size=1)
ROWS = 80  # past the first epoch's end (53 rows)


def _ds(**kw):
    return PackingDataset(samples_from_lengths(LENGTHS), **{**KW, **kw})


def test_decided_rows_are_iters_rows_with_the_same_states():
    laid, decided = _ds(), _ds()
    it, dec = iter(laid), decided.decided_rows()
    epochs = set()
    for _ in range(ROWS):
        row, plan = next(it), next(dec)
        assert isinstance(plan, DecidedRow)
        assert plan.sequence_ids == row.sequence_ids
        assert plan.lengths.tolist() == np.diff(row.cu_seqlens.numpy()).tolist()
        assert plan.num_patches == 0
        assert_same_batch(plan.build(), row)
        assert decided.state_dict() == laid.state_dict()
        epochs.add(decided.epoch)
    assert epochs == {0, 1}  # an epoch boundary was crossed
    assert decided.stats.as_dict() == laid.stats.as_dict() and decided.stats.split >= 1


@pytest.mark.parametrize("saved_by", ["iter", "decided_rows"])
def test_a_state_of_either_resumes_the_other(saved_by):
    src = _ds()
    rows = src.decided_rows() if saved_by == "decided_rows" else iter(src)
    for _ in range(17):
        next(rows)
    state = json.loads(json.dumps(src.state_dict()))  # plain data
    expected = [r.sequence_ids for r in islice(rows, 20)]
    other = _ds()
    other.load_state_dict(state)
    again = other.decided_rows() if saved_by == "iter" else iter(other)
    assert [r.sequence_ids for r in islice(again, 20)] == expected
