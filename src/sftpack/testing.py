"""Offline, deterministic helpers for tests and examples (no downloads).

:class:`CharTokenizer` maps each character to its Unicode code point, so a
token id reads back as the text it came from: ``"hi"`` -> ``[104, 105]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from . import _optional
from .data import CHATML_TEMPLATE
from .sample import Sample

__all__ = [
    "CHAT_STYLES",
    "HYBRID_FAMILIES",
    "CharTokenizer",
    "hybrid_config",
    "samples_from_lengths",
    "save_hybrid_folder",
    "tiny_chat_tokenizer",
]


class CharTokenizer:
    """Characters to code points and back.

    >>> tok = CharTokenizer()
    >>> tok.encode("hi!")
    [104, 105, 33]
    >>> tok.decode([104, 105, 33])
    'hi!'
    """

    pad_token_id = 0
    vocab_size = 0x110000

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(chr(int(i)) for i in ids if int(i) > 0)

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [self.encode(t) for t in texts]}


def samples_from_lengths(lengths: Iterable[int], *, trainable_from: int = 0) -> list[Sample]:
    """Self-describing samples: sample ``i`` of length ``L`` holds ids
    ``1000*(i+1) + [0, 1, ..., L-1]``, so any slot of a packed row tells which
    sample and which position it came from. Tokens at positions ``>= trainable_from``
    are trainable.

    >>> s = samples_from_lengths([3])[0]
    >>> s.input_ids.tolist(), s.loss_mask.tolist()
    ([1000, 1001, 1002], [True, True, True])
    """
    out = []
    for i, n in enumerate(lengths):
        ids = 1000 * (i + 1) + np.arange(int(n), dtype=np.int64)
        mask = np.arange(int(n)) >= trainable_from
        out.append(Sample(ids, mask, i))
    return out


# ---------------------------------------------------------------------------- tiny chat tokenizers
#
# Offline Hugging Face fast tokenizers for the chat tests: byte-level BPE over
# the 256 byte symbols plus a few hand-written merges (so some tokens span
# several characters, and "\n\n" merges across a header/content boundary, as in
# real vocabularies), the special tokens of one chat format, and its template.

_CHATML = CHATML_TEMPLATE
_CHATML_GEN = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3 style: headers between special tokens, contents trimmed, bos first.
_LLAMA3 = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_LLAMA3_GEN = (
    "{% for message in messages %}"
    "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Mistral style: [INST] blocks, no assistant header, eos closes each answer, the
# system prompt folded into the first user turn, roles must alternate.
_MISTRAL_HEAD = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{{ '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
)
_MISTRAL = (
    _MISTRAL_HEAD
    + "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
_MISTRAL_GEN = (
    _MISTRAL_HEAD
    + "{% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% endif %}{% endfor %}"
)

#: style -> (template without markers, template with ``{% generation %}`` markers, specials, bos, eos)
CHAT_STYLES: dict[str, tuple[str, str, tuple[str, ...], str | None, str]] = {
    "chatml": (_CHATML, _CHATML_GEN, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>"),
    "llama3": (
        _LLAMA3,
        _LLAMA3_GEN,
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "mistral": (_MISTRAL, _MISTRAL_GEN, ("<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>"),
}

# Merges of the tiny vocabulary, as byte-level strings ("Ġ" is a space, "Ċ" a newline).
# fmt: off
_TINY_WORDS = ("ĊĊ", "ĊĊĊ", "Ġt", "he", "Ġthe", "Ġy", "ou", "Ġyou", "ll", "llo", "Ġhe", "Ġhello",
               "in", "ing", "ass", "ist", "ant")
# fmt: on


def tiny_chat_tokenizer(style: str = "chatml", *, generation: bool = False) -> Any:
    """An offline ``PreTrainedTokenizerFast`` (byte-level BPE, ~270 tokens) with the
    special tokens and chat template of ``style`` (``"chatml"``, ``"llama3"``, ``"mistral"``);
    ``generation=True`` picks the template variant with ``{% generation %}`` markers.

    >>> tok = tiny_chat_tokenizer("llama3")
    >>> tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nhi<|eot_id|>'
    """
    if style not in CHAT_STYLES:
        raise ValueError(f"style={style!r} is not valid: choose one of {', '.join(map(repr, CHAT_STYLES))}")
    tk = _optional.tokenizers()
    AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers = (  # noqa: N806 - the library's names
        tk.AddedToken,
        tk.Regex,
        tk.Tokenizer,
        tk.decoders,
        tk.models,
        tk.pre_tokenizers,
    )
    plain, marked, specials, bos, eos = CHAT_STYLES[style]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    for word in _TINY_WORDS:  # build each word left to right: ("h", "e"), then ("he", "l")...
        left = word[0]
        for ch in word[1:]:
            if left + ch not in vocab:
                merges.append((left, ch))
                vocab[left + ch] = len(vocab)
            left += ch
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    pattern = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok = _optional.transformers().PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=specials[0]
    )
    tok.chat_template = marked if generation else plain
    return tok


#: the hybrid families :func:`hybrid_config` builds, each with one layer that carries state
#: along the sequence and one attention layer (Zamba2: a Mamba2 layer and a hybrid one)
HYBRID_FAMILIES = (
    "nemotron_h",
    "bamba",
    "falcon_h1",
    "granitemoehybrid",
    "zamba2",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "lfm2",
)


def hybrid_config(kind: str, vocab_size: int, *, hidden: int = 32, layers: int = 2, **overrides: Any) -> Any:
    """A tiny transformers config of the hybrid family ``kind`` (:data:`HYBRID_FAMILIES`): the
    first layer carries state along the sequence (a Mamba2 mixer, a gated delta net, a short
    convolution), the others are attention; ``hidden`` wide, ``layers`` deep, chunks of 8
    tokens for the chunked scans (so a test's sequences span several). Nothing downloaded."""
    hf = _optional.transformers()
    heads = max(hidden // 8, 2)
    attn = dict(num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1))
    base: dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, **attn)
    base.update(num_hidden_layers=layers, tie_word_embeddings=False)
    mamba2 = dict(mamba_n_heads=heads, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
    gdn = dict(
        layer_types=["linear_attention"] + ["full_attention"] * (layers - 1),
        head_dim=8,
        linear_num_key_heads=max(heads // 2, 1),
        linear_num_value_heads=heads,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    configs: dict[str, tuple[str, dict[str, Any]]] = {
        "nemotron_h": (
            "NemotronHConfig",
            dict(
                head_dim=8,
                mamba_num_heads=heads,
                mamba_head_dim=8,
                ssm_state_size=8,
                n_groups=1,
                chunk_size=8,
                hybrid_override_pattern="M" + "*" * (layers - 1),
            ),
        ),
        "bamba": ("BambaConfig", dict(attn_layer_indices=list(range(1, layers)), mamba_expand=1, **mamba2)),
        "falcon_h1": ("FalconH1Config", dict(mamba_expand=2, mamba_d_ssm=2 * hidden, **dict(mamba2, mamba_d_head=16))),
        "granitemoehybrid": (
            "GraniteMoeHybridConfig",
            dict(layer_types=["mamba"] + ["attention"] * (layers - 1), mamba_expand=1, num_local_experts=0, **mamba2),
        ),
        "zamba2": (
            "Zamba2Config",
            dict(
                mamba_headdim=8,
                mamba_d_state=8,
                mamba_ngroups=1,
                chunk_size=8,
                layers_block_type=["mamba"] + ["hybrid"] * (layers - 1),
            ),
        ),
        "qwen3_5": ("Qwen3_5TextConfig", gdn),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(gdn, **experts)),
        "qwen3_next": ("Qwen3NextConfig", dict(gdn, decoder_sparse_step=1, **experts)),
        "lfm2": ("Lfm2Config", dict(layer_types=["conv"] + ["full_attention"] * (layers - 1))),
    }
    if kind not in configs:
        raise ValueError(f"hybrid_config: kind must be one of {', '.join(HYBRID_FAMILIES)}, got {kind!r}")
    name, extra = configs[kind]
    return getattr(hf, name)(**{**base, **extra, **overrides})


def save_hybrid_folder(kind: str, root: str, *, seed: int = 0, tokenizer: Any = None, **config: Any) -> str:
    """A user's model folder of the hybrid family ``kind``, written by ``save_pretrained`` from
    :func:`hybrid_config` (seeded weights), with ``tokenizer`` (default
    :func:`tiny_chat_tokenizer`) beside it; returns ``root``."""
    import torch  # start-up: sftpack.testing loads no torch (tests/test_architecture.py)

    hf = _optional.transformers()
    tok = tokenizer if tokenizer is not None else tiny_chat_tokenizer("chatml")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf.AutoModelForCausalLM.from_config(hybrid_config(kind, len(tok), **config))
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root
