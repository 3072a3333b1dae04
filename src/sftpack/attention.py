"""Reference variable-length causal attention over a packed run.

Given queries, keys and values in THD layout (``(T, heads, head_dim)``) and the
boundaries of a :class:`~sftpack.PackedBatch` (or a Megatron ``PackedSeqParams``),
each sequence attends causally to itself and to nothing else.

On CPU the fastest *exact* reference is a loop over segments, one causal
``scaled_dot_product_attention`` per segment (an explicit block-diagonal mask
costs a dense ``T x T`` score matrix instead). It is differentiable, so it backs the exactness tests. On
CUDA tensors with flash-attn installed it dispatches to
``flash_attn_varlen_func`` instead.

Boundary modes, as Transformer Engine reads them:

- ``pad_between_seqs=True``: segment ``i`` holds ``cu_seqlens[i+1]-cu_seqlens[i]``
  real tokens starting at ``cu_seqlens_padded[i]``; attention runs over the real
  tokens only and padding slots get zeros.
- ``pad_between_seqs=False``: the padded offsets are the boundaries; each padded
  segment is one causal sequence. Padding trails the real tokens, so under a causal
  mask no real token ever sees it: real outputs are identical to the mode above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import _optional
from .handoff.slots import real_token_mask

__all__ = [
    "UnsupportedAttentionError",
    "varlen_attention",
    "boundaries_of",
    "hf_attention_forward",
    "register_hf_attention",
    "TRAIN_ATTENTION",
    "register_train_attention",
]


def boundaries_of(packed: Any, pad_between_seqs: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """``(cu_seqlens, cu_seqlens_padded, max_seqlen, pad_between_seqs)`` of a
    :class:`~sftpack.PackedBatch` or a Megatron ``PackedSeqParams``.

    For ``PackedSeqParams`` the mode follows Transformer Engine's rule: padding
    between sequences unless ``cu_seqlens_q_padded`` is missing or is the very
    same tensor object as ``cu_seqlens_q``. For a ``PackedBatch`` it defaults to True.
    """
    if hasattr(packed, "cu_seqlens_q"):  # megatron.core PackedSeqParams
        cu = packed.cu_seqlens_q
        cup = packed.cu_seqlens_q_padded
        mode = cup is not None and cup is not cu
        if cup is None:
            cup = cu
        max_len = packed.max_seqlen_q
    else:
        cu, cup, max_len = packed.cu_seqlens, packed.cu_seqlens_padded, packed.max_seqlen
        mode = True
    if pad_between_seqs is not None:
        mode = bool(pad_between_seqs)
    if max_len is None:
        max_len = int((cup[1:] - cup[:-1]).max())
    return cu, cup, int(max_len), mode


def _flash_attn_varlen() -> Callable[..., Any] | None:
    return _optional.flash_attn_varlen_func()


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: Any,
    *,
    pad_between_seqs: bool | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of every sequence with itself only.

    Args:
        q: ``(T, Hq, D)`` queries of the whole flat run.
        k, v: ``(T, Hkv, D)``; ``Hq`` must be a multiple of ``Hkv`` (grouped-query
            attention repeats each key/value head ``Hq // Hkv`` times).
        packed: a :class:`~sftpack.PackedBatch` or a Megatron ``PackedSeqParams``.
        pad_between_seqs: override the boundary mode (see the module docstring).
        causal: causal mask inside each sequence.
        softmax_scale: defaults to ``1/sqrt(D)``.
        backend: ``"auto"`` (flash-attn on CUDA when installed, else the reference
            loop), ``"reference"`` or ``"flash"``.

    Returns:
        ``(T, Hq, D)``; padding slots are zero when ``pad_between_seqs`` is True.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention takes THD tensors (T, heads, head_dim); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    T, hq, d = q.shape
    if k.shape[0] != T or v.shape[0] != T:
        raise ValueError(f"q, k, v must share T; got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    cu, cup, max_len, mode = boundaries_of(packed, pad_between_seqs)
    if int(cup[-1]) != T:
        raise ValueError(
            f"the boundaries cover {int(cup[-1])} slots but q has T={T}: pass the PackedBatch of these tokens"
        )
    if backend not in ("auto", "reference", "flash"):
        raise ValueError(f"backend must be one of 'auto', 'reference', 'flash', got {backend!r}")
    flash = _flash_attn_varlen() if (q.is_cuda and backend != "reference") else None
    if backend == "flash" and flash is None:
        raise RuntimeError("backend='flash' needs CUDA tensors and the flash-attn package")
    if flash is not None:
        out = flash(
            q,
            k,
            v,
            cu_seqlens_q=cup,
            cu_seqlens_k=cup,
            max_seqlen_q=max_len,
            max_seqlen_k=max_len,
            softmax_scale=softmax_scale,
            causal=causal,
        )
        if mode:
            real = real_token_mask(cu, cup, T)
            out = out * real.view(T, 1, 1).to(out.dtype)
        return out
    return _reference(q, k, v, cu, cup, mode, causal, softmax_scale)


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    cup: torch.Tensor,
    pad_between_seqs: bool,
    causal: bool,
    softmax_scale: float | None,
) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    starts = cup[:-1].tolist()
    if pad_between_seqs:
        lens = (cu[1:] - cu[:-1]).tolist()
    else:
        lens = (cup[1:] - cup[:-1]).tolist()
    pieces = []
    pos = 0
    for s, n in zip(starts, lens):
        if s > pos:  # padding slots of the previous segment (mode True only)
            pieces.append(q.new_zeros(s - pos, q.shape[1], v.shape[2]))
        qs = q[s : s + n].transpose(0, 1)  # (H, n, D)
        ks = k[s : s + n].transpose(0, 1)
        vs = v[s : s + n].transpose(0, 1)
        if rep > 1:
            ks = ks.repeat_interleave(rep, dim=0)
            vs = vs.repeat_interleave(rep, dim=0)
        # 4-D (1, H, n, D): on CPU, 3-D inputs fall back to the slow math kernel.
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=causal, scale=softmax_scale)[0]
        pieces.append(o.transpose(0, 1))
        pos = s + n
    if pos < q.shape[0]:
        pieces.append(q.new_zeros(q.shape[0] - pos, q.shape[1], v.shape[2]))
    return torch.cat(pieces, dim=0)


# ------------------------------------------------------------- Hugging Face
HF_ATTENTION_NAME = "sftpack_varlen"


def _hf_is_causal(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Hugging Face's rule: the call's ``is_causal`` wins, else the module's (vision towers set False)."""
    flag = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if flag is None else flag)


