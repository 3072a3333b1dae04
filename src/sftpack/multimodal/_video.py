"""Videos of a multimodal conversation: read one video part, sample its frames, turn them into patches.

A video part is ``{"type": "video", "frames": [FILE, ...]}`` (the frames as images, in
order; optional ``"fps"``: the rate they were taken at) or ``{"type": "video", "path":
"clip.mp4"}`` (a file decoded by PyAV, the ``video`` extra; optional ``"fps"``: the rate
to sample it at). Relative names are read from the working directory, as
:func:`~sftpack.multimodal._images.load_image` reads images (the readers make a data file's
relative paths absolute). A refusal is a :class:`~sftpack.multimodal._images.BadImageError`
naming the record, the field, the reason (``video_*``) and the fix.

Frames follow the rule of transformers' ``Qwen2VLVideoProcessor`` (5.24), re-implemented
here (that processor needs torchvision, which has no build for this CPU torch) and tested
against its own code:

- a file is sampled only when asked (its ``fps``, or a :class:`VideoSampling` with
  ``fps``): ``n = frames / file_fps * fps`` clamped to ``[min_frames, min(max_frames,
  frames)]`` and rounded down to a multiple of the temporal patch, taken evenly from 0
  (:func:`sample_indices`); otherwise every frame is kept, as the processor's default
  ``do_sample_frames=False`` does. A list of frames is never sampled;
- every frame is resized to one size (:func:`resize_frames`), rescaled and normalised; an odd
  count (any count not a multiple of the temporal patch) is padded by repeating the last
  frame, and each run of ``temporal_patch_size`` frames becomes one temporal slice of the
  grid ``(t, h, w)``. The size: with a model folder's video settings (:class:`VideoSampling`
  with pixel limits, :func:`read_video_settings`) the video processor's ``smart_resize`` with
  its own limits (:func:`frame_size`; Qwen3-VL's bounds the whole clip, ``t x h x w``) and its
  own mean and std (:func:`frame_processor`); without them the image processor's, frame by frame;
- how a file is sampled and a clip sized is the family's :class:`VideoRule` (``VideoSampling.rule``
  names the family whose rule it is, :func:`video_rule`): Qwen2-VL's (``Qwen2VLVideoProcessor``'s,
  above; :mod:`sftpack.multimodal.families.qwen2_vl`) or Qwen3-VL's, which samples over the whole
  clip and bounds the whole clip's pixels (:mod:`sftpack.multimodal.families.qwen3_vl`, which also
  writes each temporal slice after its time);
- ``second_per_grid_ts`` (what Qwen2.5-VL's MRoPE spaces the temporal axis by) is
  ``temporal_patch_size / sampled_fps``, with ``sampled_fps = kept / frames * file_fps``
  for a file and the part's ``fps`` (24 when not given, the processor's fallback) for frames.

The per-frame pixels are those of ``Qwen2VLImageProcessorPil`` with the video settings (PIL
bicubic resize, then its rescale and normalisation): a video of identical frames is patch for
patch the still image of an image processor with the video's limits. transformers' torchvision video processor resizes with torchvision instead,
which differs by 1-2 levels of 255 on some pixels (the same difference as its torchvision
image processor's).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar, NoReturn

import numpy as np

from .. import _optional
from ._family import EncodedImages, UnsupportedModelError, family_for, family_names
from ._images import (
    BadImageError,
    BadImageReason,
    is_url,
    load_image,
    pixel_table,
    processor_from_settings,
    resize_image,
)

__all__ = [
    "EncodedVideos",
    "VideoSampling",
    "decode_video",
    "encode_videos",
    "VideoRule",
    "fit_size",
    "frame_processor",
    "frame_size",
    "patchify_frames",
    "read_video_settings",
    "resize_frames",
    "sample_indices",
    "video_header",
    "video_processor_for",
    "video_rule",
]

#: The frame rate HF's ``VideoMetadata.sampled_fps`` falls back to for frames without one.
DEFAULT_FPS = 24.0

#: Where a model folder's video processor settings are read from, in ``AutoVideoProcessor``'s order
#: (transformers 5.24): ``processor_config.json``'s ``"video_processor"`` entry, then the first file here.
VIDEO_CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")


@dataclass(frozen=True)
class VideoSampling:
    """A video processor's settings, as plain data: how frames are taken from a file, and how
    they are sized and normalised.

    Sampling (``Qwen2VLVideoProcessor``'s settings and defaults): ``fps`` (``None``: every
    frame, unless the part gives one), ``min_frames``, ``max_frames``; ``rule``: the family whose
    video rule applies (:func:`video_rule`: how a file is sampled, :func:`sample_indices`, and a
    clip sized, :func:`frame_size`), ``"qwen2_vl"`` (``Qwen2VLVideoProcessor``'s: each frame sized
    alone) or ``"qwen3_vl"`` (``Qwen3VLVideoProcessor``'s: the pixel limits over the whole clip).

    Sizing: ``min_pixels`` and ``max_pixels`` (the video processor's ``size``
    ``shortest_edge`` and ``longest_edge``; ``None``: each frame resized as the image processor
    resizes an image, with its limits), ``patch_size``, ``temporal_patch_size``, ``merge_size``,
    ``image_mean``, ``image_std``, ``rescale_factor``, ``resample`` (``None``: the image
    processor's), ``cap_pixels_per_frame`` and ``max_video_tokens`` (the processors' optional
    per-frame cap). ``source``: the file they were read from (:func:`read_video_settings`),
    named in errors."""

    fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768
    rule: str = "qwen2_vl"
    min_pixels: int | None = None
    max_pixels: int | None = None
    patch_size: int | None = None
    temporal_patch_size: int | None = None
    merge_size: int | None = None
    image_mean: tuple[float, ...] | None = None
    image_std: tuple[float, ...] | None = None
    rescale_factor: float | None = None
    resample: int | None = None
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 0
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.rule not in family_names():  # its rule is looked up when used (the family module may be loading)
            raise ValueError(f"VideoSampling.rule {self.rule!r}: a family's name, one with video ({family_names()})")
        if (self.min_pixels is None) != (self.max_pixels is None):
            raise ValueError("VideoSampling: give min_pixels and max_pixels together (or neither)")

    @property
    def sized(self) -> bool:
        """Whether the frames are sized by these settings' pixel limits (not the image processor's)."""
        return self.min_pixels is not None

    def sampling_only(self) -> VideoSampling:
        """The same sampling, the frames sized by the image processor (no pixel limits of its own)."""
        return VideoSampling(fps=self.fps, min_frames=self.min_frames, max_frames=self.max_frames, rule=self.rule)


@dataclass
class EncodedVideos(EncodedImages):
    """One conversation's videos, encoded (in order), as :class:`~sftpack.multimodal.EncodedImages`
    holds images: every video's patches ``pixel_values`` ``(P, D)`` float32, the placeholder
    ``tokens`` each takes (``t*h*w / merge**2``), each ``grid_thw`` ``(V, 3)``, the tower's
    ``merge_size``; and each ``second_per_grid_ts`` ``(V,)`` float32 (seconds a temporal slice
    spans) and ``frames`` ``(V,)`` (frames kept, before padding)."""

    second_per_grid_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    frames: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class VideoRule:
    """How a family's video processor samples a file's frames (:meth:`indices`) and sizes a clip
    (:meth:`frame_size`): the family's own rule (its ``video_rule``, named by
    ``VideoSampling.rule``; :func:`video_rule`). The rest of a video's way (decoding, resizing
    by that size, patching, the settings a model folder gives) is shared."""

    #: whether a model folder's ``min_pixels`` / ``max_pixels`` keys override its ``size`` limits
    #: (:func:`read_video_settings`)
    pixel_keys: ClassVar[bool] = False

    def indices(
        self, total: int, file_fps: float, fps: float, temporal_patch: int, sampling: VideoSampling
    ) -> np.ndarray:  # pragma: no cover - per family
        """The frames of a ``total``-frame file at ``file_fps`` kept when sampling at ``fps``.

        Raises:
            ValueError: too few frames for the rule."""
        raise NotImplementedError

    def frame_size(
        self,
        frames: int,
        height: int,
        width: int,
        limits: tuple[int, int],
        sampling: VideoSampling,
        factor: int,
        temporal: int,
    ) -> tuple[int, int]:  # pragma: no cover - per family
        """``(height, width)`` every frame of a clip of ``frames`` frames of ``height x width`` is
        resized to, within the pixel ``limits`` ``(min, max)``, sides multiples of ``factor``.

        Raises:
            ValueError: a clip the rule cannot size."""
        raise NotImplementedError


def video_rule(name: str) -> VideoRule:
    """The video rule of the family ``name`` (its ``video_rule``).

    Raises:
        ValueError: a family without video."""
    rule = getattr(type(family_for(name)), "video_rule", None)
    if not isinstance(rule, VideoRule):
        raise ValueError(f"VideoSampling.rule {name!r}: the {name} family takes no video, so has no video rule")
    return rule


def sample_indices(total: int, file_fps: float, fps: float, temporal_patch: int, sampling: VideoSampling) -> np.ndarray:
    """The frames of a ``total``-frame file at ``file_fps`` kept when sampling at ``fps``, by
    ``sampling.rule``'s family's rule (:meth:`VideoRule.indices`; see the module text).

    Raises:
        ValueError: the clip has fewer frames than the rule needs (one temporal patch).
    """
    return video_rule(sampling.rule).indices(total, file_fps, fps, temporal_patch, sampling)


def frame_size(
    frames: int, height: int, width: int, sampling: VideoSampling, factor: int, temporal: int
) -> tuple[int, int]:
    """``(height, width)`` that every frame of a clip of ``frames`` frames of ``height x width``
    is resized to by the video processor's rule (``sampling.rule``'s family's,
    :meth:`VideoRule.frame_size`: transformers 5.24's ``smart_resize`` of that family's module,
    re-implemented and tested against it), within ``sampling.min_pixels ... max_pixels``
    (``sampling.sized``), sides multiples of ``factor`` (``patch_size * merge_size``). With
    ``cap_pixels_per_frame`` the upper limit first shrinks as the processor's per-frame cap
    shrinks it (a share of ``max_video_tokens``, at least ``1.05 x min_pixels``).

    Raises:
        ValueError: settings without pixel limits, or a clip the rule cannot size.
    """
    if sampling.min_pixels is None or sampling.max_pixels is None:
        raise ValueError("frame_size: the settings have no pixel limits (VideoSampling.sized is False)")
    limits = (sampling.min_pixels, sampling.max_pixels)
    return video_rule(sampling.rule).frame_size(frames, height, width, limits, sampling, factor, temporal)


def fit_size(height: int, width: int, count: int, depth: int, limits: tuple[int, int], factor: int) -> tuple[int, int]:
    """``smart_resize``'s sizing, shared by the video rules: sides rounded to multiples of
    ``factor``; when ``depth`` frames of that size exceed the upper limit both sides scaled down
    (floored) by the ratio of ``count`` frames of ``height x width`` to it, below the lower limit
    scaled up (ceiled), the aspect ratio kept as nearly as the multiples allow."""
    lo, hi = limits
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if depth * h * w > hi:
        beta = math.sqrt((count * height * width) / hi)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif depth * h * w < lo:
        beta = math.sqrt(lo / (count * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def frame_processor(processor: Any, sampling: VideoSampling) -> Any:
    """The PIL/numpy ``Qwen2VLImageProcessorPil`` whose settings are the video processor's:
    ``processor`` itself for settings without pixel limits, else one (shared) with the settings'
    pixel limits, patch sizes, rescale factor, mean, std and resample, each ``None`` taken from
    ``processor``. Its ``process_image`` reads a frame, its table (:func:`pixel_table`)
    normalises it and its sizes patch it."""
    if not sampling.sized:
        return processor

    def pick(name: str) -> Any:
        own = getattr(sampling, name)
        return own if own is not None else getattr(processor, name)

    settings = {
        "patch_size": int(pick("patch_size")),
        "temporal_patch_size": int(pick("temporal_patch_size")),
        "merge_size": int(pick("merge_size")),
        "rescale_factor": float(pick("rescale_factor")),
        "image_mean": tuple(float(x) for x in pick("image_mean")),
        "image_std": tuple(float(x) for x in pick("image_std")),
        "min_pixels": int(sampling.min_pixels or 0),
        "max_pixels": int(sampling.max_pixels or 0),
        "resample": int(pick("resample")),
    }
    return _sized_processor(tuple(settings.items()))


@lru_cache(maxsize=8)
def _sized_processor(settings: tuple[tuple[str, Any], ...]) -> Any:
    """:func:`~sftpack.multimodal._images.processor_from_settings` of ``settings`` (its items), shared."""
    return processor_from_settings(dict(settings))


def video_processor_for(processor: Any, sampling: VideoSampling) -> Any:
    """:func:`frame_processor`, checked: its patch, temporal patch and merge sizes must be
    ``processor``'s (one vision tower takes both).

    Raises:
        UnsupportedModelError: they differ, in one line naming the settings' file.
    """
    sizes = ("patch_size", "temporal_patch_size", "merge_size")
    video = frame_processor(processor, sampling)
    got, want = (tuple(int(getattr(x, a)) for a in sizes) for x in (video, processor))
    if got != want:
        raise UnsupportedModelError(
            f"{sampling.source or 'the video settings'}: patch_size, temporal_patch_size, merge_size {got} "
            f"differ from the image processor's {want}: the model's vision tower takes one; make them equal"
        )
    return video


def resize_frames(images: list[Any], processor: Any, sampling: VideoSampling) -> np.ndarray:
    """``(N, H, W, 3)`` uint8: the frames (RGB ``PIL`` images of one size) resized. Without the
    settings' own pixel limits each as ``processor`` resizes an image (:func:`resize_image`);
    with them all to :func:`frame_size` by the settings' rule and frame count, with the same
    PIL resize the image processor runs (transformers' ``image_transforms.resize``).

    Raises:
        ValueError: :func:`frame_size`'s.
    """
    if not sampling.sized:
        first = resize_image(images[0], processor)
        out = np.empty((len(images), *first.shape), np.uint8)
        out[0] = first
        for i, im in enumerate(images[1:], 1):
            out[i] = resize_image(im, processor)
        return out
    proc = frame_processor(processor, sampling)
    width, height = images[0].size
    factor = int(proc.patch_size) * int(proc.merge_size)
    h, w = frame_size(len(images), height, width, sampling, factor, int(proc.temporal_patch_size))
    resize = _optional.transformers("image_transforms").resize
    out = np.empty((len(images), h, w, 3), np.uint8)
    for i, im in enumerate(images):
        chw = proc.process_image(im, do_convert_rgb=True)
        out[i] = np.moveaxis(
            resize(
                chw, (h, w), resample=proc.resample, data_format="channels_first", input_data_format="channels_first"
            ),
            0,
            -1,
        )
    return out


def video_header(path: str) -> tuple[int, float]:
    """``(frames, fps)`` a video file's first stream states in its header (as :func:`decode_video`
    and transformers' PyAV reader read them; 0 where it states none). The file must open:
    :func:`decode_video` has read it first."""
    av = _optional._need("av", "video", "decoding a video file")
    with av.open(path) as container:
        stream = container.streams.video[0]
        return int(stream.frames or 0), float(stream.average_rate) if stream.average_rate else 0.0


def patchify_frames(frames: np.ndarray, processor: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values (t*h*w, 3*T*p*p) float32, grid (t, h, w))`` of resized ``(N, H, W, 3)``
    uint8 frames: padded to a multiple of the temporal patch ``T`` by repeating the last frame,
    normalised by the processor's table, each run of ``T`` frames one temporal slice, patches in
    the tower's merge-window order (channel, then frame, row, column within a patch)."""
    p, t, m = int(processor.patch_size), int(processor.temporal_patch_size), int(processor.merge_size)
    n, h, w, c = frames.shape
    if pad := -n % t:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        n += pad
    gt, gh, gw = n // t, h // p, w // p
    table = pixel_table(processor)
    values = table[np.arange(3), frames]  # (N, H, W, 3) float32
    # (gt, T, bh, mh, py, bw, mw, px, C) -> (gt, bh, bw, mh, mw, C, T, py, px)
    blocks = values.reshape(gt, t, gh // m, m, p, gw // m, m, p, c).transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(blocks.reshape(gt * gh * gw, c * t * p * p)), np.array([gt, gh, gw], np.int64)


def _bad(record: Any, field: str, reason: BadImageReason, detail: str) -> NoReturn:
    raise BadImageError(record, field, reason, detail)


def decode_video(
    path: str, fps: float | None, temporal_patch: int, sampling: VideoSampling, record: Any = None, field: str = "video"
) -> tuple[list[Any], float]:
    """The kept frames (RGB ``PIL`` images) of the video file ``path`` and their ``sampled_fps``:
    every frame, or those :func:`sample_indices` keeps at ``fps`` (or ``sampling.fps``) out of
    the frames the stream's header counts (as transformers' PyAV reader counts them); only the
    kept frames are converted and held (the file is decoded up to the last one)."""
    av = _optional._need("av", "video", "decoding a video file")
    Image = _optional._need("PIL.Image", "multimodal", "reading images")
    where = f"{field}.path"

    def bad(reason: BadImageReason, detail: str) -> NoReturn:
        _bad(record, where, reason, f"the file {path!r} {detail}")

    if is_url(path):
        _bad(record, where, BadImageReason.VIDEO_URL, f"a URL {path[:80]!r}")
    if not os.path.isfile(path):
        here = "" if os.path.isabs(path) else f" in the working directory {os.getcwd()!r}"
        _bad(record, where, BadImageReason.VIDEO_MISSING_FILE, f"no file {path!r}{here}")
    want = fps if fps is not None else sampling.fps
    try:
        with av.open(path) as container:
            if not container.streams.video:
                bad(BadImageReason.VIDEO_UNDECODABLE, "holds no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else 0.0
            total = int(stream.frames or 0)
            if want is not None and (rate <= 0 or total <= 0):
                bad(BadImageReason.VIDEO_UNDECODABLE, "states no frame rate or frame count to sample by")
            idx = _indices(total, rate, want, temporal_patch, sampling, bad)
            keep, last = (set(), -1) if idx is None else (set(idx.tolist()), int(idx[-1]))
            frames = []
            for i, frame in enumerate(container.decode(stream)):
                if idx is not None and i > last:
                    break
                if idx is None or i in keep:
                    frames.append(Image.fromarray(frame.to_ndarray(format="rgb24")))
    except BadImageError:
        raise
    except Exception as e:  # PyAV raises several types for damaged or foreign data
        bad(BadImageReason.VIDEO_UNDECODABLE, f"cannot be decoded ({e})"[:300])
    if not frames:
        bad(BadImageReason.VIDEO_UNDECODABLE, "holds no frames")
    if idx is not None and len(frames) != len(idx):
        bad(BadImageReason.VIDEO_UNDECODABLE, f"decodes to fewer frames than the {total} its header counts")
    if idx is None:
        total = len(frames)
    sampled = len(frames) / total * rate if rate > 0 else DEFAULT_FPS
    return frames, sampled


def _indices(
    total: int,
    rate: float,
    want: float | None,
    temporal_patch: int,
    sampling: VideoSampling,
    bad: Callable[[BadImageReason, str], NoReturn],
) -> np.ndarray | None:
    """:func:`sample_indices`, or ``None`` (every frame) without a rate to sample at."""
    if want is None:
        return None
    try:
        return sample_indices(total, rate, float(want), temporal_patch, sampling)
    except ValueError as e:
        bad(BadImageReason.VIDEO_TOO_SHORT, f"is too short: {e}")


def _fps(part: dict, record: Any, field: str) -> float | None:
    fps = part.get("fps")
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        _bad(record, f"{field}.fps", BadImageReason.VIDEO_BAD_FPS, f"fps {fps!r} is not a positive number")
    return float(fps)


def load_frames(
    part: dict, processor: Any, sampling: VideoSampling, record: Any = None, field: str = "video"
) -> tuple[np.ndarray, float]:
    """``(N, H, W, 3)`` uint8 frames of one video part, all resized to one size
    (:func:`resize_frames`: the video settings' rule and limits, or without limits of their own
    the image processor's ``smart_resize`` of the first), and the part's ``sampled_fps``."""
    fps = _fps(part, record, field)
    t = int(processor.temporal_patch_size)
    if part.get("frames") is not None:
        names = part["frames"]
        if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)) or not names:
            _bad(record, f"{field}.frames", BadImageReason.VIDEO_NO_SOURCE, "frames must be a non-empty list of images")
        images = [
            load_image(f if isinstance(f, dict) else {"image": f}, record, f"{field}.frames[{i}]")
            for i, f in enumerate(names)
        ]
        sampled = fps if fps is not None else DEFAULT_FPS
    elif part.get("path") is not None:
        if not isinstance(part["path"], (str, os.PathLike)):
            _bad(record, f"{field}.path", BadImageReason.VIDEO_NO_SOURCE, f"path is a {type(part['path']).__name__}")
        images, sampled = decode_video(os.fspath(part["path"]), fps, t, sampling, record, field)
    else:
        _bad(record, field, BadImageReason.VIDEO_NO_SOURCE, f"no video in the part (keys {sorted(part)})")
    sizes = {im.size for im in images}
    if len(sizes) > 1:
        _bad(
            record,
            f"{field}.frames",
            BadImageReason.VIDEO_FRAME_SIZES,
            f"frames of sizes {sorted(sizes)} (width x height): a video's frames share one size",
        )
    try:
        return resize_frames(images, processor, sampling), sampled
    except ValueError as e:
        _bad(record, field, BadImageReason.VIDEO_TOO_SHORT, str(e))


def encode_videos(
    parts: list[dict],
    processor: Any,
    *,
    sampling: VideoSampling | None = None,
    record: Any = None,
    fields: list[str] | None = None,
) -> EncodedVideos:
    """Patches, grids, placeholder counts and ``second_per_grid_ts`` of one conversation's video
    parts (in order), by ``processor`` (a Qwen2-VL-style image processor: its resize, patch,
    temporal patch and merge sizes, rescale and normalisation) and ``sampling`` (the video
    processor's settings: its sampling and, where it has pixel limits, its sizes, mean and std,
    :func:`frame_processor`).
    ``record`` and ``fields`` (each part's, e.g. ``messages[0].content[1]``) are named in errors.

    Raises:
        BadImageError: a part without a source, a URL, a missing or undecodable file, frames of
            several sizes, a bad ``fps``, a clip shorter than one temporal patch once sampled.
        UnsupportedModelError: video settings whose patch sizes are not the image processor's.
    """
    sampling = sampling or VideoSampling()
    video = video_processor_for(processor, sampling)
    p, t, m = int(video.patch_size), int(video.temporal_patch_size), int(video.merge_size)
    pixels, grids, seconds, kept = [], [], [], []
    for i, part in enumerate(parts):
        field = fields[i] if fields is not None else f"videos[{i}]"
        frames, sampled = load_frames(part, processor, sampling, record, field)
        pv, grid = patchify_frames(frames, video)
        pixels.append(pv)
        grids.append(grid)
        seconds.append(t / sampled)  # a python float, as the processor's list holds it
        kept.append(len(frames))
    grid_thw = np.stack(grids) if grids else np.zeros((0, 3), np.int64)
    return EncodedVideos(
        pixel_values=np.concatenate(pixels) if pixels else np.zeros((0, 3 * t * p * p), np.float32),
        tokens=grid_thw.prod(axis=1) // (m * m),
        grid_thw=grid_thw,
        merge_size=m,
        second_per_grid_ts=np.asarray(seconds, dtype=np.float32),
        frames=np.asarray(kept, dtype=np.int64),
    )


# ------------------------------------------------------------------ a model folder's video settings
def read_video_settings(model_dir: str | os.PathLike, defaults: VideoSampling) -> VideoSampling | None:
    """The video processor settings of the model folder ``model_dir``, from the first of
    ``processor_config.json``'s ``"video_processor"`` entry, ``video_preprocessor_config.json``
    and ``preprocessor_config.json`` (``AutoVideoProcessor``'s order, so a folder with only an
    image processor's file has videos sized by its keys, as transformers does), each key missing
    or ``null`` taken from ``defaults`` (the family's video processor class's defaults, with
    pixel limits). ``None``: the folder has none of these files.

    The keys read (transformers 5.24's): ``size`` (``shortest_edge``, ``longest_edge``: the pixel
    limits), for a rule that reads them (:attr:`VideoRule.pixel_keys`: ``Qwen2VLVideoProcessor``
    takes them, ``Qwen3VLVideoProcessor`` ignores them) also ``min_pixels`` / ``max_pixels`` over them;
    ``patch_size``, ``temporal_patch_size``, ``merge_size``, ``image_mean``, ``image_std``,
    ``rescale_factor``, ``resample``; ``do_sample_frames`` (default: ``defaults.fps`` is set),
    ``fps``, ``min_frames``, ``max_frames``; ``cap_pixels_per_frame``, ``max_video_tokens``.
    Other keys are not read.

    Raises:
        UnsupportedModelError: a file that is not a JSON object, or a value of a key above that the
            processor could not take or sftpack does not follow (``do_resize``, ``do_rescale``,
            ``do_normalize`` false; ``num_frames`` with sampling on), in one line naming the file,
            the key and the fix.
    """
    folder = os.fspath(model_dir)
    nested = os.path.join(folder, "processor_config.json")
    if os.path.isfile(nested):
        entry = _json_object(nested).get("video_processor")
        if isinstance(entry, dict):
            return _settings(entry, defaults, f'{nested} ("video_processor")')
    for name in VIDEO_CONFIG_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return _settings(_json_object(path), defaults, path)
    return None


def _json_object(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"{path}: cannot be read as JSON ({e}); fix the file or remove it") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path}: holds a {type(data).__name__}, not a JSON object; fix the file")
    return data


