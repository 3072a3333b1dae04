"""Reading conversations from files, streaming, with every rejected row and file accounted for.

(One reader whose file kinds share one set of accounting steps, ``_drop`` /
``_skip_file`` / ``_lose_tail``, which keep ``read == kept + sum(dropped)`` true
at every moment; split per format, each piece would need the reader's counters
handed around. Finding the files is ``_find``'s part; what a pass reports, its
counts and the error of a file it cannot read, ``_read_stats``'s.)

File kinds (chosen by file name):

* ``*.jsonl``, ``*.json``, ``*.ndjson`` (``.gz`` too): one JSON object per line
  (id ``"chat.jsonl:17"``, the line, 1-based), or one JSON array of them.
* ``*.parquet``: the rows' columns (``messages``...); id ``"chat.parquet[16]"``
  (row, 0-based).
* Hugging Face ``datasets``: the same columns, from a ``save_to_disk`` folder
  or a ``Dataset`` / ``DatasetDict`` / ``IterableDataset`` object; id
  ``"folder[16]"`` or ``"dataset[16]"``.

Folders and globs: a folder is searched **recursively**, in sorted path order
(so the ids and the output are the same on every machine); a sub-folder written
by ``save_to_disk`` is read as a dataset, not searched. A glob is expanded with
``**`` matching any depth. Nothing found there is dropped without a word: a
file of another kind is counted in ``stats.files_skipped["unsupported_format"]``
and a hidden entry (``.git``, ``.DS_Store``) under ``"hidden"``, each listed in
``stats.file_problems``; an image or video file (``.png``, ``.jpg``, ``.mp4``...)
is the data's media, not a data file, counted in ``stats.media_files``. A file
named explicitly must be of a known kind.

Which files a path, folder or glob names, and of which kind, is ``_find``'s
part. A row holds ``messages``, ShareGPT ``conversations``, Alpaca, TRL
prompt/completion or ``text`` fields, detected per row (``_rows`` has the checks;
``stats.formats`` counts the kept rows of each); a row of another format than its
file's first row is a bad row (``mixed_formats``), ``messages`` and ShareGPT aside.
A table (Parquet, a dataset) is read from the columns of the first format it has.
Contents may be lists of ``{"type": "text"}`` / ``{"type": "image"}`` parts
(``_rows`` has the rules): a conversation of text parts only reads as text (each
content joined into one string); one with images keeps its parts, each image's
``path`` made absolute against the data file's folder (a saved dataset's folder;
the working folder for a ``datasets`` object) and, unless ``allow_outside_images``,
required to lie in it or in the folder whose search found the file (else the row
is bad, ``image_outside_data_dir``), an ``images`` column handed to the
source-less image parts in order, and ``stats.images`` counting the image parts
kept. Such a conversation is left unchecked for the text tokenizer (which refuses
image parts); the multimodal tokenizer takes it.

Memory stays bounded whatever the file size: JSONL is read line by line,
Parquet one record batch at a time (``batch_size`` rows of only the needed
columns), a saved dataset through its memory-mapped Arrow files. A file holding
one JSON array (``[{...}, {...}]``) is the exception: read whole (``_json_array``),
each element a row (id ``"chat.json[3]"``, located by the line it starts on),
whatever the first element is (one that is not an object is a bad row,
``not_an_object``); one that does not parse is skipped as ``malformed_json``. Other files that are not
JSON Lines are told apart from bad rows by their first 64 KiB and first rows (a
UTF-16 byte order mark or zero bytes, line ends that are bare CRs, an indented
object), so a pretty-printed object is one explained file (with the ``jq`` line
that converts it), not 12 ``invalid_json`` rows.

Accounting: every non-blank line (or table row) is ``read``; each then lands in
``kept`` or in exactly one ``dropped[reason]`` (the first problem found), so
``read == kept + sum(dropped.values())`` holds at every moment, also after a
:class:`BadRowError` was raised (the row that raised is counted as dropped).
A container damaged part-way (a ``.gz`` cut short or with a bad checksum, a
Parquet page that does not decode) keeps the rows read before the damage and
counts the rest under ``dropped["unreadable_tail"]``: Parquet knows how many
rows were lost (its footer), a compressed stream does not, so its tail counts
as one row. A file that yields nothing (not gzip, not Parquet, 0 bytes, no
permission, one of the non-JSONL kinds above) counts under
``stats.files_skipped[reason]`` and is not a row. In ``on_bad_row="error"``
mode each of these raises :class:`BadFileError` naming the file, what is wrong
and the fix instead.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import _optional
from .._base import positive_int
from ..sample import Conversation
from ._bad_row import BadRowError, RowProblem
from ._find import FileProblem, _pick_split, _resolve, _Source
from ._json_array import MalformedArray, array_items
from ._options import BadRowReason, FileSkipReason, OnBadRow, RowFormat, choose
from ._parts import DataFolder
from ._read_stats import BadFileError, ReadStats
from ._rows import _CHAT_LISTS, FORMAT_FIELDS, GROUP_FIELD, ROLES, WEIGHT_FIELDS, _read_row, detect_format

__all__ = ["ConversationReader", "read_conversations"]

logger = logging.getLogger("sftpack.chat")

_SNIFF = 1 << 16  # bytes looked at to tell a JSON Lines file from other text
#: What a damaged container raises while it is read: gzip EOFError, BadGzipFile (an
#: OSError), zlib.error; pyarrow ArrowInvalid (a ValueError), OSError.
_GZIP_ERRORS = (OSError, EOFError, zlib.error)
_CONTAINER_ERRORS = (*_GZIP_ERRORS, ValueError)


# ---------------------------------------------------------------------------- sources


class _NotJsonl(Exception):
    """Internal: the file is text, but not JSON Lines."""

    def __init__(self, reason: FileSkipReason, detail: str, fix: str):
        super().__init__(detail)
        self.reason, self.detail, self.fix = reason, detail, fix


def _sniff(head: bytes, name: str) -> None:
    """Raise :class:`_NotJsonl` if the first bytes show UTF-16/32 text or CR-only line ends."""
    stem = Path(name).name
    utf16 = head.startswith((b"\xff\xfe", b"\xfe\xff"))
    if not utf16 and len(head) >= 4:  # no byte order mark: ASCII in UTF-16 has a zero in every other byte
        utf16 = (head[1] == 0 and head[3] == 0) or (head[0] == 0 and head[2] == 0)
    if utf16:
        raise _NotJsonl(
            FileSkipReason.UTF16,
            "is UTF-16 (or UTF-32) text, not UTF-8",
            f"convert it: iconv -f UTF-16 -t UTF-8 {name} > {stem}.utf8.jsonl",
        )
    if b"\r" in head and b"\n" not in head:
        raise _NotJsonl(
            FileSkipReason.CR_LINE_ENDINGS,
            "ends its lines with a bare CR (classic Mac line ends), so it reads as one line",
            f"convert them: tr '\\r' '\\n' < {name} > {stem}.lf.jsonl",
        )


def _document(name: str, what: str, array: bool) -> _NotJsonl:
    out = f"{Path(name).name.split('.')[0]}.jsonl"
    fix = f"jq -c '.[]' {name} > {out}" if array else f"jq -c . {name} > {out} (or jq -c '.KEY[]' for a list under KEY)"
    return _NotJsonl(
        FileSkipReason.JSON_DOCUMENT,
        f"looks like one JSON {what}, not JSON Lines (one object per line), and reading it would load it whole",
        f"convert it: {fix}",
    )


def _breaks_off(raw: bytes, err: json.JSONDecodeError) -> bool:
    """Whether the line is the start of a JSON value that goes on on later lines."""
    if raw.strip()[:1] not in (b"{", b"["):
        return False
    return err.pos >= len(raw.decode("utf-8", "replace").rstrip())


def _parse(raw: bytes) -> Any:
    """``json.loads``, with a decoder recursion (thousands of nested levels) as a ValueError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply for the JSON decoder (thousands of levels)") from None


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
        skipped: list[FileProblem] | None = None,
        *,
        media_files: int = 0,
        allow_outside_images: bool = False,
    ):
        self.sources = sources
        self.on_bad_row = on_bad_row
        self.role_map = dict(role_map) if role_map is not None else None
        self.batch_size = batch_size
        self.skipped_in_folders = list(skipped or [])
        self.media_files = media_files
        self.allow_outside_images = allow_outside_images
        self.stats = ReadStats()
        self._first: tuple[RowFormat, str] | None = None  # the format of the file's first row, and where
        for problem in self.skipped_in_folders:  # known before the first pass
            self.stats._skip_file(problem)
        self.stats.media_files = media_files

    def __repr__(self) -> str:
        names = [s.name for s in self.sources]
        return f"ConversationReader({names}, on_bad_row={self.on_bad_row.value!r}, stats={self.stats.as_dict()})"

    def __iter__(self) -> Iterator[Conversation]:
        self.stats._reset()
        for problem in self.skipped_in_folders:
            self.stats._skip_file(problem)
        self.stats.media_files = self.media_files
        for src in self.sources:
            self._first = None
            if src.kind == "jsonl":
                yield from self._read_jsonl(src)
            elif src.kind == "parquet":
                yield from self._read_parquet(src)
            else:
                yield from self._read_dataset(src)
        s = self.stats
        if s.dropped or s.files_skipped:
            # the counts are the caller's (ReadStats); the commands print them
            words = ", ".join(f"{k} {v:,}" for k, v in sorted(s.dropped.items())) or "none"
            files = ", ".join(f"{k} {v:,}" for k, v in sorted(s.files_skipped.items())) or "none"
            logger.debug(
                "read %s rows, kept %s; left out %s bad rows (%s); files not read: %s",
                f"{s.read:,}",
                f"{s.kept:,}",
                f"{s.num_dropped:,}",
                words,
                files,
            )

    # -- accounting

    def _drop(self, src: _Source, location: str, bad: RowProblem) -> None:
        key = bad.reason.value
        self.stats.dropped[key] = self.stats.dropped.get(key, 0) + 1
        if self.on_bad_row is OnBadRow.ERROR:
            raise BadRowError(src.name, location, bad.reason, bad.detail, bad.fix)

    def _folder(self, src: _Source, base: Path) -> DataFolder:
        """The data folder of ``src``'s rows: ``base``, the folder their media paths are relative to;
        their media must lie in it (or in the folder whose search found the file), unless allowed."""
        if self.allow_outside_images:
            return DataFolder(base)
        within = [os.path.realpath(base)]
        if src.root is not None:
            within.append(os.path.realpath(src.root))
        return DataFolder(base, tuple(dict.fromkeys(within)))

    def _row(self, src: _Source, cid: str, location: str, row: Any, base: DataFolder) -> Conversation | None:
        """One row: a conversation, or counted (raised) as bad. ``base``: the data folder (image paths)."""
        self.stats.read += 1
        try:
            fmt = detect_format(row)
            first = self._first
            if fmt is not None and first is not None and fmt is not first[0] and {fmt, first[0]} != _CHAT_LISTS:
                raise RowProblem(
                    BadRowReason.MIXED_FORMATS,
                    f"a {fmt.value} row, but the file's first row ({first[1]}) is {first[0].value}",
                    f"keep one format per file: write this row as {first[0].value} too, or move it to a file of its own",
                )
            messages, images, fmt = _read_row(row, self.role_map, base=base)
        except RowProblem as bad:
            self._drop(src, location, bad)
            return None
        except (TypeError, ValueError, RecursionError) as e:  # a value no check foresaw: still one bad row
            self._drop(
                src,
                location,
                RowProblem(
                    BadRowReason.MALFORMED_MESSAGE,
                    f"unusable row ({type(e).__name__}: {e})",
                    "write messages as {'role': str, 'content': str} objects",
                ),
            )
            return None
        self.stats.kept += 1
        self.stats.formats[fmt.value] = self.stats.formats.get(fmt.value, 0) + 1
        if self._first is None:
            self._first = (fmt, location)
        self.stats.images += images
        # with images, the text tokenizer's checks must run (and refuse it); the multimodal one takes it
        return Conversation(cid, messages, checked=not images)

    def _skip_file(self, src: _Source, reason: FileSkipReason, detail: str, fix: str) -> None:
        self.stats._skip_file(FileProblem(src.name, reason.value, detail))
        if self.on_bad_row is OnBadRow.ERROR:
            raise BadFileError(src.name, reason, detail, fix)

    def _lose_tail(self, src: _Source, after: str, error: BaseException, rows: int) -> None:
        """Count the unreadable rest of a damaged file (``rows``: how many, where known)."""
        detail = f"damaged after {after}: {_describe(error)}"
        key = BadRowReason.UNREADABLE_TAIL.value
        self.stats.read += rows
        self.stats.dropped[key] = self.stats.dropped.get(key, 0) + rows
        self.stats.file_problems.append(FileProblem(src.name, key, detail, rows))
        if self.on_bad_row is OnBadRow.ERROR:
            raise BadFileError(
                src.name, BadRowReason.UNREADABLE_TAIL, detail, "restore the file from a good copy (or re-download it)"
            ) from error

    # -- JSON Lines

    def _read_jsonl(self, src: _Source) -> Iterator[Conversation]:
        path: Path = src.target
        gz = path.name.lower().endswith(".gz")
        opener = gzip.open if gz else open
        try:
            with opener(path, "rb") as f:
                head = f.read(_SNIFF)
        except _GZIP_ERRORS as e:  # not gzip, no permission...; damage further in is found again below
            if not (gz and (isinstance(e, (EOFError, zlib.error)) or _is_crc(e))):
                self._skip_file(src, FileSkipReason.UNREADABLE, _describe(e), _container_fix(gz))
                return
            head = b""
        try:
            _sniff(head, src.name)
        except _NotJsonl as e:
            self._skip_file(src, e.reason, e.detail, e.fix)
            return
        # the file's kind is the file's: one JSON array (starts with "[" and parses whole as one array,
        # whatever its elements) or JSON Lines (of arrays, too: more than one value)
        array = head.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"["
        if array:
            try:
                items = self._array(src, opener)
            except _NotJsonl as e:
                self._skip_file(src, e.reason, e.detail, e.fix)
                return
            if items is not None:
                yield from self._array_rows(src, items, self._folder(src, path.resolve().parent))
                return
        self.stats.files_read += 1
        rows_before = self.stats.read
        self._last_line = 0
        try:
            with opener(path, "rb") as f:
                yield from self._jsonl_rows(src, f, self._folder(src, path.resolve().parent))
        except _NotJsonl as e:
            self.stats.files_read -= 1
            self._skip_file(src, e.reason, e.detail, e.fix)
        except _GZIP_ERRORS as e:
            if self.stats.read == rows_before:  # nothing came out: the file is unreadable, not a tail
                self.stats.files_read -= 1
                self._skip_file(src, FileSkipReason.UNREADABLE, _describe(e), _container_fix(gz))
                return
            self._lose_tail(src, f"line {self._last_line}", e, 1)

    def _array(self, src: _Source, opener: Any) -> list[tuple[int, Any]] | None:
        """The elements of a JSON array file, each a row (an element that is no object is a bad row,
        counted under its reason); None: not one JSON value (JSON Lines whose lines are arrays), or
        damaged (the JSON Lines path reports it); raises :class:`_NotJsonl` for an array that does
        not parse."""
        try:
            with opener(src.target, "rb") as f:
                data = f.read()
        except _GZIP_ERRORS:
            return None
        try:
            items = array_items(data)
        except MalformedArray as e:
            raise _NotJsonl(
                FileSkipReason.MALFORMED_JSON,
                f"is a JSON array that does not parse: {e}",
                f"fix the JSON there (python -m json.tool {src.name} shows the spot)",
            ) from None
        return items

    def _array_rows(self, src: _Source, items: list[tuple[int, Any]], base: DataFolder) -> Iterator[Conversation]:
        self.stats.files_read += 1
        for index, (line, row) in enumerate(items):
            conv = self._row(src, f"{src.name}[{index}]", f"item {index} (line {line})", row, base)
            if conv is not None:
                yield conv

    def _jsonl_rows(self, src: _Source, f: Any, base: DataFolder) -> Iterator[Conversation]:
        self._last_line = 0
        lines = enumerate(f, 1)
        pending: list[tuple[int, bytes]] = []  # a line read ahead to tell a document from a bad first row
        first = True
        while True:
            if pending:
                lineno, raw = pending.pop()
            else:
                nxt = next(lines, None)
                if nxt is None:
                    return
                lineno, raw = nxt
            self._last_line = lineno
            if not raw.strip():
                continue
            location = f"line {lineno}"
            try:
                row = _parse(raw)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too deep
                if first and isinstance(e, json.JSONDecodeError) and _breaks_off(raw, e):
                    ahead = self._next_nonblank(lines)
                    # an indented document: line 1 opens it ("{" / "["), line 2 (indented) does not parse either
                    if (
                        ahead is not None
                        and not _parses(ahead[1])
                        and (raw.strip() in (b"{", b"[") or ahead[1][:1] in (b" ", b"\t"))
                    ):
                        array = raw.strip()[:1] == b"["
                        raise _document(
                            src.name, "array" if array else "object spread over several lines", array
                        ) from None
                    if ahead is not None:
                        pending.append(ahead)
                first = False
                if isinstance(e, json.JSONDecodeError):
                    detail = f"invalid JSON ({e.msg} at column {e.colno})"
                elif isinstance(e, UnicodeDecodeError):
                    detail = f"invalid JSON: not UTF-8 text ({e})"
                else:
                    detail = f"invalid JSON: {e}"
                self.stats.read += 1
                self._drop(
                    src,
                    location,
                    RowProblem(BadRowReason.INVALID_JSON, detail, "write one complete UTF-8 JSON object per line"),
                )
                continue
            if first and isinstance(row, list) and row and isinstance(row[0], dict):
                raise _document(src.name, f"array of objects ({len(row)}) on one line", True)
            first = False
            conv = self._row(src, f"{src.name}:{lineno}", location, row, base)
            if conv is not None:
                yield conv

    @staticmethod
    def _next_nonblank(lines: Iterator[tuple[int, bytes]]) -> tuple[int, bytes] | None:
        for lineno, raw in lines:
            if raw.strip():
                return lineno, raw
        return None

    # -- Parquet

    def _read_parquet(self, src: _Source) -> Iterator[Conversation]:
        pq = _optional.parquet()
        try:
            pf = pq.ParquetFile(src.target)
            names = set(pf.schema_arrow.names)
            num_rows = pf.metadata.num_rows
        except _CONTAINER_ERRORS as e:
            self._skip_file(
                src,
                FileSkipReason.UNREADABLE,
                f"not a readable Parquet file ({_describe(e)})",
                "write it again (e.g. pyarrow.parquet.write_table), or remove it",
            )
            return
        self.stats.files_read += 1
        columns = _columns(names)
        if not columns:
            yield from self._missing_column(src, num_rows, sorted(names))
            return
        base = self._folder(src, Path(src.target).resolve().parent)
        index = 0
        batches = pf.iter_batches(batch_size=self.batch_size, columns=columns)
        while True:
            rows: list[Any] = []  # free the last batch's rows before the next is decoded
            try:
                batch = next(batches, None)
                rows = [] if batch is None else batch.to_pylist()
            except _CONTAINER_ERRORS as e:
                self._lose_tail(src, f"row {index - 1}" if index else "its footer", e, max(num_rows - index, 1))
                return
            if batch is None:
                return
            for row in rows:
                conv = self._row(src, f"{src.name}[{index}]", f"row {index}", row, base)
                index += 1
                if conv is not None:
                    yield conv

    # -- datasets

    def _read_dataset(self, src: _Source) -> Iterator[Conversation]:
        target = src.target
        folder = Path.cwd()  # a datasets object's image paths: relative to the working folder
        if isinstance(target, tuple):
            datasets = _optional.datasets()
            path, split = target
            folder = Path(path).resolve()
            try:
                loaded = datasets.load_from_disk(str(path))
            except (OSError, ValueError, EOFError) as e:
                self._skip_file(
                    src,
                    FileSkipReason.UNREADABLE,
                    f"not a readable saved dataset ({_describe(e)})",
                    "save it again with save_to_disk, or point at its data files",
                )
                return
            target = _pick_split(loaded, split, src.name)
        base = self._folder(src, folder)
        self.stats.files_read += 1
        index = 0
        if not hasattr(target, "__len__"):  # an IterableDataset: its columns may be unknown, check each row
            for row in target:
                conv = self._row(src, f"{src.name}[{index}]", f"row {index}", row, base)
                index += 1
                if conv is not None:
                    yield conv
            return
        names = list(target.column_names or [])
        columns = _columns(names)
        if not columns:
            yield from self._missing_column(src, len(target), names)
            return
        # map-style: Arrow batches of only the needed columns from the memory-mapped table (not
        # decoded rows: an Image feature stays its {"bytes", "path"} struct)
        batches: Iterable[Any] = target.select_columns(columns).with_format("arrow").iter(batch_size=self.batch_size)
        for batch in batches:
            rows = batch.to_pylist()
            for row in rows:
                conv = self._row(src, f"{src.name}[{index}]", f"row {index}", row, base)
                index += 1
                if conv is not None:
                    yield conv

    def _missing_column(self, src: _Source, num_rows: int, names: list[str]) -> Iterator[Conversation]:
        if num_rows == 0:
            return iter(())
        bad = RowProblem(
            BadRowReason.MISSING_MESSAGES,
            f"no 'messages' column, nor another known format's (columns: {names})",
            "add a 'messages' column of {'role', 'content'} lists (or ShareGPT 'conversations', 'prompt' and "
            "'completion', 'prompt' / 'chosen' / 'rejected' pairs, Alpaca 'instruction' and 'output', or 'text')",
        )
        if self.on_bad_row is OnBadRow.SKIP:  # every row is bad for the same reason: count them at once
            self.stats.read += num_rows
            key = bad.reason.value
            self.stats.dropped[key] = self.stats.dropped.get(key, 0) + num_rows
            return iter(())
        self.stats.read += 1
        self._drop(src, "row 0", bad)
        raise AssertionError("unreachable: _drop raises in error mode")


