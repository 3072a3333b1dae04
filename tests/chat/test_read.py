"""sftpack.chat._read: sources, formats, bad rows and their accounting, bounded memory."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sftpack.chat import (
    BadFileError,
    BadRowError,
    BadRowReason,
    read_conversations,
    tokenize_conversations,
)
from tests.helpers import (
    BAD_LINES,
    GOOD,
    A,
    U,
    tok_of,
    trainable_runs,
    write_jsonl,
)

# ---------------------------------------------------------------------------- readers


@pytest.mark.parametrize("reason", list(BAD_LINES), ids=lambda r: r.value)
def test_bad_row_error_mode_names_file_line_problem_and_fix(tmp_path: Path, reason: BadRowReason) -> None:
    raw, phrase = BAD_LINES[reason]
    path = write_jsonl(tmp_path / "chat.jsonl", [json.dumps(GOOD), "", raw, json.dumps(GOOD)])
    reader = read_conversations(path)
    got = []
    with pytest.raises(BadRowError) as info:
        for conv in reader:
            got.append(conv.id)
    err = info.value
    msg = str(err)
    assert isinstance(err, ValueError) and err.reason is reason
    assert str(path) in msg and "line 3" in msg and phrase in msg and "Fix:" in msg and reason.value in msg
    assert "on_bad_row='skip'" in msg
    assert got == [f"{path}:1"]
    assert reader.stats.as_dict() == {
        "read": 2,
        "kept": 1,
        "dropped": {reason.value: 1},
        "formats": {"messages": 1},
    }


@pytest.mark.parametrize("reason", list(BAD_LINES), ids=lambda r: r.value)
def test_bad_row_skip_mode_counts_it(tmp_path: Path, reason: BadRowReason) -> None:
    raw, _ = BAD_LINES[reason]
    path = write_jsonl(tmp_path / "chat.jsonl", [json.dumps(GOOD), raw, "   ", json.dumps(GOOD)])
    reader = read_conversations(path, on_bad_row="skip")
    assert [c.id for c in reader] == [f"{path}:1", f"{path}:4"]
    assert reader.stats.as_dict() == {
        "read": 3,
        "kept": 2,
        "dropped": {reason.value: 1},
        "formats": {"messages": 2},
    }
    assert reader.stats["read"] == reader.stats["kept"] + sum(reader.stats["dropped"].values())


def test_invalid_utf8_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
    reader = read_conversations(path, on_bad_row="skip")
    assert len(list(reader)) == 1 and reader.stats.dropped == {"invalid_json": 1}


@st.composite
def row_mixes(draw: Any) -> list[BadRowReason | None]:
    return draw(st.lists(st.sampled_from([None, *BAD_LINES]), max_size=40))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(row_mixes())
def test_accounting_identity_on_random_mixes(tmp_path: Path, kinds: list[BadRowReason | None]) -> None:
    # a file of that one line is one JSON array, each element a row: tests/chat/test_json_arrays.py
    assume(kinds != [BadRowReason.NOT_AN_OBJECT])
    lines = [
        json.dumps({"messages": [U(f"q{i}"), A(f"a{i}")]}) if k is None else BAD_LINES[k][0]
        for i, k in enumerate(kinds)
    ]
    path = write_jsonl(tmp_path / "mix.jsonl", lines)
    reader = read_conversations(path, on_bad_row="skip")
    convs = list(reader)
    s = reader.stats
    assert s.read == len(kinds) == s.kept + sum(s.dropped.values())
    assert [c.id for c in convs] == [f"{path}:{i + 1}" for i, k in enumerate(kinds) if k is None]
    expected: dict[str, int] = {}
    for k in kinds:
        if k is not None:
            expected[k.value] = expected.get(k.value, 0) + 1
    assert s.dropped == expected
    # error mode: stops at the first bad row, identity still holds
    strict = read_conversations(path)
    first_bad = next((i for i, k in enumerate(kinds) if k is not None), None)
    if first_bad is None:
        assert len(list(strict)) == len(kinds)
    else:
        with pytest.raises(BadRowError, match=f"line {first_bad + 1}:"):
            list(strict)
        assert strict.stats.read == first_bad + 1 == strict.stats.kept + strict.stats.num_dropped


def test_parquet_streams_batches_and_names_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [U(f"q{i}"), A(f"a{i}")], "extra": i} for i in range(25)]
    rows[7] = {
        "messages": [U("q7"), {"role": "assistant", "content": None}],
        "extra": 7,
    }
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10)
    reader = read_conversations(path, on_bad_row="skip", batch_size=4)
    convs = list(reader)
    assert len(convs) == 24 and convs[7].id == f"{path}[8]" and convs[0].messages == [U("q0"), A("a0")]
    assert reader.stats.as_dict() == {
        "read": 25,
        "kept": 24,
        "dropped": {"non_string_content": 1},
        "formats": {"messages": 24},
    }
    with pytest.raises(BadRowError, match=r"row 7: message 1 \(assistant\) has a null content"):
        list(read_conversations(path, batch_size=4))
    # No usable column: every row is counted
    other = tmp_path / "other.parquet"
    pq.write_table(pa.Table.from_pylist([{"body": "x"}] * 3), other)
    r2 = read_conversations(other, on_bad_row="skip")
    assert list(r2) == [] and r2.stats.as_dict() == {
        "read": 3,
        "kept": 0,
        "dropped": {"missing_messages": 3},
        "formats": {},
    }
    with pytest.raises(BadRowError, match="row 0: no 'messages' column, nor another known format's"):
        list(read_conversations(other))


def test_hf_datasets_saved_and_in_memory(tmp_path: Path) -> None:
    import datasets

    rows = [{"messages": [U(f"q{i}"), A(f"a{i}")]} for i in range(5)] + [{"messages": [U("x")]}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    reader = read_conversations(tmp_path / "saved", on_bad_row="skip", batch_size=2)
    convs = list(reader)
    assert [c.id for c in convs] == [f"{tmp_path / 'saved'}[{i}]" for i in range(5)]
    assert reader.stats.as_dict() == {
        "read": 6,
        "kept": 5,
        "dropped": {"no_assistant_turn": 1},
        "formats": {"messages": 5},
    }
    assert [c.messages for c in read_conversations(ds, on_bad_row="skip")] == [c.messages for c in convs]
    streamed = read_conversations(ds.to_iterable_dataset(), on_bad_row="skip")
    assert [c.messages for c in streamed] == [c.messages for c in convs] and streamed.stats.read == 6
    dd = datasets.DatasetDict({"train": ds, "test": ds})
    with pytest.raises(ValueError, match="split="):
        read_conversations(dd)
    assert len(list(read_conversations(dd, on_bad_row="skip", split="test"))) == 5


def test_sources_gz_glob_directory_and_refusals(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [json.dumps(GOOD)])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    assert [c.id for c in read_conversations(str(tmp_path / "*.jsonl*"))] == [
        f"{tmp_path / 'a.jsonl'}:1",
        f"{tmp_path / 'b.jsonl.gz'}:1",
        f"{tmp_path / 'b.jsonl.gz'}:2",
    ]
    assert len(list(read_conversations(tmp_path))) == 3
    reader = read_conversations([tmp_path / "a.jsonl", tmp_path / "a.jsonl"])
    assert len(list(reader)) == 2 and len(list(reader)) == 2 and reader.stats.read == 2  # each pass starts afresh
    (tmp_path / "arr.json").write_text(json.dumps([GOOD]))  # one line: the file is one JSON array, read
    assert [c.id for c in read_conversations(tmp_path / "arr.json")] == [f"{tmp_path / 'arr.json'}[0]"]
    (tmp_path / "arr2.json").write_text(json.dumps([GOOD], indent=2)[:-2])  # an array cut short: refused
    with pytest.raises(BadFileError, match=r"JSON array that does not parse.*line 1[0-9] column.*malformed_json"):
        list(read_conversations(tmp_path / "arr2.json"))
    skip = read_conversations(tmp_path / "arr2.json", on_bad_row="skip")  # skip mode: a counted file
    assert list(skip) == [] and skip.stats.files_skipped == {"malformed_json": 1} and skip.stats.read == 0
    with pytest.raises(FileNotFoundError):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format"):
        read_conversations(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="'error', 'skip'"):
        read_conversations(tmp_path / "a.jsonl", on_bad_row="ignore")


def test_read_then_tokenize(tmp_path: Path) -> None:
    lines = [
        json.dumps({"messages": [U("q"), A("the answer")]}),
        "oops",
        json.dumps(GOOD),
    ]
    reader = read_conversations(write_jsonl(tmp_path / "c.jsonl", lines), on_bad_row="skip")
    out = tokenize_conversations(reader, tok_of("chatml"), progress=False)
    samples = out.to_list()
    assert [s.conversation_id for s in samples] == [
        f"{tmp_path / 'c.jsonl'}:1",
        f"{tmp_path / 'c.jsonl'}:3",
    ]
    assert trainable_runs(tok_of("chatml"), samples[0]) == ["the answer<|im_end|>"]
    assert reader.stats.dropped == {"invalid_json": 1} and out.stats.conversations == 2


def test_streaming_keeps_memory_bounded(tmp_path: Path) -> None:
    """Reading never holds the file: peak traced memory stays a small fraction of its size."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [U(f"question {i} " + "x" * 400), A(f"answer {i} " + "y" * 600)]} for i in range(3000)]
    jsonl = write_jsonl(tmp_path / "big.jsonl", [json.dumps(r) for r in rows])
    parquet = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=500)
    size = jsonl.stat().st_size  # about 3 MB
    for path in (jsonl, parquet):
        tracemalloc.start()
        n = sum(1 for _ in read_conversations(path, batch_size=256))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert n == 3000 and peak < size / 4, (path.name, peak, size)


