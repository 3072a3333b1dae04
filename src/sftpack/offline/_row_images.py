"""``MediaReader``: the media columns of a prepack with images, read back for a batch of rows.

:class:`~sftpack.offline._dataset.PrepackedDataset` opens one for a prepack whose manifest
has a ``media`` entry: it checks the media index (``images.npy``, ``row_images.npy``) against
itself, the pixel file and the text index, and lays the media of the rows it reads
(:meth:`MediaReader.lay_rows`; one row is a batch of one): each sequence's media by the
family the manifest names, all of them laid at their slots at once, and every image of the
batch patchified from its stored pixels straight into the batch's one ``pixel_values``
buffer, as the image processor would have made them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..handoff.payload import Media
from ._format import PrepackError

__all__ = ["MediaReader"]


class MediaReader:
    """The media columns of a prepack with media, read for a batch of rows (:class:`PrepackedDataset`
    uses it): each sequence's media rebuilt by the family the manifest names, configured as it was
    written (``Family.media`` of :func:`sftpack.multimodal.family_for` ``(manifest["media"]["family"])``
    with its ``family_settings``), MRoPE positions included, from the stored grids, kinds and
    placeholder starts, and the values remade from the stored pixels as the processor makes them
    (a patch family's patches, a fixed-size image's ``(3, H, W)`` values through the stored table).

    Args:
        path: the prepack directory; manifest: its checked manifest; arrays: the memory-mapped
            ``pixels``, ``images`` and ``row_images`` arrays.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], arrays: dict[str, np.ndarray]):
        from ..multimodal import family_for  # multimodal loads only for media (~0.5 s over the offline path)

        self.path = Path(path)
        self.entry = manifest["media"]
        self.pixels = arrays["pixels"]
        self.images = arrays["images"]
        self.row_images = arrays["row_images"]
        try:
            self.family = type(family_for(self.entry["family"])).from_media_settings(
                self.entry.get("family_settings", {})
            )
        except ValueError as e:
            raise PrepackError(f"{self.path}: manifest media.family_settings: {e}; write the prepack again") from None
        # the family's stored format (the manifest's media.kind, checked against it on open) says
        # how the values are remade: by the processors it names (a patch family's), else by the table
        try:
            processors = self.family.stored_processors(self.entry)
        except ValueError as e:
            raise PrepackError(f"{self.path}: {e}") from None
        self.patches = processors is not None  #: a patch family's (processors remake patches); else a table's
        self.processor: Any = None
        self.video_processor: Any = None
        self.table: np.ndarray | None = None
        if processors is not None:
            self.processor, self.video_processor = processors
            want = self.entry["processor"]
            p, t = int(want["patch_size"]), int(want["temporal_patch_size"])
            self.patch_dim, self.temporal = 3 * t * p * p, t
        else:
            self.table = np.asarray(self.entry["pixel_table"], dtype=np.float32)
            self.patch_dim, self.temporal = 0, 1
        self.image_token_id = int(self.entry["image_token_id"])
        self.merge_size = int(self.entry["merge_size"])

    def check(self, rows: np.ndarray, sequences: np.ndarray, counts: dict[str, Any]) -> None:
        """The media index against itself, the pixel file and the text index: O(rows + items)."""
        im, ri, n_img = self.images, self.row_images, self.images.shape[0]

        def fail(name: str, what: str) -> PrepackError:
            return PrepackError(f"{self.path / name} is inconsistent ({what}): the prepack is damaged; write it again")

        if n_img != self.entry["images"]:
            raise fail("images.npy", f"it holds {n_img} items, the manifest counts {self.entry['images']}")
        if ri.shape[0] != rows.shape[0] or int(ri[0]) != 0 or int(ri[-1]) != n_img or np.any(np.diff(ri) < 0):
            raise fail("row_images.npy", f"it must run from 0 to {n_img} items, one entry per row and one more")
        if not n_img:
            return
        h, w, f = (im[k].astype(np.int64) for k in ("height", "width", "frames"))
        if np.any(h < 1) or np.any(w < 1) or np.any(f < 1):
            raise fail("images.npy", "every item needs at least one frame of at least one pixel")
        nbytes = f * h * w * 3
        starts = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
        if np.any(im["pixels"] != starts) or int(nbytes.sum()) != self.pixels.shape[0]:
            raise fail("images.npy", "the items' pixels must tile pixels.npy in order")
        m = self.merge_size
        gt, gh, gw = (im[k].astype(np.int64) for k in ("grid_t", "grid_h", "grid_w"))
        video = im["video"] != 0
        if np.any((im["video"] != 0) & (im["video"] != 1)):
            raise fail("images.npy", "video must be 0 or 1")
        sec = im["seconds"]
        if not bool(np.all(np.isfinite(sec))) or np.any(sec < 0) or np.any(sec[~video] != 0):
            raise fail("images.npy", "seconds must be finite and >= 0, and 0 for images")
        if self.patches:
            p = int(self.entry["processor"]["patch_size"])
            bad = np.any(gh * p != h) or np.any(gw * p != w) or np.any(gh % m) or np.any(gw % m) or np.any(gt < 1)
            frames = np.where(video, gt * self.temporal, 1)
            if bad or np.any(gt[~video] != 1) or np.any(f != frames):
                raise fail(
                    "images.npy",
                    f"every item needs grid (t, height/{p}, width/{p}) in multiples of {m}, t = 1 for an image, "
                    f"and t x {self.temporal} frames for a video, 1 for an image",
                )
        elif np.any(gt != 1) or np.any(gh != 1) or np.any(gw < 1) or np.any(f != 1) or np.any(video):
            raise fail("images.npy", "every image of a fixed-size tower needs grid (1, 1, placeholders) and one frame")
        if int((gt * gh * gw).sum()) != self.entry["patches"]:
            raise fail("images.npy", f"its grids hold other than the manifest's {self.entry['patches']} patches")
        seq = im["sequence"]
        if np.any(np.diff(seq) < 0) or int(seq[0]) < 0 or int(seq[-1]) >= sequences.shape[0]:
            raise fail("images.npy", "item sequences must be in order and name sequences of the prepack")
        row_of_image = np.searchsorted(rows["sequence"], seq, side="right") - 1
        in_row = np.repeat(np.arange(rows.shape[0] - 1), np.diff(ri))
        if np.any(row_of_image != in_row):
            raise fail("row_images.npy", "an item is listed under another row than its sequence's")
        run = (gt * gh * gw) // (m * m)
        if np.any(im["start"] < 0) or np.any(im["start"] + run > sequences["length"][seq]):
            raise fail("images.npy", "an item's placeholder run lies outside its sequence")

    def image_range(self, rows: np.ndarray) -> np.ndarray:
        """``(I,)`` int64: the items of ``rows`` (global row numbers), in batch order."""
        ri = self.row_images
        a, b = ri[rows].astype(np.int64), ri[rows + 1].astype(np.int64)
        if rows.shape[0] == 1 or bool(np.all(a[1:] == b[:-1])):  # consecutive rows: one run of items
            return np.arange(int(a[0]), int(b[-1]), dtype=np.int64)
        return np.concatenate([np.arange(x, y, dtype=np.int64) for x, y in zip(a.tolist(), b.tolist())])

    def stored_bytes(self, images: np.ndarray) -> int:
        """Bytes of ``pixels.npy`` the items ``images`` hold."""
        im = self.images[images]
        return int((im["frames"].astype(np.int64) * im["height"] * im["width"]).sum()) * 3

    def _item(self, rec: Any) -> np.ndarray:
        a, f, h, w = int(rec["pixels"]), int(rec["frames"]), int(rec["height"]), int(rec["width"])
        return self.pixels[a : a + f * h * w * 3].reshape(f, h, w, 3)

    def pixel_values(self, images: np.ndarray) -> np.ndarray:
        """The values of the items ``images`` (numbers, in order) remade from the stored pixels into
        one buffer, each straight into its slice: ``(P, D)`` float32 patches of a patch family
        (what a row's or a batch's ``pixel_values`` holds), ``(I, 3, H, W)`` float32 of fixed-size images."""
        from ..multimodal import (  # multimodal loads only for media (~0.5 s over the offline path)
            image_values,
            patchify_frames,
            patchify_pixels,
        )

        im = self.images[images]
        if not self.patches:
            assert self.table is not None
            hw = {(int(r["height"]), int(r["width"])) for r in im} or {(0, 0)}
            if len(hw) > 1:
                raise ValueError(f"images of sizes {sorted(hw)} in one batch: one tower takes one image size")
            ((h, w),) = hw
            vals = np.empty((len(im), 3, h, w), np.float32)
            for i, rec in enumerate(im):
                image_values(self._item(rec)[0], self.table, out=vals[i])
            return vals
        per = (im["grid_t"].astype(np.int64) * im["grid_h"] * im["grid_w"]).tolist()
        out = np.empty((int(sum(per)), self.patch_dim), np.float32)
        o = 0
        proc = self.processor
        for rec, n in zip(im, per):
            px = self._item(rec)
            if rec["video"]:
                out[o : o + n] = patchify_frames(px, self.video_processor)[0]
            else:
                patchify_pixels(px[0], proc, out=out[o : o + n])
            o += n
        return out

    def stored_images(self, r: int) -> list[np.ndarray]:
        """Row ``r``'s items as stored, in row order: an image's resized ``(H, W, 3)`` uint8
        pixels, a video item's ``(frames, H, W, 3)``."""
        out = []
        for rec in self.images[int(self.row_images[r]) : int(self.row_images[r + 1])]:
            px = self._item(rec)
            out.append(px if rec["video"] else px[0])
        return out

    def lay_rows(
        self,
        rows: np.ndarray,
        row_sequences: np.ndarray,
        input_ids: np.ndarray,
        cu_seqlens: np.ndarray,
        cu_seqlens_padded: np.ndarray,
        *,
        pixel_values: np.ndarray | None = None,
    ) -> Media:
        """The media of ``rows`` (global row numbers) laid end to end, as the batch of their text
        fields (``input_ids``, ``cu_seqlens``, ``cu_seqlens_padded``: one segment per stored
        sequence, in order) carries it: field for field the media of
        ``PackedBatch.concat([PackedBatch.from_samples(row's samples) for each row])``.

        Each sequence's media is the family's (:meth:`~sftpack.multimodal.Family.media` of its
        ids, placeholder runs and grids: MRoPE positions included), the sequences laid at their
        slots in one :meth:`~sftpack.handoff.payload.Media.lay`, and the pixels of every image of
        the batch patchified once into the batch's buffer (``pixel_values``: use these patches
        instead, ``(P, D)`` in batch order). ``row_sequences`` is the row index's first
        sequence per row (``rows.npy``'s ``sequence``).

        Raises:
            PackedBatchError: the laid media do not fit the batch's tokens (a damaged index, read
                with ``verify=None``), checked before any pixel is made."""
        from ..multimodal import (  # multimodal loads only for media (~0.5 s over the offline path)
            EncodedImages,
            EncodedVideos,
        )

        idx = self.image_range(rows)
        im = self.images[idx]
        # each item's segment of the batch: its sequence's place among the batch's sequences
        seq0 = row_sequences[rows].astype(np.int64)
        n_seq = row_sequences[rows + 1].astype(np.int64) - seq0
        seg0 = np.concatenate([[0], np.cumsum(n_seq)[:-1]])
        per_row = self.row_images[rows + 1].astype(np.int64) - self.row_images[rows]
        b = np.repeat(np.arange(rows.shape[0]), per_row)
        seg = im["sequence"].astype(np.int64) - seq0[b] + seg0[b]
        n_seg = int(n_seq.sum())
        bounds = np.searchsorted(seg, np.arange(n_seg + 1)).tolist()
        grids = np.stack([im["grid_t"], im["grid_h"], im["grid_w"]], axis=1).astype(np.int64).reshape(-1, 3)
        per = grids.prod(axis=1)
        tokens = per // self.merge_size**2
        runs = np.stack([im["start"].astype(np.int64), tokens], axis=1).reshape(-1, 2)
        video = im["video"] != 0
        seconds = im["seconds"].astype(np.float32)
        cu = cu_seqlens.astype(np.int64).tolist()
        cup = cu_seqlens_padded.astype(np.int64).tolist()
        lengths = [y - x for x, y in zip(cu[:-1], cu[1:])]

        # the values are the batch's one buffer, made below: each part holds placeholders of their count
        def no_values(n: int) -> np.ndarray:
            return np.empty((n, 0) if self.patches else (n, 3, 0, 0), np.float32)

        parts = []
        for k in range(n_seg):
            a, e, off = bounds[k], bounds[k + 1], cup[k]
            img = np.arange(a, e)[~video[a:e]]
            images = EncodedImages(
                pixel_values=no_values(int(per[img].sum()) if self.patches else len(img)),
                tokens=tokens[img],
                grid_thw=grids[img],
                merge_size=self.merge_size,
            )
            extra: dict[str, Any] = {}
            if video[a:e].any():
                vid = np.arange(a, e)[video[a:e]]
                extra["videos"] = EncodedVideos(
                    pixel_values=no_values(int(per[vid].sum())),
                    tokens=tokens[vid],
                    grid_thw=grids[vid],
                    merge_size=self.merge_size,
                    second_per_grid_ts=seconds[vid],
                    frames=grids[vid, 0] * self.temporal,
                )
                extra["video_runs"] = runs[vid]
            ids = input_ids[off : off + lengths[k]]
            parts.append(self.family.media(ids, runs[img], images, self.image_token_id, **extra))
        laid = type(parts[0]).lay(
            parts,
            lengths=lengths,
            offsets=cup[:-1],
            widths=[y - x for x, y in zip(cup[:-1], cup[1:])],
            segments=[1] * n_seg,
        )
        # against the batch's tokens before any pixel is made (runs on placeholders, inside their
        # sequences; positions restarting): what a damaged index read with verify=None breaks
        laid.check(input_ids, cu_seqlens, cu_seqlens_padded)
        pv = self.pixel_values(idx) if pixel_values is None else pixel_values
        return dataclasses.replace(laid, pixel_values=torch.from_numpy(pv))
