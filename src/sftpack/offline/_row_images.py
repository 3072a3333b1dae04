"""``MediaReader``: the media columns of a prepack with images, read back per row.

:class:`~sftpack.offline._dataset.PrepackedDataset` opens one for a prepack whose manifest
has a ``media`` entry: it checks the media index (``images.npy``, ``row_images.npy``) against
itself, the pixel file and the text index, and rebuilds each row's samples with their media
(the family the manifest names, the pixels patchified as the image processor does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..sample import Sample
from ._format import DEFAULT_FAMILY, PrepackError

__all__ = ["MediaReader"]


class MediaReader:
    """The media columns of a prepack with images, read per row (:class:`PrepackedDataset` uses it):
    each sequence's media rebuilt by the family the manifest names (``Family.media`` of
    :func:`sftpack.multimodal.family_for` ``(manifest["media"]["family"])``, Qwen2-VL's when it names
    none: the prepacks written before it was recorded), MRoPE positions included, from the stored
    grids and placeholder starts, and the pixels patchified as the processor does.

    Args:
        path: the prepack directory; manifest: its checked manifest; arrays: the memory-mapped
            ``pixels``, ``images`` and ``row_images`` arrays.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], arrays: dict[str, np.ndarray]):
        from ..multimodal import family_for
        from ..multimodal._images import image_processor, processor_settings

        self.path = Path(path)
        self.entry = manifest["media"]
        self.pixels = arrays["pixels"]
        self.images = arrays["images"]
        self.row_images = arrays["row_images"]
        want = self.entry["processor"]
        self.processor = image_processor(int(want["min_pixels"]), int(want["max_pixels"]))
        have = processor_settings(self.processor)
        diff = sorted(k for k in want if want[k] != have.get(k))
        if diff:
            raise PrepackError(
                f"{self.path}: its images were stored for an image processor with {', '.join(f'{k}={want[k]!r}' for k in diff)}"
                f", the installed one has {', '.join(f'{k}={have.get(k)!r}' for k in diff)}: the patches would differ; "
                "install the transformers version it was written with, or prepack again"
            )
        self.image_token_id = int(self.entry["image_token_id"])
        self.merge_size = int(self.entry["merge_size"])
        self.family = family_for(self.entry.get("family", DEFAULT_FAMILY))
        p, t = int(want["patch_size"]), int(want["temporal_patch_size"])
        self.patch_dim = 3 * t * p * p

    def check(self, rows: np.ndarray, sequences: np.ndarray, counts: dict[str, Any]) -> None:
        """The media index against itself, the pixel file and the text index: O(rows + images)."""
        im, ri, n_img = self.images, self.row_images, self.images.shape[0]

        def fail(name: str, what: str) -> PrepackError:
            return PrepackError(f"{self.path / name} is inconsistent ({what}): the prepack is damaged; write it again")

        if n_img != self.entry["images"]:
            raise fail("images.npy", f"it holds {n_img} images, the manifest counts {self.entry['images']}")
        if ri.shape[0] != rows.shape[0] or int(ri[0]) != 0 or int(ri[-1]) != n_img or np.any(np.diff(ri) < 0):
            raise fail("row_images.npy", f"it must run from 0 to {n_img} images, one entry per row and one more")
        if not n_img:
            return
        h, w = im["height"].astype(np.int64), im["width"].astype(np.int64)
        p = int(self.entry["processor"]["patch_size"])
        nbytes = h * w * 3
        starts = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
        if np.any(im["pixels"] != starts) or int(nbytes.sum()) != self.pixels.shape[0]:
            raise fail("images.npy", "the images' pixels must tile pixels.npy in order")
        m = self.merge_size
        gt, gh, gw = im["grid_t"], im["grid_h"], im["grid_w"]
        if np.any(gt != 1) or np.any(gh * p != h) or np.any(gw * p != w) or np.any(gh % m) or np.any(gw % m):
            raise fail("images.npy", f"every image needs grid (1, height/{p}, width/{p}) in multiples of {m}")
        if int((gh.astype(np.int64) * gw).sum()) != self.entry["patches"]:
            raise fail("images.npy", f"its grids hold other than the manifest's {self.entry['patches']} patches")
        seq = im["sequence"]
        if np.any(np.diff(seq) < 0) or int(seq[0]) < 0 or int(seq[-1]) >= sequences.shape[0]:
            raise fail("images.npy", "image sequences must be in order and name sequences of the prepack")
        row_of_image = np.searchsorted(rows["sequence"], seq, side="right") - 1
        in_row = np.repeat(np.arange(rows.shape[0] - 1), np.diff(ri))
        if np.any(row_of_image != in_row):
            raise fail("row_images.npy", "an image is listed under another row than its sequence's")
        run = (gh.astype(np.int64) * gw) // (m * m)
        if np.any(im["start"] < 0) or np.any(im["start"] + run > sequences["length"][seq]):
            raise fail("images.npy", "an image's placeholder run lies outside its sequence")

    def pixel_values(self, r: int) -> np.ndarray:
        """``(P, D)`` float32: row ``r``'s images patchified from the stored pixels, in row order, into
        one buffer (what the row's ``pixel_values`` holds)."""
        from ..multimodal._images import patchify_pixels

        im = self.images[int(self.row_images[r]) : int(self.row_images[r + 1])]
        per = (im["grid_h"].astype(np.int64) * im["grid_w"]).tolist()
        out = np.empty((int(sum(per)), self.patch_dim), np.float32)
        o = 0
        for pixels, n in zip(self.stored_images(r), per):
            patchify_pixels(pixels, self.processor, out=out[o : o + n])
            o += n
        return out

    def stored_images(self, r: int) -> list[np.ndarray]:
        """Row ``r``'s images as stored: resized ``(H, W, 3)`` uint8 arrays, in row order."""
        out = []
        for rec in self.images[int(self.row_images[r]) : int(self.row_images[r + 1])]:
            a, h, w = int(rec["pixels"]), int(rec["height"]), int(rec["width"])
            out.append(self.pixels[a : a + h * w * 3].reshape(h, w, 3))
        return out

    def samples(
        self,
        r: int,
        first_sequence: int,
        ids: np.ndarray,
        mask: np.ndarray,
        seqs: np.ndarray,
        conv_ids: list[Any],
        *,
        with_pixels: bool = True,
    ) -> list[Sample]:
        """Row ``r``'s :class:`~sftpack.Sample` list (its stored slices ``ids``, ``mask``, ``seqs``,
        whose first sequence is number ``first_sequence``): each sequence with its images as its
        ``media`` (the family's :class:`~sftpack.handoff.payload.PatchMedia`, MRoPE positions
        included), ``pixel_values`` patchified from the stored pixels (``with_pixels=False``:
        ``(P, 0)`` placeholders, for a reader that patchifies the whole row into one buffer,
        :meth:`pixel_values`)."""
        from ..multimodal._family import EncodedImages

        i0, i1 = int(self.row_images[r]), int(self.row_images[r + 1])
        im = self.images[i0:i1]
        owner = im["sequence"].tolist()
        pv_row = self.pixel_values(r) if with_pixels else np.empty((0, 0), np.float32)
        out = []
        t = k0 = o = 0
        m2 = self.merge_size**2
        lengths = seqs["length"].astype(np.int64).tolist()
        for j, n in enumerate(lengths):
            k1 = k0
            while k1 < len(owner) and owner[k1] == first_sequence + j:
                k1 += 1
            mine = im[k0:k1]
            grids = np.stack([mine["grid_t"], mine["grid_h"], mine["grid_w"]], axis=1).astype(np.int64).reshape(-1, 3)
            per = grids.prod(axis=1)
            patches = int(per.sum())
            pv = pv_row[o : o + patches] if with_pixels else np.empty((patches, 0), np.float32)
            o += patches
            runs = np.stack([mine["start"].astype(np.int64), per // m2], axis=1).reshape(-1, 2)
            seq_ids = np.asarray(ids[t : t + n], dtype=np.int64)
            images = EncodedImages(pixel_values=pv, tokens=per // m2, grid_thw=grids, merge_size=self.merge_size)
            media = self.family.media(seq_ids, runs, images, self.image_token_id)
            out.append(Sample(seq_ids, np.asarray(mask[t : t + n], dtype=bool), conv_ids[j], media=media))
            t += n
            k0 = k1
        return out
