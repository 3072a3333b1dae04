"""Images of a multimodal conversation: read one content part, turn it into Qwen2-VL patches.

A content part names its image in one of the Hugging Face chat format's ways:
``{"type": "image", "path": FILE}``, ``{"type": "image", "bytes": b"..."}`` or
``{"type": "image", "image": FILE_OR_PIL_IMAGE}``. URLs (any ``scheme://``, ``file://``
included) are refused: nothing is ever downloaded. One sftpack extension:
``"resize": [width, height]`` resizes the decoded image (bicubic, deterministic) before
the processor sees it; the easy-vqa corpus uses it to give its 64x64 images varied
resolutions.

:func:`load_image` reads as ``transformers.image_utils.load_image`` does (PIL, the EXIF
orientation applied, RGB), with stated limits: a file over :data:`MAX_IMAGE_BYTES` is
refused before it is read, a file is decoded from disk only once PIL knows its format from
its first bytes (a non-image file is refused by its header, never read whole), and an image
whose sides differ by more than :data:`MAX_ASPECT_RATIO` times is refused. Each refusal is a
:class:`BadImageError` naming the record, the field, the :class:`BadImageReason` and the fix.

Patches: :func:`process_images` runs the processor it is given. For transformers' PIL/numpy
``Qwen2VLImageProcessorPil`` itself (a Qwen family's, e.g. :func:`~sftpack.multimodal.families.qwen2_vl.qwen2vl_image_processor`; any sizes, patch sizes, mean,
std, resample) it takes a faster road to the same bytes (:func:`reproduces`): the
processor's own ``smart_resize`` to multiples of ``patch_size * merge_size``, then its
rescale and CLIP normalisation as a table and the patch layout as one compiled pass, giving
``[grid_t * grid_h * grid_w, C * temporal_patch * patch * patch]`` float32 patches in the
merge-window order the vision tower expects, bit for bit the processor's own (tested). Any
other processor (a subclass, one that skips a step, the torchvision ``Qwen2VLImageProcessor``
that ``AutoProcessor`` picks where torchvision is installed) is run itself.
"""

from __future__ import annotations

import io
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import IO, Any, NoReturn

import numpy as np

from .. import _optional
from .._base import StrEnum
from ..chat import is_url  # its home is the reader's row checks; public here too

__all__ = [
    "MAX_ASPECT_RATIO",
    "MAX_IMAGE_BYTES",
    "BadImageError",
    "BadImageReason",
    "ImagePatches",
    "is_url",
    "load_image",
    "process_images",
    "reproduces",
]

#: The largest image file (or ``bytes``) read, 256 MiB: what an uncompressed 8-bit RGB image
#: at PIL's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, 89.5 million pixels) takes.
#: A larger file is no image a vision model should see, and reading it would cost as much
#: memory in every tokenizer worker; it is refused from its size, before it is opened.
MAX_IMAGE_BYTES = 256 << 20

#: The longest side of an image (after its ``"resize"``) may be at most this many times its
#: shortest: Qwen2-VL's ``smart_resize`` refuses more (a bare ``ValueError`` deep in the
#: processor), and such a strip is under one patch across for any vision tower. Applied to
#: every image, so a record is refused the same way whatever the model.
MAX_ASPECT_RATIO = 200

_Bad = Callable[..., NoReturn]  # raises the BadImageError of a reason and a detail (and a field)