# ---------------------------------------------------------------------------- issue 9: hardening

ROWS = [{"messages": [U(f"q{i}"), A(f"a{i}")]} for i in range(6)]


def _lines(rows: list[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def test_deeply_nested_json_is_a_bad_row(tmp_path: Path) -> None:
    deep = b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    path = tmp_path / "deep.jsonl"
    path.write_bytes(_lines(ROWS[:1]) + deep + b"\n" + _lines(ROWS[1:2]))
    reader = read_conversations(path, on_bad_row="skip")
    assert len(list(reader)) == 2
    assert reader.stats.as_dict() == {"read": 3, "kept": 2, "dropped": {"invalid_json": 1}, "formats": {"messages": 2}}
    with pytest.raises(BadRowError, match=r"line 2: invalid JSON: nested too deeply.*\[invalid_json\]"):
        list(read_conversations(path))


def test_truncated_gzip_keeps_rows_before_the_cut_and_counts_the_tail(tmp_path: Path) -> None:
    rows = [{"messages": [U(f"question {i} " + "x" * (i % 97)), A(f"answer {i}")]} for i in range(5000)]
    whole = gzip.compress(_lines(rows))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    reader = read_conversations(path, on_bad_row="skip")
    convs = list(reader)
    s = reader.stats
    assert 0 < len(convs) < 5000 and s.kept == len(convs)
    assert s.dropped.get("unreadable_tail") == 1 and s.read == s.kept + s.num_dropped
    assert [c.messages for c in convs[:3]] == [r["messages"] for r in rows[:3]]
    (problem,) = s.file_problems
    assert problem.path == str(path) and problem.reason == "unreadable_tail" and "cut short" in problem.detail
    with pytest.raises(BadFileError, match=rf"{path}: damaged after line \d+: .*cut short.*\[unreadable_tail\]"):
        list(read_conversations(path))


def test_a_gz_that_is_not_gzip_and_broken_parquet_files_are_named(tmp_path: Path) -> None:
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_bytes(_lines(ROWS))  # plain text with a .gz name
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    text = tmp_path / "text.parquet"
    text.write_bytes(_lines(ROWS))
    good = write_jsonl(tmp_path / "good.jsonl", [json.dumps(r) for r in ROWS])
    for bad, phrase in [(fake, "not a valid gzip stream"), (empty, "0 bytes"), (text, "not a readable Parquet")]:
        with pytest.raises(BadFileError, match=rf"{bad}: .*{phrase}.*\[unreadable\]. Fix: "):
            list(read_conversations(bad))
    reader = read_conversations([fake, good, empty, text], on_bad_row="skip")
    assert len(list(reader)) == 6
    s = reader.stats
    assert s.as_dict() == {"read": 6, "kept": 6, "dropped": {}, "formats": {"messages": 6}}
    assert (s.files_read, s.files_skipped) == (1, {"unreadable": 3})
    assert [p.path for p in s.file_problems] == [str(fake), str(empty), str(text)]


def test_parquet_damaged_mid_file_counts_the_rows_lost(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [U(f"q{i} " + "z" * 300), A(f"a{i}")]} for i in range(40)]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10, compression="snappy")
    meta = pq.ParquetFile(path).metadata
    start = meta.row_group(2).column(0).data_page_offset  # scribble over the third row group's pages
    raw = bytearray(path.read_bytes())
    raw[start : start + 200] = b"\xff" * 200
    path.write_bytes(bytes(raw))
    reader = read_conversations(path, on_bad_row="skip", batch_size=10)
    convs = list(reader)
    assert len(convs) == 20 and reader.stats.dropped == {"unreadable_tail": 20}
    assert reader.stats.read == 40 == reader.stats.kept + reader.stats.num_dropped
    with pytest.raises(BadFileError, match=rf"{path}: damaged after row 19"):
        list(read_conversations(path, batch_size=10))


