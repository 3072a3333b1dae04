"""The model side of a step: a Hugging Face causal LM and the global token-mean loss
of one micro-batch, packed or padded.

The default model is a small Llama built from a config (nothing downloaded) with
the tokenizer's vocabulary: transformers' ``LlamaForCausalLM``, or with
``impl="torch"`` :class:`~sftpack.loop._llama.SmallLlama`, the same network and
weights in plain torch (``sftpack train``'s default: no transformers modeling
import); ``load_model(DIR)`` opens a local folder instead.
Packed rows run through variable-length attention, registered with transformers
as :data:`TRAIN_ATTENTION` (defined in :mod:`sftpack.attention`): on CPU one causal 4-D SDPA call per segment (the fused
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

Data with images trains a vision-language model of a family
(:func:`sftpack.multimodal.family_for`): :func:`build_media_model` builds the
family's tiny model from a config (:meth:`~sftpack.multimodal.Family.tiny_model`,
nothing downloaded), and the same :class:`LossModule` takes its micro-batches: a
packed row runs the family's :meth:`~sftpack.multimodal.Family.packed_hidden` (the
vision tower over the row's per-image boundaries, its features into the image slots,
and the language model over the row's boundaries and the media's positions), a padded
batch runs the model's own path; then the same head and loss.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from .._base import StrEnum, choose
from .._optional import CustomCodeError, flash_attn_varlen_func, from_pretrained, transformers
from ..attention import TRAIN_ATTENTION, register_train_attention
from ..exactness import PackingProbe, mark_exact, norms_in_model_dtype, require_exact_packing
from ..head import fused_linear_cross_entropy
from ..hybrid import keep_apart
from ..sample import IGNORE_INDEX
from ._llama import SmallLlamaConfig, build_small_llama
from ._options import Packing

__all__ = [
    "TRAIN_ATTENTION",
    "LossModule",
    "ModelImpl",
    "build_media_model",
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
    sizes: dict[str, Any] = {
        "hidden_size": dim,
        "intermediate_size": 4 * dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
    }
    if choose(ModelImpl, impl, "impl") is ModelImpl.TORCH:
        if attn_implementation not in (None, TRAIN_ATTENTION):
            raise ValueError(
                f"impl='torch' runs sftpack's training attention only, not attn_implementation="
                f"{attn_implementation!r}: leave it out, or use impl='transformers'"
            )
        return mark_exact(build_small_llama(SmallLlamaConfig(vocab_size, **sizes), seed=seed, dtype=dtype))
    hf = transformers()
    cfg = hf.LlamaConfig(
        vocab_size=vocab_size,
        **sizes,
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
    model = mark_exact(model.to(dtype).train())  # a Llama: packing proven exact by the suite
    return norms_in_model_dtype(model) if dtype == torch.float64 else model


def load_model(
    path: str,
    *,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A causal LM from a local folder (``save_pretrained``); never downloads, never runs the
    folder's own code (:class:`~sftpack._optional.CustomCodeError`)."""
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 and _has_experts(path) else {}
    try:
        model = from_pretrained(
            "AutoModelForCausalLM",
            path,
            local_files_only=True,
            attn_implementation=attn_implementation or register_train_attention(),
            dtype=dtype,
            **extra,
        )
    except CustomCodeError:
        raise
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a causal LM from {path!r} ({' '.join(str(e).split())[:200]}); give a local folder "
            "written by model.save_pretrained(), or leave --model out for the default small Llama"
        ) from None
    model = model.train()
    keep_apart(model)  # hybrid layers (Mamba2, gated delta net, short conv) keep a packed row's sequences apart
    return norms_in_model_dtype(model) if dtype == torch.float64 else model


def _has_experts(path: str) -> bool:
    """Whether the folder's config names routed experts: their default kernel (``torch._grouped_mm``)
    takes no float64, so a float64 model runs them by transformers' own per-expert loop (``eager``)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    text = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    return isinstance(text, dict) and any(
        int(text.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def require_exact(model: Any, config: Any) -> PackingProbe | None:
    """The guard of a run of ``config`` (a :class:`~sftpack.loop.TrainConfig`) on ``model``: on a
    packed path, its layers that carry state kept apart (:func:`sftpack.hybrid.keep_apart`), then
    :func:`sftpack.exactness.require_exact_packing` (a vision-language model through
    its family), in the run's boundary mode and padding multiple; padded training needs none."""
    if config.packing is Packing.NONE:
        return None
    keep_apart(model)  # a Hugging Face hybrid model built or loaded by the caller: its state layers too
    family = None
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        from ..multimodal import family_for  # start-up: multimodal (~0.2 s) only for a vision-language model

        family = family_for(model)
    return require_exact_packing(
        model,
        pad_between_seqs=config.pad_between_seqs,
        pad_multiple=config.pad_multiple,
        allow=config.allow_inexact_packing,
        family=family,
    )


def media_token_ids(family: Any, tokenizer: Any) -> dict[str, int]:
    """The token ids a model config of ``family`` names, by config key (``Family.token_ids``)."""
    return {k: int(v) for k, v in family.token_ids(tokenizer).items()}


