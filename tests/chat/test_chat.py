"""sftpack.chat: readers and bad rows, rendering and loss masks, over-long policies, batches.

Unit tests run on the tiny offline tokenizers of ``sftpack.testing`` (byte-level
BPE, ChatML / Llama-3 / Mistral templates, each with and without
``{% generation %}`` markers); ``tests/test_data.py`` covers the real Qwen one.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack import Sample
from sftpack.chat import (
    BadRowError,
    BadRowReason,
    ChatRenderer,
    Conversation,
    OverlongError,
    TemplateError,
    encode_conversation,
    mask_from_offsets,
    read_conversations,
    renderer_for,
    tokenize_conversation,
    tokenize_conversations,
    validate_messages,
)
from sftpack.testing import CHAT_STYLES, CharTokenizer, tiny_chat_tokenizer

STYLES = sorted(CHAT_STYLES)
EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}

_TOKS: dict[tuple[str, bool], Any] = {}


def tok_of(style: str, generation: bool = False) -> Any:
    if (style, generation) not in _TOKS:
        _TOKS[(style, generation)] = tiny_chat_tokenizer(style, generation=generation)
    return _TOKS[(style, generation)]


def U(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def A(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def S(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def show(tok: Any, sample: Sample) -> str:
    """The sample's text, each trainable run of tokens wrapped in ⟦ ⟧."""
    out, open_ = [], False
    for tid, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist()):
        if m and not open_:
            out.append("⟦")
        if not m and open_:
            out.append("⟧")
        open_ = m
        out.append(tok.decode([tid]))
    if open_:
        out.append("⟧")
    return "".join(out)


def trainable_runs(tok: Any, sample: Sample) -> list[str]:
    """Decoded text of each maximal run of trainable tokens (decoded together, so
    multi-byte characters split over tokens come back whole)."""
    runs, cur = [], []
    for tid, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist()):
        if m:
            cur.append(tid)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


# ---------------------------------------------------------------------------- masks, token by token


def test_chatml_mask_token_by_token() -> None:
    tok = tok_of("chatml")
    s = tokenize_conversation([U("hi"), A("yo")], tok, conversation_id="c0")
    got = [(tok.decode([t]), bool(m)) for t, m in zip(s.input_ids.tolist(), s.loss_mask.tolist())]
    expected = (
        [("<|im_start|>", False), ("u", False), ("s", False), ("e", False), ("r", False), ("\n", False)]
        + [("h", False), ("i", False), ("<|im_end|>", False), ("\n", False)]
        + [("<|im_start|>", False), ("ass", False), ("ist", False), ("ant", False), ("\n", False)]
        + [("y", True), ("o", True), ("<|im_end|>", True), ("\n", False)]
    )
    assert got == expected
    assert s.conversation_id == "c0" and s.input_ids.dtype == np.int64 and s.loss_mask.dtype == bool


MULTI = [S("Be brief."), U("hello you"), A("the thing"), U("and?"), A("fine, thanks")]


@pytest.mark.parametrize(
    ("style", "expected"),
    [
        (
            "chatml",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello you<|im_end|>\n"
            "<|im_start|>assistant\n⟦the thing<|im_end|>⟧\n<|im_start|>user\nand?<|im_end|>\n"
            "<|im_start|>assistant\n⟦fine, thanks<|im_end|>⟧\n",
        ),
        (
            "llama3",
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nhello you<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n⟦the thing<|eot_id|>⟧"
            "<|start_header_id|>user<|end_header_id|>\n\nand?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n⟦fine, thanks<|eot_id|>⟧",
        ),
        (
            "mistral",
            "<s>[INST] Be brief.\n\nhello you [/INST]⟦the thing</s>⟧[INST] and? [/INST]⟦fine, thanks</s>⟧",
        ),
    ],
)
@pytest.mark.parametrize("generation", [False, True], ids=["no-markers", "generation-markers"])
def test_multi_turn_with_system_prompt(style: str, expected: str, generation: bool) -> None:
    tok = tok_of(style, generation)
    assert show(tok, tokenize_conversation(MULTI, tok)) == expected


