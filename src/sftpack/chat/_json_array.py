"""A file holding one JSON array of rows (``[{...}, {...}]``), read item by item with each item's line.

The reader takes such a file like JSON Lines: each item is a row, named by its
index (``"chat.json[3]"``) and located by the line it starts on, so a bad row's
error points into the file. The file is read whole (a JSON document has no
line-by-line form): memory grows with its size, a few times the bytes for the
parsed rows. For files larger than memory, JSON Lines stays the streamed form.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MalformedArray", "array_items"]

_WS = re.compile(r"[ \t\n\r]*")


class MalformedArray(ValueError):
    """The document starts as an array but does not parse: ``line``, ``column`` (1-based), ``msg``."""

    def __init__(self, msg: str, line: int, column: int):
        super().__init__(f"{msg} at line {line} column {column}")
        self.msg, self.line, self.column = msg, line, column


def _where(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def array_items(data: bytes) -> list[tuple[int, Any]] | None:
    """``(line, value)`` of each item of the JSON array ``data`` holds, in order.

    Returns None when the bytes hold more than one JSON value (JSON Lines whose
    lines are arrays: not one document). Raises :class:`MalformedArray` where the
    document breaks off or holds invalid JSON (or is not UTF-8).

    >>> array_items(b'[{"text": "a"},\\n {"text": "b"}]')
    [(1, {'text': 'a'}), (2, {'text': 'b'})]
    >>> array_items(b'[1]\\n[2]\\n') is None
    True
    """
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise MalformedArray(f"not UTF-8 text ({e.reason})", line, e.start - data.rfind(b"\n", 0, e.start)) from None
    decoder = json.JSONDecoder()
    pos = _WS.match(text, 0).end()  # type: ignore[union-attr]
    if text[pos : pos + 1] != "[":
        raise MalformedArray("the document is not an array", *_where(text, pos))
    pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
    items: list[tuple[int, Any]] = []
    line, counted = 1, 0
    closed = text[pos : pos + 1] == "]"
    pos += closed
    while not closed:
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise MalformedArray(e.msg, e.lineno, e.colno) from None
        except RecursionError:
            raise MalformedArray("nested too deeply for the JSON decoder", *_where(text, pos)) from None
        items.append((line, value))
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
        nxt = text[pos : pos + 1]
        if nxt == "]":
            pos, closed = pos + 1, True
        elif nxt == ",":
            pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
        else:
            msg = "the array is not closed (the file ends)" if not nxt else "expected ',' or ']' after an item"
            raise MalformedArray(msg, *_where(text, pos))
    if _WS.match(text, pos).end() != len(text):  # type: ignore[union-attr]
        return None
    return items
