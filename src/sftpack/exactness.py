"""Proof that packing is exact: packed vs. one-conversation-at-a-time.

Training on a packed row must give the same logits on real tokens, the same
token-mean loss and the same parameter gradients as running every conversation
alone. This module holds the small, real models and the comparison used by the
test suite (and by ``sftpack demo``), so anyone can run the same check against
their own packing settings.

- :class:`TinyCausalLM`: a plain-PyTorch causal transformer (RMSNorm, RoPE from
  ``position_ids``, grouped-query attention through :func:`sftpack.attention.varlen_attention`,
  SwiGLU MLP). Without boundaries it runs one ordinary causal sequence through
  ``scaled_dot_product_attention(is_causal=True)`` - the reference shares no
  packing code with the packed path.
- :func:`check_plain_model` / :func:`check_hf_model` return an
  :class:`ExactnessReport` with the largest differences.
- The tolerance of such a comparison, derived from the model's shape
  (:func:`rounding_chain`, :func:`tolerance`), and the guard every packed training run
  passes first (:func:`probe_packing`, :func:`require_exact_packing`): a few short
  synthetic sequences through the user's own model, packed against each alone, so that
  no model whose layers carry state across sequence boundaries trains packed unawares.

The reference labels are built here independently of :class:`~sftpack.PackedBatch`
(target of token ``t`` is token ``t+1`` when that one is trainable).
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import _optional
from .attention import register_hf_attention, varlen_attention
from .handoff import PackedBatch
from .hybrid import layer_kind, rounding_dtype
from .loss import loss_dtype
from .sample import IGNORE_INDEX, Sample

__all__ = [
    "ExactnessReport",
    "InexactPackingError",
    "PackingProbe",
    "TinyCausalLM",
    "check_hf_model",
    "check_plain_model",
    "mark_exact",
    "norms_in_model_dtype",
    "probe_packing",
    "reference_labels",
    "require_exact_packing",
    "rounding_chain",
    "tiny_llama",
    "tolerance",
]


def reference_labels(sample: Sample) -> torch.Tensor:
    """``(L,)`` shifted labels of one conversation on its own: ``ids[t+1]`` where
    ``loss_mask[t+1]``, else -100; the last token has no target."""
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long)
    mask = torch.as_tensor(sample.loss_mask, dtype=torch.bool)
    out = torch.full_like(ids, IGNORE_INDEX)
    out[:-1] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], IGNORE_INDEX))
    return out


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


@dataclass
class ExactnessReport:
    """Largest differences between the packed run and the per-conversation reference."""

    max_logit_diff: float
    loss_packed: float
    loss_reference: float
    max_grad_diff: float
    num_label_tokens: int

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_packed - self.loss_reference)

    def within(self, logits: float, loss: float, grads: float) -> bool:
        return self.max_logit_diff <= logits and self.loss_diff <= loss and self.max_grad_diff <= grads


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for p in model.parameters()]


def _compare(
    model: nn.Module,
    samples: Sequence[Sample],
    packed: PackedBatch,
    run_packed: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    run_single: Callable[[Sample], tuple[torch.Tensor, torch.Tensor, int]],
) -> ExactnessReport:
    model.zero_grad(set_to_none=True)
    logits, loss = run_packed()
    loss.backward()
    g_packed = _grads(model)

    model.zero_grad(set_to_none=True)
    starts = packed.cu_seqlens_padded[:-1].tolist()
    total_sum = torch.zeros((), dtype=logits.dtype)
    total_count = 0
    max_logit = 0.0
    with_grad = []
    for s, start in zip(samples, starts):
        ref_logits, loss_sum, count = run_single(s)
        got = logits[start : start + len(s)].detach()
        max_logit = max(max_logit, float((got - ref_logits.detach()).abs().max()))
        total_sum = total_sum + loss_sum
        total_count += count
        with_grad.append(loss_sum)
    ref_loss = total_sum / max(total_count, 1)
    if total_count:
        ref_loss.backward()
    g_ref = _grads(model)
    model.zero_grad(set_to_none=True)
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(g_packed, g_ref))
    return ExactnessReport(max_logit, float(loss.detach()), float(ref_loss.detach()), grad_diff, total_count)


def _for_loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(loss_dtype(logits.dtype))


def check_plain_model(
    model: TinyCausalLM,
    samples: Sequence[Sample],
    packed: PackedBatch,
    *,
    pad_between_seqs: bool = True,
    contaminate: bool = False,
) -> ExactnessReport:
    """Run ``packed`` through ``model`` in one pass (Megatron ``PackedSeqParams`` boundaries
    in the given mode) and each sample alone; compare logits, token-mean loss, gradients.

    ``contaminate=True`` is the negative control: the packed row is run as *one*
    causal sequence (positions still restart), so later sequences see earlier ones
    and the check must fail whenever there are two or more sequences.
    """
    params = None if contaminate else packed.to_packed_seq_params(pad_between_seqs=pad_between_seqs)

    def run_packed() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(packed.input_ids, packed.position_ids, params)
        n = max(packed.num_label_tokens, 1)
        loss = F.cross_entropy(_for_loss(logits), packed.labels, ignore_index=IGNORE_INDEX, reduction="sum") / n
        return logits, loss

    def run_single(s: Sample) -> tuple[torch.Tensor, torch.Tensor, int]:
        ids = torch.as_tensor(s.input_ids)
        logits = model(ids, torch.arange(len(s)), None)
        lab = reference_labels(s)
        loss_sum = F.cross_entropy(_for_loss(logits), lab, ignore_index=IGNORE_INDEX, reduction="sum")
        return logits, loss_sum, int((lab != IGNORE_INDEX).sum())

    return _compare(model, samples, packed, run_packed, run_single)


def _hf_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``labels`` unshifted: slot ``t`` predicts
    ``labels[t + 1]``), summed, in the logits' own dtype where that is float64."""
    shifted = torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])
    return F.cross_entropy(_for_loss(logits), shifted, ignore_index=IGNORE_INDEX, reduction="sum")