# Conversations whose trainable text is known exactly: (messages, runs per style).
HAND = {
    "unicode and emoji": (
        [U("¿qué tal? 你好"), A("très bien 😀👍🏽 — 谢谢"), U("ok"), A("🎉")],
        ["très bien 😀👍🏽 — 谢谢", "🎉"],
    ),
    "multi-line and code": (
        [U("code?"), A("def f(x):\n    return x\n\n# done"), U("thanks")],
        ["def f(x):\n    return x\n\n# done"],
    ),
    "one-character turns": ([U("?"), A("."), U("!"), A("a")], [".", "a"]),
    "template-like text inside": ([U("say [INST]"), A("<im_start> is not special")], ["<im_start> is not special"]),
}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("generation", [False, True], ids=["no-markers", "generation-markers"])
@pytest.mark.parametrize("case", sorted(HAND))
def test_trainable_text_is_assistant_content_plus_end_of_turn(style: str, generation: bool, case: str) -> None:
    messages, contents = HAND[case]
    if style == "mistral" and messages[-1]["role"] == "user":
        messages = messages[:-1]  # fine for Mistral too; kept for symmetry
    tok = tok_of(style, generation)
    s = tokenize_conversation(messages, tok)
    assert trainable_runs(tok, s) == [c + EOT[style] for c in contents]
    # Only the last assistant turn:
    last = tokenize_conversation(messages, tok, train_on="last_assistant")
    assert trainable_runs(tok, last) == [contents[-1] + EOT[style]]
    assert np.array_equal(last.input_ids, s.input_ids)
    # Everything:
    every = tokenize_conversation(messages, tok, train_on="everything")
    assert every.loss_mask.all() and np.array_equal(every.input_ids, s.input_ids)


@pytest.mark.parametrize("style", STYLES)
def test_empty_ish_turns(style: str) -> None:
    """Whitespace contents: the end-of-turn token stays trainable; a leading newline
    that merges with the header's newline into one token counts as header."""
    tok = tok_of(style)
    s = tokenize_conversation([U("hi"), A(" "), U("x"), A("\nyes"), U("y"), A("ok ")], tok)
    runs = trainable_runs(tok, s)
    if style == "chatml":
        # "assistant\n" + "\nyes": the BPE token "\n\n" starts in the header -> not trainable
        assert runs == [" <|im_end|>", "yes<|im_end|>", "ok <|im_end|>"]
    elif style == "llama3":  # the template trims contents
        assert runs == ["<|eot_id|>", "yes<|eot_id|>", "ok<|eot_id|>"]
    else:
        assert runs == [" </s>", "\nyes</s>", "ok </s>"]


def test_generation_markers_agree_with_prefix_diff_and_fast_path() -> None:
    for style in STYLES:
        for _, (messages, _) in sorted(HAND.items()):
            plain = tokenize_conversation(messages, tok_of(style))
            marked = tokenize_conversation(messages, tok_of(style, True))
            r = renderer_for(tok_of(style))
            text, spans = r.spans(messages)
            assert (text, spans) == r.prefix_diff_spans(messages)
            assert np.array_equal(plain.input_ids, marked.input_ids)
            assert np.array_equal(plain.loss_mask, marked.loss_mask), style


def test_fast_path_is_used_and_falls_back() -> None:
    tok = tiny_chat_tokenizer("llama3")  # a fresh renderer, fresh counters
    r = renderer_for(tok)
    tokenize_conversation([U("hi"), A("yo")], tok)
    assert (r.fast_renders, r.slow_renders) == (1, 0)
    # The template trims contents: "  yo" is not inserted verbatim -> the reference method.
    s = tokenize_conversation([U("hi"), A("  yo")], tok)
    assert (r.fast_renders, r.slow_renders) == (1, 1)
    assert trainable_runs(tok, s) == ["yo<|eot_id|>"]


def test_rendering_matches_apply_chat_template() -> None:
    for style in STYLES:
        for generation in (False, True):
            tok = tok_of(style, generation)
            r = renderer_for(tok)
            for messages, _ in HAND.values():
                assert r.render(messages) == tok.apply_chat_template(messages, tokenize=False)
                if style != "mistral":
                    assert r.render(messages, True) == tok.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=True
                    )


