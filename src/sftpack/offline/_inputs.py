"""The inputs of a prepack, the same for every engine: what they are, what they hash to,
and what reading them counted.

:func:`open_inputs` sorts what the caller passed into one of three kinds and
gives the conversations to tokenize (``limit`` applied) with the input part of
the fingerprint:

- ``None``: the embedded corpus (:func:`sftpack.data.default_corpus`), fingerprinted
  by its package file and the ``limit``;
- paths (files, folders, globs, saved datasets) or a
  :class:`~sftpack.chat.ConversationReader`: read by a reader, each file
  fingerprinted by name, size and SHA-256 before it is read;
- any other iterable of conversations: hashed as it streams (ids and messages),
  so its fingerprint is known once it has been read.

:func:`reading_counts` turns the reader's and the tokenizer's statistics into the
manifest's ``read`` / ``kept`` / ``dropped`` / ``overlong`` counts, and
:func:`check_out_outside_inputs` refuses an output folder that the next run
would read as input.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from ..chat import ConversationReader, OnBadRow, read_conversations
from ..data import _corpus, default_corpus
from ._fingerprint import input_fingerprints
from ._format import PrepackError

__all__ = [
    "Inputs",
    "KnownLength",
    "input_total",
    "check_inputs_found",
    "check_out_outside_inputs",
    "is_paths",
    "open_image_inputs",
    "open_inputs",
    "reading_counts",
]

#: The tokenizer statistics the counts read (missing ones count 0: an engine that read nothing).
_TOKENIZE_KEYS = (
    "conversations",
    "fit",
    "truncated",
    "split",
    "dropped",
    "tokens",
    "tokens_lost",
    "trainable_tokens_lost",
    "no_trainable",
)


def is_paths(inputs: object) -> bool:
    """Whether ``inputs`` is read by a :class:`~sftpack.chat.ConversationReader` (paths or a ``datasets`` object)."""
    if isinstance(inputs, (str, os.PathLike)):
        return True
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(p, (str, os.PathLike)) for p in inputs):
        return True
    return type(inputs).__module__.startswith("datasets.")


class Hashing:
    """Passes conversations through, hashing their ids and messages (for iterable inputs)."""

    def __init__(self, items: Iterable[Any]):
        self.items = items
        self.h = hashlib.sha256()
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            cid = getattr(item, "id", None)
            msgs = getattr(item, "messages", item.get("messages") if isinstance(item, dict) else item)
            self.h.update(json.dumps([cid, msgs], sort_keys=True, default=str).encode())
            self.count += 1
            yield item

    def fingerprint(self) -> dict[str, Any]:
        return {"name": "<iterable>", "size": self.count, "sha256": self.h.hexdigest()}


@dataclass(frozen=True)
class Inputs:
    """The inputs sorted out (see the module docstring).

    Attributes:
        conversations: what to tokenize, ``limit`` applied (read once).
        reader: the reader of path inputs (its stats count what was read), else ``None``.
        limit: the ``limit`` asked for.
        files: the input fingerprint known before reading (``[]`` for an iterable).
        hashing: the hashing pass-through of an iterable, else ``None``.
    """

    conversations: Iterable[Any]
    reader: ConversationReader | None
    limit: int | None
    files: list[dict[str, Any]]
    hashing: Hashing | None = None

    def fingerprint(self) -> list[dict[str, Any]]:
        """The manifest's ``fingerprint["inputs"]`` (for an iterable: once it has been read)."""
        return [self.hashing.fingerprint()] if self.hashing is not None else self.files


def open_inputs(inputs: Any, *, on_bad_row: OnBadRow | str, limit: int | None) -> Inputs:
    """Sort ``inputs`` into one of the three kinds (see the module docstring)."""
    if inputs is None:
        files = input_fingerprints(None)
        files[0]["limit"] = limit
        return Inputs(default_corpus(limit), None, limit, files)
    if isinstance(inputs, ConversationReader) or is_paths(inputs):
        reader = inputs if isinstance(inputs, ConversationReader) else read_conversations(inputs, on_bad_row=on_bad_row)
        conversations: Iterable[Any] = reader if limit is None else islice(reader, limit)
        return Inputs(conversations, reader, limit, input_fingerprints(reader))
    hashing = Hashing(inputs if limit is None else islice(inputs, limit))
    return Inputs(hashing, None, limit, [], hashing)


def open_image_inputs(inputs: Any, *, limit: int | None) -> Inputs:
    """The inputs of a prepack with images: an iterable of conversations (Hugging Face's multimodal
    chat format, e.g. :func:`sftpack.multimodal.vqa_corpus` or :func:`sftpack.chat.read_conversations`),
    hashed as it streams."""
    if inputs is None or isinstance(inputs, ConversationReader) or is_paths(inputs):
        what = "no inputs (the embedded corpus is text)" if inputs is None else "paths"
        raise ValueError(
            f"a prepack with images takes an iterable of conversations, got {what}: read files with "
            "sftpack.chat.read_conversations(paths) and pass the conversations it yields"
        )
    hashing = Hashing(inputs if limit is None else islice(inputs, limit))
    return Inputs(hashing, None, limit, [], hashing)


