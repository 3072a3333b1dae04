"""``--config FILE.yaml`` on ``sftpack train`` and ``sftpack prepack``: every setting a flag gives,
the file gives under the flag's name (dashes or underscores); flags on the command line win; an
unknown key, a bad value or a bad file is one line naming the file and the key, exit 2."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from sftpack.cli import build_parser, main
from sftpack.cli._common import given_settings
from tests.cli.test_settings import COMMANDS, _another


def _yaml(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _line(v) -> str:
    return json.dumps(v)  # JSON scalars and lists are YAML


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_file_gives_every_setting_its_flag_gives(command, tmp_path):
    options, argv, _ = COMMANDS[command]
    lines, expected = [], {}
    for i, f in enumerate(dataclasses.fields(options)):
        if "help" not in f.metadata:
            continue
        text, expected[f.name] = _another(options, f)
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))[2:]
        key = flag.replace("-", "_") if i % 2 else flag  # both spellings
        value = True if isinstance(expected[f.name], bool) else text[0]  # a switch named by its flag: on
        lines.append(f"{key}: {_line(value)}")
    path = _yaml(tmp_path, "\n".join(lines) + "\n")
    from_file = given_settings(build_parser().parse_args([*argv, "--config", path]), options)
    assert from_file == expected


def test_flags_on_the_command_line_override_the_file(tmp_path):
    path = _yaml(tmp_path, "max-seq-len: 512\nlr: 0.5\nseed: 3\n")
    args = build_parser().parse_args(["train", f"--config={path}", "--lr", "0.25"])
    assert (args.max_seq_len, args.lr, args.seed) == (512, 0.25, 3)
    args = build_parser().parse_args(["train", "--max-seq-len", "128", "--config", path])
    assert args.max_seq_len == 128  # the command line wins wherever --config stands


def test_positionals_from_the_file_unless_given(tmp_path):
    path = _yaml(tmp_path, "inputs: [a.jsonl, b.jsonl]\nout: rows\n")
    args = build_parser().parse_args(["prepack", "--config", path])
    assert (args.inputs, args.out) == (["a.jsonl", "b.jsonl"], "rows")
    assert build_parser().parse_args(["prepack", "c.jsonl", "--config", path]).inputs == ["c.jsonl"]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("max_seqlen: 512\n", "unknown key 'max_seqlen' (did you mean --max-seq-len?)"),
        ("zzzz: 1\n", "unknown key 'zzzz' (see sftpack train --help"),
        ("lr: [1, 2]\n", "'lr' takes one value, not a list"),
        ("max-seq-len: fast\n", "--max-seq-len: 'fast' is not an integer (on the command line or in --config"),
        ("lr: 0.1\n  bad: [\n", ", line 2"),
        ("- lr\n", "must be a mapping"),
        # a list or a mapping where a flag takes plain values: refused by its kind, never printed
        ("lr: {a: 1}\n", "'lr' takes plain values, not a mapping"),
        ("packing: [[1, 2], [3]]\n", "'packing' takes plain values, not a list of lists or mappings"),
        ("fsdp: [1, 2]\n", "'fsdp' is a switch: write true or false, not a list"),
        # YAML aliases are refused where they stand (a few of them nested are a "billion laughs")
        ("lr: &x 0.1\nseed: *x\n", ", line 2: the YAML alias *x is not read in a config file (write the value itself)"),
        ("base: &b {lr: 0.1}\n<<: *b\n", ", line 2: the YAML alias *b is not read"),
        # inputs are file paths: a number or a mapping would be read as data
        ("inputs: 5\n", "'inputs' takes file paths, not 5 (write each path as text, quoted if it looks like a number)"),
        ("inputs: [a.jsonl, {messages: []}]\n", "'inputs' takes file paths, not a mapping"),
        ("inputs: {messages: [{role: user, content: hi}]}\n", "'inputs' takes file paths, not a mapping"),
        # the same setting twice: its dash and underscore spellings, its flag and setting names, one key twice
        ("max-seq-len: 64\nmax_seq_len: 128\n", "'max-seq-len' and 'max_seq_len' are the same setting (keep one)"),
        ("lr: 0.1\nseed: 1\nlr: 0.2\n", ", line 3: 'lr' is given twice, on lines 1 and 3 (keep one)"),
        # deeper than Python's recursion limit (PyYAML composes each level in a frame, at least)
        ("lr: " + "[" * (sys.getrecursionlimit() + 100) + "]" * (sys.getrecursionlimit() + 100) + "\n", "too deeply"),
    ],
)
def test_a_bad_file_is_one_line_and_exit_2(tmp_path, capsys, text, said):
    path = _yaml(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", path])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_a_switch_takes_true_or_false(tmp_path, capsys):
    on = next(f for f in dataclasses.fields(COMMANDS["prepack"][0]) if f.name == "progress")
    assert on.metadata  # a flag of prepack whose default is on: false in the file turns it off
    args = build_parser().parse_args(["prepack", "--out", "o", "--config", _yaml(tmp_path, "progress: false\n")])
    assert args.progress is False
    with pytest.raises(SystemExit):
        main(["prepack", "--out", "o", "--config", _yaml(tmp_path, "progress: maybe\n", "b.yaml")])
    assert "'progress' is a switch: write true or false" in capsys.readouterr().err


def test_a_switch_by_its_flag_and_by_its_setting_is_one_setting_given_twice(tmp_path, capsys):
    path = _yaml(tmp_path, "no-progress: true\nprogress: true\n")
    with pytest.raises(SystemExit) as e:
        main(["prepack", "--out", str(tmp_path / "rows"), "--config", path])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert f"--config {path}: 'no-progress' and 'progress' are the same setting (keep one)" in err


def test_prepack_from_a_config_file(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i} it is."}]}
        for i in range(6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = _yaml(tmp_path, f"inputs: [{data}]\nout: {tmp_path / 'rows'}\nmax_seq_len: 64\nno-progress: true\n")
    assert main(["prepack", "--config", path]) == 0
    manifest = json.loads((tmp_path / "rows" / "manifest.json").read_text())
    assert manifest["max_seq_len"] == 64


def test_a_file_not_in_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("lr: 0.1\n# réglages\n".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert f"--config {path}, line 2: not UTF-8 text (byte 0xe9; save the file as UTF-8)" in err


def _laughs(key: str) -> str:
    """A "billion laughs" file: nine levels of nine aliases each, 9**9 (387 million) strings
    when expanded, in about 700 bytes."""
    lines = [f"{key}:", "  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"  - &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    lines.append("  - [" + ", ".join(["*i"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("command", "key"), [("train", "lr"), ("prepack", "inputs")])
def test_a_billion_laughs_is_refused_at_its_first_alias(tmp_path, command, key):
    """Expanded, the value is built (or printed) in exponential time and memory: before, the
    command hung. The timeout only turns a hang into a failure; the refusal is immediate."""
    path = _yaml(tmp_path, _laughs(key), "laughs.yaml")
    assert len(_laughs(key)) < 800
    out = ["--out", str(tmp_path / "rows")] if command == "prepack" else []
    proc = subprocess.run(
        [sys.executable, "-m", "sftpack.cli", command, "--config", path, *out],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert f"--config {path}, line 3: the YAML alias *a is not read in a config file" in proc.stderr
