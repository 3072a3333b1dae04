"""Qwen3-VL: Qwen2-VL's tokens, media and MRoPE rule, 16-px patches, interleaved MRoPE and deepstack.

For images Qwen3-VL is Qwen2-VL's family with three differences, each handled here:

- **patches of 16 px**: its image processor is transformers' own ``Qwen2VLImageProcessorPil``
  (``AutoImageProcessor`` maps ``qwen3_vl`` to it) with Qwen3-VL's settings: patch 16,
  temporal patch 2, merge 2, mean and std 0.5 (:func:`qwen3vl_image_processor`). An image of
  ``H x W`` pixels is resized to multiples of 32 and takes ``H * W / 32**2`` placeholders. A
  processor of other patch or merge sizes than the model's (Qwen2-VL's patch 14 given to a
  Qwen3-VL model) is refused by :meth:`Qwen3VL.check` in one line.
- **interleaved MRoPE**: the language model's rotary frequencies take the temporal, height and
  width positions in turn (``t h w t h w ...``) instead of in three blocks. That is inside the
  model; the positions it is given are the same three rows. For still images
  ``Qwen3VLModel.get_rope_index`` (transformers 5.24) is Qwen2-VL's rule
  (:func:`~sftpack.multimodal.families.qwen2_vl.mrope_positions`: text advances by one, an
  image of grid ``(t, h, w)`` takes ``(p + i_t, p + i_h, p + i_w)`` and advances ``p`` by
  ``max(h, w) // merge``), tested equal to it; it differs only for video (a video's frames
  are split into grids of one frame each, between timestamps), which this module does not take.
- **deepstack**: the vision tower returns, beside its merged output, one merged feature map per
  layer in ``deepstack_visual_indexes``; the language model adds map ``k`` to the hidden states
  of the visual tokens after its layer ``k``. :meth:`Qwen3VL.vision_outputs` hands them, split
  per image, to the model with the merged output (``mm_encoder_outputs``); the model lays both
  on the row's placeholders in row order, so each image's deepstack features land on that
  image's tokens, as they do for each sample alone (tested, with a control that shifts them by
  one image and fails).

Everything else (the image block, the embedded tokenizer with Qwen2-VL's special-token ids,
which Qwen3-VL keeps, :class:`~sftpack.handoff.payload.PatchMedia`, the packed forward over
sftpack's training attention, Hugging Face's own forward for a sample alone) is Qwen2-VL's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, ClassVar, NoReturn

import torch

from ... import _optional
from ...exactness import small_text_config
from ...handoff.payload import PatchMedia
from .._family import UnsupportedModelError
from .._images import _pil_processor_class
from .qwen2_vl import Qwen2VL

__all__ = ["Qwen3VL", "qwen3vl_image_processor"]

#: Qwen3-VL's image processor settings (its ``preprocessor_config.json``), beside the pixel limits.
PATCH, TEMPORAL, MERGE = 16, 2, 2
MEAN = STD = (0.5, 0.5, 0.5)


@lru_cache(maxsize=8)
def qwen3vl_image_processor(
    patch_size: int = PATCH,
    temporal_patch_size: int = TEMPORAL,
    merge_size: int = MERGE,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> Any:
    """Qwen3-VL's image processor, shared: transformers' PIL/numpy ``Qwen2VLImageProcessorPil``
    (the class ``AutoImageProcessor`` gives a ``qwen3_vl`` folder without torchvision) with
    Qwen3-VL's patch 16, temporal patch 2, merge 2 and mean and std 0.5. The pixel limits default
    to those of the Qwen2-VL default counted in placeholders: 2 x 2 to 16 x 16 of them an image
    (64 x 64 to 512 x 512 pixels at patch 16, merge 2)."""
    side = patch_size * merge_size
    return _pil_processor_class()(
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
        image_mean=list(MEAN),
        image_std=list(STD),
        min_pixels=(2 * side) ** 2 if min_pixels is None else min_pixels,
        max_pixels=(16 * side) ** 2 if max_pixels is None else max_pixels,
    )


class Qwen3VL(Qwen2VL):
    """Qwen3-VL (see the module text). ``patch_size``, ``temporal_patch_size`` and ``merge_size``:
    the model's (from its config's ``vision_config`` by :meth:`from_config`), which the image
    processor must have."""

    name: ClassVar[str] = "qwen3_vl"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl",)
    model_class: ClassVar[str] = "Qwen3VLForConditionalGeneration"
    norm_classes: ClassVar[tuple[str, ...] | None] = ("Qwen3VLTextRMSNorm",)
    #: no video yet: Qwen3-VL writes each frame between timestamps and splits a video's grid per
    #: frame for its positions, which Qwen2-VL's video rule does not (a video part is refused)
    video_block: ClassVar[tuple[str, ...]] = ()
    video_placeholder: ClassVar[str] = ""

    def __init__(self, patch_size: int = PATCH, temporal_patch_size: int = TEMPORAL, merge_size: int = MERGE) -> None:
        super().__init__()
        #: the model's ``(patch_size, temporal_patch_size, merge_size)``
        self.sizes = (int(patch_size), int(temporal_patch_size), int(merge_size))

    @classmethod
    def from_config(cls, config: Any) -> Qwen3VL:
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return cls()
        return cls(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)

    def _default_image_processor(self) -> Any:
        return qwen3vl_image_processor(*self.sizes)

    def check(self, tokenizer: Any, processor: Any) -> None:
        """Qwen2-VL's checks, and the processor's patch, temporal patch and merge sizes must be the model's."""
        super().check(tokenizer, processor)
        got = tuple(int(getattr(processor, a)) for a in ("patch_size", "temporal_patch_size", "merge_size"))
        if got != self.sizes:
            raise UnsupportedModelError(
                f"{type(processor).__name__} has patch_size, temporal_patch_size, merge_size {got}, the qwen3_vl "
                f"model {self.sizes}: use the model folder's own image processor, or family_for(model).image_processor()"
            )

    def encode_videos(
        self, parts: list[dict], processor: Any, *, record: Any = None, fields: list[str] | None = None
    ) -> NoReturn:
        """Refused (see :attr:`video_block`), in one line naming the family."""
        raise UnsupportedModelError(
            f"the {self.name} family takes no video parts yet (record {record!r}): drop them, or use the "
            "qwen2_vl or qwen2_5_vl family"
        )

    # ------------------------------------------------------------- the model
    def config(self, vocab_size: int, token_ids: dict[str, int], **sizes: Any) -> Any:
        """A small ``Qwen3VLConfig``. Text: ``dim`` wide (default 32), ``layers`` (2), ``heads`` (4)
        of ``dim / heads`` each, ``kv_heads`` (2), interleaved MRoPE sections of the rotary
        half-width in Qwen3-VL's proportions (its 24:20:20 of 64; here ``half - 2 * (half // 4)``,
        ``half // 4``, ``half // 4``). Vision: the model's patch sizes, ``vision_depth`` (2)
        blocks ``vision_dim`` (32) wide with ``vision_heads`` (4), a 16 x 16 learned position
        grid, and deepstack from its first ``min(vision_depth, layers)`` blocks (so every text
        layer of a tiny model takes a deepstack map, as Qwen3-VL's first three do)."""
        dim, layers, heads = sizes.get("dim", 32), sizes.get("layers", 2), sizes.get("heads", 4)
        vdim, depth = sizes.get("vision_dim", 32), sizes.get("vision_depth", 2)
        half = dim // heads // 2
        section = [half - 2 * (half // 4), half // 4, half // 4]
        p, t, m = self.sizes
        text = small_text_config(vocab_size, dim=dim, layers=layers, heads=heads, kv_heads=sizes.get("kv_heads", 2))
        return _optional.transformers().Qwen3VLConfig(
            text_config=dict(
                **text,
                head_dim=dim // heads,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": section,
                    "mrope_interleaved": True,
                },
                bos_token_id=None,
                eos_token_id=None,
                pad_token_id=None,
            ),
            vision_config=dict(
                depth=depth,
                hidden_size=vdim,
                intermediate_size=2 * vdim,
                num_heads=sizes.get("vision_heads", 4),
                out_hidden_size=dim,
                patch_size=p,
                temporal_patch_size=t,
                spatial_merge_size=m,
                in_channels=3,
                num_position_embeddings=256,
                deepstack_visual_indexes=list(range(min(depth, layers))),
            ),
            video_token_id=token_ids.get("video_token_id", vocab_size - 1),
            tie_word_embeddings=False,
            **{k: v for k, v in token_ids.items() if k != "video_token_id"},
        )

    def vision_outputs(self, model: Any, media: PatchMedia) -> Any:
        """The vision tower over the row's images (one attention segment per frame), its merged
        output and each deepstack map split per image, as the model's ``mm_encoder_outputs`` take them."""
        hf = _optional.transformers("models.qwen3_vl.modeling_qwen3_vl")
        visual = model.model.visual
        grid = media.grid_thw
        out = visual(media.pixel_values.to(visual.dtype), grid_thw=grid, cu_seqlens=media.vision_cu_seqlens)
        sizes = (grid.prod(-1) // visual.spatial_merge_size**2).tolist()
        return hf.BaseModelOutputWithDeepstackFeatures(
            last_hidden_state=out.last_hidden_state,
            pooler_output=torch.split(out.pooler_output, sizes),
            deepstack_features=[torch.split(f, sizes) for f in out.deepstack_features],
        )
