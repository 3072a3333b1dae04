"""What a prepack stores of a sample's media, and the pixel values remade from it, for every family.

A processor's pixel values are an elementwise function of its resized uint8 pixels (rescale,
then normalise, per channel: :func:`~sftpack.multimodal._images.pixel_table`) laid out in the
tower's order. So each media item is stored as those uint8 pixels (3 bytes a pixel, against 4
bytes a value, or 8 for a still image's two temporal copies) and its values are remade on read,
bit for bit:

- a patch family's image (Qwen-VL, :class:`~sftpack.handoff.payload.PatchMedia`): one frame
  ``(1, H, W, 3)``, remade by :func:`~sftpack.multimodal._images.patchify_pixels`;
- a patch family's video item (a whole video, or one temporal slice of Qwen3-VL's): its frames
  ``(t * T, H, W, 3)`` (padded to whole temporal slices as the processor pads them), remade by
  :func:`~sftpack.multimodal._video.patchify_frames`; its ``seconds`` per slice kept beside it;
- a fixed-size image (LLaVA, Gemma 3, :class:`~sftpack.handoff.payload.ImageMedia`): one frame
  ``(1, H, W, 3)`` of the ``(3, H, W)`` values, remade through the table, which the prepack's
  manifest keeps (the reader needs no processor); its grid is written ``(1, 1, n)``, ``n`` its
  placeholders (what its run and the patch budget count).

:func:`stored_items` turns a sample's values back into pixels and refuses values no uint8 pixel
gives (a processor that is not elementwise, or values edited after it): what is stored is then
exactly what the in-memory sample carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..handoff.payload import ImageMedia, Media, PatchMedia
from ._images import frames_from_patches, pixel_table, pixels_from_patches, resize_image, table_pixels

__all__ = ["PixelRecorder", "StoredItems", "image_values", "stored_items", "table_pixels"]


class PixelRecorder:
    """A patch family's image processor (transformers' ``Qwen2VLImageProcessorPil``) that only
    resizes: called on images it resizes each exactly as ``processor`` does (its own resize,
    :func:`~sftpack.multimodal._images.resize_image`), keeps the resized uint8 pixels (in call
    order, :attr:`pixels`) and gives their grids with zero-width ``(P, 0)`` placeholder values
    (what a sample whose values travel elsewhere carries) instead of making float32 patches. A
    prepack stores exactly those pixels, so it never makes the patches only to turn them back into
    pixels. Every other attribute is ``processor``'s (its sizes, its video frames' resize and
    values: videos are made as ever and stored from their values)."""

    def __init__(self, processor: Any):
        self._processor = processor
        #: the resized ``(H, W, 3)`` uint8 pixels of every image processed, in order
        self.pixels: list[np.ndarray] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processor, name)

    def __call__(self, images: list[Any], return_tensors: str = "np", **_: Any) -> dict[str, np.ndarray]:
        p = int(self._processor.patch_size)
        resized = [resize_image(im, self._processor) for im in images]
        self.pixels.extend(resized)
        grids = np.array([(1, px.shape[0] // p, px.shape[1] // p) for px in resized], np.int64).reshape(-1, 3)
        return {"pixel_values": np.empty((int(grids.prod(axis=1).sum()), 0), np.float32), "image_grid_thw": grids}


@dataclass(frozen=True)
class StoredItems:
    """One sample's media items as stored, in row order.

    Attributes:
        pixels: each item's ``(frames, H, W, 3)`` uint8 pixels.
        grids: ``(I, 3)`` int64 each item's grid (``(1, 1, n)`` for a fixed-size image of ``n`` placeholders).
        video: ``(I,)`` bool: which items are videos.
        seconds: ``(I,)`` float32: seconds a video item's temporal slice spans (0 for an image).
        merge_size: the tower's merge window (1 for fixed-size images).
    """

    pixels: list[np.ndarray]
    grids: np.ndarray
    video: np.ndarray
    seconds: np.ndarray
    merge_size: int


def image_values(pixels: np.ndarray, table: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``(3, H, W)`` float32: a fixed-size image's values remade from its ``(H, W, 3)`` uint8 pixels
    (``out``: an array of that shape to write into, a slice of a batch's ``pixel_values``)."""
    h, w, _ = pixels.shape
    if out is None:
        out = np.empty((3, h, w), np.float32)
    for c in range(3):
        np.take(table[c], pixels[..., c], out=out[c])
    return out


def stored_items(
    media: Media, processor: Any, video_processor: Any = None, images: list[np.ndarray] | None = None
) -> StoredItems:
    """What a prepack stores of one sample's ``media`` (made with ``processor``, its videos'
    frames normalised by ``video_processor``, default ``processor``: the family's
    :meth:`~sftpack.multimodal.Family.video_processor`): each item's uint8 pixels, grid, kind
    and seconds (the module text). ``images``: the image items' resized pixels, in order, where
    a :class:`PixelRecorder` made them (their values are ``(P, 0)`` placeholders); else each
    image's pixels are turned back from its values.

    Raises:
        ValueError: values no uint8 pixel gives (named by item), or a payload of another kind.
    """
    n = media.num_items
    if isinstance(media, PatchMedia):
        grids = media.grid_thw.cpu().numpy().astype(np.int64)
        video = media.video.cpu().numpy().astype(bool)
        pv = media.pixel_values.cpu().numpy()
        offs = np.concatenate([[0], np.cumsum(grids.prod(axis=1))])
        pixels = []
        recorded = iter(images) if images is not None else None
        for i in range(n):
            own = pv[offs[i] : offs[i + 1]]
            try:
                if video[i]:
                    pixels.append(frames_from_patches(own, grids[i], video_processor or processor))
                elif recorded is not None:
                    px = next(recorded)
                    if px.shape[:2] != (
                        int(grids[i][1]) * processor.patch_size,
                        int(grids[i][2]) * processor.patch_size,
                    ):
                        raise ValueError(f"recorded pixels {px.shape} are not of its grid {grids[i].tolist()}")
                    pixels.append(px[None])
                else:
                    pixels.append(pixels_from_patches(own, grids[i], processor)[None])
            except ValueError as e:
                raise ValueError(f"{'video' if video[i] else 'image'} item {i}: {e}") from None
        seconds = media.second_per_grid_ts.cpu().numpy().astype(np.float32)
        return StoredItems(pixels, grids, video, seconds, int(media.merge_size))
    if isinstance(media, ImageMedia):
        table = pixel_table(processor)
        pv = media.pixel_values.cpu().numpy()
        pixels = []
        for i in range(n):
            if pv[i].dtype != np.float32 or pv[i].ndim != 3 or pv[i].shape[0] != 3:
                raise ValueError(f"image item {i}: values {pv[i].shape} {pv[i].dtype}, need (3, H, W) float32")
            try:
                pixels.append(table_pixels(np.moveaxis(pv[i], 0, -1), table)[None])
            except ValueError as e:
                raise ValueError(f"image item {i}: {e}") from None
        runs = media.slots.cpu().numpy()[:, 1].astype(np.int64)
        grids = np.stack([np.ones(n, np.int64), np.ones(n, np.int64), runs], axis=1).reshape(-1, 3)
        return StoredItems(pixels, grids, np.zeros(n, bool), np.zeros(n, np.float32), 1)
    raise ValueError(f"a prepack stores PatchMedia or ImageMedia items, not {type(media).__name__}")