def _restarts_of(position_ids: torch.Tensor | None, batch: int, width: int) -> list[torch.Tensor] | None:
    """Per row, the ``(N+1,)`` int32 segment offsets that Hugging Face's own kernels read
    from ``position_ids`` ``(B, T)`` when no boundaries are given: a new sequence starts
    wherever a position is not its predecessor plus one (its packed form, "position ids
    restarting per sample"). ``None`` when no row restarts (or there are no positions).
    """
    if position_ids is None or position_ids.dim() != 2 or tuple(position_ids.shape) != (batch, width):
        return None
    step = torch.diff(position_ids, dim=-1) != 1
    if not bool(step.any()):
        return None
    rows = []
    ends = torch.tensor([width], dtype=torch.int32, device=position_ids.device)
    zero = torch.zeros(1, dtype=torch.int32, device=position_ids.device)
    for b in range(batch):
        starts = (torch.nonzero(step[b]).flatten() + 1).to(torch.int32)
        rows.append(torch.cat([zero, starts, ends]))
    return rows


class UnsupportedAttentionError(ValueError):
    """A model asks the attention for an option of Hugging Face's kernels that sftpack's attention
    does not compute (``option``: ``"softcap"``, ``"s_aux"`` or ``"sliding_window"``; ``module``:
    the attention's class; ``window``/``longest``: the sliding window and the longest sequence).
    The message is the library's advice; a command that cannot follow it (``sftpack verify``
    always runs sftpack's attention) says its own from these fields."""

    def __init__(self, message: str, *, option: str, module: str, window: int = 0, longest: int = 0) -> None:
        super().__init__(message)
        self.option, self.module, self.window, self.longest = option, module, window, longest


def _refuse_unsupported(module: torch.nn.Module, kwargs: dict[str, Any], longest: Callable[[], int]) -> None:
    """Options of Hugging Face's kernels this attention does not compute: refused, never ignored."""
    name = type(module).__name__
    for key in ("softcap", "s_aux"):
        if kwargs.get(key) is not None:
            raise UnsupportedAttentionError(
                f"{name} asks for {key}={kwargs[key]!r}, which sftpack's attention does not compute: "
                "load this model with attn_implementation='sdpa' or 'flash_attention_2'",
                option=key,
                module=name,
            )
    window = kwargs.get("sliding_window")
    if window is not None and longest() > int(window):
        raise UnsupportedAttentionError(
            f"{name} uses a sliding window of {int(window)} tokens and a sequence here has {longest()}: "
            "sftpack's attention is full attention within each sequence; cap --max-seq-len at the window, "
            "or load this model with attn_implementation='sdpa' or 'flash_attention_2'",
            option="sliding_window",
            module=name,
            window=int(window),
            longest=longest(),
        )


