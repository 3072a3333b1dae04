"""``--family``: one meaning on every command that takes it, its choices the registry's."""

from __future__ import annotations

import pytest

from sftpack.cli import build_parser, main
from sftpack.loop import DataSettings, InputSettings, ModelSettings, OutputSettings, RunConfig, TrainConfig
from sftpack.multimodal import family_names

TINY = {"dim": 16, "layers": 1, "heads": 2, "kv_heads": 1}


def _family_action(command: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    sub._add_arguments()  # a command's options are added when it is first parsed (sftpack.cli._Parser)
    return next(a for a in sub._actions if a.dest == "family")


@pytest.mark.parametrize("command", ["prepack", "verify", "bench", "train"])
def test_every_command_takes_the_same_family_flag_with_the_registrys_names(command):
    action = _family_action(command)
    assert list(action.choices) == list(family_names())
    assert action.help == _family_action("prepack").help  # one meaning, said once
    assert "default: the --model folder's" in action.help


def test_train_with_a_family_on_text_data_is_refused_in_one_line(capsys):
    assert main(["train", "--family", "llava", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--family llava names the model of data with images: these inputs have no image parts" in err
    with pytest.raises(SystemExit) as e:  # argparse: not one of the registry's names
        main(["train", "--family", "no_such_family"])
    assert e.value.code == 2
    assert "invalid choice: 'no_such_family'" in capsys.readouterr().err


def test_an_image_run_trains_the_family_it_is_given():
    said: list[str] = []
    config = RunConfig(
        input=InputSettings(corpus="vqa", limit=4, image_sides=(56, 56)),
        data=DataSettings(vocab="data"),
        model=ModelSettings(family="llava"),
        train=TrainConfig(packing="trainer", steps=1, batch_size=2, max_seq_len=1024, **TINY),
        output=OutputSettings(progress=False),
    )
    result = config.build(say=said.append).run()
    assert [r.step for r in result.logs] == [1]
    assert any(line.startswith("model: tiny llava (") for line in said), said
