"""Reading conversations from files, streaming, with every rejected row accounted for.

Formats (chosen by file name; a directory is either a Hugging Face dataset
saved with ``save_to_disk`` or a folder of such files, read in sorted order):

* ``*.jsonl``, ``*.json``, ``*.ndjson`` (``.gz`` too): one JSON object per line;
  id ``"chat.jsonl:17"`` (line, 1-based).
* ``*.parquet``: a ``messages`` (or ``conversations``) column; id
  ``"chat.parquet[16]"`` (row, 0-based).
* Hugging Face ``datasets``: the same columns, from a ``save_to_disk`` folder
  or a ``Dataset`` / ``DatasetDict`` / ``IterableDataset`` object; id
  ``"folder[16]"`` or ``"dataset[16]"``.

A row holds either OpenAI-style ``messages`` or ShareGPT ``conversations``; its
checks live in ``_rows``.

Memory stays bounded whatever the file size: JSONL is read line by line,
Parquet one record batch at a time (``batch_size`` rows of only the needed
column), a saved dataset through its memory-mapped Arrow files. The trade-off is
that a JSON *array* file (``[{...}, {...}]``) is refused (an indented one as a
file, a one-line one as a row that is not an object) with the ``jq`` line that
converts it: parsing an array would need the whole file in memory.

Accounting: every non-blank line (or table row) is ``read``; each then lands in
``kept`` or in exactly one ``dropped[reason]`` (the first problem found), so
``read == kept + sum(dropped.values())`` holds at every moment, also after a
:class:`BadRowError` was raised (the row that raised is counted as dropped).
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._options import BadRowReason, OnBadRow, choose
from ._rows import ROLES, BadRowError, Conversation, _Bad, _messages

__all__ = ["ConversationReader", "ReadStats", "read_conversations"]

logger = logging.getLogger("sftpack.chat")

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
_PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class ReadStats:
    """Counts of one pass over the sources: ``read == kept + sum(dropped.values())``.

    Attributes:
        read: rows seen (blank JSONL lines are not rows).
        kept: rows yielded as conversations.
        dropped: reason (a :class:`BadRowReason` value) -> rows left out for it.
    """

    read: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def num_dropped(self) -> int:
        """``sum(dropped.values())``."""
        return sum(self.dropped.values())

    def __getitem__(self, key: str) -> Any:
        if key in ("read", "kept", "dropped"):
            return getattr(self, key)
        raise KeyError(key)

    def as_dict(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "dropped": dict(self.dropped)}

    def _reset(self) -> None:
        self.read = self.kept = 0
        self.dropped.clear()


# ---------------------------------------------------------------------------- sources


@dataclass
class _Source:
    kind: str  # "jsonl" | "parquet" | "dataset"
    name: str
    target: Any  # a path, or a datasets object


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _kind_of(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    return None


def _resolve(paths: Any, split: str | None) -> list[_Source]:
    if _is_datasets_object(paths):
        return [_Source("dataset", "dataset", _pick_split(paths, split, "dataset"))]
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    sources: list[_Source] = []
    for p in paths:
        if _is_datasets_object(p):
            sources.append(_Source("dataset", f"dataset{len(sources)}", _pick_split(p, split, "dataset")))
            continue
        text = os.fspath(p)
        if not os.path.exists(text) and glob.has_magic(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise FileNotFoundError(f"no file matches {text!r}")
            sources.extend(_source_for(Path(m), split) for m in matches)
            continue
        sources.extend(_sources_for_path(Path(text), split))
    return sources


def _sources_for_path(path: Path, split: str | None) -> list[_Source]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        if _is_saved_dataset(path):
            return [_Source("dataset", str(path), (path, split))]
        files = sorted(f for f in path.iterdir() if f.is_file() and _kind_of(f))
        if not files:
            raise ValueError(
                f"{path} is a directory with no .jsonl / .json / .parquet file and is not a dataset "
                "saved with datasets' save_to_disk: point at the files or the saved dataset"
            )
        return [_source_for(f, split) for f in files]
    return [_source_for(path, split)]


def _source_for(path: Path, split: str | None) -> _Source:
    if path.is_dir():
        if _is_saved_dataset(path):
            return _Source("dataset", str(path), (path, split))
        raise ValueError(f"{path} is a directory, not a dataset saved with save_to_disk")
    kind = _kind_of(path)
    if kind is None:
        raise ValueError(
            f"{path}: unknown format; supported: JSON Lines ({', '.join(_JSONL_SUFFIXES)}), "
            f"Parquet ({', '.join(_PARQUET_SUFFIXES)}), or a Hugging Face dataset directory (save_to_disk)"
        )
    return _Source(kind, str(path), path)


def _is_datasets_object(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("datasets.") and hasattr(obj, "column_names")


def _pick_split(ds: Any, split: str | None, name: str) -> Any:
    if isinstance(ds.column_names, dict):  # a DatasetDict: one split has to be chosen
        splits = list(ds.column_names)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise ValueError(f"{name} has splits {splits}: pass split= one of them")
        return ds[split]
    return ds


# ---------------------------------------------------------------------------- the reader


class ConversationReader:
    """Iterable over the :class:`Conversation` of some sources; see :func:`read_conversations`.

    Each ``iter()`` starts a fresh pass and resets :attr:`stats` in place.
    """

    def __init__(
        self,
        sources: list[_Source],
        on_bad_row: OnBadRow,
        role_map: Mapping[str, str] | None,
        batch_size: int,
    ):
        self.sources = sources
        self.on_bad_row = on_bad_row
        self.role_map = dict(role_map) if role_map is not None else None
        self.batch_size = batch_size
        self.stats = ReadStats()

    def __repr__(self) -> str:
        names = [s.name for s in self.sources]
        return f"ConversationReader({names}, on_bad_row={self.on_bad_row.value!r}, stats={self.stats.as_dict()})"

    def __iter__(self) -> Iterator[Conversation]:
        self.stats._reset()
        for src in self.sources:
            if src.kind == "jsonl":
                yield from self._read_jsonl(src)
            elif src.kind == "parquet":
                yield from self._read_parquet(src)
            else:
                yield from self._read_dataset(src)
        if self.stats.dropped:
            logger.warning(
                "read %d rows, kept %d, skipped %d bad rows: %s",
                self.stats.read,
                self.stats.kept,
                self.stats.num_dropped,
                dict(self.stats.dropped),
            )

    def _drop(self, src: _Source, location: str, bad: _Bad) -> None:
        key = bad.reason.value
        self.stats.dropped[key] = self.stats.dropped.get(key, 0) + 1
        if self.on_bad_row is OnBadRow.ERROR:
            raise BadRowError(src.name, location, bad.reason, bad.detail, bad.fix)

    def _row(self, src: _Source, cid: str, location: str, row: Any) -> Conversation | None:
        self.stats.read += 1
        try:
            messages = _messages(row, self.role_map)
        except _Bad as bad:
            self._drop(src, location, bad)
            return None
        self.stats.kept += 1
        return Conversation(cid, messages)

    def _read_jsonl(self, src: _Source) -> Iterator[Conversation]:
        path: Path = src.target
        opener = gzip.open if path.name.lower().endswith(".gz") else open
        first = True
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                location = f"line {lineno}"
                try:
                    row = json.loads(raw)
                except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                    if first and raw.lstrip()[:1] == b"[":  # an indented JSON array: every line would be bad
                        raise ValueError(
                            f"{src.name} looks like one JSON array, not JSON Lines (one object per line), and "
                            "reading an array would load it whole. Convert it: "
                            f"jq -c '.[]' {src.name} > {Path(src.name).stem}.jsonl"
                        ) from None
                    if isinstance(e, json.JSONDecodeError):
                        detail = f"invalid JSON ({e.msg} at column {e.colno})"
                    else:  # UnicodeDecodeError
                        detail = f"invalid JSON: not UTF-8 text ({e})"
                    self.stats.read += 1
                    self._drop(
                        src,
                        location,
                        _Bad(BadRowReason.INVALID_JSON, detail, "write one complete UTF-8 JSON object per line"),
                    )
                    continue
                finally:
                    first = False
                conv = self._row(src, f"{src.name}:{lineno}", location, row)
                if conv is not None:
                    yield conv

    def _read_parquet(self, src: _Source) -> Iterator[Conversation]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(src.target)
        names = set(pf.schema_arrow.names)
        columns = [c for c in ("messages", "conversations") if c in names]
        if not columns:
            yield from self._missing_column(src, pf.metadata.num_rows, sorted(names))
            return
        index = 0
        for batch in pf.iter_batches(batch_size=self.batch_size, columns=columns):
            for row in batch.to_pylist():
                conv = self._row(src, f"{src.name}[{index}]", f"row {index}", row)
                index += 1
                if conv is not None:
                    yield conv

    def _read_dataset(self, src: _Source) -> Iterator[Conversation]:
        target = src.target
        if isinstance(target, tuple):
            import datasets

            path, split = target
            target = _pick_split(datasets.load_from_disk(str(path)), split, src.name)
        index = 0
        if not hasattr(target, "__len__"):  # an IterableDataset: its columns may be unknown, check each row
            for row in target:
                conv = self._row(src, f"{src.name}[{index}]", f"row {index}", row)
                index += 1
                if conv is not None:
                    yield conv
            return
        names = list(target.column_names or [])
        columns = [c for c in ("messages", "conversations") if c in names]
        if not columns:
            yield from self._missing_column(src, len(target), names)
            return
        # map-style: columnar batches of only the needed columns from the memory-mapped Arrow table
        batches: Iterable[dict[str, list[Any]]] = target.select_columns(columns).iter(batch_size=self.batch_size)
        for batch in batches:
            rows = [dict(zip(columns, vals)) for vals in zip(*(batch[c] for c in columns))]
            for row in rows:
                conv = self._row(src, f"{src.name}[{index}]", f"row {index}", row)
                index += 1
                if conv is not None:
                    yield conv

    def _missing_column(self, src: _Source, num_rows: int, names: list[str]) -> Iterator[Conversation]:
        if num_rows == 0:
            return iter(())
        bad = _Bad(
            BadRowReason.MISSING_MESSAGES,
            f"no 'messages' or 'conversations' column (columns: {names})",
            "add a 'messages' column of {'role', 'content'} lists",
        )
        if self.on_bad_row is OnBadRow.SKIP:  # every row is bad for the same reason: count them at once
            self.stats.read += num_rows
            key = bad.reason.value
            self.stats.dropped[key] = self.stats.dropped.get(key, 0) + num_rows
            return iter(())
        self.stats.read += 1
        self._drop(src, "row 0", bad)
        raise AssertionError("unreachable: _drop raises in error mode")


def read_conversations(
    paths: Any,
    on_bad_row: str | OnBadRow = "error",
    *,
    role_map: Mapping[str, str] | None = None,
    split: str | None = None,
    batch_size: int = 1024,
) -> ConversationReader:
    """Stream the conversations of JSONL, Parquet or Hugging Face dataset sources.

    Args:
        paths: a path, a glob pattern, a list of them, a directory of files, a
            folder written by ``datasets``' ``save_to_disk``, or a ``datasets``
            ``Dataset`` / ``DatasetDict`` / ``IterableDataset`` object.
        on_bad_row: ``"error"`` (raise :class:`BadRowError` naming file, line,
            problem and fix) or ``"skip"`` (count it in ``stats.dropped``).
        role_map: renames roles before checking them, e.g. ``{"bot": "assistant"}``.
        split: the split to read from a ``DatasetDict``.
        batch_size: rows per Parquet / Arrow batch (bounds memory).

    Returns:
        A :class:`ConversationReader`: iterate it for :class:`Conversation`
        objects; its ``stats`` (:class:`ReadStats`) fills in as it goes.

    Missing paths and invalid options fail here, before anything is read.

    >>> import json, pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "chat.jsonl"
    >>> _ = p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
    ...     {"role": "assistant", "content": "hello"}]}) + "\\n" + "{oops\\n")
    >>> reader = read_conversations(p, on_bad_row="skip")
    >>> [c.id.rsplit("/", 1)[-1] for c in reader]
    ['chat.jsonl:1']
    >>> reader.stats
    ReadStats(read=2, kept=1, dropped={'invalid_json': 1})
    """
    mode = choose(OnBadRow, on_bad_row, "on_bad_row")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if role_map is not None:
        bad = {k: v for k, v in role_map.items() if v not in ROLES}
        if bad:
            raise ValueError(f"role_map={bad!r} maps to unknown roles: targets must be one of {sorted(ROLES)}")
    return ConversationReader(_resolve(paths, split), mode, role_map, batch_size)
