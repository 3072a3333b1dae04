"""Stage 3 of a prepack: the plan and a token source in, the files out.

:func:`allocate` creates ``tokens.npy`` and ``loss_mask.npy`` at their final
size (header + items, space reserved up front so a full disk fails before the
long write, not after); :func:`write_rows` fills any range of rows at the
offsets the plan fixed, with ``os.pwrite``; :func:`write_index` writes the
small per-sequence and per-row index and the conversation ids. Because every
byte's position comes from the plan, rows can be written in any order, by any
number of workers (an engine runs :func:`write_rows` on disjoint row ranges),
and the files come out the same.

A token source is anything with ``gather(sample_indices) -> (ids, mask)``
returning the samples' tokens and masks laid end to end in that order (the
local engine's is :class:`~sftpack.offline._stage.StagingSource`).

Samples with images add the media columns (``pixels.npy``, ``images.npy``,
``row_images.npy``): :func:`media_layout` fixes, from the plan and the staged
media, every image's record and the first image and pixel byte of every row, so
the same :func:`write_rows` call fills a range of rows' pixels (the source's
``gather_pixels(sample_indices)``) and image records beside their tokens, at
offsets no other range touches.

A source whose samples carry weights (``source.weighted``) adds ``weights.npy``, each token's
float64 weight at its token's offset (``gather_weights(sample_indices)``), written beside the
tokens by the same call; :func:`write_index` writes ``roles.npy`` for preference pairs.

Memory: one chunk of rows at a time (``chunk_tokens``, 1M tokens by default:
about 10 MB), whatever the dataset size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ._format import IMAGE_DTYPE, ROLES_FILE, ROW_DTYPE, SEQUENCE_DTYPE, WEIGHTS_FILE, npy_header
from ._plan import RowPlan
from ._stage import StagedMedia

__all__ = ["MediaLayout", "TokenSource", "allocate", "media_layout", "row_chunks", "write_index", "write_rows"]

CHUNK_TOKENS = 1 << 20
#: Pixel bytes gathered and written per step at most (a chunk of rows is cut at whichever comes first).
CHUNK_PIXEL_BYTES = 1 << 26


class TokenSource(Protocol):
    def gather(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class MediaLayout:
    """Where the images of every row go: a pure function of the plan and the staged media.

    Attributes:
        records: ``(I,)`` :data:`~sftpack.offline._format.IMAGE_DTYPE` in row order, as written
            (``pixels``: the offset in ``pixels.npy``; ``sequence``: the output sequence).
        row_images: ``(R+1,)`` int64: row ``r`` holds images ``row_images[r]:row_images[r+1]``.
        row_pixels: ``(R+1,)`` int64: row ``r``'s pixels are bytes ``row_pixels[r]:row_pixels[r+1]``.
    """

    records: np.ndarray
    row_images: np.ndarray
    row_pixels: np.ndarray

    @property
    def pixel_bytes(self) -> int:
        return int(self.row_pixels[-1])


def media_layout(plan: RowPlan, media: StagedMedia) -> MediaLayout:
    """The :class:`MediaLayout` of ``plan`` over the staged ``media`` (each sequence's images in order)."""
    fi = media.first_image
    per_seq = np.diff(fi)[plan.order]
    seq_first = np.zeros(plan.order.shape[0] + 1, np.int64)
    np.cumsum(per_seq, out=seq_first[1:])
    total = int(seq_first[-1])
    src = np.repeat(fi[plan.order] - seq_first[:-1], per_seq) + np.arange(total, dtype=np.int64)
    out = media.records[src].copy()
    nbytes = out["frames"].astype(np.int64) * out["height"] * out["width"] * 3
    first_byte = np.zeros(total + 1, np.int64)
    np.cumsum(nbytes, out=first_byte[1:])
    out["pixels"] = first_byte[:-1]
    out["sequence"] = np.repeat(np.arange(plan.order.shape[0], dtype=np.int64), per_seq)
    row_images = seq_first[plan.row_offsets]
    return MediaLayout(out, row_images, first_byte[row_images])


def _create(path: Path, header: bytes, nbytes: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, header)
        total = len(header) + nbytes
        if nbytes:
            if hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, total)
                except OSError as e:
                    if e.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: the filesystem cannot, so extend below
                        raise
                    os.ftruncate(fd, total)
            else:  # pragma: no cover - non-POSIX
                os.ftruncate(fd, total)
    finally:
        os.close(fd)


