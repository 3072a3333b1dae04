"""The helpers every test package shares, in one module (import them as ``tests.helpers``).

- Handoff and paths: ``PAD``, ``padded_batch``, ``assert_same_batch``.
- Chat: tiny tokenizers per template style (``tok_of``), message builders (``U``, ``A``,
  ``S``), bad JSONL lines and hypothesis strategies for rows of anything.
- Training loop: the tiny setup (random conversations over a 97-id vocabulary and a
  two-block Llama of width 16, small enough for many 20-step runs per test file), the
  differences the equality tests compare, and ``train_args`` (``sftpack train`` on the
  commands' tiny model).
- Weighted samples (``weighted_samples``), the reference that runs each conversation alone
  (``WeightedAlone``), the loss rule by hand (``weighted_rule_by_hand``), a weighted chat file
  and its ``sftpack train`` arguments (``weighted_chat``, ``weighted_cli_args``).
- Preference pairs (DPO): five string pairs (``PREFERENCE_PAIRS``), their samples tokenized and
  compacted with a reference model saved beside them (``preference_data``), and the DPO loss
  computed one sequence at a time through the models (``dpo_loss_alone``).
- Vision-language model folders and images: a small tokenizer of each family's own kind
  (``tiny_vlm_tokenizer``), a user's folder (``save_vlm_folder``), the folder tests' data and
  row checks (``write_folder_data``, ``check_prepacked_rows``, ``packed_vs_alone``), PNG writers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from sftpack import PackedBatch, Sample
from sftpack.chat import BadRowReason, Conversation
from sftpack.loop import TrainConfig, build_model
from sftpack.loop._sources import Source
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


def train_args(
    data: Any,
    *extra: str,
    tokenizer: Any = None,
    steps: int | None = 1,
    batch_size: int = 4,
    max_seq_len: int = 64,
    dim: int = 16,
    layers: int = 1,
) -> list[str]:
    """The arguments of ``sftpack train DATA`` on the commands' tiny model (``dim`` wide,
    ``layers`` deep, 2 heads, 1 key-value head) for ``steps`` steps (``None``: no ``--steps``) of
    ``batch_size`` rows ``max_seq_len`` wide, with ``--tokenizer`` when one is given, then ``extra``."""
    args = ["train", str(data)]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    if steps is not None:
        args += ["--steps", str(steps)]
    args += ["--batch-size", str(batch_size), "--max-seq-len", str(max_seq_len)]
    args += ["--dim", str(dim), "--layers", str(layers), "--heads", "2", "--kv-heads", "1"]
    return [*args, *extra]


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


# ------------------------------------------------------------------ vision-language model folders
#: Hugging Face's LLaVA-1.5 conversation format as its llava-1.5 folders' template writes it
#: (written here, not copied): ``USER: <image>\\n... ASSISTANT: ...``, images first, each text
#: followed by a space, the assistant's text marked with {% generation %}; no end-of-turn token.
LLAVA_15_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for part in message['content'] if part['type'] == 'image' %}{{ '<image>\\n' }}{% endfor %}"
    "{% for part in message['content'] if part['type'] == 'text' %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ part['text'] + ' ' }}{% endgeneration %}"
    "{% else %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def tiny_vlm_tokenizer(name: str) -> Any:
    """A small tokenizer of the vision-language family ``name``'s own kind (byte-level BPE, ~290
    ids, so a float64 run of a tiny folder's model is quick, where the embedded Qwen one has
    151,657): the Qwen-VL families' ChatML with Qwen2-VL's special tokens (the family writes its
    image and video blocks, as with the embedded tokenizer), LLaVA-1.5's ``<image>`` with its
    template, or Gemma 3's tokens with its template. A fresh tokenizer each call."""
    from sftpack.multimodal.families import gemma3
    from sftpack.multimodal.families.qwen2_vl import QWEN2VL_SPECIALS

    tok = tiny_chat_tokenizer("chatml")
    if name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        tok.add_special_tokens(
            {"additional_special_tokens": list(QWEN2VL_SPECIALS)}, replace_extra_special_tokens=False
        )
    elif name == "llava":
        tok.add_special_tokens({"additional_special_tokens": ["<image>"]}, replace_extra_special_tokens=False)
        tok.chat_template = LLAVA_15_TEMPLATE
    elif name == "gemma3":
        specials = [gemma3.TURN_START, gemma3.TURN_END, gemma3.BOI, gemma3.EOI, gemma3.SOFT]
        tok.add_special_tokens({"bos_token": gemma3.BOS, "additional_special_tokens": specials})
        tok.chat_template = gemma3.GEMMA3_TEMPLATE
    else:
        raise ValueError(f"tiny_vlm_tokenizer: no tiny tokenizer for {name!r}")
    return tok


