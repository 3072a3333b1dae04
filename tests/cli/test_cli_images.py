"""A user's own image files through every command: ``sftpack prepack FILE`` (local and Ray, the
same bytes), ``sftpack inspect`` on what it wrote, ``sftpack bench FILE``, bad image paths, and
the options data with images does not take.

The data: a JSONL file of conversations whose image parts name PNGs beside it (relative paths,
one in a sub-folder), a text-only conversation among them, and one with two images."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from sftpack.cli import main
from tests.helpers import image_conv, save_png, save_vlm_folder, write_rows
from tests.ray.conftest import ray_cluster  # noqa: F401 - tests/ray's one private Ray, for the --engine ray test

pytest.importorskip("PIL")

MAX_SEQ_LEN = 512
BUDGET = 100  # vision patches per row: the 5 images (16, 24, and 16 + 24 + 48 in one conversation) need 2 rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """``my_images.jsonl`` and its PNGs (``a.png``, ``imgs/b.png``, ``imgs/c.png``), in a folder of their own."""
    root = tmp_path_factory.mktemp("mine")
    save_png(root / "a.png", (56, 56), (200, 30, 30))
    save_png(root / "imgs" / "b.png", (84, 56), (30, 200, 30))
    save_png(root / "imgs" / "c.png", (112, 84), (30, 30, 200))
    text = {"type": "text", "text": "What colour is it?"}
    return write_rows(
        root / "my_images.jsonl",
        [
            image_conv({"type": "image", "path": "a.png"}, text, answer="Red."),
            image_conv({"type": "image", "path": "imgs/b.png"}, text, answer="Green."),
            {"messages": [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi there."}]},
            image_conv(
                {"type": "image", "path": "a.png"},
                {"type": "text", "text": "And these two?"},
                {"type": "image", "path": "imgs/b.png"},
                {"type": "image", "path": "imgs/c.png"},
                answer="Red, green and blue.",
            ),
        ],
    )


@pytest.fixture(scope="module")
def bad(data: Path) -> Path:
    """Beside ``data``: line 2's image part names a file that is not there."""
    return write_rows(
        data.parent / "bad.jsonl",
        [
            image_conv({"type": "image", "path": "a.png"}, {"type": "text", "text": "Colour?"}, answer="Red."),
            image_conv({"type": "image", "path": "imgs/missing.png"}, {"type": "text", "text": "And?"}, answer="None."),
        ],
    )


def _prepack(data: Path, out: Path, *extra: str) -> int:
    args = ["prepack", str(data), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN), "--no-progress"]
    return main([*args, "--max-patches-per-row", str(BUDGET), *extra])


def _same(a, b) -> None:
    """Two ``PackedBatch`` objects field by field, tensors byte for byte (the media's too)."""
    import torch

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "media":
            assert type(x) is type(y), f.name
            pairs = [(getattr(x, g.name), getattr(y, g.name), g.name) for g in dataclasses.fields(x)]
        else:
            pairs = [(x, y, f.name)]
        for u, v, name in pairs:
            if isinstance(u, torch.Tensor):
                assert isinstance(v, torch.Tensor) and u.dtype == v.dtype and u.shape == v.shape, name
                assert u.numpy().tobytes() == v.numpy().tobytes(), name
            else:
                assert u == v, name


