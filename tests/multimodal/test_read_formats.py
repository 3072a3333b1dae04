"""Multimodal conversations from Parquet files and saved Hugging Face datasets: the same
conversations and samples as the same data in JSONL, every row accounted for."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from sftpack.chat import BadFileError, BadRowError
from sftpack.multimodal import MultimodalReadStats, MultimodalStats, tokenize_multimodal_conversations
from sftpack.multimodal._read import read_multimodal, read_multimodal_jsonl

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")


def _png_bytes(size, colour):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE = _png_bytes((56, 84), (200, 30, 30)), _png_bytes((112, 56), (30, 30, 200))


def _text(t):
    return {"type": "text", "text": t}


def _conv(parts, answer):
    return [{"role": "user", "content": parts}, {"role": "assistant", "content": [_text(answer)]}]


def _folder(tmp_path):
    d = tmp_path / "data"
    (d / "imgs").mkdir(parents=True)
    (d / "imgs" / "red.png").write_bytes(RED)
    (d / "imgs" / "blue.png").write_bytes(BLUE)
    return d


ROWS = [  # image paths relative to the data file's folder
    {"messages": _conv([{"type": "image", "path": "imgs/red.png"}, _text("What colour?")], "Red.")},
    {
        "messages": _conv(
            [
                {"type": "image", "path": "imgs/red.png"},
                _text("And these?"),
                {"type": "image", "path": "imgs/blue.png"},
            ],
            "Red and blue.",
        )
    },
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _same_samples(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.input_ids.tolist() == y.input_ids.tolist() and x.loss_mask.tolist() == y.loss_mask.tolist()
        assert np.array_equal(x.pixel_values, y.pixel_values) and np.array_equal(x.image_grid_thw, y.image_grid_thw)
        assert np.array_equal(x.image_runs, y.image_runs)


def test_parquet_and_saved_dataset_give_the_jsonl_conversations_and_samples(tmp_path, tok, proc):
    d = _folder(tmp_path)
    from_jsonl = list(read_multimodal_jsonl(_jsonl(d / "chat.jsonl", ROWS)))
    pq.write_table(pa.Table.from_pylist(ROWS), d / "chat.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(d / "saved"))
    # the saved dataset's paths are relative to its own folder: give it the images there too
    (d / "saved" / "imgs").mkdir()
    for name in ("red.png", "blue.png"):
        (d / "saved" / "imgs" / name).write_bytes((d / "imgs" / name).read_bytes())
    st = MultimodalReadStats()
    from_parquet = list(read_multimodal(d / "chat.parquet", stats=st))
    from_saved = list(read_multimodal(d / "saved"))
    assert [c["id"] for c in from_parquet] == ["chat.parquet[0]", "chat.parquet[1]"]
    assert [c["id"] for c in from_saved] == ["saved[0]", "saved[1]"]
    assert (st.read, st.kept, st.images, st.dropped) == (2, 2, 3, {})
    # Arrow's absent struct fields (None) are dropped: the parts are the JSONL reader's exactly
    assert [c["messages"] for c in from_parquet] == [c["messages"] for c in from_jsonl]
    saved_msgs = [c["messages"] for c in from_saved]
    assert json.dumps(saved_msgs).replace("/saved/imgs/", "/imgs/") == json.dumps([c["messages"] for c in from_jsonl])
    # the dispatcher reads JSONL as read_multimodal_jsonl does
    assert list(read_multimodal(d / "chat.jsonl")) == from_jsonl
    want = list(tokenize_multimodal_conversations(from_jsonl, tokenizer=tok, processor=proc))
    _same_samples(list(tokenize_multimodal_conversations(from_parquet, tokenizer=tok, processor=proc)), want)
    _same_samples(list(tokenize_multimodal_conversations(from_saved, tokenizer=tok, processor=proc)), want)


def _images_rows():  # the common HF VLM layout: an images column, {"type": "image"} parts take from it in order
    return [
        {"images": [RED], "messages": _conv([{"type": "image"}, _text("What colour?")], "Red.")},
        {
            "images": [RED, BLUE],
            "messages": _conv([{"type": "image"}, _text("And these?"), {"type": "image"}], "Red and blue."),
        },
    ]


def test_an_images_column_and_image_bytes_give_the_same_samples(tmp_path, tok, proc):
    d = _folder(tmp_path)
    want = list(
        tokenize_multimodal_conversations(
            read_multimodal_jsonl(_jsonl(d / "chat.jsonl", ROWS)), tokenizer=tok, processor=proc
        )
    )
    rows = _images_rows()
    pq.write_table(pa.Table.from_pylist(rows), d / "images.parquet")
    inline = [  # bytes inside the parts
        {"messages": _conv([{"type": "image", "bytes": RED}, _text("What colour?")], "Red.")},
        {
            "messages": _conv(
                [{"type": "image", "bytes": RED}, _text("And these?"), {"type": "image", "bytes": BLUE}],
                "Red and blue.",
            )
        },
    ]
    pq.write_table(pa.Table.from_pylist(inline), d / "inline.parquet")
    # a saved dataset with the images as a datasets Image feature ({"bytes", "path"} structs in Arrow)
    feats = datasets.Dataset.from_list(rows).features.copy()
    feats["images"] = datasets.Sequence(datasets.Image())
    ds = datasets.Dataset.from_list(
        [{**r, "images": [{"bytes": b, "path": None} for b in r["images"]]} for r in rows], features=feats
    )
    ds.save_to_disk(str(tmp_path / "vlm"))
    for source in (d / "images.parquet", d / "inline.parquet", tmp_path / "vlm", ds):
        st = MultimodalReadStats()
        convs = list(read_multimodal(source, stats=st))
        assert (st.read, st.kept, st.images) == (2, 2, 3), source
        assert convs[1]["messages"][0]["content"][2] == {"type": "image", "bytes": BLUE}
        _same_samples(list(tokenize_multimodal_conversations(convs, tokenizer=tok, processor=proc)), want)


def test_bad_rows_are_counted_or_named_by_file_row_and_field(tmp_path, tok, proc):
    d = _folder(tmp_path)
    rows = [
        ROWS[0],
        {"messages": _conv([{"type": "image", "path": "imgs/gone.png"}, _text("?")], "Gone.")},  # missing file
        {"messages": _conv([{"type": "image", "bytes": b"not a png"}, _text("?")], "Broken.")},  # undecodable
        {"messages": None},  # missing messages
        {"messages": _conv([{"type": "image"}, _text("?")], "No source.")},  # no path, no images column
    ]
    path = d / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    st = MultimodalReadStats()
    convs = list(read_multimodal(path, "skip", stats=st))
    assert [c["id"] for c in convs] == ["bad.parquet[0]", "bad.parquet[1]", "bad.parquet[2]"]
    assert st.dropped == {"missing_messages": 1, "malformed_message": 1}
    assert st.read == st.kept + sum(st.dropped.values()) == 5
    with pytest.raises(BadRowError) as e:
        list(read_multimodal(path))
    msg = str(e.value)
    assert "bad.parquet, row 3" in msg and "'messages'" in msg and "[missing_messages]" in msg and "Fix:" in msg
    # the images the reader cannot check are the tokenizer's: counted under their reasons, named by file and row
    ts = MultimodalStats()
    out = list(tokenize_multimodal_conversations(convs, tokenizer=tok, processor=proc, on_bad_row="skip", stats=ts))
    assert len(out) == 1 and ts.dropped == {"image_missing_file": 1, "image_undecodable": 1}
    with pytest.raises(ValueError, match=r"bad.parquet\[1\].*messages\[0\]\.content\[0\]\.path: no file"):
        list(tokenize_multimodal_conversations(convs, tokenizer=tok, processor=proc))


def test_images_column_mismatch_missing_column_and_unreadable_files(tmp_path):
    d = _folder(tmp_path)
    rows = _images_rows()
    rows[1]["images"] = [RED]  # two image parts, one image
    pq.write_table(pa.Table.from_pylist(rows), d / "short.parquet")
    with pytest.raises(BadRowError, match=r"short.parquet, row 1: messages\[0\]\.content\[2\]: image part 2"):
        list(read_multimodal(d / "short.parquet"))
    rows[1]["images"] = [RED, BLUE, BLUE]  # one image too many
    pq.write_table(pa.Table.from_pylist(rows), d / "long.parquet")
    st = MultimodalReadStats()
    assert len(list(read_multimodal(d / "long.parquet", "skip", stats=st))) == 1
    assert st.dropped == {"malformed_message": 1}
    # no messages column: every row counted at once, or row 0 named
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": "b"}]), d / "plain.parquet")
    st = MultimodalReadStats()
    assert list(read_multimodal(d / "plain.parquet", "skip", stats=st)) == []
    assert (st.read, st.dropped) == (2, {"missing_messages": 2})
    with pytest.raises(BadRowError, match=r"plain.parquet, row 0: no 'messages' column"):
        list(read_multimodal(d / "plain.parquet"))
    # a file that is not Parquet: a BadFileError, or counted in files_skipped
    (d / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(BadFileError, match="junk.parquet: not a readable Parquet file"):
        list(read_multimodal(d / "junk.parquet"))
    st = MultimodalReadStats()
    assert list(read_multimodal([d / "junk.parquet"], "skip", stats=st)) == []
    assert st.files_skipped == {"unreadable": 1} and st.read == 0
    with pytest.raises(FileNotFoundError):
        read_multimodal(d / "absent.parquet")
