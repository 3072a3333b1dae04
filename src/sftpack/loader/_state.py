"""A loader's saved position: plain ints and lists, checked before it is trusted.

One (rank, worker)'s state, as :meth:`PackingDataset.state_dict` writes it::

    {"version": 1, "config": {max_seq_len, buffer_size, ...},   # the arguments it was built with
     "rank": 0, "world_size": 2, "num_workers": 2, "shard": 1, "num_shards": 4,
     "epoch": 3, "end_epoch": 4, "active": True, "cursor": 812,  # position in this share's epoch order
     "buffer": [[source index, piece, rounds waited], ...],      # samples read, not yet in a row
     "pending": [[[source index, piece], ...], ...],             # rows decided, not yet emitted
     "stats": {...},                                              # LoaderStats counts
     "num_samples": 5000,                                         # len() of a map-style source (else None)
     "lengths": [tokens, ...]}                                     # of each buffer entry, then each pending one

No token is stored: a restore re-reads the named samples (O(buffer) reads on
a map-style source) and replays the pending rows exactly as decided. A state
is only loaded into the dataset it came from: same arguments, same rank and
world size, same ``num_workers``; anything else is a :class:`StateError` that
names the field, both values and the fix (never a bare ``AssertionError``).

A state is also checked against the data before it is trusted (:func:`check_fields`,
:func:`check_refs`, :func:`restore_items`): every field of the right type and range,
no sequence named twice (it would be emitted twice), the cursor within the share
(a negative one would cut the epoch), every named sample among those the share had
read, every piece within its sample, every re-read sequence as long as when it was
saved, and every pending row within ``max_seq_len``. A state saved over other data
is refused, never replayed into an ``IndexError`` or a wrong row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._base import non_negative_int, positive_int

__all__ = [
    "STATE_VERSION",
    "StateError",
    "check_fields",
    "check_loadable",
    "check_refs",
    "check_share",
    "refs_needed",
    "restore_items",
]

#: every key of a state (``num_samples`` and ``lengths`` are newer and optional)
_KEYS = (
    "config",
    "rank",
    "world_size",
    "num_workers",
    "shard",
    "num_shards",
    "epoch",
    "end_epoch",
    "active",
    "cursor",
    "buffer",
    "pending",
    "stats",
)

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
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise StateError(
            f"the PackingDataset state lacks {', '.join(missing)}: pass what state_dict() returned, unedited"
        )
    if not isinstance(state["config"], dict):
        raise StateError(f"state['config'] must be a dict of the dataset's arguments, got {state['config']!r}")
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


def _int(state: dict[str, Any], key: str, lo: int = 0) -> int:
    check = positive_int if lo else non_negative_int
    return check(f"state[{key!r}]", state[key], error=StateError, why="the state is damaged or edited")


def _ref(where: str, entry: Any, size: int) -> tuple[int, ...]:
    ok = isinstance(entry, (list, tuple)) and len(entry) == size
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry)
    if not ok:
        what = "[source index, piece, rounds waited]" if size == 3 else "[source index, piece]"
        raise StateError(
            f"{where} = {entry!r}: each entry must be {what}, non-negative integers; the state is damaged or edited"
        )
    return tuple(entry)


def check_fields(state: dict[str, Any], max_wait: int) -> None:
    """Raise :class:`StateError` unless the position fields have the types and ranges
    :meth:`PackingDataset.state_dict` writes, and no sequence is named twice."""
    for key in ("rank", "shard", "epoch", "cursor", "num_workers"):
        _int(state, key)
    for key in ("world_size", "num_shards"):
        _int(state, key, lo=1)
    if state["end_epoch"] is not None and _int(state, "end_epoch") < state["epoch"]:
        raise StateError(
            f"state['end_epoch'] = {state['end_epoch']} is before state['epoch'] = {state['epoch']}; "
            "the state is damaged or edited"
        )
    if not isinstance(state["active"], bool):
        raise StateError(f"state['active'] = {state['active']!r}: it must be True or False")
    if not isinstance(state["stats"], dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in state["stats"].values()
    ):
        raise StateError(f"state['stats'] must map counts to non-negative numbers, got {state['stats']!r}")
    buffer, pending = state["buffer"], state["pending"]
    if not isinstance(buffer, (list, tuple)) or not isinstance(pending, (list, tuple)):
        raise StateError("state['buffer'] and state['pending'] must be lists; the state is damaged or edited")
    seen: dict[tuple[int, int], str] = {}

    def once(ref: tuple[int, ...], where: str) -> None:
        key = (ref[0], ref[1])
        if key in seen:
            raise StateError(
                f"{where} names sample {key[0]} piece {key[1]}, already named by {seen[key]}: each sequence is "
                "in the buffer or one pending row at most once (it would be emitted twice); the state is damaged "
                "or edited"
            )
        seen[key] = where

    for i, entry in enumerate(buffer):
        ref = _ref(f"state['buffer'][{i}]", entry, 3)
        if ref[2] > max_wait:
            raise StateError(
                f"state['buffer'][{i}] = {list(ref)} has waited {ref[2]} rounds, more than max_wait={max_wait}; "
                "the state is damaged or edited"
            )
        once(ref, f"state['buffer'][{i}]")
    for r, row in enumerate(pending):
        if not isinstance(row, (list, tuple)) or not row:
            raise StateError(f"state['pending'][{r}] = {row!r}: a pending row is a non-empty list of sequences")
        for j, entry in enumerate(row):
            once(_ref(f"state['pending'][{r}][{j}]", entry, 2), f"state['pending'][{r}][{j}]")
    lengths = state.get("lengths")
    if lengths is not None and (
        not isinstance(lengths, (list, tuple))
        or len(lengths) != len(seen)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
    ):
        raise StateError(
            f"state['lengths'] must hold one token count (>= 1) per buffer and pending entry ({len(seen)}), got "
            f"{str(lengths)[:60]}; the state is damaged or edited"
        )


def check_refs(state: dict[str, Any], order: Any, num_samples: int | None) -> None:
    """Raise :class:`StateError` unless the state fits the data: the same number of
    samples (map-style), a cursor within the share, and every named sample among the
    ``cursor`` samples the share had read.

    ``order`` is the share's reading order in the state's epoch (map-style) or ``None``
    (an iterable source: share ``s`` of ``S`` reads indices ``s, s + S, ...``; a cursor
    beyond its end is found when it is re-read).
    """
    saved = state.get("num_samples")
    if saved is not None and num_samples is not None and saved != num_samples:
        raise StateError(
            f"the state was saved over a source of {saved} samples but this dataset's source holds "
            f"{num_samples}: resume with the same samples in the same order"
        )
    cursor, shard, shards, epoch = state["cursor"], state["shard"], state["num_shards"], state["epoch"]
    if order is not None and cursor > len(order):
        raise StateError(
            f"state['cursor'] = {cursor} but share {shard} of {shards} holds {len(order)} samples in epoch {epoch}: "
            "the state was saved over other data (or edited); resume with the same samples in the same order"
        )
    read = {int(i) for i in order[:cursor]} if order is not None else None
    entries = [(f"state['buffer'][{i}]", b) for i, b in enumerate(state["buffer"])]
    entries += [(f"state['pending'][{r}][{j}]", e) for r, row in enumerate(state["pending"]) for j, e in enumerate(row)]
    for where, entry in entries:
        src = entry[0]
        if read is not None:
            ok = src in read
        else:
            ok = src % shards == shard and src // shards < cursor
        if not ok:
            raise StateError(
                f"{where} = {list(entry)} names sample {src}, which is not among the {cursor} samples share "
                f"{shard} of {shards} had read in epoch {epoch} (state['cursor'] = {cursor}): the state was saved "
                "over other data (or edited); resume with the same samples in the same order"
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
    refs = [b[:2] for b in state["buffer"]] + [r for row in state["pending"] for r in row]
    saved = {(int(r[0]), int(r[1])): n for r, n in zip(refs, state.get("lengths") or ())}

    def item(ref: list[int]) -> Any:
        src, piece = int(ref[0]), int(ref[1])
        if src not in samples:
            raise StateError(
                f"the state names sample {src}, which this share's source does not hold: the state was saved "
                "over other data; resume with the same samples in the same order"
            )
        if src not in cache:
            cache[src] = cut(src, samples[src])
        if piece >= len(cache[src]):
            raise StateError(
                f"the state names piece {piece} of sample {src}, which has {len(cache[src])} piece(s) here: the "
                "state was saved over other data; resume with the same samples in the same order"
            )
        it = cache[src][piece]
        if (src, piece) in saved and saved[(src, piece)] != it.length:
            raise StateError(
                f"sample {src} piece {piece} has {it.length} tokens here but had {saved[(src, piece)]} when the "
                "state was saved: the state was saved over other data (or another tokenizer); resume with the "
                "same samples in the same order"
            )
        return it

    buffer = [item(b) for b in state["buffer"]]
    ages = [int(b[2]) for b in state["buffer"]]
    pending = [[item(r) for r in row] for row in state["pending"]]
    return buffer, ages, pending