class BadImageReason(StrEnum):
    """Why an image (or video, :mod:`~sftpack.multimodal._video`) part cannot be used (the key of the skip counts)."""

    MISSING_FILE = "image_missing_file"  #: no such file (or it cannot be opened)
    UNDECODABLE = "image_undecodable"  #: not an image format PIL reads, or damaged
    ZERO_SIZE = "image_zero_size"  #: 0 bytes, or no pixels
    NO_SOURCE = "image_no_source"  #: no ``path`` / ``bytes`` / ``image``, or one of the wrong type
    URL = "image_url"  #: a URL (nothing is downloaded)
    TOO_LARGE = "image_too_large"  #: over :data:`MAX_IMAGE_BYTES`
    ASPECT_RATIO = "image_aspect_ratio"  #: sides differ by more than :data:`MAX_ASPECT_RATIO` times
    BAD_RESIZE = "image_bad_resize"  #: ``"resize"`` is not two positive sizes within PIL's pixel limit
    VIDEO_NO_SOURCE = "video_no_source"  #: a video part without ``frames`` or ``path``, or one of the wrong type
    VIDEO_URL = "video_url"  #: a video given as a URL (nothing is downloaded)
    VIDEO_MISSING_FILE = "video_missing_file"  #: no such video file
    VIDEO_UNDECODABLE = "video_undecodable"  #: not a video PyAV decodes, no frames, or no frame rate to sample by
    VIDEO_FRAME_SIZES = "video_frame_sizes"  #: a video's frames of several sizes
    VIDEO_BAD_FPS = "video_bad_fps"  #: ``"fps"`` is not a positive number
    VIDEO_TOO_SHORT = "video_too_short"  #: fewer frames than one temporal patch once sampled


_FIXES = {
    BadImageReason.MISSING_FILE: "fix the path or drop the part",
    BadImageReason.UNDECODABLE: "re-encode the image (PNG/JPEG) or drop the part",
    BadImageReason.ZERO_SIZE: "the image has no pixels: drop the part",
    BadImageReason.NO_SOURCE: 'give the image as "path", "bytes" or "image"',
    BadImageReason.URL: "download the image first and give its local path (sftpack never downloads)",
    BadImageReason.TOO_LARGE: f"downscale or re-encode the image below {MAX_IMAGE_BYTES >> 20} MiB, or drop the part",
    BadImageReason.ASPECT_RATIO: f"crop or pad the image to at most {MAX_ASPECT_RATIO}:1, or drop the part",
    BadImageReason.BAD_RESIZE: 'give "resize" as [width, height], two positive integers (at most '
    "PIL.Image.MAX_IMAGE_PIXELS pixels in all), or leave it out",
    BadImageReason.VIDEO_NO_SOURCE: 'give the video as "frames" (a list of image files) or "path" (a video file)',
    BadImageReason.VIDEO_URL: "download the video first and give its local path (sftpack never downloads)",
    BadImageReason.VIDEO_MISSING_FILE: "fix the path or drop the part",
    BadImageReason.VIDEO_UNDECODABLE: "re-encode the video (e.g. ffmpeg -i IN -c:v libx264 OUT.mp4) or drop the part",
    BadImageReason.VIDEO_FRAME_SIZES: "resize the frames to one size or drop the part",
    BadImageReason.VIDEO_BAD_FPS: 'give "fps" as a positive number, or leave it out',
    BadImageReason.VIDEO_TOO_SHORT: 'lower "fps" or give more frames, or drop the part',
}


class BadImageError(ValueError):
    """An image part that cannot be read; names the record, the field, the reason and the fix."""

    def __init__(self, record: Any, field: str, reason: BadImageReason, detail: str):
        super().__init__(f"record {record!r}, {field}: {detail} ({reason.value}); {_FIXES[reason]}")
        self.record, self.field, self.reason = record, field, reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (str(self), self.record, self.field, self.reason))


def _rebuild(message: str, record: Any, field: str, reason: BadImageReason) -> BadImageError:
    err = BadImageError.__new__(BadImageError)
    ValueError.__init__(err, message)
    err.record, err.field, err.reason = record, field, reason
    return err


def _pil() -> Any:
    return _optional._need("PIL.Image", "multimodal", "reading images")


