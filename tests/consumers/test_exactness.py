"""The heart of the project: packed training equals one-conversation-at-a-time training.

For a plain-PyTorch model (boundaries through Megatron's PackedSeqParams, both
modes) and a real Hugging Face LlamaForCausalLM (boundaries through
to_hf_kwargs), logits on real tokens, the token-mean loss and every parameter
gradient must match per-conversation runs, for pad multiples 1, 4, 8 and
hypothesis-generated length sets. A negative control proves the check detects
cross-sequence contamination.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sftpack import PackedBatch
from sftpack.attention import register_hf_attention
from sftpack.exactness import TinyCausalLM, check_hf_model, check_plain_model, random_samples, tiny_llama

VOCAB = 97
PLAIN_TOL = dict(logits=1e-5, loss=1e-5, grads=1e-5)
HF_TOL = dict(logits=1e-5, loss=1e-5, grads=1e-5)


@functools.lru_cache(maxsize=None)
def plain_model() -> TinyCausalLM:
    return TinyCausalLM(vocab_size=VOCAB, seed=0)


@functools.lru_cache(maxsize=None)
def hf_model(impl: str):
    if impl == "sftpack_varlen":
        register_hf_attention()
    return tiny_llama(VOCAB, attn_implementation=impl)


lengths = st.one_of(
    st.lists(st.integers(1, 48), min_size=1, max_size=8),  # general mixes
    st.lists(st.integers(1, 3), min_size=8, max_size=24),  # many tiny sequences
    st.just([1]),
    st.integers(64, 96).map(lambda n: [n]),  # one sequence filling the row
)


def _row(lens, pad_multiple, fixed_width, seed):
    samples = random_samples(lens, VOCAB, seed=seed)
    padded = sum(-(-n // pad_multiple) * pad_multiple for n in lens)
    width = padded + 5 * pad_multiple if fixed_width else None
    return samples, PackedBatch.from_samples(samples, pad_multiple=pad_multiple, row_width=width).validate()


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real+padded", "padded-for-both"])
@pytest.mark.parametrize("pad_multiple", [1, 4, 8])
@given(lens=lengths, fixed_width=st.booleans(), seed=st.integers(0, 2**16))
@example(lens=[5, 10], fixed_width=False, seed=0)
@example(lens=[1, 1, 1, 1], fixed_width=True, seed=1)
@settings(max_examples=12, deadline=None)
def test_plain_model_exact(pad_between_seqs, pad_multiple, lens, fixed_width, seed):
    samples, packed = _row(lens, pad_multiple, fixed_width, seed)
    r = check_plain_model(plain_model(), samples, packed, pad_between_seqs=pad_between_seqs)
    assert r.within(**PLAIN_TOL), r


@pytest.mark.parametrize("impl", ["sdpa", "eager", "sftpack_varlen"])
@pytest.mark.parametrize("pad_multiple", [1, 4, 8])
@given(lens=lengths, fixed_width=st.booleans(), seed=st.integers(0, 2**16))
@example(lens=[5, 10], fixed_width=False, seed=0)
@settings(max_examples=6, deadline=None)
def test_hf_llama_exact(impl, pad_multiple, lens, fixed_width, seed):
    samples, packed = _row(lens, pad_multiple, fixed_width, seed)
    r = check_hf_model(hf_model(impl), samples, packed)
    assert r.within(**HF_TOL), r


@given(lens=st.lists(st.integers(2, 32), min_size=2, max_size=6), seed=st.integers(0, 2**16))
@settings(max_examples=10, deadline=None)
def test_negative_control_detects_contamination(lens, seed):
    """The same row run as one causal sequence must fail the check: later
    sequences then attend to earlier ones."""
    samples, packed = _row(lens, 4, False, seed)
    r = check_plain_model(plain_model(), samples, packed, contaminate=True)
    assert r.max_logit_diff > 1e-3, r
    assert not r.within(**PLAIN_TOL)
