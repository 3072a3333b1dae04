"""The contract's worked example, built by the loader path's own code.

Two conversations, A (5 tokens) and B (10 tokens), streamed through
:class:`~sftpack.loader.PackingDataset` with ``max_seq_len=36`` and each
sequence padded to a multiple of 4 (context parallelism 2)::

    A A A A A . . . |B B B B B B B B B B . . . . . . . . . . . . . . . . . .
    cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 8, 36]  kernel gets: padded for both

``sftpack map`` draws this row from :func:`worked_example_row`.
"""

from __future__ import annotations

import numpy as np

from ..handoff import PackedBatch
from ..sample import Sample
from ._dataset import PackingDataset

__all__ = ["worked_example_row"]


def worked_example_row(*, max_seq_len: int = 36, pad_multiple: int = 4) -> PackedBatch:
    """The one row :class:`~sftpack.loader.PackingDataset` makes of A (ids 1..5) and B (ids 101..110).

    >>> row = worked_example_row()
    >>> row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist(), row.sequence_ids
    ([0, 5, 15], [0, 8, 36], ('A', 'B'))
    """
    a = Sample(np.arange(1, 6), np.ones(5, dtype=bool), "A")
    b = Sample(np.arange(101, 111), np.ones(10, dtype=bool), "B")
    ds = PackingDataset([a, b], max_seq_len=max_seq_len, buffer_size=2, pad_multiple=pad_multiple)
    rows = list(ds)
    if len(rows) != 1:  # only with a max_seq_len too small for both
        raise ValueError(f"A and B do not share one row of max_seq_len={max_seq_len}: got {len(rows)} rows")
    return rows[0]
