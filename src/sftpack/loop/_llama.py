"""The default model of ``sftpack train``: a small Llama written in plain torch.

Why not transformers' ``LlamaForCausalLM``, which :func:`~sftpack.loop.build_model`
builds? Only for start-up time. Importing its modeling code costs about 4 s on a
2-core CPU (``transformers.models`` scans every model folder, and
``modeling_utils`` pulls in ``torch.distributed.tensor``, sympy and hub
integrations), longer than the rest of a cached run to its first step. The
network is the same, so :class:`SmallLlama` mirrors ``LlamaForCausalLM`` op for
op:

* the parameters have the same names and shapes, so a ``state_dict`` loads into
  either model;
* :func:`build_small_llama` draws the same weights as
  ``build_model(..., impl="transformers")`` for the same seed, in the same order
  (torch's default init of each module as it is built, then transformers'
  ``normal(0, 0.02)`` of the body, then the head's);
* the forward pass uses the same ops in the same order: RMSNorm in at least
  float32, rotary angles in float32, GQA, SiLU MLP, and attention through
  :mod:`sftpack.attention`, the function ``build_model`` registers with
  transformers.

``tests/loop/test_llama.py`` pins all three: equal weights, float32 outputs
bit for bit equal, and float64 logits, loss and gradients equal to a fixed
tolerance on packed rows in both boundary modes and on padded batches.

What it leaves out: a KV cache, generation, ``save_pretrained``, dropout and
rotary scaling. It is for training; use ``build_model(..., impl="transformers")``
or ``--model DIR`` for a Hugging Face model (the HF ``Trainer``
collators need one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import TRAIN_ATTENTION, hf_attention_forward

__all__ = ["SmallLlama", "SmallLlamaConfig", "build_small_llama"]


@dataclass
class SmallLlamaConfig:
    """The fields of transformers' ``LlamaConfig`` that :class:`SmallLlama` uses,
    with its defaults (``rope_theta`` 10,000, ``rms_norm_eps`` 1e-6,
    ``initializer_range`` 0.02, no biases, no tied head)."""

    vocab_size: int
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    #: the attention every layer runs (read by the training loop's ``LossModule``)
    _attn_implementation: str = TRAIN_ATTENTION

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SmallLlamaConfig.{name} must be a positive integer, got {value!r}")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads < 1 or kv < 1 or heads % kv or self.hidden_size % heads or (self.hidden_size // heads) % 2:
            raise ValueError(
                f"SmallLlamaConfig: hidden_size {self.hidden_size} with {heads} heads and {kv} key/value heads: "
                "the heads must divide hidden_size into an even head size, and the key/value heads the heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class BodyOutput:
    """The body's output: ``last_hidden_state`` ``(B, T, hidden)`` after the final norm."""

    last_hidden_state: torch.Tensor


@dataclass
class CausalLMOutput:
    """``logits`` ``(B, T, vocab)``; ``loss``: the mean next-token cross-entropy over
    labels that are not -100 (``labels`` unshifted, as Hugging Face takes them), or ``None``."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x**2) + eps)``, computed in float32 for float32 and narrower
    inputs (as ``LlamaRMSNorm``) and in float64 for float64 ones (as
    :func:`sftpack.exactness.norms_in_model_dtype` makes it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class Rotary(nn.Module):
    """Rotary embedding tables ``cos, sin`` ``(B, T, head_dim)`` for ``position_ids`` ``(B, T)``,
    the angles formed in float32 whatever the model's dtype (as transformers does)."""

    def __init__(self, cfg: SmallLlamaConfig) -> None:
        super().__init__()
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: SmallLlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: dict[str, Any]) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * c) + (_rotate_half(q) * s)
        k = (k * c) + (_rotate_half(k) * s)
        out, _ = hf_attention_forward(self, q, k, v, None, scaling=self.scaling, **bounds)
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


class MLP(nn.Module):
    def __init__(self, cfg: SmallLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: SmallLlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: dict[str, Any]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, bounds)
        return x + self.mlp(self.post_attention_layernorm(x))


class SmallLlamaModel(nn.Module):
    """The body: embedding, decoder layers, final norm (``LlamaModel``'s parameter names)."""

    def __init__(self, cfg: SmallLlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = False,
        **bounds: Any,
    ) -> BodyOutput:
        """``input_ids`` ``(B, T)``. A packed row (``B == 1``) gives its boundaries as
        :meth:`~sftpack.PackedBatch.to_hf_kwargs` does (``cu_seq_lens_q`` / ``_k``,
        ``max_length_q`` / ``_k``; ``sftpack_cu_seqlens_real`` for the ``real`` mode)
        and ``position_ids`` restarting per sequence; without boundaries, positions that
        restart mark the sequences (Hugging Face's packed form), else each row is
        one causal sequence (right padding needs no mask: attention never looks right).
        """
        if attention_mask is not None:
            raise ValueError(
                "SmallLlama takes no attention_mask: give a packed row's boundaries (PackedBatch.to_hf_kwargs()) "
                "or right-padded rows, which causal attention reads correctly without a mask"
            )
        if use_cache:
            raise ValueError("SmallLlama has no KV cache (it is for training): use_cache must be False")
        unknown = set(bounds) - {
            "cu_seq_lens_q",
            "cu_seq_lens_k",
            "max_length_q",
            "max_length_k",
            "sftpack_cu_seqlens_real",
        }
        if unknown:
            raise TypeError(f"SmallLlama got unexpected keyword arguments {sorted(unknown)}")
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        else:  # as Hugging Face's layers do: restarting positions without boundaries are a packed row
            bounds = {**bounds, "position_ids": position_ids}
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, bounds)
        return BodyOutput(self.norm(x))


class SmallLlama(nn.Module):
    """A Llama causal LM in plain torch with ``LlamaForCausalLM``'s parameters and
    computation (see the module docstring); ``model.model`` is the body, ``model.lm_head`` the head.

    >>> m = build_small_llama(SmallLlamaConfig(1000, hidden_size=32, intermediate_size=128,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    >>> m.config.vocab_size, sum(p.numel() for p in m.parameters())
    (1000, 79456)
    >>> m(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 1000])
    """

    def __init__(self, cfg: SmallLlamaConfig, *, body: SmallLlamaModel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = SmallLlamaModel(cfg) if body is None else body
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def base_model(self) -> SmallLlamaModel:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> CausalLMOutput:
        """Logits for every slot, and with ``labels`` the mean next-token loss (the
        reference; the training loop runs the head on supervised slots only)."""
        logits = self.lm_head(self.model(input_ids, **kwargs).last_hidden_state)
        loss = None
        if labels is not None:
            shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
            loss = F.cross_entropy(logits.float().flatten(0, -2), shifted.flatten(), ignore_index=-100)
        return CausalLMOutput(logits, loss)


def build_small_llama(cfg: SmallLlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> SmallLlama:
    """A seeded :class:`SmallLlama` with the weights ``build_model`` gives transformers' Llama.

    The random draws follow transformers' order: each module draws torch's default
    init as it is built; then the body's embedding and linear layers are redrawn
    from ``normal(0, initializer_range)`` in module order; then the head is built
    and redrawn. The global RNG is left as it was.
    """
    std = cfg.initializer_range
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        body = SmallLlamaModel(cfg)
        for mod in body.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                mod.weight.normal_(0.0, std)
        model = SmallLlama(cfg, body=body)  # the head is built (and draws its default init) here
        model.lm_head.weight.normal_(0.0, std)
    return model.to(dtype).train()
