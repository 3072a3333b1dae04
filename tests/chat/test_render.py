"""sftpack.chat._render: chat templates, trainable spans (fast path == prefix-diff reference), masks token by token.

Unit tests run on the tiny offline tokenizers of ``sftpack.testing`` (byte-level
BPE, ChatML / Llama-3 / Mistral templates, each with and without
``{% generation %}`` markers); ``test_default_data.py`` covers the real Qwen one.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack.chat import (
    ChatRenderer,
    TemplateError,
    mask_from_offsets,
    renderer_for,
    tokenize_conversation,
)
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import (
    EOT,
    HAND,
    STYLES,
    A,
    S,
    U,
    conversations,
    show,
    tok_of,
    trainable_runs,
)

# ---------------------------------------------------------------------------- masks, token by token


def test_chatml_mask_token_by_token() -> None:
    tok = tok_of("chatml")
    s = tokenize_conversation([U("hi"), A("yo")], tok, conversation_id="c0")
    got = [(tok.decode([t]), bool(m)) for t, m in zip(s.input_ids.tolist(), s.loss_mask.tolist())]
    expected = (
        [
            ("<|im_start|>", False),
            ("u", False),
            ("s", False),
            ("e", False),
            ("r", False),
            ("\n", False),
        ]
        + [("h", False), ("i", False), ("<|im_end|>", False), ("\n", False)]
        + [
            ("<|im_start|>", False),
            ("ass", False),
            ("ist", False),
            ("ant", False),
            ("\n", False),
        ]
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
            (
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello you<|im_end|>\n"
                "<|im_start|>assistant\n⟦the thing<|im_end|>⟧\n<|im_start|>user\nand?<|im_end|>\n"
                "<|im_start|>assistant\n⟦fine, thanks<|im_end|>⟧\n"
            ),
        ),
        (
            "llama3",
            (
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nhello you<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n⟦the thing<|eot_id|>⟧"
                "<|start_header_id|>user<|end_header_id|>\n\nand?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n⟦fine, thanks<|eot_id|>⟧"
            ),
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
    """Whitespace around contents: the end-of-turn token stays trainable; a leading newline
    that merges with the header's newline into one token counts as header. (A content of
    only whitespace is a bad row: ``test_tokenize.py``.)"""
    tok = tok_of(style)
    s = tokenize_conversation([U("hi"), A(" ."), U("x"), A("\nyes"), U("y"), A("ok ")], tok)
    runs = trainable_runs(tok, s)
    if style == "chatml":
        # "assistant\n" + "\nyes": the BPE token "\n\n" starts in the header -> not trainable
        assert runs == [" .<|im_end|>", "yes<|im_end|>", "ok <|im_end|>"]
    elif style == "llama3":  # the template trims contents
        assert runs == [".<|eot_id|>", "yes<|eot_id|>", "ok<|eot_id|>"]
    else:
        assert runs == [" .</s>", "\nyes</s>", "ok </s>"]


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


# ---------------------------------------------------------------------------- property: fast == reference


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    conversations(),
    st.sampled_from(STYLES),
    st.sampled_from(["all_assistant", "last_assistant"]),
)
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