@pytest.fixture(scope="module")
def prepacked(data: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "mine.prepack"
    assert _prepack(data, out) == 0
    return out


def test_has_images_finds_image_parts_in_files_folders_and_globs(data, tmp_path):
    from sftpack.cli._common import has_images

    text = write_rows(tmp_path / "text.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert has_images([str(data)]) and has_images([str(data.parent)]) and has_images([str(data.parent / "*.jsonl")])
    assert not has_images([str(text)]) and not has_images([str(tmp_path / "none.jsonl")])
    sharegpt = write_rows(
        tmp_path / "sharegpt.jsonl",
        [{"conversations": [{"from": "human", "value": [{"type": "image", "path": "x.png"}]}]}],
    )
    assert has_images([str(text), str(sharegpt)])


def test_prepack_of_a_file_with_image_parts_reads_back_as_tokenizing_it(data, prepacked, capsys):
    from sftpack.chat import read_conversations
    from sftpack.handoff import PackedBatch
    from sftpack.multimodal import tokenize_media_conversations
    from sftpack.offline import PrepackedDataset

    ds = PrepackedDataset(prepacked, verify="full")
    m = ds.manifest
    c, fp = m["counts"], m["fingerprint"]
    assert (c["read"], c["kept"], c["dropped"], c["sequences"]) == (4, 4, {}, 4)
    assert m["media"]["family"] == "qwen2_vl" and m["media"]["images"] == 5 and fp["max_patches_per_row"] == BUDGET
    assert [f["name"] for f in fp["input_files"]] == [str(data)]
    assert fp["input_files"][0]["size"] == data.stat().st_size
    # the same conversations tokenized in memory, by conversation id and piece
    samples = tokenize_media_conversations(read_conversations([str(data)]), max_seq_len=MAX_SEQ_LEN)
    in_memory = {(s.conversation_id, int((s.meta or {}).get("piece", 0))): s for s in samples}
    assert len(in_memory) == 4 and sum(s.num_patches > 0 for s in in_memory.values()) == 3
    assert len(ds) == 2  # the patch budget splits what one row of 512 tokens would hold
    seen = 0
    for r in range(len(ds)):
        row = ds[r].validate()
        assert row.media is not None and int(row.media.grid_thw.prod(dim=1).sum()) <= BUDGET
        seqs = ds.row_sequences(r)
        keys = [(ds.conversation_id(int(i)), int(k)) for i, k in zip(seqs["conversation"], seqs["piece"])]
        built = PackedBatch.from_samples(
            [in_memory[k] for k in keys], max_seq_len=MAX_SEQ_LEN, pad_multiple=1, pad_id=m["pad_id"]
        )
        _same(row, built)
        seen += len(keys)
    assert seen == 4


def test_prepack_prints_the_images_and_takes_the_family(data, tmp_path, capsys):
    from sftpack.offline import PrepackedDataset

    out = tmp_path / "qwen25.prepack"
    assert _prepack(data, out, "--family", "qwen2_5_vl") == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text
    # 128 patches of 3 x 2 x 14 x 14 float32 values: 602,112 bytes
    assert re.search(
        r"images\s+5 media items \(2\.5 a row\), 128 vision patches; stored as resized uint8 pixels: [\d.]+ MB "
        r"\(float32 values: 0\.60 MB\)",
        text,
    ), text
    assert PrepackedDataset(out).manifest["media"]["family"] == "qwen2_5_vl"


def test_inspect_shows_the_media_facts_of_an_image_prepack(data, prepacked, capsys):
    assert main(["inspect", str(prepacked), "--row", "0", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "source: multimodal conversations" in out
    assert re.search(rf"input {re.escape(str(data))}\s+{data.stat().st_size:,} bytes\s+sha256 [0-9a-f]{{16}}", out)
    assert re.search(r"input <iterable>\s+4 conversations", out)
    assert re.search(
        rf"media for qwen2_vl: 5 items \(128 vision patches, at most {BUDGET} a row\), stored as resized uint8 pixels",
        out,
    ), out
    assert re.search(r"media image \d+x\d+ px at slot \d+ \(\d+ placeholders\)", out)


def test_inspect_reads_the_patch_budget_of_an_older_prepack_and_a_prepack_without_one(data, prepacked, tmp_path):
    from sftpack.cli._inspect import describe_lines
    from sftpack.offline import PrepackedDataset

    ds = PrepackedDataset(prepacked)
    fp = ds.manifest["fingerprint"]
    fp["max_patches"] = fp.pop("max_patches_per_row")  # the key of the first format-3 prepacks
    assert any(f"at most {BUDGET} a row" in line for line in describe_lines(ds))
    del fp["max_patches"]
    assert any(
        "media for qwen2_vl: 5 items (128 vision patches, no patch budget per row)" in ln for ln in describe_lines(ds)
    )


@pytest.mark.usefixtures("ray_cluster")
def test_prepack_engine_ray_writes_the_local_engines_bytes(data, prepacked, tmp_path, capsys):
    pytest.importorskip("ray")
    out = tmp_path / "ray.prepack"
    assert _prepack(data, out, "--engine", "ray", "--workers", "2") == 0
    assert "ray actors" in capsys.readouterr().out
    names = sorted(p.name for p in prepacked.iterdir())
    assert "pixels.npy" in names and sorted(p.name for p in out.iterdir()) == names
    assert [n for n in names if (out / n).read_bytes() != (prepacked / n).read_bytes()] == []


def test_prepack_engine_ray_with_a_model_folder_writes_the_local_engines_bytes(data, tmp_path, capsys):
    """A user's folder (Qwen2.5-VL: its configuration travels with its family) on Ray's actors:
    the local engine's bytes."""
    pytest.importorskip("ray")
    folder = save_vlm_folder(str(tmp_path / "qwen2_5_vl"), "qwen2_5_vl")
    local, ray = tmp_path / "local.prepack", tmp_path / "ray.prepack"
    assert _prepack(data, local, "--model", folder) == 0
    assert _prepack(data, ray, "--model", folder, "--engine", "ray", "--workers", "2") == 0
    assert "ray actors" in capsys.readouterr().out
    names = sorted(p.name for p in local.iterdir())
    assert "pixels.npy" in names and sorted(p.name for p in ray.iterdir()) == names
    assert [n for n in names if (ray / n).read_bytes() != (local / n).read_bytes()] == []
    assert json.loads((ray / "manifest.json").read_text())["media"]["family"] == "qwen2_5_vl"


def test_bench_a_file_with_image_parts(data, capsys):
    args = ["bench", str(data), "--max-seq-len", str(MAX_SEQ_LEN), "--max-patches-per-row", str(BUDGET)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"source: {data}" in out
    assert "read 4 rows: 4 kept, dropped: none; 5 image parts" in out
    assert "4 conversations -> 4 samples with 5 images (dropped: none)" in out
    assert f"patch budget {BUDGET} vision patches per row" in out
    lines = [ln for ln in out.splitlines() if re.match(r"\s+bfd\s", ln)]
    assert len(lines) == 2 and lines[1].split()[1:3] == [str(BUDGET), "2"]  # two rows under the budget


def test_a_bad_image_path_is_a_one_line_error_naming_file_line_and_field(bad, tmp_path, capsys):
    out = tmp_path / "never"
    assert _prepack(bad, out, "--on-bad-row", "error") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"sftpack prepack: record '{bad}:2', messages[0].content[0].path: no file"), err
    assert "missing.png" in err[0] and "(image_missing_file)" in err[0]
    assert not out.exists() and not list(tmp_path.iterdir())
    assert main(["bench", str(bad), "--on-bad-row", "error"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sftpack bench: record '{bad}:2', messages[0].content[0].path")


def test_a_bad_image_path_is_counted_with_on_bad_row_skip(bad, tmp_path, capsys):
    from sftpack.offline import PrepackedDataset

    out = tmp_path / "kept"
    assert _prepack(bad, out, "--on-bad-row", "skip") == 0
    assert re.search(r"dropped \(by reason\)\s+image_missing_file 1\n", capsys.readouterr().out)
    c = PrepackedDataset(out).manifest["counts"]
    assert (c["read"], c["kept"], c["dropped"]) == (2, 1, {"image_missing_file": 1})
    assert main(["bench", str(bad)]) == 0  # --on-bad-row skip is bench's default
    assert "2 conversations -> 1 samples with 1 images (dropped: image_missing_file 1)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tokenizer", "somewhere"], "--tokenizer: not offered with data with images"),
        (["--train-on", "last_assistant"], "--train-on: not offered with data with images"),
        (["--overlong", "truncate"], "--overlong truncate: not offered with data with images"),
        (["--engine", "ray", "--num-proc", "2"], "--num-proc is the local engine's; with --engine ray use --workers"),
        (["--workers", "2"], "--workers and --ray-address need --engine ray"),
        (["--corpus", "vqa"], "--corpus vqa reads the embedded easy-vqa corpus: give no inputs"),
    ],
)
def test_prepack_refuses_what_image_data_does_not_take(data, tmp_path, capsys, extra, message):
    assert _prepack(data, tmp_path / "never", *extra) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "never").exists()


def test_prepack_family_takes_the_supported_families_only(data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _prepack(data, tmp_path / "never", "--family", "mistral3")
    assert e.value.code == 2 and "argument --family: invalid choice: 'mistral3'" in capsys.readouterr().err


def test_image_options_on_text_data_are_refused(tmp_path, capsys):
    text = write_rows(tmp_path / "text.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    args = ["prepack", str(text), "--out", str(tmp_path / "never")]
    assert main([*args, "--family", "qwen2_5_vl"]) == 2
    assert "--family qwen2_5_vl names the model of data with images" in capsys.readouterr().err
    assert main([*args, "--max-patches-per-row", "64"]) == 2
    assert "--max-patches-per-row is a budget for images" in capsys.readouterr().err
    assert main(["bench", str(text), "--max-patches-per-row", "64"]) == 2
    assert "--max-patches-per-row is the vision-patch budget" in capsys.readouterr().err


def test_a_model_folder_with_another_tokenizer_is_refused(data, tmp_path, capsys):
    """--model brings its own tokenizer: --tokenizer beside it is a usage error, on text data
    (bench, prepack) and on data with images (train), before any work."""
    text = write_rows(tmp_path / "text.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    both = ["--model", str(tmp_path / "m"), "--tokenizer", str(tmp_path / "t")]
    for argv in (
        ["bench", str(text), *both],
        ["prepack", str(text), "--out", str(tmp_path / "never"), *both],
        ["train", str(data), "--steps", "1", *both],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "--tokenizer: a --model folder brings its own tokenizer; drop --tokenizer" in err, err
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tokenizer", "x"], "--tokenizer: not offered with data with images"),
        (["--overlong", "truncate"], "--overlong truncate: not offered with data with images"),
        (["--num-proc", "2"], "--num-proc: not offered with data with images"),
    ],
)
def test_bench_refuses_what_image_data_does_not_take(data, capsys, extra, message):
    assert main(["bench", str(data), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
