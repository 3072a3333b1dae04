"""The small, real models of the exactness checks (:class:`TinyCausalLM`, :func:`tiny_llama`),
the RMS norms made to compute in the model's dtype (:func:`norms_in_model_dtype`), and the mark
of a model whose packing the suite proves exact (:func:`mark_exact`)."""

from __future__ import annotations

import math
import types
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import _optional
from ..attention import varlen_attention

#: the attribute that marks a model whose packing the suite proves exact (:func:`mark_exact`)
_PROVEN = "_sftpack_packing_proven"


def mark_exact(model: Any) -> Any:
    """Mark ``model`` as one whose packing the test suite proves exact (the models sftpack
    builds itself: ``build_model``, :func:`tiny_llama`, the families' tiny models), so that
    :func:`require_exact_packing` skips its probe; returns ``model``."""
    object.__setattr__(model, _PROVEN, True)
    return model


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(T, H, D)`` at ``position_ids`` ``(T,)``."""
    d = x.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=dt, device=x.device) / d))
    ang = position_ids.to(dt)[:, None] * inv[None, :]  # (T, D/2)
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1)[:, None, :].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1)[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1 = _RMSNorm(dim)
        self.q = nn.Linear(dim, heads * self.hd, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, dim, bias=False)
        self.norm2 = _RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, packed: Any, pad_between_seqs: bool | None
    ) -> torch.Tensor:
        T = x.shape[0]
        h = self.norm1(x)
        q = _rope(self.q(h).view(T, self.heads, self.hd), position_ids)
        k, v = self.kv(h).view(T, 2, self.kv_heads, self.hd).unbind(1)
        k = _rope(k, position_ids)
        if packed is None:  # one plain causal sequence: the unpacked reference
            rep = self.heads // self.kv_heads
            a = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.repeat_interleave(rep, dim=1).transpose(0, 1),
                v.repeat_interleave(rep, dim=1).transpose(0, 1),
                is_causal=True,
            ).transpose(0, 1)
        else:
            a = varlen_attention(q, k, v, packed, pad_between_seqs=pad_between_seqs)
        x = x + self.o(a.reshape(T, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyCausalLM(nn.Module):
    """A small causal transformer in plain PyTorch for exactness checks.

    ``forward(input_ids (T,), position_ids (T,), packed=None)`` -> logits ``(T, vocab)``.
    With ``packed`` (a :class:`~sftpack.PackedBatch` or Megatron ``PackedSeqParams``)
    attention is variable-length; without it the input is one causal sequence.
    """

    def __init__(
        self,
        vocab_size: int = 97,
        dim: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        layers: int = 2,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = _RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
                else:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        self.to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        packed: Any = None,
        pad_between_seqs: bool | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        for blk in self.blocks:
            x = blk(x, position_ids, packed, pad_between_seqs)
        return self.head(self.norm(x))


def _rms_norm_in_input_dtype(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    x = hidden_states
    weight = cast(torch.Tensor, self.weight)  # LlamaRMSNorm's parameter and float epsilon
    eps = cast(float, self.variance_epsilon)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


#: RMSNorms of the formula ``w * x / sqrt(mean(x**2) + eps)`` that upcast to float32: Llama's
#: and the hybrid families' (LFM2, Nemotron-H, Bamba, Granite-4 hybrid, Zamba2)
RMS_NORMS = (
    "LlamaRMSNorm",
    "Lfm2RMSNorm",
    "Lfm2MoeRMSNorm",
    "NemotronHRMSNorm",
    "BambaRMSNorm",
    "GraniteMoeHybridRMSNorm",
    "Zamba2RMSNorm",
)


def norms_in_model_dtype(model: nn.Module, classes: tuple[str, ...] = RMS_NORMS) -> nn.Module:
    """Make a float64 Hugging Face Llama compute its RMSNorms in float64; returns ``model``.

    ``LlamaRMSNorm`` upcasts to float32 (for bfloat16 stability) and casts back, so in a
    float64 model every normalised activation would be rounded to float32: float64 would
    then not be float64, and two groupings of the same tokens could differ by a float32
    rounding step. This swaps in the same formula, ``w * x / sqrt(mean(x**2) + eps)``,
    computed in the input's dtype, on every module of ``model`` whose class is named in
    ``classes`` (another model's RMSNorm, e.g. ``("Qwen2VLRMSNorm",)``; parameters and
    state-dict keys unchanged). Only for float64 models; other dtypes are left as they are.
    """
    for mod in model.modules():
        if type(mod).__name__ in classes:
            mod.forward = types.MethodType(_rms_norm_in_input_dtype, mod)
    return model


def small_text_config(
    vocab_size: int, *, dim: int, layers: int, heads: int, kv_heads: int, max_positions: int = 32768
) -> dict[str, Any]:
    """The keys of a small Llama-shaped language model's Hugging Face config: ``vocab_size`` ids,
    ``dim`` wide with an MLP twice that, ``layers`` layers of ``heads`` attention heads
    (``kv_heads`` key/value heads), ``max_positions`` positions, no attention dropout."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": dim,
        "intermediate_size": 2 * dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
        "attention_dropout": 0.0,
    }


def tiny_llama(
    vocab_size: int = 97, attn_implementation: str = "sdpa", seed: int = 0, dtype: torch.dtype = torch.float32
) -> Any:
    """A randomly initialised Hugging Face ``LlamaForCausalLM`` (nothing downloaded).

    ``dtype=torch.float64`` gives a model that computes in float64 throughout
    (:func:`norms_in_model_dtype`), except the ``eager`` attention's softmax, which
    Hugging Face computes in float32."""
    transformers = _optional.transformers()
    cfg = transformers.LlamaConfig(
        **small_text_config(vocab_size, dim=32, layers=2, heads=4, kv_heads=2, max_positions=4096),
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    model = mark_exact(transformers.LlamaForCausalLM(cfg).to(dtype).train())
    return norms_in_model_dtype(model) if dtype == torch.float64 else model
