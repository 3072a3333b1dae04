"""The model side of a step: a Hugging Face causal LM and the global token-mean loss
of one micro-batch, packed or padded.

The default model is a small Llama built from a config (nothing downloaded) with
the tokenizer's vocabulary: transformers' ``LlamaForCausalLM``, or with
``impl="torch"`` :class:`~sftpack.loop._llama.SmallLlama`, the same network and
weights in plain torch (``sftpack train``'s default: no transformers modeling
import); ``load_model(DIR)`` opens a local folder instead.
Packed rows run through variable-length attention, registered with transformers
as :data:`TRAIN_ATTENTION` (defined in :mod:`sftpack._train_attention`): on CPU one causal 4-D SDPA call per segment (the fused
flash kernel: exact, differentiable, and much faster on long segments than the 3-D
call of :func:`sftpack.attention.varlen_attention`, which materialises the scores),
on CUDA :func:`sftpack.attention.varlen_attention` (flash-attn when installed);
``flash_attention_2`` works too where flash-attn is present. Both boundary modes
are honoured: ``padded`` hands the kernel ``cu_seqlens_padded`` for both sides,
``real`` the real lengths too (padding slots then get zero attention output).
Padded batches (the baseline) run one batched causal SDPA call, no mask needed:
padding is on the right and attention is causal.

The loss is :func:`sftpack.loss.token_mean_loss`'s: the summed token loss over the
global count of supervised targets, the same normalisation for every path, the
padded baseline included. The output head runs only on slots that have a target
(the same loss and gradients as ``model(**batch)``, which computes logits for
every slot): with the embedded tokenizer's 151,646 ids a logit row is 0.6 MB, and
on the embedded corpus about 38% of the real tokens are supervised, so this skips
most of the head's work for every path alike (prompt tokens, and the baseline's
padding). Those rows go through :func:`sftpack.head.fused_linear_cross_entropy`:
the head's matmul and the cross-entropy in chunks of rows whose logits fit a fixed
budget (:data:`sftpack.head.DEFAULT_CHUNK_BYTES`), one reused buffer, the gradients
formed in the same pass (nothing recomputed in the backward pass); on CUDA a fused
kernel (Liger-Kernel, cut-cross-entropy) where one is installed. A tied head
(weight shared with the input embedding) and a frozen one work as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._base import StrEnum, choose
from .._optional import flash_attn_varlen_func, transformers
from .._train_attention import TRAIN_ATTENTION, register_train_attention
from ..exactness import norms_in_model_dtype
from ..head import fused_linear_cross_entropy
from ..sample import IGNORE_INDEX
from ._llama import SmallLlamaConfig, build_small_llama

__all__ = [
    "TRAIN_ATTENTION",
    "LossModule",
    "ModelImpl",
    "build_model",
    "load_model",
    "register_train_attention",
]


class ModelImpl(StrEnum):
    """Which code :func:`build_model` builds the small Llama with (the same network and weights)."""

    #: transformers' ``LlamaForCausalLM``: a ``PreTrainedModel`` (HF ``Trainer``, ``save_pretrained``, generation)
    TRANSFORMERS = "transformers"
    #: :class:`~sftpack.loop._llama.SmallLlama`, the same ops in plain torch: no transformers modeling code to
    #: import (about 4 s of a 2-core CPU's start-up); ``sftpack train``'s default
    TORCH = "torch"


def default_attention(device: torch.device | str) -> str:
    """``flash_attention_2`` on CUDA with flash-attn installed, else the reference."""
    if torch.device(device).type == "cuda" and flash_attn_varlen_func() is not None:
        return "flash_attention_2"
    return register_train_attention()


def build_model(
    vocab_size: int,
    *,
    dim: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 32768,
    seed: int = 0,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    impl: str | ModelImpl = ModelImpl.TRANSFORMERS,
) -> Any:
    """A randomly initialised small Llama causal LM (seeded, nothing downloaded).

    ``impl="transformers"`` (the default) builds transformers' ``LlamaForCausalLM``;
    ``impl="torch"`` builds :class:`~sftpack.loop._llama.SmallLlama`, the same network
    in plain torch with the same weights for the same seed (tested equal: float32 bit
    for bit, float64 to 1e-12), which imports none of transformers' modeling code;
    ``sftpack train`` uses it by default because that import is most of its start-up.

    ``dtype=torch.float64`` computes in float64 throughout, norms included
    (:func:`sftpack.exactness.norms_in_model_dtype`); the training-equality tests
    use it to compare packings to 1e-10.

    >>> m = build_model(1000, dim=32, layers=1, heads=2, kv_heads=1)
    >>> m.config.vocab_size, sum(p.numel() for p in m.parameters())
    (1000, 79456)
    >>> t = build_model(1000, dim=32, layers=1, heads=2, kv_heads=1, impl="torch")
    >>> type(t).__name__, all(torch.equal(a, b) for a, b in zip(m.parameters(), t.parameters()))
    ('SmallLlama', True)
    """
    if choose(ModelImpl, impl, "impl") is ModelImpl.TORCH:
        if attn_implementation not in (None, TRAIN_ATTENTION):
            raise ValueError(
                f"impl='torch' runs sftpack's training attention only, not attn_implementation="
                f"{attn_implementation!r}: leave it out, or use impl='transformers'"
            )
        cfg = SmallLlamaConfig(
            vocab_size,
            hidden_size=dim,
            intermediate_size=4 * dim,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
        )
        return build_small_llama(cfg, seed=seed, dtype=dtype)
    hf = transformers()
    cfg = hf.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    cfg._attn_implementation = attn_implementation or register_train_attention()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf.LlamaForCausalLM(cfg)
    model = model.to(dtype).train()
    return norms_in_model_dtype(model) if dtype == torch.float64 else model


def load_model(
    path: str,
    *,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A causal LM from a local folder (``save_pretrained``); never downloads."""
    try:
        model = transformers().AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            attn_implementation=attn_implementation or register_train_attention(),
            dtype=dtype,
        )
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a causal LM from {path!r} ({' '.join(str(e).split())[:200]}); give a local folder "
            "written by model.save_pretrained(), or leave --model out for the default small Llama"
        ) from None
    model = model.train()
    return norms_in_model_dtype(model) if dtype == torch.float64 else model