def load_image(part: dict, record: Any = None, field: str = "image", *, name: str | None = None) -> Any:
    """The RGB ``PIL.Image`` of one image content part, upright (its EXIF orientation applied,
    as ``transformers.image_utils.load_image`` does) and resized if it asks to be.

    A relative ``path`` is read from the working directory (the readers make a data file's
    relative paths absolute, from the file's folder). A ``PIL`` image given is not changed.

    Args:
        part: the content part (``path``, ``bytes`` or ``image``; optional ``resize``).
        record, field: named in errors (``field`` is the part's, e.g. ``messages[0].content[1]``).
        name: the file the part's bytes were read from, named in errors ("the file NAME");
            by default they are "the image". Bytes are decoded under any key, so a caller that
            looked up a part's file itself (an Energon sample's member) passes
            ``{"path": data, "resize": ...}`` with ``name`` and the error names ``FIELD.path``.

    Raises:
        BadImageError: no source, a URL, a missing, empty, over-large or undecodable file, no
            pixels, an aspect ratio over :data:`MAX_ASPECT_RATIO` or a bad ``resize``.
    """
    Image = _pil()
    src, kind = _source(part, record, field)
    where = f"{field}.{kind}"

    def bad(reason: BadImageReason, detail: str, at: str = where) -> NoReturn:
        raise BadImageError(record, at, reason, detail)

    resize = _resize_to(part.get("resize"), bad, f"{field}.resize", Image.MAX_IMAGE_PIXELS)
    if isinstance(src, str) and is_url(src):
        bad(BadImageReason.URL, f"a URL {src[:80]!r}")
    if isinstance(src, Image.Image):
        subject = "the image"
        img = _upright(lambda: src, False, subject, bad)  # a copy: the caller's image stays as it is
    elif isinstance(src, (bytes, bytearray, memoryview)):
        subject = f"the file {name!r}" if name is not None else "the image"
        with memoryview(src) as view:
            n = view.nbytes
        _check_size(n, subject, bad)  # before any copy
        data = src if isinstance(src, bytes) else bytes(src)
        img = _upright(lambda: Image.open(io.BytesIO(data)), True, subject, bad, data[:16], len(data))
    elif kind != "bytes" and isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        subject = f"the file {path!r}"
        img = _read_file(path, subject, bad)
    elif kind == "bytes" and isinstance(src, str):
        bad(BadImageReason.NO_SOURCE, f'"bytes" holds a str, not bytes (a file name? give it as "path"): {src[:80]!r}')
    else:
        bad(BadImageReason.NO_SOURCE, f"an image given as {type(src).__name__}")
    if img.width == 0 or img.height == 0:
        bad(BadImageReason.ZERO_SIZE, f"{subject} has no pixels (size {img.width}x{img.height})")
    if img.mode != "RGB":
        img = img.convert("RGB")
    if resize is not None:
        img = img.resize(resize, Image.Resampling.BICUBIC)
    w, h = img.size
    if max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        after = " after the resize" if resize is not None else ""
        bad(
            BadImageReason.ASPECT_RATIO,
            f"{subject} is {w}x{h} pixels{after}: aspect ratio {max(w, h) / min(w, h):.4g}:1, "
            f"over MAX_ASPECT_RATIO ({MAX_ASPECT_RATIO}:1)",
            f"{field}.resize" if resize is not None else where,
        )
    return img


def _source(part: dict, record: Any, field: str) -> tuple[Any, str]:
    """The part's image and the key holding it (``bytes``, then ``path``, then ``image``)."""
    for kind in ("bytes", "path", "image"):
        if part.get(kind) is not None:
            return part[kind], kind
    if "url" in part:
        raise BadImageError(record, f"{field}.url", BadImageReason.URL, f"a URL {str(part['url'])[:80]!r}")
    raise BadImageError(record, field, BadImageReason.NO_SOURCE, f"no image in the part (keys {sorted(part)})")