def test_template_that_rewrites_history_is_refused_with_advice() -> None:
    # Shows the system prompt before the *last* user turn (as some Mistral templates do).
    template = (
        "{% for m in messages %}{% if m.role == 'user' %}"
        "{% if loop.last or loop.index0 == messages|length - 2 %}[SYS]{% endif %}[U]{{ m.content }}"
        "{% elif m.role == 'assistant' %}[A]{{ m.content }}</s>{% endif %}{% endfor %}"
    )
    r = ChatRenderer(template, special_tokens=["</s>"])
    with pytest.raises(TemplateError, match="generation"):
        r.spans([U("a"), A("b"), U("c"), A("d")])


def test_tokenizer_errors_are_clear() -> None:
    with pytest.raises(TypeError, match="fast"):
        tokenize_conversation([U("a"), A("b")], CharTokenizer())
    tok = tiny_chat_tokenizer("chatml")
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        tokenize_conversation([U("a"), A("b")], tok)
    with pytest.raises(ValueError, match="'all_assistant', 'last_assistant', 'everything'"):
        tokenize_conversation([U("a"), A("b")], tok_of("chatml"), train_on="assistant")
    with pytest.raises(ValueError, match="encode_conversation"):
        tokenize_conversation([U("a"), A("b")], tok_of("chatml"), overlong="split")
    with pytest.raises(ValueError, match="max_seq_len"):
        tokenize_conversation([U("a"), A("b")], tok_of("chatml"), max_seq_len=0)


# ---------------------------------------------------------------------------- property: fast == reference

_TEXT = st.text(alphabet=st.sampled_from(list("ab yo\n\t.!😀é你")), min_size=1, max_size=12).filter(lambda t: t.strip())


@st.composite
def conversations(draw: Any) -> list[dict[str, str]]:
    n = draw(st.integers(1, 4))
    msgs = [S(draw(_TEXT))] if draw(st.booleans()) else []
    for _ in range(n):
        msgs += [U(draw(_TEXT)), A(draw(_TEXT))]
    if draw(st.booleans()):
        msgs.append(U(draw(_TEXT)))
    return msgs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.sampled_from(STYLES), st.sampled_from(["all_assistant", "last_assistant"]))
def test_fast_masks_equal_reference(messages: list[dict[str, str]], style: str, train_on: str) -> None:
    tok = tok_of(style)
    r = renderer_for(tok)
    text, spans = r.spans(messages, train_on)
    assert (text, spans) == r.prefix_diff_spans(messages, train_on)
    s = tokenize_conversation(messages, tok, train_on=train_on)
    enc = tok.backend_tokenizer.encode(text, add_special_tokens=False)
    assert s.input_ids.tolist() == enc.ids
    assert np.array_equal(s.loss_mask, mask_from_offsets(enc.offsets, spans))
    marked = tokenize_conversation(messages, tok_of(style, True), train_on=train_on)
    assert np.array_equal(marked.loss_mask, s.loss_mask)


# ---------------------------------------------------------------------------- over-long policies

CONVO = [U("hello you"), A("the thing is long enough"), U("and?"), A("yes")]


@pytest.fixture(scope="module")
def full() -> Sample:
    return tokenize_conversation(CONVO, tok_of("chatml"))


@pytest.mark.parametrize("delta", [0, 1])
@pytest.mark.parametrize("policy", ["truncate", "drop", "split", "error"])
def test_overlong_at_and_above_length_keeps_the_whole(full: Sample, delta: int, policy: str) -> None:
    enc = encode_conversation(CONVO, tok_of("chatml"), max_seq_len=len(full) + delta, overlong=policy)
    assert enc.outcome == "fit" and enc.tokens_lost == 0 and len(enc.samples) == 1
    assert np.array_equal(enc.samples[0].input_ids, full.input_ids)
    assert np.array_equal(enc.samples[0].loss_mask, full.loss_mask)