def check_hf_model(model: Any, samples: Sequence[Sample], packed: PackedBatch) -> ExactnessReport:
    """Same check for a Hugging Face causal LM fed ``packed.to_hf_kwargs()``; the
    reference runs each conversation as its own ``(1, L)`` batch.

    The loss is the model's own (``labels`` passed in), except for a float64 model:
    Hugging Face's loss upcasts the logits to float32, so there the same loss (the
    same shift of the same ``labels``) is computed from the logits in float64."""
    native = next(model.parameters()).dtype != torch.float64

    def run_packed() -> tuple[torch.Tensor, torch.Tensor]:
        kw = packed.to_hf_kwargs()
        labels = kw["labels"] if native else kw.pop("labels")
        out = model(**kw)
        if packed.num_label_tokens == 0:  # Hugging Face's mean over no targets is NaN
            return out.logits[0], out.logits.sum() * 0.0
        if native:
            return out.logits[0], out.loss
        return out.logits[0], _hf_loss_sum(out.logits[0], labels[0]) / packed.num_label_tokens

    def run_single(s: Sample) -> tuple[torch.Tensor, torch.Tensor, int]:
        ids = torch.as_tensor(s.input_ids)[None]
        lab = torch.as_tensor(s.input_ids).clone()
        lab[~torch.as_tensor(s.loss_mask)] = IGNORE_INDEX
        lab[0] = IGNORE_INDEX  # the first token is never a target
        count = int((lab != IGNORE_INDEX).sum())
        if not native:
            out = model(input_ids=ids, use_cache=False)
            loss_sum = _hf_loss_sum(out.logits[0], lab) if count else out.logits.sum() * 0.0
            return out.logits[0], loss_sum, count
        out = model(input_ids=ids, labels=lab[None] if count else None, use_cache=False)
        loss_sum = out.loss * count if count else out.logits.sum() * 0.0
        return out.logits[0], loss_sum, count

    return _compare(model, samples, packed, run_packed, run_single)


def random_samples(lengths: Sequence[int], vocab_size: int, seed: int = 0, p_train: float = 0.7) -> list[Sample]:
    """Random ids and loss masks for the given lengths (seeded)."""
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(1, vocab_size, n), rng.random(n) < p_train, i) for i, n in enumerate(lengths)]


