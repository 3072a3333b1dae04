"""One tokenized-data cache entry on disk: its layout, its atomic write, its checked
read, and the eviction that bounds the cache.

One entry is one folder ``<root>/tokenized/<key>/`` (``<key>``:
:func:`~sftpack.chat._cache_key.cache_key`)::

    tokens.u32     every sample's ids, end to end (uint32)
    mask.u8        every sample's loss mask, end to end (0/1)
    lengths.i64    tokens of each sample (int64)
    weights.f64    (only when a sample has weights) those samples' token weights, end
                   to end (float64); ``index.json``'s ``weighted`` lists which samples
    index.json     each sample's conversation id, meta and conversation position (its
                   index in the input), the number of conversations, the tokenize
                   stats, and what training needs from the tokenizer (vocabulary
                   size, pad id), so that a run reading the entry need not load it
    manifest.json  format, key, and the size and SHA-256 of the files above

An entry without weighted samples is what it was before weights existed: the same
four files, the same bytes.

Samples are stored in input order (by conversation position, pieces in order)
whatever order they were tokenized in.

It is written into a temporary folder beside it and renamed into place
(:class:`sftpack._publish.Publish`), so a reader sees a whole entry or none; two
runs writing the same entry at once both succeed (the second rename finds the
folder there and drops its own copy). An entry whose files do not match their
manifest (a cut write, a damaged disk) is reported with a :class:`CacheWarning`
(``warnings.warn``: shown once, filterable; not a log line), removed and
rebuilt: never read as it is (so is a file where an entry folder should be).

A cache that cannot be written (a full disk, a read-only folder, a file in the
way) is reported with one warning and the samples are used without it: nothing
is left behind.

The cache is bounded: before a new entry is written, the entries used least
recently (an entry's folder's modification time is its last use: set when it is
written and each time it is read) are removed until the new one fits within
``max_size`` bytes (:data:`DEFAULT_MAX_SIZE`; ``0``: no limit). The entry being
written is never removed, and one larger than the limit is not written.

The root is ``cache_dir`` when given, else :func:`sftpack.data.cache_dir`
(``$SFTPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/sftpack``, else ``~/.cache/sftpack``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .._publish import Publish
from ..data import CacheWarning, cache_dir
from ..sample import Sample
from ._batch import TokenizeStats
from ._cache_key import FORMAT_VERSION, _sha

__all__ = ["DEFAULT_MAX_SIZE", "CacheWarning", "EntryWriter", "default_cache_dir", "parse_size", "read_entry"]


def _warn(message: str) -> None:
    warnings.warn(message, CacheWarning, stacklevel=3)


#: the cache's default size limit in bytes (10 GiB): an entry takes about 5 bytes per
#: token (uint32 id and uint8 mask), so this holds the entry of a 2-billion-token
#: data set, or the last few versions of a few-hundred-million-token one, or about
#: 500 entries of the embedded corpus (3.55 M tokens, about 18 MB each)
DEFAULT_MAX_SIZE = 10 << 30
_FILES = ("tokens.u32", "mask.u8", "lengths.i64", "index.json")
_WEIGHTS = "weights.f64"  # an entry with weighted samples only


def default_cache_dir() -> Path:
    """The cache's default root: :func:`sftpack.data.cache_dir` (``$SFTPACK_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/sftpack``, else ``~/.cache/sftpack``)."""

    return cache_dir()


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from a size such as ``10G``, ``500M``, ``1.5GiB`` or ``123`` (binary
    units K, M, G, T, any case, optionally followed by ``B`` or ``iB``). ``0``: no limit.

    >>> parse_size("500M"), parse_size("1.5g"), parse_size("0")
    (524288000, 1610612736, 0)
    """
    t = text.strip().upper()
    t = t[:-2] if t.endswith("IB") else t[:-1] if t.endswith("B") else t
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)].strip()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not number or not 0 <= value < float("inf"):
        raise ValueError(
            f"{text!r} is not a size: give bytes or a number with K, M, G or T (e.g. 10G, 500M; 0: no limit)"
        )
    return int(value * _UNITS[unit])


def _damaged(entry: Path, why: str) -> None:
    _warn(f"tokenized-data cache entry {entry} is damaged ({why}): rebuilding it")
    _remove(entry)


def _remove(entry: Path) -> None:
    """Move ``entry`` aside, then delete it (a concurrent reader never sees half of it)."""
    trash = entry.with_name(f".trash-{entry.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, trash)
    except OSError:
        return  # already gone (another run removed or replaced it), or a read-only cache
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            trash.unlink()


def _cannot_write(root: Path, e: OSError) -> None:
    """Say that the cache in ``root`` cannot be written, and why (the path named only
    when it is not one of this run's temporary files)."""
    why = f"[Errno {e.errno}] {e.strerror}" if e.errno and e.strerror else str(e)
    if e.filename and not any(part.startswith(".tmp-") for part in Path(str(e.filename)).parts):
        why += f": {str(e.filename)!r}"
    _warn(f"cannot write the tokenized-data cache in {root}: {why}; going on without the cache")


def _mark_used(entry: Path) -> None:
    """Note that ``entry`` is used now (its folder's modification time: what eviction
    goes by). A read-only cache cannot note it: no matter."""
    with contextlib.suppress(OSError):
        os.utime(entry)


def _make_room(folder: Path, need: int, limit: int, keep: Path) -> None:
    """Remove the entries of ``folder`` used least recently until they and ``need``
    more bytes fit within ``limit`` (``keep`` is never removed)."""
    found: list[tuple[float, int, Path]] = []
    total = need
    try:
        children = list(os.scandir(folder))
    except OSError:
        return
    for child in children:
        if child.name.startswith(".") or child.name == keep.name:
            continue  # temporary, half-deleted, or the entry being written
        try:
            st = child.stat(follow_symlinks=False)
            size = st.st_size
            if child.is_dir(follow_symlinks=False):
                size = sum(f.stat(follow_symlinks=False).st_size for f in os.scandir(child.path))
        except OSError:  # removed meanwhile by another run
            continue
        found.append((st.st_mtime, size, Path(child.path)))
        total += size
    for _, size, path in sorted(found, key=lambda t: (t[0], t[2].name)):
        if total <= limit:
            break
        _remove(path)
        total -= size


def read_entry(entry: Path, key: str) -> tuple[list[Sample], TokenizeStats, dict[str, Any]] | None:
    """The samples, stats and the rest of a whole, matching entry (``positions``: each
    sample's conversation position, ``conversations``: how many conversations went in,
    ``tokenizer``: :func:`tokenizer_info`); ``None`` if there is none. A damaged entry
    is reported, removed and ``None`` returned."""
    manifest_path = entry / "manifest.json"
    if not entry.is_dir():
        if os.path.lexists(entry):
            _damaged(entry, "a file, not a folder")
        return None
    _mark_used(entry)
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        _damaged(entry, f"manifest.json unreadable: {type(e).__name__}")
        return None
    if manifest.get("format") != FORMAT_VERSION or manifest.get("key") != key:
        _damaged(entry, f"format {manifest.get('format')!r} / key of another entry")
        return None
    blobs: dict[str, bytes] = {}
    names = _FILES + ((_WEIGHTS,) if _WEIGHTS in (manifest.get("files") or {}) else ())
    for name in names:
        want = (manifest.get("files") or {}).get(name) or {}
        try:
            data = (entry / name).read_bytes()
        except OSError as e:
            _damaged(entry, f"{name}: {type(e).__name__}")
            return None
        if len(data) != want.get("size") or _sha(data) != want.get("sha256"):
            _damaged(
                entry,
                f"{name} has {len(data):,} bytes and SHA-256 {_sha(data)[:12]}..., the manifest says "
                f"{want.get('size')} bytes, {str(want.get('sha256'))[:12]}...",
            )
            return None
        blobs[name] = data
    ids = np.frombuffer(blobs["tokens.u32"], dtype=np.uint32).astype(np.int64)
    mask = np.frombuffer(blobs["mask.u8"], dtype=np.uint8).astype(bool)
    lengths = np.frombuffer(blobs["lengths.i64"], dtype=np.int64)
    index = json.loads(blobs["index.json"])
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    of: dict[int, np.ndarray] = {}  # the weighted samples' weights (stored end to end)
    if _WEIGHTS in blobs:
        weights = np.frombuffer(blobs[_WEIGHTS], dtype=np.float64)
        at = 0
        for i in index["weighted"]:
            n = int(lengths[i])
            of[i] = weights[at : at + n].copy()
            at += n
    samples = [
        Sample(ids[a:b], mask[a:b], cid, meta, weights=of.get(k))
        for k, (a, b, (cid, meta)) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist(), index["samples"]))
    ]
    stats = TokenizeStats(**index["stats"])
    rest = {
        "positions": np.asarray(index["positions"], dtype=np.int64),
        "conversations": int(index["conversations"]),
        "tokenizer": dict(index.get("tokenizer") or {}),
    }
    return samples, stats, rest


