"""``sftpack verify FILE --model DIR``: the table, exit 0 when every path agrees, 1 naming the
first sample that differs (a broken packer, simulated by positions that do not restart), and 2
in one line for a model folder of an unsupported vision-language family."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

import sftpack.report.verify as verify_module
from sftpack.cli import main
from tests.report.test_verify import CONVERSATIONS, _folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "mine.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return _folder(str(tmp_path_factory.mktemp("my-llama")))


def test_verify_prints_a_row_per_path_and_mode_and_exits_0(data, folder, capsys):
    rc = main(["verify", data, "--model", folder, "--max-seq-len", "64", "--paths", "trainer", "offline"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith(("trainer ", "offline "))]
    assert [(r[0], r[1], r[-1]) for r in rows] == [
        ("trainer", "real", "exact"),
        ("trainer", "padded", "exact"),
        ("offline", "real", "exact"),
        ("offline", "padded", "exact"),
    ]
    assert f"model: {folder} (text, float64)" in out
    assert "packing is exact on this model" in out


def test_a_path_that_differs_exits_1_naming_the_sample(data, folder, capsys, monkeypatch):
    def broken(batch):  # a packer that forgets to restart the positions of each sequence
        return dataclasses.replace(batch, position_ids=torch.arange(len(batch.position_ids)))

    monkeypatch.setattr(verify_module, "verify", functools.partial(verify_module.verify, tamper=broken))
    rc = main(["verify", data, "--model", folder, "--max-seq-len", "64", "--paths", "trainer"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "DIFFERS" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"sftpack verify: trainer (real boundaries): conversation '{data}:")  # file:line
    assert "logits differ by" in last


def test_an_unsupported_vision_language_folder_is_one_line_and_exit_2(tmp_path, data, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral3", "vision_config": {}}))
    rc = main(["verify", data, "--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1
    assert "mistral3" in err and "qwen2_vl" in err