def exactness_table(
    trials: int = 5,
    pad_multiples: Sequence[int] = (1, 4, 8),
    seed: int = 0,
    max_len: int = 64,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, Any]]:
    """Measure the worst differences over ``trials`` seeded random rows for every
    consumer and boundary mode; one dict per (consumer, mode, pad multiple).

    ``dtype=torch.float64`` runs every model in float64 (Hugging Face's ``eager``
    attention still takes its softmax in float32)."""
    rng = np.random.default_rng(seed)
    vocab = 97
    plain = TinyCausalLM(vocab_size=vocab, seed=seed, dtype=dtype)
    hf_impl = register_hf_attention()
    consumers: list[tuple[str, str, Callable[[list[Sample], PackedBatch], ExactnessReport]]] = [
        ("plain + PackedSeqParams", "real+padded", lambda s, p: check_plain_model(plain, s, p, pad_between_seqs=True)),
        (
            "plain + PackedSeqParams",
            "padded-for-both",
            lambda s, p: check_plain_model(plain, s, p, pad_between_seqs=False),
        ),
    ]
    for impl in ("sdpa", "eager", hf_impl):
        model = tiny_llama(vocab, attn_implementation=impl, seed=seed, dtype=dtype)
        mode = "cu_seq_lens (padded)" if impl == hf_impl else "position_ids"
        consumers.append((f"HF Llama ({impl})", mode, functools.partial(check_hf_model, model)))
    rows = []
    batches = []
    for _ in range(trials):
        lens = rng.integers(1, max_len + 1, size=int(rng.integers(1, 9))).tolist()
        batches.append(random_samples(lens, vocab, seed=int(rng.integers(1 << 30))))
    for name, mode, fn in consumers:
        for pm in pad_multiples:
            worst = dict(logits=0.0, loss=0.0, grads=0.0)
            for samples in batches:
                r = fn(samples, PackedBatch.from_samples(samples, pad_multiple=pm))
                worst["logits"] = max(worst["logits"], r.max_logit_diff)
                worst["loss"] = max(worst["loss"], r.loss_diff)
                worst["grads"] = max(worst["grads"], r.max_grad_diff)
            rows.append({"consumer": name, "mode": mode, "pad_multiple": pm, "trials": trials, **worst})
    return rows


# ------------------------------------------------------------- the tolerance, derived from the model's shape
#: unit roundoff of each dtype a comparison may run in
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24}
#: the config keys of a feed-forward block's width, by the names Hugging Face's configs use
_MLP_WIDTH_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "mlp_dim", "inner_dim")


