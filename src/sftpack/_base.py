"""The few helpers every package shares, one of each.

- ``StrEnum`` (with a Python 3.10 stand-in) and :func:`choose`, which turns a
  user's string into a member or raises an error that names the option and
  lists the valid values.
- :func:`round_up`: the padded length of a sequence (or an array of them).
- :func:`positive_int` / :func:`non_negative_int`: the one check for sizes,
  multiples, seeds and counts (Python and numpy integers accepted; bools, floats
  and strings refused).
- :func:`check_width`: the one check that a row width is a multiple of the
  per-sequence pad multiple (the last sequence absorbs a row's tail).

No torch here: :mod:`sftpack.binpack` imports this module.
"""

from __future__ import annotations

import enum
import numbers
import sys
from typing import Any, Literal, TypeVar, overload

__all__ = ["StrEnum", "check_width", "choose", "non_negative_int", "positive_int", "round_up"]

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


def _int_at_least(
    lo: int, kind: str, name: str, value: object, error: type[ValueError], allow_none: bool, who: str, why: str
) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < lo:
        prefix = f"{who}: " if who else ""
        suffix = f"; {why}" if why else ""
        raise error(f"{prefix}{name} must be a {kind} integer, got {value!r}{suffix}")
    return int(value)


@overload
def positive_int(
    name: str,
    value: object,
    *,
    error: type[ValueError] = ...,
    allow_none: Literal[False] = ...,
    who: str = ...,
    why: str = ...,
) -> int: ...


@overload
def positive_int(
    name: str,
    value: object,
    *,
    error: type[ValueError] = ...,
    allow_none: bool,
    who: str = ...,
    why: str = ...,
) -> int | None: ...


def positive_int(
    name: str,
    value: object,
    *,
    error: type[ValueError] = ValueError,
    allow_none: bool = False,
    who: str = "",
    why: str = "",
) -> int | None:
    """``value`` as a Python ``int >= 1``, or ``error`` naming the option.

    Python and numpy integers are accepted; ``bool``, floats (even ``4.0``) and
    strings are refused. ``allow_none=True`` passes ``None`` through; ``why`` is appended
    to the message.

    >>> positive_int("pad_multiple", 4)
    4
    >>> positive_int("pad_multiple", 0, who="pack_step")
    Traceback (most recent call last):
    ...
    ValueError: pack_step: pad_multiple must be a positive integer, got 0
    """
    return _int_at_least(1, "positive", name, value, error, allow_none, who, why)


@overload
def non_negative_int(
    name: str,
    value: object,
    *,
    error: type[ValueError] = ...,
    allow_none: Literal[False] = ...,
    who: str = ...,
    why: str = ...,
) -> int: ...


@overload
def non_negative_int(
    name: str,
    value: object,
    *,
    error: type[ValueError] = ...,
    allow_none: bool,
    who: str = ...,
    why: str = ...,
) -> int | None: ...


def non_negative_int(
    name: str,
    value: object,
    *,
    error: type[ValueError] = ValueError,
    allow_none: bool = False,
    who: str = "",
    why: str = "",
) -> int | None:
    """``value`` as a Python ``int >= 0``, or ``error`` naming the option (and ``why``, when given).

    >>> non_negative_int("seed", 0)
    0
    >>> non_negative_int("max_wait", -1, who="PackingDataset")
    Traceback (most recent call last):
    ...
    ValueError: PackingDataset: max_wait must be a non-negative integer, got -1
    """
    return _int_at_least(0, "non-negative", name, value, error, allow_none, who, why)


def check_width(
    width: int,
    multiple: int,
    *,
    name: str = "max_seq_len",
    multiple_name: str = "pad_multiple",
    who: str = "",
    error: type[ValueError] = ValueError,
) -> int:
    """``width`` (already a positive int) if it is a multiple of ``multiple``, else ``error``
    naming both and the nearest valid widths: a row's tail padding is folded into its last
    sequence, which would lose its alignment otherwise.

    >>> check_width(36, 4)
    36
    >>> check_width(30, 4, who="PackingDataset")
    Traceback (most recent call last):
    ...
    ValueError: PackingDataset: max_seq_len=30 is not a multiple of pad_multiple=4: the last sequence of a row absorbs the row's tail and would lose its alignment; use max_seq_len=32 or 28
    """
    if width % multiple:
        prefix = f"{who}: " if who else ""
        up, down = round_up(width, multiple), width // multiple * multiple
        use = f"{name}={up}" + (f" or {down}" if down else "")
        raise error(
            f"{prefix}{name}={width} is not a multiple of {multiple_name}={multiple}: the last sequence of a row "
            f"absorbs the row's tail and would lose its alignment; use {use}"
        )
    return width


def pool_context() -> Any:
    """The multiprocessing context of the worker pools that tokenize (text and images): fork on
    Linux, so workers inherit the tokenizer instead of unpickling it; spawn elsewhere (fork is
    unsafe or missing), and spawn in a process where Ray runs: its threads (gRPC, the core
    worker) hold locks a forked child inherits and may never see released, so a forked worker
    can die or hang and the pool with it."""
    import multiprocessing

    ray = sys.modules.get("ray")
    in_ray = ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") and not in_ray else "spawn")
