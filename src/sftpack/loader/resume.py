"""Exact resume through DataLoader workers: torchdata's ``StatefulDataLoader``, with clear errors.

A plain ``DataLoader`` cannot resume an ``IterableDataset`` exactly with
workers: it restarts the round-robin over workers at worker 0. torchdata's
``StatefulDataLoader`` asks each worker's :class:`~sftpack.loader.PackingDataset`
copy for its ``state_dict()`` after every row and hands each worker its own
state back on restore. Rows of worker ``w`` of ``W`` are interleaved
round-robin, so a state only resumes into the same ``num_workers``;
torchdata reports a mismatch as a bare ``AssertionError`` (or not at all),
:class:`StatefulLoader` as a :class:`~sftpack.loader.StateError` that says
what to do.

>>> from sftpack.testing import samples_from_lengths
>>> from sftpack.loader import PackingDataset
>>> ds = PackingDataset(samples_from_lengths([5, 10, 20, 30]), max_seq_len=36, buffer_size=2, pad_multiple=4)
>>> loader = StatefulLoader(ds, num_workers=0)
>>> it = iter(loader); first = next(it)
>>> state = loader.state_dict()
>>> again = StatefulLoader(PackingDataset(samples_from_lengths([5, 10, 20, 30]), max_seq_len=36,
...                                      buffer_size=2, pad_multiple=4), num_workers=0)
>>> again.load_state_dict(state)
>>> [r.sequence_ids for r in again] == [r.sequence_ids for r in it]
True
>>> StatefulLoader(ds, num_workers=2).load_state_dict(state)
Traceback (most recent call last):
...
sftpack.loader._state.StateError: this loader state was saved with num_workers=0 but the loader has num_workers=2: each worker packs its own share of the samples, so resume with num_workers=0 (or start afresh)
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from ._state import StateError

__all__ = ["StatefulLoader", "saved_num_workers"]


def saved_num_workers(state: dict[str, Any]) -> int:
    """The ``num_workers`` a torchdata ``StatefulDataLoader`` state was saved with."""
    if not isinstance(state, dict):
        raise StateError(f"a StatefulDataLoader state is a dict, got {type(state).__name__}")
    if "_snapshot" in state:
        return int(state["_snapshot"]["_main_snapshot"]["_num_workers"])
    if "_num_yielded" in state:
        return 0
    raise StateError(
        f"not a torchdata StatefulDataLoader state (keys {sorted(state)[:6]}): pass what loader.state_dict() returned"
    )


class StatefulLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` for :class:`~sftpack.loader.PackingDataset` rows.

    Defaults to ``batch_size=None`` (each item is one ``max_seq_len`` row); give
    ``batch_size=B`` and ``collate_fn=PackedBatch.concat`` for ``B`` rows laid end
    to end. ``load_state_dict`` refuses a state saved with another ``num_workers``
    with a :class:`~sftpack.loader.StateError` (torchdata's own check is a bare
    ``AssertionError``).
    """

    def __init__(self, dataset: Any, *, batch_size: int | None = None, num_workers: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = saved_num_workers(state_dict)
        if saved != self.num_workers:
            raise StateError(
                f"this loader state was saved with num_workers={saved} but the loader has "
                f"num_workers={self.num_workers}: each worker packs its own share of the samples, so resume "
                f"with num_workers={saved} (or start afresh)"
            )
        super().load_state_dict(state_dict)