def _int_of(cfg: Any, *names: str) -> int:
    """The first of ``names`` that ``cfg`` holds as a positive integer, else 0."""
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _widest_matmul(model: Any) -> int:
    """The longest dot product of any linear map of ``model`` but its output head: the largest
    ``in_features`` of a ``Linear`` (or of transformers' ``Conv1D``, GPT-2's, whose weight is
    ``(in, out)``); 0 when there is none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    widest = 0
    for mod in model.modules():
        if mod is head:
            continue
        if isinstance(mod, nn.Linear):
            widest = max(widest, mod.in_features)
        elif type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2:
            widest = max(widest, int(mod.weight.shape[0]))
    return widest


def rounding_chain(model: Any, row_width: int, patches: int = 0) -> int:
    """An upper bound of the longest chain of roundings (terms of one sum, summed along one
    path) in one forward and backward pass of ``model`` over a row of ``row_width`` slots
    holding ``patches`` vision patches: per language layer the hidden width, the widest
    feed-forward or projection (the config's MLP width, ``intermediate_size``, OPT's
    ``ffn_dim``, GPT-2's ``n_inner``... or the longest dot product of any of the model's linear
    maps, whichever is larger) and the row (attention and the gradients' sums over tokens), per
    vision layer the same over the patches, twice (forward and backward), plus the vocabulary
    (the softmax) and the row (the loss).

    Raises:
        ValueError: a config that names no layer count or vocabulary (nothing to bound).
    """
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layers = _int_of(text, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _int_of(text, "vocab_size")
    widest = _widest_matmul(model)
    hidden = _int_of(text, "hidden_size", "n_embd", "d_model") or widest
    mlp = max(_int_of(text, *_MLP_WIDTH_KEYS), widest)
    if not (layers and vocab and hidden):
        missing = [
            n for n, v in (("num_hidden_layers", layers), ("vocab_size", vocab), ("hidden_size", hidden)) if not v
        ]
        raise ValueError(
            f"{type(model).__name__}: its config names no {' or '.join(missing)}, so no tolerance can be derived "
            "from the model's shape: this model cannot be checked"
        )
    n = layers * (hidden + mlp + row_width)
    vision = getattr(cfg, "vision_config", None)
    if vision is not None and patches:
        width = int(getattr(vision, "embed_dim", 0) or getattr(vision, "hidden_size", 0))
        vmlp = int(getattr(vision, "intermediate_size", 0) or width * getattr(vision, "mlp_ratio", 4))
        depth = int(getattr(vision, "depth", 0) or getattr(vision, "num_hidden_layers", 0))
        n += depth * (width + vmlp + patches)
    return 2 * n + vocab + row_width


def tolerance(chain: int, dtype: torch.dtype, magnitude: float) -> float:
    """The largest difference two runs of one function in other summation orders may show on
    values of ``magnitude`` (floored at 1), over a rounding ``chain``: an ``n``-term sum is off
    by at most ``n * u`` of its terms' magnitude sum (Higham, *Accuracy and Stability of
    Numerical Algorithms*, section 3.1); in float64 ``2 * n * u`` (two runs), ``u = 2**-53``; in
    float32 the ``sqrt(n) * u`` growth of Higham & Mary (2019) with ``lambda = 10`` (exceeded
    with probability below 1e-20), ``2 * 10 * sqrt(n) * u``, ``u = 2**-24``."""
    u = UNIT_ROUNDOFF[dtype]
    scale = max(1.0, magnitude)
    if dtype == torch.float64:
        return 2 * chain * u * scale
    return 2 * 10 * math.sqrt(chain) * u * scale


# ------------------------------------------------------------- the guard: is packing exact on this model?
#: the attribute that marks a model whose packing the suite proves exact (:func:`mark_exact`)
_PROVEN = "_sftpack_packing_proven"
#: the attribute caching a model's probe (one probe per model, however many entry points ask)
_PROBED = "_sftpack_packing_probe"
#: substrings of the class names of layers that carry state along the sequence (recurrences,
#: causal convolutions): where a leak across packed boundaries comes from
_STATEFUL = ("Mamba", "Mixer", "Conv", "DeltaNet", "Recurrent", "Rwkv", "RWKV", "Ssm", "SSM", "LinearAttention")
#: the synthetic sequences of the probe: short, more than one (a leak shows in the later ones),
#: longer than the usual causal-conv kernel (3 or 4), of other lengths (no alignment by chance)
PROBE_LENGTHS = (9, 6, 7)


class InexactPackingError(ValueError):
    """Packing is not exact on this model: a packed row's logits differ from each sequence
    alone (:func:`require_exact_packing`); the message names the layers that carry state and
    the fix."""


def mark_exact(model: Any) -> Any:
    """Mark ``model`` as one whose packing the test suite proves exact (the models sftpack
    builds itself: ``build_model``, :func:`tiny_llama`, the families' tiny models), so that
    :func:`require_exact_packing` skips its probe; returns ``model``."""
    object.__setattr__(model, _PROVEN, True)
    return model


@dataclass(frozen=True)
class PackingProbe:
    """What :func:`probe_packing` found: the largest ``|packed - alone|`` logit of the
    synthetic sequences, its tolerance, and the layers that carry state along a sequence."""

    model: str  #: the model's class
    difference: float
    tolerance: float
    carriers: tuple[str, ...]  #: e.g. ``("Mamba2 mixer (NemotronHMamba2Mixer)",)``; may be empty
    dtype: str = "float64"  #: what the probe computed in

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance

    def describe(self) -> str:
        """One line: what differs and why."""
        where = (
            f"its {', '.join(self.carriers)} layers carry state from one sequence of a row into the next"
            if self.carriers
            else "a layer of it sees across the sequence boundaries of a packed row"
        )
        return (
            f"packing is not exact on {self.model}: a packed row's logits differ from each sequence alone by "
            f"{self.difference:.2g} (tolerance {self.tolerance:.2g}); {where}"
        )


def state_carrying_layers(model: Any) -> tuple[str, ...]:
    """The kinds of ``model``'s layers that carry state along the sequence (a recurrence, a
    causal convolution: Mamba and Mamba2 mixers, short convolutions, gated delta nets...), as
    ``"kind (Class)"``, in the order they first occur: the kinds :mod:`sftpack.hybrid` covers
    by their names (:data:`sftpack.hybrid.LAYER_KINDS`), any other by its class name (a
    recurrent layer, or one that owns a 1-D convolution: a Mamba (v1) mixer). torch's own
    modules are not named (a convolution inside such a layer is named by the layer, and GPT-2's
    ``Conv1D``, a linear map, not at all)."""
    found: dict[str, None] = {}
    for mod in model.modules():
        cls = type(mod)
        if cls.__module__.startswith("torch."):
            continue
        name = cls.__name__
        covered = layer_kind(mod)
        if covered is not None:
            found[f"{covered.name} ({name})"] = None
            continue
        if not any(k in name for k in _STATEFUL) or name == "Conv1D" or "Vision" in name or "Patch" in name:
            continue
        recurrent = any(k in name for k in ("Recurrent", "Rwkv", "RWKV"))
        if not recurrent and not any(isinstance(c, nn.Conv1d) for c in mod.children()):
            continue  # a model, a block or a norm named after its family: the layer below it is named
        kind = (
            "Mamba2 mixer"
            if "Mamba2" in name or ("Mixer" in name and "Mamba" not in name)
            else "Mamba mixer"
            if "Mamba" in name
            else "short conv"
            if "Conv" in name
            else "gated delta net"
            if "DeltaNet" in name
            else "recurrent"
        )
        found[f"{kind} ({name})"] = None
    return tuple(found)


def packed_text_logits(model: Any, batch: PackedBatch, *, pad_between_seqs: bool) -> torch.Tensor:
    """``(T, vocab)`` logits of a Hugging Face causal LM over one packed row, fed as
    ``sftpack train`` feeds it (:meth:`PackedBatch.to_hf_kwargs`, and under sftpack's training
    attention with ``pad_between_seqs`` the real boundaries too)."""
    from ._train_attention import TRAIN_ATTENTION

    kw = batch.to_hf_kwargs()
    kw.pop("labels")
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if pad_between_seqs and getattr(text, "_attn_implementation", None) == TRAIN_ATTENTION:
        kw["sftpack_cu_seqlens_real"] = batch.cu_seqlens
    return cast(torch.Tensor, model(**kw).logits[0])


def alone_text_logits(model: Any, sample: Sample) -> torch.Tensor:
    """``(L, vocab)`` logits of one sample alone, as one ordinary ``(1, L)`` sequence."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long, device=device)[None]
    return cast(torch.Tensor, model(input_ids=ids, use_cache=False).logits[0])


