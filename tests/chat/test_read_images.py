"""sftpack.chat.read_conversations on content parts: conversations with images, and text in the parts form.

Every case of tests/multimodal/test_read.py and tests/multimodal/test_read_formats.py
(``read_multimodal_jsonl`` / ``read_multimodal``), ported to the one reader: the same
messages and the same counts. Where they differ, it is on purpose and said so: the ids
are the chat reader's (the path as given, ``chat.jsonl:1`` -> ``data/chat.jsonl:1``),
and a problem that is not about content parts (an unknown role, a table with no
``messages`` column) is worded as the chat reader always worded it. Then what only the
chat reader does: compressed and damaged ``.gz`` files, text parts read as text.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from sftpack.chat import BadFileError, BadRowError, read_conversations, tokenize_conversations, validate_messages
from tests.helpers import save_png, tok_of

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def tok() -> Any:
    from sftpack.multimodal import family_for

    return family_for("qwen2_vl").tokenizer()


@pytest.fixture(scope="module")
def proc() -> Any:
    from sftpack.multimodal import family_for

    return family_for("qwen2_vl").image_processor()


def _tokenize(convs: Any, tok: Any, proc: Any, **kw: Any) -> list[Any]:
    from sftpack.multimodal import tokenize_media_conversations

    return list(tokenize_media_conversations(convs, tokenizer=tok, processor=proc, **kw))


# ============================================================================ tests/multimodal/test_read.py


def _turns(*user_parts: Any, answer: Any = "A red square.") -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(user_parts)}, {"role": "assistant", "content": answer}]


GOOD = [
    {"messages": _turns({"type": "image", "path": "imgs/a.png"}, {"type": "text", "text": "What shape?"})},
    {
        "messages": _turns(
            {"type": "image", "image": "imgs/a.png"},
            {"type": "text", "text": "And this one?"},
            {"type": "image", "path": "b.png"},
        ),
        "id": "own-id",
    },
]


def _write(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_image_paths_are_relative_to_the_file_and_samples_carry_the_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: Any, proc: Any
) -> None:
    save_png(tmp_path / "data" / "imgs" / "a.png", (56, 84))
    save_png(tmp_path / "data" / "b.png", (112, 56))
    _write(tmp_path / "data" / "chat.jsonl", [GOOD[0], "", GOOD[1]])
    monkeypatch.chdir(tmp_path)  # not the file's folder: the paths must still resolve
    reader = read_conversations("data/chat.jsonl")
    convs = list(reader)
    st = reader.stats
    assert [c["id"] for c in convs] == ["data/chat.jsonl:1", "data/chat.jsonl:3"]  # file:line, whatever the row's id
    assert (st.read, st.kept, st.images, st.dropped) == (2, 2, 3, {})
    assert st.as_dict() == {"read": 2, "kept": 2, "images": 3, "dropped": {}, "formats": {"messages": 2}}
    assert st["images"] == 3
    assert repr(st) == "ReadStats(read=2, kept=2, dropped={}, images=3)"
    img = convs[1]["messages"][0]["content"][0]
    assert img["path"] == os.fspath(tmp_path / "data" / "imgs" / "a.png") and "image" not in img
    # a conversation with images is all parts: the string answer becomes one text part
    assert convs[0]["messages"][1]["content"] == [{"type": "text", "text": "A red square."}]
    assert convs[0].messages == [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": os.fspath(tmp_path / "data" / "imgs" / "a.png")},
                {"type": "text", "text": "What shape?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
    ]
    samples = _tokenize(convs, tok, proc)
    assert [s.media.num_items for s in samples] == [1, 2]
    assert samples[1].media.grid_thw.tolist() == [[1, 6, 4], [1, 4, 8]]  # 84x56 and 56x112 px, 14 px patches


BAD = [  # (row, reason, a phrase of the error); the line is the row's place in the file, 1-based
    ("{not json", "invalid_json", "line 1"),
    ("[1, 2]", "not_an_object", "line 2"),
    ({"id": 3}, "missing_messages", "line 3"),
    ({"messages": _turns({"type": "image", "path": "https://x/y.png"})}, "malformed_message", "content[0].path: a URL"),
    ({"messages": _turns({"type": "image"})}, "malformed_message", "messages[0].content[0]: an image part with no"),
    ({"messages": _turns({"type": "audio", "path": "v.wav"})}, "malformed_message", "not a text, image or video part"),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "image", "path": "a.png"}]},
            ]
        },
        "malformed_message",
        "messages[1].content[0]: an image in an assistant turn",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "no_assistant_turn", "line 8"),
    # the chat reader's wording (read_multimodal_jsonl: "messages[0].role: 'robot'")
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown_role", "message 0 has role 'robot'"),
    ({"messages": _turns({"type": "text", "text": 5})}, "non_string_content", "messages[0].content[0].text"),
]


def test_bad_lines_are_counted_or_named_by_file_line_and_field(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.jsonl", [row for row, _, _ in BAD] + [GOOD[0]])
    reader = read_conversations([path], "skip")
    kept = list(reader)
    st = reader.stats
    assert len(kept) == 1 and kept[0]["id"] == f"{path}:{len(BAD) + 1}"
    want: dict[str, int] = {}
    for _, reason, _ in BAD:
        want[reason] = want.get(reason, 0) + 1
    assert st.dropped == want and st.read == st.kept + sum(st.dropped.values()) == len(BAD) + 1
    assert st.images == 1  # only the kept row's
    for n, (row, reason, where) in enumerate(BAD, 1):
        one = _write(tmp_path / f"one{n}.jsonl", [GOOD[0]] * (n - 1) + [row])
        with pytest.raises(BadRowError) as e:
            list(read_conversations(one))
        msg = str(e.value)
        assert f"one{n}.jsonl, line {n}" in msg and where in msg and f"[{reason}]" in msg and "Fix:" in msg
        assert e.value.reason.value == reason
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_conversations(tmp_path / "absent.jsonl")


def test_a_missing_image_is_named_by_file_line_and_field_or_counted(tmp_path: Path, tok: Any, proc: Any) -> None:
    from sftpack.multimodal import BadImageError, MediaTokenizeStats

    save_png(tmp_path / "imgs" / "a.png", (56, 56))
    missing = {"messages": _turns({"type": "text", "text": "Look:"}, {"type": "image", "path": "imgs/gone.png"})}
    path = _write(tmp_path / "chat.jsonl", [GOOD[0], missing])
    with pytest.raises(BadImageError, match=r"chat.jsonl:2', messages\[0\]\.content\[1\]\.path: no file"):
        _tokenize(read_conversations(path), tok, proc)
    st = MediaTokenizeStats()
    out = _tokenize(read_conversations(path), tok, proc, on_bad_row="skip", stats=st)
    assert len(out) == 1 and st.dropped == {"image_missing_file": 1} and st.read == st.kept + 1


# ============================================================================ tests/multimodal/test_read_formats.py


def _png_bytes(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE = _png_bytes((56, 84), (200, 30, 30)), _png_bytes((112, 56), (30, 30, 200))


def _text(t: str) -> dict[str, str]:
    return {"type": "text", "text": t}


def _conv(parts: list[Any], answer: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": parts}, {"role": "assistant", "content": [_text(answer)]}]


def _folder(tmp_path: Path) -> Path:
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


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _same_samples(a: list[Any], b: list[Any]) -> None:
    import torch

    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.input_ids.tolist() == y.input_ids.tolist() and x.loss_mask.tolist() == y.loss_mask.tolist()
        assert torch.equal(x.media.pixel_values, y.media.pixel_values)
        assert torch.equal(x.media.grid_thw, y.media.grid_thw) and torch.equal(x.media.slots, y.media.slots)


def test_parquet_and_saved_dataset_give_the_jsonl_conversations_and_samples(
    tmp_path: Path, tok: Any, proc: Any
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    d = _folder(tmp_path)
    from_jsonl = list(read_conversations(_jsonl(d / "chat.jsonl", ROWS)))
    pq.write_table(pa.Table.from_pylist(ROWS), d / "chat.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(d / "saved"))
    # the saved dataset's paths are relative to its own folder: give it the images there too
    (d / "saved" / "imgs").mkdir()
    for name in ("red.png", "blue.png"):
        (d / "saved" / "imgs" / name).write_bytes((d / "imgs" / name).read_bytes())
    reader = read_conversations(d / "chat.parquet")
    from_parquet = list(reader)
    st = reader.stats
    from_saved = list(read_conversations(d / "saved"))
    assert [c["id"] for c in from_parquet] == [f"{d / 'chat.parquet'}[0]", f"{d / 'chat.parquet'}[1]"]
    assert [c["id"] for c in from_saved] == [f"{d / 'saved'}[0]", f"{d / 'saved'}[1]"]
    assert (st.read, st.kept, st.images, st.dropped) == (2, 2, 3, {})
    # Arrow's absent struct fields (None) are dropped: the parts are the JSONL reader's exactly
    assert [c["messages"] for c in from_parquet] == [c["messages"] for c in from_jsonl]
    assert from_jsonl[1]["messages"][0]["content"][2] == {"type": "image", "path": os.fspath(d / "imgs" / "blue.png")}
    assert from_jsonl[0]["messages"][1]["content"] == [_text("Red.")]  # kept as parts, as read_multimodal did
    saved_msgs = [c["messages"] for c in from_saved]
    assert json.dumps(saved_msgs).replace("/saved/imgs/", "/imgs/") == json.dumps([c["messages"] for c in from_jsonl])
    want = _tokenize(from_jsonl, tok, proc)
    _same_samples(_tokenize(from_parquet, tok, proc), want)
    _same_samples(_tokenize(from_saved, tok, proc), want)


def _images_rows() -> list[dict[str, Any]]:  # the common HF VLM layout: an images column, {"type": "image"} parts
    return [
        {"images": [RED], "messages": _conv([{"type": "image"}, _text("What colour?")], "Red.")},
        {
            "images": [RED, BLUE],
            "messages": _conv([{"type": "image"}, _text("And these?"), {"type": "image"}], "Red and blue."),
        },
    ]


def test_an_images_column_and_image_bytes_give_the_same_samples(tmp_path: Path, tok: Any, proc: Any) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    d = _folder(tmp_path)
    want = _tokenize(read_conversations(_jsonl(d / "chat.jsonl", ROWS)), tok, proc)
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
        reader = read_conversations(source)
        convs = list(reader)
        st = reader.stats
        assert (st.read, st.kept, st.images) == (2, 2, 3), source
        assert convs[1]["messages"][0]["content"][2] == {"type": "image", "bytes": BLUE}
        _same_samples(_tokenize(convs, tok, proc), want)


def test_bad_rows_are_counted_or_named_by_file_row_and_field(tmp_path: Path, tok: Any, proc: Any) -> None:
    from sftpack.multimodal import MediaTokenizeStats

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
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
    reader = read_conversations(path, "skip")
    convs = list(reader)
    st = reader.stats
    assert [c["id"] for c in convs] == [f"{path}[0]", f"{path}[1]", f"{path}[2]"]
    assert st.dropped == {"missing_messages": 1, "malformed_message": 1} and st.images == 3
    assert st.read == st.kept + sum(st.dropped.values()) == 5
    with pytest.raises(BadRowError) as e:
        list(read_conversations(path))
    msg = str(e.value)
    assert "bad.parquet, row 3" in msg and "'messages'" in msg and "[missing_messages]" in msg and "Fix:" in msg
    # the images the reader cannot check are the tokenizer's: counted under their reasons, named by file and row
    ts = MediaTokenizeStats()
    out = _tokenize(convs, tok, proc, on_bad_row="skip", stats=ts)
    assert len(out) == 1 and ts.dropped == {"image_missing_file": 1, "image_undecodable": 1}
    with pytest.raises(ValueError, match=r"bad.parquet\[1\].*messages\[0\]\.content\[0\]\.path: no file"):
        _tokenize(convs, tok, proc)


def test_images_column_mismatch_missing_column_and_unreadable_files(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    d = _folder(tmp_path)
    rows = _images_rows()
    rows[1]["images"] = [RED]  # two image parts, one image
    pq.write_table(pa.Table.from_pylist(rows), d / "short.parquet")
    with pytest.raises(BadRowError, match=r"short.parquet, row 1: messages\[0\]\.content\[2\]: image part 2"):
        list(read_conversations(d / "short.parquet"))
    rows[1]["images"] = [RED, BLUE, BLUE]  # one image too many
    pq.write_table(pa.Table.from_pylist(rows), d / "long.parquet")
    reader = read_conversations(d / "long.parquet", "skip")
    assert len(list(reader)) == 1
    assert reader.stats.dropped == {"malformed_message": 1} and reader.stats.images == 1
    with pytest.raises(BadRowError, match=r"long.parquet, row 1: 'images' has 3 entries but 2 image parts"):
        list(read_conversations(d / "long.parquet"))
    # no messages column: every row counted at once, or row 0 named (in the chat reader's words)
    pq.write_table(pa.Table.from_pylist([{"body": "a"}, {"body": "b"}]), d / "plain.parquet")
    reader = read_conversations(d / "plain.parquet", "skip")
    assert list(reader) == []
    assert (reader.stats.read, reader.stats.dropped) == (2, {"missing_messages": 2})
    with pytest.raises(BadRowError, match=r"plain.parquet, row 0: no 'messages' column, nor another known format's"):
        list(read_conversations(d / "plain.parquet"))
    # a file that is not Parquet: a BadFileError, or counted in files_skipped
    (d / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(BadFileError, match="junk.parquet: not a readable Parquet file"):
        list(read_conversations(d / "junk.parquet"))
    reader = read_conversations([d / "junk.parquet"], "skip")
    assert list(reader) == []
    assert reader.stats.files_skipped == {"unreadable": 1} and reader.stats.read == 0
    with pytest.raises(FileNotFoundError):
        read_conversations(d / "absent.parquet")


# ============================================================================ what only the one reader does


def test_gzipped_jsonl_with_images_reads_as_the_plain_file(tmp_path: Path, tok: Any, proc: Any) -> None:
    d = _folder(tmp_path)
    plain = list(read_conversations(_jsonl(d / "chat.jsonl", ROWS)))
    gz = d / "chat.jsonl.gz"
    gz.write_bytes(gzip.compress((d / "chat.jsonl").read_bytes()))
    reader = read_conversations(gz)
    convs = list(reader)
    assert [c.id for c in convs] == [f"{gz}:1", f"{gz}:2"]
    assert [c.messages for c in convs] == [c.messages for c in plain]  # image paths relative to the .gz's folder
    assert reader.stats.as_dict() == {"read": 2, "kept": 2, "images": 3, "dropped": {}, "formats": {"messages": 2}}
    _same_samples(_tokenize(convs, tok, proc), _tokenize(plain, tok, proc))


def test_a_damaged_gz_tail_keeps_the_rows_and_images_before_it(tmp_path: Path) -> None:
    d = _folder(tmp_path)
    rows = [
        {
            "messages": _conv(
                [{"type": "image", "path": "imgs/red.png"}, _text(f"colour {i}? " + "x" * (i % 97))], "Red."
            )
        }
        for i in range(3000)
    ]
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
    path = d / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    reader = read_conversations(path, on_bad_row="skip")
    convs = list(reader)
    s = reader.stats
    assert 0 < len(convs) < 3000 and s.kept == len(convs) == s.images
    assert s.dropped == {"unreadable_tail": 1} and s.read == s.kept + s.num_dropped
    assert convs[0].messages[0]["content"][0] == {"type": "image", "path": os.fspath(d / "imgs" / "red.png")}
    (problem,) = s.file_problems
    assert problem.path == str(path) and problem.reason == "unreadable_tail" and "cut short" in problem.detail
    with pytest.raises(BadFileError, match=rf"{path}: damaged after line \d+: .*cut short.*\[unreadable_tail\]"):
        list(read_conversations(path))


def test_text_parts_read_exactly_as_the_same_text_in_strings(tmp_path: Path) -> None:
    strings = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]},
        {"conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "Hi <|im_end|> you"}]},
    ]
    strings[0]["messages"].append({"role": "assistant", "content": "Hello!", "name": "bot"})
    parts = [
        {
            "messages": [
                {"role": "system", "content": [_text("Be brief.")]},
                {"role": "user", "content": [_text("Hi"), _text(" there")]},
                {"role": "assistant", "content": [_text("Hel"), _text(""), _text("lo!")], "name": "bot"},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": [_text("Hello!")]},
                {"from": "gpt", "value": [_text("Hi <|im"), _text("_end|> you")]},
            ]
        },
    ]
    a = read_conversations(_jsonl(tmp_path / "a.jsonl", strings))
    b = read_conversations(_jsonl(tmp_path / "b.jsonl", parts))
    ca, cb = list(a), list(b)
    assert [c.messages for c in cb] == [c.messages for c in ca]
    assert cb[0].messages[2] == {"role": "assistant", "content": "Hello!", "name": "bot"}
    assert [c.id.replace("b.jsonl", "a.jsonl") for c in cb] == [c.id for c in ca]
    assert (
        b.stats.as_dict(files=True)
        == a.stats.as_dict(files=True)
        == {
            "read": 2,
            "kept": 2,
            "dropped": {},
            "formats": {"messages": 1, "sharegpt": 1},
            "files_read": 1,
            "files_skipped": {},
            "file_problems": [],
        }
    )
    assert b.stats.images == 0 and repr(b.stats) == repr(a.stats) == (
        "ReadStats(read=2, kept=2, dropped={}, formats={'messages': 1, 'sharegpt': 1})"
    )
    # text: checked for the text tokenizer, which gives the same samples
    tok = tok_of("chatml")
    sa, sb = tokenize_conversations(ca, tok).to_list(), tokenize_conversations(cb, tok).to_list()
    assert [s.input_ids.tolist() for s in sb] == [s.input_ids.tolist() for s in sa]
    assert [s.loss_mask.tolist() for s in sb] == [s.loss_mask.tolist() for s in sa]


@pytest.mark.parametrize(
    ("row", "reason", "phrase"),
    [
        (
            {"messages": [{"role": "user", "content": [_text(" ")]}, {"role": "assistant", "content": "a"}]},
            "empty_content",
            "message 0 (user) has an empty content",
        ),
        (
            {"messages": [{"role": "user", "content": []}, {"role": "assistant", "content": "a"}]},
            "non_string_content",
            "message 0 (user) has an empty list content",
        ),
        (
            {"messages": [{"role": "user", "content": [_text("q\ud800")]}, {"role": "assistant", "content": "a"}]},
            "invalid_text",
            "message 0 (user) holds a lone surrogate",
        ),
        (
            {"messages": _turns({"type": "image", "path": "a.png"}, _text("q\ud800"))},
            "invalid_text",
            "messages[0].content[1].text holds a lone surrogate",
        ),
        (
            {"messages": _turns({"type": "image"}), "images": "a.png"},
            "malformed_message",
            "'images': a str, not a list",
        ),
        ({"messages": _turns(_text("q")), "images": ["a.png"]}, "malformed_message", "'images' has 1 entries but 0"),
        ({"messages": _turns({"type": "image", "path": 7})}, "malformed_message", "messages[0].content[0].path: a int"),
        (
            {"messages": _turns({"type": "image", "path": "file:///a.png"})},
            "malformed_message",
            "a URL 'file:///a.png'",
        ),
        (
            {"messages": _turns({"type": "image"}), "images": ["s3://b/a.png"]},
            "malformed_message",
            "images[0].image: a URL",
        ),
        ({"messages": _turns("not a part")}, "malformed_message", "messages[0].content[0]: 'not a part' is not a text"),
        (
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": [{"type": "image", "path": "a.png"}]},
                ]
            },
            "malformed_message",
            "conversations[1].value[0]: an image in an assistant turn",
        ),
    ],
)
def test_bad_parts_name_line_field_and_fix(tmp_path: Path, row: dict[str, Any], reason: str, phrase: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")  # ensure_ascii: a lone surrogate survives as an escape
    with pytest.raises(BadRowError) as e:
        list(read_conversations(path))
    msg = str(e.value)
    assert f"{path}, line 1" in msg and phrase in msg and f"[{reason}]" in msg and "Fix:" in msg
    reader = read_conversations(path, "skip")
    assert list(reader) == [] and reader.stats.as_dict() == {
        "read": 1,
        "kept": 0,
        "dropped": {reason: 1},
        "formats": {},
    }


def test_sharegpt_role_map_and_extra_keys_with_images(tmp_path: Path) -> None:
    rows = [
        {
            "conversations": [
                {"from": "human", "value": [{"type": "image", "path": "/abs/a.png", "resize": [64, 32]}, _text("q")]},
                {"from": "bot", "value": "a", "weight": 1},
            ]
        }
    ]
    path = _jsonl(tmp_path / "s.jsonl", rows)  # an image outside the data folder: read when allowed
    reader = read_conversations(path, role_map={"bot": "assistant"}, allow_outside_images=True)
    (conv,) = list(reader)
    assert conv.messages == [
        {"role": "user", "content": [{"type": "image", "resize": [64, 32], "path": "/abs/a.png"}, _text("q")]},
        {"role": "assistant", "content": [_text("a")], "weight": 1},
    ]
    assert reader.stats.images == 1 and not conv.checked


def test_the_text_path_refuses_image_conversations_by_name(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "mixed.jsonl", [ROWS[0], {"messages": _conv([_text("q")], "a")}])
    convs = list(read_conversations(path))
    assert [c.checked for c in convs] == [False, True] and convs[1].messages[1]["content"] == "a"
    tok = tok_of("chatml")
    out = tokenize_conversations(convs, tok, on_bad_row="skip")
    assert len(out.to_list()) == 1 and out.stats.skipped == {"non_string_content": 1}
    with pytest.raises(BadRowError, match=r"holds image or video parts.*tokenize_media_conversations"):
        tokenize_conversations(convs, tok).to_list()
    # the text checks (no data file to resolve paths against) still take strings only
    with pytest.raises(ValueError, match=r"message 0 \(user\) has a list content, expected a string"):
        validate_messages([{"role": "user", "content": [_text("q")]}, {"role": "assistant", "content": "a"}])
