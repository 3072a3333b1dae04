"""``SmallLlama`` (plain torch, ``sftpack train``'s default) is transformers' ``LlamaForCausalLM``.

Three claims, each against the real ``LlamaForCausalLM`` that ``build_model`` builds:

1. the same seed gives the same parameters, bit for bit, under the same names;
2. in float32 the same ops in the same order give bit-for-bit equal loss and
   gradients (``torch.equal``): packed rows in both boundary modes, padded batches;
3. in float64 the training loss (``LossModule``: the head on supervised slots, the
   global token-mean) and every parameter's gradient agree to 1e-12 relative,
   through either model's own full-vocabulary ``forward`` too.

Why 1e-12 in float64 (u = 2**-53 = 1.1e-16): the two models run the same ops on the
same values, so any difference is rounding only, from other summation orders
(there are none when the ops match; claim 2 checks that in float32). The longest
chain of roundings behind a loss or gradient here is n <= 5e3 (2 layers of width
32, segments <= 40 tokens, a 300-id head): Higham's worst case n*u = 5.6e-13 of
the magnitudes, twice for two runs, 1.1e-12; the tolerance is relative to the
largest magnitude of each compared tensor. A wrong op (a missing norm, positions
not rotated, a head over the wrong slots) moves the loss by more than 1e-3
(the negative control below).
"""

from __future__ import annotations

import pytest
import torch

from sftpack import PackedBatch
from sftpack.loop import build_model
from sftpack.loop._llama import SmallLlama, SmallLlamaConfig
from sftpack.loop._model import LossModule
from sftpack.testing import samples_from_lengths

V = 300
REL_64 = 1e-12  # float64: 2 x n*u = 1.1e-12 for n <= 5e3 roundings (see above)
SHAPES = [dict(dim=32, layers=2, heads=4, kv_heads=2), dict(dim=16, layers=1, heads=2, kv_heads=1)]


def _pair(dtype: torch.dtype, seed: int = 0, **shape):
    hf = build_model(V, seed=seed, dtype=dtype, **shape)
    me = build_model(V, seed=seed, dtype=dtype, impl="torch", **shape)
    return hf, me


def _row(pad_multiple: int = 1) -> PackedBatch:
    samples = samples_from_lengths([17, 9, 30, 5], trainable_from=3)
    for s in samples:
        s.input_ids %= V
    return PackedBatch.from_samples(samples, pad_multiple=pad_multiple)


def _padded():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 24), generator=g)
    labels = ids.clone()
    labels[0, 20:] = -100  # right padding
    labels[1, 10:] = -100
    labels[:, :2] = -100  # a prompt
    return type("MB", (), {"input_ids": ids, "labels": labels})()


def _loss_and_grads(model, mb, pad_between_seqs: bool):
    model.zero_grad(set_to_none=True)
    n = (
        (mb.labels != -100)
        .sum()
        .to(torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32)
    )
    loss = LossModule(model, pad_between_seqs=pad_between_seqs)(mb, n)
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 5])
def test_same_parameters_for_the_same_seed(shape, seed):
    hf, me = _pair(torch.float32, seed, **shape)
    a, b = hf.state_dict(), me.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    other = build_model(V, seed=seed + 1, impl="torch", **shape).state_dict()
    assert not torch.equal(other["lm_head.weight"], b["lm_head.weight"])


BATCHES = [
    pytest.param(lambda: _row(1), False, id="packed-padded-bounds"),
    pytest.param(lambda: _row(4), True, id="packed-real-bounds"),
    pytest.param(_padded, False, id="padded-batch"),
]


@pytest.mark.parametrize("make, real", BATCHES)
def test_float32_bit_for_bit(make, real):
    hf, me = _pair(torch.float32, **SHAPES[0])
    mb = make()
    la, ga = _loss_and_grads(hf, mb, real)
    lb, gb = _loss_and_grads(me, mb, real)
    assert torch.equal(la, lb), (la.item(), lb.item())
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("make, real", BATCHES)
@pytest.mark.parametrize("shape", SHAPES)
def test_float64_equal(make, real, shape):
    hf, me = _pair(torch.float64, **shape)
    mb = make()
    la, ga = _loss_and_grads(hf, mb, real)
    lb, gb = _loss_and_grads(me, mb, real)
    assert _close(la, lb) <= REL_64
    for k in ga:
        assert _close(ga[k], gb[k]) <= REL_64, k


def test_full_forward_matches_transformers():
    """``model(**to_hf_kwargs())``: logits of every slot and Hugging Face's own shifted loss."""
    hf, me = _pair(torch.float64, **SHAPES[0])
    kw = _row(2).to_hf_kwargs()
    a, b = hf(**kw), me(**kw)
    assert _close(a.logits, b.logits) <= REL_64
    assert _close(a.loss, b.loss) <= REL_64


def test_a_wrong_model_is_caught():
    """Negative control: a SmallLlama without its final norm moves the loss by far more than the tolerance."""
    hf, me = _pair(torch.float64, **SHAPES[0])
    me.model.norm = torch.nn.Identity()  # type: ignore[assignment]
    mb = _row(1)
    la, _ = _loss_and_grads(hf, mb, False)
    lb, _ = _loss_and_grads(me, mb, False)
    assert abs(la.item() - lb.item()) > 1e-3


def test_checkpoints_load_into_either_model():
    hf, _ = _pair(torch.float32, **SHAPES[1])
    me = build_model(V, seed=9, impl="torch", **SHAPES[1])
    me.load_state_dict(hf.state_dict())
    ids = torch.randint(0, V, (1, 12))
    assert torch.equal(me(ids).logits, hf(ids, use_cache=False).logits)


def test_bad_config_and_inputs_are_named():
    with pytest.raises(ValueError, match="heads must divide hidden_size"):
        SmallLlamaConfig(V, hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        SmallLlamaConfig(0)
    m = SmallLlama(SmallLlamaConfig(V, hidden_size=16, num_attention_heads=2, num_key_value_heads=1))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="no attention_mask"):
        m(ids, attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="no KV cache"):
        m(ids, use_cache=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        m(ids, past_key_values=None)


def test_building_it_imports_no_transformers_modeling_code():
    import subprocess
    import sys

    code = (
        "import sys; from sftpack.loop import build_model; build_model(50, dim=16, heads=2, kv_heads=1, "
        "impl='torch'); print(sorted(m for m in sys.modules if m.startswith('transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
