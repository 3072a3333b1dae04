"""Helpers shared by the tests of several packages."""

from __future__ import annotations

import torch

from sftpack import PackedBatch, Sample
from sftpack.trainer import padded_batch as _padded_batch

# A pad id no sample uses (samples_from_lengths ids are >= 1000; pad ids must be >= 0),
# so padding is visible in every assertion.
PAD = 999


def padded_batch(samples: list[Sample], S: int | None = None, pad_id: int = PAD):
    """Right-padded ``(input_ids, lengths, loss_mask)`` of the samples, row i = sample i."""
    return _padded_batch(samples, S, pad_id=pad_id)


def assert_same_batch(a: PackedBatch, b: PackedBatch) -> None:
    """Every per-slot field and boundary equal, dtypes included."""
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
        assert torch.equal(x, y), (name, x.tolist(), y.tolist())
    assert a.max_seqlen == b.max_seqlen
