"""A JSON array file is read element by element whatever its first element is (issue 38, item 7).

The file's kind comes from the file (its first non-space character is ``[`` and the whole
parses as one array), not from its first element: an element that is not an object (a
number, a string, a list) is one bad row counted under ``not_an_object``, named by its index;
the objects around it are read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sftpack.chat import BadRowError, read_conversations
from sftpack.cli import main
from sftpack.testing import tiny_chat_tokenizer


def _good(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}


# the odd elements: a number first, a string and a list in the middle (a list of a good row, too)
ARRAY = [7, _good(1), "stray text", _good(2), [_good(3)], _good(4)]
GOOD_AT = [1, 3, 5]


def _write(tmp_path: Path, pretty: bool) -> Path:
    path = tmp_path / ("pretty.json" if pretty else "compact.json")
    path.write_text(json.dumps(ARRAY, indent=2 if pretty else None), encoding="utf-8")
    return path


@pytest.mark.parametrize("pretty", [False, True], ids=["compact", "pretty"])
def test_the_good_elements_are_read_and_each_bad_one_counted(tmp_path: Path, pretty: bool) -> None:
    path = _write(tmp_path, pretty)
    reader = read_conversations(path, on_bad_row="skip")
    convs = list(reader)
    assert [c.id for c in convs] == [f"{path}[{i}]" for i in GOOD_AT]
    assert [c.messages[0]["content"] for c in convs] == ["question 1", "question 2", "question 4"]
    s = reader.stats.as_dict(files=True)
    assert s["read"] == len(ARRAY) and s["kept"] == 3 and s["dropped"] == {"not_an_object": 3}
    assert s["files_read"] == 1 and s["files_skipped"] == {} and s["file_problems"] == []


@pytest.mark.parametrize("pretty", [False, True], ids=["compact", "pretty"])
def test_error_mode_names_the_file_and_the_element(tmp_path: Path, pretty: bool) -> None:
    path = _write(tmp_path, pretty)
    with pytest.raises(BadRowError) as info:
        list(read_conversations(path, on_bad_row="error"))
    e = info.value
    assert e.source == str(path) and e.location.startswith("item 0 (line ") and e.reason.value == "not_an_object"
    assert "JSON number, not an object" in str(e) and "element of a JSON array" in e.fix


def test_an_array_of_only_bad_elements_and_an_empty_array(tmp_path: Path) -> None:
    """Negative controls: nothing good is invented; an empty array is a file of no rows."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1, "two", [3], None], indent=1))
    reader = read_conversations(bad, on_bad_row="skip")
    assert list(reader) == [] and reader.stats.as_dict() == {
        "read": 4,
        "kept": 0,
        "dropped": {"not_an_object": 4},
        "formats": {},
    }
    empty = tmp_path / "empty.json"
    empty.write_text("[\n]\n")
    reader = read_conversations(empty, on_bad_row="skip")
    assert list(reader) == [] and (reader.stats.read, reader.stats.files_read, reader.stats.files_skipped) == (0, 1, {})


def test_json_lines_whose_lines_are_arrays_stay_json_lines(tmp_path: Path) -> None:
    """More than one JSON value is no single array: each line is a row (here a bad one)."""
    path = tmp_path / "lines.jsonl"
    path.write_text("[1, 2]\n[3]\n" + json.dumps(_good(0)) + "\n")
    reader = read_conversations(path, on_bad_row="skip")
    assert [c.id for c in reader] == [f"{path}:3"]
    assert reader.stats.as_dict()["dropped"] == {"not_an_object": 2}


@pytest.mark.parametrize("pretty", [False, True], ids=["compact", "pretty"])
def test_bench_and_prepack_pack_the_good_elements(tmp_path: Path, pretty: bool, capsys) -> None:
    path = _write(tmp_path, pretty)
    tok = tmp_path / "tok"
    tiny_chat_tokenizer("chatml").save_pretrained(tok)
    assert main(["bench", str(path), "--tokenizer", str(tok), "--max-seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "read 6 rows: 3 kept, dropped: not_an_object 3" in out and "3 conversations ->" in out
    assert main(["prepack", str(path), "--out", str(tmp_path / "pp"), "--tokenizer", str(tok)]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"conversations read +6\n +kept +3\n +formats +messages 3\n +dropped \(by reason\) +not_an_object 3\n", out
    ), out
    assert re.search(r"samples \(sequences\) +3\n", out), out
    strict = ["prepack", str(path), "--out", str(tmp_path / "pp2"), "--tokenizer", str(tok), "--on-bad-row", "error"]
    assert main(strict) == 1
    err = capsys.readouterr().err
    where = rf"sftpack prepack: {re.escape(str(path))}, item 0 \(line \d+\)"
    assert re.match(where + ": the row is a JSON number", err), err