def save_vlm_folder(root: str, name: str, *, seed: int = 5, **sizes: Any) -> str:
    """A user's model folder of the vision-language family ``name`` written into ``root``
    (``save_pretrained`` of a tiny seeded model built from a config, :func:`tiny_vlm_tokenizer`'s
    tokenizer and the family's image processor; nothing downloaded); ``sizes``:
    :func:`sftpack.loop._model.build_media_model`'s (``dim``, ``layers``, ``heads``, ``kv_heads``).
    Returns ``root``."""
    from sftpack.loop._model import build_media_model
    from sftpack.multimodal import family_for

    fam = family_for(name)
    tok = tiny_vlm_tokenizer(name)
    build_media_model(fam, tok, seed=seed, **sizes).save_pretrained(root)
    tok.save_pretrained(root)
    fam.image_processor().save_pretrained(root)
    return root


#: float64 exactness bound of a folder's rows against each sample alone, and what a bug moves the
#: logits by at least (tests/multimodal/test_model_folders.py derives both)
FOLDER_TOL, FOLDER_BUG = 1e-10, 1e-6


def save_png(path: Path, size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 30)) -> Path:
    """A one-colour RGB PNG of ``size`` (w, h) at ``path`` (its folder made); returns ``path``."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def png_bytes(w: int = 56, h: int = 56, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """The bytes of a one-colour ``w x h`` RGB PNG."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def image_conv(*parts: dict, answer: str) -> dict:
    """A row of one user turn of ``parts`` and the assistant's ``answer``."""
    return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": answer}]}


def write_rows(path: Path, rows: list[Any]) -> Path:
    """``rows`` (JSON values, or lines as they are) one a line at ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_folder_data(root: Path) -> Path:
    """The model-folder tests' data in ``root``: ``mine.jsonl``, four conversations (a red 56x56
    image, a green 84x56 one, text only, both images), and the two PNGs."""
    save_png(root / "a.png", (56, 56), (200, 30, 30))
    save_png(root / "b.png", (84, 56), (30, 200, 30))
    text = {"type": "text", "text": "What colour is it?"}
    return write_rows(
        root / "mine.jsonl",
        [
            image_conv({"type": "image", "path": "a.png"}, text, answer="Red."),
            image_conv({"type": "image", "path": "b.png"}, text, answer="Green."),
            {"messages": [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi there."}]},
            image_conv({"type": "image", "path": "b.png"}, {"type": "image", "path": "a.png"}, text, answer="Both."),
        ],
    )


def folder_samples(fam: Any, path: str, data: Path) -> list[Sample]:
    """The folder's own samples of ``data`` (ids as the reader gives them: file:line)."""
    from sftpack.chat import read_conversations
    from sftpack.loop._setup import media_samples

    tok, proc = fam.tokenizer(path), fam.image_processor(path)
    samples, _ = media_samples(
        read_conversations([str(data)]), max_seq_len=256, family=fam, tokenizer=tok, processor=proc
    )
    return samples


def images_shifted(batch: PackedBatch) -> PackedBatch:
    """The row with its images shifted by one (each image's pixels on the next one's placeholders)."""
    media = batch.media
    return dataclasses.replace(batch, media=dataclasses.replace(media, pixel_values=media.pixel_values.roll(1, 0)))


def shifts(batch: PackedBatch) -> bool:
    """Whether shifting the row's images by one changes them (two or more images, not all equal)."""
    pv = batch.media.pixel_values
    return pv.shape[0] > 1 and not torch.equal(pv, pv.roll(1, 0))


def positions_not_restarted(batch: PackedBatch) -> PackedBatch:
    """The row with its positions running on across its sequences (the MRoPE rows too, where the
    family has them; LLaVA and Gemma 3 take the text's)."""
    media = batch.media
    if getattr(media, "positions", None) is not None:
        positions = media.positions.clone()
        positions[:] = torch.arange(positions.shape[-1])
        media = dataclasses.replace(media, positions=positions)
    return dataclasses.replace(batch, position_ids=torch.arange(len(batch.position_ids)), media=media)


def packed_vs_alone(fam: Any, model: Any, samples: list[Sample], row: PackedBatch) -> tuple[float, float, dict]:
    """The largest differences (logits, loss, gradients by part) between ``row`` run packed through
    ``fam``'s packed forward and each of ``samples`` run alone the model's own way
    (:func:`sftpack.multimodal._exactness.compare_packed_alone`)."""
    from sftpack.multimodal._exactness import compare_packed_alone

    logits, loss, grads, _, _ = compare_packed_alone(
        model,
        samples,
        row,
        alone=fam.alone_logits,
        packed=lambda: fam.packed_logits(model, row),
        part_of=fam.part_of,
    )
    return logits, loss, grads


