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
- :func:`renamed`: the one way a renamed keyword keeps its old spelling for one
  release (a ``DeprecationWarning`` naming the new one); :func:`warn_renamed` the
  warning itself (for a renamed attribute).
- :func:`pool_results`: the worker pool that tokenizes (text and images), results in
  input order (:func:`_pool_context`: how its workers start); :func:`chunks`: its tasks
  (and any other stream cut into lists).

No torch here: :mod:`sftpack.binpack` imports this module.
"""

from __future__ import annotations

import enum
import numbers
import os
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, Protocol, TypeVar, cast, overload

__all__ = [
    "LazyChoices",
    "StrEnum",
    "check_width",
    "choose",
    "chunks",
    "non_negative_int",
    "pool_results",
    "positive_int",
    "renamed",
    "round_up",
    "warn_renamed",
]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T")


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


class _IntCheck(Protocol):
    """The signature of :func:`positive_int` and :func:`non_negative_int`: an ``int``, or where
    ``allow_none`` is given (``True`` passes ``None`` through) an ``int`` or ``None``."""

    @overload
    def __call__(
        self, name: str, value: object, *, error: type[ValueError] = ..., who: str = ..., why: str = ...
    ) -> int: ...

    @overload
    def __call__(
        self,
        name: str,
        value: object,
        *,
        error: type[ValueError] = ...,
        allow_none: bool,
        who: str = ...,
        why: str = ...,
    ) -> int | None: ...


def _int_at_least(lo: int, kind: str, doc: str) -> _IntCheck:
    """The check that a value is a Python or numpy integer ``>= lo`` (a ``kind`` integer)."""

    def check(
        name: str,
        value: object,
        *,
        error: type[ValueError] = ValueError,
        allow_none: bool = False,
        who: str = "",
        why: str = "",
    ) -> int | None:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < lo:
            prefix = f"{who}: " if who else ""
            suffix = f"; {why}" if why else ""
            raise error(f"{prefix}{name} must be a {kind} integer, got {value!r}{suffix}")
        return int(value)

    check.__name__ = check.__qualname__ = f"{kind.replace('-', '_')}_int"
    check.__doc__ = doc
    return cast(_IntCheck, check)


positive_int = _int_at_least(
    1,
    "positive",
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
    """,
)

non_negative_int = _int_at_least(
    0,
    "non-negative",
    """``value`` as a Python ``int >= 0``, or ``error`` naming the option (and ``why``, when given).

    >>> non_negative_int("seed", 0)
    0
    >>> non_negative_int("max_wait", -1, who="PackingDataset")
    Traceback (most recent call last):
    ...
    ValueError: PackingDataset: max_wait must be a non-negative integer, got -1
    """,
)


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


def warn_renamed(who: str, old: str, new: str, *, stacklevel: int = 3) -> None:
    """The ``DeprecationWarning`` of a renamed keyword or attribute: ``who``'s ``old`` is now
    ``new`` (the same value), and the old spelling goes in the next release. ``stacklevel``:
    as for :func:`warnings.warn`, counted from the caller of this function (3: the caller of
    the function that calls it)."""
    warnings.warn(
        f"{who}: {old} is deprecated and will be removed in the next release of sftpack; use {new} "
        "(the same value, under the name every sftpack API uses)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed(who: str, new: str, value: T | None, old: str, old_value: T | None) -> T | None:
    """The value of the renamed keyword ``new``: ``value``, or ``old_value`` given under the
    old spelling ``old`` (accepted for one release, with :func:`warn_renamed`'s warning
    pointing at the caller of ``who``). Both given: ``TypeError``. ``None`` means not given.

    >>> renamed("pack_step", "max_seq_len", 64, "pad_to", None)
    64
    >>> renamed("pack_step", "max_seq_len", 64, "pad_to", 64)
    Traceback (most recent call last):
    ...
    TypeError: pack_step: give max_seq_len= only (pad_to= is its old spelling)
    """
    if old_value is None:
        return value
    if value is not None:
        raise TypeError(f"{who}: give {new}= only ({old}= is its old spelling)")
    warn_renamed(who, f"{old}=", f"{new}=", stacklevel=4)
    return old_value


def chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in lists of ``size`` (the last one shorter if need be), read as they are needed.

    >>> list(chunks(range(5), 2))
    [[0, 1], [2, 3], [4]]
    """
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def _pool_context() -> Any:
    """The multiprocessing context of the worker pools that tokenize (text and images): fork on
    Linux, so workers inherit the tokenizer instead of unpickling it; spawn elsewhere (fork is
    unsafe or missing), and spawn in a process where Ray runs: its threads (gRPC, the core
    worker) hold locks a forked child inherits and may never see released, so a forked worker
    can die or hang and the pool with it."""
    import multiprocessing  # start-up: only worker pools need it; `import sftpack` loads this module

    ray = sys.modules.get("ray")
    in_ray = ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") and not in_ray else "spawn")


def pool_results(
    work: Callable[[Any], Any],
    tasks: Iterable[Any],
    num_proc: int,
    *,
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
) -> Iterator[Any]:
    """``work(task)`` of each task, in task order, run in a pool of ``num_proc`` worker processes
    (:func:`_pool_context`'s, each set up by ``initializer(*initargs)``) with at most ``2 * num_proc``
    tasks in flight; the pool is terminated on leaving (also on an error, or when the caller stops).

    Each worker runs the tokenizer single-threaded: ``TOKENIZERS_PARALLELISM`` is ``"false"`` while
    the pool starts (so the workers inherit it, and tokenizers does not warn in them that it
    disables its thread pool), and as it was afterwards."""

    ctx = _pool_context()
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(num_proc, initializer=initializer, initargs=initargs)
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        pending: deque[Any] = deque()
        for task in tasks:
            pending.append(pool.apply_async(work, (task,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        pool.terminate()
        pool.join()


class LazyChoices(Sequence[str]):
    """An argparse ``choices`` list read from ``load`` the first time it is asked for (when the
    option is given or its help shown), so that building a parser loads nothing: e.g. the model
    families' names, whose registry loads torch."""

    def __init__(self, load: Callable[[], Sequence[str]]) -> None:
        self._load = load

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        return self._load()[i]

    def __len__(self) -> int:
        return len(self._load())