def _resize_to(size: Any, bad: _Bad, at: str, max_pixels: int | None) -> tuple[int, int] | None:
    """``(width, height)`` of a part's ``"resize"``, checked; None without one."""
    if size is None:
        return None

    def whole(x: Any) -> bool:
        if isinstance(x, bool):
            return False
        return isinstance(x, numbers.Integral) or (isinstance(x, float) and x.is_integer())

    if isinstance(size, (str, bytes)) or not hasattr(size, "__len__") or len(size) != 2 or not all(map(whole, size)):
        bad(BadImageReason.BAD_RESIZE, f"resize {size!r}: not [width, height]", at)
    w, h = int(size[0]), int(size[1])
    if w < 1 or h < 1:
        bad(BadImageReason.BAD_RESIZE, f"resize {size!r}: to {w}x{h} pixels", at)
    if max_pixels is not None and w * h > max_pixels:
        bad(BadImageReason.BAD_RESIZE, f"resize {size!r}: {w * h:,} pixels, over PIL's limit of {max_pixels:,}", at)
    return w, h


def _check_size(n: int, subject: str, bad: _Bad) -> None:
    if n == 0:
        bad(BadImageReason.ZERO_SIZE, f"{subject} is empty (0 bytes)")
    if n > MAX_IMAGE_BYTES:
        bad(
            BadImageReason.TOO_LARGE,
            f"{subject} is {n:,} bytes, over MAX_IMAGE_BYTES ({MAX_IMAGE_BYTES:,} bytes, {MAX_IMAGE_BYTES >> 20} MiB)",
        )


def _read_file(path: str, subject: str, bad: _Bad) -> Any:
    """Decoded from disk, never read whole first: the size is checked, then PIL reads the header."""
    if not os.path.isfile(path):
        here = "" if os.path.isabs(path) else f" in the working directory {os.getcwd()!r}"
        bad(BadImageReason.MISSING_FILE, f"no file {path!r}{here}")
    try:
        f: IO[bytes] = open(path, "rb")  # noqa: SIM115 - closed below, after decoding
    except OSError as e:
        bad(BadImageReason.MISSING_FILE, f"cannot open {path!r} ({type(e).__name__}: {e.strerror})")
    with f:
        n = os.fstat(f.fileno()).st_size
        _check_size(n, subject, bad)
        head = f.read(16)
        f.seek(0)
        return _upright(lambda: _pil().open(f), True, subject, bad, head, n)


def _upright(open_: Callable[[], Any], own: bool, subject: str, bad: _Bad, head: bytes = b"", n: int = 0) -> Any:
    """``open_()``'s image decoded with its EXIF orientation applied (in place if ``own``, else on a
    copy). ``Image.open`` reads only the header: PIL knows the format by its first bytes, and
    nothing more is read unless it does."""
    Image, ImageOps = _pil(), _optional._need("PIL.ImageOps", "multimodal", "reading images")
    try:
        img = open_()
    except Image.UnidentifiedImageError:
        bad(
            BadImageReason.UNDECODABLE,
            f"{subject} ({n:,} bytes) cannot be decoded: not an image (no format PIL reads starts {head!r})",
        )
    except Exception as e:  # PIL raises several types for damaged data (and DecompressionBombError)
        bad(BadImageReason.UNDECODABLE, f"{subject} ({n:,} bytes) cannot be decoded ({type(e).__name__}: {e})"[:300])
    try:
        img.load()
        if own:
            ImageOps.exif_transpose(img, in_place=True)
            return img
        return ImageOps.exif_transpose(img)
    except Exception as e:  # a damaged body, found while decoding
        what = f"{subject} ({n:,} bytes)" if n else subject
        bad(BadImageReason.UNDECODABLE, f"{what} cannot be decoded ({type(e).__name__}: {e})"[:300])


def _pil_processor_class() -> Any:
    return _optional.transformers("models.qwen2_vl.image_processing_pil_qwen2_vl").Qwen2VLImageProcessorPil


