"""The reference varlen attention against an independent block-diagonal mask.

In float64, to a fixed 1e-12: per output, n <= 50 roundings (8-dim scores, softmax
and weighted sum over <= 40 keys) give at most n*u = 5.5e-15 of the magnitudes
(|q.k| / sqrt(8) and |v| below 10 for these standard-normal draws), 5.5e-14 for two
computations; 1e-12 is 18x that. Independent of the summation order, so of the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sftpack import PackedBatch
from sftpack.attention import varlen_attention
from sftpack.testing import samples_from_lengths


def _block_mask(cu: list[int], cup: list[int], T: int, pad_between_seqs: bool) -> torch.Tensor:
    """(T, T) bool: slot i may attend slot j (an independent construction)."""
    seg = torch.full((T,), -1)
    off = torch.zeros(T, dtype=torch.long)
    for i in range(len(cup) - 1):
        n = (cu[i + 1] - cu[i]) if pad_between_seqs else (cup[i + 1] - cup[i])
        seg[cup[i] : cup[i] + n] = i
        off[cup[i] : cup[i] + n] = torch.arange(n)
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    causal = off[:, None] >= off[None, :]
    return same & causal


@pytest.mark.parametrize("pad_between_seqs", [True, False])
@pytest.mark.parametrize("lens,pm,width", [([5, 10], 4, None), ([1, 1, 7, 3], 8, 40), ([16], 1, None)])
def test_matches_block_diagonal_mask(pad_between_seqs, lens, pm, width):
    b = PackedBatch.from_samples(samples_from_lengths(lens), pad_multiple=pm, max_seq_len=width)
    T, H, Hkv, D = b.num_tokens, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    q = torch.randn(T, H, D, generator=g, dtype=f64, requires_grad=True)
    k = torch.randn(T, Hkv, D, generator=g, dtype=f64, requires_grad=True)
    v = torch.randn(T, Hkv, D, generator=g, dtype=f64, requires_grad=True)
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, 1)) / D**0.5
    assert float(v.abs().max()) < 10 and float(scores.abs().max()) < 10  # the tolerance's premise
    out = varlen_attention(q, k, v, b, pad_between_seqs=pad_between_seqs)
    mask = _block_mask(b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist(), T, pad_between_seqs)
    rows = mask.any(-1)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[:, rows],
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask[rows],
    ).transpose(0, 1)
    torch.testing.assert_close(out[rows], ref, atol=1e-12, rtol=0)
    assert torch.all(out[~rows] == 0)
    real = b.real_token_mask
    # Real tokens' outputs and their gradients agree under both modes.
    other = varlen_attention(q, k, v, b, pad_between_seqs=not pad_between_seqs)
    torch.testing.assert_close(out[real], other[real], atol=1e-12, rtol=0)
    (out[real].sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_mode_follows_packed_seq_params_identity():
    b = PackedBatch.from_samples(samples_from_lengths([3, 2]), pad_multiple=4)
    q = torch.randn(b.num_tokens, 2, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert float(q.abs().max()) < 10  # the tolerance's premise (module docstring)
    real_out = varlen_attention(q, q, q, b.to_packed_seq_params(pad_between_seqs=True))
    pad_out = varlen_attention(q, q, q, b.to_packed_seq_params(pad_between_seqs=False))
    assert torch.all(real_out[~b.real_token_mask] == 0)  # padding untouched in real mode
    assert not torch.all(pad_out[~b.real_token_mask] == 0)  # padding attended in padded mode
    torch.testing.assert_close(real_out[b.real_token_mask], pad_out[b.real_token_mask], atol=1e-12, rtol=0)


def test_shape_errors():
    b = PackedBatch.from_samples(samples_from_lengths([3]))
    with pytest.raises(ValueError, match="THD tensors"):
        varlen_attention(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3, 4), b)
    with pytest.raises(ValueError, match="cover 3 slots but q has T=5"):
        varlen_attention(torch.zeros(5, 2, 4), torch.zeros(5, 2, 4), torch.zeros(5, 2, 4), b)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attention(torch.zeros(3, 3, 4), torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), b)
