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

from sftpack import PackedBatch
from sftpack.cli import main
from sftpack.loop._model import build_media_model
from sftpack.multimodal import family_for
from sftpack.multimodal._exactness import compare_packed_alone
from sftpack.offline import PrepackedDataset
from tests.cli.test_cli_images import _conv, _png, _write

pytest.importorskip("PIL")

TOL = 1e-10  # float64: see the module docstring
BUG = 1e-6
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "gemma3"]


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


#: Hugging Face's LLaVA-1.5 conversation format as its llava-1.5 folders' template writes it
#: (written here, not copied): ``USER: <image>\\n... ASSISTANT: ...``, images first, each text
#: followed by a space, the assistant's text marked with {% generation %}; no end-of-turn token.
LLAVA_15_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for part in message['content'] if part['type'] == 'image' %}{{ '<image>\\n' }}{% endfor %}"
    "{% for part in message['content'] if part['type'] == 'text' %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ part['text'] + ' ' }}{% endgeneration %}"
    "{% else %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _tiny_tokenizer(name: str):
    """A small tokenizer of the family's own kind (byte-level BPE, ~280 ids, so a float64 run of
    the folder's model is quick): LLaVA-1.5's ``<image>`` with its template, or Gemma 3's tokens
    with its template."""
    from sftpack.multimodal.families import gemma3
    from sftpack.testing import tiny_chat_tokenizer

    tok = tiny_chat_tokenizer("chatml")
    if name == "llava":
        tok.add_special_tokens({"additional_special_tokens": ["<image>"]}, replace_extra_special_tokens=False)
        tok.chat_template = LLAVA_15_TEMPLATE
    else:
        specials = [gemma3.TURN_START, gemma3.TURN_END, gemma3.BOI, gemma3.EOI, gemma3.SOFT]
        tok.add_special_tokens({"bos_token": gemma3.BOS, "additional_special_tokens": specials})
        tok.chat_template = gemma3.GEMMA3_TEMPLATE
    return tok


@functools.cache
def _folder(root: str, name: str) -> str:
    """A user's folder of ``name``'s model: a tiny model with its tokenizer (LLaVA and Gemma 3: a
    small one of their own kind) and image processor."""
    fam = family_for(name)
    tok = _tiny_tokenizer(name) if name in ("llava", "gemma3") else fam.tokenizer()
    proc = fam.image_processor()
    build_media_model(fam, tok, seed=5).save_pretrained(root)
    tok.save_pretrained(root)
    proc.save_pretrained(root)
    return root


_FOLDERS: dict[str, str] = {}


def _shared_folder(name: str, tmp_path_factory) -> str:
    """One folder per family for the tests that only read it."""
    if name not in _FOLDERS:
        _FOLDERS[name] = _folder(str(tmp_path_factory.mktemp(name)), name)
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
    path = _folder(str(tmp_path_factory.mktemp(f"{name}-prepack")), name)
    out = tmp_path / "rows"
    assert main(["prepack", str(data), "--model", path, "--out", str(out), "--max-seq-len", "256"]) == 0
    ds = PrepackedDataset(out)
    assert ds.manifest["media"]["family"] == name
    assert main(["inspect", str(out), "--row", "0"]) == 0  # every media kind described
    fam = family_for(path)
    check_prepacked_rows(fam, path, data, [ds[i] for i in range(len(ds))])


def check_prepacked_rows(fam, folder: str, data, rows) -> None:
    """Each prepacked row through the folder's own HF class (float64) equals each of its samples
    alone within TOL; the negative control fails by BUG: the same row with positions not
    restarted (a row of several samples, MRoPE families) or its images shifted by one (LLaVA and
    Gemma 3, whose tiny models barely move with a position shift: a row of two or more images)."""
    model = fam.pretrained(folder, dtype=torch.float64)
    samples = {s.conversation_id: s for s in _samples(fam, folder, data)}
    controlled = 0
    for row in rows:
        chosen = [samples[i] for i in row.sequence_ids]
        mrope = getattr(row.media, "positions", None) is not None
        control, telling = (
            (_positions_not_restarted(row), len(chosen) > 1) if mrope else (_images_shifted(row), _shifts(row))
        )
        controlled += telling
        for bad, run in ((False, row), (True, control)):
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
            elif telling:
                assert logits > BUG
    assert controlled  # the control ran on at least one row


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_rows_of_an_image_family_folder_equal_each_sample_alone_through_hf(name, data, tmp_path_factory):
    """LLaVA-1.5 (``<image>``, its own template) and Gemma 3 (soft tokens bidirectional within an
    image) folders: the rows the loader and the trainer build (``PackedBatch.from_samples``) of the folder's own samples, through the folder's
    Hugging Face class, equal each sample alone; the row's images shifted by one fail it."""
    path = _shared_folder(name, tmp_path_factory)
    fam = family_for(path)
    assert fam.name == name and fam.image_token_id == fam.placeholder_id(fam.tokenizer(path))
    model = fam.pretrained(path, dtype=torch.float64)
    samples = _samples(fam, path, data)
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
        logits, loss, grads, _, _ = compare_packed_alone(
            model,
            samples,
            run,
            alone=fam.alone_logits,
            packed=lambda run=run: fam.packed_logits(model, run),
            part_of=fam.part_of,
        )
        if bad:
            assert logits > BUG
        else:
            assert max(logits, loss, *grads.values()) <= TOL


def _samples(fam, path, data):
    """The folder's own samples of ``data`` (ids as the reader gives them: file:line)."""
    from sftpack.chat import read_conversations
    from sftpack.loop._setup import media_samples

    tok, proc = fam.tokenizer(path), fam.image_processor(path)
    samples, _ = media_samples(
        read_conversations([str(data)]), max_seq_len=256, family=fam, tokenizer=tok, processor=proc
    )
    return samples


def _images_shifted(batch):
    media = batch.media
    return dataclasses.replace(batch, media=dataclasses.replace(media, pixel_values=media.pixel_values.roll(1, 0)))


def _shifts(batch) -> bool:
    """Whether shifting the row's images by one changes them (two or more images, not all equal)."""
    pv = batch.media.pixel_values
    return pv.shape[0] > 1 and not torch.equal(pv, pv.roll(1, 0))


def _positions_not_restarted(batch):
    """The row with its positions running on across its sequences (the MRoPE rows too, where the
    family has them; LLaVA and Gemma 3 take the text's)."""
    media = batch.media
    if getattr(media, "positions", None) is not None:
        positions = media.positions.clone()
        positions[:] = torch.arange(positions.shape[-1])
        media = dataclasses.replace(media, positions=positions)
    return dataclasses.replace(batch, position_ids=torch.arange(len(batch.position_ids)), media=media)


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
    folder = tmp_path / "mistral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral3", "vision_config": {}}))
    extra = ["--out", str(tmp_path / "o")] if command == "prepack" else []
    rc = main([command, str(data), "--model", str(folder), *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1
    assert "mistral3" in err and "qwen2_vl" in err