def processor_from_settings(settings: dict[str, Any]) -> Any:
    """The ``Qwen2VLImageProcessorPil`` of :func:`processor_settings`' ``settings`` (a prepack's
    manifest keeps them): the processor whose patches the stored pixels re-make, whatever the
    family (Qwen2-VL's patch 14, Qwen3-VL's 16 with mean and std 0.5)."""
    return _pil_processor_class()(
        patch_size=int(settings["patch_size"]),
        temporal_patch_size=int(settings["temporal_patch_size"]),
        merge_size=int(settings["merge_size"]),
        rescale_factor=float(settings["rescale_factor"]),
        image_mean=[float(x) for x in settings["image_mean"]],
        image_std=[float(x) for x in settings["image_std"]],
        min_pixels=int(settings["min_pixels"]),
        max_pixels=int(settings["max_pixels"]),
        resample=int(settings["resample"]),
    )


def reproduces(processor: Any) -> bool:
    """Whether :func:`process_images`' fast road gives exactly ``processor``'s own output: the
    processor is transformers' ``Qwen2VLImageProcessorPil`` itself (not a subclass, whose
    methods may differ) and resizes, rescales, normalises and converts to RGB. Its settings
    (sizes, patch sizes, rescale factor, mean, std, resample) are its own business: the fast
    road calls its resize and tabulates its rescale and normalisation."""
    if type(processor).__name__ != "Qwen2VLImageProcessorPil" or type(processor) is not _pil_processor_class():
        return False
    return all(
        getattr(processor, k, None) is True for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
    )


@dataclass(frozen=True)
class ImagePatches:
    """The processor's output for the images of one sample, in order."""

    pixel_values: np.ndarray  #: ``(P, C*T*p*p)`` float32, the images' patches concatenated
    image_grid_thw: np.ndarray  #: ``(I, 3)`` int64

    def tokens_per_image(self, merge_size: int) -> np.ndarray:
        """Placeholder tokens of each image: ``grid_t * grid_h * grid_w // merge_size**2``."""
        return self.image_grid_thw.prod(axis=1) // (merge_size * merge_size)


def process_images(images: list[Any], processor: Any) -> ImagePatches:
    """Patches and grids of ``images`` (PIL images): ``processor(images=images)``'s output, bit for bit.

    Exactly the processor given is used: for transformers' ``Qwen2VLImageProcessorPil``
    (:func:`reproduces`) through :func:`resize_image` and :func:`patchify_pixels`, the same bytes
    at about twice the speed; any other processor (a subclass, the torchvision one) is called."""
    if not images:
        dim = 3 * int(processor.temporal_patch_size) * int(processor.patch_size) ** 2
        return ImagePatches(np.zeros((0, dim), np.float32), np.zeros((0, 3), np.int64))
    Image = _pil()
    if reproduces(processor) and all(isinstance(im, Image.Image) for im in images):
        return _fast(images, processor)
    out = processor(images=images, return_tensors="np")
    return ImagePatches(
        np.ascontiguousarray(out["pixel_values"], dtype=np.float32),
        np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3),
    )


