"""The ``sftpack`` command line: the only place that prints.

    sftpack map [--png FILE]   the contract's worked example at the three packing moments
    sftpack demo               the main job on the embedded default
    sftpack bench [PATHS]      what packing saves on your conversations, per algorithm
    sftpack plan DATA          each path's balance across data-parallel ranks, on paper

Each command is a module ``_<name>.py`` of this package with
``register(subparsers)`` (found at start, listed in :data:`_ORDER`'s order). A user
error (a bad option, a bad file, a conversation that cannot be packed) prints
one line, ``sftpack <command>: <what> (<fix>)``, and exits 2 for usage errors
and 1 for data errors; a ``--model`` or ``--tokenizer`` folder that asks for its own Python
code (``auto_map``) is a usage error, since sftpack never runs it (``sftpack._optional``);
``--debug`` shows the traceback instead. Ctrl-C prints
``sftpack <command>: interrupted`` (exit 130); SIGTERM, what a scheduler sends
before it kills a job, takes the same way out (its clean-up included), prints
``sftpack <command>: stopped by SIGTERM...`` and exits 143 (``sftpack train``
first saves a checkpoint at the end of the current step, with ``--checkpoint-dir``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .._optional import CustomCodeError, refuse_custom_code
from ..loop import ConfigError
from ._common import Terminated, UsageError, flag_of, sigterm_handled
from ._config import CONFIG_HELP, expand_config

__all__ = ["build_parser", "main"]

#: the order ``sftpack --help`` lists commands in (others follow alphabetically)
_ORDER = ("prepack", "inspect", "train", "verify", "map", "demo", "bench", "plan")
#: the commands that take ``--config FILE.yaml`` (:mod:`._config`)
_CONFIGURED = ("prepack", "train")


def _command_modules() -> list[str]:
    names = [
        m.name
        for m in pkgutil.iter_modules(__path__)
        if m.name.startswith("_") and not m.name.startswith("__") and m.name not in ("_common", "_config")
    ]
    rank = {f"_{n}": i for i, n in enumerate(_ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, ``sftpack <command>: <what> (see --help)``, exit 2.

    A command whose options are built from a library's settings (importing it: torch, for
    ``train`` and ``prepack``) gives them as ``add_parser(..., arguments=add)``: ``add(parser)``
    runs the first time the command parses or shows its help, so that ``sftpack --help`` and
    the other commands do not import that library.
    """

    def __init__(self, *args: Any, arguments: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._arguments = arguments
        self._config_file: str | None = None

    def _add_arguments(self) -> None:
        add, self._arguments = self._arguments, None
        if add is not None:
            add(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._add_arguments()
        if args is not None and any(a.dest == "config" for a in self._actions):
            try:
                args, self._config_file = expand_config(self, args)
            except ValueError as e:
                self.error(str(e))
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_arguments()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_arguments()
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        if self._config_file is not None and not message.startswith("--config"):
            message = f"{message} (on the command line or in --config {self._config_file})"
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="sftpack",
        description="Pack SFT conversations into flat rows for variable-length (THD) attention.",
    )
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in _command_modules():
        module = importlib.import_module(f"{__name__}.{name}")
        if hasattr(module, "register"):
            module.register(sub)
    for name in _CONFIGURED:
        sub.choices[name].add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; ``argv=None``: ``sys.argv[1:]``, as the ``sftpack`` command.

    Run as the command (``argv=None``), a command that sets ``exit_at_once``
    (``sftpack train``: torch and transformers loaded, whose interpreter teardown
    takes seconds) ends the process as soon as it returns, its output flushed,
    instead of waiting for the interpreter to tear every module down.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = _run(args)
    if argv is None and getattr(args, "exit_at_once", False):
        _exit_at_once(rc)
    return rc


def _exit_at_once(rc: int) -> NoReturn:
    """Flush what the command wrote and end the process now (no module teardown)."""
    import logging  # start-up: only a run configures logging, not `sftpack --help`

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(rc)


def _say_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    """A library warning, as the command's one line (not Python's file:line and source line), on a
    line of its own even while a progress bar is drawn (``tqdm.write`` moves the bars below it)."""
    from .._progress import Bar  # start-up: tqdm loads with the first bar, not for `sftpack --help`

    Bar.write(f"sftpack: warning: {message}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    try:
        with sigterm_handled(), warnings.catch_warnings():
            warnings.showwarning = _say_warning
            for folder in (getattr(args, "model", None), getattr(args, "tokenizer", None)):
                if isinstance(folder, str):  # before any work; every load checks again
                    refuse_custom_code(folder)
            return int(args.func(args) or 0)
    except Terminated as e:
        print(f"sftpack {args.command}: {e}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (UsageError, CustomCodeError, ConfigError) as e:  # settings that cannot work: exit 2
        if args.debug:
            raise
        said = e.spelled(flag_of) if isinstance(e, ConfigError) else str(e)  # a run's settings named as flags
        print(f"sftpack {args.command}: {said}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sftpack {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:
        if args.debug:
            raise
        print(f"sftpack {args.command}: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        text += " (check that the path exists)"
    elif isinstance(e, PermissionError):
        text += " (check that you may read or write there)"
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
