"""The media fields of a row with images: their names, their checks and their concatenation.

A row built from samples with images (:mod:`sftpack.multimodal`) carries, next to the
six boundary fields, the pixels and where each image's placeholder run lies
(:data:`MEDIA_FIELDS`), and on a patch-sequence vision tower with multimodal
positions (Qwen2-VL) the patch grid, the vision boundaries and the MRoPE positions
too (:data:`PATCH_MEDIA_FIELDS`). A text row has none of them.

- :func:`check_pixel_values`: usable pixels (layout, dtype, finite), for a row and
  for a sample alike.
- :func:`validate_media`: the media part of :meth:`PackedBatch.validate`.
- :func:`concat_media`: the media part of :meth:`PackedBatch.concat`.

The functions read a row through :class:`MediaRow` (what a :class:`~sftpack.PackedBatch`
has), so this module sits below :mod:`sftpack.handoff.batch` and never imports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from .errors import PackedBatchError

__all__ = ["MEDIA_FIELDS", "PATCH_MEDIA_FIELDS", "MediaRow", "check_pixel_values", "concat_media", "validate_media"]

#: The media fields of any row with images: all set, or all ``None`` (a text row).
MEDIA_FIELDS = ("pixel_values", "image_slots", "image_sequence", "image_token_id")
#: The fields of a patch-sequence vision tower with multimodal positions (Qwen2-VL): all set,
#: or all ``None`` (a LLaVA-style row: one fixed-size pixel tensor per image, 1-D positions).
PATCH_MEDIA_FIELDS = ("mrope_position_ids", "image_grid_thw", "vision_cu_seqlens", "spatial_merge_size")


#: What pixel values may be: float32 (what the image processors make) or a half type a tower runs in.
_PIXEL_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), torch.float32, torch.float16, torch.bfloat16}


def _is_patch_width(d: int) -> bool:
    """``d == 3 * t * p * p`` for a temporal patch ``t`` of 1 or 2 and an integer patch side ``p``."""
    return d % 3 == 0 and any(d // 3 % t == 0 and math.isqrt(d // 3 // t) ** 2 == d // 3 // t for t in (1, 2))


def check_pixel_values(
    pv: np.ndarray | torch.Tensor,
    name: str,
    *,
    patches: bool,
    placeholders: bool = False,
    error: type[ValueError] = PackedBatchError,
) -> None:
    """Raise ``error`` (message starting with ``name``) unless ``pv`` are usable pixel values.

    ``patches``: the ``(P, D)`` patch layout of a patch-sequence tower (Qwen2-VL), where a
    patch is ``D = 3 * t * p**2`` values (channels x temporal patch 1 or 2 x a ``p x p``
    patch: 1176 for Qwen2-VL's 14-pixel patches, 1536 for 16-pixel ones); else one
    ``(I, C, H, W)`` tensor per image (LLaVA). ``placeholders``: ``(P, 0)`` is taken too (a
    sample whose pixels travel in a separate buffer). The dtype must be float32, float16 or
    bfloat16 (float64 only doubles every row's pixel memory and its copy to the device:
    the tower casts to its own dtype), and every value finite.

    Finite is checked by one float32 sum (NaN and inf propagate through it): a full
    ``isfinite`` pass costs ~15x more on CPU (about 1 ms vs 70 ms for a 4096 x 1176 row,
    one core); the element-wise search runs only when the sum is not finite.
    """
    dtype = pv.dtype
    if dtype not in _PIXEL_DTYPES:
        cast = ".astype(np.float32)" if isinstance(pv, np.ndarray) else ".float()"
        raise error(
            f"{name} must be floating point: float32 (what the image processor makes), float16 or bfloat16, got "
            f"{dtype}; cast with {cast} (the vision tower casts to its own dtype, so float64 would only double "
            "the pixels' memory and their copy to the device)"
        )
    shape = tuple(pv.shape)
    if patches:
        if len(shape) != 2:
            raise error(f"{name} must be (patches, patch width), got shape {shape}")
        if not _is_patch_width(shape[1]) and not (placeholders and shape[1] == 0):
            raise error(
                f"{name} has patches of width {shape[1]}: a patch is 3 channels x temporal patch (1 or 2) x "
                "patch side**2 values (1176 for Qwen2-VL's 14-pixel patches and temporal patch 2, 1536 for "
                "16-pixel ones); pass the image processor's pixel_values, one row per patch"
            )
    elif len(shape) != 4:
        raise error(f"{name} must be (images, channels, height, width), got shape {shape}")
    if isinstance(pv, np.ndarray):
        if np.isfinite(pv.sum(dtype=np.float32)):
            return
        bad = np.argwhere(~np.isfinite(pv))
    else:
        if bool(torch.isfinite(pv.sum(dtype=torch.float32))):
            return
        bad = torch.nonzero(~torch.isfinite(pv)).cpu().numpy()
    if not len(bad):
        raise error(f"{name} sums to more than float32 holds: pixel values are normalised, of magnitude ~1")
    at = tuple(int(i) for i in bad[0])
    raise error(
        f"{name}[{', '.join(map(str, at))}] = {float(pv[at])}: pixel values must be finite ({len(bad)} are not); "
        "check the image and the processor's normalisation (image_std of 0?)"
    )


class MediaRow(Protocol):
    """What the media checks and the concatenation read of a row: a :class:`~sftpack.PackedBatch`."""

    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def mrope_position_ids(self) -> torch.Tensor | None: ...
    @property
    def pixel_values(self) -> torch.Tensor | None: ...
    @property
    def image_grid_thw(self) -> torch.Tensor | None: ...
    @property
    def vision_cu_seqlens(self) -> torch.Tensor | None: ...
    @property
    def image_slots(self) -> torch.Tensor | None: ...
    @property
    def image_sequence(self) -> torch.Tensor | None: ...
    @property
    def image_token_id(self) -> int | None: ...
    @property
    def spatial_merge_size(self) -> int | None: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def has_media(self) -> bool: ...


def validate_media(row: MediaRow, cu_h: np.ndarray, cup_h: np.ndarray) -> None:
    """Check the media fields of ``row`` (nothing on a text row); ``cu_h`` / ``cup_h`` are its
    boundaries on the host as int64 (:meth:`PackedBatch.validate` checked them already).
    Raise :class:`PackedBatchError` naming the field and the numbers."""
    present = [name for name in MEDIA_FIELDS + PATCH_MEDIA_FIELDS if getattr(row, name) is not None]
    if not present:
        return
    missing = [name for name in MEDIA_FIELDS if getattr(row, name) is None]
    patch = [name for name in PATCH_MEDIA_FIELDS if getattr(row, name) is not None]
    if missing or (patch and len(patch) != len(PATCH_MEDIA_FIELDS)):
        missing += [name for name in PATCH_MEDIA_FIELDS if patch and getattr(row, name) is None]
        raise PackedBatchError(
            f"PackedBatch has media fields {present} but not {missing}: a row with media carries all of "
            f"{list(MEDIA_FIELDS)}, and either all or none of {list(PATCH_MEDIA_FIELDS)} (build it with "
            "sftpack.multimodal.build_multimodal_row, or set a LlavaRow's media on its batch)"
        )
    if not patch:
        _validate_image_media(row, cu_h, cup_h)
        return
    T = row.num_tokens
    mrope = row.mrope_position_ids
    pv, grid, vcu = row.pixel_values, row.image_grid_thw, row.vision_cu_seqlens
    slots, seq = row.image_slots, row.image_sequence
    assert mrope is not None and pv is not None and grid is not None and vcu is not None
    assert slots is not None and seq is not None
    for name, t, shape, dtype in (
        ("mrope_position_ids", mrope, (3, T), torch.int64),
        ("image_grid_thw", grid, (None, 3), torch.int64),
        ("vision_cu_seqlens", vcu, (None,), torch.int32),
        ("image_slots", slots, (None, 2), torch.int64),
        ("image_sequence", seq, (None,), torch.int64),
        ("pixel_values", pv, (None, None), None),
    ):
        if not isinstance(t, torch.Tensor):
            raise PackedBatchError(f"PackedBatch.{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
            raise PackedBatchError(f"PackedBatch.{name} must have shape {want}, got {tuple(t.shape)}")
        if dtype is not None and t.dtype != dtype:
            raise PackedBatchError(f"PackedBatch.{name} must be {dtype}, got {t.dtype}")
    check_pixel_values(pv, "PackedBatch.pixel_values", patches=True)
    devices = {t.device for t in (row.input_ids, mrope, pv, grid, vcu)}
    if len(devices) > 1:
        raise PackedBatchError(
            f"PackedBatch media tensors are on several devices {sorted(map(str, devices))}: call .to(device)"
        )
    n_img = grid.shape[0]
    if slots.shape[0] != n_img or seq.shape[0] != n_img:
        raise PackedBatchError(
            f"PackedBatch: image_grid_thw holds {n_img} images but image_slots {slots.shape[0]} and "
            f"image_sequence {seq.shape[0]}: one entry per image in each"
        )
    if not isinstance(row.image_token_id, (int, np.integer)) or isinstance(row.image_token_id, bool):
        raise PackedBatchError(f"PackedBatch.image_token_id must be an int, got {row.image_token_id!r}")
    merge = row.spatial_merge_size
    if isinstance(merge, bool) or not isinstance(merge, (int, np.integer)) or merge < 1:
        raise PackedBatchError(f"PackedBatch.spatial_merge_size must be an int >= 1, got {merge!r}")
    g = grid.cpu().numpy()
    if n_img and int(g.min()) < 1:
        i = int(np.flatnonzero(g.min(axis=1) < 1)[0])
        raise PackedBatchError(f"PackedBatch.image_grid_thw[{i}] = {g[i].tolist()}: every extent must be >= 1")
    per = g.prod(axis=1)
    if int(per.sum()) != pv.shape[0]:
        raise PackedBatchError(
            f"PackedBatch.pixel_values has {pv.shape[0]} patches but image_grid_thw holds {int(per.sum())} "
            "(sum of t*h*w): the patches of every image, in row order"
        )
    frames = np.repeat(g[:, 1] * g[:, 2], g[:, 0])
    want_vcu = np.zeros(len(frames) + 1, dtype=np.int64)
    np.cumsum(frames, out=want_vcu[1:])
    got_vcu = vcu.cpu().numpy().astype(np.int64)
    if not np.array_equal(got_vcu, want_vcu):
        raise PackedBatchError(
            f"PackedBatch.vision_cu_seqlens = {got_vcu.tolist()} but image_grid_thw gives "
            f"{want_vcu.tolist()} (one vision segment per frame: cumsum of h*w, repeated t times)"
        )
    _validate_image_runs(row, cu_h, cup_h, per // (int(merge) ** 2), per % (int(merge) ** 2), g)
    m = mrope.cpu().numpy()
    starts = cup_h[:-1]
    bad = np.flatnonzero(m[:, starts].any(axis=0))
    if bad.size:
        k = int(bad[0])
        raise PackedBatchError(
            f"PackedBatch.mrope_position_ids[:, {int(starts[k])}] = {m[:, starts[k]].tolist()} at the start "
            f"of segment {k}: multimodal positions restart at 0 for each sequence"
        )


def _validate_image_media(row: MediaRow, cu_h: np.ndarray, cup_h: np.ndarray) -> None:
    """A row whose images are one fixed-size pixel tensor each (LLaVA-style: no patch grid, no
    multimodal positions): ``pixel_values`` ``(I, C, H, W)``, every image's run one length."""
    pv, slots, seq = row.pixel_values, row.image_slots, row.image_sequence
    assert pv is not None and slots is not None and seq is not None
    for name, t, shape, dtype in (
        ("pixel_values", pv, (None, None, None, None), None),
        ("image_slots", slots, (None, 2), torch.int64),
        ("image_sequence", seq, (None,), torch.int64),
    ):
        if not isinstance(t, torch.Tensor):
            raise PackedBatchError(f"PackedBatch.{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
            raise PackedBatchError(
                f"PackedBatch.{name} must have shape {want} on a row without image_grid_thw (one pixel "
                f"tensor per image), got {tuple(t.shape)}"
            )
        if dtype is not None and t.dtype != dtype:
            raise PackedBatchError(f"PackedBatch.{name} must be {dtype}, got {t.dtype}")
    check_pixel_values(pv, "PackedBatch.pixel_values", patches=False)
    if not isinstance(row.image_token_id, (int, np.integer)) or isinstance(row.image_token_id, bool):
        raise PackedBatchError(f"PackedBatch.image_token_id must be an int, got {row.image_token_id!r}")
    devices = {t.device for t in (row.input_ids, pv, slots, seq)}
    if len(devices) > 1:
        raise PackedBatchError(
            f"PackedBatch media tensors are on several devices {sorted(map(str, devices))}: call .to(device)"
        )
    n_img = slots.shape[0]
    if pv.shape[0] != n_img or seq.shape[0] != n_img:
        raise PackedBatchError(
            f"PackedBatch: pixel_values holds {pv.shape[0]} images but image_slots {n_img} and "
            f"image_sequence {seq.shape[0]}: one entry per image in each"
        )
    lens = slots[:, 1].cpu().numpy()
    same = np.full(n_img, int(lens[0]) if n_img else 0, dtype=np.int64)
    _validate_image_runs(row, cu_h, cup_h, same, np.zeros(n_img, dtype=np.int64), None)


def _validate_image_runs(
    row: MediaRow, cu_h: np.ndarray, cup_h: np.ndarray, want: np.ndarray, rem: np.ndarray, grid: np.ndarray | None
) -> None:
    """Each image's run: ``want[i]`` slots of ``image_token_id`` (``rem[i]`` must be 0), inside its
    segment's real tokens, in row order; every image token in exactly one run."""
    T = row.num_tokens
    slots, seq = row.image_slots, row.image_sequence
    assert slots is not None and seq is not None
    n_img = int(slots.shape[0])
    ids_h = row.input_ids.cpu().numpy()
    is_img: np.ndarray = np.equal(ids_h, int(row.image_token_id))  # type: ignore[arg-type]
    marked = np.zeros(T, dtype=bool)
    real = np.diff(cu_h)
    n_seq = len(real)
    sl, sq = slots.cpu().numpy(), seq.cpu().numpy()
    if n_img > 1 and bool((np.diff(sl[:, 0]) <= 0).any()):
        i = int(np.flatnonzero(np.diff(sl[:, 0]) <= 0)[0]) + 1
        raise PackedBatchError(
            f"PackedBatch.image_slots[{i}] starts at {int(sl[i, 0])}, not after image {i - 1} at "
            f"{int(sl[i - 1, 0])}: images (and their patches) are in row order"
        )
    for i in range(n_img):
        s, n, k = int(sl[i, 0]), int(sl[i, 1]), int(sq[i])
        if n != int(want[i]) or int(rem[i]):
            why = (
                f"its grid {grid[i].tolist()} gives t*h*w/spatial_merge_size**2"
                if grid is not None
                else f"every image of a row without image_grid_thw takes the same {int(want[i])}"
            )
            raise PackedBatchError(f"PackedBatch.image_slots[{i}] has {n} placeholders but {why}")
        if not 0 <= k < n_seq:
            raise PackedBatchError(f"PackedBatch.image_sequence[{i}] = {k}, not a segment of N={n_seq}")
        a, e = int(cup_h[k]), int(cup_h[k] + real[k])
        if not (a <= s and s + n <= e) or not bool(is_img[s : s + n].all()):
            raise PackedBatchError(
                f"PackedBatch.image_slots[{i}] = [{s}, {s + n}) is not a run of image_token_id "
                f"{row.image_token_id} inside the real tokens [{a}, {e}) of segment {k}"
            )
        marked[s : s + n] = True
    stray = np.flatnonzero(is_img & ~marked)
    if stray.size:
        raise PackedBatchError(
            f"PackedBatch.input_ids[{int(stray[0])}] is the image token {row.image_token_id} but lies in no "
            "image_slots run: every placeholder belongs to exactly one image"
        )


def concat_media(batches: Sequence[MediaRow]) -> dict[str, Any]:
    """The media fields of rows laid end to end: patches, grids and MRoPE appended in
    order; image slots, image segments and vision boundaries shifted by the rows before."""
    with_media = [b.has_media for b in batches]
    if not any(with_media):
        return {}
    if not all(with_media):
        i = with_media.index(False)
        raise PackedBatchError(
            f"PackedBatch.concat: row {i} has no media fields but row {with_media.index(True)} has; build every "
            "row of a multimodal batch with sftpack.multimodal.build_multimodal_row (a row without images "
            "then carries empty media)"
        )
    patches = {b.image_grid_thw is not None for b in batches}
    if len(patches) != 1:
        raise PackedBatchError(
            "PackedBatch.concat: some rows carry patch media (image_grid_thw, Qwen2-VL) and some one pixel "
            "tensor per image (LLaVA): rows of one batch come from one model family"
        )
    for name in ("image_token_id", "spatial_merge_size"):
        vals = {getattr(b, name) for b in batches}
        if len(vals) != 1:
            raise PackedBatchError(f"PackedBatch.concat: the rows use different {name} values {sorted(vals)}")
    slots, seqs = [], []
    vcus = [batches[0].vision_cu_seqlens]
    t_off = n_off = 0
    for b in batches:
        assert b.image_slots is not None and b.image_sequence is not None
        shift = torch.tensor([t_off, 0], dtype=b.image_slots.dtype, device=b.image_slots.device)
        slots.append(b.image_slots + shift)
        seqs.append(b.image_sequence + n_off)
        t_off += b.num_tokens
        n_off += b.num_sequences
    out: dict[str, Any] = {
        "pixel_values": torch.cat([b.pixel_values for b in batches]),  # type: ignore[misc]
        "image_slots": torch.cat(slots),
        "image_sequence": torch.cat(seqs),
        "image_token_id": batches[0].image_token_id,
    }
    if not patches.pop():  # LLaVA-style: no grid, no vision boundaries, 1-D positions
        return out
    v_off = batches[0].vision_cu_seqlens[-1:]  # type: ignore[index]
    for b in batches[1:]:
        assert b.vision_cu_seqlens is not None
        vcus.append(b.vision_cu_seqlens[1:] + v_off)
        v_off = v_off + b.vision_cu_seqlens[-1:]
    return {
        **out,
        "mrope_position_ids": torch.cat([b.mrope_position_ids for b in batches], dim=1),  # type: ignore[misc]
        "image_grid_thw": torch.cat([b.image_grid_thw for b in batches]),  # type: ignore[misc]
        "vision_cu_seqlens": torch.cat(vcus),  # type: ignore[arg-type]
        "spatial_merge_size": batches[0].spatial_merge_size,
    }
