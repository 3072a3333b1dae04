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
- an odd count (any count not a multiple of the temporal patch) is padded by repeating
  the last frame; every frame is resized to the size the first one gets (``smart_resize``
  to multiples of ``patch * merge``), rescaled and normalised, and each run of
  ``temporal_patch_size`` frames becomes one temporal slice of the grid ``(t, h, w)``;
- Qwen3-VL samples a file by ``Qwen3VLVideoProcessor``'s rule instead (``VideoSampling.rule``,
  :func:`linspace_indices`) and writes each temporal slice after its time
  (:func:`frame_timestamps`; see :mod:`sftpack.multimodal.families.qwen3_vl`);
- ``second_per_grid_ts`` (what Qwen2.5-VL's MRoPE spaces the temporal axis by) is
  ``temporal_patch_size / sampled_fps``, with ``sampled_fps = kept / frames * file_fps``
  for a file and the part's ``fps`` (24 when not given, the processor's fallback) for frames.

The per-frame pixels are the image processor's (``Qwen2VLImageProcessorPil``: PIL bicubic
resize, then its rescale and normalisation): a video of identical frames is patch for patch
the still image. transformers' torchvision video processor resizes with torchvision instead,
which differs by 1-2 levels of 255 on some pixels (the same difference as its torchvision
image processor's).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from .. import _optional
from ._family import EncodedImages
from ._images import BadImageError, BadImageReason, is_url, load_image, pixel_table, resize_image

__all__ = [
    "EncodedVideos",
    "VideoSampling",
    "decode_video",
    "encode_videos",
    "frame_timestamps",
    "linspace_indices",
    "patchify_frames",
    "sample_indices",
    "video_header",
]

#: The frame rate HF's ``VideoMetadata.sampled_fps`` falls back to for frames without one.
DEFAULT_FPS = 24.0


@dataclass(frozen=True)
class VideoSampling:
    """How frames are taken from a video file (``Qwen2VLVideoProcessor``'s settings and defaults):
    ``fps`` (``None``: every frame, unless the part gives one), ``min_frames``, ``max_frames``;
    ``rule``: whose index rule :func:`sample_indices` follows, ``"qwen2_vl"`` or ``"qwen3_vl"``
    (``Qwen3VLVideoProcessor.sample_frames``, :func:`linspace_indices`)."""

    fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768
    rule: str = "qwen2_vl"


@dataclass
class EncodedVideos(EncodedImages):
    """One conversation's videos, encoded (in order), as :class:`~sftpack.multimodal.EncodedImages`
    holds images: every video's patches ``pixel_values`` ``(P, D)`` float32, the placeholder
    ``tokens`` each takes (``t*h*w / merge**2``), each ``grid_thw`` ``(V, 3)``, the tower's
    ``merge_size``; and each ``second_per_grid_ts`` ``(V,)`` float32 (seconds a temporal slice
    spans) and ``frames`` ``(V,)`` (frames kept, before padding)."""

    second_per_grid_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    frames: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def sample_indices(total: int, file_fps: float, fps: float, temporal_patch: int, sampling: VideoSampling) -> np.ndarray:
    """The frames of a ``total``-frame file at ``file_fps`` kept when sampling at ``fps``
    (``Qwen2VLVideoProcessor.sample_frames``' rule, see the module text).

    Raises:
        ValueError: the clip has fewer frames than one temporal patch.
    """
    if sampling.rule == "qwen3_vl":
        return linspace_indices(total, file_fps, fps, sampling)
    import torch

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


def linspace_indices(total: int, file_fps: float, fps: float, sampling: VideoSampling) -> np.ndarray:
    """The frames of a ``total``-frame file at ``file_fps`` kept when sampling at ``fps`` by
    ``Qwen3VLVideoProcessor.sample_frames``' rule (transformers 5.24): ``n = int(total / file_fps
    * fps)`` clamped to ``[min_frames, min(max_frames, total)]`` (any count: an odd one is padded
    later), spread evenly over the whole clip, first and last frame included
    (``linspace(0, total - 1, n)`` rounded half to even)."""
    n = min(max(int(total / file_fps * fps), sampling.min_frames), sampling.max_frames, total)
    out: np.ndarray = np.linspace(0, total - 1, n).round().astype(np.int64)
    return out


def video_header(path: str) -> tuple[int, float]:
    """``(frames, fps)`` a video file's first stream states in its header (as :func:`decode_video`
    and transformers' PyAV reader read them; 0 where it states none). The file must open:
    :func:`decode_video` has read it first."""
    av = _optional._need("av", "video", "decoding a video file")
    with av.open(path) as container:
        stream = container.streams.video[0]
        return int(stream.frames or 0), float(stream.average_rate) if stream.average_rate else 0.0


def frame_timestamps(indices: list[int], fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal slice of a video whose kept frames are ``indices`` of a clip at
    ``fps`` (``Qwen3VLProcessor._calculate_timestamps``' rule): the indices padded to a multiple
    of ``temporal_patch`` by repeating the last, each slice the mean of its first and last frame's
    time (``index / fps``)."""
    idx = [int(i) for i in indices]
    idx += idx[-1:] * (-len(idx) % temporal_patch)
    sec = [i / fps for i in idx]
    return [(sec[k] + sec[k + temporal_patch - 1]) / 2 for k in range(0, len(sec), temporal_patch)]


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
    """``(N, H, W, 3)`` uint8 frames of one video part, each resized as the processor resizes the
    first (its ``smart_resize``), and the part's ``sampled_fps``."""
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
    first = resize_image(images[0], processor)
    out = np.empty((len(images), *first.shape), np.uint8)
    out[0] = first
    for i, im in enumerate(images[1:], 1):
        out[i] = resize_image(im, processor)
    return out, sampled


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
    temporal patch and merge sizes, rescale and normalisation) and ``sampling``.
    ``record`` and ``fields`` (each part's, e.g. ``messages[0].content[1]``) are named in errors.

    Raises:
        BadImageError: a part without a source, a URL, a missing or undecodable file, frames of
            several sizes, a bad ``fps``, a clip shorter than one temporal patch once sampled.
    """
    sampling = sampling or VideoSampling()
    p, t, m = int(processor.patch_size), int(processor.temporal_patch_size), int(processor.merge_size)
    pixels, grids, seconds, kept = [], [], [], []
    for i, part in enumerate(parts):
        field = fields[i] if fields is not None else f"videos[{i}]"
        frames, sampled = load_frames(part, processor, sampling, record, field)
        pv, grid = patchify_frames(frames, processor)
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
