"""Prepacks with images (issue 19): multimodal conversations through the one offline pipeline.

The same driver (:func:`~sftpack.offline._driver.run`) writes them: stage 1 tokenizes
each conversation with :func:`sftpack.multimodal.tokenize_multimodal_conversations`
(in ``num_proc`` forked workers, results taken in input order), applies the patch
budget's rule (:func:`sftpack.multimodal._plan.check_patch_budget`: a conversation
with a sample over ``max_patches`` is dropped and counted as ``over_patch_budget``, or
refused under ``overlong="error"``, as the loader does) and stages its tokens like any
sample plus its images; stage 2 plans rows with
:func:`sftpack.multimodal.plan_rows` (tokens per row and, optionally, vision patches
per row); stage 3 writes the tokens at the plan's offsets and the images in row order.

What is stored per image: the **resized uint8 pixels** (the processor's ``smart_resize``
output, ``(H, W, 3)``, 3 bytes a pixel) and its grid, not the float32 patches (24 bytes
a pixel: 4-byte floats, every pixel twice for Qwen2-VL's temporal patch), 8x less disk
and page cache. Reading patchifies them again with the processor's own rescale and
normalisation table (:func:`sftpack.multimodal._images.patchify_pixels`), which gives
``pixel_values`` byte for byte as the processor does (tested). Stage 1 gets the pixels
back from the sample's own patches (:func:`~sftpack.multimodal._images.pixels_from_patches`,
the exact inverse, refused when the patches are not a uint8 image's), so what is stored
is exactly what the in-memory sample carries. MRoPE positions are not stored: a row's
reader recomputes them per sample (:func:`sftpack.multimodal.rope_index`) when it builds
the row with :func:`sftpack.multimodal.build_multimodal_row`, the in-memory row builder.

Three more files (format version 3)::

    pixels.npy      (B,)    uint8    every image's resized pixels, (H, W, 3) row-major, in row order
    images.npy      (I,)    pixels i8, height i4, width i4, grid_t i4, grid_h i4, grid_w i4,
                                     sequence i8, start i4    (sequence: the output sequence the image
                                     belongs to; start: its placeholder run's start in that sequence)
    row_images.npy  (R+1,)  int64    row r holds images [row_images[r], row_images[r+1])

Stage 1 keeps per image 40 bytes in memory and appends the pixels to a staging file,
so memory stays flat in the number of images.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ..sample import Sample
from ._engine import MultimodalConversations, Staged, progress_bar
from ._fingerprint import tokenizer_fingerprint
from ._format import MEDIA_FILES, PrepackError, npy_header
from ._inputs import Hashing
from ._plan import RowPlan, _finish, check_width
from ._stage import stage_samples

__all__ = [
    "IMAGE_DTYPE",
    "MEDIA_FILES",
    "MEDIA_INDEX_FILES",
    "MediaPack",
    "MultimodalConversations",
    "StagedMedia",
    "stage_multimodal",
    "write_media",
]

#: One record per image, in row order.
IMAGE_DTYPE = np.dtype(
    [
        ("pixels", "<i8"),
        ("height", "<i4"),
        ("width", "<i4"),
        ("grid_t", "<i4"),
        ("grid_h", "<i4"),
        ("grid_w", "<i4"),
        ("sequence", "<i8"),
        ("start", "<i4"),
    ]
)
MEDIA_INDEX_FILES = MEDIA_FILES[1:]
MEDIA_KIND = "qwen2vl-resized-uint8-hwc"
_PIXELS = "pixels.u8"


@dataclass
class StagedMedia:
    """The images of stage 1, in input order (the samples' order).

    Attributes:
        directory: the staging folder (the pixels, end to end, in ``pixels.u8``).
        first_image: ``(S+1,)`` int64: sample ``s`` holds images ``first_image[s]:first_image[s+1]``.
        records: ``(I,)`` :data:`IMAGE_DTYPE` in input order (``pixels``: the offset in the staging
            file; ``sequence``: the input sample).
        patches: ``(S,)`` int64 vision patches of each sample (the planner's second budget).
        settings: the processor's settings (:func:`~sftpack.multimodal._images.processor_settings`).
        image_token_id, merge_size: the samples' placeholder id and merge window.
    """

    directory: Path
    first_image: np.ndarray
    records: np.ndarray
    patches: np.ndarray
    settings: dict[str, Any]
    image_token_id: int
    merge_size: int

    @property
    def num_images(self) -> int:
        return int(self.records.shape[0])

    @property
    def pixel_bytes(self) -> int:
        r = self.records
        return int((r["height"].astype(np.int64) * r["width"] * 3).sum())

    def manifest_entry(self) -> dict[str, Any]:
        return {
            "kind": MEDIA_KIND,
            "images": self.num_images,
            "patches": int(self.patches.sum()),
            "pixel_bytes": self.pixel_bytes,
            "image_token_id": self.image_token_id,
            "merge_size": self.merge_size,
            "processor": self.settings,
        }


# ------------------------------------------------------------------ stage 1


def _encode(conv: Any, settings: dict[str, Any]) -> tuple[dict[str, Any], list[tuple]]:
    """One conversation to ``(stats delta, pieces)``; a piece is ``(ids, mask, conversation id, meta,
    runs, grids, [resized uint8 pixels per image])`` (plain arrays: cheap to send between processes)."""
    from ..multimodal import MultimodalStats, tokenize_multimodal_conversations
    from ..multimodal._images import pixels_from_patches
    from ..multimodal._plan import check_patch_budget

    st = MultimodalStats()
    proc = settings["processor"]
    samples = list(
        tokenize_multimodal_conversations(
            [conv],
            tokenizer=settings["tokenizer"],
            processor=proc,
            max_seq_len=settings["max_seq_len"],
            overlong=settings["overlong"],
            on_bad_row=settings["on_bad_row"],
            stats=st,
        )
    )
    reason = check_patch_budget(samples, settings["max_patches"], settings["overlong"])
    if reason is not None:  # kept by the tokenizer, but no row can hold it: counted under the budget's reason
        st, samples = MultimodalStats(read=st.read, dropped={reason: 1}), []
    pieces = []
    for s in samples:
        offs = np.concatenate([[0], np.cumsum(s.image_grid_thw.prod(axis=1))])
        pixels = []
        for i, g in enumerate(s.image_grid_thw):
            try:
                pixels.append(pixels_from_patches(s.pixel_values[offs[i] : offs[i + 1]], g, proc))
            except ValueError as e:
                raise PrepackError(
                    f"conversation {s.conversation_id!r}, image {i}: {e}; the prepack stores resized uint8 pixels"
                ) from None
        pieces.append(
            (
                s.input_ids,
                s.loss_mask,
                s.conversation_id,
                dict(s.meta or {}),
                s.image_runs,
                s.image_grid_thw,
                pixels,
                s.image_token_id,
                s.merge_size,
            )
        )
    delta = {"read": st.read, "kept": st.kept, "samples": st.samples, "images": st.images, "dropped": st.dropped}
    return delta, pieces


_worker_settings: dict[str, Any] = {}


def _init_worker(settings: dict[str, Any]) -> None:
    _worker_settings.update(settings)


def _work(items: list[Any]) -> list[tuple[dict[str, Any], list[tuple]]]:
    return [_encode(c, _worker_settings) for c in items]


def _chunks(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    buf: list[Any] = []
    for x in items:
        buf.append(x)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf


def _encoded(
    inputs: Iterable[Any], limit: int | None, num_proc: int, settings: dict[str, Any], chunk: int = 8
) -> Iterator[tuple]:
    """``_encode`` of every conversation, in input order, in this process or ``num_proc`` forked ones."""
    convs: Iterable[Any] = inputs if limit is None else islice(inputs, limit)
    if num_proc == 1:
        for c in convs:
            yield _encode(c, settings)
        return
    import multiprocessing

    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(num_proc, initializer=_init_worker, initargs=(settings,))
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        pending: deque[Any] = deque()
        for items in _chunks(convs, chunk):
            pending.append(pool.apply_async(_work, (items,)))
            if len(pending) >= 2 * num_proc:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
    finally:
        pool.terminate()
        pool.join()


@dataclass
class _Recorder:
    """Turns the encoded pieces into plain :class:`Sample` objects for :func:`stage_samples`,
    appending each piece's images to the staging pixel file as it passes."""

    directory: Path
    counts: dict[str, Any] = field(default_factory=lambda: {"read": 0, "kept": 0, "dropped": {}, "split": 0})
    first_image: list[int] = field(default_factory=lambda: [0])
    records: list[tuple] = field(default_factory=list)
    patches: list[int] = field(default_factory=list)
    image_token_id: int | None = None
    merge_size: int | None = None
    offset: int = 0

    def samples(self, encoded: Iterable[tuple]) -> Iterator[Sample]:
        with open(self.directory / _PIXELS, "wb") as f:
            for delta, pieces in encoded:
                c = self.counts
                c["read"] += delta["read"]
                c["kept"] += delta["kept"]
                for k, v in delta["dropped"].items():
                    c["dropped"][k] = c["dropped"].get(k, 0) + v
                c["split"] += len(pieces) > 1
                for ids, mask, cid, meta, runs, grids, pixels, image_id, merge in pieces:
                    self.image_token_id = int(image_id) if self.image_token_id is None else self.image_token_id
                    self.merge_size = int(merge) if self.merge_size is None else self.merge_size
                    if (image_id, merge) != (self.image_token_id, self.merge_size):
                        raise PrepackError(f"conversation {cid!r}: another image token or merge size than the others")
                    n = len(self.patches)
                    for (start, _), g, px in zip(runs.tolist(), grids.tolist(), pixels):
                        h, w, _c = px.shape
                        self.records.append((self.offset, h, w, g[0], g[1], g[2], n, start))
                        f.write(np.ascontiguousarray(px).data)
                        self.offset += px.nbytes
                    self.first_image.append(len(self.records))
                    self.patches.append(int(np.asarray(grids).prod(axis=1).sum()) if len(grids) else 0)
                    yield Sample(ids, mask, cid, meta=meta)
            f.flush()
            os.fsync(f.fileno())


def stage_multimodal(work: MultimodalConversations, staging: Path, progress: bool = False) -> Any:
    """Stage 1 for multimodal conversations: a :class:`~sftpack.offline.engine.Staged` with ``media``."""
    from ..multimodal import image_processor, qwen2vl_tokenizer
    from ..multimodal._images import processor_settings, reproduces

    proc = work.processor if work.processor is not None else image_processor()
    if not reproduces(proc):  # the reader re-patchifies stored pixels the PIL processor's way
        raise ValueError(
            f"prepack_multimodal stores each image's resized uint8 pixels and re-makes the patches the way "
            f"transformers' Qwen2VLImageProcessorPil does, which {type(proc).__name__} with these settings does "
            "not reproduce exactly: pass sftpack.multimodal.image_processor(min_pixels=..., max_pixels=...) (or a "
            "Qwen2VLImageProcessorPil that resizes, rescales, normalises and converts to RGB)"
        )
    staging = Path(staging)
    staging.mkdir(parents=True, exist_ok=True)
    tok = work.tokenizer if work.tokenizer is not None else qwen2vl_tokenizer()
    settings = {
        "tokenizer": tok,
        "processor": proc,
        "max_seq_len": work.max_seq_len,
        "overlong": work.overlong,
        "on_bad_row": work.on_bad_row,
        "max_patches": work.max_patches,
    }
    rec = _Recorder(staging)
    hashing = Hashing(work.inputs if work.limit is None else islice(work.inputs, work.limit))
    with progress_bar(progress, desc="tokenize", unit="conv") as bar:

        def counted() -> Iterator[tuple]:
            for item in _encoded(hashing, None, work.num_proc, settings):
                bar.update(1)
                yield item

        staged = stage_samples(rec.samples(counted()), staging)
    c = rec.counts
    over = c["dropped"].get("overlong", 0)
    counts = {
        "read": c["read"],
        "kept": c["kept"],
        "dropped": dict(sorted(c["dropped"].items())),
        "overlong": {
            "tokenized": c["kept"] + over,
            "fit": c["kept"] - c["split"],
            "truncated": 0,
            "split": c["split"],
            "dropped": over,
        },
    }
    records = np.array(rec.records, dtype=IMAGE_DTYPE) if rec.records else np.zeros(0, IMAGE_DTYPE)
    media = StagedMedia(
        staging,
        np.asarray(rec.first_image, np.int64),
        records,
        np.asarray(rec.patches, np.int64),
        processor_settings(proc),
        int(rec.image_token_id if rec.image_token_id is not None else 151655),
        int(rec.merge_size if rec.merge_size is not None else int(proc.merge_size)),
    )
    return Staged(
        staged,
        staged.source(),
        staged.source().conversation_ids_path(),
        counts,
        inputs=[hashing.fingerprint()],
        tokenizer=tokenizer_fingerprint(tok),
        media=media,
    )


# ------------------------------------------------------------------ stage 2


@dataclass(frozen=True)
class MediaPack:
    """Stage 2 for samples with images: :func:`sftpack.multimodal.plan_rows` (first-fit decreasing on
    the padded token cost, a row taking a sample only if its vision patches fit ``max_patches`` too).
    Each row lists its samples in input order; rows in the planner's order."""

    max_seq_len: int
    pad_multiple: int = 1
    max_patches: int | None = None

    def __post_init__(self) -> None:
        width, m = check_width(self.max_seq_len, self.pad_multiple)
        object.__setattr__(self, "max_seq_len", width)
        object.__setattr__(self, "pad_multiple", m)
        if self.max_patches is not None and (isinstance(self.max_patches, bool) or int(self.max_patches) < 1):
            raise ValueError(f"max_patches must be a positive integer or None, got {self.max_patches!r}")

    def plan(
        self, lengths: ArrayLike, row_sizes: Iterable[int] | None = None, *, patches: ArrayLike | None = None
    ) -> RowPlan:
        from ..multimodal import plan_rows

        if row_sizes is not None:
            raise ValueError("MediaPack plans its own rows")
        lengths_in = np.asarray(lengths, np.int64)
        pt = np.zeros_like(lengths_in) if patches is None else np.asarray(patches, np.int64)
        rows = plan_rows(
            lengths_in, pt, max_seq_len=self.max_seq_len, max_patches=self.max_patches, pad_multiple=self.pad_multiple
        )
        order = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        return _finish(lengths_in, order.astype(np.int64), offsets, self.max_seq_len, self.pad_multiple)

    def fingerprint(self) -> dict[str, Any]:
        return {"algorithm": "multimodal.plan_rows (ffd, two budgets)", "seed": None, "max_patches": self.max_patches}


# ------------------------------------------------------------------ stage 3


def _write_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(npy_header(arr.dtype, arr.shape[0]))
        f.write(np.ascontiguousarray(arr).tobytes())
        f.flush()
        os.fsync(f.fileno())


def write_media(directory: Path, plan: RowPlan, media: StagedMedia, chunk_bytes: int = 1 << 24) -> None:
    """``pixels.npy``, ``images.npy`` and ``row_images.npy``: the images of the plan's sequences in
    row order (each sequence's images in order). Pure function of the plan and the staged images."""
    fi = media.first_image
    counts = fi[1:] - fi[:-1]
    per_seq = counts[plan.order]  # images of each output sequence
    src = np.concatenate([np.arange(fi[s], fi[s + 1]) for s in plan.order.tolist()]) if media.num_images else None
    out = media.records[src].copy() if src is not None else np.zeros(0, IMAGE_DTYPE)
    nbytes = out["height"].astype(np.int64) * out["width"] * 3
    starts = np.zeros(out.shape[0], np.int64)
    if out.shape[0]:
        np.cumsum(nbytes[:-1], out=starts[1:])
    src_off = out["pixels"].copy()
    out["pixels"] = starts
    out["sequence"] = np.repeat(np.arange(plan.order.shape[0], dtype=np.int64), per_seq)
    total = int(nbytes.sum())
    header = npy_header(np.uint8, total)
    with (
        open(media.directory / _PIXELS, "rb", buffering=0) as fsrc,
        open(directory / "pixels.npy", "wb") as fdst,
    ):
        fdst.write(header)
        buf = bytearray()
        for a, n in zip(src_off.tolist(), nbytes.tolist()):
            fsrc.seek(a)
            data = fsrc.read(n)
            if len(data) != n:
                raise OSError(f"{media.directory / _PIXELS}: unexpected end of the staging file at byte {a}")
            buf += data
            if len(buf) >= chunk_bytes:
                fdst.write(buf)
                buf = bytearray()
        fdst.write(buf)
        fdst.flush()
        os.fsync(fdst.fileno())
    _write_npy(directory / "images.npy", out)
    row_images = np.zeros(plan.num_rows + 1, np.int64)
    seq_first = np.zeros(plan.order.shape[0] + 1, np.int64)
    np.cumsum(per_seq, out=seq_first[1:])
    row_images[:] = seq_first[plan.row_offsets]
    _write_npy(directory / "row_images.npy", row_images)


# ------------------------------------------------------------------ reading


class MediaReader:
    """The images of a prepack with media, read per row (:class:`~sftpack.offline.PrepackedDataset` uses it).

    Args:
        path: the prepack directory; manifest: its checked manifest; arrays: the memory-mapped
            ``pixels``, ``images`` and ``row_images`` arrays.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], arrays: dict[str, np.ndarray]):
        from ..multimodal import image_processor
        from ..multimodal._images import processor_settings

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
        for rec, n in zip(im, per):
            a, hh, ww = int(rec["pixels"]), int(rec["height"]), int(rec["width"])
            patchify_pixels(self.pixels[a : a + hh * ww * 3].reshape(hh, ww, 3), self.processor, out=out[o : o + n])
            o += n
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
    ) -> list[Any]:
        """Row ``r``'s :class:`~sftpack.multimodal.MultimodalSample` list (its stored slices ``ids``,
        ``mask``, ``seqs``, whose first sequence is number ``first_sequence``): each sequence with its
        images, ``pixel_values`` patchified from the stored pixels (``with_pixels=False``: ``(P, 0)``
        placeholders, for a reader that patchifies the whole row into one buffer, :meth:`pixel_values`)."""
        from ..multimodal import MultimodalSample

        i0, i1 = int(self.row_images[r]), int(self.row_images[r + 1])
        im = self.images[i0:i1]
        owner = im["sequence"].tolist()
        pv_row = self.pixel_values(r) if with_pixels else np.empty((0, 0), np.float32)
        out = []
        t = k0 = o = 0
        lengths = seqs["length"].astype(np.int64).tolist()
        for j, n in enumerate(lengths):
            k1 = k0
            while k1 < len(owner) and owner[k1] == first_sequence + j:
                k1 += 1
            mine = im[k0:k1]
            grids = np.stack([mine["grid_t"], mine["grid_h"], mine["grid_w"]], axis=1).astype(np.int64)
            patches = int(grids.prod(axis=1).sum()) if k1 > k0 else 0
            pv = pv_row[o : o + patches] if with_pixels else np.empty((patches, 0), np.float32)
            o += patches
            runs = np.stack([mine["start"].astype(np.int64), grids.prod(axis=1) // self.merge_size**2], axis=1)
            out.append(
                MultimodalSample(
                    np.asarray(ids[t : t + n], dtype=np.int64),
                    np.asarray(mask[t : t + n], dtype=bool),
                    conv_ids[j],
                    pixel_values=pv,
                    image_grid_thw=grids.reshape(-1, 3),
                    image_runs=runs.reshape(-1, 2),
                    image_token_id=self.image_token_id,
                    merge_size=self.merge_size,
                )
            )
            t += n
            k0 = k1
        return out
