"""The packed-JSONL export read the way the upstream loader (NeMo-RL #3380,
``megatron_sft_packed``) reads it.

The reader below is written in this file from that loader's documented behaviour
(docs/guides/sft.md "Megatron-LM offline-packed datasets" and the preprocessor it
describes), in our own words: a line is ``{"messages": [...]}`` starting with a
``system`` message and ending with an ``assistant`` one; it is cut into
conversations at every ``system`` message; each conversation is tokenized whole
with ``apply_chat_template`` (no generation prompt); with context parallelism the
row is padded after each conversation to a multiple of ``2 * CP``; a row holding
more than ``max_seq_length`` tokens is cut there (the tail is lost, with a warning
and no error).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sftpack.chat import read_conversations
from sftpack.offline import PrepackedDataset, export_packed_jsonl, prepack

WIDTH = 1024
#: a template that renders only the contents (the upstream's simplest prompt format), in our words
CONTENT_ONLY = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _split(messages):
    convs = []
    for m in messages:
        if m["role"] == "system" or not convs:
            convs.append([])
        convs[-1].append(m)
    return convs


def _count(tok, conv, template=None):
    out = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=False, chat_template=template)
    return len(out["input_ids"] if hasattr(out, "keys") else out)


def _upstream_row_tokens(tok, messages, granularity, template=None):
    """Tokens the upstream loader lays for one line before it cuts at max_seq_length."""
    assert messages[0]["role"] == "system" and messages[-1]["role"] == "assistant"
    total = 0
    for conv in _split(messages):
        total += _count(tok, conv, template)
        total = -(-total // granularity) * granularity  # padded to 2*CP after each conversation
    return total


def _trimmed(messages):
    end = len(messages)
    while end and messages[end - 1]["role"] != "assistant":
        end -= 1
    return [{"role": m["role"], "content": m["content"]} for m in messages[:end]]


@pytest.mark.parametrize("pad_multiple, template", [(1, None), (4, None), (1, CONTENT_ONLY)])
def test_no_row_overflows_the_upstream_reader_and_nothing_is_lost(chat_file, tok, tmp_path, pad_multiple, template):
    ds = PrepackedDataset(
        prepack(
            chat_file, tmp_path / "p", tokenizer=tok, max_seq_len=WIDTH, pad_multiple=pad_multiple, overlong="drop"
        ).path
    )
    source = {c.id: c.messages for c in read_conversations(chat_file, on_bad_row="skip")}
    assert not any(m[0]["role"] == "system" for m in source.values())  # every one gets the system prompt
    dst = tmp_path / "train.jsonl.packed"
    counts = export_packed_jsonl(ds, dst, tokenizer=tok, chat_template=template)
    lines = [json.loads(x)["messages"] for x in dst.read_text().splitlines()]
    assert len(lines) == counts["rows"]
    sizes = [_upstream_row_tokens(tok, msgs, pad_multiple, template) for msgs in lines]
    assert max(sizes) <= WIDTH, f"{sum(s > WIDTH for s in sizes)} of {len(lines)} rows overflow"
    # nothing lost: every conversation of the prepack is written once, whole (bar untrained trailing
    # turns), except those the system prompt makes longer than a row: left out (a drop prepack), counted
    ids = {ds.conversation_id(int(c)) for c in ds.sequences["conversation"]}
    sys_msg = {"role": "system", "content": "You are a helpful assistant."}
    too_long = {i for i in ids if _count(tok, [sys_msg, *_trimmed(source[i])], template) > WIDTH}
    assert counts["over_length_dropped"] == len(too_long) and counts["over_length_written_whole"] == 0
    want = sorted(json.dumps(_trimmed(source[i])) for i in ids - too_long)
    got = sorted(json.dumps(conv[1:]) for msgs in lines for conv in _split(msgs))  # less the added system prompt
    assert got == want and counts["conversations"] == len(want)
    assert all(
        conv[0] == {"role": "system", "content": "You are a helpful assistant."}
        for msgs in lines
        for conv in _split(msgs)
    )
    # the bug this guards: the prepack's own rows, with the system prompts added after packing
    old = []
    for r in range(ds.num_rows):
        row = []
        for c in ds.row_sequences(r)["conversation"]:
            row += [
                {"role": "system", "content": "You are a helpful assistant."},
                *_trimmed(source[ds.conversation_id(int(c))]),
            ]
        old.append(_upstream_row_tokens(tok, row, pad_multiple, template))
    if template is None:
        assert sum(s > WIDTH for s in old) > 0


def test_over_length_conversations_follow_the_overlong_policy(chat_file, tok, tmp_path):
    ds = PrepackedDataset(
        prepack(chat_file, tmp_path / "p", tokenizer=tok, max_seq_len=WIDTH, overlong="truncate").path
    )
    dst = tmp_path / "t.jsonl.packed"
    counts = export_packed_jsonl(ds, dst, tokenizer=tok)  # the prepack's policy: truncate
    lines = [json.loads(x)["messages"] for x in dst.read_text().splitlines()]
    sizes = np.array([_upstream_row_tokens(tok, m, 1) for m in lines])
    n_conv = np.array([len(_split(m)) for m in lines])
    assert counts["over_length_written_whole"] == int(np.count_nonzero(sizes > WIDTH)) > 0
    assert np.all(n_conv[sizes > WIDTH] == 1)  # an over-long one never takes another conversation down with it
    assert counts["conversations"] == ds.manifest["counts"]["sequences"]
    dropped = export_packed_jsonl(ds, tmp_path / "d.jsonl.packed", tokenizer=tok, overlong="drop")
    assert dropped["over_length_dropped"] == counts["over_length_written_whole"]
    assert dropped["conversations"] == counts["conversations"] - dropped["over_length_dropped"]
    with pytest.raises(ValueError, match=r"conversation .* tokens as written .* more than the row width 1024"):
        export_packed_jsonl(ds, tmp_path / "e.jsonl.packed", tokenizer=tok, overlong="error")
    assert not (tmp_path / "e.jsonl.packed").exists()


def test_export_needs_a_tokenizer_to_count(chat_file, tok, tmp_path):
    ds = prepack(chat_file, tmp_path / "p", tokenizer=tok, max_seq_len=WIDTH, overlong="drop").path
    with pytest.raises(ValueError, match="pass tokenizer="):
        export_packed_jsonl(ds, tmp_path / "x.jsonl.packed")
    assert not (tmp_path / "x.jsonl.packed").exists()