def allocate(
    directory: Path, plan: RowPlan, dtype: np.dtype, media: MediaLayout | None = None, *, weighted: bool = False
) -> None:
    """Create ``tokens.npy`` (``dtype``) and ``loss_mask.npy`` (bool) at full size, with
    ``media`` the media columns ``pixels.npy`` (uint8) and ``images.npy`` (one record an image),
    and with ``weighted`` ``weights.npy`` (float64, one a token)."""
    n = plan.num_tokens
    _create(directory / "tokens.npy", npy_header(dtype, n), n * np.dtype(dtype).itemsize)
    _create(directory / "loss_mask.npy", npy_header(np.bool_, n), n)
    if weighted:
        _create(directory / WEIGHTS_FILE, npy_header(np.float64, n), n * 8)
    if media is not None:
        i = media.records.shape[0]
        _create(directory / "pixels.npy", npy_header(np.uint8, media.pixel_bytes), media.pixel_bytes)
        _create(directory / "images.npy", npy_header(IMAGE_DTYPE, i), i * IMAGE_DTYPE.itemsize)


def row_chunks(
    plan: RowPlan,
    rows: tuple[int, int] | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    media: MediaLayout | None = None,
) -> list[tuple[int, int]]:
    """Split rows ``[a, b)`` into consecutive ranges of about ``chunk_tokens`` tokens each (and,
    with ``media``, at most about :data:`CHUNK_PIXEL_BYTES` of pixels)."""
    a, b = rows if rows is not None else (0, plan.num_rows)
    if a >= b:
        return []
    tok = plan.row_token_offsets()
    out = []
    start = a
    while start < b:
        end = int(np.searchsorted(tok, tok[start] + chunk_tokens, side="right")) - 1
        if media is not None:
            px = media.row_pixels
            end = min(end, int(np.searchsorted(px, px[start] + CHUNK_PIXEL_BYTES, side="right")) - 1)
        end = min(max(end, start + 1), b)
        out.append((start, end))
        start = end
    return out


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def write_rows(
    directory: Path,
    plan: RowPlan,
    source: TokenSource,
    dtype: np.dtype,
    *,
    rows: tuple[int, int] | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    on_chunk: Callable[[int], None] | None = None,
    media: MediaLayout | None = None,
) -> None:
    """Fill the tokens and masks of rows ``[a, b)`` (default: all) into the allocated files.

    Args:
        directory: where :func:`allocate` created the files.
        plan: the :class:`RowPlan`.
        source: a token source (``gather(sample_indices) -> (ids, mask)``; with ``media``
            also ``gather_pixels(sample_indices)``).
        dtype: the token dtype :func:`allocate` used.
        rows: the row range to write.
        chunk_tokens: tokens gathered and written per step.
        on_chunk: called with the number of rows after each chunk (progress).
        media: the rows' images (:func:`media_layout`): their pixels and records are written too.
    """
    dtype = np.dtype(dtype)
    n = plan.num_tokens
    tok_header = len(npy_header(dtype, n))
    mask_header = len(npy_header(np.bool_, n))
    tok_off = plan.row_token_offsets()
    fd_t = os.open(directory / "tokens.npy", os.O_WRONLY)
    fd_m = os.open(directory / "loss_mask.npy", os.O_WRONLY)
    fd_w = os.open(directory / WEIGHTS_FILE, os.O_WRONLY) if getattr(source, "weighted", False) else None
    w_header = len(npy_header(np.float64, n))
    media_files = _MediaFiles(directory, media) if media is not None else None
    try:
        for a, b in row_chunks(plan, rows, chunk_tokens, media):
            samples = plan.order[plan.row_offsets[a] : plan.row_offsets[b]]
            ids, mask = source.gather(samples)
            expected = int(tok_off[b] - tok_off[a])
            if ids.shape[0] != expected or mask.shape[0] != expected:
                raise RuntimeError(
                    f"the token source returned {ids.shape[0]} tokens for rows {a}..{b - 1}, the plan expects "
                    f"{expected}: the source does not match the lengths the plan was made from"
                )
            _pwrite_all(
                fd_t,
                np.ascontiguousarray(ids, dtype=dtype).view(np.uint8),
                tok_header + int(tok_off[a]) * dtype.itemsize,
            )
            _pwrite_all(fd_m, np.ascontiguousarray(mask, dtype=np.bool_).view(np.uint8), mask_header + int(tok_off[a]))
            if fd_w is not None:
                w = np.ascontiguousarray(source.gather_weights(samples), dtype=np.float64)  # type: ignore[attr-defined]
                if w.shape[0] != expected:
                    raise RuntimeError(
                        f"the token source returned {w.shape[0]} weights for rows {a}..{b - 1}, the plan expects "
                        f"{expected}: the source does not match the lengths the plan was made from"
                    )
                _pwrite_all(fd_w, w.view(np.uint8), w_header + int(tok_off[a]) * 8)
            if media_files is not None:
                media_files.write(a, b, source, samples)
            if on_chunk is not None:
                on_chunk(b - a)
        os.fsync(fd_t)
        os.fsync(fd_m)
        if fd_w is not None:
            os.fsync(fd_w)
        if media_files is not None:
            media_files.sync()
    finally:
        os.close(fd_t)
        os.close(fd_m)
        if fd_w is not None:
            os.close(fd_w)
        if media_files is not None:
            media_files.close()


