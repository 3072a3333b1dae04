"""Samples to a right-padded ``[B, S]`` batch: what a loader without packing hands
the step, and the input of :func:`sftpack.trainer.pack_step` (which packs it back
at the step). The padded baseline of ``sftpack train --packing none`` uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..sample import Sample

__all__ = ["padded_batch"]


def padded_batch(
    samples: Sequence[Sample], seq_len: int | None = None, *, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A right-padded batch of samples: ``input_ids`` ``(B, S)`` int64, ``lengths``
    ``(B,)`` int64 and ``loss_mask`` ``(B, S)`` bool, row ``i`` holding sample ``i``.
    ``S`` defaults to the longest sample.

    >>> from sftpack.testing import samples_from_lengths
    >>> ids, lengths, mask = padded_batch(samples_from_lengths([2, 3]), pad_id=-1)
    >>> ids.tolist(), lengths.tolist()
    ([[1000, 1001, -1], [2000, 2001, 2002]], [2, 3])
    """
    if not samples:
        raise ValueError("padded_batch needs at least one sample, got none")
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    S = int(lengths.max()) if seq_len is None else int(seq_len)
    if int(lengths.max()) > S:
        i = int(np.argmax(lengths))
        raise ValueError(f"padded_batch: sample {i} has {int(lengths[i])} tokens, more than seq_len={S}")
    ids = torch.full((len(samples), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), S), dtype=torch.bool)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.from_numpy(s.input_ids)
        mask[i, : len(s)] = torch.from_numpy(s.loss_mask)
    return ids, torch.from_numpy(lengths), mask
