"""A loader's saved position: plain ints and lists, checked before it is trusted.

One (rank, worker)'s state, as :meth:`PackingDataset.state_dict` writes it::

    {"version": 1, "config": {max_seq_len, buffer_size, ...},   # the arguments it was built with
     "rank": 0, "world_size": 2, "num_workers": 2, "shard": 1, "num_shards": 4,
     "epoch": 3, "end_epoch": 4, "active": True, "cursor": 812,  # position in this share's epoch order
     "buffer": [[source index, piece, rounds waited], ...],      # samples read, not yet in a row
     "pending": [[[source index, piece], ...], ...],             # rows decided, not yet emitted
     "stats": {...}}                                              # LoaderStats counts

No token is stored: a restore re-reads the named samples (O(buffer) reads on
a map-style source) and replays the pending rows exactly as decided. A state
is only loaded into the dataset it came from: same arguments, same rank and
world size, same ``num_workers``; anything else is a :class:`StateError` that
names the field, both values and the fix (never a bare ``AssertionError``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["STATE_VERSION", "StateError", "check_loadable", "check_share", "refs_needed", "restore_items"]

STATE_VERSION = 1


class StateError(ValueError):
    """A saved loader state does not fit this loader (the message says which field and the fix)."""


def check_loadable(state: Any, config: dict[str, Any], rank: int, world_size: int) -> None:
    """Raise :class:`StateError` unless ``state`` came from a dataset with ``config`` on this rank."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        keys = sorted(state)[:8] if isinstance(state, dict) else "-"
        raise StateError(
            f"not a PackingDataset state (version {STATE_VERSION}): got {type(state).__name__} with keys {keys}"
        )
    diff = {k: (v, config.get(k)) for k, v in state["config"].items() if config.get(k) != v}
    if diff:
        what = ", ".join(f"{k}: saved {a!r}, here {b!r}" for k, (a, b) in sorted(diff.items()))
        raise StateError(
            f"the state was saved by a PackingDataset with other arguments ({what}): "
            "build the dataset with the saved arguments to resume"
        )
    if (state["rank"], state["world_size"]) != (rank, world_size):
        raise StateError(
            f"the state belongs to rank {state['rank']} of {state['world_size']} but this dataset is rank "
            f"{rank} of {world_size}: load each rank's own state, with the same world size"
        )


def check_share(state: dict[str, Any], shard: int, shards: int, num_workers: int, rank: int) -> None:
    """Raise :class:`StateError` unless the iterating worker owns the share the state was saved by."""
    if (state["shard"], state["num_shards"]) != (shard, shards):
        raise StateError(
            f"the state was saved by worker {state['shard'] - state['rank'] * state['num_workers']} of "
            f"num_workers={state['num_workers']} (rank {state['rank']} of {state['world_size']}) but is being "
            f"restored into worker {shard - rank * num_workers} of num_workers={num_workers}: each worker owns "
            f"a different share of the samples, so resume with num_workers={state['num_workers']}"
        )


def refs_needed(state: dict[str, Any]) -> set[int]:
    """Source indices a restore must re-read: the buffer's and the pending rows'."""
    return {int(b[0]) for b in state["buffer"]} | {int(r[0]) for row in state["pending"] for r in row}


def restore_items(
    state: dict[str, Any], samples: dict[int, Any], cut: Callable[[int, Any], list[Any]]
) -> tuple[list[Any], list[int], list[list[Any]]]:
    """``(buffer items, their ages, pending rows of items)`` of ``state``, from the re-read
    ``samples`` (index -> sample) and ``cut`` (the over-long policy: sample -> its items)."""
    cache: dict[int, list[Any]] = {}

    def item(ref: list[int]) -> Any:
        src, piece = int(ref[0]), int(ref[1])
        if src not in cache:
            cache[src] = cut(src, samples[src])
        return cache[src][piece]

    buffer = [item(b) for b in state["buffer"]]
    ages = [int(b[2]) for b in state["buffer"]]
    pending = [[item(r) for r in row] for row in state["pending"]]
    return buffer, ages, pending
