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
import functools
import json
from pathlib import Path

import pytest
import torch

from sftpack.cli import main
from sftpack.loop._model import build_media_model
from sftpack.multimodal import family_for
from sftpack.multimodal._exactness import compare_packed_alone
from sftpack.offline import PrepackedDataset
from tests.cli.test_cli_images import _conv, _png, _write

pytest.importorskip("PIL")

TOL = 1e-10  # float64: see the module docstring
BUG = 1e-6
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm-data")
    _png(root / "a.png", (56, 56), (200, 30, 30))
    _png(root / "b.png", (84, 56), (30, 200, 30))
    text = {"type": "text", "text": "What colour is it?"}
    return _write(
        root / "mine.jsonl",
        [
            _conv({"type": "image", "path": "a.png"}, text, answer="Red."),
            _conv({"type": "image", "path": "b.png"}, text, answer="Green."),
            {"messages": [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi there."}]},
            _conv({"type": "image", "path": "b.png"}, {"type": "image", "path": "a.png"}, text, answer="Both."),
        ],
    )


@functools.cache
def _folder(root: str, name: str) -> str:
    """A user's folder of ``name``'s model: a tiny model with its tokenizer and image processor."""
    fam = family_for(name)
    tok, proc = fam.tokenizer(), fam.image_processor()
    build_media_model(fam, tok, seed=5).save_pretrained(root)
    tok.save_pretrained(root)
    proc.save_pretrained(root)
    return root


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, _folder(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_verify_passes_on_the_users_folder(folder, data, capsys):
    name, path = folder
    rc = main(["verify", str(data), "--model", path, "--max-seq-len", "256"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"({name}, float64)" in out
    assert out.count(" exact") >= 4  # trainer and loader, both modes
    if name == "llava":  # the offline path stores Qwen2-VL-style pixels only: said, not silently skipped
        assert "offline  real       not offered" in out


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_prepacked_rows_of_the_folder_equal_each_sample_alone_through_hf(name, data, tmp_path, tmp_path_factory):
    path = _folder(str(tmp_path_factory.mktemp(f"{name}-prepack")), name)
    out = tmp_path / "rows"
    assert main(["prepack", str(data), "--model", path, "--out", str(out), "--max-seq-len", "256"]) == 0
    ds = PrepackedDataset(out)
    assert ds.manifest["media"]["family"] == name
    fam = family_for(path)
    model = fam.pretrained(path, dtype=torch.float64)
    samples = {s.conversation_id: s for s in _samples(fam, path, data)}
    for row in (ds[i] for i in range(len(ds))):
        chosen = [samples[i] for i in row.sequence_ids]
        for bad, tamper in ((False, None), (True, _positions_not_restarted)):
            run = tamper(row) if tamper else row
            logits, loss, grads, _, _ = compare_packed_alone(
                model,
                chosen,
                run,
                alone=fam.alone_logits,
                packed=lambda run=run: fam.packed_logits(model, run),
                part_of=fam.part_of,
            )
            if not bad:
                assert max(logits, loss, *grads.values()) <= TOL
            elif len(chosen) > 1:
                assert logits > BUG


def _samples(fam, path, data):
    """The folder's own samples of ``data`` (ids as the reader gives them: file:line)."""
    from sftpack.chat import read_conversations
    from sftpack.loop._setup import media_samples

    tok, proc = fam.tokenizer(path), fam.image_processor(path)
    samples, _ = media_samples(
        read_conversations([str(data)]), max_seq_len=256, family=fam, tokenizer=tok, processor=proc
    )
    return samples


def _positions_not_restarted(batch):
    media = batch.media
    positions = media.positions.clone()
    positions[:] = torch.arange(positions.shape[-1])
    return dataclasses.replace(
        batch,
        position_ids=torch.arange(len(batch.position_ids)),
        media=dataclasses.replace(media, positions=positions),
    )


def test_train_runs_on_the_users_folder(data, tmp_path, tmp_path_factory, capsys):
    path = _folder(str(tmp_path_factory.mktemp("qwen2_vl-train")), "qwen2_vl")
    log = tmp_path / "log.jsonl"
    rc = main(["train", str(data), "--model", path, "--steps", "2", "--batch-size", "2", "--log", str(log)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"model: {path} (qwen2_vl) (Qwen2VLForConditionalGeneration)" in out and "tiny" not in out
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(x["images"] >= 0 for x in lines)


def test_bench_takes_the_users_folder(data, tmp_path_factory, capsys):
    path = _folder(str(tmp_path_factory.mktemp("qwen2_5_vl-bench")), "qwen2_5_vl")
    assert main(["bench", str(data), "--model", path, "--max-seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "4 conversations -> 4 samples with 4 images" in out


@pytest.mark.parametrize("command", ["verify", "prepack", "train", "bench"])
def test_an_unsupported_model_folder_is_one_line_and_exit_2(command, data, tmp_path, capsys):
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "vision_config": {}}))
    extra = ["--out", str(tmp_path / "o")] if command == "prepack" else []
    rc = main([command, str(data), "--model", str(folder), *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1
    assert "gemma3" in err and "qwen2_vl" in err