def test_overlong_one_below(full: Sample) -> None:
    tok, n = tok_of("chatml"), len(full)
    last_trainable = int(full.loss_mask[-1])
    t = encode_conversation(CONVO, tok, max_seq_len=n - 1, overlong="truncate")
    assert t.outcome == "truncated" and (t.tokens_lost, t.trainable_lost) == (1, last_trainable)
    assert np.array_equal(t.samples[0].input_ids, full.input_ids[:-1])
    assert np.array_equal(t.samples[0].loss_mask, full.loss_mask[:-1])
    assert t.samples[0].meta == {"truncated_from": n}
    assert tokenize_conversation(CONVO, tok, max_seq_len=n - 1).input_ids.tolist() == full.input_ids[:-1].tolist()

    d = encode_conversation(CONVO, tok, max_seq_len=n - 1, overlong="drop")
    assert d.outcome == "dropped" and d.samples == [] and d.tokens_lost == n
    assert d.trainable_lost == full.num_trainable

    sp = encode_conversation(CONVO, tok, max_seq_len=n - 1, overlong="split")
    assert sp.outcome == "split" and sp.tokens_lost == 0
    assert [len(p) for p in sp.samples] == [n - 1, 1]
    assert [p.meta for p in sp.samples] == [{"piece": 0, "pieces": 2}, {"piece": 1, "pieces": 2}]
    assert np.concatenate([p.input_ids for p in sp.samples]).tolist() == full.input_ids.tolist()
    assert np.concatenate([p.loss_mask for p in sp.samples]).tolist() == full.loss_mask.tolist()

    with pytest.raises(OverlongError, match=rf"{n} tokens > max_seq_len={n - 1}.*'truncate'.*'split'"):
        tokenize_conversation(CONVO, tok, max_seq_len=n - 1, overlong="error", conversation_id="c7")


def test_split_pieces_of_at_most_max(full: Sample) -> None:
    sp = encode_conversation(CONVO, tok_of("chatml"), max_seq_len=7, overlong="split")
    lengths = [len(p) for p in sp.samples]
    assert all(x <= 7 for x in lengths) and sum(lengths) == len(full) and lengths[:-1] == [7] * (len(lengths) - 1)


def test_batch_stats_account_for_every_outcome(full: Sample) -> None:
    tok, n = tok_of("chatml"), len(full)
    short = [U("a"), A("b")]
    n_short = len(tokenize_conversation(short, tok))
    convs = [CONVO, short, CONVO, short]
    for policy, samples, outcome in [("truncate", 4, "truncated"), ("drop", 2, "dropped"), ("split", 6, "split")]:
        out = tokenize_conversations(convs, tok, max_seq_len=n - 1, overlong=policy, progress=False)
        got = out.to_list()
        st_ = out.stats
        assert len(got) == st_.samples == samples
        assert st_.conversations == 4 == st_.fit + st_.truncated + st_.dropped + st_.split
        assert (st_.fit, getattr(st_, outcome)) == (2, 2)
        assert st_.tokens + st_.tokens_lost == 2 * n + 2 * n_short
        assert st_.tokens == sum(len(s) for s in got)
    with pytest.raises(OverlongError):
        list(tokenize_conversations(convs, tok, max_seq_len=n - 1, overlong="error", progress=False))


# ---------------------------------------------------------------------------- batches


def _many() -> list[Any]:
    out: list[Any] = []
    for i in range(40):
        msgs = [U(f"q{i} " + "you " * (i % 5)), A("the " * (1 + i % 7) + f"a{i}")]
        out.append(Conversation(f"conv-{i}", msgs) if i % 2 else {"id": f"d{i}", "messages": msgs})
    return out


def test_batch_equals_one_by_one_and_keeps_ids() -> None:
    tok = tok_of("llama3")
    convs = _many()
    batch = tokenize_conversations(convs, tok, batch_size=7, progress=False).to_list()
    assert [s.conversation_id for s in batch] == [c.id if isinstance(c, Conversation) else c["id"] for c in convs]
    for s, c in zip(batch, convs):
        one = tokenize_conversation(c, tok)
        assert np.array_equal(s.input_ids, one.input_ids) and np.array_equal(s.loss_mask, one.loss_mask)
    plain = tokenize_conversations([c["messages"] for c in convs], tok, progress=False).to_list()
    assert [s.conversation_id for s in plain] == list(range(len(convs)))