def _fast(images: list[Any], processor: Any) -> ImagePatches:
    """The processor's output for still images: grid ``(1, H / p, W / p)`` of each resized image,
    its patches written straight into the batch's ``pixel_values``."""
    p, t = int(processor.patch_size), int(processor.temporal_patch_size)
    pixels = [resize_image(im, processor) for im in images]
    grids = np.array([(1, px.shape[0] // p, px.shape[1] // p) for px in pixels], dtype=np.int64)
    counts = grids.prod(axis=1)
    out = np.empty((int(counts.sum()), 3 * t * p * p), np.float32)
    start = 0
    for px, n in zip(pixels, counts.tolist()):
        patchify_pixels(px, processor, out=out[start : start + n])
        start += n
    return ImagePatches(out, grids)


# ------------------------------------------------------------------ resize apart from patchify
#
# The processor's pipeline per image is: to RGB, smart_resize (bicubic, PIL, uint8 in and
# out), rescale (uint8 -> float64 * 1/255 -> float32), normalise ((x - mean) / std in
# float32, per channel), patchify (a fixed permutation, each patch repeated over the
# temporal patch). Everything after the resize is elementwise on one uint8 value of one
# channel, then a permutation: so the resized uint8 image and its grid determine the
# patches, and a (3, 256) table of the processor's own rescale+normalise outputs
# reproduces them bit for bit (:func:`pixel_table`). That is what lets a prepack store
# the resized pixels (3 bytes a pixel) instead of float32 patches (24 bytes a pixel:
# 4-byte floats, each pixel twice for the temporal patch) and patchify on read.


def _key(processor: Any) -> tuple:
    return (
        int(processor.patch_size),
        int(processor.temporal_patch_size),
        int(processor.merge_size),
        float(processor.rescale_factor),
        tuple(float(x) for x in processor.image_mean),
        tuple(float(x) for x in processor.image_std),
    )


def processor_settings(processor: Any) -> dict[str, Any]:
    """What the processor's output depends on, as plain JSON values (a prepack's manifest keeps them)."""
    size = processor.size
    p, t, m, scale, mean, std = _key(processor)
    return {
        "patch_size": p,
        "temporal_patch_size": t,
        "merge_size": m,
        "rescale_factor": scale,
        "image_mean": list(mean),
        "image_std": list(std),
        "min_pixels": int(size.shortest_edge if hasattr(size, "shortest_edge") else size["shortest_edge"]),
        "max_pixels": int(size.longest_edge if hasattr(size, "longest_edge") else size["longest_edge"]),
        "resample": int(processor.resample),
        "class": type(processor).__name__,
    }


def _table_key(processor: Any) -> tuple:
    """What the table depends on: the processor's class, rescale factor, mean and std."""
    return (
        type(processor).__qualname__,
        float(processor.rescale_factor),
        tuple(float(x) for x in processor.image_mean),
        tuple(float(x) for x in processor.image_std),
    )


@lru_cache(maxsize=8)
def _table(key: tuple, processor: Any) -> np.ndarray:
    ramp = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()  # a (C, H, W) image of every value
    x = processor.rescale(ramp, processor.rescale_factor)
    x = processor.normalize(x, processor.image_mean, processor.image_std)
    out = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(3, 256))
    out.setflags(write=False)
    return out


def pixel_table(processor: Any) -> np.ndarray:
    """``(3, 256)`` float32: the processor's own rescale and normalisation of every uint8 value of
    each channel (read-only, shared). ``table[c, v]`` is the pixel value the processor gives a uint8
    value ``v`` of channel ``c``, bit for bit (the steps are elementwise): a Qwen-VL patch value, or
    a LLaVA / Gemma 3 ``pixel_values`` entry (any transformers PIL/numpy image processor that
    rescales and normalises)."""
    if not (getattr(processor, "do_rescale", True) and getattr(processor, "do_normalize", True)):
        raise ValueError(
            f"{type(processor).__name__} does not rescale and normalise: a prepack stores uint8 pixels and "
            "remakes the processor's values from them, which needs both steps"
        )
    return _table(_table_key(processor), processor)


def resize_image(image: Any, processor: Any) -> np.ndarray:
    """The processor's resize of one RGB ``PIL`` image: ``(H, W, 3)`` uint8, ``H`` and ``W``
    multiples of ``patch_size * merge_size`` (Qwen2-VL's ``smart_resize``, bicubic).

    For transformers' ``Qwen2VLImageProcessorPil`` itself and an RGB image, the image is resized
    by PIL straight to the size the processor's own ``smart_resize`` gives: what its resize does
    after turning the image into an array and back (the same PIL call on the same pixels; a
    quarter faster). Any other processor or image mode goes through the processor's own steps."""
    if type(processor) is _pil_processor_class() and getattr(image, "mode", None) == "RGB":
        return _pil_resized(image, processor)
    chw = processor.process_image(image, do_convert_rgb=True)
    chw = processor.resize(
        chw, size=processor.size, resample=processor.resample, factor=int(processor.patch_size * processor.merge_size)
    )
    if chw.dtype != np.uint8:
        raise TypeError(f"the processor's resize gave {chw.dtype}, expected uint8 pixels")
    return np.ascontiguousarray(np.moveaxis(chw, 0, -1))


def _pil_resized(image: Any, processor: Any) -> np.ndarray:
    smart_resize = _optional.transformers("models.qwen2_vl.image_processing_pil_qwen2_vl").smart_resize
    size = processor.size
    lo = size.shortest_edge if hasattr(size, "shortest_edge") else size["shortest_edge"]
    hi = size.longest_edge if hasattr(size, "longest_edge") else size["longest_edge"]
    factor = int(processor.patch_size * processor.merge_size)
    h, w = smart_resize(image.height, image.width, factor=factor, min_pixels=lo, max_pixels=hi)
    return np.asarray(image.resize((w, h), resample=processor.resample))


def patchify_pixels(pixels: np.ndarray, processor: Any, out: np.ndarray | None = None) -> np.ndarray:
    """``(grid_h * grid_w, 3 * T * p * p)`` float32 patches of a resized ``(H, W, 3)`` uint8 image:
    byte for byte what the processor gives for the image it was resized from.

    ``out``: an array of that shape to write into (a slice of a batch's ``pixel_values``)."""
    p, t, m = int(processor.patch_size), int(processor.temporal_patch_size), int(processor.merge_size)
    h, w, c = pixels.shape
    gh, gw = h // p, w // p
    if c != 3 or gh * p != h or gw * p != w or gh % m or gw % m:
        raise ValueError(f"pixels of shape {pixels.shape}: need (H, W, 3) with H and W multiples of {p * m}")
    shape = (gh * gw, 3 * t * p * p)
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out has shape {out.shape} {out.dtype}, the patches need {shape} float32, contiguous")
    src = np.ascontiguousarray(pixels, dtype=np.uint8)
    _patchify_kernel()(src, pixel_table(processor), p, m, t, out)
    return out


def _patchify_numpy(pixels: np.ndarray, table: np.ndarray, p: int, m: int, t: int, out: np.ndarray) -> None:
    """The patch layout as numpy reshapes (the reference of the compiled kernel, and its stand-in)."""
    h, w, _ = pixels.shape
    gh, gw = h // p, w // p
    values = table[np.arange(3), pixels]  # (H, W, 3) float32
    # (bh, mh, py, bw, mw, px, C) -> (bh, bw, mh, mw, C, py, px)
    blocks = values.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    out.reshape(gh // m, gw // m, m, m, 3, t, p, p)[...] = blocks[:, :, :, :, :, None, :, :]


def _patchify_loops(pixels: Any, table: Any, p: int, m: int, t: int, out: Any) -> None:
    """One pass over the output in order: patch (bh, bw, mh, mw), then channel, temporal copy, row, column
    (each temporal copy after the first copies the first)."""
    h, w = pixels.shape[0], pixels.shape[1]
    gh, gw = h // p, w // p
    k = 0
    for bh in range(gh // m):
        for bw in range(gw // m):
            for mh in range(m):
                for mw in range(m):
                    y0 = (bh * m + mh) * p
                    x0 = (bw * m + mw) * p
                    row = out[k]
                    for c in range(3):
                        base = c * t * p * p
                        j = base
                        tc = table[c]
                        for py in range(p):
                            line = pixels[y0 + py]
                            for px in range(p):
                                row[j] = tc[line[x0 + px, c]]
                                j += 1
                        for ti in range(1, t):  # the temporal copies repeat the first
                            o = base + ti * p * p
                            for q in range(p * p):
                                row[o + q] = row[base + q]
                    k += 1


_kernel: Any = None


def _patchify_kernel() -> Any:
    """:func:`_patchify_loops` compiled by numba (cached on disk), or the numpy reshapes without numba."""
    global _kernel
    if _kernel is None:
        try:
            import numba  # start-up: numba (~1 s) only for the compiled resize
        except ImportError:  # pragma: no cover - numba is a dependency of the package
            _kernel = _patchify_numpy
        else:
            _kernel = numba.njit(cache=True, nogil=True)(_patchify_loops)
    return _kernel


def pixels_from_patches(pixel_values: np.ndarray, grid_thw: Any, processor: Any) -> np.ndarray:
    """The resized ``(H, W, 3)`` uint8 image whose :func:`patchify_pixels` is ``pixel_values``
    (one image's patches, grid ``(1, h, w)``): the exact inverse (:func:`frames_from_patches`,
    its temporal copies checked to be one frame).

    Raises:
        ValueError: the patches are not the processor's output for a uint8 image (a value that
            is not in :func:`pixel_table`, temporal copies that differ, a video grid).
    """
    p, t = int(processor.patch_size), int(processor.temporal_patch_size)
    gt, gh, gw = (int(x) for x in np.asarray(grid_thw).reshape(3))
    pv = np.asarray(pixel_values)
    if gt != 1 or pv.shape != (gh * gw, 3 * t * p * p) or pv.dtype != np.float32:
        raise ValueError(
            f"patches {pv.shape} {pv.dtype} for grid {(gt, gh, gw)}: need one image's ({gh * gw}, {3 * t * p * p}) "
            "float32 patches of grid (1, h, w)"
        )
    copies = pv.reshape(gh * gw, 3, t, p * p).view(np.uint32)
    if not bool((copies == copies[:, :, :1]).all()):
        raise ValueError("the patches' temporal copies differ: not a still image")
    return frames_from_patches(pv, (1, gh, gw), processor)[0]


def frames_from_patches(pixel_values: np.ndarray, grid_thw: Any, processor: Any) -> np.ndarray:
    """The ``(t * T, H, W, 3)`` uint8 frames whose patches are ``pixel_values`` (one item's, grid
    ``(t, h, w)``, ``T`` the temporal patch; a still image's ``T`` frames are its copies): the
    inverse of the patch layout and of :func:`pixel_table`, bit for bit.

    Raises:
        ValueError: a value that is no table entry (:func:`table_pixels`), or another shape.
    """
    p, t, m = int(processor.patch_size), int(processor.temporal_patch_size), int(processor.merge_size)
    gt, gh, gw = (int(x) for x in np.asarray(grid_thw).reshape(3))
    pv = np.asarray(pixel_values)
    if pv.shape != (gt * gh * gw, 3 * t * p * p):
        raise ValueError(f"patches {pv.shape} for grid {(gt, gh, gw)}: need ({gt * gh * gw}, {3 * t * p * p})")
    # (gt, bh, bw, mh, mw, C, T, py, px) -> (gt, T, bh, mh, py, bw, mw, px, C)
    blocks = pv.reshape(gt, gh // m, gw // m, m, m, 3, t, p, p).transpose(0, 6, 1, 3, 7, 2, 4, 8, 5)
    return table_pixels(blocks.reshape(gt * t, gh * p, gw * p, 3), pixel_table(processor))


def table_pixels(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The uint8 pixels whose table entries are ``values`` (``(..., 3)``, channel last), bit for bit.

    Raises:
        ValueError: a value that is no entry of its channel's row of ``table``.
    """
    out = np.empty(values.shape, np.uint8)
    for c in range(3):
        row = table[c]
        if not bool(np.all(np.diff(row) > 0)):
            raise ValueError(f"the processor's values of channel {c} do not rise with the pixel value")
        v = values[..., c]
        idx = np.minimum(np.searchsorted(row, v), 255)
        if not np.array_equal(row[idx].view(np.uint32), np.ascontiguousarray(v, np.float32).view(np.uint32)):
            raise ValueError(f"channel {c} holds values that no uint8 pixel normalises to: not the processor's output")
        out[..., c] = idx
    return out
