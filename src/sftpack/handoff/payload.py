"""Media as one payload of a sample and of a row: :class:`Media`, :class:`PatchMedia`, :class:`ImageMedia`.

A sample or a row that carries media (images; on :class:`PatchMedia` also videos, patch
grids with ``t >= 1`` under their own placeholder) carries one object, ``sample.media`` /
``batch.media``, next to its tokens.
The object holds its items in order, each with its run of placeholder tokens, and knows
everything the paths and the consumers ask of media:

- :meth:`Media.check`: validate itself against the tokens it belongs to (a sample's,
  or a row's with its boundaries), one message naming the field and the numbers;
- :meth:`Media.lay`: concatenate in row order (samples into a row, rows into a flat
  run: one operation, shifting each part's runs and segments, and continuing each
  part's multimodal positions through its padding);
- :meth:`Media.piece`: the media of a piece of a split sample;
- :meth:`Media.to` / :meth:`Media.pin_memory`: move devices;
- :attr:`Media.vision_cu_seqlens`: the vision tower's per-item boundaries;
- :meth:`Media.hf_kwargs`: its part of :meth:`~sftpack.PackedBatch.to_hf_kwargs`.

Two kinds, by what the vision tower eats (a model family picks one, see
:mod:`sftpack.multimodal`):

- :class:`PatchMedia`: a patch-sequence tower (Qwen2-VL, Qwen2.5-VL): ``pixel_values``
  ``(P, D)`` patches of every item, each item's ``(t, h, w)`` patch grid, the merge
  window side, and optional multimodal positions ``(3, L)`` (MRoPE; ``None``: the
  model uses 1-D positions);
- :class:`ImageMedia`: one fixed-size pixel tensor per image (LLaVA): ``pixel_values``
  ``(I, C, H, W)``, every image's run one length.

Every field is a torch tensor, on a sample too (``torch.from_numpy`` shares the
memory); ``slots`` are relative to the owner (a sample starts at slot 0) and
``sequence`` names the owner's segment of each item (all 0 on a sample).
:func:`check_pixel_values` is the pixel rule of both kinds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from .errors import PackedBatchError

__all__ = ["ImageMedia", "Media", "PatchMedia", "check_pixel_values"]

#: What pixel values may be: float32 (what the image processors make) or a half type a tower runs in.
_PIXEL_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), torch.float32, torch.float16, torch.bfloat16}

_M = TypeVar("_M", bound="Media")


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
    if isinstance(pv, torch.Tensor) and pv.device.type == "cpu":
        # numpy on the host's tensors: a torch reduction may hang in a process forked after
        # the parent used OpenMP threads (sample media is built in forked tokenizer workers)
        pv = pv.numpy() if pv.dtype != torch.bfloat16 else pv
    if isinstance(pv, torch.Tensor) and pv.dtype == torch.bfloat16 and pv.device.type == "cpu":
        exponent = pv.contiguous().view(torch.int16).numpy() & 0x7F80  # all ones: inf or NaN
        bad = np.argwhere(exponent == 0x7F80)
        if not len(bad):
            return
    elif isinstance(pv, np.ndarray):
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


def _tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return t.to(dtype) if dtype is not None and t.dtype != dtype else t


def _check_shape(name: str, t: Any, shape: tuple[int | None, ...], dtype: torch.dtype | None, error: type) -> None:
    if not isinstance(t, torch.Tensor):
        raise error(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape)):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
        raise error(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise error(f"{name} must be {dtype}, got {t.dtype}")


def map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """A copy of the dataclass ``obj`` with ``fn`` of each of its fields that is a tensor or a
    :class:`Media` (which maps its own): how a row and its media move devices or pin."""
    return replace(
        obj, **{f.name: fn(v) for f in fields(obj) if isinstance(v := getattr(obj, f.name), (torch.Tensor, Media))}
    )


@dataclass(eq=False)
class Media:
    """The media of one sample or one row: items in order, each with its run of placeholder tokens.

    Attributes:
        pixel_values: the items' pixels (layout by kind, see the subclasses).
        slots: ``(I, 2)`` int64: each item's placeholder run ``(start slot, length)`` in the
            owner's tokens, in order.
        sequence: ``(I,)`` int64: the owner's segment each item belongs to (0 on a sample).
        token_id: the placeholder token id (every slot holding it is in exactly one run); a
            kind with several placeholders (:class:`PatchMedia`'s videos) names the others itself.
        hf_refusal: why the model's own Hugging Face forward cannot take a packed row of this
            media, and what runs it instead (``None``: it can). The family that makes the media
            sets it (Gemma 3: its images' two-way attention); a row's media keeps any part's, and
            :meth:`~sftpack.PackedBatch.to_hf_kwargs` refuses with it.
    """

    pixel_values: torch.Tensor
    slots: torch.Tensor
    sequence: torch.Tensor
    token_id: int
    hf_refusal: str | None = None

    #: one word for the kind (what a row's parts must share); set by each subclass
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.slots = _tensor(self.slots, torch.int64).reshape(-1, 2)
        self.sequence = _tensor(self.sequence, torch.int64).reshape(-1)
        self.pixel_values = _tensor(self.pixel_values)

    # ------------------------------------------------------------------ sizes
    @property
    def num_items(self) -> int:
        """``I``: items (images) held."""
        return int(self.slots.shape[0])

    @property
    def num_placeholders(self) -> int:
        """Slots whose embeddings the vision features replace."""
        return int(self.slots[:, 1].sum()) if self.num_items else 0

    @property
    def num_patches(self) -> int:  # pragma: no cover - every kind defines it
        """What the row planner's second budget counts (``--max-patches-per-row``)."""
        raise NotImplementedError

    @property
    def vision_cu_seqlens(self) -> torch.Tensor | None:
        """The vision tower's boundaries (``None`` when it sees one item per batch entry)."""
        return None

    @property
    def device(self) -> torch.device:
        return self.pixel_values.device

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self: _M, device: torch.device | str, non_blocking: bool = False) -> _M:
        """A copy with every tensor on ``device``."""
        return map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self: _M) -> _M:
        return map_tensors(self, lambda t: t.pin_memory())

    # ------------------------------------------------------------- checking
    def check(
        self,
        input_ids: np.ndarray | torch.Tensor,
        cu_seqlens: np.ndarray | None = None,
        cu_seqlens_padded: np.ndarray | None = None,
        *,
        loss_mask: np.ndarray | None = None,
        name: str = "PackedBatch.media",
        error: type[ValueError] = PackedBatchError,
    ) -> None:
        """Validate against the owner's tokens: a sample's (no boundaries: one segment, all real)
        or a row's (``cu_seqlens`` / ``cu_seqlens_padded`` on the host). Raise ``error``
        naming ``name``'s field and the numbers. ``loss_mask`` (a sample's): no placeholder
        may be trainable."""
        ids = input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids)
        T = int(ids.shape[0])
        cu = np.array([0, T]) if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64)
        cup = cu if cu_seqlens_padded is None else np.asarray(cu_seqlens_padded, dtype=np.int64)
        n = self.num_items
        _check_shape(f"{name}.slots", self.slots, (None, 2), torch.int64, error)
        _check_shape(f"{name}.sequence", self.sequence, (n,), torch.int64, error)
        if isinstance(self.token_id, bool) or not isinstance(self.token_id, (int, np.integer)):
            raise error(f"{name}.token_id must be an int, got {self.token_id!r}")
        if self.hf_refusal is not None and not isinstance(self.hf_refusal, str):
            raise error(f"{name}.hf_refusal must be a str or None, got {type(self.hf_refusal).__name__}")
        devices = {t.device for t in self._tensors().values()}
        if isinstance(input_ids, torch.Tensor):
            devices.add(input_ids.device)
        if len(devices) > 1:
            raise error(f"{name} tensors are on several devices {sorted(map(str, devices))}: call .to(device)")
        want = self._check_kind(T, cup, name, error)
        self._check_runs(ids, cu, cup, want, name, error)
        if loss_mask is not None and bool((np.asarray(loss_mask) & np.isin(ids, self._placeholder_ids())).any()):
            raise error(f"{name}: placeholder tokens of an item's run are marked trainable")

    def _check_kind(self, T: int, cup: np.ndarray, name: str, error: type) -> np.ndarray:  # pragma: no cover
        """The kind's own fields; returns each item's required run length."""
        raise NotImplementedError

    def _item_token_ids(self) -> np.ndarray:
        """``(I,)``: the placeholder id of each item's run (by default :attr:`token_id` for all)."""
        return np.full(self.num_items, int(self.token_id), dtype=np.int64)

    def renumbered(self: _M, new_id: Callable[[int], int]) -> _M:
        """The payload with its placeholder id mapped through ``new_id`` (a vocabulary renumbered)."""
        return replace(self, token_id=int(new_id(int(self.token_id))))

    def _placeholder_ids(self) -> list[int]:
        """Every placeholder id of this media (by default :attr:`token_id`)."""
        return [int(self.token_id)]

    def _check_runs(
        self, ids: np.ndarray, cu: np.ndarray, cup: np.ndarray, want: np.ndarray, name: str, error: type
    ) -> None:
        """Each item's run: ``want[i]`` slots of its placeholder (:meth:`_item_token_ids`), inside its
        segment's real tokens, in order; every placeholder in exactly one run."""
        is_ph: np.ndarray = np.isin(ids, self._placeholder_ids())
        own = self._item_token_ids()
        marked = np.zeros(ids.shape[0], dtype=bool)
        real = np.diff(cu)
        sl, sq = self.slots.cpu().numpy(), self.sequence.cpu().numpy()
        if self.num_items > 1 and bool((np.diff(sl[:, 0]) <= 0).any()):
            i = int(np.flatnonzero(np.diff(sl[:, 0]) <= 0)[0]) + 1
            raise error(
                f"{name}.slots[{i}] starts at {int(sl[i, 0])}, not after item {i - 1} at {int(sl[i - 1, 0])}: "
                "items (and their pixels) are in row order"
            )
        for i in range(self.num_items):
            s, n, k = int(sl[i, 0]), int(sl[i, 1]), int(sq[i])
            if n != int(want[i]):
                raise error(f"{name}.slots[{i}] has {n} placeholders but {self._why(i, int(want[i]))}")
            if not 0 <= k < len(real):
                raise error(f"{name}.sequence[{i}] = {k}, not a segment of N={len(real)}")
            a, e = int(cup[k]), int(cup[k] + real[k])
            if not (a <= s and s + n <= e) or not bool((ids[s : s + n] == own[i]).all()):
                raise error(
                    f"{name}.slots[{i}] = [{s}, {s + n}) is not a run of placeholder {int(own[i])} inside the "
                    f"real tokens [{a}, {e}) of segment {k}"
                )
            marked[s : s + n] = True
        stray = np.flatnonzero(is_ph & ~marked)
        if stray.size:
            raise error(
                f"{name}: slot {int(stray[0])} holds the placeholder {int(ids[stray[0]])} but lies in no item's run: "
                "every placeholder belongs to exactly one item"
            )

    def _why(self, i: int, want: int) -> str:  # pragma: no cover - every kind defines it
        raise NotImplementedError

    # ---------------------------------------------------------- row order
    @classmethod
    def lay(
        cls: type[_M],
        parts: Sequence[_M | None],
        *,
        lengths: Sequence[int],
        offsets: Sequence[int],
        widths: Sequence[int],
        segments: Sequence[int],
    ) -> _M:
        """Parts (of samples into a row, or of rows into a flat run) laid end to end.

        Part ``k`` starts at slot ``offsets[k]``, spans ``widths[k]`` slots of which its first
        ``lengths[k]`` are its own tokens (the rest its padding), and holds ``segments[k]``
        segments. ``None`` is a part without media (a text-only sample: its multimodal
        positions, if the kind has them, are 1-D ``0, 1, ...``). Items keep their order;
        runs move by the part's offset, segments by the segments before."""
        real = [p for p in parts if p is not None]
        if not real:
            raise PackedBatchError("Media.lay needs at least one part with media")
        first = real[0]
        for q in real:
            if type(q) is not type(first):
                raise PackedBatchError(
                    f"Media.lay: parts of kinds {type(first).__name__} and {type(q).__name__}: one row feeds one "
                    "vision tower, so its samples come from one model family"
                )
            if q.token_id != first.token_id:
                raise PackedBatchError(f"Media.lay: parts use placeholder ids {first.token_id} and {q.token_id}")
        slots, seqs, seg_off = [], [], 0
        for p, off, nseg in zip(parts, offsets, segments):
            if p is not None:
                slots.append(p.slots + torch.tensor([int(off), 0], dtype=torch.int64, device=p.slots.device))
                seqs.append(p.sequence + seg_off)
            seg_off += int(nseg)
        refusal = next((p.hf_refusal for p in real if p.hf_refusal is not None), None)
        return first._join(  # type: ignore[return-value]
            real,
            parts,
            (lengths, offsets, widths),
            slots=torch.cat(slots),
            sequence=torch.cat(seqs),
            hf_refusal=refusal,
        )

    def _join(
        self, real: Sequence[Any], parts: Sequence[Any], geometry: tuple, **laid: Any
    ) -> Media:  # pragma: no cover
        """:meth:`lay` of this kind: the parts' own fields joined (``geometry``: :meth:`lay`'s
        ``lengths``, ``offsets`` and ``widths``), with the ``laid`` slots and sequence."""
        raise NotImplementedError

    def piece(self: _M, start: int, stop: int) -> _M:
        """The media of a sample's tokens ``[start, stop)`` alone (a piece of a split sample): the
        items whose runs lie inside, runs moved to the piece, and multimodal positions as the
        piece tokenized alone would have them. ``start`` must be a text token (never inside a
        run), where every position row holds the same value; the position rules of the
        families here advance from there by the same steps whatever came before, so the
        piece's positions are the sample's minus that value."""
        sl = self.slots
        keep = ((sl[:, 0] >= start) & (sl[:, 0] + sl[:, 1] <= stop)).nonzero().flatten()
        inside = ((sl[:, 0] < stop) & (sl[:, 0] + sl[:, 1] > start)).nonzero().flatten()
        if inside.shape[0] != keep.shape[0]:
            raise ValueError(f"Media.piece({start}, {stop}) cuts through an item's placeholder run")
        own = self._piece(keep, start, stop)
        shift = torch.tensor([start, 0], dtype=torch.int64, device=sl.device)
        return replace(self, slots=sl[keep] - shift, sequence=self.sequence[keep], **own)

    def _piece(self, keep: torch.Tensor, start: int, stop: int) -> dict[str, Any]:  # pragma: no cover
        """The kind's own fields of :meth:`piece`'s items ``keep`` (its ``slots`` and ``sequence``: the base's)."""
        raise NotImplementedError

    # ------------------------------------------------------------ consumers
    def hf_kwargs(self, position_ids: torch.Tensor) -> dict[str, Any]:  # pragma: no cover - every kind defines it
        """This media's part of :meth:`~sftpack.PackedBatch.to_hf_kwargs`, given the row's 1-D
        ``position_ids``: the pixel inputs (when there are items) and, where the kind has its
        own positions, the ``position_ids`` that replace the text ones."""
        raise NotImplementedError