def test_two_processes_give_the_same_output_in_the_same_order() -> None:
    tok = tok_of("chatml")
    convs = _many()
    one = tokenize_conversations(convs, tok, batch_size=3, max_seq_len=12, overlong="split", progress=False)
    two = tokenize_conversations(convs, tok, batch_size=3, max_seq_len=12, overlong="split", num_proc=2, progress=False)
    a, b = one.to_list(), two.to_list()
    assert [s.conversation_id for s in a] == [s.conversation_id for s in b]
    assert all(
        np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask) for x, y in zip(a, b)
    )
    assert one.stats == two.stats and one.stats.split > 0


def test_worker_errors_reach_the_caller() -> None:
    convs = _many()
    with pytest.raises(OverlongError, match="max_seq_len=5"):
        list(
            tokenize_conversations(convs, tok_of("chatml"), max_seq_len=5, overlong="error", num_proc=2, progress=False)
        )


def test_batch_options_validated_up_front() -> None:
    with pytest.raises(ValueError, match="'truncate', 'drop', 'split', 'error'"):
        tokenize_conversations([], tok_of("chatml"), overlong="cut")
    with pytest.raises(ValueError, match="num_proc"):
        tokenize_conversations([], tok_of("chatml"), num_proc=0)


# ---------------------------------------------------------------------------- readers

GOOD = {"messages": [U("hi"), A("hello")]}

# Every bad-row kind: (reason, the raw line, a phrase of the message)
BAD_LINES = {
    BadRowReason.INVALID_JSON: ('{"messages": [', "invalid JSON"),
    BadRowReason.NOT_AN_OBJECT: ('["just", "a", "list"]', "not an object"),
    BadRowReason.MISSING_MESSAGES: ('{"text": "hello"}', "no 'messages' field"),
    BadRowReason.EMPTY_MESSAGES: ('{"messages": []}', "'messages' is empty"),
    BadRowReason.MALFORMED_MESSAGE: ('{"messages": ["hi"]}', "message 0 is a str"),
    BadRowReason.UNKNOWN_ROLE: (json.dumps({"messages": [U("a"), {"role": "bot", "content": "b"}]}), "role 'bot'"),
    BadRowReason.NON_STRING_CONTENT: (
        json.dumps({"messages": [U("a"), {"role": "assistant", "content": None}]}),
        "null content",
    ),
    BadRowReason.EMPTY_CONTENT: (json.dumps({"messages": [U("a"), A("  ")]}), "empty content"),
    BadRowReason.NO_ASSISTANT_TURN: (json.dumps({"messages": [U("a"), U("b")]}), "none of the 2 messages"),
}


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("reason", list(BAD_LINES), ids=lambda r: r.value)
def test_bad_row_error_mode_names_file_line_problem_and_fix(tmp_path: Path, reason: BadRowReason) -> None:
    raw, phrase = BAD_LINES[reason]
    path = _write_jsonl(tmp_path / "chat.jsonl", [json.dumps(GOOD), "", raw, json.dumps(GOOD)])
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
    assert reader.stats.as_dict() == {"read": 2, "kept": 1, "dropped": {reason.value: 1}}


@pytest.mark.parametrize("reason", list(BAD_LINES), ids=lambda r: r.value)
def test_bad_row_skip_mode_counts_it(tmp_path: Path, reason: BadRowReason) -> None:
    raw, _ = BAD_LINES[reason]
    path = _write_jsonl(tmp_path / "chat.jsonl", [json.dumps(GOOD), raw, "   ", json.dumps(GOOD)])
    reader = read_conversations(path, on_bad_row="skip")
    assert [c.id for c in reader] == [f"{path}:1", f"{path}:4"]
    assert reader.stats.as_dict() == {"read": 3, "kept": 2, "dropped": {reason.value: 1}}
    assert reader.stats["read"] == reader.stats["kept"] + sum(reader.stats["dropped"].values())


def test_invalid_utf8_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
    reader = read_conversations(path, on_bad_row="skip")
    assert len(list(reader)) == 1 and reader.stats.dropped == {"invalid_json": 1}


@st.composite
def row_mixes(draw: Any) -> list[BadRowReason | None]:
    return draw(st.lists(st.sampled_from([None, *BAD_LINES]), max_size=40))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row_mixes())