def test_folders_are_searched_recursively_and_every_other_file_is_counted(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / ".git").mkdir()
    write_jsonl(tmp_path / "top.jsonl", [json.dumps(ROWS[0])])
    write_jsonl(tmp_path / "a" / "b" / "deep.jsonl", [json.dumps(ROWS[1]), json.dumps(ROWS[2])])
    (tmp_path / "a" / "notes.txt").write_text("hello")
    (tmp_path / "a" / "data.csv").write_text("a,b\n")
    (tmp_path / ".git" / "config").write_text("x")
    (tmp_path / ".DS_Store").write_bytes(b"\0")
    reader = read_conversations(tmp_path)
    assert [c.id for c in reader] == [
        f"{tmp_path / 'a' / 'b' / 'deep.jsonl'}:1",
        f"{tmp_path / 'a' / 'b' / 'deep.jsonl'}:2",
        f"{tmp_path / 'top.jsonl'}:1",
    ]
    s = reader.stats
    assert s.files_read == 2 and s.files_skipped == {"unsupported_format": 2, "hidden": 2}
    assert sorted(p.path for p in s.file_problems) == sorted(
        str(p)
        for p in (tmp_path / ".git", tmp_path / ".DS_Store", tmp_path / "a" / "data.csv", tmp_path / "a" / "notes.txt")
    )
    assert s.as_dict(files=True)["files_skipped"] == {"unsupported_format": 2, "hidden": 2}
    # ** recurses; a plain * does not; a glob's other files are counted too
    assert len(list(read_conversations(str(tmp_path / "**" / "*.jsonl")))) == 3
    assert len(list(read_conversations(str(tmp_path / "*.jsonl")))) == 1
    star = read_conversations(str(tmp_path / "a" / "*"))  # the folder b (recursed) and two other files
    assert len(list(star)) == 2 and star.stats.files_skipped == {"unsupported_format": 2}
    # a folder with nothing readable is an error that says what was looked for
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="no .jsonl / .json / .parquet file .searched recursively."):
        read_conversations(tmp_path / "empty")


