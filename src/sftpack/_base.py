"""The few helpers every package shares, one of each.

- ``StrEnum`` (with a Python 3.10 stand-in) and :func:`choose`, which turns a
  user's string into a member or raises an error that names the option and
  lists the valid values.
- :func:`round_up`: the padded length of a sequence (or an array of them).
- :func:`positive_int`: the one check for sizes and multiples (Python and numpy
  integers accepted; bools, floats and strings refused).

No torch here: :mod:`sftpack.binpack` imports this module.
"""

from __future__ import annotations

import enum
import numbers
import sys
from typing import Any, TypeVar

__all__ = ["StrEnum", "choose", "positive_int", "round_up"]

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


def round_up(n: Any, multiple: int) -> Any:
    """Smallest multiple of ``multiple`` that is ``>= n`` (elementwise for numpy
    arrays and torch tensors).

    >>> round_up(5, 4), round_up(8, 4), round_up(0, 4)
    (8, 8, 0)
    """
    return -(-n // multiple) * multiple


def positive_int(
    name: str,
    value: object,
    *,
    error: type[ValueError] = ValueError,
    allow_none: bool = False,
    who: str = "",
) -> Any:
    """``value`` as a Python ``int >= 1``, or ``error`` naming the option.

    Python and numpy integers are accepted; ``bool``, floats (even ``4.0``) and
    strings are refused. ``allow_none=True`` passes ``None`` through.

    >>> positive_int("pad_multiple", 4)
    4
    >>> positive_int("pad_multiple", 0, who="pack_step")
    Traceback (most recent call last):
    ...
    ValueError: pack_step: pad_multiple must be a positive integer, got 0
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        prefix = f"{who}: " if who else ""
        raise error(f"{prefix}{name} must be a positive integer, got {value!r}")
    return int(value)
