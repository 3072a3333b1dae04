"""Qwen2-VL: a patch-sequence vision tower, placeholders in a vision block, MRoPE positions.

The family behind :class:`~sftpack.multimodal.Family` (``family_for("qwen2_vl")``):

- an image part is ``<|vision_start|><|image_pad|><|vision_end|>``, its placeholder
  repeated ``t*h*w / merge**2`` times (``Qwen2VLProcessor``'s ``replace_image_token``
  rule), its pixels ``(t*h*w, 3*t_p*14*14)`` patches from ``Qwen2VLImageProcessorPil``;
- a video part (frames or a file, :mod:`~sftpack.multimodal._video`) is
  ``<|vision_start|><|video_pad|><|vision_end|>``, its placeholder repeated
  ``t*h*w / merge**2`` times (``replace_video_token``), its frames sampled, sized and patched as
  ``Qwen2VLVideoProcessor`` does (:meth:`Qwen2VL.encode_videos`; with a model folder by its
  video settings, :meth:`Qwen2VL.video_settings`, else each frame sized by the image processor's
  limits and HF's sampling defaults); a sample's images and
  videos are the items of one :class:`~sftpack.handoff.payload.PatchMedia`, in text order
  (:meth:`Qwen2VL.media`);
- the media is a :class:`~sftpack.handoff.payload.PatchMedia` with each sample's own
  MRoPE positions (:func:`mrope_positions`, ``Qwen2VLModel.get_rope_index`` re-implemented
  in numpy and tested equal to it);
- the tokenizer is the embedded Qwen BPE plus Qwen2-VL's special tokens at Qwen2-VL's ids.

The language model runs sftpack's training attention (``sftpack_varlen_train``):
boundaries from ``cu_seq_lens_q`` (padded) and, in the ``real`` mode,
``sftpack_cu_seqlens_real``. Qwen2-VL's text attention hands these keyword arguments
through unchanged, and its ``(4, 1, T)`` position form (text row on top of the MRoPE
rows) only feeds the mask builder, which the registered mask function turns into "no
mask". The vision tower runs ``sdpa`` (bidirectional within each image);
:meth:`Qwen2VL.packed_logits` calls the tower itself with the row's per-image
boundaries and hands its output to the model (``mm_encoder_outputs``), so the language
model's boundary arguments never reach the vision attention.
"""

from __future__ import annotations

import copy
import math
import os
from functools import lru_cache
from typing import Any, ClassVar, cast

import numpy as np
import torch

from ... import _optional
from ...data import default_tokenizer
from ...exactness import small_text_config
from ...handoff import PackedBatch
from ...handoff.payload import PatchMedia
from .._family import (
    EncodedImages,
    Family,
    ImageProcessor,
    PatchProcessor,
    VisionLanguageModel,
    seeded_model,
    text_kwargs,
)
from .._images import (
    _pil_processor_class,
    process_images,
    processor_from_settings,
    processor_settings,
    reproduces,
)
from .._video import (
    EncodedVideos,
    VideoRule,
    VideoSampling,
    encode_videos,
    fit_size,
    read_video_settings,
    video_processor_for,
)

