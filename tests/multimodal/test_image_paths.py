"""Image paths that leave the data folder are not read unless allowed (issue 38, item 13).

A third-party dataset naming ``/home/me/secret.png``, ``../secret.png`` or a symlink out of its
folder would otherwise pull any readable image of the machine into a shared prepack. By
default such a conversation is counted under ``image_outside_data_dir`` (or, with
``--on-bad-row error``, one line naming the file, line, field and the fix);
``--allow-outside-images`` (``allow_outside_images=True``) reads them. A symlink inside the
folder to a file inside it stays allowed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sftpack.chat import BadRowError, read_conversations
from sftpack.cli import main
from tests.helpers import save_png

pytest.importorskip("PIL")

ASK = {"type": "text", "text": "What colour is it?"}


def _conv(path: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "path": path}, ASK]},
            {"role": "assistant", "content": "A colour."},
        ]
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """``data/chat.jsonl``: line 1 inside, lines 2-4 outside (absolute, ``../``, a symlink out), line 5
    a symlink inside to a file inside; ``secret/s.png`` lies beside ``data/``."""
    root = tmp_path_factory.mktemp("paths")
    save_png(root / "secret" / "s.png", (56, 56), (200, 30, 30))
    save_png(root / "data" / "imgs" / "ok.png", (56, 56), (30, 200, 30))
    os.symlink(root / "secret" / "s.png", root / "data" / "imgs" / "out.png")
    os.symlink(root / "data" / "imgs" / "ok.png", root / "data" / "in.png")
    rows = [
        _conv("imgs/ok.png"),
        _conv(str(root / "secret" / "s.png")),
        _conv("../secret/s.png"),
        _conv("imgs/out.png"),
        _conv("in.png"),
    ]
    path = root / "data" / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_reader_counts_paths_outside_the_data_folder(data: Path) -> None:
    reader = read_conversations(data, on_bad_row="skip")
    assert [c.id for c in reader] == [f"{data}:1", f"{data}:5"]
    assert reader.stats.dropped == {"image_outside_data_dir": 3} and reader.stats.images == 2
    allowed = read_conversations(data, on_bad_row="skip", allow_outside_images=True)
    convs = list(allowed)
    assert len(convs) == 5 and allowed.stats.dropped == {} and allowed.stats.images == 5
    assert convs[1].messages[0]["content"][0]["path"] == str(data.parent.parent / "secret" / "s.png")
    with pytest.raises(BadRowError) as info:
        list(read_conversations(data))
    e = info.value
    assert (e.source, e.location, e.reason.value) == (str(data), "line 2", "image_outside_data_dir")
    assert "messages[0].content[0].path" in e.detail and "allow_outside_images=True" in e.fix


def test_a_folder_searched_is_the_data_folder_of_the_files_in_it(data: Path, tmp_path: Path) -> None:
    """``../`` from a sub-folder's file stays inside the folder the user named: allowed."""
    root = tmp_path / "set"
    save_png(root / "images" / "a.png", (56, 56), (1, 2, 3))
    (root / "train").mkdir()
    (root / "train" / "chat.jsonl").write_text(json.dumps(_conv("../images/a.png")) + "\n")
    reader = read_conversations(root, on_bad_row="skip")
    assert len(list(reader)) == 1 and reader.stats.dropped == {} and reader.stats.media_files == 1
    alone = read_conversations(root / "train" / "chat.jsonl", on_bad_row="skip")  # the file alone: its folder
    assert list(alone) == [] and alone.stats.dropped == {"image_outside_data_dir": 1}


def test_prepack_and_bench_count_them_and_read_them_when_allowed(data: Path, tmp_path: Path, capsys) -> None:
    from sftpack.offline import PrepackedDataset

    common = ["--max-seq-len", "256", "--max-patches-per-row", "200"]
    assert main(["prepack", str(data), "--out", str(tmp_path / "pp"), "--no-progress", *common]) == 0
    out = capsys.readouterr().out
    assert "read 5 rows: 2 kept, dropped: image_outside_data_dir 3" in out, out
    assert PrepackedDataset(tmp_path / "pp").manifest["counts"]["kept"] == 2
    assert PrepackedDataset(tmp_path / "pp").manifest["media"]["images"] == 2
    allow = ["--allow-outside-images"]  # the same flag on prepack, bench, train and verify
    assert main(["bench", str(data), *common, *allow]) == 0
    assert "read 5 rows: 5 kept, dropped: none; 5 image parts" in capsys.readouterr().out
    assert main(["bench", str(data), "--on-bad-row", "error", *common]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sftpack bench: {data}, line 2: messages[0].content[0].path: "), err
    assert "outside the data folder" in err[0] and "--allow-outside-images" in err[0]