def _settings(data: dict, defaults: VideoSampling, source: str) -> VideoSampling:
    """:func:`read_video_settings`' settings of one processor dict ``data`` read from ``source``."""

    def bad(key: str, value: Any, why: str, fix: str = "") -> NoReturn:
        raise UnsupportedModelError(
            f"{source}: {key} {value!r} {why}; {fix or 'fix it, or remove the key for the processor default'}"
        )

    def has(key: str) -> bool:
        return data.get(key) is not None

    def number(key: str, value: Any, *, integer: bool) -> Any:
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value <= 0:
            bad(key, value, f"is not a positive {'integer' if integer else 'number'}")
        return int(value) if integer else float(value)

    def get(key: str, default: Any, *, integer: bool = True) -> Any:
        return number(key, data[key], integer=integer) if has(key) else default

    def flag(key: str, default: bool) -> bool:
        if not has(key):
            return default
        if not isinstance(data[key], bool):
            bad(key, data[key], "is not true or false")
        return bool(data[key])

    def triple(key: str, default: Any) -> Any:
        if not has(key):
            return default
        value = data[key]
        items = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        ok = isinstance(items, list) and len(items) == 3
        if not ok or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in items):
            bad(key, value, "is not a number or a list of 3 numbers (one a channel)")
        if key == "image_std" and any(x == 0 for x in items):
            bad(key, value, "has a 0 (the normalisation divides by it)")
        return tuple(float(x) for x in items)

    for key in ("do_resize", "do_rescale", "do_normalize"):
        if flag(key, True) is not True:
            bad(key, data[key], "turns a step off", "sftpack resizes, rescales and normalises every frame: set it true")
    size = data.get("size")
    if size is None:
        lo: Any = defaults.min_pixels
        hi: Any = defaults.max_pixels
        lo_key, hi_key = "size.shortest_edge", "size.longest_edge"
    elif isinstance(size, dict):
        lo, hi, lo_key, hi_key = (
            size.get("shortest_edge"),
            size.get("longest_edge"),
            "size.shortest_edge",
            "size.longest_edge",
        )
    else:
        bad("size", size, "is not an object with shortest_edge and longest_edge (pixels)")
    if video_rule(defaults.rule).pixel_keys:  # e.g. Qwen2VLVideoProcessor takes min_pixels / max_pixels over size
        if has("min_pixels"):
            lo, lo_key = data["min_pixels"], "min_pixels"
        if has("max_pixels"):
            hi, hi_key = data["max_pixels"], "max_pixels"
    lo, hi = number(lo_key, lo, integer=True), number(hi_key, hi, integer=True)
    if lo > hi:
        bad(lo_key, lo, f"is above {hi_key} {hi}", "make the smallest size at most the largest")
    sample = flag("do_sample_frames", defaults.fps is not None)
    if sample and has("num_frames"):
        bad("num_frames", data["num_frames"], "is set", "sftpack samples by fps: remove num_frames and set fps")
    min_frames, max_frames = get("min_frames", defaults.min_frames), get("max_frames", defaults.max_frames)
    if min_frames > max_frames:
        bad("min_frames", min_frames, f"is above max_frames {max_frames}", "make min_frames at most max_frames")
    resample = data.get("resample", defaults.resample)
    if resample is not None and (isinstance(resample, bool) or not isinstance(resample, int) or not 0 <= resample <= 5):
        bad("resample", resample, "is not a PIL resampling filter (0-5)")
    return VideoSampling(
        fps=get("fps", defaults.fps, integer=False) if sample else None,
        min_frames=min_frames,
        max_frames=max_frames,
        rule=defaults.rule,
        min_pixels=lo,
        max_pixels=hi,
        patch_size=get("patch_size", defaults.patch_size),
        temporal_patch_size=get("temporal_patch_size", defaults.temporal_patch_size),
        merge_size=get("merge_size", defaults.merge_size),
        image_mean=triple("image_mean", defaults.image_mean),
        image_std=triple("image_std", defaults.image_std),
        rescale_factor=get("rescale_factor", defaults.rescale_factor, integer=False),
        resample=resample,
        cap_pixels_per_frame=flag("cap_pixels_per_frame", defaults.cap_pixels_per_frame),
        max_video_tokens=get("max_video_tokens", defaults.max_video_tokens),
        source=source,
    )
