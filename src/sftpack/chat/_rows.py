"""One row of a chat file: its schema, its validation, and the error a bad row raises.

A row holds OpenAI-style ``messages`` (``[{"role": ..., "content": ...}]``) or
ShareGPT ``conversations`` (``[{"from": "human", "value": ...}]``, mapped to roles:
human/user -> user, gpt/assistant/model/chatgpt/bard/bing -> assistant,
system -> system, tool/function/observation -> tool), or one of the other
formats SFT data comes in, each detected from its fields (:func:`detect_format`,
:class:`RowFormat` says how each renders): Alpaca ``instruction`` / ``input`` /
``output`` / ``system`` (messages for the chat template), TRL's prompt/completion
(strings: plain text; lists of messages: the chat template, the prompt never
trained), TRL's preference pairs (``prompt`` / ``chosen`` / ``rejected``, read as a
:class:`PreferencePair`) and plain ``text``. The ones not rendered by the chat template's usual
rule come as :class:`FormattedMessages`, a list of messages that carries how. Checks run in a fixed order
and the first failure is the row's one reason (:class:`BadRowReason`), so every
rejected row is counted exactly once. Every JSON value in every field reaches a
check (a role that is a list or an object is a bad row, not a ``TypeError``), so
nothing but a :class:`BadRowError` (or a count) ever comes out of a row. Each message error states what is wrong
*and* the fix, because a user reading ``line 48113: ...`` should not need the
source code to repair the file.

Content parts (text, image and video parts, their sources resolved against the data
folder) are :mod:`._parts`'s; the errors a bad row raises, :mod:`._bad_row`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ._bad_row import BadRowError, RowProblem, _is_text, _short, _type_name
from ._options import BadRowReason, RowFormat
from ._parts import DataFolder, _images_column, _is_image_part, _parts

__all__ = [
    "FORMAT_FIELDS",
    "ROLES",
    "SHAREGPT_ROLES",
    "BadRowError",
    "FormattedMessages",
    "PreferencePair",
    "detect_format",
    "validate_messages",
]

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
    except RowProblem as bad:
        raise ValueError(f"{bad.detail} [{bad.reason.value}]. Fix: {bad.fix}") from None


def _messages(row: Any, role_map: Mapping[str, str] | None, allow_list: bool = False) -> list[dict[str, Any]]:
    """The row's checked messages, each content a string (the tokenizer's checks; see :func:`_read_row`)."""
    return _read_row(row, role_map, allow_list)[0]


def _read_row(
    row: Any,
    role_map: Mapping[str, str] | None,
    allow_list: bool = False,
    base: DataFolder | None = None,
) -> tuple[list[dict[str, Any]], int, RowFormat]:
    """The row's checked messages, its number of image parts and its format; raises :class:`RowProblem`.

    ``base`` (the reader's: the data file's folder) accepts content parts, image paths
    relative to its ``path`` and kept within its ``within``; without it (the tokenizer's checks) a content must be a string.
    """
    if allow_list and isinstance(row, FormattedMessages):  # checked again as the row it was read from
        row = row.as_row()
    if allow_list and isinstance(row, list):
        out, images = _chat_list(row, "messages", False, role_map, base, None)
        return out, images, RowFormat.MESSAGES
    weight, group = row_weight(row), row_group(row)
    messages, images, fmt = _read_fields(row, role_map, base)
    # the row's own fields that ride on its messages (a pair carries neither)
    for name, value, reason, what in (
        (
            "group",
            group,
            BadRowReason.BAD_GROUP,
            "a 'group': a pair is a group of its own (its chosen and rejected answers)",
        ),
        ("weight", weight, BadRowReason.BAD_WEIGHT, "a 'weight' / 'advantage': pairs are not weighted (yet)"),
    ):
        if value is None:
            continue
        if isinstance(messages, PreferencePair):
            raise RowProblem(reason, f"a preference pair has {what}", "remove the field from the pair's row")
        if not isinstance(messages, FormattedMessages):
            messages = FormattedMessages(messages, fmt)
        setattr(messages, name, value)
    return messages, images, fmt


def _read_fields(
    row: Any, role_map: Mapping[str, str] | None, base: DataFolder | None
) -> tuple[list[dict[str, Any]], int, RowFormat]:
    """:func:`_read_row` of a row that is not a bare list: its format's fields, checked."""
    if not isinstance(row, dict):
        raise RowProblem(
            BadRowReason.NOT_AN_OBJECT,
            f"the row is a JSON {_type_name(row)}, not an object",
            "make each row one object (a line of a JSON Lines file, or an element of a JSON array file): "
            '{"messages": [{"role": "user", "content": "..."}, ...]}',
        )
    fmt = detect_format(row)
    if fmt is None:
        keys = ", ".join(repr(k) for k in list(row)[:8]) or "none"
        raise RowProblem(
            BadRowReason.MISSING_MESSAGES,
            f"no 'messages' field, nor another known format's (the row's keys: {keys})",
            "give the row a 'messages' list of {'role', 'content'} objects (or ShareGPT 'conversations' of "
            "{'from', 'value'}, 'prompt' and 'completion', 'prompt' / 'chosen' / 'rejected' pairs, Alpaca "
            "'instruction' and 'output', or 'text')",
        )
    if fmt is RowFormat.ALPACA:
        return _alpaca(row), 0, fmt
    if fmt is RowFormat.TEXT:
        text = _string(row, "text", "the text to train on")
        return FormattedMessages([{"role": "assistant", "content": text}], fmt, template=False), 0, fmt
    if fmt is RowFormat.PROMPT_COMPLETION:
        prompt = _string(row, "prompt", "the prompt (may be empty)", empty=True)
        completion = _string(row, "completion", "the text to train on")
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return FormattedMessages(msgs, fmt, template=False, prompt_messages=1), 0, fmt
    if fmt is RowFormat.CONVERSATIONAL_PROMPT_COMPLETION:
        return _conversational(row, role_map, base), 0, fmt
    if fmt in _PAIRS:
        return _preference(row, fmt, role_map, base), 0, fmt
    sharegpt = fmt is RowFormat.SHAREGPT
    msgs = row["conversations"] if sharegpt else row["messages"]
    out, images = _chat_list(msgs, "conversations" if sharegpt else "messages", sharegpt, role_map, base, row)
    tools = checked_tools(row)
    if tools is not None:
        return FormattedMessages(out, fmt, tools=tools), images, fmt
    return out, images, fmt


def _chat_list(
    msgs: Any,
    field_name: str,
    sharegpt: bool,
    role_map: Mapping[str, str] | None,
    base: DataFolder | None,
    images_of: dict[str, Any] | None,
    need_assistant: bool = True,
) -> tuple[list[dict[str, Any]], int]:
    """A list of messages (``field_name`` of the row), checked; and its number of image parts.
    ``images_of``: the row whose ``images`` list feeds image parts without a source."""
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if not isinstance(msgs, list):
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE,
            f"'{field_name}' is a {_type_name(msgs)}, expected a list of objects",
            f"make '{field_name}' a list of {{'{role_key}', '{content_key}'}} objects",
        )
    if not msgs:
        raise RowProblem(
            BadRowReason.EMPTY_MESSAGES,
            f"'{field_name}' is empty",
            "remove the row, or give it at least a user and an assistant message",
        )
    pool = _images_column(images_of) if base is not None and images_of is not None else None
    out: list[dict[str, Any]] = []
    parts_of: list[list[dict[str, Any]] | None] = []  # each message's parts, where it gave a list
    images = 0
    has_assistant = False
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"message {i} is a {_type_name(m)}, expected an object",
                f"write each message as {{'{role_key}': ..., '{content_key}': ...}}",
            )
        rk = role_key if role_key in m else "role"
        ck = content_key if content_key in m else "content"
        if rk not in m:
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"message {i} has no '{role_key}'",
                f"give every message a '{role_key}'",
            )
        if ck not in m and not m.get("tool_calls"):
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"message {i} has no '{content_key}'",
                f"give every message a '{content_key}'",
            )
        raw_role, content = m[rk], m[ck] if ck in m else None
        if not isinstance(raw_role, str):
            raise RowProblem(
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
            raise RowProblem(
                BadRowReason.UNKNOWN_ROLE,
                f"message {i} has role {_short(raw_role)}, which is not one of {known}",
                f"rename it in the data to one of {known} (in Python: role_map={{{raw_role!r}: 'assistant'}})",
            )
        if m.get("weight") is not None:
            _number(m["weight"], f"message {i} ({role}).weight", what="the turn's weight in the loss")
            if role != "assistant":
                raise RowProblem(
                    BadRowReason.BAD_WEIGHT,
                    f"message {i} ({role}) has a 'weight', but only the assistant's turns are trained",
                    "move the weight to the assistant turn it is about, or remove it",
                )
        calls = None
        if m.get("tool_calls") is not None:
            calls = checked_tool_calls(m["tool_calls"], i, role)
            if content is None or (isinstance(content, str) and not content.strip()):
                content = ""  # a turn that only calls tools: its calls are what the template writes
        parts: list[dict[str, Any]] | None = None
        n_images = 0
        if isinstance(content, list) and content and base is not None:
            parts, n_images = _parts(content, f"{field_name}[{i}].{ck}", role, base, pool)
            if not n_images:  # text only: one string, as if it had been written as one
                content = "".join(p["text"] for p in parts)
        elif isinstance(content, list) and base is None and any(_is_image_part(p) for p in content):
            raise RowProblem(
                BadRowReason.NON_STRING_CONTENT,
                f"message {i} ({role}) holds image or video parts: this is the text path, which reads text only",
                "tokenize conversations with images with sftpack.multimodal.tokenize_media_conversations",
            )
        if n_images:
            for j, p in enumerate(parts or ()):
                if p["type"] == "text" and not _is_text(p["text"]):
                    raise RowProblem(
                        BadRowReason.INVALID_TEXT,
                        f"{field_name}[{i}].{ck}[{j}].text holds a lone surrogate (an unpaired \\ud800-\\udfff "
                        "escape), not text",
                        "fix the escape (a character outside the BMP is a surrogate *pair*) or remove the row",
                    )
        elif not isinstance(content, str):
            if isinstance(content, list) and not content and base is not None:
                raise RowProblem(
                    BadRowReason.NON_STRING_CONTENT,
                    f"message {i} ({role}) has an empty list content, expected a string or a list of parts",
                    'give a string or a non-empty list of {"type": "text"|"image", ...} parts',
                )
            raise RowProblem(
                BadRowReason.NON_STRING_CONTENT,
                f"message {i} ({role}) has a {_type_name(content)} content, expected a string",
                "flatten the content to one string (e.g. join the text parts)",
            )
        elif not content.strip() and calls is None:
            raise RowProblem(
                BadRowReason.EMPTY_CONTENT,
                f"message {i} ({role}) has an empty content",
                "remove the empty message or the row",
            )
        elif not _is_text(content):
            raise RowProblem(
                BadRowReason.INVALID_TEXT,
                f"message {i} ({role}) holds a lone surrogate (an unpaired \\ud800-\\udfff escape), not text",
                "fix the escape (a character outside the BMP is a surrogate *pair*) or remove the row",
            )
        images += n_images
        has_assistant = has_assistant or role == "assistant"
        parts_of.append(parts)
        if sharegpt or rk != "role" or ck != "content":
            extra = {k: v for k, v in m.items() if k not in (rk, ck) and v is not None}
            out.append({"role": role, "content": content, **extra})
        else:
            out.append({k: v for k, v in m.items() if v is not None} | {"role": role, "content": content})
        if calls is not None:
            out[-1]["tool_calls"] = calls
    if need_assistant and not has_assistant:
        raise RowProblem(
            BadRowReason.NO_ASSISTANT_TURN,
            f"none of the {len(out)} messages is from the assistant: nothing to train on",
            "remove the row, or add the assistant's answer",
        )
    if pool is not None and pool.used != len(pool.values):
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE,
            f"'images' has {len(pool.values)} entries but {pool.used} image parts without a source take from it",
            "give 'images' exactly one entry per image part without a path",
        )
    if images:  # a conversation with images: every content a list of parts
        for msg, parts in zip(out, parts_of):
            msg["content"] = parts if parts is not None else [{"type": "text", "text": msg["content"]}]
    return out, images


