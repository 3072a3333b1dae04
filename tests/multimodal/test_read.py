"""Multimodal conversations from JSONL: image paths relative to the file, every line accounted for."""

from __future__ import annotations

import json
import os

import pytest

from sftpack.chat import BadRowError
from sftpack.multimodal import (
    BadImageError,
    MultimodalReadStats,
    MultimodalStats,
    read_multimodal_jsonl,
    tokenize_multimodal_conversations,
)


def _png(path, size):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)


def _turns(*user_parts, answer="A red square."):
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


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_image_paths_are_relative_to_the_file_and_samples_carry_the_images(tmp_path, monkeypatch, tok, proc):
    _png(tmp_path / "data" / "imgs" / "a.png", (56, 84))
    _png(tmp_path / "data" / "b.png", (112, 56))
    _write(tmp_path / "data" / "chat.jsonl", [GOOD[0], "", GOOD[1]])
    monkeypatch.chdir(tmp_path)  # not the file's folder: the paths must still resolve
    st = MultimodalReadStats()
    convs = list(read_multimodal_jsonl("data/chat.jsonl", stats=st))
    assert [c["id"] for c in convs] == ["chat.jsonl:1", "chat.jsonl:3"]  # file:line, whatever id the row has
    assert (st.read, st.kept, st.images, st.dropped) == (2, 2, 3, {})
    img = convs[1]["messages"][0]["content"][0]
    assert img["path"] == os.fspath(tmp_path / "data" / "imgs" / "a.png") and "image" not in img
    assert convs[0]["messages"][1]["content"] == [{"type": "text", "text": "A red square."}]
    samples = list(tokenize_multimodal_conversations(convs, tokenizer=tok, processor=proc))
    assert [s.num_images for s in samples] == [1, 2]
    assert samples[1].image_grid_thw.tolist() == [[1, 6, 4], [1, 4, 8]]  # 84x56 and 56x112 px, 14 px patches


BAD = [
    ("{not json", "invalid_json", "line 1"),
    ("[1, 2]", "not_an_object", "line 2"),
    ({"id": 3}, "missing_messages", "line 3"),
    ({"messages": _turns({"type": "image", "path": "https://x/y.png"})}, "malformed_message", "content[0].path: a URL"),
    ({"messages": _turns({"type": "image"})}, "malformed_message", "messages[0].content[0]: an image part with no"),
    ({"messages": _turns({"type": "video", "path": "v.mp4"})}, "malformed_message", "not a text or image part"),
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
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown_role", "messages[0].role: 'robot'"),
    ({"messages": _turns({"type": "text", "text": 5})}, "non_string_content", "messages[0].content[0].text"),
]


def test_bad_lines_are_counted_or_named_by_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write(path, [row for row, _, _ in BAD] + [GOOD[0]])
    st = MultimodalReadStats()
    kept = list(read_multimodal_jsonl([path], "skip", stats=st))
    assert len(kept) == 1 and kept[0]["id"] == f"bad.jsonl:{len(BAD) + 1}"
    want: dict[str, int] = {}
    for _, reason, _ in BAD:
        want[reason] = want.get(reason, 0) + 1
    assert st.dropped == want and st.read == st.kept + sum(st.dropped.values()) == len(BAD) + 1
    for n, (row, reason, where) in enumerate(BAD, 1):
        one = tmp_path / f"one{n}.jsonl"
        _write(one, [GOOD[0]] * (n - 1) + [row])
        with pytest.raises(BadRowError) as e:
            list(read_multimodal_jsonl(one))
        msg = str(e.value)
        assert f"one{n}.jsonl, line {n}" in msg and where in msg and f"[{reason}]" in msg and "Fix:" in msg
    with pytest.raises(FileNotFoundError, match="no file"):
        read_multimodal_jsonl(tmp_path / "absent.jsonl")


def test_a_missing_image_is_named_by_file_line_and_field_or_counted(tmp_path, tok, proc):
    _png(tmp_path / "imgs" / "a.png", (56, 56))
    missing = {"messages": _turns({"type": "text", "text": "Look:"}, {"type": "image", "path": "imgs/gone.png"})}
    path = tmp_path / "chat.jsonl"
    _write(path, [GOOD[0], missing])
    with pytest.raises(BadImageError, match=r"'chat.jsonl:2', messages\[0\]\.content\[1\]\.path: no file"):
        list(tokenize_multimodal_conversations(read_multimodal_jsonl(path), tokenizer=tok, processor=proc))
    st = MultimodalStats()
    out = list(
        tokenize_multimodal_conversations(
            read_multimodal_jsonl(path), tokenizer=tok, processor=proc, on_bad_row="skip", stats=st
        )
    )
    assert len(out) == 1 and st.dropped == {"image_missing_file": 1} and st.read == st.kept + 1
