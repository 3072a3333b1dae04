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
