"""``--config FILE.yaml``: a command's settings from a file, flags given on the command line winning.

The file is a YAML (or JSON) mapping whose keys are the command's own flag names, with dashes
or underscores and without the leading ``--`` (``max-seq-len: 2048`` or ``max_seq_len: 2048``),
or a positional argument's name (``inputs: [a.jsonl, b.jsonl]``, used when the command line
gives none). Each key becomes the flag it names, placed *before* the command line's own
arguments, so argparse checks and converts it exactly as if typed, and a flag given on the
command line overrides it (the last value of an option wins). A ``true`` switch named by its flag is
the flag (``no-progress: true``), one named by its setting takes that value (``progress: false``); a list gives an option of several values (or one value per repeat of a repeatable
option); ``null`` leaves the setting unset. An unknown key is refused naming the key and the
closest flag; so are a setting given twice (``max-seq-len`` and ``max_seq_len``, or one key
twice), a list or mapping where a flag takes one value, and a positional (``inputs``) that is
not file paths.

YAML aliases (``*name``, and the ``<<: *name`` merges that use them) are refused: a settings file
has no use for them, and nested aliases make a few hundred bytes into a value of billions of
elements (the "billion laughs"), which anything that walks or prints the value spends exponential
time and memory on. Without them, every value is as large as its text in the file, no larger.
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


def _shown(value: Any) -> str:
    """``value`` for a message, at most 60 characters: a list or a mapping by its kind alone (its
    text could be as long as the file)."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value[:61] if isinstance(value, (str, bytes)) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _loader() -> Any:
    """PyYAML's safe loader, refusing aliases (``*name``) and a key given twice in one mapping
    (PyYAML would keep the last silently); each refusal a ``yaml.MarkedYAMLError`` at the
    alias or the second key."""
    import yaml  # start-up: yaml loads only when a --config file is read or written

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.MarkedYAMLError(
                    problem=f"the YAML alias *{_shown(event.anchor)[1:-1]} is not read in a config file "
                    "(write the value itself)",
                    problem_mark=event.start_mark,
                )
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: PyYAML's own error names it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise yaml.MarkedYAMLError(
                        problem=f"{_shown(key)} is given twice, on lines {first} and "
                        f"{key_node.start_mark.line + 1} (keep one)",
                        problem_mark=key_node.start_mark,
                    )
            return super().construct_mapping(node, deep=deep)

    return Loader


def _load(path: str) -> dict[str, Any]:
    import yaml  # start-up: yaml loads only when a --config file is read or written

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ValueError(
            f"--config {path}, line {line}: not UTF-8 text (byte 0x{e.object[e.start]:02x}; save the file as UTF-8)"
        ) from None
    try:
        data = yaml.load(text, Loader=_loader())  # a SafeLoader (no Python tags), refusing aliases
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        fix = "" if problem.endswith(")") else " (write 'flag-name: value' lines)"
        raise ValueError(f"--config {path}{where}: {problem}{fix}") from None
    except RecursionError:
        raise ValueError(f"--config {path}: nested too deeply (write 'flag-name: value' lines)") from None
    except ValueError as e:  # a YAML scalar Python cannot hold (an integer of over 4300 digits)
        raise ValueError(f"--config {path}: {' '.join(str(e).split())[:200]}") from None
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
            raise ValueError(f"--config {path}: {key!r} is a switch: write true or false, not {_shown(value)}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value == (True if by_flag else action.const) else []
    if isinstance(action, argparse._CountAction):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"--config {path}: {key!r} counts: write a whole number, not {_shown(value)}")
        return [flag] * value
    if isinstance(value, dict):
        raise ValueError(f"--config {path}: {key!r} takes plain values, not a mapping")
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, (dict, list)) for v in values):  # no repr: its text can be all of the file
        raise ValueError(f"--config {path}: {key!r} takes plain values, not a list of lists or mappings")
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
    given: dict[argparse.Action, str] = {}  # each setting's key in the file, to refuse a second
    for raw_key, value in _load(path).items():
        key = str(raw_key).strip().lstrip("-").replace("_", "-")
        action = options[key][1] if key in options else positionals.get(key)
        if action is None:
            close = difflib.get_close_matches(key, [*options, *positionals], n=1, cutoff=0.5) if len(key) < 80 else []
            hint = f"did you mean --{close[0]}?" if close else f"see {parser.prog} --help for the flags"
            raise ValueError(f"--config {path}: unknown key {_shown(raw_key)} ({hint})")
        if action in given:
            raise ValueError(
                f"--config {path}: {given[action]!r} and {_shown(raw_key)} are the same setting (keep one)"
            )
        given[action] = str(raw_key)
        if key in options:
            words += _words(path, str(raw_key), *options[key], value)
        else:
            _positional(parser, path, str(raw_key), action, value)
    return words + rest, path


def _positional(parser: argparse.ArgumentParser, path: str, key: str, action: argparse.Action, value: Any) -> None:
    """``key: value`` as the default of the positional ``action`` (``inputs``): file paths, each
    a string (a number or a mapping would be read as data, not as a file's name)."""
    if value is None:
        return
    paths = value if isinstance(value, list) else [value]
    bad = next((v for v in paths if not isinstance(v, str)), None)
    if bad is not None or (isinstance(value, list) and action.nargs not in ("*", "+")):
        what = f"not {_shown(bad)}" if bad is not None else "one path, not a list"
        raise ValueError(
            f"--config {path}: {key!r} takes file paths, {what} (write each path as text, quoted if it looks like "
            "a number)"
        )
    parser.set_defaults(**{action.dest: paths if action.nargs in ("*", "+") else value})