@dataclass(eq=False)
class PatchMedia(Media):
    """Media for a patch-sequence vision tower (Qwen2-VL, Qwen2.5-VL): images and videos.

    Items are images or videos, in row order; a video is a grid of ``t`` temporal slices
    (each ``temporal_patch`` frames), its run of its own placeholder ``video_token_id``. The
    tower runs over all items at once (its attention never crosses a frame); the model takes
    the image items' features at its image placeholders and the videos' at its video ones.

    Attributes (beyond :class:`Media`'s):
        pixel_values: ``(P, D)`` float32 (float16, bfloat16): every item's patches in order;
            ``D = 3 * t * p**2`` (1176 on Qwen2-VL).
        grid_thw: ``(I, 3)`` int64: each item's ``(t, h, w)`` patch grid (``P = sum(t*h*w)``).
        merge_size: the tower's merge window side: an item's run is ``t*h*w / merge_size**2``.
        positions: ``(3, L)`` int64 multimodal positions (MRoPE: temporal, height, width) of the
            owner's slots, each segment's starting at 0 and its padding continuing from its
            largest position; ``None``: the model takes 1-D positions.
        video: ``(I,)`` bool: which items are videos (default none).
        video_token_id: the videos' placeholder id (``None`` when no item is a video; parts laid
            into one row must agree on it).
        second_per_grid_ts: ``(I,)`` float32: seconds each temporal slice of a video spans
            (``temporal_patch / sampled fps``; 0 for images), what Qwen2.5-VL spaces its
            temporal positions by (already in ``positions``; kept for the model's own forward).
    """

    grid_thw: torch.Tensor = None  # type: ignore[assignment]
    merge_size: int = 2
    positions: torch.Tensor | None = None
    video: torch.Tensor = None  # type: ignore[assignment]
    video_token_id: int | None = None
    second_per_grid_ts: torch.Tensor = None  # type: ignore[assignment]

    kind: ClassVar[str] = "patches"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.grid_thw = _tensor(np.zeros((0, 3), np.int64) if self.grid_thw is None else self.grid_thw, torch.int64)
        self.grid_thw = self.grid_thw.reshape(-1, 3)
        if self.positions is not None:
            self.positions = _tensor(self.positions, torch.int64)
        n, dev = self.slots.shape[0], self.slots.device
        self.video = (
            torch.zeros(n, dtype=torch.bool, device=dev) if self.video is None else _tensor(self.video, torch.bool)
        ).reshape(-1)
        sgt = self.second_per_grid_ts
        self.second_per_grid_ts = (
            torch.zeros(n, dtype=torch.float32, device=dev) if sgt is None else _tensor(sgt, torch.float32)
        ).reshape(-1)

    @property
    def num_videos(self) -> int:
        """Items that are videos."""
        return int(self.video.sum())

    def _item_token_ids(self) -> np.ndarray:
        out = super()._item_token_ids()
        if self.video_token_id is not None:
            out[self.video.cpu().numpy()] = int(self.video_token_id)
        return out

    def _placeholder_ids(self) -> list[int]:
        return [int(self.token_id)] + ([int(self.video_token_id)] if self.video_token_id is not None else [])

    def renumbered(self, new_id: Callable[[int], int]) -> PatchMedia:
        """The payload with its placeholder ids (images' and videos') mapped through ``new_id``."""
        vid = None if self.video_token_id is None else int(new_id(int(self.video_token_id)))
        return replace(self, token_id=int(new_id(int(self.token_id))), video_token_id=vid)

    def by_kind(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``{"image": ..., "video": ...}`` (each kind present): its items' ``(pixel_values,
        grid_thw, index)``, in row order, ``index`` the items' positions among all items."""
        per = self.grid_thw.prod(dim=1)
        out = {}
        for kind, mask in (("image", ~self.video), ("video", self.video)):
            index = mask.nonzero().flatten()
            if index.numel() == 0:
                continue
            if index.numel() == self.num_items:
                out[kind] = (self.pixel_values, self.grid_thw, index)
                continue
            rows = torch.repeat_interleave(mask, per)
            out[kind] = (self.pixel_values[rows], self.grid_thw[index], index)
        return out

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def vision_cu_seqlens(self) -> torch.Tensor:
        """``(F+1,)`` int32: one vision segment per frame (``cumsum`` of ``h * w``, repeated ``t`` times)."""
        g = self.grid_thw
        per = torch.repeat_interleave(g[:, 1] * g[:, 2], g[:, 0])
        out = torch.zeros(per.shape[0] + 1, dtype=torch.int32, device=g.device)
        out[1:] = torch.cumsum(per, 0)
        return out

    def _why(self, i: int, want: int) -> str:
        return f"its grid {self.grid_thw[i].tolist()} gives t*h*w/merge_size**2 = {want}"

    def _check_kind(self, T: int, cup: np.ndarray, name: str, error: type) -> np.ndarray:
        n = self.num_items
        _check_shape(f"{name}.grid_thw", self.grid_thw, (n, 3), torch.int64, error)
        _check_shape(f"{name}.video", self.video, (n,), torch.bool, error)
        _check_shape(f"{name}.second_per_grid_ts", self.second_per_grid_ts, (n,), torch.float32, error)
        vid = self.video_token_id
        if (self.num_videos or vid is not None) and (isinstance(vid, bool) or not isinstance(vid, (int, np.integer))):
            raise error(f"{name}.video_token_id must be an int when an item is a video, got {vid!r}")
        if vid is not None and int(vid) == int(self.token_id):
            raise error(f"{name}.video_token_id {vid} is the image placeholder: videos have their own")
        sgt = self.second_per_grid_ts.cpu().numpy()
        if not bool(np.isfinite(sgt).all()) or bool((sgt < 0).any()):
            raise error(f"{name}.second_per_grid_ts must be finite and >= 0, got {sgt.tolist()}")
        _check_shape(f"{name}.pixel_values", self.pixel_values, (None, None), None, error)
        check_pixel_values(self.pixel_values, f"{name}.pixel_values", patches=True, placeholders=True, error=error)
        merge = self.merge_size
        if isinstance(merge, bool) or not isinstance(merge, (int, np.integer)) or merge < 1:
            raise error(f"{name}.merge_size must be an int >= 1, got {merge!r}")
        g = self.grid_thw.cpu().numpy()
        if n and int(g.min()) < 1:
            i = int(np.flatnonzero(g.min(axis=1) < 1)[0])
            raise error(f"{name}.grid_thw[{i}] = {g[i].tolist()}: every extent must be >= 1")
        per = g.prod(axis=1)
        if int(per.sum()) != self.pixel_values.shape[0]:
            raise error(
                f"{name}.pixel_values has {self.pixel_values.shape[0]} patches but grid_thw holds "
                f"{int(per.sum())} (sum of t*h*w): the patches of every item, in order"
            )
        bad = np.flatnonzero(per % (int(merge) ** 2))
        if bad.size:
            i = int(bad[0])
            raise error(f"{name}.grid_thw[{i}] = {g[i].tolist()}: t*h*w is not a multiple of merge_size**2")
        if self.positions is not None:
            _check_shape(f"{name}.positions", self.positions, (3, T), torch.int64, error)
            m = self.positions.cpu().numpy()
            starts = cup[:-1]
            bad = np.flatnonzero(m[:, starts].any(axis=0))
            if bad.size:
                k = int(bad[0])
                raise error(
                    f"{name}.positions[:, {int(starts[k])}] = {m[:, starts[k]].tolist()} at the start of segment "
                    f"{k}: multimodal positions restart at 0 for each sequence"
                )
        return per // (int(merge) ** 2)

    def _join(
        self, real: Sequence[PatchMedia], parts: Sequence[PatchMedia | None], geometry: tuple, **laid: Any
    ) -> PatchMedia:
        widths = {p.pixel_values.shape[1] for p in real if p.num_patches}
        if len(widths) > 1:
            raise PackedBatchError(
                f"Media.lay: patches of widths {sorted(widths)}: one row feeds one vision tower, whose patches have "
                "one width (3 x temporal patch x patch side**2); tokenize the samples with one image processor"
            )
        merges = {p.merge_size for p in real}
        if len(merges) > 1:
            raise PackedBatchError(f"Media.lay: parts use merge sizes {sorted(merges)}")
        with_pos = {p.positions is not None for p in real}
        if len(with_pos) > 1:
            raise PackedBatchError("Media.lay: some parts carry multimodal positions and some do not")
        positions = None
        if with_pos.pop():
            lengths, offsets, widths_ = geometry
            total = int(offsets[-1]) + int(widths_[-1])
            positions = torch.empty((3, total), dtype=torch.int64, device=self.slots.device)
            for p, L, off, w in zip(parts, lengths, offsets, widths_):
                L, off, w = int(L), int(off), int(w)
                if p is None or p.positions is None:
                    own = torch.arange(L, device=positions.device).expand(3, L)
                else:
                    own = p.positions[:, :L]
                positions[:, off : off + L] = own
                top = int(own.max()) + 1 if L else 0
                positions[:, off + L : off + w] = top + torch.arange(w - L, device=positions.device)
        video_ids = {int(p.video_token_id) for p in real if p.video_token_id is not None}
        if len(video_ids) > 1:
            raise PackedBatchError(f"Media.lay: parts use video placeholder ids {sorted(video_ids)}")
        with_pixels = [p.pixel_values for p in real if p.num_patches] or [self.pixel_values]
        return PatchMedia(
            pixel_values=torch.cat(with_pixels),
            token_id=self.token_id,
            grid_thw=torch.cat([p.grid_thw for p in real]),
            merge_size=self.merge_size,
            positions=positions,
            video=torch.cat([p.video for p in real]),
            video_token_id=video_ids.pop() if video_ids else None,
            second_per_grid_ts=torch.cat([p.second_per_grid_ts for p in real]),
            **laid,
        )

    def _piece(self, keep: torch.Tensor, start: int, stop: int) -> dict[str, Any]:
        per = self.grid_thw.prod(dim=1)
        off = torch.cat([per.new_zeros(1), per.cumsum(0)]).tolist()
        rows = [self.pixel_values[off[i] : off[i + 1]] for i in keep.tolist()]
        positions = None
        if self.positions is not None:
            at = self.positions[:, start]
            if bool((at != at[0]).any()):
                raise ValueError(f"Media.piece: slot {start} is not a text token (positions {at.tolist()})")
            positions = self.positions[:, start:stop] - at[0]
        return {
            "pixel_values": torch.cat(rows) if rows else self.pixel_values[:0],
            "grid_thw": self.grid_thw[keep],
            "positions": positions,
            "video": self.video[keep],
            "second_per_grid_ts": self.second_per_grid_ts[keep],
        }

    def hf_kwargs(self, position_ids: torch.Tensor) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.positions is not None:  # Qwen2-VL's packed form: the text row on top of the three MRoPE rows
            kw["position_ids"] = torch.cat([position_ids[None], self.positions]).unsqueeze(1)
        kinds = self.by_kind()
        if "image" in kinds:
            kw["pixel_values"], kw["image_grid_thw"], _ = kinds["image"]
        if "video" in kinds:  # (second_per_grid_ts only moves positions, which ``positions`` already holds)
            kw["pixel_values_videos"], kw["video_grid_thw"], _ = kinds["video"]
        return kw