def build_media_model(
    family: Any,
    tokenizer: Any,
    *,
    vocab: Any = None,
    dim: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The tiny model of a vision-language ``family`` (:meth:`Family.tiny_model
    <sftpack.multimodal.Family.tiny_model>`, from a config, seeded, nothing downloaded):
    text ``dim`` / ``layers`` / ``heads`` / ``kv_heads``, a vision tower ``dim`` wide with
    ``heads`` heads, over the tokenizer's vocabulary or, given ``vocab`` (the original id of
    each of the model's ids, sorted: :func:`~sftpack.loop.compact_vocabulary` kept
    :func:`media_token_ids`), over those ids plus one unused last id (what a config names
    without a token here, e.g. Qwen2-VL's video placeholder, defaults to it)."""
    ids = media_token_ids(family, tokenizer)
    size: dict[str, Any] = {}
    if vocab is not None:
        vocab = np.asarray(vocab)
        missing = [k for k, v in ids.items() if not np.isin(v, vocab)]
        if missing:
            raise ValueError(f"build_media_model: the vocabulary lacks the ids of {missing}: keep them when compacting")
        ids = {k: int(np.searchsorted(vocab, v)) for k, v in ids.items()}
        size["vocab_size"] = len(vocab) + 1
    return family.tiny_model(
        tokenizer,
        token_ids=ids,
        dim=dim,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        vision_dim=dim,
        vision_heads=heads,
        seed=seed,
        dtype=dtype,
        **size,
    )


def _body_and_head(model: Any) -> tuple[nn.Module, nn.Linear]:
    head = model.get_output_embeddings()
    body = model.base_model
    if head is None or body is model:
        raise ValueError(f"{type(model).__name__} has no separate base model and output head: not a causal LM")
    return body, head


def packed_hidden(model: Any, mb: Any, *, pad_between_seqs: bool) -> torch.Tensor:
    """The last hidden states ``(T, H)`` of a text model (``model.base_model``) over the slots of the
    packed row ``mb``, its boundaries honoured (``pad_between_seqs``: the real ones too)."""
    body, _ = _body_and_head(model)
    kw = mb.to_hf_kwargs()
    kw.pop("labels")
    if pad_between_seqs and getattr(model.config, "_attn_implementation", None) == TRAIN_ATTENTION:
        kw["sftpack_cu_seqlens_real"] = mb.cu_seqlens  # other kernels read the padded boundaries only
    hidden: torch.Tensor = body(**kw).last_hidden_state[0]
    return hidden


class LossModule(nn.Module):
    """The model plus the loss, as one module (so DDP wraps the whole forward).

    ``forward(mb, n)`` returns the micro-batch's share of the global token-mean loss:
    ``sum of token losses / n * average_over_ranks`` (a 0-dim float32 tensor;
    float64 for a float64 model). A micro-batch with media (``mb.media``) runs a
    vision-language model's family forward first (see the module text).
    """

    def __init__(self, model: Any, *, pad_between_seqs: bool, average_over_ranks: int = 1) -> None:
        super().__init__()
        self.model = model
        self.pad_between_seqs = pad_between_seqs
        self.average_over_ranks = average_over_ranks
        #: a vision-language model: :func:`sftpack.loop.train` logs each step's ``images``
        self.counts_images = getattr(getattr(model, "config", None), "vision_config", None) is not None
        self._family: Any = None

    def family(self) -> Any:
        """The model's vision-language family (:func:`sftpack.multimodal.family_for`), found once."""
        if self._family is None:
            from ..multimodal import family_for  # start-up: multimodal (~0.2 s) only for a vision-language model

            self._family = family_for(self.model)
        return self._family

    def _media_hidden(self, body: nn.Module, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and labels of a micro-batch with media: a packed row (the family's
        :meth:`~sftpack.multimodal.Family.packed_hidden`: the vision tower over the row's
        per-image boundaries, the language model over the row's boundaries and the media's
        positions) or a right-padded batch (the model's own path)."""
        if hasattr(mb, "cu_seqlens_padded"):
            return self.family().packed_hidden(self.model, mb, pad_between_seqs=self.pad_between_seqs), mb.labels
        # right-padded rows: causal attention never looks right
        media = mb.media
        pixels = {k: v for k, v in media.hf_kwargs(mb.input_ids.reshape(-1)).items() if k != "position_ids"}
        if "pixel_values" in pixels:
            pixels["pixel_values"] = pixels["pixel_values"].to(self.model.dtype)
        b, S = mb.input_ids.shape
        kw: dict[str, Any] = {"input_ids": mb.input_ids, "use_cache": False, **pixels}
        kw.update(self.family().padded_kwargs(mb.input_ids, media))  # Gemma 3: its images' two-way attention
        positions = getattr(media, "positions", None)
        if positions is not None:
            kw["position_ids"] = positions.reshape(3, b, S)
        return body(**kw).last_hidden_state.flatten(0, 1), mb.labels.reshape(-1)

    def forward(self, mb: Any, num_label_tokens: torch.Tensor) -> torch.Tensor:
        body, head = _body_and_head(self.model)
        if getattr(mb, "media", None) is not None:
            hidden, labels = self._media_hidden(body, mb)
        elif hasattr(mb, "cu_seqlens_padded"):  # a packed run
            hidden = packed_hidden(self.model, mb, pad_between_seqs=self.pad_between_seqs)
            labels = mb.labels
        else:  # right-padded rows: causal attention never looks right, so no mask is needed
            hidden = body(input_ids=mb.input_ids, use_cache=False).last_hidden_state.flatten(0, 1)
            labels = mb.labels.reshape(-1)
        # The head only where there is a target: the same loss, without the logits of
        # prompt and padding slots (with a 151,646-id vocabulary they cost more than the body).
        keep = labels != IGNORE_INDEX
        # a packed row with weights (the trainer path): each target's loss times its weight, over
        # the step's weighted count sum |w| (num_label_tokens then is count_label_tokens(weighted=True))
        weights = getattr(mb, "weights", None)
        return fused_linear_cross_entropy(
            hidden[keep],
            head.weight,
            labels[keep],
            num_label_tokens,
            bias=getattr(head, "bias", None),
            average_over_ranks=self.average_over_ranks,
            weights=None if weights is None else weights.reshape(-1)[keep],
        )
