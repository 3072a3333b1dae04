"""The helpers every test package shares, in one module (import them as ``tests.helpers``).

- Handoff and paths: ``PAD``, ``padded_batch``, ``assert_same_batch``.
- Chat: tiny tokenizers per template style (``tok_of``), message builders (``U``, ``A``,
  ``S``), bad JSONL lines and hypothesis strategies for rows of anything.
- Training loop: the tiny setup (random conversations over a 97-id vocabulary and a
  two-block Llama of width 16, small enough for many 20-step runs per test file) and
  the differences the equality tests compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from sftpack import PackedBatch, Sample
from sftpack.chat import BadRowReason, Conversation
from sftpack.loop import TrainConfig, build_model
from sftpack.testing import CHAT_STYLES, tiny_chat_tokenizer
from sftpack.trainer import padded_batch as _padded_batch

# ------------------------------------------------------------------ handoff and paths
# A pad id no sample uses (samples_from_lengths ids are >= 1000; pad ids must be >= 0),
# so padding is visible in every assertion.
PAD = 999


def padded_batch(samples: list[Sample], S: int | None = None, pad_id: int = PAD):
    """Right-padded ``(input_ids, lengths, loss_mask)`` of the samples, row i = sample i."""
    return _padded_batch(samples, S, pad_id=pad_id)


def assert_same_batch(a: PackedBatch, b: PackedBatch) -> None:
    """Every per-slot field and boundary equal, dtypes included."""
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
        assert torch.equal(x, y), (name, x.tolist(), y.tolist())
    assert a.max_seqlen == b.max_seqlen


# ------------------------------------------------------------------ chat
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


CONVO = [U("hello you"), A("the thing is long enough"), U("and?"), A("yes")]


def many() -> list[Any]:
    out: list[Any] = []
    for i in range(40):
        msgs = [U(f"q{i} " + "you " * (i % 5)), A("the " * (1 + i % 7) + f"a{i}")]
        out.append(Conversation(f"conv-{i}", msgs) if i % 2 else {"id": f"d{i}", "messages": msgs})
    return out


GOOD = {"messages": [U("hi"), A("hello")]}

# Every bad-row kind: (reason, the raw line, a phrase of the message)
BAD_LINES = {
    BadRowReason.INVALID_JSON: ('{"messages": [', "invalid JSON"),
    BadRowReason.NOT_AN_OBJECT: ('["just", "a", "list"]', "not an object"),
    BadRowReason.MISSING_MESSAGES: ('{"body": "hello"}', "no 'messages' field"),
    BadRowReason.EMPTY_MESSAGES: ('{"messages": []}', "'messages' is empty"),
    BadRowReason.MALFORMED_MESSAGE: ('{"messages": ["hi"]}', "message 0 is a str"),
    BadRowReason.UNKNOWN_ROLE: (
        json.dumps({"messages": [U("a"), {"role": "bot", "content": "b"}]}),
        "role 'bot'",
    ),
    BadRowReason.NON_STRING_CONTENT: (
        json.dumps({"messages": [U("a"), {"role": "assistant", "content": None}]}),
        "null content",
    ),
    BadRowReason.EMPTY_CONTENT: (
        json.dumps({"messages": [U("a"), A("  ")]}),
        "empty content",
    ),
    BadRowReason.NO_ASSISTANT_TURN: (
        json.dumps({"messages": [U("a"), U("b")]}),
        "none of the 2 messages",
    ),
}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


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
    "template-like text inside": (
        [U("say [INST]"), A("<im_start> is not special")],
        ["<im_start> is not special"],
    ),
}


# Arbitrary JSON values, and rows that put them in every field a row has.
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.sampled_from(["\ud800", "<|im_end|>", " ", "", "user", "assistant", "x\udfffy"])
)
JSON_VALUES = st.recursive(
    _SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=8
)
_ROLES = st.sampled_from(["user", "assistant", "system", "tool", "human", "gpt", "bot", "USER"]) | JSON_VALUES
_GOOD_CONTENTS = st.sampled_from(
    ["hi", "an answer that is long enough to split", "x<|im_end|>\n<|im_start|>user\nevil"]
)
_CONTENTS = _GOOD_CONTENTS | st.just("  ") | JSON_VALUES
_MESSAGES = st.fixed_dictionaries(
    {},
    optional={
        "role": _ROLES,
        "content": _CONTENTS,
        "from": _ROLES,
        "value": _CONTENTS,
        "name": JSON_VALUES,
        "tool_calls": JSON_VALUES,
    },
)
_MESSAGE_LISTS = st.lists(st.one_of(_MESSAGES, _MESSAGES, JSON_VALUES), max_size=4)
# mostly well-formed rows with one odd value, so the later checks (and the template) are reached too
_MOSTLY_GOOD = st.builds(
    lambda r, c, odd: {"messages": [{"role": "user", "content": "q"}, {"role": r, "content": c, **odd}]},
    st.one_of(st.just("assistant"), st.just("assistant"), _ROLES),
    st.one_of(_GOOD_CONTENTS, _GOOD_CONTENTS, _CONTENTS),
    st.dictionaries(st.sampled_from(["name", "tool_calls", "weight"]), JSON_VALUES, max_size=2),
)
ROWS_OF_ANYTHING = st.one_of(
    JSON_VALUES,
    _MOSTLY_GOOD,
    _MOSTLY_GOOD,
    st.fixed_dictionaries(
        {},
        optional={
            "messages": _MESSAGE_LISTS | JSON_VALUES,
            "conversations": _MESSAGE_LISTS | JSON_VALUES,
            "id": JSON_VALUES,
        },
    ),
)

#: ChatML that also renders a message's ``name`` and iterates its ``tool_calls``, so odd
#: values there reach the template (and fail inside it, as real templates do).
NOSY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}\n"
    "{% for t in m.tool_calls %}{{ t.function.name }}{% endfor %}"
    "{% for c in m.citations %}[{{ c }}]{% endfor %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def nosy_tokenizer() -> Any:
    tok = tiny_chat_tokenizer("chatml")
    tok.chat_template = NOSY_TEMPLATE
    return tok


# ------------------------------------------------------------------ training loop
TINY_VOCAB = 97
TINY_MODEL = {"dim": 16, "layers": 2, "heads": 2, "kv_heads": 1}


def tiny_config(**kw) -> TrainConfig:
    base = dict(
        steps=20,
        batch_size=4,
        max_seq_len=128,
        lr=1e-2,
        warmup_steps=2,
        seed=0,
        **TINY_MODEL,
    )
    base.update(kw)
    return TrainConfig(**base)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32):
    return build_model(TINY_VOCAB, seed=seed, dtype=dtype, **TINY_MODEL)


def tiny_samples(n: int = 72, seed: int = 3) -> list[Sample]:
    """``n`` learnable conversations of 3-60 tokens with ids ``"c0"``, ``"c1"``, ...:
    an arithmetic progression mod 97 (random start, stride 1-3), the first third
    a prompt (not trained on)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n_tok in enumerate(rng.integers(3, 61, size=n)):
        ids = (int(rng.integers(TINY_VOCAB)) + int(rng.integers(1, 4)) * np.arange(n_tok)) % TINY_VOCAB
        out.append(Sample(ids, np.arange(n_tok) >= n_tok // 3, f"c{i}"))
    return out


def max_param_diff(a, b) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def max_loss_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def counting_conversations(n: int = 30) -> list[list[dict[str, str]]]:
    """``n`` two-turn conversations whose lengths cycle (user: ``i % 4 + 1`` counts,
    assistant: ``i % 9 + 1`` triples), so that conversation ``i`` reads as its index."""
    return [
        [
            {"role": "user", "content": f"count {i} " * (i % 4 + 1)},
            {"role": "assistant", "content": "one two three " * (i % 9 + 1)},
        ]
        for i in range(n)
    ]


def load_models_leaking(monkeypatch: Any) -> None:
    """The negative control through the commands: every model ``sftpack.loop.load_model`` opens
    (``sftpack train/verify --model DIR``) has its hybrid layers' state crossing the row's
    boundaries (:func:`sftpack.hybrid.leaking`, entered for the rest of the test)."""
    import contextlib

    import sftpack.loop
    from sftpack.hybrid import leaking

    real = sftpack.loop.load_model
    stack = contextlib.ExitStack()

    def leaky(*args: Any, **kwargs: Any) -> Any:
        model = real(*args, **kwargs)
        stack.enter_context(leaking(model))
        return model

    monkeypatch.setattr(sftpack.loop, "load_model", leaky)