__all__ = [
    "QWEN2VL_SPECIALS",
    "QWEN2VL_STORED_FORMAT",
    "Qwen2VL",
    "Qwen2VLVideoRule",
    "mrope_positions",
    "qwen2vl_image_processor",
    "qwen2vl_tokenizer",
]

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
#: OpenAI CLIP's mean and std (transformers' ``OPENAI_CLIP_MEAN`` / ``_STD``): Qwen2-VL's normalisation
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
#: Qwen2-VL's special tokens after ``<|im_end|>``, in id order (151646 ... 151656).
QWEN2VL_SPECIALS = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    "<|vision_pad|>",
    IMAGE_PAD,
    VIDEO_PAD,
)
QWEN2VL_IDS = dict(zip(QWEN2VL_SPECIALS, range(151646, 151657)))
#: How a prepack stores a Qwen-VL family's media items (its manifest's ``media.kind``): each item's
#: resized uint8 pixels ``(frames, H, W, 3)`` as ``Qwen2VLImageProcessorPil`` resizes them, the
#: patches remade by that processor of the manifest's ``processor`` settings (and the videos' by
#: its ``video_processor``). Qwen2.5-VL and Qwen3-VL store theirs the same way.
QWEN2VL_STORED_FORMAT = "qwen2vl-resized-uint8-hwc"


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    tok = copy.deepcopy(default_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": list(QWEN2VL_SPECIALS)}, replace_extra_special_tokens=False)
    got = dict(zip(QWEN2VL_SPECIALS, tok.convert_tokens_to_ids(list(QWEN2VL_SPECIALS))))
    if got != QWEN2VL_IDS:
        raise RuntimeError(f"Qwen2-VL special token ids {got} differ from Qwen2-VL's {QWEN2VL_IDS}")
    return tok


def qwen2vl_tokenizer() -> Any:
    """The embedded Qwen BPE (:func:`sftpack.data.default_tokenizer`) plus Qwen2-VL's special
    tokens at Qwen2-VL's ids (``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653,
    ``<|image_pad|>`` 151655); 151,657 tokens. Shared within the process."""
    return _tokenizer()


@lru_cache(maxsize=8)
def qwen2vl_image_processor(min_pixels: int = 56 * 56, max_pixels: int = 448 * 448) -> Any:
    """Qwen2-VL's PIL/numpy image processor (``Qwen2VLImageProcessorPil``: patch 14, temporal
    patch 2, merge 2), shared: the family's default. Not the torchvision ``Qwen2VLImageProcessor``
    that ``AutoProcessor`` / ``AutoImageProcessor`` pick where torchvision is installed: its resize
    differs by 1-2 levels of 255 on some pixels (pass that one as ``processor=`` to get its patches)."""
    return _pil_processor_class()(min_pixels=min_pixels, max_pixels=max_pixels)


def mrope_positions(
    length: int, runs: np.ndarray, grid_thw: np.ndarray, merge: int, time_interval: np.ndarray | None = None
) -> np.ndarray:
    """Qwen2-VL's 3-D MRoPE positions ``(3, length)`` of one sample alone, starting at 0.

    The rule of ``Qwen2VLModel.get_rope_index`` (transformers 5.24), re-implemented in
    numpy and tested equal to it: a text token takes ``(p, p, p)`` and advances ``p``
    by one; an image or video of grid ``(t, h, w)`` with ``h' = h/merge``, ``w' = w/merge``
    (placeholder run ``runs[i]``) takes ``(p + i_t, p + i_h, p + i_w)`` over its
    ``t x h' x w'`` placeholders in row-major order, then ``p`` advances by
    ``max(h, w) // merge``. ``time_interval`` (``(I,)`` float32, Qwen2.5-VL's videos):
    the temporal index is ``int(i_t * time_interval[i])`` instead, the product in float32
    as ``Qwen2_5_VLModel.get_vision_position_ids`` computes it (an interval of 1 is ``i_t``).
    """
    L = int(length)
    out = np.empty((3, L), dtype=np.int64)
    p, t0 = 0, 0
    steps = None if time_interval is None else np.asarray(time_interval, dtype=np.float32).tolist()
    for i, ((s, n), (gt, gh, gw)) in enumerate(zip(np.asarray(runs).tolist(), np.asarray(grid_thw).tolist())):
        out[:, t0:s] = np.arange(p, p + s - t0)
        p += s - t0
        hh, ww = gh // merge, gw // merge
        ts = np.arange(gt)
        if steps is not None:
            ts = (ts.astype(np.float32) * np.float32(steps[i])).astype(np.int64)
        tt, yy, xx = np.meshgrid(ts, np.arange(hh), np.arange(ww), indexing="ij")
        out[0, s : s + n] = tt.reshape(-1) + p
        out[1, s : s + n] = yy.reshape(-1) + p
        out[2, s : s + n] = xx.reshape(-1) + p
        p += max(gh, gw) // merge
        t0 = s + n
    out[:, t0:] = np.arange(p, p + L - t0)
    return out


class Qwen2VLVideoRule(VideoRule):
    """``Qwen2VLVideoProcessor``'s rule (transformers 5.24, re-implemented and tested against its
    own code): a file sampled evenly from its first frame, a multiple of the temporal patch;
    each frame sized alone. A model folder's ``min_pixels`` / ``max_pixels`` override its ``size``."""

    pixel_keys: ClassVar[bool] = True

    def indices(
        self, total: int, file_fps: float, fps: float, temporal_patch: int, sampling: VideoSampling
    ) -> np.ndarray:
        """``Qwen2VLVideoProcessor.sample_frames``' rule: ``n = total / file_fps * fps`` clamped
        to ``[min_frames, min(max_frames, total)]`` and rounded down to a multiple of the temporal
        patch, taken evenly from 0.

        Raises:
            ValueError: the clip has fewer frames than one temporal patch.
        """
        top = math.floor(min(sampling.max_frames, total) / temporal_patch) * temporal_patch
        n = min(max(total / file_fps * fps, sampling.min_frames), top, total)
        n = math.floor(n / temporal_patch) * temporal_patch
        if n < 1:
            raise ValueError(
                f"{total} frame(s) sampled at {fps:g} fps give fewer frames than one temporal patch of {temporal_patch}"
            )
        # the processor takes torch.arange(0, total, total / n).int(): the same float steps here
        out: np.ndarray = torch.arange(0, total, total / n).int().numpy().astype(np.int64)
        return out

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
        """Each frame alone (:func:`~sftpack.multimodal._video.fit_size` of one frame); with
        ``cap_pixels_per_frame`` the upper limit at most the clip's share of 90 % of
        ``max_video_tokens``' pixels (at least ``1.05 x`` the lower)."""
        lo, hi = limits
        if sampling.cap_pixels_per_frame:
            budget = int(sampling.max_video_tokens * factor * factor * 0.9)
            hi = max(min(hi, budget * temporal // frames), int(lo * 1.05))
        return fit_size(height, width, 1, 1, (lo, hi), factor)


class Qwen2VL(Family):
    """Qwen2-VL (see the module text)."""

    name: ClassVar[str] = "qwen2_vl"
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_vl",)
    image_block: ClassVar[tuple[str, ...]] = (VISION_START, IMAGE_PAD, VISION_END)
    placeholder: ClassVar[str] = IMAGE_PAD
    #: what each video part becomes in the text, and its placeholder
    video_block: ClassVar[tuple[str, ...]] = (VISION_START, VIDEO_PAD, VISION_END)
    video_placeholder: ClassVar[str] = VIDEO_PAD
    #: ``Qwen2VLVideoProcessor``'s class defaults (transformers 5.24): frames not sampled, each
    #: sized alone within 128 x 28 x 28 ... 28 x 28 x 768 pixels; what a model folder's video
    #: settings fall back to key by key (:meth:`video_settings`)
    video_defaults: ClassVar[VideoSampling] = VideoSampling(
        rule="qwen2_vl",
        min_pixels=128 * 28 * 28,
        max_pixels=28 * 28 * 768,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        rescale_factor=1 / 255,
        resample=3,  # bicubic
        max_video_tokens=128000,
    )
    processor_wanted: ClassVar[str] = (
        "(integer patch_size, temporal_patch_size and merge_size; image_grid_thw out): the qwen2_vl and "
        "qwen2_5_vl families take Qwen2VLImageProcessorPil (Family.image_processor()), the llava family a "
        "CLIP processor"
    )
    media_class: ClassVar[type[PatchMedia]] = PatchMedia
    stored_format: ClassVar[str] = QWEN2VL_STORED_FORMAT
    #: how a video file is sampled and a clip sized (``VideoSampling.rule`` ``"qwen2_vl"`` names it)
    video_rule: ClassVar[VideoRule] = Qwen2VLVideoRule()
    model_class: ClassVar[str] = "Qwen2VLForConditionalGeneration"
    norm_classes: ClassVar[tuple[str, ...] | None] = ("Qwen2VLRMSNorm",)

    def __init__(self, video_sampling: VideoSampling | None = None) -> None:
        #: the video processor's settings :meth:`encode_videos` follows: a model folder's
        #: (:meth:`video_settings`, set by :meth:`from_config` and :meth:`image_processor` of a
        #: folder), else :attr:`video_defaults`' sampling with each frame sized by the image processor
        self.video_sampling = video_sampling if video_sampling is not None else self.video_settings()

    @classmethod
    def from_config(cls, config: Any) -> Qwen2VL:
        """The family configured for ``config`` (:meth:`_configured`), with the video settings of
        the model folder it was read from (``config.name_or_path``, a local folder) when it is one."""
        family = cls._configured(config)
        folder = getattr(config, "name_or_path", None)
        if isinstance(folder, str) and folder and os.path.isdir(folder):
            family.video_sampling = family.video_settings(folder)
        return family

    @classmethod
    def _configured(cls, config: Any) -> Qwen2VL:
        """The family for ``config`` (Qwen2-VL takes nothing from it)."""
        return cls()

    def video_settings(self, model_dir: str | os.PathLike | None = None) -> VideoSampling:
        """The video processor's settings of the model folder ``model_dir``
        (:func:`~sftpack.multimodal._video.read_video_settings`: its video processor's file, or
        the image processor's, each key it lacks from :attr:`video_defaults`); without a folder,
        or a folder without either file, :attr:`video_defaults`' sampling with each frame sized
        as the image processor sizes an image.

        Raises:
            UnsupportedModelError: a bad value in the folder's file (naming the file and the key).
        """
        found = None if model_dir is None else read_video_settings(model_dir, self.video_defaults)
        return found if found is not None else self.video_defaults.sampling_only()

    def image_processor(self, model_dir: str | os.PathLike | None = None) -> Any:
        """The base's image processor; a model folder's also sets the family's video settings to
        the folder's (:meth:`video_settings`), so its videos are sized as its video processor sizes them."""
        processor = super().image_processor(model_dir)
        if model_dir is not None:
            self.video_sampling = self.video_settings(model_dir)
        return processor

    def video_processor(self, processor: ImageProcessor) -> Any:
        """The image processor as the video settings make frames' values (their mean, std and
        limits; :func:`~sftpack.multimodal._video.video_processor_for`)."""
        return video_processor_for(processor, self.video_sampling)

    # ------------------------------------------------------ stored media
    def check_stored(self, processor: ImageProcessor) -> None:
        """A prepack stores each item's resized uint8 pixels and remakes the patches as
        transformers' ``Qwen2VLImageProcessorPil`` does: ``processor`` must be that one
        (:func:`~sftpack.multimodal.reproduces`).

        Raises:
            ValueError: another processor, naming it and the fix."""
        if not reproduces(processor):
            raise ValueError(
                f"a prepack with images stores each image's resized uint8 pixels and re-makes the patches the way "
                f"transformers' Qwen2VLImageProcessorPil does, which {type(processor).__name__} with these settings "
                f"(family {self.name!r}) does not reproduce exactly: pass sftpack.multimodal.family_for()."
                "image_processor(), or a transformers.Qwen2VLImageProcessorPil(min_pixels=..., max_pixels=...) that "
                "resizes, rescales, normalises and converts to RGB"
            )

    def stored_processor(self, processor: ImageProcessor, merge_size: int | None = None) -> dict[str, Any]:
        """The tower's merge window and the settings of the image processor and of the video
        processor (:meth:`video_processor`) that remake the patches
        (:func:`~sftpack.multimodal.processor_settings`)."""
        merge = merge_size if merge_size is not None else cast(PatchProcessor, processor).merge_size
        return {
            "merge_size": int(merge),
            "processor": processor_settings(processor),
            "video_processor": processor_settings(self.video_processor(processor)),
        }

    def stored_processors(self, entry: dict[str, Any]) -> tuple[ImageProcessor, ImageProcessor]:
        """The ``Qwen2VLImageProcessorPil`` of the entry's ``processor`` settings and the one of
        its ``video_processor`` settings (:func:`~sftpack.multimodal.processor_from_settings`),
        each checked to have them.

        Raises:
            ValueError: the installed transformers makes a processor of other settings."""
        want = entry["processor"]
        image = processor_from_settings(want)
        have = processor_settings(image)
        diff = sorted(k for k in want if want[k] != have.get(k))
        if diff:
            raise ValueError(
                "its images were stored for an image processor with "
                f"{', '.join(f'{k}={want[k]!r}' for k in diff)}, the installed one has "
                f"{', '.join(f'{k}={have.get(k)!r}' for k in diff)}: the patches would differ; install the "
                "transformers version it was written with, or prepack again"
            )
        # the videos' frames normalised as the model folder's video settings say (its mean and std)
        settings = entry.get("video_processor", want)
        video = processor_from_settings(settings)
        if processor_settings(video) != settings:
            raise ValueError(
                f"its videos were stored for a video processor with settings {settings}, the installed one reads "
                "them otherwise: install the transformers version it was written with, or prepack again"
            )
        return image, video

    def _default_tokenizer(self) -> Any:
        return qwen2vl_tokenizer()

    def _default_image_processor(self) -> Any:
        return qwen2vl_image_processor()

    def check(self, tokenizer: Any, processor: ImageProcessor) -> None:
        """The base's checks, and the video settings' patch sizes must be ``processor``'s (a
        folder's video processor file of other sizes is refused here, before any record)."""
        super().check(tokenizer, processor)
        video_processor_for(processor, self.video_sampling)

    def takes_processor(self, processor: ImageProcessor) -> bool:
        sizes = [getattr(processor, a, None) for a in ("patch_size", "temporal_patch_size", "merge_size")]
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes)
        return ints and "image_grid_thw" in (getattr(processor, "model_input_names", None) or ())

    def encode_images(self, images: list[Any], processor: ImageProcessor) -> EncodedImages:
        patches = process_images(images, processor)
        grid = patches.image_grid_thw
        merge = int(cast(PatchProcessor, processor).merge_size)  # check(): a patch processor
        return EncodedImages(patches.pixel_values, patches.tokens_per_image(merge), grid, merge)

    def _media_fields(
        self, input_ids: np.ndarray, runs: np.ndarray, images: EncodedImages, **videos: Any
    ) -> dict[str, Any]:
        """Images only: a sample with videos is laid by :meth:`media` itself."""
        assert images.grid_thw is not None
        merge = images.merge_size
        return {
            "grid_thw": torch.from_numpy(images.grid_thw),
            "merge_size": merge,
            "positions": torch.from_numpy(mrope_positions(len(input_ids), runs, images.grid_thw, merge)),
        }

    # ------------------------------------------------------------------ video
    def encode_videos(
        self, videos: list[dict], processor: ImageProcessor, *, record: Any = None, fields: list[str] | None = None
    ) -> EncodedVideos:
        """Patches and placeholder counts of one conversation's video parts (in order), their
        frames sampled, resized and normalised by :attr:`video_sampling` (the model folder's video
        settings; without pixel limits of their own resized and normalised by ``processor``) and
        patched by ``processor``'s sizes (see :mod:`~sftpack.multimodal._video`).
        ``record`` and ``fields`` (each part's) are named in errors."""
        return encode_videos(videos, processor, sampling=self.video_sampling, record=record, fields=fields)

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
        """The sample's :class:`~sftpack.handoff.payload.PatchMedia`: its images (``runs[i]``:
        image ``i``'s placeholder run) and its videos (``videos``: :meth:`encode_videos`'
        :class:`~sftpack.multimodal._video.EncodedVideos`; ``video_runs[j]``: video ``j``'s run,
        whose token is the video placeholder) as items in text order, with their MRoPE
        positions. Without videos the base's (images only)."""
        if videos is None or video_runs is None or not len(video_runs):
            media = super().media(input_ids, runs, images, token_id)
            assert isinstance(media, PatchMedia)
            return media
        if not isinstance(videos, EncodedVideos):
            raise TypeError(
                f"Qwen2VL.media: videos must be encode_videos()' EncodedVideos, got {type(videos).__name__}"
            )
        assert videos.grid_thw is not None
        video_token_id = int(input_ids[int(video_runs[0][0])])
        merge = videos.merge_size
        img_grid = np.zeros((0, 3), np.int64) if images.grid_thw is None else images.grid_thw
        img_pv = images.pixel_values
        if len(img_grid) and images.merge_size != merge:
            raise ValueError(f"Qwen2VL.media: images merge {images.merge_size} but videos {merge}")
        all_runs = np.concatenate([np.asarray(runs, np.int64).reshape(-1, 2), np.asarray(video_runs, np.int64)])
        grids = np.concatenate([img_grid, videos.grid_thw])
        is_video = np.r_[np.zeros(len(img_grid), bool), np.ones(len(videos.grid_thw), bool)]
        seconds = np.r_[np.zeros(len(img_grid), np.float32), videos.second_per_grid_ts].astype(np.float32)
        chunks = np.split(img_pv, np.cumsum(img_grid.prod(axis=1))[:-1]) if len(img_grid) else []
        chunks += np.split(videos.pixel_values, np.cumsum(videos.grid_thw.prod(axis=1))[:-1])
        order = np.argsort(all_runs[:, 0], kind="stable")
        grids, is_video, seconds = grids[order], is_video[order], seconds[order]
        positions = mrope_positions(
            len(input_ids), all_runs[order], grids, merge, self._time_intervals(is_video, seconds)
        )
        return PatchMedia(
            pixel_values=torch.from_numpy(np.concatenate([chunks[k] for k in order.tolist()])),
            slots=torch.from_numpy(all_runs[order]),
            sequence=torch.zeros(len(order), dtype=torch.int64),
            token_id=int(token_id),
            grid_thw=torch.from_numpy(grids),
            merge_size=merge,
            positions=torch.from_numpy(positions),
            video=torch.from_numpy(is_video),
            video_token_id=video_token_id,
            second_per_grid_ts=torch.from_numpy(seconds),
        )

    def _time_intervals(self, is_video: np.ndarray, seconds: np.ndarray) -> np.ndarray | None:
        """Each item's temporal position step (:func:`mrope_positions`); ``None``: 1 (Qwen2-VL's rule)."""
        return None

    # ------------------------------------------------------------- the model
    def token_ids(self, tokenizer: Any) -> dict[str, int]:
        """The ids a config names: the placeholders (image, video) and the vision block's ends."""
        ids = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VISION_START, VISION_END, VIDEO_PAD])
        return dict(
            image_token_id=ids[0], vision_start_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3]
        )

    def config(self, vocab_size: int, token_ids: dict[str, int], **sizes: Any) -> Any:
        """A small ``Qwen2VLConfig`` (patch 14, temporal patch 2, merge 2; MRoPE sections of a
        ``dim / heads / 2`` rotary half-width)."""
        return _config(_optional.transformers().Qwen2VLConfig, vocab_size, token_ids, **sizes)

    def _tiny_model(self, vocab_size: int, ids: dict[str, int], build: dict[str, Any], sizes: dict[str, Any]) -> Any:
        """Vision: patch 14, temporal patch 2, merge 2 (so the real image processor fits).
        Text: MRoPE sections of a ``dim / heads / 2`` rotary half-width. The vision tower runs
        ``sdpa``. ``sizes``: ``dim``, ``layers``, ``heads``, ``kv_heads``, ``vision_dim``,
        ``vision_depth``, ``vision_heads``."""
        cfg = self.config(vocab_size, ids, **sizes)
        model_class = getattr(_optional.transformers(), self.model_class)
        return seeded_model(model_class, cfg, **build, norm_classes=self.norm_classes)

    def vision_outputs(self, model: VisionLanguageModel, media: PatchMedia) -> Any:
        """The vision tower over the row's items (images and videos), one attention segment per
        frame, its features split per item (``pooler_output``)."""
        hf = _optional.transformers("modeling_outputs")
        visual = model.model.visual
        grid = media.grid_thw
        out = visual(media.pixel_values.to(visual.dtype), grid_thw=grid, cu_seqlens=media.vision_cu_seqlens)
        sizes = (grid.prod(-1) // visual.spatial_merge_size**2).tolist()
        return hf.BaseModelOutputWithPooling(
            last_hidden_state=out.last_hidden_state, pooler_output=torch.split(out.pooler_output, sizes)
        )

    def encoder_outputs(self, model: VisionLanguageModel, media: PatchMedia) -> dict[str, Any]:
        """The model's ``mm_encoder_outputs`` for a row: the tower run once over every item
        (:meth:`vision_outputs`; an item's features depend on it alone), the features of the
        images under ``"image"`` and those of the videos under ``"video"``, each in row order."""
        out = self.vision_outputs(model, media)
        if not media.num_videos:
            return {"image": out}
        hf = _optional.transformers("modeling_outputs")
        return {
            kind: hf.BaseModelOutputWithPooling(
                last_hidden_state=out.last_hidden_state, pooler_output=tuple(out.pooler_output[i] for i in idx.tolist())
            )
            for kind, (_, _, idx) in media.by_kind().items()
        }

    def packed_hidden(
        self, model: VisionLanguageModel, batch: PackedBatch, *, pad_between_seqs: bool = True
    ) -> torch.Tensor:
        """``(T, H)`` hidden states of a packed row: the vision tower over the row's per-image
        boundaries, the language model over ``batch.to_hf_kwargs()`` (its tower inputs and
        labels dropped; with ``pad_between_seqs`` the real boundaries added as
        ``sftpack_cu_seqlens_real``).

        With sftpack's training attention the boundaries are ``cu_seqlens`` (either mode).
        With any other attention (``sdpa``, ``eager``) only ``input_ids`` and the ``(4, 1, T)``
        positions go in, and Hugging Face builds a block-causal mask from the restarts of
        the text position row; ``pad_between_seqs`` is then moot.
        """
        row = batch.to_hf_kwargs()  # its pixels and labels left out: the tower runs here, the loss is the caller's
        inputs = {"input_ids": row["input_ids"], "position_ids": row["position_ids"]}
        kw = text_kwargs(model, batch, inputs, pad_between_seqs=pad_between_seqs)
        media = batch.media
        if isinstance(media, PatchMedia) and media.num_items:
            kw["mm_encoder_outputs"] = self.encoder_outputs(model, media)
        return model.model(**kw).last_hidden_state[0]

    def _alone_media(self, model: VisionLanguageModel, input_ids: torch.Tensor, media: PatchMedia) -> dict[str, Any]:
        """Hugging Face's own way: the model computes the MRoPE positions (``get_rope_index``)
        and runs its vision tower itself (images and videos apart); one causal sequence, no
        boundaries. ``mm_token_type_ids``: 1 at image placeholders, 2 at video ones."""
        kinds = media.by_kind()
        types = (input_ids == media.token_id).to(torch.int32)
        kw: dict[str, Any] = {}
        if "image" in kinds:
            kw["pixel_values"], kw["image_grid_thw"], _ = kinds["image"]
        if "video" in kinds:
            kw["pixel_values_videos"], kw["video_grid_thw"], index = kinds["video"]
            types[input_ids == int(media.video_token_id or 0)] = 2
            kw.update(self._alone_video(media, index))
        kw["mm_token_type_ids"] = types
        return kw

    def _alone_video(self, media: PatchMedia, index: torch.Tensor) -> dict[str, Any]:
        """What the model's own forward takes beyond the videos' pixels and grids (Qwen2-VL: nothing)."""
        return {}

    def part_of(self, parameter: str) -> str:
        return "vision" if ".visual." in f".{parameter}" else "language"


def _config(
    config_class: Any,
    vocab_size: int,
    token_ids: dict[str, int],
    *,
    dim: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vision_dim: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 4,
    vision: dict[str, Any] | None = None,
) -> Any:
    """A small config of a Qwen2-VL-shaped model (``vision``: vision-config keys that replace or
    add to Qwen2-VL's)."""
    half = dim // heads // 2
    section = [half - 2 * (half // 4), half // 4, half // 4]
    return config_class(
        text_config=dict(
            **small_text_config(vocab_size, dim=dim, layers=layers, heads=heads, kv_heads=kv_heads),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
        vision_config={
            **dict(
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
            **(vision or {}),
        },
        video_token_id=token_ids.get("video_token_id", vocab_size - 1),
        tie_word_embeddings=False,
        **{k: v for k, v in token_ids.items() if k != "video_token_id"},
    )