def test_accounting_identity_on_random_mixes(tmp_path: Path, kinds: list[BadRowReason | None]) -> None:
    lines = [
        json.dumps({"messages": [U(f"q{i}"), A(f"a{i}")]}) if k is None else BAD_LINES[k][0]
        for i, k in enumerate(kinds)
    ]
    path = _write_jsonl(tmp_path / "mix.jsonl", lines)
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


def test_sharegpt_and_role_map(tmp_path: Path) -> None:
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        },
        {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a", "name": None}]},
    ]
    path = _write_jsonl(tmp_path / "sg.jsonl", [json.dumps(r) for r in rows])
    convs = list(read_conversations(path, role_map={"bot": "assistant"}))
    assert convs[0].messages == [S("s"), U("q"), A("a")]
    assert convs[1].messages == [U("q"), A("a")]  # null-valued keys dropped, as transformers does
    with pytest.raises(BadRowError, match=r"role_map=\{'bot': 'assistant'\}"):
        list(read_conversations(path))
    with pytest.raises(ValueError, match="unknown roles"):
        read_conversations(path, role_map={"bot": "robot"})


def test_parquet_streams_batches_and_names_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [U(f"q{i}"), A(f"a{i}")], "extra": i} for i in range(25)]
    rows[7] = {"messages": [U("q7"), {"role": "assistant", "content": None}], "extra": 7}
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10)
    reader = read_conversations(path, on_bad_row="skip", batch_size=4)
    convs = list(reader)
    assert len(convs) == 24 and convs[7].id == f"{path}[8]" and convs[0].messages == [U("q0"), A("a0")]
    assert reader.stats.as_dict() == {"read": 25, "kept": 24, "dropped": {"non_string_content": 1}}
    with pytest.raises(BadRowError, match=r"row 7: message 1 \(assistant\) has a null content"):
        list(read_conversations(path, batch_size=4))
    # No usable column: every row is counted
    other = tmp_path / "other.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "x"}] * 3), other)
    r2 = read_conversations(other, on_bad_row="skip")
    assert list(r2) == [] and r2.stats.as_dict() == {"read": 3, "kept": 0, "dropped": {"missing_messages": 3}}
    with pytest.raises(BadRowError, match="row 0: no 'messages' or 'conversations' column"):
        list(read_conversations(other))