def _body_and_head(model: Any) -> tuple[nn.Module, nn.Linear]:
    head = model.get_output_embeddings()
    body = model.base_model
    if head is None or body is model:
        raise ValueError(f"{type(model).__name__} has no separate base model and output head: not a causal LM")
    return body, head


class LossModule(nn.Module):
    """The model plus the loss, as one module (so DDP wraps the whole forward).

    ``forward(mb, n)`` returns the micro-batch's share of the global token-mean loss:
    ``sum of token losses / n * average_over_ranks`` (a 0-dim float32 tensor;
    float64 for a float64 model).
    """

    def __init__(self, model: Any, *, pad_between_seqs: bool, average_over_ranks: int = 1) -> None:
        super().__init__()
        self.model = model
        self.pad_between_seqs = pad_between_seqs
        self.average_over_ranks = average_over_ranks

    def forward(self, mb: Any, num_label_tokens: torch.Tensor) -> torch.Tensor:
        body, head = _body_and_head(self.model)
        if hasattr(mb, "cu_seqlens_padded"):  # a packed run
            kw = mb.to_hf_kwargs()
            kw.pop("labels")
            if self.pad_between_seqs and getattr(self.model.config, "_attn_implementation", None) == TRAIN_ATTENTION:
                kw["sftpack_cu_seqlens_real"] = mb.cu_seqlens  # other kernels read the padded boundaries only
            hidden = body(**kw).last_hidden_state[0]
            labels = mb.labels
        else:  # right-padded rows: causal attention never looks right, so no mask is needed
            hidden = body(input_ids=mb.input_ids, use_cache=False).last_hidden_state.flatten(0, 1)
            labels = mb.labels.reshape(-1)
        # The head only where there is a target: the same loss, without the logits of
        # prompt and padding slots (with a 151,646-id vocabulary they cost more than the body).
        keep = labels != IGNORE_INDEX
        return fused_linear_cross_entropy(
            hidden[keep],
            head.weight,
            labels[keep],
            num_label_tokens,
            bias=getattr(head, "bias", None),
            average_over_ranks=self.average_over_ranks,
        )