def _columns(names: Iterable[str]) -> list[str]:
    """The columns a table's rows are read from: those of the first format (in
    :func:`~._rows.detect_format`'s order) whose deciding column the table has, and
    ``weight`` / ``advantage`` and ``group`` where the table has them."""
    have = set(names)
    fields = _format_columns(have)
    return fields + [c for c in (*WEIGHT_FIELDS, GROUP_FIELD) if c in have] if fields else []


def _format_columns(have: set[str]) -> list[str]:
    if have & {"messages", "conversations"}:  # both read: a row takes whichever it fills
        return [c for c in ("messages", "conversations", "images") if c in have]
    if have & {"chosen", "rejected"} and "completion" not in have:
        return [c for c in FORMAT_FIELDS[RowFormat.PREFERENCE] if c in have]
    for fmt, deciding in (
        (RowFormat.PROMPT_COMPLETION, {"prompt", "completion"}),
        (RowFormat.ALPACA, {"instruction", "output"}),
        (RowFormat.TEXT, {"text"}),
    ):
        if have & deciding:
            return [c for c in FORMAT_FIELDS[fmt] if c in have]
    return []


def _parses(raw: bytes) -> bool:
    try:
        _parse(raw)
    except ValueError:
        return False
    return True


def _is_crc(e: BaseException) -> bool:
    return isinstance(e, gzip.BadGzipFile) and "CRC" in str(e)


