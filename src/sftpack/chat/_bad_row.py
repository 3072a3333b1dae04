"""What a bad row is: :class:`BadRowError` (the error, naming the file, line, reason and fix) and
:class:`RowProblem` (what a check raises: the reason, detail and fix, before the reader knows
where the row came from), and the small helpers the checks word their messages with."""

from __future__ import annotations

from typing import Any

from ._options import BadRowReason

#: Both spellings: the CLI user reads the flag, the library user the argument.
_SKIP_HINT = (
    "or pass --on-bad-row skip (on_bad_row='skip' in Python) to leave such rows out (each counted in stats.dropped)"
)


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


class RowProblem(Exception):
    """Why a row is unusable: its ``reason`` (a :class:`BadRowReason`), a ``detail`` and a ``fix``.
    The reader turns it into a count or a :class:`BadRowError`; the media tokenizer
    (:mod:`sftpack.multimodal`, whose rows the same checks read) into an error naming the record."""

    def __init__(self, reason: BadRowReason, detail: str, fix: str):
        super().__init__(detail)
        self.reason, self.detail, self.fix = reason, detail, fix


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), type(value).__name__)


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
