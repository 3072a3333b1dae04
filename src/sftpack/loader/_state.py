"""A loader's saved position: plain ints and lists, checked before it is trusted.

One (rank, worker)'s state, as :meth:`PackingDataset.state_dict` writes it::

    {"version": 3, "config": {max_seq_len, buffer_size, ...},   # the arguments it was built with
     "rank": 0, "world_size": 2, "num_workers": 2, "shard": 1, "num_shards": 4,
     "epoch": 3, "end_epoch": 4, "active": True, "cursor": 812,  # position in this share's epoch order
     "buffer": [[source index, piece, rounds waited], ...],      # samples read, not yet in a row
     "pending": [[[source index, piece], ...], ...],             # rows decided, not yet emitted
     "stats": {...},                                              # LoaderStats counts
     "num_samples": 5000,                                         # len() of a map-style source (else None)
     "lengths": [tokens, ...],                                    # of each buffer entry, then each pending one
     "digests": ["9f3c...", ...],                                 # of each entry's tokens, id and media, same order
     "last": [source index, pieces, digest] or None}              # the last sample the share read this epoch

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
saved and with the same tokens and id (``digests``; the last sample read is re-read
and compared too, so a state with nothing buffered is checked as well), and every
pending row within ``max_seq_len``. A state saved over other data (fewer samples, the
same samples reversed or some replaced) is refused, never replayed into an
``IndexError`` or a wrong row. Its counts (:func:`check_stats`) must add up and match
what the state holds (every sequence read is emitted, buffered, pending or abandoned).

Version 2 added ``digests`` and ``last``; version 3 is the one loader of samples with and
without media (a fingerprint also covers a sample's media: each item's patch grid, or each
item's placeholder run; the media arguments join ``config`` when set). A state of an older
version (a version-2 ``MultimodalPackingDataset`` state too) is refused with what to do.

``active`` False with an ``end_epoch`` marks a share whose ``iter()`` had ended when the
state was taken (:func:`first_iter`): inside a DataLoader worker that is a worker that
finished its share of the loader's pass while the others still yield, so the first
``iter()`` after the restore (torchdata's, finishing that pass) yields nothing and the
next one starts the next epoch; in the main process the first ``iter()`` starts it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .._base import non_negative_int, positive_int
from ..handoff.layout import padded_lengths

__all__ = [
    "STATE_VERSION",
    "StateError",
    "check_fields",
    "check_loadable",
    "check_pending",
    "check_refs",
    "check_share",
    "check_stats",
    "digest",
    "first_iter",
    "last_mark",
    "position",
    "refs_needed",
    "unemitted",
    "restore_items",
]

#: every key of a state
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
    "num_samples",
    "lengths",
    "digests",
    "last",
)

STATE_VERSION = 3


def digest(input_ids: np.ndarray, sequence_id: Any, *extra: np.ndarray) -> str:
    """A short fingerprint of one buffered sequence: its token ids, its id and ``extra`` arrays
    (the layout of a sample's media). Computed only when a state is taken."""
    h = hashlib.blake2b(np.ascontiguousarray(input_ids, dtype=np.int64).tobytes(), digest_size=8)
    h.update(repr(sequence_id).encode())
    for a in extra:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def last_mark(index: int, items: Sequence[Any]) -> list[Any]:
    """``[source index, pieces, digest]`` of a sample from its items (none: dropped)."""
    h = hashlib.blake2b("".join(it.digest() for it in items).encode(), digest_size=8)
    return [int(index), len(items), h.hexdigest()]


class StateError(ValueError):
    """A saved loader state does not fit this loader (the message says which field and the fix)."""


def check_loadable(state: Any, config: dict[str, Any], rank: int, world_size: int) -> None:
    """Raise :class:`StateError` unless ``state`` came from a dataset with ``config`` on this rank."""
    if isinstance(state, dict) and isinstance(state.get("version"), int) and state["version"] < STATE_VERSION:
        raise StateError(
            f"the state is state version {state['version']}, saved by an older sftpack; this sftpack reads version "
            f"{STATE_VERSION} (one loader for samples with and without media, whose fingerprints of the buffered "
            "samples cover their media too): resume with the sftpack that saved it, or start the epoch over "
            "(set_epoch(epoch) on a fresh dataset instead of load_state_dict)"
        )
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
    saved = state["config"]
    diff = {k: (saved.get(k), config.get(k)) for k in saved.keys() | config.keys() if config.get(k) != saved.get(k)}
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


def position(
    buffer: Sequence[Any], ages: Sequence[int], pending: Sequence[Sequence[Any]], last: tuple[int, list[Any]] | None
) -> dict[str, Any]:
    """The index-only entries of a state (``buffer``, ``pending``, ``lengths``, ``digests``, ``last``)
    from a loader's items (each with ``ref``, ``length`` and ``digest()``)."""
    entries = [*buffer, *(it for row in pending for it in row)]
    return {
        "buffer": [[*it.ref, age] for it, age in zip(buffer, ages)],
        "pending": [[list(it.ref) for it in row] for row in pending],
        "lengths": [it.length for it in entries],
        "digests": [it.digest() for it in entries],
        "last": None if last is None else last_mark(*last),
    }


def unemitted(buffer: Sequence[Any], pending: Sequence[Sequence[Any]], restore: dict[str, Any] | None) -> int:
    """Sequences read but not emitted yet: a loaded state's (not yet iterated), else the buffer's and pending rows'."""
    if restore is not None:
        return len(restore["buffer"]) + sum(len(row) for row in restore["pending"])
    return len(buffer) + sum(len(row) for row in pending)


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
    lengths = state["lengths"]
    if (
        not isinstance(lengths, (list, tuple))
        or len(lengths) != len(seen)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
    ):
        raise StateError(
            f"state['lengths'] must hold one token count (>= 1) per buffer and pending entry ({len(seen)}), got "
            f"{str(lengths)[:60]}; the state is damaged or edited"
        )
    digests = state["digests"]
    if not isinstance(digests, (list, tuple)) or len(digests) != len(seen) or not all(_hex(d) for d in digests):
        raise StateError(
            f"state['digests'] must hold one fingerprint (16 hex digits) per buffer and pending entry ({len(seen)}), "
            f"got {str(digests)[:60]}; the state is damaged or edited"
        )
    last = state["last"]
    if last is not None and not (
        isinstance(last, (list, tuple))
        and len(last) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in last[:2])
        and _hex(last[2])
    ):
        raise StateError(
            f"state['last'] = {str(last)[:60]}: it must be None or [source index, pieces, fingerprint]; the state "
            "is damaged or edited"
        )