# ---------------------------------------------------------------------------- weights

#: The row fields that weigh a whole conversation in the loss (``advantage``: the RL spelling).
WEIGHT_FIELDS = ("weight", "advantage")


def _number(value: Any, where: str, *, what: str) -> float:
    """``value`` as a finite float, else a :class:`RowProblem` (``bad_weight``) naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RowProblem(
            BadRowReason.BAD_WEIGHT,
            f"{where} is a {_type_name(value)} ({_short(value)}), expected a number",
            f"write {where.rsplit('.', 1)[-1] if '.' in where else where} as a JSON number ({what}), e.g. 0.5",
        )
    out = float(value)
    if out != out or out in (float("inf"), float("-inf")):
        raise RowProblem(
            BadRowReason.BAD_WEIGHT,
            f"{where} is {value!r}, not a finite number",
            f"give a finite number ({what}; 0 leaves the tokens out of the loss), or remove the row",
        )
    return out


def row_weight(row: Any) -> float | None:
    """A row's ``weight`` or ``advantage`` (one number for the whole conversation, any sign),
    checked; ``None`` when it has neither (a null counts as absent).

    >>> row_weight({"messages": [], "advantage": -0.5}), row_weight({"messages": []})
    (-0.5, None)
    """
    if not isinstance(row, dict):
        return None
    given = [k for k in WEIGHT_FIELDS if row.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise RowProblem(
            BadRowReason.BAD_WEIGHT,
            "the row has both 'weight' and 'advantage'",
            "keep one: 'weight' (an importance weight) or 'advantage' (RL), both read as the conversation's weight",
        )
    return _number(row[given[0]], f"'{given[0]}'", what="the conversation's weight in the loss")


#: The row field naming the group a conversation belongs to (an RL / GRPO prompt's completions).
GROUP_FIELD = "group"


def row_group(row: Any) -> str | int | None:
    """A row's ``group``: the prompt an RL completion belongs to (a non-empty string or an
    integer), checked; ``None`` when it has none (a null counts as absent). The conversations
    of one group are kept whole by the packers and averaged together by
    ``weight_normalisation="group"``.

    >>> row_group({"messages": [], "group": "q7"}), row_group({"messages": [], "group": 3}), row_group({})
    ('q7', 3, None)
    """
    if not isinstance(row, dict) or row.get(GROUP_FIELD) is None:
        return None
    value = row[GROUP_FIELD]
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise RowProblem(
            BadRowReason.BAD_GROUP,
            f"'group' is {'an empty string' if value == '' else f'a {_type_name(value)} ({_short(value)})'}, "
            "expected a non-empty string or an integer",
            "write 'group' as the id of the prompt the completion answers, a string or an integer, e.g. \"q7\"",
        )
    return value


# ---------------------------------------------------------------------------- tools

_CALL_FIX = (
    'write each call as {"type": "function", "function": {"name": "...", "arguments": {...}}} '
    '(OpenAI\'s form; {"name": ..., "arguments": ...} is read too)'
)


def _json_object(value: Any, where: str, fix: str) -> Any:
    """``value``, or the JSON it holds when it is a string (tools and arguments are often stored so)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise RowProblem(BadRowReason.MALFORMED_MESSAGE, f"{where} is a string that is not JSON ({e})", fix) from None


