"""A tiny Qwen2-VL from a config, and its forward pass on a packed row or on one sample alone.

The language model runs sftpack's training attention (``sftpack_varlen_train``,
registered by :func:`sftpack._train_attention.register_train_attention`): boundaries from
``cu_seq_lens_q`` (padded) and, in the ``real`` mode, ``sftpack_cu_seqlens_real``.
Qwen2-VL's text attention hands these keyword arguments through unchanged, and its
``(4, 1, T)`` position form (text row on top of the MRoPE rows) only feeds the mask
builder, which the registered mask function turns into "no mask".

The vision tower runs ``sdpa`` (bidirectional within each image: sftpack's causal
attention must never reach it). :func:`packed_logits` calls the tower itself with the
row's ``vision_cu_seqlens`` and hands its output to the model (``mm_encoder_outputs``),
so the language model's boundary arguments never reach the vision attention.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _optional
from ..exactness import norms_in_model_dtype
from ..handoff import PackedBatch
from ._sample import MultimodalSample

__all__ = ["alone_logits", "packed_logits", "tiny_qwen2vl"]


def tiny_qwen2vl(
    vocab_size: int,
    *,
    image_token_id: int,
    vision_start_token_id: int,
    vision_end_token_id: int,
    video_token_id: int | None = None,
    dim: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vision_dim: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    text_attention: str | None = None,
) -> Any:
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` (seeded, nothing downloaded).

    Vision: patch 14, temporal patch 2, merge 2 (Qwen2-VL's, so the real image processor
    fits). Text: MRoPE sections ``[2, 1, 1]`` of a ``dim / heads / 2`` rotary half-width.
    ``dtype=torch.float64`` also makes the RMSNorms compute in float64 (Qwen2-VL's upcast
    them to float32 otherwise). ``text_attention``: the language model's attention
    (default sftpack's training attention; ``"sdpa"`` makes Hugging Face find the
    boundaries from the text position row instead). The vision tower runs ``sdpa``.
    """
    from .._train_attention import register_train_attention

    hf = _optional.transformers()
    half = dim // heads // 2
    section = [half - 2 * (half // 4), half // 4, half // 4]
    cfg = hf.Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=dim,
            intermediate_size=2 * dim,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
            max_position_embeddings=32768,
            attention_dropout=0.0,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
        vision_config=dict(
            depth=vision_depth,
            embed_dim=vision_dim,
            hidden_size=dim,
            num_heads=vision_heads,
            mlp_ratio=2,
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            in_channels=3,
        ),
        image_token_id=image_token_id,
        video_token_id=video_token_id if video_token_id is not None else vocab_size - 1,
        vision_start_token_id=vision_start_token_id,
        vision_end_token_id=vision_end_token_id,
        tie_word_embeddings=False,
    )
    name = text_attention or register_train_attention()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf.Qwen2VLForConditionalGeneration._from_config(
            cfg, attn_implementation={"": name, "text_config": name, "vision_config": "sdpa"}
        )
    model = model.to(dtype).train()
    return norms_in_model_dtype(model, ("Qwen2VLRMSNorm",)) if dtype == torch.float64 else model


def _train_attention_name() -> str:
    from .._train_attention import TRAIN_ATTENTION

    return TRAIN_ATTENTION


def _image_outputs(model: Any, pixel_values: torch.Tensor, grid: torch.Tensor, cu: torch.Tensor) -> Any:
    hf = _optional.transformers("modeling_outputs")
    visual = model.model.visual
    out = visual(pixel_values.to(visual.dtype), grid_thw=grid, cu_seqlens=cu)
    sizes = (grid.prod(-1) // visual.spatial_merge_size**2).tolist()
    return hf.BaseModelOutputWithPooling(
        last_hidden_state=out.last_hidden_state, pooler_output=torch.split(out.pooler_output, sizes)
    )


def packed_logits(model: Any, batch: PackedBatch, *, pad_between_seqs: bool = True) -> torch.Tensor:
    """``(T, V)`` logits of a packed row: the vision tower over ``batch.vision_cu_seqlens``,
    the language model over ``batch.to_hf_kwargs()`` (its tower inputs and labels dropped; with
    ``pad_between_seqs`` the real boundaries added as ``sftpack_cu_seqlens_real``).

    With sftpack's training attention the boundaries are ``cu_seqlens`` (either mode).
    With any other attention (``sdpa``, ``eager``) only ``input_ids`` and the ``(4, 1, T)``
    positions go in, and Hugging Face builds a block-causal mask from the restarts of
    the text position row; ``pad_between_seqs`` is then moot (padding trails each
    segment and a causal mask never lets a real token see it).
    """
    kw = batch.to_hf_kwargs()
    if pad_between_seqs:  # the real boundaries, for sftpack's training attention
        kw["sftpack_cu_seqlens_real"] = batch.cu_seqlens
    for key in ("labels", "pixel_values", "image_grid_thw"):  # the tower runs here, the loss is the caller's
        kw.pop(key, None)
    if model.config.text_config._attn_implementation != _train_attention_name():
        kw = {"input_ids": kw["input_ids"], "position_ids": kw["position_ids"], "use_cache": False}
    if batch.num_images:
        assert batch.pixel_values is not None and batch.image_grid_thw is not None
        assert batch.vision_cu_seqlens is not None
        kw["mm_encoder_outputs"] = {
            "image": _image_outputs(model, batch.pixel_values, batch.image_grid_thw, batch.vision_cu_seqlens)
        }
    return model(**kw).logits[0]


def alone_logits(model: Any, sample: MultimodalSample) -> torch.Tensor:
    """``(L, V)`` logits of one sample run alone, Hugging Face's own way: the model computes
    the MRoPE positions (``get_rope_index``) and runs its vision tower itself; one causal
    sequence, no boundaries."""
    ids = torch.from_numpy(sample.input_ids).unsqueeze(0)
    kw: dict[str, Any] = {"input_ids": ids, "use_cache": False}
    if sample.num_images:
        kw["pixel_values"] = torch.from_numpy(sample.pixel_values)
        kw["image_grid_thw"] = torch.from_numpy(sample.image_grid_thw)
        kw["mm_token_type_ids"] = (ids == sample.image_token_id).to(torch.int32)
    return model(**kw).logits[0]
