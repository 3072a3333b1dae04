"""A row's ``group`` (the prompt an RL / GRPO completion answers), from the file into
``Sample.meta["group"]``: read, checked (``bad_group``), tokenized, cached; an SFT sample still
(no ``role``); a row without it gives exactly the sample it gave before groups existed."""

from __future__ import annotations

import pickle

import pytest

from sftpack import Sample
from sftpack.chat import BadRowError, read_conversations, tokenize_conversation, tokenize_conversations
from sftpack.chat._batch import TokenizeStats
from sftpack.chat._cache_entry import EntryWriter, read_entry
from sftpack.sample import check_sft_sample
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import write_rows


def U(text: str) -> dict:
    return {"role": "user", "content": text}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer("chatml")


ROWS = [
    {"messages": [U("2+2?"), A("4")], "group": "q1", "advantage": 1.0},
    {"messages": [U("2+2?"), A("5")], "group": "q1", "advantage": -1.0},
    {"messages": [U("3+3?"), A("6")], "group": 7},
    {"messages": [U("2+2?"), A("4")]},
]


def test_group_reaches_the_samples_meta(tmp_path, tok):
    reader = read_conversations(write_rows(tmp_path / "g.jsonl", ROWS))
    samples = [tokenize_conversation(c, tok) for c in reader]
    assert reader.stats.kept == len(ROWS) and reader.stats.dropped == {}
    assert [s.meta.get("group") for s in samples] == ["q1", "q1", 7, None]
    for fmt, row in (
        ("pc", {"prompt": "3+3=", "completion": " 6", "group": 7}),
        ("text", {"text": "plain text", "group": "t", "weight": 0.5}),
    ):
        (conv,) = read_conversations(write_rows(tmp_path / f"{fmt}.jsonl", [row]))
        assert tokenize_conversation(conv, tok).meta == {"group": row["group"]}
    for s in samples:
        check_sft_sample(s)  # SFT-trained completions: no role, accepted
        assert "role" not in s.meta
    assert samples[0].weights is not None and set(samples[0].weights[samples[0].loss_mask].tolist()) == {1.0}
    # the group changes nothing else: the same ids, mask and weights as the row without it
    bare = tokenize_conversation({"messages": [U("2+2?"), A("4")], "advantage": 1.0}, tok)
    assert samples[0].input_ids.tolist() == bare.input_ids.tolist()
    assert samples[0].loss_mask.tolist() == bare.loss_mask.tolist()
    assert samples[0].weights.tolist() == bare.weights.tolist()
    # a row without it: the sample of before groups existed, byte for byte
    s4 = samples[3]
    assert pickle.dumps(s4) == pickle.dumps(Sample(s4.input_ids.copy(), s4.loss_mask.copy(), s4.conversation_id))
    # the batched tokenizer (the path of sftpack train) gives the same samples
    batched = tokenize_conversations(read_conversations(tmp_path / "g.jsonl"), tok, batch_size=2)
    assert [pickle.dumps(s) for s in batched] == [pickle.dumps(s) for s in samples]


def test_a_split_or_truncated_member_keeps_its_group(tok):
    row = {"messages": [U("a b c d e f g h"), A("i j k l m n o p")], "group": "g"}
    whole = tokenize_conversation(row, tok)
    cut = tokenize_conversation(row, tok, max_seq_len=len(whole) - 2, overlong="truncate")
    assert cut.meta == {"group": "g", "truncated_from": len(whole)}
    pieces = tokenize_conversations([row], tok, max_seq_len=len(whole) - 2, overlong="split")
    assert [p.meta for p in pieces] == [{"group": "g", "piece": k, "pieces": 2} for k in range(2)]


BAD = [
    ({"messages": [U("hi"), A("yo")], "group": 1.5}, "'group' is a number \\(1.5\\)"),
    ({"messages": [U("hi"), A("yo")], "group": True}, "'group' is a boolean"),
    ({"messages": [U("hi"), A("yo")], "group": ""}, "'group' is an empty string"),
    ({"messages": [U("hi"), A("yo")], "group": ["q"]}, "'group' is a list"),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "group": "q"}, "preference pair has a 'group'"),
]


def test_bad_groups_are_counted_and_named(tmp_path, tok):
    path = write_rows(tmp_path / "bad.jsonl", [r for r, _ in BAD])
    reader = read_conversations(path, on_bad_row="skip")
    assert list(reader) == []
    assert reader.stats.dropped == {"bad_group": len(BAD)}
    for i, (row, words) in enumerate(BAD):
        good = {"prompt": "p", "chosen": "a", "rejected": "c"} if "chosen" in row else {"messages": [U("x"), A("y")]}
        one = write_rows(tmp_path / f"bad{i}.jsonl", [good, row])
        with pytest.raises(BadRowError, match=rf"bad{i}\.jsonl, line 2: .*{words}.*\[bad_group\].*Fix:"):
            list(read_conversations(one))
    # a null is absent
    (conv,) = read_conversations(write_rows(tmp_path / "null.jsonl", [{"messages": [U("hi"), A("yo")], "group": None}]))
    assert tokenize_conversation(conv, tok).meta == {}
    # the tokenizer's own checks (rows not from the reader) say the same
    with pytest.raises(BadRowError, match=r"\[bad_group\]"):
        tokenize_conversation({"messages": [U("hi"), A("yo")], "group": 2.0}, tok)


def test_groups_round_trip_through_the_cache(tmp_path, tok):
    samples = [tokenize_conversation(r, tok) for r in ROWS]
    entry = tmp_path / "tokenized" / "k"
    w = EntryWriter(entry, "k")
    for s in samples:
        w.add(s)
    assert w.commit(TokenizeStats())
    got, _, _ = read_entry(entry, "k")
    assert [pickle.dumps(s) for s in got] == [pickle.dumps(s) for s in samples]


def test_a_parquet_group_column_is_read(tmp_path, tok):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.table(
        {"prompt": ["1+1=", "1+1="], "completion": [" 2", " 3"], "group": [5, 5], "advantage": [1.0, -1.0]}
    )
    pq.write_table(table, tmp_path / "g.parquet")
    samples = [tokenize_conversation(c, tok) for c in read_conversations(tmp_path / "g.parquet")]
    assert [s.meta for s in samples] == [{"group": 5}, {"group": 5}]
    assert [sorted(set(s.weights[s.loss_mask].tolist())) for s in samples] == [[1.0], [-1.0]]


def test_the_image_tokenizer_refuses_a_group_naming_it():
    """A group is never dropped unseen: the image tokenizer does not keep RL groups whole yet, so a
    record with a ``group`` is refused, naming it (a record without one tokenizes as before)."""
    from sftpack.multimodal import tokenize_media_conversations

    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], "group": "q1"}
    with pytest.raises(ValueError, match=r"carries a group \('q1'\): conversations with images do not keep RL"):
        list(tokenize_media_conversations([record], on_bad_row="error"))
    del record["group"]
    assert len(list(tokenize_media_conversations([record], on_bad_row="error"))) == 1
