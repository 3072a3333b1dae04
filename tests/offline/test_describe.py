"""``describe`` on its own: the histograms account for every row and sequence, and the
fill it computes from the index files is the manifest's."""

from __future__ import annotations

import numpy as np

from sftpack.offline import PrepackedDataset, describe, prepack_samples
from sftpack.testing import samples_from_lengths


def test_the_histograms_account_for_every_row_and_the_fill_is_the_manifests(built):
    ds = PrepackedDataset(built[1])
    d = describe(ds)
    c = ds.manifest["counts"]
    assert d.fill.shape == d.sequences_per_row.shape == d.padded_fill.shape == (c["rows"],)
    assert sum(n for _, _, n in d.fill_histogram) == c["rows"]
    assert sum(n for _, n in d.per_row_histogram) == c["rows"]
    assert sum(k * n for k, n in d.per_row_histogram) == c["sequences"]
    assert np.isclose(d.fill.mean(), c["fill"])
    assert np.all(d.padded_fill >= d.fill) and np.all(d.padded_fill <= 1.0)


def test_padded_fill_counts_each_sequences_padding(tmp_path):
    # one row of 3 + 5 tokens at pad multiple 4: 8 real of 16 slots, 4 + 8 = 12 once padded
    r = prepack_samples(samples_from_lengths([3, 5]), tmp_path / "p", max_seq_len=16, pad_multiple=4, row_sizes=[2])
    d = describe(PrepackedDataset(r.path))
    assert d.fill.tolist() == [0.5] and d.padded_fill.tolist() == [0.75]
    assert d.per_row_histogram == [(2, 1)]
    assert [n for _, _, n in d.fill_histogram] == [0] * 5 + [1] + [0] * 4  # the [0.5, 0.6) bucket
