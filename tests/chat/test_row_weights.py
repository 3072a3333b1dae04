"""A row's ``weight`` / ``advantage`` and an assistant message's ``weight``, from the file into
``Sample.weights`` (issue 42 item 5): read, checked (``bad_weight``), tokenized, cached; a row
without them gives exactly the sample it gave before weights existed."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from sftpack import Sample
from sftpack.chat import BadRowError, read_conversations, tokenize_conversation, tokenize_conversations
from sftpack.chat._batch import TokenizeStats
from sftpack.chat._cache_entry import _FILES, EntryWriter, read_entry
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import write_rows


def U(text: str, **kw: object) -> dict:
    return {"role": "user", "content": text, **kw}


def A(text: str, **kw: object) -> dict:
    return {"role": "assistant", "content": text, **kw}


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer("chatml")


def trained_weights(s: Sample) -> list[float]:
    return np.asarray(s.weights)[s.loss_mask].tolist()


def test_row_and_turn_weights_reach_the_trained_tokens(tmp_path, tok):
    rows = [
        {"messages": [U("hi"), A("yo")], "weight": 2.5},
        {"messages": [U("hi"), A("yo")], "advantage": -0.75},
        {"messages": [U("a"), A("one", weight=0), U("b"), A("two", weight=3)], "advantage": -2},
        {"messages": [U("a"), A("one"), U("b"), A("two", weight=0.5)]},
        {"messages": [U("hi"), A("yo")]},
    ]
    reader = read_conversations(write_rows(tmp_path / "w.jsonl", rows))
    samples = [tokenize_conversation(c, tok) for c in reader]
    assert reader.stats.kept == len(rows)
    s0, s1, s2, s3, s6 = samples
    (s4,) = (
        tokenize_conversation(c, tok)
        for c in read_conversations(write_rows(tmp_path / "t.jsonl", [{"text": "plain text to train on", "weight": 0}]))
    )
    (s5,) = (
        tokenize_conversation(c, tok)
        for c in read_conversations(
            write_rows(tmp_path / "p.jsonl", [{"prompt": "2 + 3 =", "completion": " 5", "advantage": 1.5}])
        )
    )
    assert set(trained_weights(s0)) == {2.5} and set(trained_weights(s1)) == {-0.75}
    # per turn: the row's advantage times each turn's weight, over that turn's trained tokens
    n_one = len(tokenize_conversation([U("a"), A("one")], tok).input_ids)
    w2 = np.asarray(s2.weights)
    assert set(w2[s2.loss_mask][: int(s2.loss_mask[:n_one].sum())].tolist()) == {-0.0}
    assert set(w2[s2.loss_mask][int(s2.loss_mask[:n_one].sum()) :].tolist()) == {-6.0}
    w3 = np.asarray(s3.weights)[s3.loss_mask]
    first = int(s3.loss_mask[:n_one].sum())
    assert set(w3[:first].tolist()) == {1.0} and set(w3[first:].tolist()) == {0.5}
    assert set(trained_weights(s4)) == {0.0} and set(trained_weights(s5)) == {1.5}
    # the same ids and mask as the row without the field
    for s in (s0, s1):
        assert s.input_ids.tolist() == s6.input_ids.tolist() and s.loss_mask.tolist() == s6.loss_mask.tolist()
    # a row without the fields: the sample of before weights existed, byte for byte
    assert s6.weights is None and "weights" not in s6.__dict__
    fresh = Sample(s6.input_ids.copy(), s6.loss_mask.copy(), s6.conversation_id)
    assert pickle.dumps(s6) == pickle.dumps(fresh)
    # the batched tokenizer (the path of sftpack train) gives the same samples
    batched = tokenize_conversations(read_conversations(tmp_path / "w.jsonl"), tok, batch_size=3)
    for a, b in zip(batched, samples):
        assert pickle.dumps(a) == pickle.dumps(b)


BAD = [
    ({"messages": [U("hi"), A("yo")], "weight": "2"}, "'weight' is a string"),
    ({"messages": [U("hi"), A("yo")], "weight": True}, "'weight' is a boolean"),
    ({"messages": [U("hi"), A("yo")], "advantage": [1]}, "'advantage' is a list"),
    ({"messages": [U("hi"), A("yo")], "weight": 1, "advantage": 1}, "both 'weight' and 'advantage'"),
    ({"messages": [U("hi", weight=2), A("yo")]}, "message 0 (user) has a 'weight'"),
    ({"messages": [U("hi"), A("yo", weight="x")]}, "message 1 (assistant).weight is a string"),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "weight": 1}, "preference pair has a 'weight'"),
]


def test_bad_weights_are_counted_and_named(tmp_path, tok):
    lines = [json.dumps(r) for r, _ in BAD] + [
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "weight": NaN}'
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    reader = read_conversations(path, on_bad_row="skip")
    assert list(reader) == []
    assert reader.stats.dropped == {"bad_weight": len(BAD) + 1}  # each row counted once, under its reason
    for i, (row, words) in enumerate(BAD):
        good = {"prompt": "p", "chosen": "a", "rejected": "c"} if "chosen" in row else {"messages": [U("x"), A("y")]}
        one = write_rows(tmp_path / f"bad{i}.jsonl", [good, row])
        words = words.replace("(", r"\(").replace(")", r"\)")
        with pytest.raises(BadRowError, match=rf"bad{i}\.jsonl, line 2: .*{words}.*\[bad_weight\]"):
            list(read_conversations(one))
    nan = tmp_path / "nan.jsonl"
    nan.write_text(lines[-1] + "\n")
    with pytest.raises(BadRowError, match=r"nan\.jsonl, line 1: 'weight' is nan, not a finite number \[bad_weight\]"):
        list(read_conversations(nan))
    # the tokenizer's own checks (rows not from the reader) say the same
    with pytest.raises(BadRowError, match=r"\[bad_weight\]"):
        tokenize_conversation({"messages": [U("hi"), A("yo")], "advantage": float("inf")}, tok)


def test_weights_round_trip_through_the_cache(tmp_path, tok):
    plain = tokenize_conversation([U("hi"), A("yo")], tok)
    heavy = tokenize_conversation({"messages": [U("a"), A("b", weight=2)], "advantage": -1}, tok)
    entry = tmp_path / "tokenized" / "k"
    w = EntryWriter(entry, "k")
    for s in (plain, heavy, plain):
        w.add(s)
    assert w.commit(TokenizeStats())
    got, _, _ = read_entry(entry, "k")
    assert [pickle.dumps(s) for s in got] == [pickle.dumps(s) for s in (plain, heavy, plain)]
    assert got[1].weights.tolist() == heavy.weights.tolist() and got[0].weights is None
    # an entry without weighted samples: the four files of before, no 'weighted' key
    entry2 = tmp_path / "tokenized" / "k2"
    w = EntryWriter(entry2, "k2")
    w.add(plain)
    assert w.commit(TokenizeStats())
    assert sorted(p.name for p in entry2.iterdir()) == sorted([*_FILES, "manifest.json"])
    assert "weighted" not in json.loads((entry2 / "index.json").read_text())


def test_a_parquet_weight_column_is_read(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"messages": [U("hi"), A("yo")], "advantage": -0.5}, {"messages": [U("hi"), A("yo")], "advantage": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "w.parquet")
    a, b = (tokenize_conversation(c, tok) for c in read_conversations(tmp_path / "w.parquet"))
    assert set(trained_weights(a)) == {-0.5} and b.weights is None


def test_paths_that_cannot_carry_weights_refuse_them(tmp_path, capsys):
    """A weight is never dropped unseen: ``sftpack prepack`` keeps it (the weights column,
    tests/offline/test_pairs_weights.py), and the image tokenizer refuses a weighted conversation
    naming it."""
    from sftpack.cli import main
    from sftpack.multimodal import tokenize_media_conversations

    data = tmp_path / "w.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "weight": 2}\n'
    )
    assert main(["prepack", str(data), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert (tmp_path / "out" / "weights.npy").is_file()
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], "advantage": -1}
    with pytest.raises(ValueError, match=r"carries a advantage: conversations with images do not carry per-token"):
        list(tokenize_media_conversations([record], on_bad_row="error"))
