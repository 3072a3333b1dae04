"""The loader's data-parallel shares: this process's rank, and why a share is refused.

A share that yields no row is refused, never looped over: endless (``num_epochs=None``)
it would read its empty share forever without yielding, and with one epoch the ranks
would disagree on the row count (a DDP step waits forever for the rank that has none).
Equal row counts would need every share's rows, which a streaming packer only knows at
the end of the epoch. These functions word the refusal: which share, what it read, and
the fix.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dist_rank_world", "no_row", "share_name", "too_few"]

_WHY = (
    "a share with no row would never yield with num_epochs=None, and with a fixed number of epochs the "
    "ranks would disagree on the row count (a DDP step waits forever)"
)


def dist_rank_world() -> tuple[int, int]:
    """This process's data-parallel rank and world size (``torch.distributed``'s, else 0 and 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def share_name(rank: int, world_size: int, shard: int, nw: int, in_worker: bool) -> str:
    return (
        f"PackingDataset (rank {rank} of world_size={world_size}, worker {shard - rank * nw} "
        f"of num_workers={nw if in_worker else 0})"
    )


def too_few(who: str, shards: int, nw: int, world_size: int, n: int) -> str:
    """A map-style source with fewer samples than shares."""
    if n == 0:
        return f"{who}: the source holds no sample: give it at least one"
    fix = f"num_workers <= {n // world_size}" if n >= world_size else f"at most {n} ranks"
    return (
        f"{who}: the source holds {n} samples but they are dealt to {shards} shares "
        f"(world_size={world_size} x {nw} worker(s) per rank), so {shards - n} share(s) get none; "
        f"{_WHY}: use {fix}, or more samples"
    )


def no_row(who: str, epoch: int, shard: int, shards: int, read: int, dropped: int, stats: Any, max_seq_len: int) -> str:
    """A share whose epoch emitted no row (``stats``: its :class:`LoaderStats`)."""
    head = f"{who}: epoch {epoch} of share {shard} of {shards} emitted no row"
    if read and dropped == read and stats.reasons:
        return (
            f"{head}: all {read} of its samples were dropped (by reason: {stats.dropped_by}); "
            f"{_WHY}: fix the data (see the reasons), or use fewer ranks x workers"
        )
    if read and dropped == read:
        return (
            f"{head}: all {read} of its samples are longer than max_seq_len={max_seq_len} and were "
            f"dropped (overlong='drop'); {_WHY}: raise max_seq_len, or pass overlong='split' or 'truncate'"
        )
    if read == 0:
        return (
            f"{head}: it read no sample (the source is empty, or holds fewer samples than the {shards} shares "
            f"of world_size x num_workers); {_WHY}: use fewer ranks x workers, or more samples"
        )
    return f"{head}: it read {read} samples, {dropped} dropped; {_WHY}"
