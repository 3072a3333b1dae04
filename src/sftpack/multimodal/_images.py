"""Images of a multimodal conversation: read one content part, turn it into Qwen2-VL patches.

A content part names its image in one of the Hugging Face chat format's ways:
``{"type": "image", "path": FILE}``, ``{"type": "image", "bytes": b"..."}`` or
``{"type": "image", "image": FILE_OR_PIL_IMAGE}``. URLs are refused (nothing is
ever downloaded). One sftpack extension: ``"resize": [width, height]`` resizes the
decoded image (bicubic, deterministic) before the processor sees it; the easy-vqa
corpus uses it to give its 64x64 images varied resolutions.

Patches come from transformers' PIL/numpy ``Qwen2VLImageProcessorPil`` (no
torchvision): ``smart_resize`` to multiples of ``patch_size * merge_size``, rescale,
CLIP normalisation, then ``[grid_t * grid_h * grid_w, C * temporal_patch * patch * patch]``
float32 patches in the merge-window order the vision tower expects.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .. import _optional
from .._base import StrEnum

__all__ = ["BadImageError", "BadImageReason", "ImagePatches", "image_processor", "load_image", "process_images"]


class BadImageReason(StrEnum):
    """Why an image part cannot be used (the key of the skip counts)."""

    MISSING_FILE = "image_missing_file"
    UNDECODABLE = "image_undecodable"
    ZERO_SIZE = "image_zero_size"
    NO_SOURCE = "image_no_source"
    URL = "image_url"


class BadImageError(ValueError):
    """An image part that cannot be read; names the record, the field and the fix."""

    def __init__(self, record: Any, field: str, reason: BadImageReason, detail: str):
        fixes = {
            BadImageReason.MISSING_FILE: "fix the path (relative paths are read from the working directory) or drop the part",
            BadImageReason.UNDECODABLE: "re-encode the image (PNG/JPEG) or drop the part",
            BadImageReason.ZERO_SIZE: "the image has no pixels: drop the part",
            BadImageReason.NO_SOURCE: 'give the image as "path", "bytes" or "image"',
            BadImageReason.URL: "download the image first and give its local path (sftpack never downloads)",
        }
        super().__init__(f"record {record!r}, {field}: {detail} ({reason.value}); {fixes[reason]}")
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


def load_image(part: dict, record: Any = None, field: str = "image") -> Any:
    """The RGB ``PIL.Image`` of one image content part (resized if it asks to be).

    Raises:
        BadImageError: no source, a URL, a missing file, undecodable bytes or zero size.
    """
    Image = _pil()
    src: Any
    if "bytes" in part and part["bytes"] is not None:
        src, kind = part["bytes"], "bytes"
    elif "path" in part and part["path"] is not None:
        src, kind = part["path"], "path"
    elif "image" in part and part["image"] is not None:
        src, kind = part["image"], "image"
    elif "url" in part:
        raise BadImageError(record, f"{field}.url", BadImageReason.URL, f"a URL {str(part['url'])[:80]!r}")
    else:
        raise BadImageError(record, field, BadImageReason.NO_SOURCE, f"no image in the part (keys {sorted(part)})")
    where = f"{field}.{kind}"
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise BadImageError(record, where, BadImageReason.URL, f"a URL {src[:80]!r}")
    if isinstance(src, Image.Image):
        img = src
    else:
        if isinstance(src, (str, os.PathLike)):
            if not os.path.isfile(src):
                raise BadImageError(record, where, BadImageReason.MISSING_FILE, f"no file {os.fspath(src)!r}")
            with open(src, "rb") as f:
                data = f.read()
        elif isinstance(src, (bytes, bytearray, memoryview)):
            data = bytes(src)
        else:
            raise BadImageError(record, where, BadImageReason.NO_SOURCE, f"an image given as {type(src).__name__}")
        if not data:
            raise BadImageError(record, where, BadImageReason.ZERO_SIZE, "0 bytes")
        try:
            img = Image.open(io.BytesIO(data))
            img.load()
        except Exception as e:  # PIL raises several types for damaged data
            raise BadImageError(
                record, where, BadImageReason.UNDECODABLE, f"cannot decode ({type(e).__name__})"
            ) from None
    if img.width == 0 or img.height == 0:
        raise BadImageError(record, where, BadImageReason.ZERO_SIZE, f"size {img.width}x{img.height}")
    img = img.convert("RGB")
    size = part.get("resize")
    if size is not None:
        w, h = (int(x) for x in size)
        if w < 1 or h < 1:
            raise BadImageError(record, f"{field}.resize", BadImageReason.ZERO_SIZE, f"resize to {w}x{h}")
        img = img.resize((w, h), Image.Resampling.BICUBIC)
    return img


@lru_cache(maxsize=8)
def image_processor(min_pixels: int = 56 * 56, max_pixels: int = 448 * 448) -> Any:
    """Qwen2-VL's PIL/numpy image processor (patch 14, temporal patch 2, merge 2), shared."""
    mod = _optional.transformers("models.qwen2_vl.image_processing_pil_qwen2_vl")
    return mod.Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


