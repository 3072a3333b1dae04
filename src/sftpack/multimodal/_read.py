"""Multimodal conversations from JSONL, Parquet and saved Hugging Face datasets (HF multimodal chat format).

:func:`read_multimodal_jsonl` reads JSONL; :func:`read_multimodal` also reads Parquet
files and ``save_to_disk`` folders (or ``datasets`` objects), found as the chat
reader finds them (its ``_resolve``), with image bytes and an ``images`` column;
see its docstring. What follows is the JSONL format; a table row is checked the same way.

One JSON object per line, ``{"messages": [...], "id": ...}``; a message's ``content``
is a string or a list of parts ``{"type": "text", "text": ...}`` and
``{"type": "image", "path": ...}`` (``"image": "<path>"`` is read as a path too).
An image path that is not absolute is relative to the JSONL file's folder, as a
dataset folder ships its images beside the file; a URL (any ``scheme://``, ``file://``
included) is a malformed row, as nothing is downloaded. The record id is
``"name.jsonl:LINE"`` (1-based), so every later error (a missing or undecodable
image, found by :func:`tokenize_multimodal_conversations`) names the file and line.

Accounting as :func:`sftpack.chat.read_conversations`: every non-blank line is
``read`` and lands in ``kept`` or in exactly one ``dropped[reason]`` (the chat
reader's :class:`~sftpack.chat.BadRowReason` values; a content part that is neither
text nor an image with a path counts as ``malformed_message``); ``on_bad_row="error"``
raises :class:`~sftpack.chat.BadRowError` naming the file, the line, the field and
the fix. Images are not opened here: that is the tokenizer's work (counted under
:class:`BadImageReason`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _optional
from .._base import positive_int
from ..chat import BadFileError, BadRowError, BadRowReason, FileProblem
from ..chat._find import _pick_split, _resolve, _Source
from ..chat._options import FileSkipReason
from ..chat._read import _CONTAINER_ERRORS, _describe
from ._images import is_url

__all__ = ["MultimodalReadStats", "read_multimodal", "read_multimodal_jsonl"]

_ROLES = ("system", "user", "assistant")
_SOURCES = ("path", "image", "bytes")


@dataclass
class MultimodalReadStats:
    """``read == kept + sum(dropped.values())``; ``images`` counts the image parts kept.

    :func:`read_multimodal` also fills ``files_skipped`` (reason -> files not read: a
    file of another kind in a folder, an unreadable Parquet file or saved dataset) and
    ``file_problems`` (each of them, and each damaged Parquet tail, by path).
    """

    read: int = 0
    kept: int = 0
    images: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    files_skipped: dict[str, int] = field(default_factory=dict)
    file_problems: list[FileProblem] = field(default_factory=list)


class _Bad(Exception):
    def __init__(self, reason: str, detail: str, fix: str):
        super().__init__(detail)
        self.reason, self.detail, self.fix = reason, detail, fix


def _is_pil(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "convert")


def _source(value: Any, key: str, where: str, base: Path) -> dict:
    """An image value (a path string, bytes, a ``{"bytes", "path"}`` struct as Hugging Face
    stores an ``Image`` feature, or a PIL image) as the source keys of a part."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # an Arrow Image struct
        if value.get("bytes") is not None:
            return {"bytes": value["bytes"]}
        value = value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(value)}
    if _is_pil(value):
        return {"image": value}
    if isinstance(value, str) and value:
        if is_url(value):
            raise _Bad(
                BadRowReason.MALFORMED_MESSAGE.value,
                f"{where}.{key}: a URL {value[:60]!r}",
                "download the image and give its path",
            )
        return {"path": os.fspath(Path(value) if os.path.isabs(value) else base / value)}
    raise _Bad(
        BadRowReason.MALFORMED_MESSAGE.value,
        f"{where}.{key}: a {type(value).__name__}, not a path string or image bytes",
        "give the image as a path string (or bytes)",
    )


