"""No double work in the commands that take data with images: ``sftpack train`` on the offline
path tokenizes each conversation once (and processes its images once: the temporary prepack is
written from the run's samples), and ``sftpack bench --model DIR`` loads the folder's tokenizer
and image processor once (the folder's family is checked first, before any work, without
loading them).

Counting is done on the real objects: the family class's own methods are wrapped by a counter
that calls them (no mock; the real tokenizer and processor are loaded and used)."""

from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sftpack.cli import main
from sftpack.multimodal import family_for
from tests.helpers import save_vlm_folder, write_folder_data

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The model-folder tests' four conversations (:func:`tests.helpers.write_folder_data`)."""
    return write_folder_data(tmp_path_factory.mktemp("vlm-data"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A user's Qwen2-VL folder: a tiny model (built from a config, nothing downloaded), a small
    tokenizer of its kind with its chat template, the image processor."""
    return save_vlm_folder(
        str(tmp_path_factory.mktemp("qwen2_vl-folder")), "qwen2_vl", dim=16, layers=1, heads=2, kv_heads=1
    )


def _counting(monkeypatch, cls: type, *names: str) -> Counter:
    """``cls``'s methods ``names`` wrapped by a counter that calls the real method."""
    calls: Counter = Counter()
    for name in names:
        real = getattr(cls, name)

        @functools.wraps(real)
        def counted(self: Any, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(cls, name, counted)
    return calls


def test_train_offline_with_images_tokenizes_each_conversation_once(data, folder, tmp_path, monkeypatch, capsys):
    """``Family.encode_images`` runs once per conversation tokenized (images or none): as many
    calls as conversations read, on the offline path (the tiny model, and a user's ``--model``
    folder) as on the trainer path."""
    calls = _counting(monkeypatch, type(family_for(folder)), "encode_images")
    tiny = ["--vocab", "data", "--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1"]
    args = ["train", str(data), "--steps", "1", "--batch-size", "1", "--max-seq-len", "256", "--device", "cpu"]
    for packing, model in (("offline", tiny), ("offline", ["--model", folder]), ("trainer", tiny)):
        calls.clear()
        log = tmp_path / f"{packing}-{len(model)}.jsonl"
        assert main([*args, *model, "--packing", packing, "--log", str(log)]) == 0
        out = capsys.readouterr().out
        read = int(re.search(r"data: (\d+) conversations ->", out).group(1))
        assert read == 4 and calls == {"encode_images": read}, (packing, model, calls, out)
        assert ("prepacked into" in out) == (packing == "offline"), out  # offline: a prepack of the samples


def test_a_prepack_of_samples_with_images_is_the_prepack_of_their_conversations(data, tmp_path):
    """What the offline run writes (``prepack_samples(images=True)`` of the samples it tokenized)
    is byte for byte what ``prepack(images=True)`` writes of the same conversations (every file
    but the manifest, whose source and reading counts differ); negative control: without one
    sample the files differ, so the comparison can fail."""
    from sftpack.chat import read_conversations
    from sftpack.loop._setup import media_samples
    from sftpack.offline import prepack, prepack_samples

    fam = family_for(None)
    tok, proc = fam.tokenizer(), fam.image_processor()
    settings = {"max_seq_len": 128, "tokenizer": tok, "processor": proc, "family": fam, "max_patches_per_row": 256}
    convs = list(read_conversations([str(data)]))
    a = prepack(convs, tmp_path / "a", images=True, **settings).path
    samples, _ = media_samples(convs, max_seq_len=128, family=fam, tokenizer=tok, processor=proc)
    b = prepack_samples(samples, tmp_path / "b", images=True, **settings).path
    c = prepack_samples(samples[1:], tmp_path / "c", images=True, **settings).path
    files = sorted(p.name for p in Path(a).iterdir() if p.name != "manifest.json")
    assert "pixels.npy" in files and "tokens.npy" in files, files
    assert [f for f in files if (Path(a) / f).read_bytes() != (Path(b) / f).read_bytes()] == []
    assert {"tokens.npy", "pixels.npy"} <= {
        f for f in files if (Path(a) / f).read_bytes() != (Path(c) / f).read_bytes()
    }


def test_bench_model_loads_the_folders_tokenizer_and_image_processor_once(data, folder, monkeypatch, capsys):
    calls = _counting(monkeypatch, type(family_for(folder)), "tokenizer", "image_processor")
    assert main(["bench", str(data), "--model", folder, "--max-seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "4 conversations -> 4 samples with 4 images" in out  # the run used them
    assert calls == {"tokenizer": 1, "image_processor": 1}, calls


def test_bench_model_still_refuses_an_unsupported_folder_before_any_work(data, tmp_path, monkeypatch, capsys):
    import json

    other = tmp_path / "mistral"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "mistral3", "vision_config": {}}))
    calls = _counting(monkeypatch, type(family_for(None)), "tokenizer", "image_processor", "encode_images")
    assert main(["bench", str(data), "--model", str(other)]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and "mistral3" in captured.err, captured.err
    assert captured.out == "" and not calls, (captured.out, calls)  # nothing read, loaded or tokenized
