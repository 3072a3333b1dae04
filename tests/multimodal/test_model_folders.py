"""A user's own vision-language model folder (``save_pretrained``: config, weights, tokenizer with
its chat template, ``preprocessor_config.json``; built here from a config, nothing downloaded)
through the commands: ``sftpack verify --model DIR`` passes for every family; the rows ``sftpack
prepack --model DIR`` writes, run through the family's own Hugging Face class, equal each sample
alone (float64) and a negative control (positions not restarted) fails; ``sftpack train --model
DIR`` trains it; and a folder of an unsupported model type is one line and exit 2.

Tolerance: 1e-10 in float64, the bound of tests/consumers/test_exactness.py (same summation-order
argument: rounding chains of these 2-layer models with their towers are far below 1e5 terms, so
<= 2 * 1e5 * 1.1e-16 * 10 = 2.2e-10 worst case at magnitude 10 and about 1e-15 observed); a
positions bug moves the logits by more than 1e-6 here (observed: about 1e-3)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sftpack import PackedBatch
from sftpack.cli import main
from sftpack.multimodal import family_for
from sftpack.offline import PrepackedDataset
from tests.helpers import (
    FOLDER_BUG,
    FOLDER_TOL,
    check_prepacked_rows,
    folder_samples,
    packed_vs_alone,
    save_vlm_folder,
    write_folder_data,
)

pytest.importorskip("PIL")

TOL, BUG = FOLDER_TOL, FOLDER_BUG  # float64: see the module docstring
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "gemma3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_folder_data(tmp_path_factory.mktemp("vlm-data"))


_FOLDERS: dict[str, str] = {}


def _shared_folder(name: str, tmp_path_factory) -> str:
    """One folder per family for the tests that only read it."""
    if name not in _FOLDERS:
        _FOLDERS[name] = save_vlm_folder(str(tmp_path_factory.mktemp(name)), name)
    return _FOLDERS[name]


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, _shared_folder(request.param, tmp_path_factory)


def test_verify_passes_on_the_users_folder(folder, data, capsys):
    name, path = folder
    rc = main(["verify", str(data), "--model", path, "--max-seq-len", "256", "--limit", "4"])  # every conversation
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"({name}, float64)" in out
    table = [line for line in out.splitlines() if line.startswith(("trainer ", "loader ", "offline "))]
    assert len(table) == 6 and all(line.rstrip().endswith(" exact") for line in table), out  # 3 paths x 2 modes
    assert "not offered" not in out


@pytest.mark.parametrize("name", FAMILIES)
def test_prepacked_rows_of_the_folder_equal_each_sample_alone_through_hf(name, data, tmp_path, tmp_path_factory):
    path = save_vlm_folder(str(tmp_path_factory.mktemp(f"{name}-prepack")), name)
    out = tmp_path / "rows"
    assert main(["prepack", str(data), "--model", path, "--out", str(out), "--max-seq-len", "256"]) == 0
    ds = PrepackedDataset(out)
    assert ds.manifest["media"]["family"] == name
    assert main(["inspect", str(out), "--row", "0"]) == 0  # every media kind described
    fam = family_for(path)
    check_prepacked_rows(fam, path, data, [ds[i] for i in range(len(ds))])


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_rows_of_an_image_family_folder_equal_each_sample_alone_through_hf(name, data, tmp_path_factory):
    """LLaVA-1.5 (``<image>``, its own template) and Gemma 3 (soft tokens bidirectional within an
    image) folders: the rows the loader and the trainer build (``PackedBatch.from_samples``) of the folder's own samples, through the folder's
    Hugging Face class, equal each sample alone; the row's images shifted by one fail it."""
    path = _shared_folder(name, tmp_path_factory)
    fam = family_for(path)
    assert fam.name == name and fam.image_token_id == fam.placeholder_id(fam.tokenizer(path))
    model = fam.pretrained(path, dtype=torch.float64)
    samples = folder_samples(fam, path, data)
    tok = fam.tokenizer(path)
    text = tok.decode(samples[0].input_ids)
    assert text.startswith({"llava": "USER: <image>", "gemma3": "<bos><start_of_turn>user\n\n\n<start_of_image>"}[name])
    if name == "llava":  # the folder's own template: its spacing, no end-of-turn token, "Red. " trained
        assert text.endswith("What colour is it? ASSISTANT: Red. ")
        assert tok.decode(samples[0].input_ids[samples[0].loss_mask]) == "Red. "
    row = PackedBatch.from_samples(samples, pad_multiple=4, pad_id=0).validate()
    assert row.media.num_items == 4  # images a, b, b, a: shifted by one, two of them move
    pixels = row.media.pixel_values.roll(1, 0)
    shifted = dataclasses.replace(row, media=dataclasses.replace(row.media, pixel_values=pixels))
    for bad, run in ((False, row), (True, shifted)):
        logits, loss, grads = packed_vs_alone(fam, model, samples, run)
        if bad:
            assert logits > BUG
        else:
            assert max(logits, loss, *grads.values()) <= TOL


def test_train_runs_on_the_users_folder(data, tmp_path, tmp_path_factory, capsys):
    path = save_vlm_folder(str(tmp_path_factory.mktemp("qwen2_vl-train")), "qwen2_vl")
    log = tmp_path / "log.jsonl"
    rc = main(["train", str(data), "--model", path, "--steps", "2", "--batch-size", "2", "--log", str(log)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"model: {path} (qwen2_vl) (Qwen2VLForConditionalGeneration)" in out and "tiny" not in out
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(x["images"] >= 0 for x in lines)


def test_bench_takes_the_users_folder(data, tmp_path_factory, capsys):
    path = save_vlm_folder(str(tmp_path_factory.mktemp("qwen2_5_vl-bench")), "qwen2_5_vl")
    assert main(["bench", str(data), "--model", path, "--max-seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "4 conversations -> 4 samples with 4 images" in out


@pytest.mark.parametrize("command", ["verify", "prepack", "train", "bench"])
def test_an_unsupported_model_folder_is_one_line_and_exit_2(command, data, tmp_path, capsys):
    folder = tmp_path / "mistral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral3", "vision_config": {}}))
    extra = ["--out", str(tmp_path / "o")] if command == "prepack" else []
    rc = main([command, str(data), "--model", str(folder), *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1
    assert "mistral3" in err and "qwen2_vl" in err