def _part(part: Any, where: str, base: Path, images: _Images | None = None) -> tuple[dict, bool]:
    """One content part, its image path resolved; returns (part, is_image). Keys holding
    None (a struct column's absent fields in Parquet / Arrow) are dropped; an image part
    with no source takes the next entry of the row's ``images`` column, if it has one."""
    if isinstance(part, dict):
        part = {k: v for k, v in part.items() if v is not None}
    if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
        raise _Bad(
            BadRowReason.MALFORMED_MESSAGE.value,
            f"{where}: {str(part)[:60]!r} is not a text or image part",
            'write parts as {"type": "text", "text": ...} or {"type": "image", "path": ...}',
        )
    if part["type"] == "text":
        if not isinstance(part.get("text"), str):
            raise _Bad(BadRowReason.NON_STRING_CONTENT.value, f"{where}.text: not a string", "give it a string")
        return part, False
    src = next((k for k in _SOURCES if k in part), None)
    out = {k: v for k, v in part.items() if k not in _SOURCES}
    if src is None:
        if images is None:
            raise _Bad(
                BadRowReason.MALFORMED_MESSAGE.value,
                f"{where}: an image part with no path",
                'give it "path": "<file relative to the data file>", or give the row an \'images\' list',
            )
        out.update(images.take(where, base))
        return out, True
    if src == "bytes" and not isinstance(part[src], (bytes, bytearray, memoryview)):
        out["bytes"] = part[src]  # left to the tokenizer (BadImageError), as read_multimodal_jsonl always did
        return out, True
    out.update(_source(part[src], src, where, base))
    return out, True


class _Images:
    """A row's ``images`` column, handed out to its source-less image parts in order."""

    def __init__(self, values: list):
        self.values, self.used = values, 0

    def take(self, where: str, base: Path) -> dict:
        if self.used >= len(self.values):
            raise _Bad(
                BadRowReason.MALFORMED_MESSAGE.value,
                f"{where}: image part {self.used + 1} without a source, but 'images' has {len(self.values)}",
                "give 'images' one entry per image part without a path",
            )
        value = self.values[self.used]
        self.used += 1
        return _source(value, "image", f"images[{self.used - 1}]", base)


def _row(obj: Any, base: Path) -> tuple[list[dict], int]:
    if not isinstance(obj, dict):
        raise _Bad(BadRowReason.NOT_AN_OBJECT.value, "not a JSON object", 'write {"messages": [...]} per line')
    msgs = obj.get("messages")
    if msgs is None:
        raise _Bad(BadRowReason.MISSING_MESSAGES.value, "no 'messages' field", "give the row a 'messages' list")
    if not isinstance(msgs, list) or not msgs:
        raise _Bad(BadRowReason.EMPTY_MESSAGES.value, "'messages' is empty or not a list", "give it the turns")
    column = obj.get("images")
    if column is not None and not isinstance(column, list):
        raise _Bad(
            BadRowReason.MALFORMED_MESSAGE.value,
            f"'images': a {type(column).__name__}, not a list",
            "give 'images' as a list of paths or image bytes",
        )
    pool = _Images(column) if column is not None else None
    out, images, assistant = [], 0, False
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or "content" not in m:
            raise _Bad(
                BadRowReason.MALFORMED_MESSAGE.value, f"{where}: not a {{role, content}} object", "fix the message"
            )
        role = m.get("role")
        if role not in _ROLES:
            raise _Bad(BadRowReason.UNKNOWN_ROLE.value, f"{where}.role: {role!r}", f"use one of {list(_ROLES)}")
        content = m["content"]
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list) and content:
            parts = []
            for j, p in enumerate(content):
                q, is_img = _part(p, f"{where}.content[{j}]", base, pool)
                if is_img and role == "assistant":
                    raise _Bad(
                        BadRowReason.MALFORMED_MESSAGE.value,
                        f"{where}.content[{j}]: an image in an assistant turn",
                        "move it to a user turn",
                    )
                images += is_img
                parts.append(q)
        else:
            raise _Bad(
                BadRowReason.NON_STRING_CONTENT.value,
                f"{where}.content: a {type(content).__name__}, not a string or a list of parts",
                "give a string or a non-empty list of parts",
            )
        assistant |= role == "assistant"
        out.append({"role": role, "content": parts})
    if not assistant:
        raise _Bad(BadRowReason.NO_ASSISTANT_TURN.value, "no assistant message", "add the answer to train on")
    if pool is not None and pool.used != len(pool.values):
        raise _Bad(
            BadRowReason.MALFORMED_MESSAGE.value,
            f"'images' has {len(pool.values)} entries but {pool.used} image parts without a source take from it",
            "give 'images' exactly one entry per image part without a path",
        )
    return out, images


