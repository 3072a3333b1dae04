"""The library says nothing on stderr: what tokenizing many conversations skipped or cut is
returned in its stats (the CLI prints it in its summary); the log has it at debug level only,
in words (no Python dict)."""

from __future__ import annotations

import logging

from sftpack.chat import tokenize_conversations
from sftpack.testing import tiny_chat_tokenizer


def test_skips_and_cuts_are_returned_not_logged(caplog, capfd):
    tok = tiny_chat_tokenizer("chatml")
    convs = [
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello you"}],
        [{"role": "user", "content": "hi"}],  # nothing to train: skipped
        [{"role": "user", "content": "the"}, {"role": "assistant", "content": "the you " * 20}],  # over 24 tokens
    ]
    with caplog.at_level(logging.DEBUG, logger="sftpack"):
        done = tokenize_conversations(convs, tok, max_seq_len=24, overlong="truncate", on_bad_row="skip")
        samples = done.to_list()
    assert len(samples) == 2 and dict(done.stats.skipped) == {"no_assistant_turn": 1} and done.stats.truncated == 1
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    said = [r.getMessage() for r in caplog.records]
    assert "skipped 1 conversations (no_assistant_turn 1)" in said
    assert any(s.startswith("over max_seq_len=24: 1 conversations truncated, 0 dropped") for s in said)
    assert not any("{" in s for s in said)
    assert capfd.readouterr().err == ""