@dataclass(frozen=True)
class ImagePatches:
    """The processor's output for the images of one sample, in order."""

    pixel_values: np.ndarray  #: ``(P, C*T*p*p)`` float32, the images' patches concatenated
    image_grid_thw: np.ndarray  #: ``(I, 3)`` int64

    def tokens_per_image(self, merge_size: int) -> np.ndarray:
        """Placeholder tokens of each image: ``grid_t * grid_h * grid_w // merge_size**2``."""
        return self.image_grid_thw.prod(axis=1) // (merge_size * merge_size)


def process_images(images: list[Any], processor: Any) -> ImagePatches:
    """Patches and grids of ``images`` (PIL images) through ``processor``."""
    if not images:
        dim = 3 * int(processor.temporal_patch_size) * int(processor.patch_size) ** 2
        return ImagePatches(np.zeros((0, dim), np.float32), np.zeros((0, 3), np.int64))
    out = processor(images=images, return_tensors="np")
    return ImagePatches(
        np.ascontiguousarray(out["pixel_values"], dtype=np.float32),
        np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3),
    )


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
    each channel (read-only, shared). ``table[c, v]`` is the patch value of a pixel of value ``v`` in
    channel ``c``, bit for bit (the steps are elementwise)."""
    if not (getattr(processor, "do_rescale", True) and getattr(processor, "do_normalize", True)):
        raise ValueError("pixel_table needs a processor that rescales and normalises (Qwen2-VL's does)")
    return _table(_key(processor), processor)


def resize_image(image: Any, processor: Any) -> np.ndarray:
    """The processor's resize of one RGB ``PIL`` image: ``(H, W, 3)`` uint8, ``H`` and ``W``
    multiples of ``patch_size * merge_size`` (Qwen2-VL's ``smart_resize``, bicubic)."""
    chw = processor.process_image(image, do_convert_rgb=True)
    chw = processor.resize(
        chw, size=processor.size, resample=processor.resample, factor=int(processor.patch_size * processor.merge_size)
    )
    if chw.dtype != np.uint8:
        raise TypeError(f"the processor's resize gave {chw.dtype}, expected uint8 pixels")
    return np.ascontiguousarray(np.moveaxis(chw, 0, -1))


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
            import numba
        except ImportError:  # pragma: no cover - numba is a dependency of the package
            _kernel = _patchify_numpy
        else:
            _kernel = numba.njit(cache=True, nogil=True)(_patchify_loops)
    return _kernel


def pixels_from_patches(pixel_values: np.ndarray, grid_thw: Any, processor: Any) -> np.ndarray:
    """The resized ``(H, W, 3)`` uint8 image whose :func:`patchify_pixels` is ``pixel_values``
    (one image's patches, grid ``(1, h, w)``): the exact inverse.

    Raises:
        ValueError: the patches are not the processor's output for a uint8 image (a value that
            is not in :func:`pixel_table`, temporal copies that differ, a video grid).
    """
    p, t, m = int(processor.patch_size), int(processor.temporal_patch_size), int(processor.merge_size)
    gt, gh, gw = (int(x) for x in np.asarray(grid_thw).reshape(3))
    pv = np.asarray(pixel_values)
    if gt != 1 or pv.shape != (gh * gw, 3 * t * p * p) or pv.dtype != np.float32:
        raise ValueError(
            f"patches {pv.shape} {pv.dtype} for grid {(gt, gh, gw)}: need one image's ({gh * gw}, {3 * t * p * p}) "
            "float32 patches of grid (1, h, w)"
        )
    blocks = pv.reshape(gh // m, gw // m, m, m, 3, t, p, p)
    first = blocks[:, :, :, :, :, 0]
    if t > 1 and not np.array_equal(blocks, np.broadcast_to(first[:, :, :, :, :, None], blocks.shape)):
        raise ValueError("the patches' temporal copies differ: not a still image")
    chw = first.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)  # (C, bh, mh, py, bw, mw, px)
    table = pixel_table(processor)
    out = np.empty((gh * p, gw * p, 3), np.uint8)
    for c in range(3):
        idx = np.searchsorted(table[c], chw[c]).clip(0, 255)
        if not np.array_equal(table[c][idx].view(np.uint32), chw[c].view(np.uint32)):
            raise ValueError(f"channel {c} holds values that no uint8 pixel normalises to: not the processor's patches")
        out[:, :, c] = idx
    return out
