"""A data folder's images are its media, not unsupported files; every data file decides the run's kind (issue 38, item 10).

``sftpack bench DIR`` on a folder holding a JSONL with image parts, its PNGs and a text-only
JSONL: the PNGs are counted as media (not ``unsupported_format``), a file of another kind still
is, and the text-only file's conversations are packed too, as text-only samples of the image run
(a run has one model). Whether a run has images is decided from every data file the reader
finds, not from the first few.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sftpack.chat import read_conversations
from sftpack.cli import main
from sftpack.cli._common import has_images

pytest.importorskip("PIL")


def _png(path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (56, 56), (200, 30, 30)).save(path)


def _text(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": f"hi {i}"}]}


IMAGE_ROW = {
    "messages": [
        {"role": "user", "content": [{"type": "image", "path": "a.png"}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "Red."},
    ]
}


def _lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_a_mixed_folder_counts_its_images_as_media_and_packs_every_conversation(tmp_path: Path, capsys) -> None:
    _png(tmp_path / "a.png")
    _png(tmp_path / "imgs" / "unused.jpg")
    _lines(tmp_path / "a_text.jsonl", [_text(i) for i in range(3)])
    _lines(tmp_path / "b_images.jsonl", [IMAGE_ROW, IMAGE_ROW])
    (tmp_path / "notes.txt").write_text("not data")
    reader = read_conversations(tmp_path, on_bad_row="skip")
    assert len(list(reader)) == 5
    files = reader.stats.as_dict(files=True)
    assert files["media_files"] == 2 and files["files_skipped"] == {"unsupported_format": 1}
    assert [Path(p["path"]).name for p in files["file_problems"]] == ["notes.txt"]  # the negative control
    assert main(["bench", str(tmp_path), "--max-seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "read 5 rows: 5 kept, dropped: none; 2 image parts" in out
    assert "files: 2 read, not read: unsupported_format 1" in out and "notes.txt" in out
    assert ".png" not in out and ".jpg" not in out  # no image is listed as a file not read
    assert "2 image/video files beside the data: media" in out
    assert "5 conversations -> 5 samples with 2 images (dropped: none)" in out  # the text ones too


def test_every_data_file_decides_whether_the_run_has_images(tmp_path: Path) -> None:
    """An image part in the ninth data file, or in a ``.ndjson`` / JSON array / ``.gz`` file,
    makes an image run; a folder of text files does not."""
    import gzip

    (tmp_path / "text").mkdir()
    for i in range(8):
        _lines(tmp_path / "text" / f"{i}.jsonl", [_text(i)])
    assert not has_images([str(tmp_path / "text")])
    _lines(tmp_path / "text" / "9.jsonl", [IMAGE_ROW])
    assert has_images([str(tmp_path / "text")])
    for name, write in (
        ("x.ndjson", lambda p: _lines(p, [_text(0), IMAGE_ROW])),
        ("x.json", lambda p: p.write_text(json.dumps([_text(0), IMAGE_ROW], indent=2))),
        ("x.jsonl.gz", lambda p: p.write_bytes(gzip.compress((json.dumps(IMAGE_ROW) + "\n").encode()))),
    ):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        write(folder / name)
        _lines(folder / "plain.jsonl", [_text(1)])
        assert has_images([str(folder)]), name
        assert not has_images([str(folder / "plain.jsonl")])