class _MediaFiles:
    """The media columns open for positioned writes (:func:`write_rows` with ``media``)."""

    def __init__(self, directory: Path, media: MediaLayout):
        self.media = media
        self.px_header = len(npy_header(np.uint8, media.pixel_bytes))
        self.rec_header = len(npy_header(IMAGE_DTYPE, media.records.shape[0]))
        self.fd_p = os.open(directory / "pixels.npy", os.O_WRONLY)
        self.fd_i = os.open(directory / "images.npy", os.O_WRONLY)

    def write(self, a: int, b: int, source: TokenSource, samples: np.ndarray) -> None:
        m = self.media
        pixels = source.gather_pixels(samples)  # type: ignore[attr-defined]
        expected = int(m.row_pixels[b] - m.row_pixels[a])
        if pixels.shape[0] != expected:
            raise RuntimeError(
                f"the token source returned {pixels.shape[0]} pixel bytes for rows {a}..{b - 1}, the plan expects "
                f"{expected}: the source does not match the images the plan was made from"
            )
        _pwrite_all(self.fd_p, np.ascontiguousarray(pixels, dtype=np.uint8), self.px_header + int(m.row_pixels[a]))
        i0, i1 = int(m.row_images[a]), int(m.row_images[b])
        records = np.ascontiguousarray(m.records[i0:i1]).view(np.uint8)
        _pwrite_all(self.fd_i, records, self.rec_header + i0 * IMAGE_DTYPE.itemsize)

    def sync(self) -> None:
        os.fsync(self.fd_p)
        os.fsync(self.fd_i)

    def close(self) -> None:
        os.close(self.fd_p)
        os.close(self.fd_i)


def _write_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(npy_header(arr.dtype, arr.shape[0]))
        f.write(np.ascontiguousarray(arr).tobytes())
        f.flush()
        os.fsync(f.fileno())


def write_index(
    directory: Path,
    plan: RowPlan,
    *,
    conversation: np.ndarray,
    piece: np.ndarray,
    conversation_offsets: np.ndarray,
    conversation_ids: Path | bytes,
    media: MediaLayout | None = None,
    roles: np.ndarray | None = None,
) -> None:
    """Write ``sequences.npy``, ``rows.npy``, ``conversation_ids.npy`` and ``conversation_offsets.npy``
    (and with ``media``, ``row_images.npy``; with ``roles``, each input sample's role in its
    preference pair, ``roles.npy`` in row order).

    ``conversation`` / ``piece`` are per *input* sample (reordered here by the
    plan); ``conversation_ids`` is the file (or bytes) of the ids' UTF-8 JSON
    laid end to end, ``conversation_offsets`` the ``(C+1,)`` byte offsets into it.
    """
    seq = np.zeros(plan.order.shape[0], SEQUENCE_DTYPE)
    seq["start"] = plan.starts
    seq["length"] = plan.lengths
    seq["conversation"] = np.asarray(conversation, np.int64)[plan.order]
    seq["piece"] = np.asarray(piece, np.int32)[plan.order]
    _write_npy(directory / "sequences.npy", seq)
    rows = np.zeros(plan.num_rows + 1, ROW_DTYPE)
    rows["sequence"] = plan.row_offsets
    rows["token"] = plan.row_token_offsets()
    _write_npy(directory / "rows.npy", rows)
    offsets = np.asarray(conversation_offsets, np.int64)
    blob_len = int(offsets[-1])
    with open(directory / "conversation_ids.npy", "wb") as f:
        f.write(npy_header(np.uint8, blob_len))
        if isinstance(conversation_ids, (bytes, bytearray)):
            f.write(conversation_ids)
        else:
            with open(conversation_ids, "rb") as src:
                while chunk := src.read(1 << 22):
                    f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    if os.path.getsize(directory / "conversation_ids.npy") != len(npy_header(np.uint8, blob_len)) + blob_len:
        raise RuntimeError("conversation ids: the staged id file does not match its offsets")
    _write_npy(directory / "conversation_offsets.npy", offsets)
    if media is not None:
        _write_npy(directory / "row_images.npy", np.asarray(media.row_images, np.int64))
    if roles is not None:
        _write_npy(directory / ROLES_FILE, np.asarray(roles, np.uint8)[plan.order])