class _HfBounds:
    """The boundary fields :func:`varlen_attention` reads (Megatron's names)."""

    def __init__(self, real: torch.Tensor, padded: torch.Tensor, max_len: Any) -> None:
        self.cu_seqlens_q = real
        self.cu_seqlens_q_padded = padded
        self.max_seqlen_q = None if max_len is None else int(max_len)


def _packed_row(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padded: torch.Tensor,
    real: torch.Tensor | None,
    max_len: Any,
    scaling: float | None,
    causal: bool,
) -> torch.Tensor:
    """One row ``(H, T, D)`` of Hugging Face's layout through :func:`varlen_attention`; ``(T, H, D)``."""
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))
    bounds = _HfBounds(padded if real is None else real, padded, max_len)
    return varlen_attention(q, k, v, bounds, pad_between_seqs=real is not None, causal=causal, softmax_scale=scaling)


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A Hugging Face attention implementation backed by :func:`varlen_attention`.

    ``query`` ``(B, Hq, T, D)``, ``key``/``value`` ``(B, Hkv, T, D)`` as Hugging Face
    hands them; returns ``(B, T, Hq, D)``. The boundaries, in the order Hugging Face's
    flash-attention integration reads them:

    1. ``cu_seq_lens_q`` / ``max_length_q`` (physical offsets, as
       :meth:`PackedBatch.to_hf_kwargs` supplies them; one row, ``B == 1``), with the
       real lengths as ``sftpack_cu_seqlens_real`` in the ``real`` boundary mode
       (padding slots then get zeros);
    2. else the restarts of ``position_ids`` (Hugging Face's documented packed form:
       positions restarting per sample, no mask), row by row;
    3. else each row is one sequence.

    Attention is causal unless the call or the module says ``is_causal=False`` (the
    vision towers: bidirectional within each image). Options it does not compute
    (``softcap``, attention sinks, a sliding window shorter than a sequence) are refused.
    """
    if dropout:
        raise ValueError("sftpack's reference attention has no dropout; set attention_dropout=0")
    causal = _hf_is_causal(module, kwargs)
    real = kwargs.get("sftpack_cu_seqlens_real")
    cu = kwargs.get("cu_seq_lens_q")
    batch, width = query.shape[0], query.shape[2]
    if cu is not None:
        if batch != 1:
            raise ValueError(f"packed rows have batch size 1, got query of shape {tuple(query.shape)}")
        lens = cu if real is None else real
        _refuse_unsupported(module, kwargs, lambda: int((lens[1:] - lens[:-1]).max()))
        out = _packed_row(query[0], key[0], value[0], cu, real, kwargs.get("max_length_q"), scaling, causal)
        return out.unsqueeze(0), None
    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation={HF_ATTENTION_NAME!r} takes packed rows (call the model with "
            "**packed.to_hf_kwargs()) or unpadded rows without an attention_mask"
        )
    rows = _restarts_of(kwargs.get("position_ids"), batch, width)
    if rows is not None:
        _refuse_unsupported(module, kwargs, lambda: max(int((r[1:] - r[:-1]).max()) for r in rows))
        outs = [_packed_row(query[b], key[b], value[b], rows[b], None, None, scaling, causal) for b in range(batch)]
        return torch.stack(outs), None
    # No boundaries: every row is one whole sequence.
    _refuse_unsupported(module, kwargs, lambda: width)
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, dim=1) if rep > 1 else key
    v = value.repeat_interleave(rep, dim=1) if rep > 1 else value
    out = F.scaled_dot_product_attention(query, k, v, is_causal=causal, scale=scaling)
    return out.transpose(1, 2), None


def register_hf_attention(name: str = HF_ATTENTION_NAME) -> str:
    """Register :func:`hf_attention_forward` with transformers under ``name`` (and a
    mask function that builds no mask: the boundaries come from ``cu_seq_lens``).
    Then ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)``."""
    _optional.transformers().AttentionInterface.register(name, hf_attention_forward)
    _optional.transformers("masking_utils").AttentionMaskInterface.register(name, lambda *args, **kwargs: None)
    return name


#: the attention name sftpack's training registers (:func:`register_train_attention`): the training
#: loop's text models, the multimodal families' models and the exactness guard run packed rows
#: under it, and a model saved by ``sftpack train`` is loaded back with it
TRAIN_ATTENTION = "sftpack_varlen_train"


def register_train_attention() -> str:
    """Register :func:`hf_attention_forward` as :data:`TRAIN_ATTENTION` (:func:`register_hf_attention`
    under the training's name); returns the name."""
    return register_hf_attention(TRAIN_ATTENTION)
