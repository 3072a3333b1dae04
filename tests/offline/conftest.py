"""Shared small inputs: a JSONL file of real chitchat conversations (plus known bad
rows), the offline tiny tokenizer, and one prepack of it built once per session."""

from __future__ import annotations

import json

import pytest

from sftpack.data import default_corpus
from sftpack.testing import tiny_chat_tokenizer

#: bad rows appended to the corpus file, each with the reason the reader counts
BAD_ROWS = [
    ("{not json", "invalid_json"),
    ('{"messages": []}', "empty_messages"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no_assistant_turn"),
]
N_GOOD = 60
MAX_SEQ_LEN = 1024


@pytest.fixture(scope="session")
def tok():
    return tiny_chat_tokenizer("chatml")


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "chat.jsonl"
    lines = [json.dumps({"messages": c.messages}) for c in default_corpus(limit=N_GOOD)]
    lines[10:10] = [row for row, _ in BAD_ROWS]  # bad rows in the middle
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def built(tmp_path_factory, chat_file, tok):
    """(result, out dir) of one prepack of ``chat_file`` with pad multiple 4 and split."""
    from sftpack.offline import prepack

    out = tmp_path_factory.mktemp("prepacks") / "p1"
    result = prepack(chat_file, out, tokenizer=tok, max_seq_len=MAX_SEQ_LEN, pad_multiple=4, overlong="split")
    return result, out