def checked_tool_calls(calls: Any, i: int, role: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked and in one form: ``[{"type": "function",
    "function": {"name": str, "arguments": dict}}, ...]`` (arguments stored as a JSON string are
    parsed, as chat templates write them with ``tojson``); ``i`` and ``role`` name the message in
    the :class:`RowProblem` raised for calls that are malformed or not an assistant's."""
    where = f"message {i} ({role}).tool_calls"
    if role != "assistant":
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE, f"{where}: only an assistant turn calls tools", "move the calls"
        )
    if not isinstance(calls, list) or not calls:
        raise RowProblem(BadRowReason.MALFORMED_MESSAGE, f"{where} is not a non-empty list", _CALL_FIX)
    out = []
    for j, call in enumerate(calls):
        f = call.get("function", call) if isinstance(call, dict) else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(f, dict) or not isinstance(name, str) or not name:
            raise RowProblem(BadRowReason.MALFORMED_MESSAGE, f"{where}[{j}] has no function name", _CALL_FIX)
        args = _json_object(f.get("arguments", {}), f"{where}[{j}].arguments", _CALL_FIX)
        if not isinstance(args, dict):
            raise RowProblem(BadRowReason.MALFORMED_MESSAGE, f"{where}[{j}].arguments is not an object", _CALL_FIX)
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def checked_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The row's ``tools`` column (a list of JSON-schema objects, or that list as a JSON string),
    checked: ``None`` when absent or empty, else the list; a :class:`RowProblem` when malformed."""
    fix = 'give \'tools\' as a list of {"type": "function", "function": {"name": ..., "parameters": {...}}} schemas'
    tools = _json_object(row.get("tools"), "'tools'", fix)
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE, f"'tools' is a {_type_name(tools)}, not a list of objects", fix
        )
    return tools


# ---------------------------------------------------------------------------- the other formats

#: The two formats of chat lists, which may share a file (as they always could).
_CHAT_LISTS = {RowFormat.MESSAGES, RowFormat.SHAREGPT}


class FormattedMessages(list[dict[str, Any]]):
    """A row's messages that are not rendered by the chat template's usual rule.

    Attributes: ``format`` (:class:`RowFormat`), ``template`` (False: plain text, no
    chat template: the contents joined, BOS and EOS added as the tokenizer's own) and
    ``prompt_messages`` (how many leading messages are the prompt, never trained), and
    ``tools`` (the row's tool schemas, handed to the chat template; ``None``: none).
    A list of message dicts all the same, so code reading ``conversation.messages``
    works unchanged.
    """

    def __init__(
        self,
        messages: Any,
        fmt: RowFormat,
        *,
        template: bool = True,
        prompt_messages: int = 0,
        tools: list[dict[str, Any]] | None = None,
    ):
        super().__init__(messages)
        self.format, self.template, self.prompt_messages = fmt, template, prompt_messages
        self.tools = tools
        #: the row's ``weight`` / ``advantage`` (:func:`row_weight`), ``None`` without one
        self.weight: float | None = None
        #: the row's ``group`` (:func:`row_group`), ``None`` without one
        self.group: str | int | None = None

    def __repr__(self) -> str:  # names the format: two rows rendering differently never look alike
        weight = "" if self.weight is None else f", weight={self.weight!r}"  # keys a cached list apart
        group = "" if self.group is None else f", group={self.group!r}"  # so does a group (none: as before)
        return f"FormattedMessages({self.format.value}, {list.__repr__(self)}{weight}{group})"

    def as_row(self) -> dict[str, Any]:
        """The row these messages were read from (its fields, as a file would hold them)."""
        row = self._fields()
        if self.weight is not None:
            row["weight"] = self.weight
        if self.group is not None:
            row[GROUP_FIELD] = self.group
        return row

    def _fields(self) -> dict[str, Any]:
        if self.format is RowFormat.TEXT:
            return {"text": self[0]["content"]}
        if self.format is RowFormat.PROMPT_COMPLETION:
            return {"prompt": self[0]["content"], "completion": self[1]["content"]}
        if self.format in _CHAT_LISTS:
            return {"messages": list(self), "tools": self.tools}
        k = self.prompt_messages
        return {"prompt": list(self[:k]), "completion": list(self[k:])}


def detect_format(row: Any) -> RowFormat | None:
    """The :class:`RowFormat` of a row (a dict), from its fields (a null field counts as absent), or None.

    >>> detect_format({"instruction": "Add 2 and 3.", "input": "", "output": "5"}).value
    'alpaca'
    >>> detect_format({"prompt": [{"role": "user", "content": "hi"}], "completion": []}).value
    'conversational_prompt_completion'
    """
    if not isinstance(row, dict):
        return None
    if row.get("messages") is not None:  # the common case first
        return RowFormat.MESSAGES
    has = {k for k in _FIELDS if row.get(k) is not None}
    if "conversations" in has:
        return RowFormat.SHAREGPT
    if has & {"chosen", "rejected"} and "completion" not in has:
        first = next(row[k] for k in ("prompt", "chosen", "rejected") if k in has)
        return RowFormat.CONVERSATIONAL_PREFERENCE if isinstance(first, list) else RowFormat.PREFERENCE
    if has & {"prompt", "completion"}:
        first = row.get("prompt") if "prompt" in has else row.get("completion")
        return RowFormat.CONVERSATIONAL_PROMPT_COMPLETION if isinstance(first, list) else RowFormat.PROMPT_COMPLETION
    if has & {"instruction", "output"}:
        return RowFormat.ALPACA
    if "text" in has:
        return RowFormat.TEXT
    return None


#: The fields each format reads (a columnar file reads only these columns).
FORMAT_FIELDS: Mapping[RowFormat, tuple[str, ...]] = {
    RowFormat.MESSAGES: ("messages", "images"),
    RowFormat.SHAREGPT: ("conversations", "images"),
    RowFormat.PROMPT_COMPLETION: ("prompt", "completion"),
    RowFormat.CONVERSATIONAL_PROMPT_COMPLETION: ("prompt", "completion"),
    RowFormat.PREFERENCE: ("prompt", "chosen", "rejected"),
    RowFormat.CONVERSATIONAL_PREFERENCE: ("prompt", "chosen", "rejected"),
    RowFormat.ALPACA: ("instruction", "input", "output", "system"),
    RowFormat.TEXT: ("text",),
}
_FIELDS = ("conversations", "prompt", "completion", "chosen", "rejected", "instruction", "output", "text")

_WHAT = {
    RowFormat.ALPACA: "an Alpaca row (instruction, optional input, output, optional system)",
    RowFormat.PROMPT_COMPLETION: "a prompt/completion row (both strings)",
    RowFormat.CONVERSATIONAL_PROMPT_COMPLETION: "a prompt/completion row (both lists of messages)",
    RowFormat.TEXT: "a text row",
    RowFormat.PREFERENCE: "a preference pair (prompt, chosen and rejected, all strings)",
    RowFormat.CONVERSATIONAL_PREFERENCE: "a preference pair (chosen and rejected lists of messages)",
}


def _string(row: dict[str, Any], key: str, what: str, *, empty: bool = False, optional: bool = False) -> str:
    """Field ``key`` of a non-chat row, checked to be a (non-empty, unless ``empty``) string of text."""
    fmt = detect_format(row)
    where = _WHAT.get(fmt, "the row") if fmt is not None else "the row"
    value = row.get(key)
    if value is None:
        if optional:
            return ""
        raise RowProblem(
            BadRowReason.MISSING_FIELD,
            f"'{key}' is missing in {where}",
            f"add the string field '{key}' to the row ({what})",
        )
    if not isinstance(value, str):
        raise RowProblem(
            BadRowReason.NON_STRING_CONTENT,
            f"'{key}' is a {_type_name(value)} in {where}, expected a string",
            f"write '{key}' as one string: {what}",
        )
    if not empty and not optional and not value.strip():
        raise RowProblem(
            BadRowReason.EMPTY_CONTENT, f"'{key}' is empty in {where}", f"give '{key}' {what}, or remove the row"
        )
    if not _is_text(value):
        raise RowProblem(
            BadRowReason.INVALID_TEXT,
            f"'{key}' holds a lone surrogate (an unpaired \\ud800-\\udfff escape), not text",
            "fix the escape (a character outside the BMP is a surrogate *pair*) or remove the row",
        )
    return value


def _alpaca(row: dict[str, Any]) -> list[dict[str, Any]]:
    """An Alpaca row as messages: a system message when ``system`` is not empty; the user's
    turn is ``instruction``, followed by a blank line (``"\\n\\n"``) and ``input`` when
    ``input`` is not empty or only whitespace; the assistant's turn is ``output``."""
    instruction = _string(row, "instruction", "the task for the model")
    extra = _string(row, "input", "the task's input (optional)", optional=True)
    output = _string(row, "output", "the answer to train on")
    system = _string(row, "system", "a system prompt (optional)", optional=True)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    head = [{"role": "system", "content": system}] if system.strip() else []
    return [*head, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _conversational(
    row: dict[str, Any], role_map: Mapping[str, str] | None, base: DataFolder | None
) -> FormattedMessages:
    """TRL's conversational prompt/completion: both lists of messages; the completion holds the assistant's turns."""
    lists = {}
    for key in ("prompt", "completion"):
        value = row.get(key)
        if value is None:
            raise RowProblem(
                BadRowReason.MISSING_FIELD,
                f"'{key}' is missing in {_WHAT[RowFormat.CONVERSATIONAL_PROMPT_COMPLETION]}",
                f"give the row a '{key}' list of {{'role', 'content'}} messages",
            )
        if not isinstance(value, list):
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"'{key}' is a {_type_name(value)} but the other field a list",
                "write 'prompt' and 'completion' both as strings (plain text) or both as lists of messages",
            )
        try:
            out, images = _chat_list(value, key, False, role_map, base, None, need_assistant=key == "completion")
        except RowProblem as bad:
            raise RowProblem(bad.reason, f"in '{key}': {bad.detail}", bad.fix) from None
        if images:
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"'{key}' holds image parts, which prompt/completion rows do not take",
                "write the row as 'messages' (prompt and completion in one list) to train on images",
            )
        lists[key] = out
    fmt = RowFormat.CONVERSATIONAL_PROMPT_COMPLETION
    return FormattedMessages(lists["prompt"] + lists["completion"], fmt, prompt_messages=len(lists["prompt"]))


# ---------------------------------------------------------------------------- preference pairs

#: The two formats of preference pairs (strings; lists of messages).
_PAIRS = {RowFormat.PREFERENCE, RowFormat.CONVERSATIONAL_PREFERENCE}

#: A pair's members, in the order their samples come: the roles in ``Sample.meta["role"]``.
PAIR_ROLES = ("chosen", "rejected")


class PreferencePair(FormattedMessages):
    """A preference row as read: a prompt and two answers, ``chosen`` and ``rejected``.

    As a list it is the chosen conversation (the prompt's messages, then the chosen
    answer's), ``prompt_messages`` long prompt, so code reading ``conversation.messages``
    sees one conversation; :attr:`rejected` holds the rejected answer's messages and
    :meth:`members` both conversations, each as the :class:`FormattedMessages` the
    tokenizer renders (strings: plain text, the prompt not trained; lists: the chat
    template, only the answer's assistant turns trained). ``implicit``: the row gave no
    ``prompt``, the prompt being the leading messages its two conversations share.

    >>> pair = PreferencePair.of({"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6"})
    >>> [m["content"] for m in pair.members()[1]]
    ['2 + 3 =', ' 6']
    """

    def __init__(
        self,
        prompt: list[dict[str, Any]],
        chosen: list[dict[str, Any]],
        rejected: list[dict[str, Any]],
        fmt: RowFormat,
        *,
        implicit: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ):
        template = fmt is RowFormat.CONVERSATIONAL_PREFERENCE
        super().__init__(prompt + chosen, fmt, template=template, prompt_messages=len(prompt), tools=tools)
        self.rejected, self.implicit = rejected, implicit

    @classmethod
    def of(cls, row: Any) -> PreferencePair:
        """The pair a row holds, checked (raises ``ValueError`` naming the problem and its fix)."""
        pair = validate_messages(row)
        if not isinstance(pair, PreferencePair):
            raise ValueError(f"not a preference row (its format: {detect_format(row)})")
        return pair

    @property
    def prompt(self) -> list[dict[str, Any]]:
        """The prompt's messages (strings: one user message, its content the prompt, maybe empty)."""
        return list(self[: self.prompt_messages])

    def members(self) -> tuple[FormattedMessages, FormattedMessages]:
        """The chosen and the rejected conversations (prompt, then answer), as the tokenizer renders them."""
        prompt, k = self.prompt, self.prompt_messages
        return tuple(  # type: ignore[return-value]
            FormattedMessages(prompt + answer, self.format, template=self.template, prompt_messages=k, tools=self.tools)
            for answer in (list(self[k:]), self.rejected)
        )

    def __repr__(self) -> str:
        return f"PreferencePair({self.format.value}, {list.__repr__(self)}, rejected={self.rejected!r})"

    def as_row(self) -> dict[str, Any]:
        k = self.prompt_messages
        chosen, rejected = list(self[k:]), self.rejected
        if not self.template:
            return {"prompt": self[0]["content"], "chosen": chosen[0]["content"], "rejected": rejected[0]["content"]}
        if self.implicit:
            return {"chosen": self.prompt + chosen, "rejected": self.prompt + rejected, "tools": self.tools}
        return {"prompt": self.prompt, "chosen": chosen, "rejected": rejected, "tools": self.tools}


_PAIR_FIX = "write 'prompt', 'chosen' and 'rejected' all as strings (plain text) or all as lists of messages"


def _preference(
    row: dict[str, Any], fmt: RowFormat, role_map: Mapping[str, str] | None, base: DataFolder | None
) -> PreferencePair:
    """TRL's preference row, checked whole: every problem of either answer is the pair's one reason."""
    what = _WHAT[fmt]
    for key in PAIR_ROLES:
        if row.get(key) is None:
            raise RowProblem(
                BadRowReason.MISSING_FIELD,
                f"'{key}' is missing in {what}",
                "give the row both answers, 'chosen' and 'rejected' (a pair is kept or dropped whole)",
            )
    kind = list if fmt is RowFormat.CONVERSATIONAL_PREFERENCE else str
    for key in ("prompt", *PAIR_ROLES):
        value = row.get(key)
        if value is not None and not isinstance(value, kind):
            first = next(k for k in ("prompt", *PAIR_ROLES) if row.get(k) is not None)
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE if kind is list else BadRowReason.NON_STRING_CONTENT,
                f"'{key}' is a {_type_name(value)} but '{first}' a {_type_name(row[first])} in {what}",
                _PAIR_FIX,
            )
    if kind is str:
        if row.get("prompt") is None:
            raise RowProblem(
                BadRowReason.MISSING_FIELD,
                f"'prompt' is missing in {what}: string pairs need an explicit prompt",
                "add the string field 'prompt' (the text both answers follow; it may be empty), or write the pair "
                "as lists of messages, whose prompt may be implicit",
            )
        text = _string(row, "prompt", "the prompt both answers follow (may be empty)", empty=True)
        good, bad = (_string(row, k, f"the {k} answer") for k in PAIR_ROLES)
        if good == bad:
            raise _identical(what)
        return PreferencePair([{"role": "user", "content": text}], [_answer(good)], [_answer(bad)], fmt)
    lists = {key: _pair_list(row, key, role_map, base) for key in ("prompt", *PAIR_ROLES) if row.get(key) is not None}
    tools = checked_tools(row)
    if "prompt" in lists:
        for key in PAIR_ROLES:
            first = lists[key][0]["role"]
            if first != "assistant":
                repeats = lists[key][: len(lists["prompt"])] == lists["prompt"]
                raise RowProblem(
                    BadRowReason.PROMPT_MISMATCH,
                    f"'{key}' starts with a {first} message"
                    + (", repeating 'prompt'" if repeats else "")
                    + f": with an explicit 'prompt' in {what}, '{key}' holds only the answer",
                    f"start '{key}' at the assistant's answer (leave the prompt's turns to 'prompt'), or drop "
                    "'prompt' and give 'chosen' and 'rejected' as whole conversations (an implicit prompt)",
                )
        if lists["chosen"] == lists["rejected"]:
            raise _identical(what)
        return PreferencePair(lists["prompt"], lists["chosen"], lists["rejected"], fmt, tools=tools)
    chosen, rejected = lists["chosen"], lists["rejected"]
    if chosen == rejected:
        raise _identical(what)
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == 0:
        raise RowProblem(
            BadRowReason.NO_COMMON_PROMPT,
            f"'chosen' and 'rejected' differ from their first message: with no 'prompt' in {what}, the prompt is "
            "the messages both start with",
            "give both conversations the same leading turns (the prompt), or give the prompt as 'prompt' and "
            "only the answers in 'chosen' and 'rejected'",
        )
    for key, conv in zip(PAIR_ROLES, (chosen, rejected)):
        answer = conv[k:]
        if not any(m["role"] == "assistant" for m in answer):
            other = "rejected" if key == "chosen" else "chosen"
            detail = "ends with the turns" if not answer else "has no assistant turn after the turns"
            raise RowProblem(
                BadRowReason.EMPTY_MESSAGES if not answer else BadRowReason.NO_ASSISTANT_TURN,
                f"'{key}' {detail} it shares with '{other}' (the implicit prompt): it holds no answer",
                f"end '{key}' with its own assistant answer after the shared turns, or remove the row",
            )
    return PreferencePair(chosen[:k], chosen[k:], rejected[k:], fmt, implicit=True, tools=tools)


def _answer(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def _identical(what: str) -> RowProblem:
    return RowProblem(
        BadRowReason.IDENTICAL_ANSWERS,
        f"'chosen' and 'rejected' are the same in {what}: nothing to prefer",
        "give the pair two different answers, or remove the row",
    )


def _pair_list(
    row: dict[str, Any], key: str, role_map: Mapping[str, str] | None, base: DataFolder | None
) -> list[dict[str, Any]]:
    """Field ``key`` of a conversational preference row: a checked list of messages, no images."""
    try:
        out, images = _chat_list(row[key], key, False, role_map, base, None, need_assistant=key != "prompt")
    except RowProblem as bad:
        raise RowProblem(bad.reason, f"in '{key}': {bad.detail}", bad.fix) from None
    if any(m.get("weight") is not None for m in out):
        raise RowProblem(
            BadRowReason.BAD_WEIGHT,
            f"in '{key}': a message has a 'weight', and preference pairs are not weighted (yet)",
            "remove the messages' 'weight' from the pair's row",
        )
    if images:
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE,
            f"'{key}' holds image parts, which preference pairs do not take (yet)",
            "write the pair's contents as text, or train on the images with 'messages' rows",
        )
    return out
