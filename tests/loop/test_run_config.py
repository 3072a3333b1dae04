"""``sftpack.loop.RunConfig``: ``sftpack train`` as a library object. A run built in Python and
the same settings in a ``--config`` YAML file run the same thing (the same losses), for text and
for images; the rules between settings are the config's, named in Python's spelling or the
command's."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sftpack.cli import build_parser, main
from sftpack.loop import (
    ConfigError,
    DataSettings,
    InputSettings,
    ModelSettings,
    OutputSettings,
    RunConfig,
    TrainConfig,
)
from sftpack.loop._run_parts import PARTS

#: a tiny model, a few steps: the same settings for the Python run and the YAML file
TINY = {"dim": 16, "layers": 1, "heads": 2, "kv_heads": 1, "lr": 1e-2, "device": "cpu", "seed": 3}


def _yaml(path, settings):
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items()))
    return str(path)


def _cli_losses(tmp_path, settings, capsys):
    log = tmp_path / "cli.jsonl"
    assert main(["train", "--config", _yaml(tmp_path / "run.yaml", {**settings, "log": str(log)})]) == 0
    capsys.readouterr()
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_a_text_run_from_python_is_the_yaml_run(chat, tmp_path, capsys):
    train = TrainConfig(packing="trainer", steps=3, batch_size=4, max_seq_len=256, **TINY)
    config = RunConfig(
        input=InputSettings(inputs=[str(chat / "chat.jsonl")], limit=24),
        data=DataSettings(cache_dir=str(tmp_path / "cache")),
        model=ModelSettings(tokenizer=str(chat / "tok")),
        train=train,
        output=OutputSettings(progress=False),
    )
    said: list[str] = []
    result = config.build(say=said.append).run()
    assert [r.step for r in result.logs] == [1, 2, 3]
    assert any(line.startswith("data: 24 conversations -> 24 samples") for line in said), said
    assert any(line.startswith("loss ") for line in said), said  # the report, said through say
    capsys.readouterr()
    assert not capsys.readouterr().out  # the library printed nothing

    flat = {"inputs": [str(chat / "chat.jsonl")], "limit": 24, "tokenizer": str(chat / "tok")}
    flat |= {"packing": "trainer", "steps": 3, "batch-size": 4, "max-seq-len": 256, "no-progress": True}
    flat |= {k.replace("_", "-"): v for k, v in TINY.items()}
    flat["cache-dir"] = str(tmp_path / "cache")
    assert _cli_losses(tmp_path, flat, capsys) == result.losses


def test_an_image_run_from_python_is_the_yaml_run(tmp_path, capsys):
    train = TrainConfig(packing="trainer", steps=2, batch_size=2, max_seq_len=512, **TINY)
    config = RunConfig(
        input=InputSettings(corpus="vqa", limit=6, image_sides=(56, 84)),
        data=DataSettings(vocab="data"),
        train=train,
        output=OutputSettings(progress=False),
    )
    said: list[str] = []
    run = config.build(say=said.append)
    assert run.images
    result = run.run()
    assert [r.step for r in result.logs] == [1, 2] and all(r.images for r in result.logs)
    assert any(line.startswith("data: 6 easy-vqa conversations -> 6 samples with ") for line in said), said
    flat = {"corpus": "vqa", "limit": 6, "image-sides": [56, 84], "vocab": "data", "packing": "trainer"}
    flat |= {"steps": 2, "batch-size": 2, "max-seq-len": 512, "no-progress": True}
    flat |= {k.replace("_", "-"): v for k, v in TINY.items()}
    assert _cli_losses(tmp_path, flat, capsys) == result.losses


def test_a_broken_rule_names_its_settings_in_each_spelling(tmp_path, capsys):
    config = RunConfig(train=TrainConfig(packing="trainer"), data=DataSettings(prepacked=str(tmp_path)))
    with pytest.raises(ConfigError) as e:
        config.build()
    assert str(e.value) == "prepacked is for packing offline"
    assert {"prepacked", "packing"} <= set(e.value.settings)
    assert e.value.spelled(lambda name: "--" + name.replace("_", "-")) == "--prepacked is for --packing offline"
    out = OutputSettings(resume_if_any=True)
    with pytest.raises(ConfigError, match="^resume_if_any needs checkpoint_dir$"):
        RunConfig(output=out).check()
    assert main(["train", "--resume-if-any"]) == 2
    assert "--resume-if-any needs --checkpoint-dir" in capsys.readouterr().err
    # what a run with images does not take yet is refused by the config, not by the command
    vqa = InputSettings(corpus="vqa")
    with pytest.raises(ConfigError, match="^cache_dir: data with images is tokenized by each run, not cached"):
        RunConfig(input=vqa, data=DataSettings(cache_dir=str(tmp_path))).check()
    with pytest.raises(ConfigError, match="^fsdp trains text models only for now"):
        RunConfig(input=vqa, train=TrainConfig(fsdp=True)).check()
    assert main(["train", "--corpus", "vqa", "--cache-max-size", "1G"]) == 2
    assert "--cache-max-size: data with images is tokenized by each run" in capsys.readouterr().err


def test_every_option_of_train_is_a_setting_of_one_part():
    """The flags are the parts' fields (declared there once), no two parts share a name, and
    flat settings (the flags' values) make the parts they name."""
    names = [f.name for part in PARTS.values() for f in dataclasses.fields(part)]
    assert len(names) == len(set(names))
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["train"]
    dests = {a.dest for a in sub._actions if a.dest not in ("help", "config")}
    assert dests <= set(names), dests - set(names)
    config = RunConfig.from_settings({"limit": 5, "vocab": "data", "lr": 0.5, "log": "x.jsonl", "clip_norm": 0})
    assert (config.input.limit, config.data.vocab, config.train.lr, config.output.log) == (5, "data", 0.5, "x.jsonl")
    assert config.train.clip_norm is None  # 0: off, as --clip-norm 0


def test_a_model_folders_own_tokenizer_keys_the_cache(chat, tmp_path, capsys):
    """``--model DIR`` with a tokenizer in it tokenizes with that tokenizer, and its cache entry is
    keyed by that tokenizer's files: a run given the same folder as ``--tokenizer`` reads it back."""
    import shutil

    from sftpack.loop import build_model

    folder = tmp_path / "model"
    shutil.copytree(chat / "tok", folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    build_model(vocab + 64, dim=16, layers=1, heads=2, kv_heads=1).save_pretrained(folder)
    common = [str(chat / "chat.jsonl"), "--steps", "1", "--batch-size", "4", "--max-seq-len", "256", "--no-progress"]
    common += ["--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]
    assert main(["train", *common, "--model", str(folder)]) == 0
    assert "; cached in " in capsys.readouterr().out
    small = ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1"]
    assert main(["train", *common, "--tokenizer", str(folder), *small]) == 0
    assert "; read from the cache (" in capsys.readouterr().out