def check_prepacked_rows(fam: Any, folder: str, data: Path, rows: list[PackedBatch]) -> None:
    """Each prepacked row through the folder's own HF class (float64) equals each of its samples
    alone within FOLDER_TOL; the negative control fails by FOLDER_BUG: the same row with positions
    not restarted (a row of several samples, MRoPE families) or its images shifted by one (LLaVA
    and Gemma 3, whose tiny models barely move with a position shift: a row of two or more images)."""
    model = fam.pretrained(folder, dtype=torch.float64)
    samples = {s.conversation_id: s for s in folder_samples(fam, folder, data)}
    controlled = 0
    for row in rows:
        chosen = [samples[i] for i in row.sequence_ids]
        mrope = getattr(row.media, "positions", None) is not None
        control, telling = (
            (positions_not_restarted(row), len(chosen) > 1) if mrope else (images_shifted(row), shifts(row))
        )
        controlled += telling
        for bad, run in ((False, row), (True, control)):
            logits, loss, grads = packed_vs_alone(fam, model, chosen, run)
            if not bad:
                assert max(logits, loss, *grads.values()) <= FOLDER_TOL
            elif telling:
                assert logits > FOLDER_BUG
    assert controlled  # the control ran on at least one row


# ------------------------------------------------------------------ preference pairs (DPO)
PREFERENCE_PAIRS = [
    {"prompt": "What is 2 + 3?", "chosen": " It is 5.", "rejected": " It is 6, I think."},
    {"prompt": "Name a colour.", "chosen": " Blue.", "rejected": " A fish."},
    {"prompt": "Say hello", "chosen": " Hello!", "rejected": " Go away."},
    {"prompt": "Is ice cold?", "chosen": " Yes, it is cold.", "rejected": " No."},
    {"prompt": "Count to three", "chosen": " One, two, three.", "rejected": " Four."},
]
#: the tiny model of the DPO tests (one block of width 16)
DPO_MODEL = {"dim": 16, "layers": 1, "heads": 2, "kv_heads": 1}


def preference_data(root: Path) -> tuple[list[Sample], int, Path]:
    """``PREFERENCE_PAIRS`` in a JSONL under ``root``, read and tokenized with the embedded tokenizer
    (each pair two samples), ids compacted to the ones the data uses; a float64 reference model
    (``build_model`` seed 1) saved to ``root / "reference"``: ``(samples, vocabulary size, its folder)``."""
    from sftpack.chat import read_conversations, tokenize_conversations
    from sftpack.data import default_tokenizer
    from sftpack.loop import compact_vocabulary

    path = root / "prefs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PREFERENCE_PAIRS), encoding="utf-8")
    rows = list(read_conversations([str(path)]))
    samples = tokenize_conversations(rows, default_tokenizer()).to_list()
    assert len(samples) == 2 * len(PREFERENCE_PAIRS) and all(s.meta["role"] in ("chosen", "rejected") for s in samples)
    samples, ids = compact_vocabulary(samples)
    vocab = len(ids)
    assert vocab <= 97  # the DPO tests' tolerance derivation
    assert max(int(s.loss_mask[1:].sum()) for s in samples) <= 32
    ref_dir = root / "reference"
    build_model(vocab, **DPO_MODEL, seed=1, dtype=torch.float64).save_pretrained(ref_dir)
    return samples, vocab, ref_dir


def _alone_logp(model: Any, s: Sample) -> torch.Tensor:
    """One sequence's summed log-probability of its trained tokens, run alone, unpacked."""
    ids = torch.as_tensor(s.input_ids, dtype=torch.int64)
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
    return logp[torch.as_tensor(s.loss_mask[1:])].sum()


def dpo_loss_alone(policy: Any, reference: Any, pairs: list[tuple[Sample, Sample]], beta: float = 0.1) -> float:
    """The mean sigmoid DPO loss of ``(chosen, rejected)`` pairs, each sequence through both models
    alone as its own ``(1, L)`` batch: ``log1p(exp(-z))``, ``z = beta * ((pc - rc) - (pr - rr))``."""
    losses = []
    for chosen, rejected in pairs:
        z = beta * (
            (_alone_logp(policy, chosen) - _alone_logp(reference, chosen))
            - (_alone_logp(policy, rejected) - _alone_logp(reference, rejected))
        )
        losses.append(float(torch.log1p(torch.exp(-z))))
    return sum(losses) / len(losses)