@dataclass(eq=False)
class ImageMedia(Media):
    """Media for a tower that sees one fixed-size image per batch entry (LLaVA).

    ``pixel_values`` is ``(I, C, H, W)``: one tensor per image, in order; every image's run
    has one length (the tower's features per image); positions are the text's 1-D ones.
    """

    kind: ClassVar[str] = "images"

    @property
    def num_patches(self) -> int:
        """The vision features of all images (what the tower's activations grow with)."""
        return self.num_placeholders

    def _why(self, i: int, want: int) -> str:
        return f"every image takes the same {want} (one fixed-size image per item)"

    def _check_kind(self, T: int, cup: np.ndarray, name: str, error: type) -> np.ndarray:
        n = self.num_items
        check_pixel_values(self.pixel_values, f"{name}.pixel_values", patches=False, error=error)
        _check_shape(f"{name}.pixel_values", self.pixel_values, (n, None, None, None), None, error)
        first = int(self.slots[0, 1]) if n else 0
        return np.full(n, first, dtype=np.int64)

    def _join(
        self, real: Sequence[ImageMedia], parts: Sequence[ImageMedia | None], geometry: tuple, **laid: Any
    ) -> ImageMedia:
        shapes = {tuple(p.pixel_values.shape[1:]) for p in real if p.num_items}
        if len(shapes) > 1:
            raise PackedBatchError(f"Media.lay: images of shapes {sorted(shapes)}: one tower takes one image size")
        with_pixels = [p.pixel_values for p in real if p.num_items] or [self.pixel_values]
        return ImageMedia(pixel_values=torch.cat(with_pixels), token_id=self.token_id, **laid)

    def _piece(self, keep: torch.Tensor, start: int, stop: int) -> dict[str, Any]:
        return {"pixel_values": self.pixel_values[keep]}

    def hf_kwargs(self, position_ids: torch.Tensor) -> dict[str, Any]:
        return {"pixel_values": self.pixel_values} if self.num_items else {}
