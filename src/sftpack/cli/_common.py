"""Shared by the commands: option types that refuse bad values up front, the options
of a dataclass's settings (:func:`add_settings`, :func:`given_settings`), the
usage error, SIGTERM handled like Ctrl-C, the tokenizer loader, and whether
input files hold conversations with images (:func:`has_images`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import os
import signal
import typing
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._base import LazyChoices
from ..loop import RunConfig
from ..loop import inputs as _inputs
from ..loop.inputs import counts_text, has_images, render_read_stats

if TYPE_CHECKING:
    from ..chat import TokenizeStats

__all__ = [
    "INPUTS_HELP",
    "Terminated",
    "UsageError",
    "add_family",
    "add_settings",
    "flag_of",
    "given_settings",
    "has_images",
    "non_negative",
    "positive",
    "render_read_stats",
    "render_tokenize_stats",
    "sigterm_deferred",
    "sigterm_handled",
]


#: what every command that reads conversations takes as INPUT (its --help says it in these words)
INPUTS_HELP = (
    "JSONL (.jsonl/.json/.ndjson, .gz too) or JSON-array files, Parquet files, globs, folders or saved datasets"
)


class UsageError(ValueError):
    """Options that cannot work (exit status 2)."""


class Terminated(KeyboardInterrupt):
    """The process was sent SIGTERM (what a scheduler sends before it kills a job): raised
    where Ctrl-C raises ``KeyboardInterrupt``, so the same clean-up runs; exit status 143.
    The message is the line the command prints."""

    def __init__(self, message: str = "stopped by SIGTERM") -> None:
        super().__init__(message)


class _Sigterm:
    """What SIGTERM does in this process: raise :class:`Terminated` (once), or, while
    :func:`sigterm_deferred`, only record it. A process forked from this one gets the
    default back (:func:`_default_in_child`; else, should it still run there, it ends
    that process as the default would)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.received = False
        self.deferred = False

    def __call__(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        first, self.received = not self.received, True
        if first and not self.deferred:  # a second SIGTERM does not cut the clean-up of the first short
            raise Terminated()


_HANDLER: _Sigterm | None = None


def _default_in_child() -> None:
    """A forked process (the tokenizer's, its workers) ends on SIGTERM as by default, at
    once, not when its Python next runs: ``Pool.terminate()`` waits for its workers to end."""
    if isinstance(signal.getsignal(signal.SIGTERM), _Sigterm):
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # forked from another thread: the handler's own check ends it
            pass


os.register_at_fork(after_in_child=_default_in_child)


@contextlib.contextmanager
def sigterm_handled() -> Iterator[None]:
    """Inside: SIGTERM raises :class:`Terminated` in the main thread (a no-op elsewhere: only
    the main thread may set signal handlers)."""
    global _HANDLER
    try:
        before = signal.signal(signal.SIGTERM, handler := _Sigterm())
    except ValueError:  # not the main thread
        yield
        return
    outer, _HANDLER = _HANDLER, handler
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        _HANDLER = outer


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[Callable[[], bool]]:
    """Inside: SIGTERM is only recorded (the training loop stops at the end of the step, saving a
    checkpoint first); yields whether it came. After it (or outside :func:`sigterm_handled`)
    SIGTERM raises again."""
    handler = _HANDLER
    if handler is None:
        yield lambda: False
        return
    handler.deferred = True
    try:
        yield lambda: handler.received
    finally:
        handler.deferred = False


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, ">= 0")