def _describe(e: BaseException) -> str:
    if isinstance(e, EOFError):
        return "the compressed stream ends before its end marker (the file was cut short)"
    if isinstance(e, gzip.BadGzipFile):
        return f"not a valid gzip stream ({e})"
    if isinstance(e, zlib.error):
        return f"corrupt compressed data ({e})"
    if isinstance(e, PermissionError):
        return "no permission to read it"
    return f"{type(e).__name__}: {e}"


def _container_fix(gz: bool) -> str:
    if gz:
        return "check it with gzip -t; re-compress it (gzip -c file.jsonl > file.jsonl.gz) or drop the .gz suffix"
    return "make it readable (chmod), or remove it"


def read_conversations(
    paths: Any,
    on_bad_row: str | OnBadRow = "error",
    *,
    role_map: Mapping[str, str] | None = None,
    split: str | None = None,
    batch_size: int = 1024,
    allow_outside_images: bool = False,
) -> ConversationReader:
    """Stream the conversations of JSONL (or JSON array), Parquet or Hugging Face dataset sources.

    Each row's format is detected from its fields (:class:`~sftpack.chat.RowFormat`:
    ``messages``, ShareGPT, Alpaca, prompt/completion, ``text``; one per file) and
    counted in ``stats.formats``.

    Args:
        paths: a path, a glob pattern (``**`` matches any depth), a list of them,
            a directory (searched recursively, in sorted order; other files are
            counted in ``stats.files_skipped``), a folder written by ``datasets``'
            ``save_to_disk``, or a ``datasets`` ``Dataset`` / ``DatasetDict`` /
            ``IterableDataset`` object.
        on_bad_row: ``"error"`` (raise :class:`BadRowError` naming file, line,
            problem and fix, or :class:`BadFileError` for a file that cannot be
            read) or ``"skip"`` (count it in ``stats.dropped`` or
            ``stats.files_skipped``; never raises for the data).
        role_map: renames roles before checking them, e.g. ``{"bot": "assistant"}``.
        split: the split to read from a ``DatasetDict``.
        batch_size: rows per Parquet / Arrow batch (bounds memory).
        allow_outside_images: read image and video files outside the data folder. By
            default a media path (absolute, ``../``, or through a symlink) whose file is
            not in the data file's folder (or in the folder searched that found the file;
            a saved dataset's folder; the working folder for a ``datasets`` object) makes
            its row bad, ``image_outside_data_dir``: a dataset from elsewhere cannot pull
            other files of this machine into the output.

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
    >>> reader.stats.as_dict()
    {'read': 2, 'kept': 1, 'dropped': {'invalid_json': 1}, 'formats': {'messages': 1}}
    """
    mode = choose(OnBadRow, on_bad_row, "on_bad_row")
    batch_size = positive_int("batch_size", batch_size)
    if role_map is not None:
        bad = {k: v for k, v in role_map.items() if v not in ROLES}
        if bad:
            raise ValueError(f"role_map={bad!r} maps to unknown roles: targets must be one of {sorted(ROLES)}")
    found = _resolve(paths, split)
    return ConversationReader(
        found.sources,
        mode,
        role_map,
        batch_size,
        found.skipped,
        media_files=found.media,
        allow_outside_images=bool(allow_outside_images),
    )
