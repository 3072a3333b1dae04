"""Rows under a token budget and a vision-patch budget."""

from __future__ import annotations

import numpy as np
import pytest

from sftpack import PackedBatch
from sftpack.binpack import pack
from sftpack.multimodal import plan_rows


def _check(rows, lengths, patches, max_seq_len, max_patches, m):
    idx = np.concatenate(rows)
    assert sorted(idx.tolist()) == list(range(len(lengths)))  # every sample exactly once
    for r in rows:
        assert r.tolist() == sorted(r.tolist())  # input order within a row
        assert int((-(-lengths[r] // m) * m).sum()) <= max_seq_len
        if max_patches is not None:
            assert int(patches[r].sum()) <= max_patches


@pytest.mark.parametrize("m", [1, 4])
def test_both_budgets_hold_and_the_token_budget_alone_matches_binpack_ffd(m):
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 600, size=300)
    patches = rng.integers(16, 1025, size=300)
    free = plan_rows(lengths, patches, max_seq_len=2048, pad_multiple=m)
    _check(free, lengths, patches, 2048, None, m)
    assert len(free) == len(pack(lengths, 2048, "ffd", cost_multiple=m))
    capped = plan_rows(lengths, patches, max_seq_len=2048, max_patches_per_row=2048, pad_multiple=m)
    _check(capped, lengths, patches, 2048, 2048, m)
    assert len(capped) > len(free)  # the patch budget binds here
    assert max(int(patches[r].sum()) for r in free) > 2048


def test_a_sample_over_a_budget_is_named():
    with pytest.raises(ValueError, match="sample 1 costs 12 tokens"):
        plan_rows([3, 10], [1, 1], max_seq_len=10, pad_multiple=4)
    with pytest.raises(ValueError, match="sample 0 has 50 patches"):
        plan_rows([3, 4], [50, 1], max_seq_len=10, max_patches_per_row=40)


def test_planned_rows_build(vqa_samples):
    lengths = [len(s) for s in vqa_samples]
    patches = [s.num_patches for s in vqa_samples]
    rows = plan_rows(lengths, patches, max_seq_len=256, max_patches_per_row=200, pad_multiple=4)
    for r in rows:
        b = PackedBatch.from_samples([vqa_samples[i] for i in r], pad_multiple=4, row_width=256, pad_id=151643)
        assert b.validate().media.pixel_values.shape[0] <= 200