class _Upcast:
    """Every floating parameter and buffer of a model in ``dtype`` (float64 or float32) for a
    while, then each back in its own dtype: lossless (every lower-precision value is a value of
    the wider dtype), and the same parameter objects throughout. In float64 its RMSNorms that
    upcast to float32 (:data:`RMS_NORMS`) compute in float64 meanwhile, and routed experts run
    transformers' own per-expert loop (``eager``: the grouped-matmul kernel takes no float64)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.saved: list[tuple[torch.Tensor, torch.dtype]] = []
        self.norms: list[nn.Module] = []
        self.experts: list[tuple[Any, str]] = []

    def __enter__(self) -> None:
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.is_floating_point() and t.element_size() < self.dtype.itemsize:
                self.saved.append((t, t.dtype))
                t.data = t.data.to(self.dtype)
        if self.dtype == torch.float64:  # RMSNorms that upcast to float32 compute in float64 meanwhile
            self.norms = [
                m for m in self.model.modules() if type(m).__name__ in RMS_NORMS and "forward" not in m.__dict__
            ]
            norms_in_model_dtype(self.model)
            # routed experts: their grouped-matmul kernel takes no float64, their own loop does
            configs: dict[int, Any] = {
                id(m.config): m.config for m in self.model.modules() if hasattr(m, "_is_expert_parallel")
            }
            for cfg in configs.values():
                impl = getattr(cfg, "_experts_implementation", None)
                if impl not in (None, "eager"):
                    self.experts.append((cfg, str(impl)))
                    cfg._experts_implementation = "eager"

    def __exit__(self, *exc: object) -> None:
        for t, dtype in self.saved:
            t.data = t.data.to(dtype)
        self.saved.clear()
        for m in self.norms:
            del m.forward
        self.norms = []
        for cfg, impl in self.experts:
            cfg._experts_implementation = impl
        self.experts = []


def _probe_dtype(model: nn.Module) -> torch.dtype:
    """float64, unless the model is on a CUDA device whose free memory cannot hold its weights in
    float64 beside their own copy (a model loaded whole before FSDP shards it): then float32."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return torch.float64
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    extra = sum(t.numel() * max(8 - t.element_size(), 0) for t in tensors)
    free, _ = torch.cuda.mem_get_info(device)
    return torch.float64 if extra < 0.8 * free else torch.float32


