"""``--config FILE.yaml``: a command's settings from a file, flags given on the command line winning.

The file is a YAML (or JSON) mapping whose keys are the command's own flag names, with dashes
or underscores and without the leading ``--`` (``max-seq-len: 2048`` or ``max_seq_len: 2048``),
or a positional argument's name (``inputs: [a.jsonl, b.jsonl]``, used when the command line
gives none). Each key becomes the flag it names, placed *before* the command line's own
arguments, so argparse checks and converts it exactly as if typed, and a flag given on the
command line overrides it (the last value of an option wins). A ``true`` switch named by its flag is
the flag (``no-progress: true``), one named by its setting takes that value (``progress: false``); a list gives an option of several values (or one value per repeat of a repeatable
option); ``null`` leaves the setting unset. An unknown key is refused naming the key and the
closest flag.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_HELP", "expand_config"]

CONFIG_HELP = (
    "a YAML file of this command's settings: keys are its flag names (dashes or underscores, no --), "
    "for example 'max-seq-len: 4096'; flags given on the command line override the file"
)


def _config_path(args: list[str]) -> tuple[str | None, list[str]]:
    """The ``--config`` value in ``args`` (before any ``--``) and ``args`` without it."""
    rest: list[str] = []
    path: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            rest.extend(args[i:])
            break
        if a == "--config" or a.startswith("--config="):
            if path is not None:
                raise ValueError("--config given twice (give one file)")
            if a == "--config":
                if i + 1 >= len(args):
                    raise ValueError("--config: expected a file name")
                path, i = args[i + 1], i + 2
            else:
                path, i = a.split("=", 1)[1], i + 1
            continue
        rest.append(a)
        i += 1
    return path, rest


def _load(path: str) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise ValueError(f"--config {path}{where}: {problem} (write 'flag-name: value' lines)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must be a mapping of 'flag-name: value' lines")
    return data


def _options(
    parser: argparse.ArgumentParser,
) -> tuple[dict[str, tuple[str, argparse.Action, bool]], dict[str, argparse.Action]]:
    """The parser's options by name without ``--`` (each flag, and each setting's name where it
    differs: ``no-progress`` and ``progress``) as ``(flag, action, named by its flag)``, and its
    positionals by name."""
    options: dict[str, tuple[str, argparse.Action, bool]] = {}
    positionals: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.dest == "config":
            continue
        if not action.option_strings:
            positionals[action.dest.replace("_", "-")] = action
            continue
        long = [f for f in action.option_strings if f.startswith("--")]
        if isinstance(action, argparse.BooleanOptionalAction):
            long = [f for f in long if not f.startswith("--no-")]
        for flag in long:
            options[flag[2:]] = (flag, action, True)
        if long:
            options.setdefault(action.dest.replace("_", "-"), (long[0], action, False))
    return options, positionals


def _words(path: str, key: str, flag: str, action: argparse.Action, by_flag: bool, value: Any) -> list[str]:
    """The command-line words that say ``key: value`` for ``action`` (a switch named ``by_flag``:
    ``true`` gives the flag; named by its setting: the value the setting takes)."""
    if value is None:
        return []
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {key!r} is a switch: write true or false, not {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value == (True if by_flag else action.const) else []
    if isinstance(action, argparse._CountAction):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"--config {path}: {key!r} counts: write a whole number, not {value!r}")
        return [flag] * value
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, (dict, list)) for v in values):
        raise ValueError(f"--config {path}: {key!r} takes plain values, not {value!r:.60}")
    text = [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
    if isinstance(action, argparse._AppendAction):
        return [w for t in text for w in (flag, t)]
    if isinstance(value, list) and action.nargs in (None, "?"):
        raise ValueError(f"--config {path}: {key!r} takes one value, not a list")
    return [flag, *text]


def expand_config(parser: argparse.ArgumentParser, args: Sequence[str]) -> tuple[list[str], str | None]:
    """``args`` with its ``--config FILE`` replaced by the file's settings, and ``FILE`` (``None``
    when not given). The settings are placed before the
    command line's own arguments (which then win); a positional named in the file becomes the
    parser's default for it. Raises ``ValueError`` (one line naming the file and key) for a bad
    file, an unknown key or a value of the wrong shape."""
    path, rest = _config_path(list(args))
    if path is None:
        return rest, None
    options, positionals = _options(parser)
    words: list[str] = []
    for raw_key, value in _load(path).items():
        key = str(raw_key).strip().lstrip("-").replace("_", "-")
        if key in options:
            words += _words(path, str(raw_key), *options[key], value)
        elif key in positionals:
            action = positionals[key]
            given = value if isinstance(value, list) else [value]
            parser.set_defaults(**{action.dest: given if action.nargs in ("*", "+") else value})
        else:
            close = difflib.get_close_matches(key, [*options, *positionals], n=1, cutoff=0.5)
            hint = f"did you mean --{close[0]}?" if close else f"see {parser.prog} --help for the flags"
            raise ValueError(f"--config {path}: unknown key {raw_key!r} ({hint})")
    return words + rest, path
