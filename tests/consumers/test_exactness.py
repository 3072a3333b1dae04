"""The heart of the project: packed training equals one-conversation-at-a-time training.

For a plain-PyTorch model (boundaries through Megatron's PackedSeqParams, both
modes) and a real Hugging Face LlamaForCausalLM (boundaries through
to_hf_kwargs), logits on real tokens, the token-mean loss and every parameter
gradient must match per-conversation runs, for pad multiples 1, 4, 8 and
hypothesis-generated length sets. A negative control proves the check detects
cross-sequence contamination.

The models run in float64, where packed and per-conversation runs must agree to a
fixed 1e-10 (u = 2**-53 = 1.1e-16): they compute the same function, only in other
summation orders, and whatever the order an n-term sum is off by at most n*u of
its terms' magnitude sum (Higham, Accuracy and Stability, section 3.1). The longest
chain of roundings in one forward and backward pass of these 2-layer models is
n <= 2,000 (width 32, segments <= 96, 97 logits, <= 8 x 48 targets), so each run is
off by <= 2.2e-13 relative, two by 4.4e-13, on logits, losses and gradients of
magnitude <= 10: <= 4.4e-12, and 1e-10 is 20x that (observed: about 1e-15).
Contamination moves logits by more than 1e-3 (observed: several units).

Two checks keep float32 parts:
- Hugging Face's ``eager`` attention computes its softmax in float32 even in a
  float64 model; that is the only float32 step, so its attention weights are off
  by <= 2 * 10 * sqrt(100) * 6.0e-8 = 1.2e-5 relative (the sqrt(n)*u growth of
  Higham & Mary 2019, lambda = 10: exceeded with probability <= 4e-22; n <= 100
  terms per softmax row). That relative error moves the logits by at most as
  much of their magnitude (< 1 with Hugging Face's initialisation, asserted)
  times the gain of the layers after it (about 1 at this initialisation):
  1.2e-5 -> tolerance 2e-5 (observed: about 6e-9).
- The plain model in float32 (the default dtype), with a fixed 3e-4: the same
  sqrt(n)*u bound for a forward and backward pass, 2 * 10 * sqrt(2000) * 6.0e-8 =
  5.4e-5 relative, on logits of magnitude <= 5 (asserted) and smaller gradients:
  2.7e-4 (observed: 3e-6).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sftpack import PackedBatch
from sftpack.attention import register_hf_attention
from sftpack.exactness import TinyCausalLM, check_hf_model, check_plain_model, random_samples, tiny_llama

VOCAB = 97
TOL_64 = dict(logits=1e-10, loss=1e-10, grads=1e-10)  # float64; see the docstring
EAGER_TOL = dict(logits=2e-5, loss=2e-5, grads=2e-5)  # float64 model, float32 softmax
TOL_32 = dict(logits=3e-4, loss=3e-4, grads=3e-4)  # float32 plain model
BUG = 1e-3  # what contamination must move the logits by, at least
F64 = torch.float64


@functools.cache
def plain_model(dtype: torch.dtype = F64) -> TinyCausalLM:
    return TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=dtype)


@functools.cache
def hf_model(impl: str):
    if impl == "sftpack_varlen":
        register_hf_attention()
    return tiny_llama(VOCAB, attn_implementation=impl, dtype=F64)


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
    return samples, PackedBatch.from_samples(samples, pad_multiple=pad_multiple, max_seq_len=width).validate()


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real+padded", "padded-for-both"])
@pytest.mark.parametrize("pad_multiple", [1, 4, 8])
@given(lens=lengths, fixed_width=st.booleans(), seed=st.integers(0, 2**16))
@example(lens=[5, 10], fixed_width=False, seed=0)
@example(lens=[1, 1, 1, 1], fixed_width=True, seed=1)
@settings(max_examples=12, deadline=None)
def test_plain_model_exact(pad_between_seqs, pad_multiple, lens, fixed_width, seed):
    samples, packed = _row(lens, pad_multiple, fixed_width, seed)
    r = check_plain_model(plain_model(), samples, packed, pad_between_seqs=pad_between_seqs)
    assert r.within(**TOL_64), r


@pytest.mark.parametrize("impl", ["sdpa", "eager", "sftpack_varlen"])
@pytest.mark.parametrize("pad_multiple", [1, 4, 8])
@given(lens=lengths, fixed_width=st.booleans(), seed=st.integers(0, 2**16))
@example(lens=[5, 10], fixed_width=False, seed=0)
@settings(max_examples=6, deadline=None)
def test_hf_llama_exact(impl, pad_multiple, lens, fixed_width, seed):
    samples, packed = _row(lens, pad_multiple, fixed_width, seed)
    r = check_hf_model(hf_model(impl), samples, packed)
    if impl == "eager":  # the premise of EAGER_TOL: logits of magnitude < 1
        with torch.no_grad():
            kw = packed.to_hf_kwargs()
            kw.pop("labels")
            assert float(hf_model(impl)(**kw).logits.abs().max()) < 1
    assert r.within(**(EAGER_TOL if impl == "eager" else TOL_64)), r


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real+padded", "padded-for-both"])
@pytest.mark.parametrize("lens", [[5, 10], [48, 1, 17, 30, 2], [1, 1, 1, 1], [96]])
def test_plain_model_exact_in_float32(pad_between_seqs, lens):
    """The default dtype, within the fixed float32 bound of the docstring."""
    samples, packed = _row(lens, 4, False, 5)
    model = plain_model(torch.float32)
    with torch.no_grad():  # the bound's premise: logits of magnitude <= 5
        assert float(model(packed.input_ids, packed.position_ids, packed).abs().max()) <= 5
    r = check_plain_model(model, samples, packed, pad_between_seqs=pad_between_seqs)
    print(r)
    assert r.within(**TOL_32), r


@given(lens=st.lists(st.integers(2, 32), min_size=2, max_size=6), seed=st.integers(0, 2**16))
@settings(max_examples=10, deadline=None)
def test_negative_control_detects_contamination(lens, seed):
    """The same row run as one causal sequence must fail the check: later
    sequences then attend to earlier ones."""
    samples, packed = _row(lens, 4, False, seed)
    r = check_plain_model(plain_model(), samples, packed, contaminate=True)
    assert r.max_logit_diff > BUG, r  # >= 1e7x the float64 tolerance
    assert not r.within(**TOL_64)
