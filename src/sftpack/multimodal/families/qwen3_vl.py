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
  ``max(h, w) // merge``), tested equal to it; for video it splits each video's grid into
  ``t`` grids of one temporal slice, each placed as an image is (see video below).
- **deepstack**: the vision tower returns, beside its merged output, one merged feature map per
  layer in ``deepstack_visual_indexes``; the language model adds map ``k`` to the hidden states
  of the visual tokens after its layer ``k``. :meth:`Qwen3VL.vision_outputs` hands them, split
  per image, to the model with the merged output (``mm_encoder_outputs``); the model lays both
  on the row's placeholders in row order, so each image's deepstack features land on that
  image's tokens, as they do for each sample alone (tested, with a control that shifts them by
  one image and fails).

**Video** (transformers 5.24's ``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor``, re-implemented
and tested against their own code):

- a video file is sampled at 2 fps by default (the part's ``fps`` wins) by
  ``Qwen3VLVideoProcessor.sample_frames``' rule (:func:`linspace_indices`:
  ``int(frames / file_fps * fps)`` frames clamped to 4 ... 768 and the clip, spread over the whole
  clip); a list of frames is kept whole (the processor with ``do_sample_frames=False``), taken at
  the part's ``fps`` (24 when none: the processor's fallback). Frames are resized, padded to a
  whole temporal patch and patched as Qwen2-VL's family does (:mod:`~sftpack.multimodal._video`).
  With a model folder (:meth:`Qwen3VL.video_settings`: its ``video_preprocessor_config.json``, else
  its ``preprocessor_config.json``, else ``Qwen3VLVideoProcessor``'s defaults key by key) they are
  sized by ``Qwen3VLVideoProcessor``'s rule: its ``size`` bounds the whole clip, ``t x h x w``
  (:class:`Qwen3VLVideoRule`; a clip needs 2 frames), and normalised by its
  mean and std (0.5); without a folder each frame is sized by the image processor's limits;
- the text: the chat template's ``<|vision_start|><|video_pad|><|vision_end|>`` keeps its outer
  tokens and its placeholder becomes, per temporal slice (two frames),
  ``<{t:.1f} seconds><|vision_start|><|video_pad|>...<|vision_end|>`` (:meth:`Qwen3VL.media_text`;
  ``t`` the mean time of the slice's first and last frame, ``index / fps``,
  :func:`frame_timestamps`), as ``Qwen3VLProcessor.replace_video_token``
  writes it; the timestamps are plain text;
- each temporal slice is its own item of the sample's
  :class:`~sftpack.handoff.payload.PatchMedia` (grid ``(1, h, w)``, its own placeholder run):
  ``get_rope_index`` places each slice as an image of one frame, and the tower attends within a
  frame and places its patches by ``(h, w)`` alone, so a video's slices as items give the features
  and positions of the whole video (tested against the model's own forward on the processor's
  ``(t, h, w)`` grids). Each slice's deepstack maps land on its own tokens
  (:meth:`Qwen3VL.encoder_outputs`).

Everything else (the image block, the embedded tokenizer with Qwen2-VL's special-token ids,
which Qwen3-VL keeps, :class:`~sftpack.handoff.payload.PatchMedia`, the packed forward over
sftpack's training attention, Hugging Face's own forward for a sample alone) is Qwen2-VL's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar, cast

import numpy as np
import torch

from ... import _optional
from ...exactness import small_text_config
from ...handoff.payload import PatchMedia
from .._family import EncodedImages, ImageProcessor, PatchProcessor, UnsupportedModelError, VisionLanguageModel
from .._images import _pil_processor_class
from .._video import (
    DEFAULT_FPS,
    EncodedVideos,
    VideoRule,
    VideoSampling,
    _fps,
    encode_videos,
    fit_size,
    sample_indices,
    video_header,
)
from .qwen2_vl import VIDEO_PAD, VISION_END, VISION_START, Qwen2VL

__all__ = [
    "Qwen3VL",
    "Qwen3VLVideoRule",
    "TimedVideos",
    "frame_timestamps",
    "linspace_indices",
    "qwen3vl_image_processor",
]

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


@dataclass
class TimedVideos(EncodedVideos):
    """One conversation's videos as Qwen3-VL writes them (:meth:`Qwen3VL.encode_videos`):
    :class:`~sftpack.multimodal.EncodedVideos` per video (pixels, ``grid_thw`` ``(V, 3)`` as the
    processor's ``video_grid_thw``, ``second_per_grid_ts``, ``frames``), except that ``tokens``
    holds one count per temporal slice (``h*w / merge**2``, each slice its own placeholder run, in
    order), and ``timestamps``: each video's seconds per slice."""

    timestamps: list[list[float]] = field(default_factory=list)

    def slices(self) -> EncodedVideos:
        """The same patches with every temporal slice its own video of grid ``(1, h, w)`` (the
        items of the sample's media, :meth:`Qwen3VL.media`)."""
        assert self.grid_thw is not None
        t = self.grid_thw[:, 0]
        grid = np.repeat(self.grid_thw, t, axis=0)
        grid[:, 0] = 1
        return EncodedVideos(
            pixel_values=self.pixel_values,  # a video's patches are slice after slice already
            tokens=self.tokens,
            grid_thw=grid,
            merge_size=self.merge_size,
            second_per_grid_ts=np.repeat(self.second_per_grid_ts, t),
            frames=np.repeat(self.frames, t),
        )


def linspace_indices(total: int, file_fps: float, fps: float, sampling: VideoSampling) -> np.ndarray:
    """The frames of a ``total``-frame file at ``file_fps`` kept when sampling at ``fps`` by
    ``Qwen3VLVideoProcessor.sample_frames``' rule (transformers 5.24): ``n = int(total / file_fps
    * fps)`` clamped to ``[min_frames, min(max_frames, total)]`` (any count: an odd one is padded
    later), spread evenly over the whole clip, first and last frame included
    (``linspace(0, total - 1, n)`` rounded half to even)."""
    n = min(max(int(total / file_fps * fps), sampling.min_frames), sampling.max_frames, total)
    out: np.ndarray = np.linspace(0, total - 1, n).round().astype(np.int64)
    return out


def frame_timestamps(indices: list[int], fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal slice of a video whose kept frames are ``indices`` of a clip at
    ``fps`` (``Qwen3VLProcessor._calculate_timestamps``' rule): the indices padded to a multiple
    of ``temporal_patch`` by repeating the last, each slice the mean of its first and last frame's
    time (``index / fps``)."""
    idx = [int(i) for i in indices]
    idx += idx[-1:] * (-len(idx) % temporal_patch)
    sec = [i / fps for i in idx]
    return [(sec[k] + sec[k + temporal_patch - 1]) / 2 for k in range(0, len(sec), temporal_patch)]


class Qwen3VLVideoRule(VideoRule):
    """``Qwen3VLVideoProcessor``'s rule (transformers 5.24, re-implemented and tested against its
    own code): a file sampled over the whole clip (:func:`linspace_indices`); the pixel limits
    bound the whole clip. Its ``size`` alone gives them (``min_pixels`` / ``max_pixels`` are not read)."""

    def indices(
        self, total: int, file_fps: float, fps: float, temporal_patch: int, sampling: VideoSampling
    ) -> np.ndarray:
        return linspace_indices(total, file_fps, fps, sampling)

    def frame_size(
        self,
        frames: int,
        height: int,
        width: int,
        limits: tuple[int, int],
        sampling: VideoSampling,
        factor: int,
        temporal: int,
    ) -> tuple[int, int]:
        """The limits bound the whole clip, ``t x h x w`` with ``t`` the frame count rounded to a
        multiple of ``temporal``, so more frames get smaller frames; a side under ``factor`` is
        first scaled up to it. With ``cap_pixels_per_frame`` the upper limit is ``frames`` times a
        frame's share (of ``max_video_tokens``' pixels, at most ``max / frames``, at least
        ``1.05 x`` the lower limit).

        Raises:
            ValueError: a clip of fewer frames than ``temporal`` (the processor refuses it).
        """
        lo, hi = limits
        if sampling.cap_pixels_per_frame:
            per_frame = max(min(sampling.max_video_tokens * factor * factor, hi // frames), int(lo * 1.05))
            hi = per_frame * frames
        if frames < temporal:
            raise ValueError(
                f"{frames} frame(s): Qwen3-VL's video processor sizes a clip of at least {temporal} frames"
            )
        if height < factor or width < factor:
            up = max(factor / height, factor / width)
            height, width = int(height * up), int(width * up)
        return fit_size(height, width, frames, round(frames / temporal) * temporal, (lo, hi), factor)


class Qwen3VL(Qwen2VL):
    """Qwen3-VL (see the module text). ``patch_size``, ``temporal_patch_size`` and ``merge_size``:
    the model's (from its config's ``vision_config`` by :meth:`from_config`), which the image
    processor must have."""

    name: ClassVar[str] = "qwen3_vl"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl",)
    model_class: ClassVar[str] = "Qwen3VLForConditionalGeneration"
    norm_classes: ClassVar[tuple[str, ...] | None] = ("Qwen3VLTextRMSNorm",)
    #: how a video file is sampled and a clip sized (``VideoSampling.rule`` ``"qwen3_vl"`` names it)
    video_rule: ClassVar[VideoRule] = Qwen3VLVideoRule()
    #: ``Qwen3VLVideoProcessor``'s class defaults (transformers 5.24): files sampled at 2 fps by its
    #: rule, the clip's ``t x h x w`` within 128 x 32 x 32 ... 32 x 32 x 768 pixels, mean and std 0.5
    video_defaults: ClassVar[VideoSampling] = VideoSampling(
        fps=2.0,
        rule="qwen3_vl",
        min_pixels=128 * 32 * 32,
        max_pixels=32 * 32 * 768,
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        merge_size=MERGE,
        image_mean=MEAN,
        image_std=STD,
        rescale_factor=1 / 255,
        resample=3,  # bicubic
        max_video_tokens=768,
    )

    def __init__(
        self,
        patch_size: int = PATCH,
        temporal_patch_size: int = TEMPORAL,
        merge_size: int = MERGE,
        video_sampling: VideoSampling | None = None,
    ) -> None:
        super().__init__(video_sampling)
        #: the model's ``(patch_size, temporal_patch_size, merge_size)``
        self.sizes = (int(patch_size), int(temporal_patch_size), int(merge_size))

    @classmethod
    def _configured(cls, config: Any) -> Qwen2VL:
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return cls()
        return cls(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)

    def _default_image_processor(self) -> Any:
        return qwen3vl_image_processor(*self.sizes)

    def check(self, tokenizer: Any, processor: ImageProcessor) -> None:
        """Qwen2-VL's checks, and the processor's patch, temporal patch and merge sizes must be the model's."""
        super().check(tokenizer, processor)
        got = tuple(int(getattr(processor, a)) for a in ("patch_size", "temporal_patch_size", "merge_size"))
        if got != self.sizes:
            raise UnsupportedModelError(
                f"{type(processor).__name__} has patch_size, temporal_patch_size, merge_size {got}, the qwen3_vl "
                f"model {self.sizes}: use the model folder's own image processor, or family_for(model).image_processor()"
            )

    def encode_videos(
        self, videos: list[dict], processor: ImageProcessor, *, record: Any = None, fields: list[str] | None = None
    ) -> TimedVideos:
        """Patches, placeholder counts per temporal slice and timestamps of one conversation's video
        parts (in order; see the module text). ``record`` and ``fields`` (each part's) are named in errors."""
        enc = encode_videos(videos, processor, sampling=self.video_sampling, record=record, fields=fields)
        t = int(cast(PatchProcessor, processor).temporal_patch_size)  # check(): a patch processor
        stamps = []
        for i, part in enumerate(videos):
            fps = _fps(part, record, fields[i] if fields is not None else f"videos[{i}]")
            if part.get("frames") is not None:  # kept whole, taken at the part's rate
                indices, rate = list(range(int(enc.frames[i]))), fps if fps is not None else DEFAULT_FPS
            else:  # the file, sampled as encode_videos sampled it (its header read again)
                total, rate = video_header(str(part["path"]))
                want = fps if fps is not None else self.video_sampling.fps
                indices = sample_indices(total, rate, float(want or rate), t, self.video_sampling).tolist()
            stamps.append(frame_timestamps(indices, rate, t))
        assert enc.grid_thw is not None
        per_slice = np.repeat(enc.grid_thw[:, 1] * enc.grid_thw[:, 2] // enc.merge_size**2, enc.grid_thw[:, 0])
        return TimedVideos(
            pixel_values=enc.pixel_values,
            tokens=per_slice,
            grid_thw=enc.grid_thw,
            merge_size=enc.merge_size,
            second_per_grid_ts=enc.second_per_grid_ts,
            frames=enc.frames,
            timestamps=stamps,
        )

    def media_text(self, kind: str, index: int, encoded: EncodedImages) -> str | None:
        """A video's placeholder as ``Qwen3VLProcessor.replace_video_token`` writes it: per temporal
        slice ``<{t:.1f} seconds>`` and a vision block with one placeholder (repeated by its count);
        an image's mark stays."""
        if kind != "video":
            return None
        if not isinstance(encoded, TimedVideos):
            raise TypeError(f"Qwen3VL.media_text: videos must be encode_videos()' TimedVideos, got {type(encoded)}")
        return "".join(f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD}{VISION_END}" for t in encoded.timestamps[index])

    def media(
        self,
        input_ids: np.ndarray,
        runs: np.ndarray,
        images: EncodedImages,
        token_id: int,
        *,
        videos: EncodedImages | None = None,
        video_runs: np.ndarray | None = None,
    ) -> PatchMedia:
        """Qwen2-VL's media with every temporal slice of a video its own item (``video_runs``: one
        run per slice, :meth:`encode_videos`' :class:`TimedVideos`), so the positions are
        ``get_rope_index``'s."""
        if isinstance(videos, TimedVideos):
            videos = videos.slices()
        return super().media(input_ids, runs, images, token_id, videos=videos, video_runs=video_runs)

    def _alone_media(self, model: VisionLanguageModel, input_ids: torch.Tensor, media: PatchMedia) -> dict[str, Any]:
        """Qwen2-VL's (the model runs its tower and ``get_rope_index`` itself), each run of
        consecutive slices of one size joined back into one ``(t, h, w)`` video grid, as the
        processor's ``video_grid_thw`` has it (two videos of one size back to back become one grid:
        the model splits every video grid into slices, so that changes nothing)."""
        kw = super()._alone_media(model, input_ids, media)
        if "video_grid_thw" in kw:
            grids: list[list[int]] = []
            for t, h, w in kw["video_grid_thw"].tolist():
                if grids and grids[-1][1:] == [h, w]:
                    grids[-1][0] += t
                else:
                    grids.append([t, h, w])
            kw["video_grid_thw"] = torch.tensor(grids, dtype=torch.int64)
        return kw

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

    def vision_outputs(self, model: VisionLanguageModel, media: PatchMedia) -> Any:
        """The vision tower over the row's items (one attention segment per frame), its merged
        output and each deepstack map split per item, as the model's ``mm_encoder_outputs`` take them."""
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

    def encoder_outputs(self, model: VisionLanguageModel, media: PatchMedia) -> dict[str, Any]:
        """The model's ``mm_encoder_outputs`` for a row: the tower once over every item
        (:meth:`vision_outputs`), the images' merged features and deepstack maps under ``"image"``,
        the video slices' under ``"video"``, each in row order (the model lays each kind's deepstack
        maps on that kind's placeholders)."""
        out = self.vision_outputs(model, media)
        if not media.num_videos:
            return {"image": out}
        hf = _optional.transformers("models.qwen3_vl.modeling_qwen3_vl")
        return {
            kind: hf.BaseModelOutputWithDeepstackFeatures(
                last_hidden_state=out.last_hidden_state,
                pooler_output=tuple(out.pooler_output[i] for i in idx.tolist()),
                deepstack_features=[tuple(f[i] for i in idx.tolist()) for f in out.deepstack_features],
            )
            for kind, (_, _, idx) in media.by_kind().items()
        }