def read_multimodal_jsonl(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    on_bad_row: str = "error",
    *,
    stats: MultimodalReadStats | None = None,
) -> Iterator[dict]:
    """The conversations of JSONL files, in order: ``{"id": "name.jsonl:LINE", "messages": [...]}``
    (the id names the file and line, whatever id the row holds)
    with every content part a list of parts and image paths made absolute (ready for
    :func:`tokenize_multimodal_conversations`).

    Args:
        paths: one JSONL file or a list of them (read in the order given).
        on_bad_row: ``"error"`` (raise :class:`~sftpack.chat.BadRowError` naming the file,
            line, field and fix) or ``"skip"`` (count it in ``stats.dropped``).
        stats: filled in as the lines are read.

    Raises:
        FileNotFoundError: a path that is not a file (before anything is read).
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    files = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"read_multimodal_jsonl: no file {os.fspath(f)!r}")
    st = stats if stats is not None else MultimodalReadStats()
    return _read(files, on_bad_row, st)


def _read(files: list[Path], on_bad_row: str, st: MultimodalReadStats) -> Iterator[dict]:
    for f in files:
        base = f.resolve().parent
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                st.read += 1
                try:
                    try:
                        obj = json.loads(raw)
                    except (UnicodeDecodeError, json.JSONDecodeError) as e:
                        raise _Bad(
                            BadRowReason.INVALID_JSON.value, f"not valid JSON ({e})", "write one JSON object per line"
                        ) from None
                    messages, images = _row(obj, base)
                except _Bad as bad:
                    st.dropped[bad.reason] = st.dropped.get(bad.reason, 0) + 1
                    if on_bad_row == "error":
                        raise _error(f.name, n, bad) from None
                    continue
                st.kept += 1
                st.images += images
                yield {"id": f"{f.name}:{n}", "messages": messages}


def _error(name: str, line: int, bad: _Bad) -> BadRowError:
    return BadRowError(name, f"line {line}", BadRowReason(bad.reason), bad.detail, bad.fix)


# ---------------------------------------------------------------------------- Parquet and saved datasets


def read_multimodal(
    paths: Any,
    on_bad_row: str = "error",
    *,
    split: str | None = None,
    batch_size: int = 256,
    stats: MultimodalReadStats | None = None,
) -> Iterator[dict]:
    """The conversations of JSONL files, Parquet files and Hugging Face saved datasets, in order.

    The sources are found as :func:`sftpack.chat.read_conversations` finds them (a file,
    a folder searched recursively in sorted order, a glob, a ``save_to_disk`` folder, or
    a ``datasets`` object); JSONL is read as :func:`read_multimodal_jsonl` reads it.
    A Parquet / Arrow row holds a ``messages`` column in the same format, image parts
    giving ``path`` (relative to the Parquet file's folder, or to the saved dataset's
    folder; to the working folder for a ``datasets`` object), ``bytes``, or ``image``
    (a path, bytes, or Hugging Face's ``{"bytes", "path"}`` image struct); and optionally
    an ``images`` column (paths or bytes) that the image parts without a source take
    in order (it must have exactly one entry per such part). Ids are
    ``"name.parquet[ROW]"`` / ``"folder[ROW]"`` (0-based, as the chat reader's), errors
    name ``"row ROW"``.

    Args:
        paths: as for :func:`sftpack.chat.read_conversations`.
        on_bad_row: ``"error"`` (raise :class:`~sftpack.chat.BadRowError` naming the file,
            row, field and fix, or :class:`~sftpack.chat.BadFileError` for a file that
            cannot be read) or ``"skip"`` (count it in ``stats``).
        split: the split to read from a ``DatasetDict``.
        batch_size: rows per Parquet / Arrow batch (bounds memory).
        stats: filled in as the rows are read.

    Raises:
        FileNotFoundError: a path that does not exist (before anything is read).
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    batch_size = positive_int("batch_size", batch_size)
    sources, skipped = _resolve(paths, split)
    st = stats if stats is not None else MultimodalReadStats()
    for problem in skipped:  # found in folders / globs: counted, never raised (as the chat reader)
        st.files_skipped[problem.reason] = st.files_skipped.get(problem.reason, 0) + 1
        st.file_problems.append(problem)
    return _read_sources(sources, on_bad_row, batch_size, st)


def _read_sources(sources: list[_Source], on_bad_row: str, batch_size: int, st: MultimodalReadStats) -> Iterator[dict]:
    for src in sources:
        if src.kind == "jsonl":
            if Path(src.target).name.lower().endswith(".gz"):
                raise ValueError(f"{src.name}: read_multimodal reads plain JSONL; gunzip it first")
            yield from _read([Path(src.target)], on_bad_row, st)
        elif src.kind == "parquet":
            yield from _read_parquet(src, on_bad_row, batch_size, st)
        else:
            yield from _read_dataset(src, on_bad_row, batch_size, st)


def _skip_file(src: _Source, on_bad_row: str, st: MultimodalReadStats, detail: str, fix: str) -> None:
    key = FileSkipReason.UNREADABLE.value
    st.files_skipped[key] = st.files_skipped.get(key, 0) + 1
    st.file_problems.append(FileProblem(src.name, key, detail))
    if on_bad_row == "error":
        raise BadFileError(src.name, FileSkipReason.UNREADABLE, detail, fix)


def _table_rows(
    src: _Source, name: str, base: Path, rows: Iterator[dict], on_bad_row: str, st: MultimodalReadStats, index: int
) -> Iterator[dict]:
    for row in rows:
        st.read += 1
        try:
            messages, images = _row(row, base)
        except _Bad as bad:
            st.dropped[bad.reason] = st.dropped.get(bad.reason, 0) + 1
            if on_bad_row == "error":
                raise BadRowError(src.name, f"row {index}", BadRowReason(bad.reason), bad.detail, bad.fix) from None
        else:
            st.kept += 1
            st.images += images
            yield {"id": f"{name}[{index}]", "messages": messages}
        index += 1


def _missing_messages(src: _Source, num_rows: int, names: list[str], on_bad_row: str, st: MultimodalReadStats) -> None:
    if num_rows == 0:
        return
    key = BadRowReason.MISSING_MESSAGES.value
    read = 1 if on_bad_row == "error" else num_rows  # every row is bad for the same reason: counted at once
    st.read += read
    st.dropped[key] = st.dropped.get(key, 0) + read
    if on_bad_row == "error":
        raise BadRowError(
            src.name,
            "row 0",
            BadRowReason.MISSING_MESSAGES,
            f"no 'messages' column (columns: {names})",
            "add a 'messages' column of {'role', 'content'} lists",
        )


def _read_parquet(src: _Source, on_bad_row: str, batch_size: int, st: MultimodalReadStats) -> Iterator[dict]:
    pq = _optional.parquet()
    path = Path(src.target)
    try:
        pf = pq.ParquetFile(path)
        names = list(pf.schema_arrow.names)
        num_rows = pf.metadata.num_rows
    except _CONTAINER_ERRORS as e:
        _skip_file(
            src,
            on_bad_row,
            st,
            f"not a readable Parquet file ({_describe(e)})",
            "write it again (e.g. pyarrow.parquet.write_table), or remove it",
        )
        return
    if "messages" not in names:
        _missing_messages(src, num_rows, names, on_bad_row, st)
        return
    columns = [c for c in ("messages", "images") if c in names]
    base = path.resolve().parent
    index = 0
    batches = pf.iter_batches(batch_size=batch_size, columns=columns)
    while True:
        try:
            batch = next(batches, None)
            rows = [] if batch is None else batch.to_pylist()
        except _CONTAINER_ERRORS as e:  # a damaged page: the rest of the file is lost, counted by its footer
            lost = max(num_rows - index, 1)
            key = BadRowReason.UNREADABLE_TAIL.value
            detail = f"damaged after row {index - 1}: {_describe(e)}" if index else f"damaged: {_describe(e)}"
            st.read += lost
            st.dropped[key] = st.dropped.get(key, 0) + lost
            st.file_problems.append(FileProblem(src.name, key, detail, lost))
            if on_bad_row == "error":
                raise BadFileError(
                    src.name, BadRowReason.UNREADABLE_TAIL, detail, "restore the file from a good copy"
                ) from e
            return
        if batch is None:
            return
        yield from _table_rows(src, path.name, base, iter(rows), on_bad_row, st, index)
        index += len(rows)


def _read_dataset(src: _Source, on_bad_row: str, batch_size: int, st: MultimodalReadStats) -> Iterator[dict]:
    target = src.target
    base, name = Path.cwd(), src.name
    if isinstance(target, tuple):
        datasets = _optional.datasets()
        folder, split = target
        try:
            loaded = datasets.load_from_disk(str(folder))
        except (OSError, ValueError, EOFError) as e:
            _skip_file(
                src,
                on_bad_row,
                st,
                f"not a readable saved dataset ({_describe(e)})",
                "save it again with save_to_disk, or point at its data files",
            )
            return
        target = _pick_split(loaded, split, src.name)
        base, name = Path(folder).resolve(), Path(folder).name
    if not hasattr(target, "__len__"):  # an IterableDataset: rows as it gives them (images decoded)
        yield from _table_rows(src, name, base, iter(target), on_bad_row, st, 0)
        return
    names = list(target.column_names or [])
    if "messages" not in names:
        _missing_messages(src, len(target), names, on_bad_row, st)
        return
    columns = [c for c in ("messages", "images") if c in names]
    # Arrow batches, not decoded rows: image features stay {"bytes", "path"} structs
    index = 0
    for table in target.select_columns(columns).with_format("arrow").iter(batch_size=batch_size):
        rows = table.to_pylist()
        yield from _table_rows(src, name, base, iter(rows), on_bad_row, st, index)
        index += len(rows)
