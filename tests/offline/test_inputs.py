"""The inputs on their own (``_inputs``): the three kinds, their fingerprints (an
iterable's known once read), and the counts that reading and tokenizing give."""

from __future__ import annotations

import json

import pytest

from sftpack.data import default_corpus
from sftpack.offline import PrepackError
from sftpack.offline._inputs import check_out_outside_inputs, open_inputs, reading_counts


def test_the_three_kinds_and_their_fingerprints(chat_file):
    corpus = open_inputs(None, on_bad_row="skip", limit=3)
    assert corpus.reader is None and len(list(corpus.conversations)) == 3
    assert corpus.fingerprint()[0]["limit"] == 3 and "default_corpus" in corpus.fingerprint()[0]["name"]

    files = open_inputs(chat_file, on_bad_row="skip", limit=None)
    assert files.reader is not None and files.fingerprint()[0]["size"] == chat_file.stat().st_size

    convs = list(default_corpus(limit=5))
    it = open_inputs(convs, on_bad_row="skip", limit=4)
    assert it.reader is None and it.fingerprint()[0]["size"] == 0  # nothing read yet
    assert len(list(it.conversations)) == 4
    fp = it.fingerprint()[0]
    assert fp["name"] == "<iterable>" and fp["size"] == 4
    again = open_inputs(convs[:4], on_bad_row="skip", limit=None)
    list(again.conversations)
    assert again.fingerprint()[0]["sha256"] == fp["sha256"]  # the same conversations, the same hash
    changed = [{"id": c.id, "messages": list(c.messages)} for c in convs[:4]]
    changed[2]["messages"] = changed[2]["messages"][:-1] + [{"role": "assistant", "content": "other"}]
    other = open_inputs(changed, on_bad_row="skip", limit=None)
    list(other.conversations)
    assert other.fingerprint()[0]["sha256"] != fp["sha256"]


def test_reading_counts_without_a_reader_count_every_conversation_read_and_kept():
    tokenize = {"conversations": 5, "fit": 3, "split": 1, "truncated": 0, "dropped": 1, "tokens": 90, "tokens_lost": 7}
    c = reading_counts(None, tokenize)
    assert (c["read"], c["kept"], c["dropped"]) == (5, 5, {})
    assert c["overlong"] == {"tokenized": 5, "fit": 3, "truncated": 0, "split": 1, "dropped": 1}
    assert c["tokens_rendered"] == 97 and c["trainable_tokens_lost"] == 0  # a missing statistic counts 0
    r = reading_counts({"read": 8, "kept": 5, "dropped": {"z_reason": 1, "a_reason": 2}}, tokenize)
    assert (r["read"], r["kept"]) == (8, 5) and list(r["dropped"]) == ["a_reason", "z_reason"]


def test_an_input_inside_the_output_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.jsonl").write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(PrepackError, match="is inside --out"):
        check_out_outside_inputs([out / "x.jsonl"], out)
    with pytest.raises(PrepackError, match="is inside --out"):
        check_out_outside_inputs(str(out / "*.jsonl"), out)  # a glob, expanded
    check_out_outside_inputs([out / "x.jsonl"], tmp_path / "elsewhere")  # no error
