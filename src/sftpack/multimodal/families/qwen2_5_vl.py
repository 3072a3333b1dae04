"""Qwen2.5-VL: Qwen2-VL's tokens, image processor, media and MRoPE rule, with a windowed vision tower.

For images Qwen2.5-VL is Qwen2-VL's family with another model class: the same image
block and placeholder counts (``Qwen2VLImageProcessorPil``: patch 14, temporal patch 2,
merge 2), the same :class:`~sftpack.handoff.payload.PatchMedia` and the same MRoPE
positions (``get_rope_index`` differs only for video, where ``second_per_grid_ts``
scales the temporal axis). Its vision tower attends within windows (computed from
``grid_thw``, image by image: no window crosses an image) and, in its full-attention
blocks, within each image's frames (the row's ``vision_cu_seqlens``, as Qwen2-VL's):
Qwen2-VL's :meth:`~sftpack.multimodal.families.qwen2_vl.Qwen2VL.packed_logits` runs it
unchanged. What this module adds is the model: ``Qwen2_5_VLForConditionalGeneration``
built from a config with Qwen2.5-VL's own vision keys, and the video position rule: a
video's temporal index ``i_t`` becomes ``int(i_t * tokens_per_second * second_per_grid_ts)``
(``get_vision_position_ids``' float32 product), ``tokens_per_second`` from the model's
vision config (2 in Qwen2.5-VL's checkpoints, the family's default).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from ... import _optional
from ...handoff.payload import PatchMedia
from .._video import VideoSampling
from .qwen2_vl import Qwen2VL, _config

__all__ = ["Qwen25VL"]


class Qwen25VL(Qwen2VL):
    """Qwen2.5-VL (see the module text)."""

    name: ClassVar[str] = "qwen2_5_vl"
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_vl",)
    model_class: ClassVar[str] = "Qwen2_5_VLForConditionalGeneration"
    norm_classes: ClassVar[tuple[str, ...] | None] = ("Qwen2_5_VLRMSNorm",)

    def __init__(self, tokens_per_second: int = 2, video_sampling: VideoSampling | None = None) -> None:
        super().__init__(video_sampling)
        #: temporal positions per second of video (the vision config's ``tokens_per_second``)
        self.tokens_per_second = int(tokens_per_second)

    @classmethod
    def _configured(cls, config: Any) -> Qwen2VL:
        """The family with the config's ``vision_config.tokens_per_second`` (its video settings:
        Qwen2-VL's, ``Qwen2VLVideoProcessor`` being Qwen2.5-VL's video processor too)."""
        vision = getattr(config, "vision_config", None)
        return cls(int(getattr(vision, "tokens_per_second", 2)))

    def _time_intervals(self, is_video: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """``tokens_per_second * second_per_grid_ts`` in float32 for videos, 1 for images."""
        step = np.float32(self.tokens_per_second) * seconds.astype(np.float32)
        return np.where(is_video, step, np.float32(1)).astype(np.float32)

    def _alone_video(self, media: PatchMedia, index: torch.Tensor) -> dict[str, Any]:
        return {"second_per_grid_ts": media.second_per_grid_ts[index]}

    def config(self, vocab_size: int, token_ids: dict[str, int], **sizes: Any) -> Any:
        """A small ``Qwen2_5_VLConfig``: Qwen2-VL's sizes; the tower ``vision_dim`` wide (its
        ``hidden_size``; ``out_hidden_size`` is the language model's width), a gated MLP of
        twice that, windows of 112 px (8 x 8 patches), its last block full attention and the
        family's ``tokens_per_second``.
        (Qwen2.5-VL's config takes Qwen2-VL's ``embed_dim`` / ``mlp_ratio`` silently and
        ignores them: its keys are set here.)"""
        vdim, depth = sizes.get("vision_dim", 32), sizes.get("vision_depth", 2)
        vision = dict(
            hidden_size=vdim,
            out_hidden_size=sizes.get("dim", 32),
            intermediate_size=2 * vdim,
            window_size=112,
            fullatt_block_indexes=[depth - 1],
            tokens_per_second=self.tokens_per_second,
        )
        return _config(_optional.transformers().Qwen2_5_VLConfig, vocab_size, token_ids, vision=vision, **sizes)
