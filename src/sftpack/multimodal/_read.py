"""Multimodal conversations from JSONL files (Hugging Face multimodal chat format).

One JSON object per line, ``{"messages": [...], "id": ...}``; a message's ``content``
is a string or a list of parts ``{"type": "text", "text": ...}`` and
``{"type": "image", "path": ...}`` (``"image": "<path>"`` is read as a path too).
An image path that is not absolute is relative to the JSONL file's folder, as a
dataset folder ships its images beside the file. The record id is
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

from ..chat import BadRowError, BadRowReason

__all__ = ["MultimodalReadStats", "read_multimodal_jsonl"]

_ROLES = ("system", "user", "assistant")
_SOURCES = ("path", "image", "bytes")


@dataclass
class MultimodalReadStats:
    """``read == kept + sum(dropped.values())``; ``images`` counts the image parts kept."""

    read: int = 0
    kept: int = 0
    images: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


class _Bad(Exception):
    def __init__(self, reason: str, detail: str, fix: str):
        super().__init__(detail)
        self.reason, self.detail, self.fix = reason, detail, fix


def _part(part: Any, where: str, base: Path) -> tuple[dict, bool]:
    """One content part, its image path resolved; returns (part, is_image)."""
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
    src = next((k for k in _SOURCES if part.get(k) is not None), None)
    if src is None:
        raise _Bad(
            BadRowReason.MALFORMED_MESSAGE.value,
            f"{where}: an image part with no path",
            'give it "path": "<file relative to the JSONL>"',
        )
    out = dict(part)
    if src in ("path", "image") and isinstance(part[src], str):
        p = part[src]
        if p.startswith(("http://", "https://")):
            raise _Bad(
                BadRowReason.MALFORMED_MESSAGE.value,
                f"{where}.{src}: a URL {p[:60]!r}",
                "download the image and give its path",
            )
        out.pop("image", None)
        out["path"] = os.fspath(Path(p) if os.path.isabs(p) else base / p)
    elif src != "bytes":
        raise _Bad(
            BadRowReason.MALFORMED_MESSAGE.value, f"{where}.{src}: not a path string", "give the image as a path string"
        )
    return out, True


def _row(obj: Any, base: Path) -> tuple[list[dict], int]:
    if not isinstance(obj, dict):
        raise _Bad(BadRowReason.NOT_AN_OBJECT.value, "not a JSON object", 'write {"messages": [...]} per line')
    msgs = obj.get("messages")
    if msgs is None:
        raise _Bad(BadRowReason.MISSING_MESSAGES.value, "no 'messages' field", "give the row a 'messages' list")
    if not isinstance(msgs, list) or not msgs:
        raise _Bad(BadRowReason.EMPTY_MESSAGES.value, "'messages' is empty or not a list", "give it the turns")
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
                q, is_img = _part(p, f"{where}.content[{j}]", base)
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
