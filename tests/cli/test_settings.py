"""A setting of ``sftpack train`` / ``prepack`` is declared once, on its field of
:class:`~sftpack.loop.TrainConfig` / :class:`~sftpack.offline.PrepackOptions`: the
command has a flag for each field that is not the library's alone, its default is the
field's (or the one its metadata declares for the command), and the value a flag is
given is the value the run's options get."""

from __future__ import annotations

import dataclasses
import enum
import subprocess
import sys
import typing

import pytest

from sftpack.cli import build_parser
from sftpack.cli._common import given_settings
from sftpack.loop import TrainConfig
from sftpack.offline import PrepackOptions, prepack
from sftpack.offline._ray import RayEngine

#: the fields that are the library's alone (no flag), per command: its options class and the arguments it needs
COMMANDS = {
    "train": (TrainConfig, ["train"], {"micro_batch_tokens", "betas", "eps", "extra"}),
    "prepack": (PrepackOptions, ["prepack", "--out", "out"], {"unit_size", "write_tasks", "actor_cpus", "images"}),
}


def _actions(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = next(a for a in parser._actions if a.dest == "command").choices[argv[0]]
    return args, {a.dest: a for a in sub._actions}


def _value(v):
    return v.value if isinstance(v, enum.Enum) else v


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_setting_has_its_flag_and_its_declared_default(command):
    options, argv, library_only = COMMANDS[command]
    args, actions = _actions(argv)
    fields = dataclasses.fields(options)
    flagged = {f.name for f in fields if "help" in f.metadata}
    assert flagged == {f.name for f in fields} - library_only  # a field without a flag is a library-only one
    for f in fields:
        if f.name not in flagged:
            continue
        action = actions.get(f.name)
        assert action is not None, f"{command}: {f.name} declares a flag the command does not add"
        assert action.option_strings == [f.metadata.get("flag", "--" + f.name.replace("_", "-"))]
        declared = f.metadata.get("cli_default", f.default)
        assert getattr(args, f.name) == _value(declared), f"{command} --{f.name}: default differs from the field's"
        assert action.help and "{" not in action.help


def test_the_command_defaults_that_differ_are_the_declared_ones():
    args, _ = _actions(["train"])
    # --steps and --epochs are exclusive: both unset in the parser; the command's default steps
    # (CLI_STEPS) differ from the library's (DEFAULT_STEPS) and are applied when neither is given
    from sftpack.cli._train import run_config
    from sftpack.loop._options import CLI_STEPS, DEFAULT_STEPS

    assert args.steps is None and args.epochs is None
    assert run_config(args).train.steps == CLI_STEPS != DEFAULT_STEPS == TrainConfig().steps
    args, _ = _actions(["prepack", "--out", "out"])
    assert args.pad_multiple is None and args.workers is None and args.progress is True


def _another(options, f):
    """A valid value of setting ``f`` that is not its default (as the flag's text, and as the options hold it)."""
    default = f.metadata.get("cli_default", f.default)
    default = f.default if default is None else default
    hint = typing.get_type_hints(options)[f.name]
    enums = [k for k in typing.get_args(hint) or (hint,) if isinstance(k, type) and issubclass(k, enum.Enum)]
    if enums or "choices" in f.metadata:
        choices = [m.value for m in enums[0]] if enums else f.metadata["choices"]
        value = next(c for c in choices if c != _value(default))
        return [value], value
    if isinstance(default, bool):
        return [], not default
    if isinstance(default, float):
        return [str((default or 1.0) / 2)], (default or 1.0) / 2
    if isinstance(default, int) or default is None and "min" in f.metadata:
        value = 2 * (default or 1)
        return [str(value)], value
    if "|" in f.metadata.get("metavar", ""):  # a few words or a path ("tokens|attention|SIZE|DIR"): another word
        value = next(w for w in f.metadata["metavar"].split("|") if w != default)
        return [value], value
    return ["cpu"], "cpu"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_flag_gives_its_setting(command):
    options, argv, _ = COMMANDS[command]
    given, expected = list(argv), {}
    for f in dataclasses.fields(options):
        if "help" in f.metadata:
            text, expected[f.name] = _another(options, f)
            given += [f.metadata.get("flag", "--" + f.name.replace("_", "-")), *text]
    args = build_parser().parse_args(given)
    assert given_settings(args, options) == expected
    assert given_settings(build_parser().parse_args(argv), options).keys() < expected.keys()  # unset: the default's


def test_train_flags_make_the_run_config():
    from sftpack.cli._train import run_config

    def _config(args):
        return run_config(args).train

    argv, expected = ["train"], {}
    # --epochs is the alternative to --steps, --objective dpo needs the trainer path (every other
    # flag here moves off its default, --packing too): both below
    for f in dataclasses.fields(TrainConfig):
        if "help" in f.metadata and f.name not in ("epochs", "objective"):
            text, expected[f.name] = _another(TrainConfig, f)
            argv += ["--" + f.name.replace("_", "-"), *text]
    cfg = _config(build_parser().parse_args(argv))
    assert {name: _value(getattr(cfg, name)) for name in expected} == expected
    assert _config(build_parser().parse_args(["train", "--epochs", "3"])).epochs == 3
    dpo = _config(build_parser().parse_args(["train", "--objective", "dpo", "--packing", "trainer"]))
    assert _value(dpo.objective) == "dpo"
    # the command's own meaning of a value: --clip-norm 0 is off
    assert _config(build_parser().parse_args(["train", "--max-seq-len", "64", "--clip-norm", "0"])).clip_norm is None


def test_prepack_keywords_are_the_options_fields(tmp_path):
    with pytest.raises(TypeError, match=r"prepack got max_seq_ln, not a setting: the settings are max_seq_len, "):
        prepack(None, tmp_path / "out", max_seq_ln=512)
    with pytest.raises(TypeError, match=r"RayEngine got seed, not a setting: the settings are workers, ray_address"):
        RayEngine(workers=2, seed=1)
    assert RayEngine().workers == PrepackOptions.workers and RayEngine(workers=3).workers == 3
    with pytest.raises(ValueError, match="prepack got options= and also engine, seed: set them in the"):
        prepack(None, tmp_path / "out", options=PrepackOptions(), seed=0, engine="local")
    assert not (tmp_path / "out").exists()


def test_the_parser_loads_no_torch_until_a_command_needs_it():
    """``sftpack train`` parses its TrainConfig-built options without torch (sftpack.loop loads its names
    lazily), so its tokenizer process starts while torch loads; prepack's options load the offline package."""
    code = (
        "import sys; from sftpack.cli import build_parser; p = build_parser(); p.format_help(); "
        "p.parse_args(['map']); p.parse_args(['bench']); p.parse_args(['train', '--steps', '1']); "
        "assert 'torch' not in sys.modules, 'torch'; "
        "p.parse_args(['prepack', '--out', 'x']); assert 'torch' in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
