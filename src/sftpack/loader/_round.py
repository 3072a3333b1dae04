"""One round of the loader's bin filling: a full buffer planned into rows, some of them held back.

:func:`plan_round` packs the buffer with the one row planner
(:func:`sftpack.handoff.pack_rows`: every sequence costed at the padded length the row
builder lays, under the optional patch budget when the buffer holds media) and lets the
under-filled rows wait a round (:func:`~sftpack.loader._hold.hold_back`), unless the buffer
is flushed (the end of a share) or waiting is off (``max_wait=0``). It changes nothing: the
:class:`Round` it returns says which rows are decided and what stays in the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..handoff import pack_rows, padded_lengths
from ._hold import hold_back
from ._settings import LoaderSettings
from ._source import Item

__all__ = ["Round", "plan_round"]


class Round(NamedTuple):
    """A planned buffer: the ``decided`` rows (in plan order), the ``buffer`` items that wait
    (in buffer order) and their ``ages`` (one round older), the ``held_rows`` that wait, and
    the most rounds a decided item had ``waited``."""

    decided: list[list[Item]]
    buffer: list[Item]
    ages: list[int]
    held_rows: int
    waited: int


def plan_round(buffer: Sequence[Item], ages: Sequence[int], settings: LoaderSettings, *, flush: bool) -> Round:
    """Plan ``buffer`` (its items ``ages`` rounds old) into rows; with ``flush`` every row is decided.

    Sequences of 36, 20, 12 and 3 tokens in rows of 36: the full row is decided, the
    under-filled one (35 of 36 slots) waits a round unless the buffer is flushed.

    >>> from sftpack.loader._settings import LoaderSettings
    >>> from sftpack.loader._source import cut_overlong
    >>> s = LoaderSettings.check(max_seq_len=36, buffer_size=8, pad_multiple=1, algorithm="bfd",
    ...     pad_between_seqs=False, overlong="split", seed=0, shuffle=False, max_wait=2, min_fill=0.99,
    ...     num_epochs=1, rank=0, world_size=1, pad_id=0, max_patches_per_row=None, on_bad_row="error")
    >>> buf = [cut_overlong(i, [1] * n, 36, s.overlong)[0][0] for i, n in enumerate([36, 20, 12, 3])]
    >>> r = plan_round(buf, [0, 0, 0, 0], s, flush=False)
    >>> [[it.ref[0] for it in row] for row in r.decided], [it.ref[0] for it in r.buffer], r.ages, r.held_rows
    ([[0]], [1, 2, 3], [1, 1, 1], 1)
    >>> [[it.ref[0] for it in row] for row in plan_round(buf, [0, 0, 0, 0], s, flush=True).decided]
    [[0], [1, 2, 3]]
    """
    s = settings
    lengths = np.fromiter((it.length for it in buffer), dtype=np.int64, count=len(buffer))
    cap = s.max_patches_per_row
    patches = None
    if cap is not None and any(it.media is not None for it in buffer):  # the second budget
        patches = np.fromiter((it.patches for it in buffer), dtype=np.int64, count=len(buffer))
    groups = None
    if s.groups:  # each group one unit of the planner (a sequence of no group, a unit of its own)
        numbered: dict[object, int] = {}
        groups = np.fromiter(
            (
                numbered.setdefault(("group", it.group) if it.group is not None else ("item", j), len(numbered))
                for j, it in enumerate(buffer)
            ),
            dtype=np.int64,
            count=len(buffer),
        )
    bins = pack_rows(
        lengths,
        max_seq_len=s.max_seq_len,
        pad_multiple=s.pad_multiple,
        algorithm=s.algorithm,
        seed=s.seed,
        patches=patches,
        max_patches_per_row=None if patches is None else cap,
        groups=groups,
    )
    order, offsets = bins.order, bins.offsets
    bounds = offsets.tolist()
    planned = [buffer[j] for j in order.tolist()]  # the buffer in row order
    held = None
    if not flush and s.max_wait > 0:
        held = hold_back(
            bins,
            padded_lengths(lengths, s.pad_multiple),
            np.asarray(ages, dtype=np.int64),
            max_seq_len=s.max_seq_len,
            min_fill=s.min_fill,
            max_wait=s.max_wait,
            max_items=s.buffer_size // 2,
            patches=patches,
            max_patches=cap,
        )
    if held is None or not held.any():  # every row decided (the last rounds, max_wait=0, full rows)
        decided = [planned[bounds[i] : bounds[i + 1]] for i in range(offsets.shape[0] - 1)]
        return Round(decided, [], [], 0, max(ages) if ages else 0)
    age = np.asarray(ages, dtype=np.int64)
    waits = np.repeat(held, np.diff(offsets))  # per planned position: does its row wait?
    decided = [planned[bounds[i] : bounds[i + 1]] for i in np.flatnonzero(~held).tolist()]
    waited = 0 if waits.all() else int(age[order[~waits]].max())
    keep = np.sort(order[waits])
    return Round(decided, [buffer[i] for i in keep.tolist()], (age[keep] + 1).tolist(), int(held.sum()), waited)
