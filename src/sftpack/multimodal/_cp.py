"""Context parallelism on a row with media: one rank's hidden states from its :class:`~sftpack.handoff.CPShard`.

:func:`~sftpack.handoff.shard_for_cp` gives each rank its token shard and, of the row's
media, the items whose placeholder runs reach its slots, each placeholder's
``feature_index`` and the multimodal positions at its slots (the layout and why:
:mod:`sftpack.handoff.cp`). This module is the model's side of that:

- :func:`cp_vision_outputs`: the family's vision tower over the shard's items (whole items:
  the tower attends within each), then each per-placeholder output (the merged features,
  and Qwen3-VL's deepstack maps) picked by ``feature_index``, in the shard's placeholder
  order: what the model's own scatter (``mm_encoder_outputs``) takes for the rank's tokens;
- :func:`cp_hidden`: the language model over the shard: its tokens, its positions (Qwen2-VL's
  ``(4, 1, T/CP)`` form: the text positions on top of the sharded MRoPE rows), those features,
  and the keyword arguments of a context-parallel attention, which the caller registers
  (Transformer Engine's on GPUs; the tests use an all-gather reference on CPU with gloo).

Each rank's loss over its shard is its share of the row's (labels were shifted on the whole
row), and its parameter gradients are its slots' share: sum both over the CP group. The
families whose tower runs apart from the language model (:meth:`Family.vision_outputs`:
Qwen2-VL, Qwen2.5-VL, Qwen3-VL) are supported; LLaVA's shard is laid out the same way,
but its forward here is refused by :meth:`Family.vision_outputs`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import TRAIN_ATTENTION
from ..handoff import CPShard, PackedBatchError
from ..hybrid import covered_layers, refuse_context_parallel
from ._family import Family, family_for

__all__ = ["cp_hidden", "cp_vision_outputs"]


def _pick(value: Any, index: torch.Tensor) -> Any:
    """A per-item split (a tuple of tensors, one per item) -> one tensor of the ``index`` rows of
    the items' rows laid end to end, as a 1-tuple; a list of such splits (deepstack levels) each
    alike; anything else (the patch-level ``last_hidden_state``) unchanged."""
    if isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value):
        return (torch.cat(value)[index],)
    if isinstance(value, list) and value and all(isinstance(v, tuple) for v in value):
        return [_pick(v, index) for v in value]
    return value


def cp_vision_outputs(family: Family, model: Any, shard: CPShard) -> dict[str, Any]:
    """The vision features of ``shard``'s placeholder slots as the model's ``mm_encoder_outputs``
    take them, by item kind (``"image"``; ``"video"`` for a video's placeholder): ``family``'s
    tower over all the shard's media items at once (its attention never crosses an item, so
    each item's output is what it would be alone), every per-item output laid end to end in
    item order, and each kind's placeholders, in local order, given the rows
    ``shard.feature_index`` names for them."""
    media, index = shard.media, shard.feature_index
    if media is None or index is None:
        raise PackedBatchError("cp_vision_outputs: the shard carries no media; shard a row with media")
    out = family.vision_outputs(model, media)
    kinds = {"image": int(media.token_id)}
    video = getattr(media, "video_token_id", None)
    if video is not None:
        kinds["video"] = int(video)
    at = shard.input_ids[shard.placeholder_mask]  # each placeholder's id, in feature_index's order
    picked = {}
    for kind, token_id in kinds.items():
        mine = index[at == token_id]
        if mine.numel():
            picked[kind] = type(out)(**{k: _pick(v, mine) for k, v in out.items()})
    return picked


def cp_hidden(model: Any, shard: CPShard, *, family: Family | None = None, **attention: Any) -> torch.Tensor:
    """``(T/CP, H)`` hidden states of one rank's shard of a packed row (with or without media).

    Args:
        model: a vision-language model of a family whose tower runs apart
            (:meth:`~sftpack.multimodal.Family.vision_outputs`), its language model on a
            context-parallel attention implementation.
        shard: this rank's :func:`~sftpack.handoff.shard_for_cp` of the row.
        family: default ``family_for(model)``.
        attention: handed to the language model's attention as keyword arguments (what the
            context-parallel attention reads: the global boundaries, the shard).

    Raises:
        ValueError: the language model runs sftpack's training attention, which treats each
            local segment as a whole sequence (a chunk needs the other ranks' keys and values);
            or it has layers that carry state (:func:`sftpack.hybrid.refuse_context_parallel`).
    """
    kinds = sorted({c.kind for c in covered_layers(model)})
    refuse_context_parallel(kinds[0] if kinds else None, shard.cp_size, f"cp_hidden: {type(model).__name__}")
    if model.config.get_text_config()._attn_implementation == TRAIN_ATTENTION:
        raise ValueError(
            f"cp_hidden: the language model runs {TRAIN_ATTENTION!r}, which sees each local segment as a whole "
            "sequence; a context-parallel shard needs an attention that gathers the other ranks' keys and values "
            "(Transformer Engine's with shard.to_packed_seq_params(), or run the unsharded row)"
        )
    fam = family_for(model) if family is None else family
    kw: dict[str, Any] = {
        "input_ids": shard.input_ids.unsqueeze(0),
        "position_ids": shard.position_ids.unsqueeze(0),
        "use_cache": False,
        **attention,
    }
    media = shard.media
    if media is not None:
        own = media.hf_kwargs(shard.position_ids)
        if "position_ids" in own:
            kw["position_ids"] = own["position_ids"]
        if media.num_items:
            kw["mm_encoder_outputs"] = cp_vision_outputs(fam, model, shard)
    return model.model(**kw).last_hidden_state[0]
