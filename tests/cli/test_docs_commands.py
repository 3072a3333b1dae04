"""Every command line the docs show parses with today's CLI.

The docs are read as a user reads them: each ``sftpack ...`` line of a shell
block (``bash``/``sh``/``shell``/``console``, continuation lines joined,
comments dropped, whether it is spelled ``sftpack``, ``.venv/bin/sftpack`` or
``torchrun ... -m sftpack.cli -- ...``) and each inline ``sftpack <command>
...`` span is parsed by the real parser, so a flag that does not exist, a
removed command or a bad choice fails the suite (argparse exits 2). The parse
is a dry run: nothing is read, tokenized or trained.

Prose mentions flags too ("``--micro-batch-tokens`` raises it"): every
``--flag`` written anywhere in the docs must be an option of some ``sftpack``
command, or one of the few other programs' flags listed in
:data:`FOREIGN_FLAGS` with the program it belongs to.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from sftpack.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

#: flags the docs mention that belong to other programs, with the program
FOREIGN_FLAGS = {
    "--nproc-per-node": "torchrun",
    "--nnodes": "torchrun",
    "--node-rank": "torchrun",
    "--master-addr": "torchrun",
    "--master-port": "torchrun",
    "--rdzv-endpoint": "torchrun",
    "--rdzv-backend": "torchrun",
    "--log-dir": "torchrun",
    "--head": "ray start",
    "--address": "ray start",
    "--help": "argparse, every command",
}

SHELL_LANGS = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE = re.compile(r"`(sftpack [^`]+)`")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _commands() -> set[str]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    raise AssertionError("sftpack has no subcommands")


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser with its options (a command whose options import a library adds
    them when it is first used: showing its usage does)."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for sub in subs.values():
        sub.format_usage()
    return subs


def _known_flags() -> set[str]:
    known = set(build_parser()._option_string_actions)
    for sub in _command_parsers().values():
        known |= set(sub._option_string_actions)
    return known


def _shell_lines(text: str):
    """(line number, logical line) of every shell block, continuations joined."""
    lang = None
    pending, start = "", 0
    for no, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line.strip())
        if fence:
            lang = None if lang is not None else fence.group(1)
            continue
        if lang not in SHELL_LANGS:
            continue
        stripped = line.rstrip()
        if not pending:
            start = no
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + stripped
        pending = ""


def _argv_after_sftpack(words: list[str]) -> list[str] | None:
    """The arguments sftpack gets on this command line, or None if it runs no sftpack."""
    for i, w in enumerate(words):
        if w == "sftpack" or w.endswith("/sftpack"):
            return words[i + 1 :]
        if w == "-m" and i + 1 < len(words) and words[i + 1] in ("sftpack", "sftpack.cli"):
            rest = words[i + 2 :]
            return rest[1:] if rest[:1] == ["--"] else rest
    return None


def invocations(path: Path) -> list[tuple[str, list[str]]]:
    """Every sftpack invocation the document shows, as (where, argv)."""
    text = path.read_text(encoding="utf-8")
    commands = _commands()
    found = []
    for no, line in _shell_lines(text):
        body = line.strip().removeprefix("$ ")
        try:
            words = shlex.split(body, comments=True)
        except ValueError as e:  # an unbalanced quote in the docs is a docs bug too
            raise AssertionError(f"{path.name}:{no}: cannot split {body!r}: {e}") from None
        argv = _argv_after_sftpack(words)
        if argv is not None:  # "..." stands for "the other options as above"
            argv = [w for w in argv if w != "..."]
        if argv is not None and argv[:1] and argv[0] in commands:
            found.append((f"{path.name}:{no}", argv))
    return found


def inline_mentions(path: Path) -> list[tuple[str, str, list[str]]]:
    """Inline spans such as `sftpack bench [PATHS] [--max-seq-len N]`: (where, command, flags).

    A span names a command and some of its options, often with placeholders, so
    it is not parsed whole; each flag it shows must be an option of that command.
    """
    commands = _commands()
    found = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for span in _INLINE.findall(line):
            words = span.split()
            # "sftpack prepack: ..." is a quoted error message, not a command line
            if len(words) > 1 and words[1] in commands:
                found.append((f"{path.name}:{no}", words[1], _FLAG.findall(span)))
    return found


ALL = [inv for doc in DOCS for inv in invocations(doc)]
INLINE = [m for doc in DOCS for m in inline_mentions(doc)]


def test_docs_show_commands():
    """The extraction itself works: the README's quick start is found."""
    argvs = [argv for _, argv in ALL]
    assert ["map"] in argvs
    assert any(a[:1] == ["train"] and "--packing" in a for a in argvs)
    assert any(a[:1] == ["prepack"] and "--out" in a for a in argvs)
    shown = {a[0] for a in argvs} | {command for _, command, _ in INLINE}
    assert shown == _commands(), "a command no doc shows"


@pytest.mark.parametrize(("where", "argv"), ALL, ids=[f"{w}:{' '.join(a)[:40]}" for w, a in ALL])
def test_documented_command_parses(where, argv, tmp_path, monkeypatch):
    if "--config" in argv:  # the file is the user's: an empty one stands for it (read when parsing)
        monkeypatch.chdir(tmp_path)
        (tmp_path / argv[argv.index("--config") + 1]).write_text("")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: unknown flag, missing value, bad choice
        raise AssertionError(f"{where}: `sftpack {' '.join(argv)}` does not parse (exit {e.code})") from None
    assert args.command == argv[0]


def test_inline_mentions_use_real_flags():
    subs = _command_parsers()
    wrong = [
        f"{where}: sftpack {command} {flag}"
        for where, command, flags in INLINE
        for flag in flags
        if flag not in subs[command]._option_string_actions
    ]
    assert not wrong, "options the docs give a command that it does not have:\n" + "\n".join(wrong)


def test_dry_run_catches_a_flag_that_does_not_exist():
    """The negative control: the check above really fails on a made-up flag."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--micro-batch-tokens", "4096"])
    assert e.value.code == 2


_SCRIPT = re.compile(r"benchmarks/\w+\.py")


def test_every_flag_in_the_docs_exists():
    """Prose flags too; on a line that runs a benchmark script, that script's own flags count."""
    known = _known_flags() | set(FOREIGN_FLAGS)
    missing = []
    for doc in DOCS:
        for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            scripts = "".join(
                (ROOT / s).read_text(encoding="utf-8") for s in _SCRIPT.findall(line) if (ROOT / s).exists()
            )
            missing += [
                f"{doc.name}:{no}: {flag}"
                for flag in _FLAG.findall(line)
                if flag not in known and f'"{flag}"' not in scripts
            ]
    assert not missing, "flags the docs mention that no sftpack command has:\n" + "\n".join(missing)
