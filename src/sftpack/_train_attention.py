"""sftpack's training attention for Hugging Face models, registered with transformers.

Packed rows run through :func:`sftpack.attention.hf_attention_forward`, registered as
:data:`TRAIN_ATTENTION` together with a mask function that builds no mask (the
boundaries come from the call, never from a dense mask): on CPU one 4-D SDPA call
per segment (the fused flash kernel: exact, differentiable, and much faster on long
segments than one call over a block-diagonal mask), on CUDA flash-attn when installed.
Boundaries come from ``cu_seq_lens_q`` (both boundary modes: ``padded`` hands the
kernel ``cu_seqlens_padded`` for both sides, ``real`` the real lengths too as
``sftpack_cu_seqlens_real``, and padding slots get zero output), else from the
restarts of ``position_ids`` (Hugging Face's packed form), else each row is one
sequence. Modules with ``is_causal=False`` (vision towers) attend bidirectionally.

A consumer of the handoff: the training loop's text models and the multimodal
models (:mod:`sftpack.multimodal`) both register it, and neither knows a path.
"""

from __future__ import annotations

from ._optional import transformers
from .attention import hf_attention_forward

__all__ = ["TRAIN_ATTENTION", "register_train_attention"]

#: transformers attention name registered by :func:`register_train_attention`
TRAIN_ATTENTION = "sftpack_varlen_train"

#: the function behind :data:`TRAIN_ATTENTION` (the small Llama calls it directly)
_train_attention = hf_attention_forward


def register_train_attention() -> str:
    """Register the training attention with transformers; returns its name."""
    hf = transformers()
    hf.AttentionInterface.register(TRAIN_ATTENTION, _train_attention)
    transformers("masking_utils").AttentionMaskInterface.register(TRAIN_ATTENTION, lambda *args, **kwargs: None)
    return TRAIN_ATTENTION
