"""One row of a chat file: its schema, its validation, and the error a bad row raises.

A row holds OpenAI-style ``messages`` (``[{"role": ..., "content": ...}]``) or
ShareGPT ``conversations`` (``[{"from": "human", "value": ...}]``, mapped to roles:
human/user -> user, gpt/assistant/model/chatgpt/bard/bing -> assistant,
system -> system, tool/function/observation -> tool). Checks run in a fixed order
and the first failure is the row's one reason (:class:`BadRowReason`), so every
rejected row is counted exactly once. Every JSON value in every field reaches a
check (a role that is a list or an object is a bad row, not a ``TypeError``), so
nothing but a :class:`BadRowError` (or a count) ever comes out of a row. Each message error states what is wrong
*and* the fix, because a user reading ``line 48113: ...`` should not need the
source code to repair the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._options import BadRowReason

__all__ = ["ROLES", "SHAREGPT_ROLES", "BadRowError", "validate_messages"]

#: Roles a message may have once read (after ``role_map`` / the ShareGPT mapping).
ROLES = frozenset({"system", "user", "assistant", "tool"})

#: ShareGPT ``from`` values and the role each becomes.
SHAREGPT_ROLES: Mapping[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

_SKIP_HINT = "or pass on_bad_row='skip' to leave such rows out (each counted in stats.dropped)"


class BadRowError(ValueError):
    """A row that cannot be used, in ``on_bad_row='error'`` mode.

    Attributes: ``source`` (file or dataset, or ``"conversation 'id'"`` when
    the tokenizer finds it), ``location`` (``"line 7"`` / ``"row 6"``, or empty),
    ``reason`` (:class:`BadRowReason`), ``detail`` and ``fix``.
    """

    def __init__(self, source: str, location: str, reason: BadRowReason, detail: str, fix: str):
        self.source, self.location, self.reason, self.detail, self.fix = source, location, reason, detail, fix
        where = f"{source}, {location}" if location else source
        super().__init__(f"{where}: {detail} [{reason.value}]. Fix: {fix}; {_SKIP_HINT}.")

    def __reduce__(self) -> Any:  # picklable across worker processes
        return (type(self), (self.source, self.location, self.reason, self.detail, self.fix))


class _Bad(Exception):
    """Internal: why a row is unusable (turned into a count or a BadRowError)."""

    def __init__(self, reason: BadRowReason, detail: str, fix: str):
        super().__init__(detail)
        self.reason, self.detail, self.fix = reason, detail, fix


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string", bool: "boolean"}.get(type(value), type(value).__name__)


def _is_text(s: str) -> bool:
    """Whether ``s`` encodes as UTF-8: JSON's ``"\\ud800"`` escapes give lone surrogates,
    which no tokenizer accepts."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate_messages(row: Any, role_map: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Check one row and return its messages as ``[{"role": ..., "content": ...}, ...]``.

    ``row`` is a parsed row (a dict with ``messages`` or ShareGPT ``conversations``)
    or a bare list of messages. Keys other than role and content are kept, except
    those whose value is null. Raises ``ValueError`` naming the problem and its fix.

    >>> validate_messages({"conversations": [{"from": "human", "value": "hi"},
    ...                                      {"from": "gpt", "value": "hello"}]})
    [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]
    """
    try:
        return _messages(row, role_map, allow_list=True)
    except _Bad as bad:
        raise ValueError(f"{bad.detail} [{bad.reason.value}]. Fix: {bad.fix}") from None


def _messages(row: Any, role_map: Mapping[str, str] | None, allow_list: bool = False) -> list[dict[str, Any]]:
    sharegpt = False
    if allow_list and isinstance(row, list):
        msgs: Any = row
    elif not isinstance(row, dict):
        raise _Bad(
            BadRowReason.NOT_AN_OBJECT,
            f"the row is a JSON {_type_name(row)}, not an object",
            'write one object per line: {"messages": [{"role": "user", "content": "..."}, ...]} '
            "(a file holding one JSON array converts with jq -c '.[]')",
        )
    elif row.get("messages") is not None:
        msgs = row["messages"]
    elif row.get("conversations") is not None:
        msgs, sharegpt = row["conversations"], True
    else:
        keys = ", ".join(repr(k) for k in list(row)[:8]) or "none"
        raise _Bad(
            BadRowReason.MISSING_MESSAGES,
            f"no 'messages' field (the row's keys: {keys})",
            "give the row a 'messages' list of {'role', 'content'} objects "
            "(or ShareGPT 'conversations' of {'from', 'value'})",
        )
    field_name = "conversations" if sharegpt else "messages"
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if not isinstance(msgs, list):
        raise _Bad(
            BadRowReason.MALFORMED_MESSAGE,
            f"'{field_name}' is a {_type_name(msgs)}, expected a list of objects",
            f"make '{field_name}' a list of {{'{role_key}', '{content_key}'}} objects",
        )
    if not msgs:
        raise _Bad(
            BadRowReason.EMPTY_MESSAGES,
            f"'{field_name}' is empty",
            "remove the row, or give it at least a user and an assistant message",
        )
    out: list[dict[str, Any]] = []
    has_assistant = False
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _Bad(
                BadRowReason.MALFORMED_MESSAGE,
                f"message {i} is a {_type_name(m)}, expected an object",
                f"write each message as {{'{role_key}': ..., '{content_key}': ...}}",
            )
        rk = role_key if role_key in m else "role"
        ck = content_key if content_key in m else "content"
        if rk not in m:
            raise _Bad(
                BadRowReason.MALFORMED_MESSAGE,
                f"message {i} has no '{role_key}'",
                f"give every message a '{role_key}'",
            )
        if ck not in m:
            raise _Bad(
                BadRowReason.MALFORMED_MESSAGE,
                f"message {i} has no '{content_key}'",
                f"give every message a '{content_key}'",
            )
        raw_role, content = m[rk], m[ck]
        if not isinstance(raw_role, str):
            raise _Bad(
                BadRowReason.UNKNOWN_ROLE,
                f"message {i} has a {_type_name(raw_role)} '{rk}' ({_short(raw_role)}), expected a string",
                f"write the '{rk}' as a string: one of {', '.join(sorted(ROLES))}",
            )
        role = raw_role
        if role_map is not None and raw_role in role_map:
            role = role_map[raw_role]
        elif sharegpt:
            role = SHAREGPT_ROLES.get(raw_role.lower(), raw_role)
        if role not in ROLES:
            known = ", ".join(sorted(ROLES))
            raise _Bad(
                BadRowReason.UNKNOWN_ROLE,
                f"message {i} has role {_short(raw_role)}, which is not one of {known}",
                f"map it with role_map={{{raw_role!r}: 'assistant'}} (or 'user', ...)",
            )
        if not isinstance(content, str):
            raise _Bad(
                BadRowReason.NON_STRING_CONTENT,
                f"message {i} ({role}) has a {_type_name(content)} content, expected a string",
                "flatten the content to one string (e.g. join the text parts)",
            )
        if not content.strip():
            raise _Bad(
                BadRowReason.EMPTY_CONTENT,
                f"message {i} ({role}) has an empty content",
                "remove the empty message or the row",
            )
        if not _is_text(content):
            raise _Bad(
                BadRowReason.INVALID_TEXT,
                f"message {i} ({role}) holds a lone surrogate (an unpaired \\ud800-\\udfff escape), not text",
                "fix the escape (a character outside the BMP is a surrogate *pair*) or remove the row",
            )
        has_assistant = has_assistant or role == "assistant"
        if sharegpt or rk != "role" or ck != "content":
            extra = {k: v for k, v in m.items() if k not in (rk, ck) and v is not None}
            out.append({"role": role, "content": content, **extra})
        else:
            out.append({k: v for k, v in m.items() if v is not None} | {"role": role})
    if not has_assistant:
        raise _Bad(
            BadRowReason.NO_ASSISTANT_TURN,
            f"none of the {len(out)} messages is from the assistant: nothing to train on",
            "remove the row, or add the assistant's answer",
        )
    return out