def test_hf_datasets_saved_and_in_memory(tmp_path: Path) -> None:
    import datasets

    rows = [{"messages": [U(f"q{i}"), A(f"a{i}")]} for i in range(5)] + [{"messages": [U("x")]}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    reader = read_conversations(tmp_path / "saved", on_bad_row="skip", batch_size=2)
    convs = list(reader)
    assert [c.id for c in convs] == [f"{tmp_path / 'saved'}[{i}]" for i in range(5)]
    assert reader.stats.as_dict() == {"read": 6, "kept": 5, "dropped": {"no_assistant_turn": 1}}
    assert [c.messages for c in read_conversations(ds, on_bad_row="skip")] == [c.messages for c in convs]
    streamed = read_conversations(ds.to_iterable_dataset(), on_bad_row="skip")
    assert [c.messages for c in streamed] == [c.messages for c in convs] and streamed.stats.read == 6
    dd = datasets.DatasetDict({"train": ds, "test": ds})
    with pytest.raises(ValueError, match="split="):
        read_conversations(dd)
    assert len(list(read_conversations(dd, on_bad_row="skip", split="test"))) == 5


def test_sources_gz_glob_directory_and_refusals(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "a.jsonl", [json.dumps(GOOD)])
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
    (tmp_path / "arr.json").write_text(json.dumps([GOOD]))  # one line: a row that is not an object
    with pytest.raises(BadRowError, match="jq -c"):
        list(read_conversations(tmp_path / "arr.json"))
    (tmp_path / "arr2.json").write_text(json.dumps([GOOD], indent=2))  # indented: the file is refused
    with pytest.raises(ValueError, match="looks like one JSON array.*jq -c"):
        list(read_conversations(tmp_path / "arr2.json", on_bad_row="skip"))
    with pytest.raises(FileNotFoundError):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format"):
        read_conversations(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="'error', 'skip'"):
        read_conversations(tmp_path / "a.jsonl", on_bad_row="ignore")


def test_read_then_tokenize(tmp_path: Path) -> None:
    lines = [json.dumps({"messages": [U("q"), A("the answer")]}), "oops", json.dumps(GOOD)]
    reader = read_conversations(_write_jsonl(tmp_path / "c.jsonl", lines), on_bad_row="skip")
    out = tokenize_conversations(reader, tok_of("chatml"), progress=False)
    samples = out.to_list()
    assert [s.conversation_id for s in samples] == [f"{tmp_path / 'c.jsonl'}:1", f"{tmp_path / 'c.jsonl'}:3"]
    assert trainable_runs(tok_of("chatml"), samples[0]) == ["the answer<|im_end|>"]
    assert reader.stats.dropped == {"invalid_json": 1} and out.stats.conversations == 2


def test_conversation_reads_like_a_mapping() -> None:
    c = Conversation("f.jsonl:3", [U("a"), A("b")])
    assert dict(c) == {"id": "f.jsonl:3", "messages": [U("a"), A("b")]}
    assert "messages" in c and c.get("text") is None and c["conversation_id"] == "f.jsonl:3"


def test_validate_messages_message() -> None:
    with pytest.raises(ValueError, match=r"message 1 \(assistant\) has an empty content \[empty_content\]"):
        validate_messages([U("a"), A("")])


def test_pipelined_batches_and_binary_search_give_the_same_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small batches (encoded in the helper thread while the next renders) and the
    binary search used for long encodings agree with one plain batch."""
    import sftpack.chat._tokenize as impl

    tok = tok_of("chatml")
    convs = [c for c, _ in HAND.values()] * 5 + [c["messages"] if isinstance(c, dict) else c.messages for c in _many()]
    base = impl._encode_many(list(enumerate(convs)), tok, impl._options("all_assistant", None, "truncate"))
    monkeypatch.setattr(impl, "_SCAN_LIMIT", 0)
    other = tokenize_conversations(convs, tok, batch_size=3, progress=False).to_list()
    assert len(base) == len(other) == len(convs)
    for a, b in zip(base, other):
        (s,) = a.samples
        assert s.conversation_id == b.conversation_id
        assert np.array_equal(s.input_ids, b.input_ids) and np.array_equal(s.loss_mask, b.loss_mask)


@settings(max_examples=40, deadline=None)
@given(conversations(), st.sampled_from(STYLES))
def test_binary_search_edges_equal_offsets_reference(messages: list[dict[str, str]], style: str) -> None:
    import sftpack.chat._tokenize as impl

    tok = tok_of(style)
    text, spans = renderer_for(tok).spans(messages)
    enc = tok.backend_tokenizer.encode(text, add_special_tokens=False)
    n = len(enc.ids)
    expected = mask_from_offsets(enc.offsets, spans)
    assert np.array_equal(impl._mask_from_encoding(enc, spans, n, len(text)), expected)
    saved = impl._SCAN_LIMIT
    impl._SCAN_LIMIT = 0
    try:
        assert np.array_equal(impl._mask_from_encoding(enc, spans, n, len(text)), expected)
    finally:
        impl._SCAN_LIMIT = saved


def test_progress_option_and_stats_reset_per_pass() -> None:
    tok = tok_of("chatml")
    out = tokenize_conversations([[U("a"), A("b")]] * 3, tok, progress=True)
    assert len(out.to_list()) == 3 and len(out.to_list()) == 3 and out.stats.conversations == 3


def test_streaming_keeps_memory_bounded(tmp_path: Path) -> None:
    """Reading never holds the file: peak traced memory stays a small fraction of its size."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [U(f"question {i} " + "x" * 400), A(f"answer {i} " + "y" * 600)]} for i in range(3000)]
    jsonl = _write_jsonl(tmp_path / "big.jsonl", [json.dumps(r) for r in rows])
    parquet = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=500)
    size = jsonl.stat().st_size  # about 3 MB
    for path in (jsonl, parquet):
        tracemalloc.start()
        n = sum(1 for _ in read_conversations(path, batch_size=256))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert n == 3000 and peak < size / 4, (path.name, peak, size)