def probe_packing(
    model: Any,
    *,
    pad_between_seqs: bool = True,
    pad_multiple: int = 1,
    lengths: Sequence[int] = PROBE_LENGTHS,
    seed: int = 0,
    family: Any = None,
    dtype: torch.dtype | None = None,
) -> PackingProbe:
    """Run a few short synthetic sequences (seeded random ids of ``model``'s vocabulary) through
    ``model`` packed into one row (as ``sftpack train`` feeds it) and each alone, and compare
    the logits of every real token: a layer that carries state across the row's sequence
    boundaries (a Mamba mixer, a short convolution) makes the later sequences differ. A
    vision-language model runs its ``family``'s packed and alone forwards
    (:func:`sftpack.multimodal.family_for`; text-only sequences).

    The comparison runs in float64 whatever the model's dtype (``dtype=None``): its parameters
    are turned to float64 for the probe and back afterwards, losslessly (every lower-precision
    value is a float64 value). In its own dtype a small leak can hide below that dtype's
    rounding (a tiny LFM2's convolution leaks 4.5e-5 against a float32 tolerance of 9.3e-5); in
    float64 the tolerance (:func:`tolerance` of :func:`rounding_chain`, the magnitude of the
    logits) is about 1e-12. The weights held in float64 take 8 bytes a parameter for that
    moment: what AdamW's step holds for a bfloat16 model anyway. On a CUDA device without the
    free memory for that (a big model loaded whole before FSDP shards it) the probe runs in
    float32 and its tolerance: a leak as large as a Mamba2 mixer's is still far above it, one
    as small as that LFM2's is not. Dropout is off during the probe (eval mode, then the
    model's mode again); no gradient is formed.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.get_input_embeddings().num_embeddings)
    samples = [
        Sample(torch.randint(1, max(vocab, 2), (n,), generator=gen).numpy(), np.ones(n, dtype=bool), i)
        for i, n in enumerate(lengths)
    ]
    batch = PackedBatch.from_samples(samples, pad_multiple=pad_multiple)
    device = next(model.parameters()).device
    batch = batch.to(device)
    dtype = dtype or _probe_dtype(model)
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"probe_packing: dtype must be torch.float64 or torch.float32, got {dtype}")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _Upcast(model, dtype):
            rounds = rounding_dtype(model, dtype)  # a hybrid layer's own code may round to float32
            if family is not None:
                packed = family.packed_logits(model, batch, pad_between_seqs=pad_between_seqs)
                alone = [family.alone_logits(model, s) for s in samples]
            else:
                packed = packed_text_logits(model, batch, pad_between_seqs=pad_between_seqs)
                alone = [alone_text_logits(model, s) for s in samples]
    finally:
        model.train(was_training)
    cu, cup = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    diff = max(
        float((packed[cup[i] : cup[i] + cu[i + 1] - cu[i]].double() - a.double()).abs().max())
        for i, a in enumerate(alone)
    )
    magnitude = max(float(a.abs().max()) for a in alone)
    tol = tolerance(rounding_chain(model, int(batch.input_ids.numel())), rounds, magnitude)
    return PackingProbe(
        type(model).__name__, diff, tol, state_carrying_layers(model), str(dtype).removeprefix("torch.")
    )


def require_exact_packing(
    model: Any, *, pad_between_seqs: bool = True, pad_multiple: int = 1, allow: bool = False, family: Any = None
) -> PackingProbe | None:
    """The guard of every packed training run (:func:`sftpack.loop.train` calls it before its
    first step): :func:`probe_packing` on ``model`` (a vision-language model through its
    ``family``), once per model (the result is kept on it);
    ``None`` for a model sftpack built itself (:func:`mark_exact`: proven by the test suite).

    Raises:
        InexactPackingError: the probe differs, and ``allow`` is false: one line naming the
            layers that carry state and the fixes (train padded, ``packing="none"``; a model
            whose layers are attention and MLPs; or ``allow_inexact_packing``). With ``allow``
            the same line is a warning (once per model), and the run goes on.
    """
    if getattr(model, _PROVEN, False):
        return None
    probe: PackingProbe | None = getattr(model, _PROBED, None)
    if probe is None:
        probe = probe_packing(model, pad_between_seqs=pad_between_seqs, pad_multiple=pad_multiple, family=family)
        object.__setattr__(model, _PROBED, probe)
        if not probe.ok and allow:
            warnings.warn(
                f"{probe.describe()}; training packed anyway (--allow-inexact-packing): its sequences see each "
                "other's state",
                stacklevel=2,
            )
    if not probe.ok and not allow:
        raise InexactPackingError(
            f"{probe.describe()}: train it padded (--packing none), or a model whose layers are attention and MLPs "
            "(Llama, Qwen2, Qwen3...) or ones sftpack.hybrid keeps apart (Mamba2 mixers, gated delta nets, short "
            "convolutions: docs/hybrid.md), or pass --allow-inexact-packing (TrainConfig(allow_inexact_packing=True)) "
            "to train packed anyway"
        )
    return probe
