"""sftpack's training attention for Hugging Face models, registered with transformers.

Packed rows run through variable-length attention, registered as
:data:`TRAIN_ATTENTION`: on CPU one causal 4-D SDPA call per segment (the fused
flash kernel: exact, differentiable, and much faster on long segments than the 3-D
call of :func:`sftpack.attention.varlen_attention`, which materialises the scores),
on CUDA :func:`sftpack.attention.varlen_attention` (flash-attn when installed).
Both boundary modes are honoured: ``padded`` hands the kernel ``cu_seqlens_padded``
for both sides, ``real`` the real lengths too (padding slots then get zero attention
output). Without boundaries (padded batches) it is one batched causal SDPA call.

A consumer of the handoff: the training loop's text models and the multimodal
models (:mod:`sftpack.multimodal`) both register it, and neither knows a path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._optional import transformers
from .attention import hf_attention_forward, varlen_attention

__all__ = ["TRAIN_ATTENTION", "register_train_attention"]

#: transformers attention name registered by :func:`register_train_attention`
TRAIN_ATTENTION = "sftpack_varlen_train"


class _Bounds:
    """The boundary fields :func:`sftpack.attention.varlen_attention` reads (Megatron's names)."""

    def __init__(self, real: torch.Tensor, padded: torch.Tensor, max_len: int | None) -> None:
        self.cu_seqlens_q = real
        self.cu_seqlens_q_padded = padded
        self.max_seqlen_q = max_len


def _segments_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: list[int],
    lens: list[int],
    scale: float | None,
) -> torch.Tensor:
    """Causal attention of each segment ``[s, s + n)`` with itself; zeros elsewhere.

    ``q`` ``(1, Hq, T, D)``, ``k``/``v`` ``(1, Hkv, T, D)`` as Hugging Face hands them;
    returns ``(1, T, Hq, D)``. Each call is a 4-D ``scaled_dot_product_attention``:
    on CPU that is the fused flash kernel (the 3-D call falls back to the math kernel
    and materialises the ``n x n`` scores).
    """
    rep = q.shape[1] // k.shape[1]
    T = q.shape[2]
    pieces, pos = [], 0
    for s, n in zip(starts, lens):
        if s > pos:
            pieces.append(q.new_zeros(1, q.shape[1], s - pos, v.shape[3]))
        ks, vs = k[:, :, s : s + n], v[:, :, s : s + n]
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        pieces.append(F.scaled_dot_product_attention(q[:, :, s : s + n], ks, vs, is_causal=True, scale=scale))
        pos = s + n
    if pos < T:
        pieces.append(q.new_zeros(1, q.shape[1], T - pos, v.shape[3]))
    return torch.cat(pieces, dim=2).transpose(1, 2)


def _train_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention over a packed row in either boundary mode.

    Boundaries come from ``cu_seq_lens_q`` (physical, padded, as
    :meth:`~sftpack.PackedBatch.to_hf_kwargs` gives them) and, in the ``real``
    mode, ``sftpack_cu_seqlens_real`` (real lengths: padding slots get zeros).
    On CUDA tensors :func:`sftpack.attention.varlen_attention` (flash-attn);
    without boundaries (padded batches) :func:`sftpack.attention.hf_attention_forward`.
    """
    real = kwargs.pop("sftpack_cu_seqlens_real", None)
    padded = kwargs.get("cu_seq_lens_q")
    if padded is None:
        return hf_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if dropout:
        raise ValueError("sftpack's reference attention has no dropout; set attention_dropout=0")
    if query.shape[0] != 1:
        raise ValueError(f"packed rows have batch size 1, got query of shape {tuple(query.shape)}")
    if query.is_cuda:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
        bounds = _Bounds(padded if real is None else real, padded, kwargs.get("max_length_q"))
        out = varlen_attention(q, k, v, bounds, pad_between_seqs=real is not None, softmax_scale=scaling)
        return out.unsqueeze(0), None
    starts = padded[:-1].tolist()
    lens = (padded[1:] - padded[:-1] if real is None else real[1:] - real[:-1]).tolist()
    return _segments_attention(query, key, value, starts, lens, scaling), None


def register_train_attention() -> str:
    """Register the training attention with transformers; returns its name."""
    hf = transformers()
    hf.AttentionInterface.register(TRAIN_ATTENTION, _train_attention)
    transformers("masking_utils").AttentionMaskInterface.register(TRAIN_ATTENTION, lambda *args, **kwargs: None)
    return TRAIN_ATTENTION
