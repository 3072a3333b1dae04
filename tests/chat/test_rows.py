"""sftpack.chat._rows: the row schema (OpenAI / ShareGPT), role maps, the Conversation mapping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack.chat import (
    BadRowError,
    Conversation,
    read_conversations,
    tokenize_conversations,
    validate_messages,
)
from tests.helpers import (
    ROWS_OF_ANYTHING,
    A,
    S,
    U,
    nosy_tokenizer,
    tok_of,
    write_jsonl,
)


def test_sharegpt_and_role_map(tmp_path: Path) -> None:
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "bot", "content": "a", "name": None},
            ]
        },
    ]
    path = write_jsonl(tmp_path / "sg.jsonl", [json.dumps(r) for r in rows])
    convs = list(read_conversations(path, role_map={"bot": "assistant"}))
    assert convs[0].messages == [S("s"), U("q"), A("a")]
    assert convs[1].messages == [
        U("q"),
        A("a"),
    ]  # null-valued keys dropped, as transformers does
    with pytest.raises(BadRowError, match=r"role_map=\{'bot': 'assistant'\}"):
        list(read_conversations(path))
    with pytest.raises(ValueError, match="unknown roles"):
        read_conversations(path, role_map={"bot": "robot"})


def test_conversation_reads_like_a_mapping() -> None:
    c = Conversation("f.jsonl:3", [U("a"), A("b")])
    assert dict(c) == {"id": "f.jsonl:3", "messages": [U("a"), A("b")]}
    assert "messages" in c and c.get("text") is None and c["conversation_id"] == "f.jsonl:3"


def test_validate_messages_message() -> None:
    with pytest.raises(
        ValueError,
        match=r"message 1 \(assistant\) has an empty content \[empty_content\]",
    ):
        validate_messages([U("a"), A("")])


# ---------------------------------------------------------------------------- issue 9: every value reaches a check


@pytest.mark.parametrize("role", [["user"], {"r": "user"}, 7, True, None, 1.5])
def test_a_role_of_any_json_type_is_a_bad_row_not_a_type_error(role: Any) -> None:
    for row in (
        {"messages": [U("q"), {"role": role, "content": "a"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": role, "value": "a"}]},
    ):
        with pytest.raises(ValueError, match=r"message 1 has a \w+ '(role|from)'.*\[unknown_role\]"):
            validate_messages(row, role_map={"bot": "assistant"})


def test_lone_surrogates_are_invalid_text() -> None:
    row = json.loads('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a\\ud800"}]}')
    with pytest.raises(ValueError, match=r"message 1 \(assistant\) holds a lone surrogate.*\[invalid_text\]"):
        validate_messages(row)
    ok = json.loads(
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\ud83d\\ude00"}]}'
    )
    assert validate_messages(ok)[1]["content"] == "😀"  # a surrogate *pair* is one character


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ROWS_OF_ANYTHING, min_size=1, max_size=8))
def test_any_json_in_any_field_skip_mode_never_raises_and_adds_up(tmp_path: Path, rows: list[Any]) -> None:
    """Arbitrary JSON values in every field of a row, through the reader and the tokenizer
    (directly and after the reader), in skip mode: nothing escapes and every count adds up."""
    path = tmp_path / "any.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")  # ensure_ascii: surrogates survive
    reader = read_conversations(path, on_bad_row="skip", role_map={"bot": "assistant"})
    kept = list(reader)
    s = reader.stats
    assert s.read == s.kept + sum(s.dropped.values()) and s.kept == len(kept)
    if len(rows) == 1 and isinstance(rows[0], list):  # the file is one JSON array: each element a row
        assert not s.files_skipped and s.read == len(rows[0])
    elif s.files_skipped:  # JSON Lines whose first row is an array of objects
        assert s.files_skipped == {"json_document": 1} and s.read == 0 and isinstance(rows[0], list)
    else:
        assert s.read == len(rows)
    for tok in (tok_of("chatml"), nosy_tokenizer()):
        for source, n in ((kept, len(kept)), (rows, len(rows))):
            out = tokenize_conversations(source, tok, on_bad_row="skip", max_seq_len=16, overlong="split")
            samples = out.to_list()
            t = out.stats
            assert t.conversations == n == t.fit + t.truncated + t.dropped + t.split + sum(t.skipped.values())
            assert t.samples == len(samples) and t.label_tokens + t.labels_lost == t.labels
            assert t.label_tokens == sum(int(x.loss_mask[1:].sum()) for x in samples)