class EntryWriter:
    """Collects one entry's samples as they arrive (``position``: each sample's
    conversation position; by default the order of arrival), then :meth:`commit`
    writes them in input order into a temporary folder beside the entry and renames
    it into place; :meth:`abort` throws it away. ``max_size``: the cache's size limit
    in bytes (``0``: none): the entries used least recently are removed to make room
    for this one, which is not written if it alone is larger."""

    def __init__(self, entry: Path, key: str, *, max_size: int = DEFAULT_MAX_SIZE) -> None:
        self.entry, self.key, self.max_size = entry, key, max_size
        entry.parent.mkdir(parents=True, exist_ok=True)
        _sweep(entry.parent)
        self._publish = Publish(entry, keep_existing=True)  # a new .tmp-<key>-<random> beside it
        self.tmp = self._publish.tmp
        self._samples: list[Sample] = []
        self._positions: list[int] = []
        self.uncachable = ""  # why these samples cannot be stored exactly (then nothing is committed)

    def add(self, s: Sample, position: int | None = None) -> None:
        ids = s.input_ids
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 32):
            raise ValueError(f"sample of conversation {s.conversation_id!r} holds a token id outside [0, 2**32)")
        if not self.uncachable and not _round_trips([s.conversation_id, dict(s.meta)]):
            self.uncachable = f"conversation id {s.conversation_id!r} or its meta does not survive JSON"
        self._positions.append(len(self._positions) if position is None else int(position))
        self._samples.append(s)

    def commit(
        self, stats: TokenizeStats, *, conversations: int | None = None, tokenizer: dict[str, int] | None = None
    ) -> bool:
        """Write the entry, first removing the entries used least recently as far as
        ``max_size`` requires. ``conversations``: how many went in (default: the
        largest position + 1); ``tokenizer``: :func:`tokenizer_info`. Returns whether
        the entry is there: ``False`` (with a warning, nothing left behind) when the
        samples cannot be stored, are larger than ``max_size``, or the cache cannot
        be written."""
        if self.uncachable:
            _warn(f"not caching the tokenized data: {self.uncachable}")
            self.abort()
            return False
        order = np.argsort(np.asarray(self._positions, dtype=np.int64), kind="stable")
        samples = [self._samples[i] for i in order.tolist()]
        positions = [self._positions[i] for i in order.tolist()]
        n = conversations if conversations is not None else (positions[-1] + 1 if positions else 0)
        index = {
            "samples": [[s.conversation_id, dict(s.meta)] for s in samples],
            "positions": positions,
            "conversations": n,
            "tokenizer": tokenizer or {},
            "stats": stats.as_dict(),
        }
        ids = np.concatenate([s.input_ids for s in samples]) if samples else np.zeros(0, np.int64)
        mask = np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros(0, bool)
        weighted = [i for i, s in enumerate(samples) if s.weights is not None]
        if weighted:  # only then: an entry without weights keeps its bytes
            index["weighted"] = weighted
        blobs = {
            "tokens.u32": ids.astype(np.uint32).tobytes(),
            "mask.u8": mask.astype(np.uint8).tobytes(),
            "lengths.i64": np.asarray([len(s) for s in samples], dtype=np.int64).tobytes(),
            "index.json": json.dumps(index).encode(),
        }
        if weighted:
            blobs[_WEIGHTS] = np.concatenate(
                [np.asarray(samples[i].weights, dtype=np.float64) for i in weighted]
            ).tobytes()
        files = {name: {"size": len(data), "sha256": _sha(data)} for name, data in blobs.items()}
        manifest = {"format": FORMAT_VERSION, "key": self.key, "samples": len(samples), "files": files}
        blobs["manifest.json"] = json.dumps(manifest, indent=1).encode()
        need = sum(len(data) for data in blobs.values())
        root = self.entry.parent.parent
        if self.max_size and need > self.max_size:
            _warn(
                f"not caching the tokenized data in {root}: its {need:,} bytes exceed the cache's size limit "
                f"of {self.max_size:,} bytes"
            )
            self.abort()
            return False
        if self.max_size:
            _make_room(self.entry.parent, need, self.max_size, keep=self.entry)
        try:
            for name, data in blobs.items():
                _write_file(self.tmp / name, data)
        except OSError as e:  # a full disk, a quota
            self.abort()
            _cannot_write(root, e)
            return False
        try:
            placed = self._publish.publish()
        except OSError as e:  # something else in the way
            _cannot_write(root, e)
            return False
        if not placed:
            _mark_used(self.entry)  # another run committed the same entry first: theirs is kept
        return True

    def abort(self) -> None:
        self._publish.discard()


def _round_trips(obj: Any) -> bool:
    """``obj`` comes back from JSON equal and of the same types (no tuple turned list)."""
    try:
        back = json.loads(json.dumps(obj))
    except (TypeError, ValueError):
        return False
    return _same(obj, back)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


#: a temporary folder untouched this long was left by a run that was killed mid-write
_STALE_SECONDS = 24 * 3600


def _sweep(folder: Path) -> None:
    """Remove the temporary and half-deleted folders of runs killed long ago."""
    now = time.time()
    for p in [*folder.glob(".tmp-*"), *folder.glob(".trash-*")]:
        try:
            if now - p.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:  # removed meanwhile by another run
            pass


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
