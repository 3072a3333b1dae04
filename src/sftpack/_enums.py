"""Option enums shared by every module: ``StrEnum`` (with a Python 3.10 stand-in)
and :func:`choose`, which turns a user's string into a member or raises an error
that names the option and lists the valid values."""

from __future__ import annotations

import enum
import sys
from typing import TypeVar

__all__ = ["StrEnum", "choose"]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


E = TypeVar("E", bound=enum.Enum)


def choose(kind: type[E], value: object, name: str, error: type[ValueError] = ValueError) -> E:
    """``kind(value)``, or ``error`` naming the option and listing the valid values.

    >>> class Colour(StrEnum):
    ...     RED = "red"
    >>> choose(Colour, "blue", "colour")
    Traceback (most recent call last):
    ...
    ValueError: colour='blue' is not valid: choose one of 'red'
    """
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in kind)
        raise error(f"{name}={value!r} is not valid: choose one of {valid}") from None