def test_saved_dataset_inside_a_folder_is_read_as_a_dataset(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_list(ROWS[:3]).save_to_disk(str(tmp_path / "saved"))
    write_jsonl(tmp_path / "more.jsonl", [json.dumps(ROWS[3])])
    reader = read_conversations(tmp_path)
    assert len(list(reader)) == 4 and reader.stats.files_skipped == {} and reader.stats.files_read == 2


PRETTY_OBJECT = json.dumps(ROWS[0], indent=2)  # 12 lines


@pytest.mark.parametrize(
    ("name", "payload", "reason", "phrase", "fix"),
    [
        ("obj.json", PRETTY_OBJECT.encode(), "json_document", "JSON object spread over several lines", "jq -c ."),
        ("arr.json", json.dumps(ROWS, indent=2).encode()[:-9], "malformed_json", "JSON array that does", "json.tool"),
        (  # JSON Lines whose lines are arrays of rows
            "arr1.jsonl",
            (json.dumps(ROWS[:3]) + "\n" + json.dumps(ROWS[3:]) + "\n").encode(),
            "json_document",
            "array of objects (3)",
            "jq -c '.[]'",
        ),
        ("mac.jsonl", b"".join(json.dumps(r).encode() + b"\r" for r in ROWS), "cr_line_endings", "bare CR", "tr"),
        ("u16.jsonl", _lines(ROWS).decode().encode("utf-16"), "utf16", "UTF-16", "iconv -f UTF-16"),
        ("u16le.jsonl", _lines(ROWS).decode().encode("utf-16-le"), "utf16", "UTF-16", "iconv -f UTF-16"),
    ],
)
def test_files_that_are_not_json_lines_are_explained(
    tmp_path: Path, name: str, payload: bytes, reason: str, phrase: str, fix: str
) -> None:
    path = tmp_path / name
    path.write_bytes(payload)
    with pytest.raises(BadFileError) as info:
        list(read_conversations(path))
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and phrase in msg and f"[{reason}]" in msg and fix in msg
    reader = read_conversations(path, on_bad_row="skip")
    assert list(reader) == []
    assert reader.stats.as_dict(files=True)["files_skipped"] == {reason: 1}
    assert (reader.stats.read, reader.stats.files_read) == (0, 0)  # one explained file, not N invalid rows


def test_a_broken_first_row_is_still_a_row(tmp_path: Path) -> None:
    """A JSON Lines file whose first line breaks off is not mistaken for an indented document."""
    path = write_jsonl(tmp_path / "c.jsonl", ['{"messages": [', '{"messages": [', *(json.dumps(r) for r in ROWS)])
    reader = read_conversations(path, on_bad_row="skip")
    assert len(list(reader)) == 6 and reader.stats.dropped == {"invalid_json": 2}
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + _lines(ROWS))  # a UTF-8 byte order mark is fine
    assert len(list(read_conversations(bom))) == 6


@pytest.mark.parametrize(
    ("field", "value"),
    [("role", ["user"]), ("role", {"a": 1}), ("role", 3), ("role", None), ("content", {"x": [1]})],
)
def test_every_value_of_a_field_reaches_a_check(tmp_path: Path, field: str, value: Any) -> None:
    bad = {"messages": [U("q"), {**A("a"), field: value}]}
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": value, "value": "a"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [json.dumps(bad), json.dumps(sharegpt), json.dumps(ROWS[0])])
    reader = read_conversations(path, on_bad_row="skip", role_map={"bot": "assistant"})
    assert len(list(reader)) == 1 and reader.stats.read == 3 and reader.stats.num_dropped == 2
    with pytest.raises(BadRowError, match="line 1: message 1"):
        list(read_conversations(path, role_map={"bot": "assistant"}))


def test_a_symlink_loop_is_searched_once(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [json.dumps(ROWS[0])])
    (tmp_path / "d" / "loop").symlink_to(tmp_path / "d")
    assert len(list(read_conversations(tmp_path))) == 1