def add_settings(parser: Any, options: type, *names: str) -> None:
    """An option of ``parser`` (or of an argument group) for each of the settings ``names``,
    fields of the dataclass ``options``, as the field declares it: a setting's default and
    its flag are declared once, on its field. A field with ``"help"`` in its metadata is a
    flag; the metadata may also give ``"flag"`` (else ``--`` and the name with dashes),
    ``"cli_default"`` (where the command's default differs from the field's; ``None``: unset,
    the field's default or one the command derives), ``"min"`` (an ``int`` of at least 1 or
    0: :func:`positive` / :func:`non_negative`), ``"choices"`` (an enum field's are its
    values) and ``"metavar"``. ``{default}`` in the help is the default a run gets (the
    command's, else the field's); a ``bool`` is a switch away from the command's default.
    """
    fields = {f.name: f for f in dataclasses.fields(options)}
    hints = typing.get_type_hints(options)
    for name in names:
        f = fields[name]
        meta = f.metadata
        default = meta.get("cli_default", f.default)
        shown = f.default if default is None else default
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": default.value if isinstance(default, enum.Enum) else default,
            "help": meta["help"].format(default=shown.value if isinstance(shown, enum.Enum) else shown),
        }
        kinds = typing.get_args(hints[name]) or (hints[name],)
        enums = [k for k in kinds if isinstance(k, type) and issubclass(k, enum.Enum)]
        if "nargs" in meta:
            kwargs["nargs"] = meta["nargs"]
            kwargs["type"] = {1: positive, 0: non_negative, None: None}[meta.get("min")]
        elif "parse" in meta:
            kwargs["type"] = _argument_type(meta["parse"])
        elif enums:
            kwargs["choices"] = [m.value for m in enums[0]]
        elif "choices" in meta:  # a LazyChoices stays lazy: read when the option is given or its help shown
            kwargs["choices"] = meta["choices"] if isinstance(meta["choices"], LazyChoices) else list(meta["choices"])
        elif bool in kinds:
            kwargs["action"] = "store_false" if default else "store_true"
        elif int in kinds:
            kwargs["type"] = {1: positive, 0: non_negative, None: int}[meta.get("min")]
        elif float in kinds:
            kwargs["type"] = float
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        parser.add_argument(_flag(f), **kwargs)


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse type: ``parse(text)``, its ``ValueError`` the option's error message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def given_settings(args: argparse.Namespace, options: type) -> dict[str, Any]:
    """The settings of the dataclass ``options`` that its flags (:func:`add_settings`) give,
    by field name; a flag left unset (``None``) leaves the field's default."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(options) if "help" in f.metadata}
    return {name: value for name, value in values.items() if value is not None}


def flag_of(name: str) -> str:
    """The flag of the run setting ``name`` (a field of a :class:`~sftpack.loop.RunConfig` part):
    its metadata's ``"flag"``, else ``--`` and the name with dashes (:func:`add_settings`)."""
    for part in RunConfig.parts().values():
        for f in dataclasses.fields(part):
            if f.name == name:
                return _flag(f)
    return "--" + name.replace("_", "-")


def _flag(f: dataclasses.Field) -> str:
    """The flag of the setting ``f``: its metadata's ``"flag"``, else ``--`` and its name with dashes."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def add_family(parser: Any) -> None:
    """``--family`` on ``parser`` (or an argument group), one meaning on every command
    (:data:`sftpack.loop.inputs.FAMILY_HELP`), its choices the registry's (:func:`sftpack.multimodal.family_names`).
    Unset, it is ``None``: :func:`sftpack.loop.inputs.vlm_family` then takes the ``--model`` folder's family, else
    the default."""
    parser.add_argument("--family", choices=_inputs.FAMILY_NAMES, metavar="FAMILY", help=_inputs.FAMILY_HELP)


def render_tokenize_stats(st: TokenizeStats, samples: int, seconds: float) -> str:
    """The tokenizer's accounting in words: outcomes, skips by reason, tokens and labels lost."""
    skipped = getattr(st, "skipped", {}) or {}
    lines = [
        f"  {st.conversations:,} conversations -> {samples:,} samples ({st.fit:,} fit, {st.split:,} split, "
        f"{st.truncated:,} truncated, {st.dropped:,} dropped, {sum(skipped.values()):,} skipped) in {seconds:.1f} s"
    ]
    if skipped:
        lines.append(f"  skipped: {counts_text(skipped)}")
    lost = [f"{st.tokens_lost:,} tokens lost"]
    if hasattr(st, "labels_lost"):
        lost.append(
            f"{st.labels_lost:,} of {st.labels:,} supervised labels lost ({st.split_labels_lost:,} at split points: split_labels_lost)"
        )
    if getattr(st, "special_text", 0):
        lost.append(f"{st.special_text:,} special-token strings in the data (special_text), kept as text")
    lines.append("  " + "; ".join(lost))
    return "\n".join(lines)