# ------------------------------------------------------------------ weighted samples
def with_groups(samples: list[Sample], group_of: Any) -> list[Sample]:
    """``samples`` with ``meta["group"] = group_of(i)`` (GRPO-style groups: a prompt's completions);
    ``None`` leaves conversation ``i`` without a group (a group of its own)."""
    out = []
    for i, s in enumerate(samples):
        g = group_of(i)
        out.append(
            Sample(s.input_ids, s.loss_mask, s.conversation_id, {} if g is None else {"group": g}, weights=s.weights)
        )
    return out


def weighted_samples(samples: list[Sample]) -> list[Sample]:
    """Some samples weighted 0, some 2.5, some a negative advantage, some per token, some not at all."""
    rng = np.random.default_rng(7)
    out = []
    for i, s in enumerate(samples):
        kind = i % 5
        w: object
        if kind == 0:
            w = 2.5
        elif kind == 1:
            w = 0.0
        elif kind == 2:
            w = -0.75  # a negative advantage
        elif kind == 3:
            w = rng.uniform(-2.5, 2.5, size=len(s))
        else:
            w = None
        out.append(Sample(s.input_ids, s.loss_mask, s.conversation_id, weights=w))
    return out


def weighted_group_numbers(step: list[Sample]) -> list[int]:
    numbered: dict[object, int] = {}
    return [numbered.setdefault(s.meta.get("group", ("own", i)), len(numbered)) for i, s in enumerate(step)]


class WeightedAlone(Source):
    """The reference: the steps' conversations, each its own one-sequence micro-batch (a
    group's members in several micro-batches: its groups, as :class:`TrainerSource` numbers them)."""

    step_weighted = True

    def __init__(self, steps: list[list[Sample]]) -> None:
        self.steps, self.i = steps, 0

    def next_step(self):
        step = self.steps[self.i]
        self.i += 1
        numbers = weighted_group_numbers(step)
        self.step_groups = ([[g] for g in numbers], max(numbers) + 1)
        return [PackedBatch.from_samples([s]) for s in step]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]

    def fingerprint(self):
        return "alone"


def weighted_rule_by_hand(model, samples: list[Sample], rule: str = "token") -> float:
    """The rule over the samples' targets, each sample run alone: "token": sum(w * loss) / sum(|w|);
    "sequence": the mean of each sample's sum(w * loss) / sum(|w|) (over those with sum |w| > 0);
    "group": the mean over groups of the mean over each group's samples."""
    from sftpack.loop._model import _body_and_head

    body, head = _body_and_head(model)
    nums, dens = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.as_tensor(s.input_ids)[None]
            logits = head(body(input_ids=ids, use_cache=False).last_hidden_state[0])
            target = torch.as_tensor(s.input_ids[1:])
            trained = torch.as_tensor(s.loss_mask[1:])
            w = (
                torch.ones(len(s) - 1, dtype=torch.float64)
                if s.weights is None
                else torch.as_tensor(s.weights[1:], dtype=torch.float64)
            )
            loss = F.cross_entropy(logits[:-1], target, reduction="none")
            nums.append(float((w * loss)[trained].sum()))
            dens.append(float(w.abs()[trained].sum()))
    if rule == "token":
        return sum(nums) / sum(dens)
    means = {i: nums[i] / dens[i] for i in range(len(samples)) if dens[i] > 0}
    if rule == "sequence":
        return sum(means.values()) / len(means)
    groups: dict[int, list[float]] = {}
    for i, g in enumerate(weighted_group_numbers(samples)):
        if i in means:
            groups.setdefault(g, []).append(means[i])
    return sum(sum(v) / len(v) for v in groups.values()) / len(groups)


def weighted_chat(chat: Path, path: Path) -> Path:
    """The ``chat`` fixture's conversations with a weight or an advantage on most rows."""
    rows = [json.loads(line) for line in (chat / "chat.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        if i % 4 == 1:
            r["weight"] = 2.5
        elif i % 4 == 2:
            r["advantage"] = -1.0
        elif i % 4 == 3:
            r["messages"][-1]["weight"] = 0.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def weighted_cli_args(data: Any, tmp_path: Path, name: str, packing: str = "trainer") -> list[str]:
    """``sftpack train`` of ``data`` with the tokenizer of the ``chat`` fixture (``tmp_path.parent / "tok"``)."""
    args = ["train", str(data), "--tokenizer", str(tmp_path.parent / "tok"), "--packing", packing]
    args += ["--steps", "2", "--batch-size", "4", "--max-seq-len", "256", "--dim", "16", "--layers", "1"]
    return args + ["--heads", "2", "--kv-heads", "1", "--log", str(tmp_path / f"{name}.jsonl")]
