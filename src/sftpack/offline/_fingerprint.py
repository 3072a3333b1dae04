"""Fingerprints: what a prepack was built from, so a mismatched trainer is refused.

A prepack's rows are only right for the tokenizer, row width and pad multiple
they were built with. The manifest records all of it, and each part gets a
SHA-256 so two prepacks (or a prepack and a trainer) can be compared without
the files:

- the tokenizer: the fast tokenizer's full serialisation (vocabulary, merges,
  normaliser, added tokens), its chat template and its special tokens
  (hashing the serialisation costs in proportion to the vocabulary);
- the inputs: each file's name, size and SHA-256 (a saved dataset folder: every
  file in it, in sorted order); the embedded corpus by its package file;
- the options: ``max_seq_len``, pad multiple, algorithm, seed, over-long and
  ``train_on`` policies, and the sftpack version.

The digest of all of that is ``fingerprint["sha256"]``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .. import _optional
from .._types import Tokenizer
from ._format import digest, file_sha256

__all__ = ["digest", "input_fingerprints", "pad_id_of", "tokenizer_fingerprint"]


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, Any]:
    """What identifies a tokenizer for packing: a hash of its content, chat template
    and special tokens, plus readable facts (vocabulary size, pad id).

    Two tokenizers with equal ``sha256`` produce the same ids, masks and padding.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"{type(tokenizer).__name__} is not a Hugging Face fast tokenizer: a prepack fingerprints the fast "
            "tokenizer's serialisation"
        )
    content = backend.to_str()
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = json.dumps(template, sort_keys=True)
    specials = {k: str(v) for k, v in sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())}
    h = hashlib.sha256()
    for part in (content, template or "", json.dumps(specials, sort_keys=True)):
        h.update(hashlib.sha256(part.encode("utf-8")).digest())
    return {
        "sha256": h.hexdigest(),
        "content_sha256": hashlib.sha256(content.encode("utf-8")).hexdigest(),
        "chat_template_sha256": hashlib.sha256((template or "").encode("utf-8")).hexdigest(),
        "special_tokens": specials,
        "vocab_size": len(tokenizer),
        "pad_id": pad_id_of(tokenizer),
        "name_or_path": str(getattr(tokenizer, "name_or_path", "") or ""),
    }


def pad_id_of(tokenizer: Tokenizer) -> int:
    """The id padding slots hold: the tokenizer's pad token, else its end-of-sequence
    token, else 0 (padding is never a target and never attended to by real tokens)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int) and value >= 0:
            return value
    return 0


def _hash_path(path: Path) -> dict[str, Any]:
    if path.is_dir():
        h = hashlib.sha256()
        size = 0
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            rel = f.relative_to(path).as_posix()
            h.update(rel.encode() + b"\0" + bytes.fromhex(file_sha256(f)))
            size += f.stat().st_size
        return {"name": str(path), "size": size, "sha256": h.hexdigest()}
    return {"name": str(path), "size": path.stat().st_size, "sha256": file_sha256(path)}


def input_fingerprints(sources: Any) -> list[dict[str, Any]]:
    """Name, size and SHA-256 of each input.

    ``sources`` is a :class:`~sftpack.chat.ConversationReader` (its resolved
    files, globs expanded, in reading order), a list of paths, or ``None`` for
    the embedded corpus.
    """
    if sources is None:
        path = Path(str(_optional.chitchat_dataset().__file__)).parent / "dataset.json"
        entry = _hash_path(path)
        entry["name"] = "sftpack.data.default_corpus (chitchat_dataset/dataset.json)"
        return [entry]
    out = []
    for src in getattr(sources, "sources", sources):
        target = getattr(src, "target", src)
        if isinstance(target, tuple):  # a saved dataset folder and its split
            target = target[0]
        if isinstance(target, (str, os.PathLike)):
            out.append(_hash_path(Path(target)))
        else:  # an in-memory datasets object: its own fingerprint, if it has one
            fp = getattr(target, "_fingerprint", None)
            out.append({"name": getattr(src, "name", "dataset"), "size": None, "sha256": fp})
    return out