def _hex(d: Any) -> bool:
    return isinstance(d, str) and len(d) == 16 and all(c in "0123456789abcdef" for c in d)


def check_stats(
    state: dict[str, Any],
    stats: Any,
    *,
    who: str,
    max_seq_len: int,
    max_wait: int,
    max_patches: int | None = None,
) -> None:
    """Raise :class:`StateError` unless ``state['stats']`` (read into ``stats``, a
    :class:`LoaderStats`) holds exactly the counts such a state writes, and they add up:
    ``slots = rows_out x max_seq_len``, no more real tokens than slots, no more samples
    dropped under a reason than dropped, no more patches than the patch budget allows, and
    every sequence read (``samples_in - dropped + extra_pieces``) emitted, buffered,
    pending or abandoned (by ``set_epoch`` mid-epoch)."""
    given, again = state["stats"], stats.as_dict()
    for k in sorted(set(given) - set(again)):
        raise StateError(
            f"state['stats'] holds {k!r}, which a {who} state has not: the counts are damaged or edited; "
            "pass what state_dict() returned, unedited"
        )
    for k in sorted(set(again) - set(given)):
        raise StateError(f"state['stats'] lacks {k!r}: pass what state_dict() returned, unedited")
    why = "the counts are damaged or edited; pass what state_dict() returned, unedited"
    for k, v in sorted(given.items()):
        if k != "fill" and v != again[k]:
            raise StateError(f"state['stats'][{k!r}] = {v!r}: a count must be a whole number; {why}")

    def bad(what: str) -> StateError:
        return StateError(f"state['stats']{what}: {why}")

    s = stats
    if s.slots != s.rows_out * max_seq_len:
        raise bad(
            f"['slots'] = {s.slots} but rows_out x max_seq_len = {s.rows_out} x {max_seq_len} = "
            f"{s.rows_out * max_seq_len}"
        )
    if s.real_tokens > s.slots:
        raise bad(f"['real_tokens'] = {s.real_tokens}, more than its slots ({s.slots})")
    if not s.rows_out <= s.sequences_out <= s.real_tokens:
        raise bad(
            f": rows_out <= sequences_out <= real_tokens must hold (each row holds a sequence, each sequence a "
            f"token), got {s.rows_out}, {s.sequences_out}, {s.real_tokens}"
        )
    if s.split > s.extra_pieces:
        raise bad(f"['split'] = {s.split}, more than extra_pieces = {s.extra_pieces} (a split sample adds a piece)")
    if s.max_waited > max_wait:
        raise bad(f"['max_waited'] = {s.max_waited}, more than max_wait={max_wait}")
    if sum(s.reasons.values()) > s.dropped:
        raise bad(
            f": the samples dropped under a reason ({', '.join(f'dropped:{k}' for k in sorted(s.reasons))}: "
            f"{sum(s.reasons.values())}) are more than dropped = {s.dropped}"
        )
    patches = s.patches_out
    if max_patches is not None and patches > s.rows_out * max_patches:
        raise bad(
            f"['patches_out'] = {patches}, more than rows_out x max_patches_per_row = {s.rows_out} x {max_patches} = "
            f"{s.rows_out * max_patches}"
        )
    held = len(state["buffer"])
    pend = sum(len(row) for row in state["pending"])
    read = s.samples_in - s.dropped_total + s.extra_pieces
    out = s.sequences_out + held + pend + s.abandoned
    if read != out:
        raise bad(
            f": samples_in - dropped + extra_pieces = {s.samples_in} - {s.dropped_total} + {s.extra_pieces} = "
            f"{read} sequences read, but sequences_out + buffered + pending + abandoned = {s.sequences_out} + "
            f"{held} + {pend} + {s.abandoned} = {out}"
        )
    if given.get("fill", 0.0) != again.get("fill", 0.0):
        raise StateError(
            f"state['stats']['fill'] = {given['fill']!r} but real_tokens / slots = {stats.real_tokens} / "
            f"{stats.slots} = {again['fill']!r}: {why}"
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
    if state["last"] is not None:
        entries.append(("state['last']", state["last"]))
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


def first_iter(restore: dict[str, Any] | None, in_worker: bool, skipped: bool) -> tuple[bool, dict[str, Any] | None]:
    """``(yield nothing, the state to restore)`` for an ``iter()`` of a dataset holding ``restore``.

    A state taken after the share's ``iter()`` had ended (``active`` False, an ``end_epoch``)
    inside a DataLoader worker is a worker that had finished its share of the loader's pass
    while other workers still yielded: torchdata restores it and asks one ``iter()`` to finish
    that pass, so that ``iter()`` must yield nothing (not the next epoch, which ``set_epoch`` or
    the next pass gives). Once it has (``skipped``), or in the main process, the state reads as
    one ready for the next ``iter()`` (no ``end_epoch``): that iteration starts the next epoch.
    """
    if restore is None or restore["active"] or restore["end_epoch"] is None:
        return False, restore
    if in_worker and not skipped:
        return True, restore
    return False, {**restore, "end_epoch": None}


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
    last = {int(state["last"][0])} if state["last"] is not None else set()
    return {int(b[0]) for b in state["buffer"]} | {int(r[0]) for row in state["pending"] for r in row} | last


def restore_items(
    state: dict[str, Any], samples: dict[int, Any], cut: Callable[[int, Any], list[Any]]
) -> tuple[list[Any], list[int], list[list[Any]], tuple[int, list[Any]] | None]:
    """``(buffer items, their ages, pending rows of items, (last index, its items))`` of ``state``,
    from the re-read ``samples`` (index -> sample) and ``cut`` (the over-long policy: sample -> its
    items), each checked against the lengths and fingerprints the state recorded."""
    cache: dict[int, list[Any]] = {}
    refs = [b[:2] for b in state["buffer"]] + [r for row in state["pending"] for r in row]
    keys = [(int(r[0]), int(r[1])) for r in refs]
    saved = dict(zip(keys, state["lengths"]))
    where = {k: i for i, k in enumerate(keys)}
    other = (
        "the state was saved over other data (the samples reversed, replaced or changed); resume with the same "
        "samples in the same order"
    )

    def items_of(src: int) -> list[Any]:
        if src not in samples:
            raise StateError(
                f"the state names sample {src}, which this share's source does not hold: the state was saved "
                "over other data; resume with the same samples in the same order"
            )
        if src not in cache:
            cache[src] = cut(src, samples[src])
        return cache[src]

    def item(ref: list[int]) -> Any:
        src, piece = int(ref[0]), int(ref[1])
        got = items_of(src)
        if piece >= len(got):
            raise StateError(
                f"the state names piece {piece} of sample {src}, which has {len(got)} piece(s) here: the "
                "state was saved over other data; resume with the same samples in the same order"
            )
        it = got[piece]
        if saved[(src, piece)] != it.length:
            raise StateError(
                f"sample {src} piece {piece} has {it.length} tokens here but had {saved[(src, piece)]} when the "
                "state was saved: the state was saved over other data (or another tokenizer); resume with the "
                "same samples in the same order"
            )
        k = where[(src, piece)]
        if state["digests"][k] != it.digest():
            raise StateError(
                f"state['digests'][{k}] = {state['digests'][k]!r}: sample {src} piece {piece} (id "
                f"{it.sequence_id!r}) has other tokens or another id here than when the state was saved: {other}"
            )
        return it

    buffer = [item(b) for b in state["buffer"]]
    ages = [int(b[2]) for b in state["buffer"]]
    pending = [[item(r) for r in row] for row in state["pending"]]
    last = None
    if state["last"] is not None:
        src = int(state["last"][0])
        got = items_of(src)
        if last_mark(src, got) != list(state["last"]):
            ids = sorted({repr(it.sequence_id) for it in got}) or ["- (left out)"]
            raise StateError(
                f"state['last'] = {list(state['last'])}: sample {src} (id {', '.join(ids)}), the last sample read "
                f"before the save, has other tokens or another id here than when the state was saved: {other}"
            )
        last = (src, got)
    return buffer, ages, pending, last


class Sized(Protocol):
    """What :func:`check_pending` reads of a restored item (a loader's ``Item``)."""

    @property
    def length(self) -> int: ...
    @property
    def patches(self) -> int: ...


def check_pending(
    pending: Sequence[Sequence[Sized]], pad_multiple: int, max_seq_len: int, max_patches: int | None
) -> None:
    """Raise :class:`StateError` unless every restored pending row (of items with ``length`` and
    ``patches``) fits a row: ``max_seq_len`` padded slots and the patch budget ``max_patches``."""
    for r, row in enumerate(pending):
        cost = int(padded_lengths([it.length for it in row], pad_multiple).sum())
        if cost > max_seq_len:
            raise StateError(
                f"state['pending'][{r}] holds {len(row)} sequences of {cost} padded slots, more than "
                f"max_seq_len={max_seq_len}: the state was saved over other data (or edited); resume "
                "with the same samples in the same order"
            )
        patches = sum(it.patches for it in row)
        if max_patches is not None and patches > max_patches:
            raise StateError(
                f"state['pending'][{r}] holds {len(row)} sequences of {patches} vision patches, more than "
                f"max_patches_per_row={max_patches}: the state was saved over other data (or edited); resume with "
                "the same samples in the same order"
            )