def reading_counts(read: dict[str, Any] | None, tokenize: dict[str, Any]) -> dict[str, Any]:
    """The manifest counts that reading and tokenizing give.

    A conversation the tokenizer skipped (``on_bad_row="skip"``: the template refused it, it
    holds no trainable token...) is not kept: it is counted in ``dropped`` under its reason,
    beside the reader's, so ``read == kept + sum(dropped)`` whoever left it out.

    Args:
        read: the reader's ``read`` / ``kept`` / ``dropped`` (``None`` when no reader
            read: every conversation tokenized was read).
        tokenize: the tokenizer's statistics (:class:`~sftpack.chat.TokenizeStats` as a dict).
    """
    st = {k: int(tokenize.get(k, 0)) for k in _TOKENIZE_KEYS}
    skipped = {k: int(v) for k, v in (tokenize.get("skipped") or {}).items() if v}
    formats: dict[str, int] = {}
    if read is not None:
        read_n, kept, dropped = int(read.get("read", 0)), int(read.get("kept", 0)), dict(read.get("dropped", {}))
        if read.get("formats"):  # the rows kept of each format, messages included
            formats = dict(sorted(read["formats"].items()))
    else:
        read_n, kept, dropped = st["conversations"], st["conversations"], {}
    for reason, n in skipped.items():
        dropped[reason] = dropped.get(reason, 0) + n
    head = {"read": read_n, "kept": kept - sum(skipped.values()), "dropped": dict(sorted(dropped.items()))}
    if formats:
        head["formats"] = formats
    special = {"special_text": int(tokenize.get("special_text", 0))} if tokenize.get("special_text") else {}
    return {
        **head,
        **special,
        "overlong": {
            "tokenized": st["conversations"] - sum(skipped.values()),
            "fit": st["fit"],
            "truncated": st["truncated"],
            "split": st["split"],
            "dropped": st["dropped"],
        },
        "tokens_lost": st["tokens_lost"],
        "trainable_tokens_lost": st["trainable_tokens_lost"],
        "tokens_rendered": st["tokens"] + st["tokens_lost"],
        "no_trainable": st["no_trainable"],
    }


def check_inputs_found(inputs: Any) -> None:
    """Path inputs found before the job starts: a missing file (or a glob or folder with no
    data file) raises what the reader raises, naming the path (``FileNotFoundError`` /
    ``ValueError``), instead of surfacing while the rows are staged, where it would read as
    a failed write of the output."""
    if inputs is None or isinstance(inputs, ConversationReader) or not is_paths(inputs):
        return
    if type(inputs).__module__.startswith("datasets."):
        return
    given = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if any(not os.path.exists(p) and not glob.has_magic(os.fspath(p)) for p in given):
        read_conversations(given, on_bad_row="skip")  # finds the files (reads none): the reader's own error


def check_out_outside_inputs(inputs: Any, out: str | os.PathLike[str]) -> None:
    """Refuse an output folder inside an input folder (a folder is read recursively, so the
    next run would read the prepack's own files as conversations), an input inside the output,
    or the output given as an input."""
    if inputs is None or not is_paths(inputs) or type(inputs).__module__.startswith("datasets."):
        return
    given = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    target = Path(out).resolve()
    for p in given:
        text = os.fspath(p)
        found = sorted(glob.glob(text, recursive=True)) if not os.path.exists(text) and glob.has_magic(text) else [text]
        for f in found:
            src = Path(f).resolve()
            if src == target or src.is_relative_to(target):
                raise PrepackError(
                    f"the input {f} is inside --out {out}: a prepack's own files are not conversations; "
                    "name the inputs without the output folder, or choose an --out outside them"
                )
            if Path(f).is_dir() and target.is_relative_to(src):
                raise PrepackError(
                    f"--out {out} is inside the input folder {f}, which is read recursively: the next run would "
                    "read the prepack's own files as input; choose an --out outside it"
                )


class KnownLength:
    """``items`` with a known ``len`` (the tokenize bar's total, for its rate and ETA)."""

    def __init__(self, items: Iterable[Any], total: int):
        self.items, self.total = items, total

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)


def _source_rows(src: Any) -> int | None:
    """Rows in one reader source without reading them: a JSONL file's lines (not gzip'd),
    a Parquet file's metadata, a dataset's length; None when not known cheaply."""
    if src.kind == "dataset":
        return len(src.target) if hasattr(src.target, "__len__") else None
    path = Path(src.target)
    if src.kind == "parquet":
        import pyarrow.parquet as pq  # optional: pyarrow (the chat extra) only for Parquet inputs

        return int(pq.ParquetFile(path).metadata.num_rows)
    if path.suffix == ".gz":
        return None
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def input_total(inputs: Any, reader: Any, limit: int | None) -> int | None:
    """How many conversations (rows) stage 1 will read, for the tokenize bar: the rows of a
    reader's files, the embedded corpus's (``inputs`` None), an input's ``len``; None when not known without
    reading them. Rows the reader drops as bad are in it, so a bar may end below it."""
    n: int | None
    if reader is not None:
        counts = [_source_rows(src) for src in reader.sources]
        n = None if None in counts else sum(c for c in counts if c is not None)
    elif inputs is None:
        n = len(_corpus())
    else:
        n = len(inputs) if hasattr(inputs, "__len__") else None
    return n if limit is None or n is None else min(n, limit)
