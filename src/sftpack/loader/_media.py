"""``MultimodalPackingDataset``: conversations with images, packed while streaming into rows of ``max_seq_len``.

The loader path's rule (rows always ``max_seq_len`` wide, a bounded buffer per
(rank, worker), exact resume from indices) applied to
:class:`~sftpack.multimodal.MultimodalSample` s. Each (rank, worker) reads its share
of the source (the text loader's ``Source``: the same shares, the same seeded
permutation), turns every item into samples as it arrives, and packs a full
buffer with :func:`sftpack.multimodal.plan_rows` (first-fit decreasing on the
padded token cost, a row taking a sample only if its vision patches fit the
optional ``max_patches`` too). Each decided row is laid by
:func:`sftpack.multimodal.build_multimodal_row`: its samples in input order,
their images in row order, each sample's own MRoPE positions::

    items ──▶ share of (rank, worker) ──▶ samples (tokenize / split / count) ──▶ buffer
          ──plan_rows (tokens, patches)──▶ rows ──build_multimodal_row──▶ MultimodalBatch
                        ▲                    │
                        └── under-filled rows wait (≤ max_wait rounds)

An item is a ``MultimodalSample`` (tokenized upstream) or a conversation (a mapping
with ``messages`` and ``id``, or an object with ``.messages``), tokenized here, in
the worker, with :func:`sftpack.multimodal.tokenize_multimodal`, so image decoding
runs in the DataLoader's workers. Every item read is accounted for
(:class:`MultimodalLoaderStats`): packed whole, split at text boundaries (never
inside an image), or dropped under a counted reason (a bad image under its
:class:`~sftpack.multimodal.BadImageReason`, a malformed record, over-long, over the
patch budget), or an error naming it (``on_bad_row="error"``, the default).

Under-filled rows may wait for fresh samples, as in the text loader: a row whose
fill (the larger of its token fill and its patch fill) is below ``min_fill`` keeps
its samples in the buffer for another round, at most ``max_wait`` rounds, never
more than half the buffer. At the end of a share the buffer is flushed: each epoch
emits every kept sample exactly once.

Exact resume: the state is the text loader's, indices only (epoch, cursor, the
buffer as ``(source index, piece, rounds waited)``, the decided rows as
``(source index, piece)`` lists, the counts), checked by the same checks before it
is trusted; a restore re-reads and re-tokenizes only the named items, and replays
the decided rows as decided.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .._base import check_width, choose, non_negative_int, positive_int

# The multimodal core's modules, not its package: the package also holds the exactness
# harness, whose model builder loads the training loop, which no path may import.
from ..multimodal._images import BadImageError, image_processor
from ..multimodal._plan import check_patch_budget, plan_rows
from ..multimodal._row import MultimodalBatch, build_multimodal_row
from ..multimodal._sample import MultimodalSample, qwen2vl_tokenizer, tokenize_multimodal
from ..sample import Overlong, OverlongError
from ._source import Lookahead, Source
from ._state import (
    STATE_VERSION,
    StateError,
    check_fields,
    check_loadable,
    check_refs,
    check_share,
    check_stats,
    digest,
    enter_iter,
    position,
    refs_needed,
    restore_items,
    unemitted,
)

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["MultimodalLoaderStats", "MultimodalPackingDataset", "split_multimodal_sample"]

#: the padded boundaries for both ``cu_seqlens`` and ``cu_seqlens_padded``, as the text loader
_PAD_BETWEEN_SEQS = False
#: ``<|endoftext|>``, Qwen2-VL's padding token
_QWEN2VL_PAD = 151643


# ------------------------------------------------------------------ the counts
@dataclass
class MultimodalLoaderStats:
    """Counts of one multimodal loader (or the sum over workers). Nothing is lost::

        samples_in == samples_packed + sum(dropped.values())     (per completed epoch)
        sequences_out == samples_packed + extra_pieces

    Attributes:
        samples_in: source items read.
        rows_out: rows emitted (each ``max_seq_len`` slots); ``slots`` their slots.
        sequences_out: samples (or pieces of split ones) in those rows.
        real_tokens: real tokens (vision placeholders included) in those rows.
        images_out, patches_out: images and vision patches in those rows.
        split: items cut at text boundaries into ``1 + extra`` pieces; ``extra_pieces`` the extra.
        dropped: items left out, by reason (``image_*`` as :class:`~sftpack.multimodal.BadImageReason`,
            ``bad_record``, ``overlong``, ``over_patch_budget``).
        rounds, held_rows, max_waited, epochs, abandoned: as :class:`~sftpack.loader.LoaderStats`.
    """

    samples_in: int = 0
    rows_out: int = 0
    sequences_out: int = 0
    real_tokens: int = 0
    slots: int = 0
    images_out: int = 0
    patches_out: int = 0
    split: int = 0
    extra_pieces: int = 0
    rounds: int = 0
    held_rows: int = 0
    max_waited: int = 0
    epochs: int = 0
    abandoned: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def fill(self) -> float:
        """Real tokens per slot of the emitted rows."""
        return self.real_tokens / self.slots if self.slots else 0.0

    @property
    def samples_packed(self) -> int:
        """Source items whose tokens went into rows (whole or as pieces)."""
        return self.sequences_out - self.extra_pieces

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def as_dict(self) -> dict[str, int]:
        """Flat counts (a reason ``r`` as ``dropped:r``), what the state stores."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "dropped"}
        return out | {f"dropped:{k}": v for k, v in sorted(self.dropped.items())}

    @classmethod
    def from_dict(cls, counts: Mapping[str, Any]) -> MultimodalLoaderStats:
        names = {f.name for f in fields(cls)} - {"dropped"}
        known: dict[str, Any] = {k: int(v) for k, v in counts.items() if k in names}
        out = cls(**known)
        out.dropped = {k[len("dropped:") :]: int(v) for k, v in counts.items() if k.startswith("dropped:")}
        return out

    def __add__(self, other: MultimodalLoaderStats) -> MultimodalLoaderStats:
        a, b = self.as_dict(), other.as_dict()
        out = MultimodalLoaderStats.from_dict({k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()})
        out.max_waited = max(self.max_waited, other.max_waited)
        return out

    @classmethod
    def from_state(cls, state: Any) -> MultimodalLoaderStats:
        """The counts of a :class:`MultimodalPackingDataset` state, or summed over the workers of a
        torchdata ``StatefulDataLoader`` state."""
        found = list(_dataset_states(state))
        if not found:
            raise ValueError("no sftpack MultimodalPackingDataset state found in this state dict")
        total = cls()
        for s in found:
            total = total + cls.from_dict(s["stats"])
        return total


def _dataset_states(state: Any) -> Iterator[dict[str, Any]]:
    if isinstance(state, dict):
        if isinstance(state.get("stats"), dict) and isinstance(state.get("config"), dict):
            yield state
            return
        for v in state.values():
            yield from _dataset_states(v)


# ------------------------------------------------------------------ the items
class _Item:
    """One sequence in the buffer: a sample, or one piece of a split item; ``ref`` is
    ``(source index, piece)``, all the state stores."""

    __slots__ = ("_digest", "length", "patches", "ref", "sample", "sequence_id")

    def __init__(self, ref: tuple[int, int], sample: MultimodalSample, sequence_id: Any) -> None:
        self.ref = ref
        self.sample = sample
        self.sequence_id = sequence_id
        self.length = len(sample)
        self.patches = sample.num_patches
        self._digest: str | None = None

    def digest(self) -> str:
        """The fingerprint a state records of this sequence (its tokens, image grids and id)."""
        if self._digest is None:
            self._digest = digest(self.sample.input_ids, self.sequence_id, self.sample.image_grid_thw)
        return self._digest


def split_multimodal_sample(sample: MultimodalSample, max_seq_len: int) -> list[MultimodalSample] | None:
    """``sample`` cut into pieces of at most ``max_seq_len`` tokens, never inside an image block
    (its placeholder run with the token before and after, ``<|vision_start|>`` and
    ``<|vision_end|>``); each piece carries its own images. ``None`` when an image block alone
    is longer than ``max_seq_len``. The rule of ``tokenize_multimodal(..., overlong="split")``.

    >>> import numpy as np
    >>> ids = np.array([1, 2, 151652, 151655, 151655, 151653, 3, 4])
    >>> s = MultimodalSample(ids, ids < 5, pixel_values=np.zeros((8, 1176), np.float32),
    ...                      image_grid_thw=[(1, 2, 4)], image_runs=[(3, 2)])
    >>> [p.input_ids.tolist() for p in split_multimodal_sample(s, 5)]
    [[1, 2], [151652, 151655, 151655, 151653, 3], [4]]
    >>> split_multimodal_sample(s, 3) is None
    True
    """
    L = len(sample)
    blocks = [(max(s - 1, 0), min(s + n + 1, L)) for s, n in sample.image_runs.tolist()]
    cuts, a = [], 0
    while a < L:
        b = min(a + max_seq_len, L)
        for s, e in blocks:
            if s < b < e:
                b = s
        if b <= a:
            return None
        cuts.append((a, b))
        a = b
    per = sample.image_grid_thw.prod(axis=1)
    off = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    out = []
    for k, (a, b) in enumerate(cuts):
        keep = [i for i, (s, n) in enumerate(sample.image_runs.tolist()) if a <= s and s + n <= b]
        pv = (
            np.concatenate([sample.pixel_values[off[i] : off[i + 1]] for i in keep])
            if keep
            else sample.pixel_values[:0]
        )
        runs = sample.image_runs[keep].copy()
        runs[:, 0] -= a
        out.append(
            MultimodalSample(
                sample.input_ids[a:b],
                sample.loss_mask[a:b],
                sample.conversation_id,
                meta={**(sample.meta or {}), "piece": k},
                pixel_values=pv,
                image_grid_thw=sample.image_grid_thw[keep],
                image_runs=runs,
                image_token_id=sample.image_token_id,
                merge_size=sample.merge_size,
            )
        )
    return out


class _Calls:
    """A re-iterable over a callable that returns a fresh iterable of items on each call."""

    def __init__(self, fn: Callable[[], Iterable[Any]]) -> None:
        self.fn = fn

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fn())


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


# ------------------------------------------------------------------ the dataset
class MultimodalPackingDataset(IterableDataset):
    """A torch ``IterableDataset`` of :class:`~sftpack.multimodal.MultimodalBatch` rows, each exactly
    ``max_seq_len`` wide, packed from a stream of conversations with images.

    Args:
        samples: the items: a map-style dataset (``len()`` and ``[i]``), a re-iterable, or a
            callable returning a fresh iterable on each call (e.g.
            ``lambda: vqa_corpus(seed=0)``); each item a :class:`~sftpack.multimodal.MultimodalSample`
            or a conversation (``{"messages": [...], "id": ...}``), tokenized in the worker.
        max_seq_len: row width ``T`` (vision placeholders count), a multiple of ``pad_multiple``.
        buffer_size: sequences planned together per round (per worker).
        max_patches: vision patches per row (the second budget); ``None``: no patch budget.
        pad_multiple: pad each sequence to a multiple of this (``2 * CP``).
        overlong: samples longer than a row: ``"split"`` (default; at text boundaries, never inside
            an image block), ``"drop"`` (counted) or ``"error"``. ``"truncate"`` is refused (it would
            cut a turn and possibly an image).
        on_bad_row: ``"error"`` (default): a bad image or record raises, naming the record and the
            field; ``"skip"``: counted in ``stats.dropped`` under its reason.
        seed: the permutation seed of ``shuffle``.
        shuffle: visit a map-style source in a seeded permutation per epoch.
        max_wait, min_fill: under-filled rows may wait (see the module docstring).
        num_epochs: epochs one ``iter()`` runs (``None``: endless).
        rank, world_size: data-parallel coordinates (default: ``torch.distributed``'s, else 0 and 1).
        pad_id: token id of padding slots (default ``<|endoftext|>``; never the image placeholder).
        pad_between_seqs: what :meth:`packed_seq_params` hands the kernel (``False``: the padded
            boundaries for both, as the text loader).
        tokenizer, processor: for conversation items (default :func:`~sftpack.multimodal.qwen2vl_tokenizer`
            and :func:`~sftpack.multimodal.image_processor`, built on first use).

    A sample with more patches than ``max_patches`` (or, under ``split``, a piece of it) can fit
    no row: it is dropped and counted as ``over_patch_budget``, or raises under ``overlong="error"``.

    >>> import numpy as np
    >>> def sample(n_text, grid):  # text tokens, then one image of a (t, h, w) patch grid
    ...     n = int(np.prod(grid)) // 4
    ...     ids = np.array([1] * n_text + [151652] + [151655] * n + [151653])
    ...     return MultimodalSample(ids, ids == 1, pixel_values=np.zeros((int(np.prod(grid)), 1176), np.float32),
    ...                             image_grid_thw=[grid], image_runs=[(n_text + 1, n)])
    >>> ds = MultimodalPackingDataset([sample(5, (1, 4, 4)), sample(3, (1, 2, 4)), sample(20, (1, 4, 4))],
    ...                               max_seq_len=32, buffer_size=8, max_patches=24)
    >>> rows = list(ds)
    >>> [(r.num_tokens, r.cu_seqlens.tolist(), r.image_grid_thw.tolist()) for r in rows]
    [(32, [0, 26], [[1, 4, 4]]), (32, [0, 11, 18], [[1, 4, 4], [1, 2, 4]])]
    >>> ds.stats.samples_in == ds.stats.samples_packed + ds.stats.dropped_total
    True
    """

    def __init__(
        self,
        samples: Any,
        *,
        max_seq_len: int,
        buffer_size: int = 64,
        max_patches: int | None = None,
        pad_multiple: int = 1,
        overlong: str | Overlong = Overlong.SPLIT,
        on_bad_row: str = "error",
        seed: int = 0,
        shuffle: bool = False,
        max_wait: int = 2,
        min_fill: float = 0.99,
        num_epochs: int | None = 1,
        rank: int | None = None,
        world_size: int | None = None,
        pad_id: int = _QWEN2VL_PAD,
        pad_between_seqs: bool = _PAD_BETWEEN_SEQS,
        tokenizer: Any = None,
        processor: Any = None,
    ) -> None:
        super().__init__()
        who = "MultimodalPackingDataset"
        self.max_seq_len: int = positive_int("max_seq_len", max_seq_len, who=who)
        self.buffer_size: int = positive_int("buffer_size", buffer_size, who=who)
        self.max_patches: int | None = positive_int("max_patches", max_patches, allow_none=True, who=who)
        self.pad_multiple: int = positive_int("pad_multiple", pad_multiple, who=who)
        check_width(self.max_seq_len, self.pad_multiple, who=who)
        self.overlong: Overlong = choose(Overlong, overlong, "overlong")
        if self.overlong is Overlong.TRUNCATE:
            raise ValueError(
                f"{who}: overlong='truncate' is not offered for multimodal samples (it would cut a turn and "
                "possibly an image): use 'split', 'drop' or 'error'"
            )
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"{who}: on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        self.on_bad_row: str = on_bad_row
        self.seed: int = non_negative_int("seed", seed, who=who)
        self.shuffle: bool = bool(shuffle)
        self.max_wait: int = non_negative_int("max_wait", max_wait, who=who)
        if not isinstance(min_fill, numbers.Real) or not 0.0 <= float(min_fill) <= 1.0:
            raise ValueError(f"{who}: min_fill must be a fraction in [0, 1], got {min_fill!r}")
        self.min_fill: float = float(min_fill)
        self.num_epochs: int | None = positive_int("num_epochs", num_epochs, allow_none=True, who=who)
        if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral) or pad_id < 0:
            raise ValueError(f"{who}: pad_id must be a non-negative integer token id, got {pad_id!r}")
        self.pad_id: int = int(pad_id)
        self.pad_between_seqs: bool = bool(pad_between_seqs)
        dist_rank, dist_world = _dist_rank_world()
        self.world_size: int = positive_int("world_size", world_size if world_size is not None else dist_world, who=who)
        self.rank: int = non_negative_int("rank", rank if rank is not None else dist_rank, who=who)
        if self.rank >= self.world_size:
            raise ValueError(f"{who}: rank={self.rank} must be below world_size={self.world_size}")
        if callable(samples) and not hasattr(samples, "__iter__") and not hasattr(samples, "__getitem__"):
            samples = _Calls(samples)
        self.source: Source = Source(samples, shuffle=self.shuffle, seed=self.seed)
        self._tokenizer: Any = tokenizer
        self._processor: Any = processor
        self._reset(epoch=0)

    # ----------------------------------------------------------------- state
    def _reset(self, epoch: int) -> None:
        self._epoch = epoch
        self._end_epoch: int | None = None
        self._active = False
        self._cursor = 0
        self._buffer: list[_Item] = []
        self._ages: list[int] = []
        self._pending: list[list[_Item]] = []
        self._stats = MultimodalLoaderStats()
        self._restore: dict[str, Any] | None = None
        self._skipped = False  # the first iter() after restoring an ended share (see first_iter) ran
        self._shard_seen: tuple[int, int, int] | None = None
        self._last: tuple[int, list[_Item]] | None = None  # the last item read this epoch, and its sequences

    @property
    def stats(self) -> MultimodalLoaderStats:
        """Counts so far of this (worker's) dataset."""
        return self._stats

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at the beginning of ``epoch`` (drops any partial state)."""
        stats = self._stats
        stats.abandoned += unemitted(self._buffer, self._pending, self._restore)
        self._reset(epoch=non_negative_int("epoch", epoch, who="MultimodalPackingDataset"))
        self._stats = stats

    def packed_seq_params(self, row: MultimodalBatch) -> PackedSeqParams:
        """Megatron's ``PackedSeqParams`` for ``row`` in this loader's boundary mode."""
        return row.to_packed_seq_params(pad_between_seqs=self.pad_between_seqs)

    def _config(self) -> dict[str, Any]:
        return {
            "kind": "multimodal",
            "max_seq_len": self.max_seq_len,
            "buffer_size": self.buffer_size,
            "max_patches": self.max_patches,
            "pad_multiple": self.pad_multiple,
            "overlong": str(self.overlong),
            "on_bad_row": self.on_bad_row,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "max_wait": self.max_wait,
            "min_fill": self.min_fill,
            "num_epochs": self.num_epochs,
        }

    def _shard(self) -> tuple[int, int, int]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * nw + wid, self.world_size * nw, nw

    def state_dict(self) -> dict[str, Any]:
        """This (worker's) position as plain ints and lists (survives JSON). With DataLoader
        workers take the state from torchdata's ``StatefulDataLoader`` (or
        :class:`~sftpack.loader.StatefulLoader`), which calls this inside each worker."""
        if self._restore is not None:
            return self._restore
        shard, shards, nw = self._shard()
        return {
            "version": STATE_VERSION,
            "config": self._config(),
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": nw,
            "shard": shard,
            "num_shards": shards,
            "epoch": self._epoch,
            "end_epoch": self._end_epoch,
            "active": self._active,
            "cursor": self._cursor,
            "stats": self._stats.as_dict(),
            "num_samples": len(self.source.samples) if self.source.map_style else None,
            **position(self._buffer, self._ages, self._pending, self._last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s output (a dataset built with the same arguments and items).

        Raises:
            StateError: not such a state, other arguments, rank or world size, a damaged field, a
                state saved over other data; another ``num_workers`` (when iteration starts).
        """
        check_loadable(state, self._config(), self.rank, self.world_size)
        check_fields(state, self.max_wait)
        order = None
        if self.source.map_style:
            order = self.source.order(state["epoch"], state["shard"], state["num_shards"])
        check_refs(state, order, len(self.source.samples) if self.source.map_style else None)
        stats = MultimodalLoaderStats.from_dict(state["stats"])
        check_stats(
            state,
            stats,
            who="MultimodalPackingDataset",
            max_seq_len=self.max_seq_len,
            max_wait=self.max_wait,
            max_patches=self.max_patches,
        )
        self._reset(epoch=int(state["epoch"]))
        self._restore = state
        self._stats = stats

    # ------------------------------------------------------------- intake
    def _tokenize(self, obj: Any, index: int) -> tuple[list[MultimodalSample], str | None]:
        messages: Any
        if isinstance(obj, Mapping):
            messages, cid = obj.get("messages"), obj.get("id")
        elif hasattr(obj, "messages"):
            messages, cid = obj.messages, getattr(obj, "id", None)
        else:
            raise TypeError(
                f"MultimodalPackingDataset: item {index} is a {type(obj).__name__}; an item must be a "
                "MultimodalSample or a conversation ({'messages': [...], 'id': ...})"
            )
        if self._tokenizer is None:
            self._tokenizer = qwen2vl_tokenizer()
        if self._processor is None:
            self._processor = image_processor()
        try:
            out = tokenize_multimodal(
                messages,
                tokenizer=self._tokenizer,
                processor=self._processor,
                conversation_id=cid if cid is not None else index,
                max_seq_len=self.max_seq_len,
                overlong=self.overlong,
            )
        except BadImageError as e:
            if self.on_bad_row == "error":
                raise
            return [], e.reason.value
        except OverlongError:
            if self.on_bad_row == "error":
                raise
            return [], "overlong"
        except ValueError:
            if self.on_bad_row == "error":
                raise
            return [], "bad_record"
        return out, None if out else "overlong"

    def _cut(self, index: int, obj: Any) -> tuple[list[_Item], str | None]:
        """The items of source item ``index``, or none and the reason it is dropped."""
        pieces: list[MultimodalSample]
        if isinstance(obj, MultimodalSample):
            pieces = [obj]
            if len(obj) > self.max_seq_len:
                if self.overlong is Overlong.ERROR:
                    raise OverlongError(
                        f"item {index} (conversation {obj.conversation_id!r}) has {len(obj)} tokens (images "
                        f"included), more than max_seq_len={self.max_seq_len}: raise max_seq_len, or use "
                        "overlong='split' or 'drop'",
                        obj.conversation_id,
                        len(obj),
                        self.max_seq_len,
                    )
                cut = split_multimodal_sample(obj, self.max_seq_len) if self.overlong is Overlong.SPLIT else None
                if cut is None:
                    return [], "overlong"
                pieces = cut
        else:
            got, reason = self._tokenize(obj, index)
            if reason is not None:
                return [], reason
            pieces = got
        reason = check_patch_budget(
            pieces, self.max_patches, self.overlong, who=f"item {index} (conversation {pieces[0].conversation_id!r})"
        )
        if reason is not None:
            return [], reason
        return [
            _Item((index, k), p, p.conversation_id if p.conversation_id is not None else index)
            for k, p in enumerate(pieces)
        ], None

    def _read(self, index: int, obj: Any) -> None:
        items, reason = self._cut(index, obj)
        s = self._stats
        s.samples_in += 1
        self._cursor += 1
        self._last = (index, items)
        if reason is not None:
            s.drop(reason)
            return
        if len(items) > 1:
            s.split += 1
            s.extra_pieces += len(items) - 1
        self._buffer.extend(items)
        self._ages.extend([0] * len(items))

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[MultimodalBatch]:
        # a worker restored after its share of the loader's pass had ended: that pass gets nothing
        return iter(()) if enter_iter(self, get_worker_info() is not None) else self._rows()

    def _rows(self) -> Iterator[MultimodalBatch]:
        shard, shards, nw = self._shard()
        if self.source.map_style and len(self.source.samples) < shards:
            raise ValueError(
                f"MultimodalPackingDataset (rank {self.rank} of {self.world_size}, {nw} worker(s)): the source holds "
                f"{len(self.source.samples)} items but they are dealt to {shards} shares, so some get none and would "
                "never yield a row: use fewer ranks x workers, or more items"
            )
        need: set[int] = set()
        if self._restore is not None:
            check_share(self._restore, shard, shards, nw, self.rank)
            st = self._restore
            self._epoch, self._end_epoch = int(st["epoch"]), st["end_epoch"]
            self._active, self._cursor = bool(st["active"]), int(st["cursor"])
            need = refs_needed(st)
        elif self._shard_seen is not None and self._shard_seen != (shard, shards, nw):
            self.set_epoch(self._epoch)
        self._shard_seen = (shard, shards, nw)
        if not self._active:
            self._active = True
            self._end_epoch = None if self.num_epochs is None else self._epoch + self.num_epochs
        while self._end_epoch is None or self._epoch < self._end_epoch:
            got, stream = self.source.open(self._epoch, shard, shards, self._cursor, need)
            if self._restore is not None:
                self._rebuild(got)
            need = set()
            fresh = self._cursor == 0 and not self._buffer and not self._pending
            rows_before, read_before = self._stats.rows_out, self._stats.samples_in
            yield from self._run_epoch(Lookahead(stream))
            if fresh and self._stats.rows_out == rows_before:
                read = self._stats.samples_in - read_before
                raise ValueError(
                    f"MultimodalPackingDataset (rank {self.rank} of {self.world_size}, share {shard} of {shards}): "
                    f"epoch {self._epoch - 1} emitted no row: it read {read} items and dropped them all "
                    f"({self._stats.dropped}); a share with no row never yields with num_epochs=None and makes "
                    "ranks disagree on the row count: fix the data (see the reasons), or use fewer ranks x workers"
                )
        if self._restore is not None:  # restored at the end of its last epoch: nothing to re-read
            self._rebuild({})
        self._active = False

    def _rebuild(self, got: dict[int, Any]) -> None:
        assert self._restore is not None
        self._buffer, self._ages, self._pending, self._last = restore_items(
            self._restore, got, lambda i, o: self._cut(i, o)[0]
        )
        for r, row in enumerate(self._pending):
            cost = sum(-(-it.length // self.pad_multiple) * self.pad_multiple for it in row)
            patches = sum(it.patches for it in row)
            if cost > self.max_seq_len or (self.max_patches is not None and patches > self.max_patches):
                raise StateError(
                    f"state['pending'][{r}] holds {len(row)} sequences of {cost} padded slots and {patches} patches, "
                    f"more than max_seq_len={self.max_seq_len} or max_patches={self.max_patches}: the state was "
                    "saved over other data (or edited); resume with the same items in the same order"
                )
        self._restore = None

    def _run_epoch(self, stream: Lookahead) -> Iterator[MultimodalBatch]:
        """Rows of the rest of this epoch; the epoch advances before its last row is yielded."""
        while True:
            while self._pending:
                row = self._build(self._pending[0])
                self._emit(self._pending.pop(0))
                last = not self._pending and not self._buffer and stream.done
                if last:
                    self._next_epoch()
                yield row
                if last:
                    return
            if stream.done and not self._buffer:
                self._next_epoch()
                return
            while len(self._buffer) < self.buffer_size and not stream.done:
                self._read(*stream.pop())
            if self._buffer:
                self._round(flush=stream.done)

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._cursor = 0
        self._last = None
        self._stats.epochs += 1

    def _round(self, *, flush: bool) -> None:
        buf = self._buffer
        lengths = np.fromiter((it.length for it in buf), dtype=np.int64, count=len(buf))
        patches = np.fromiter((it.patches for it in buf), dtype=np.int64, count=len(buf))
        rows = plan_rows(
            lengths, patches, max_seq_len=self.max_seq_len, max_patches=self.max_patches, pad_multiple=self.pad_multiple
        )
        ages = np.asarray(self._ages, dtype=np.int64)
        held = np.zeros(len(rows), dtype=bool)
        if not flush and self.max_wait > 0:
            cost = -(-lengths // self.pad_multiple) * self.pad_multiple
            fill = np.array([cost[r].sum() / self.max_seq_len for r in rows])
            if self.max_patches is not None:
                fill = np.maximum(fill, [patches[r].sum() / self.max_patches for r in rows])
            oldest = np.array([ages[r].max() for r in rows])
            budget = self.buffer_size // 2
            cand = np.flatnonzero((fill < self.min_fill) & (oldest < self.max_wait))
            for i in cand[np.argsort(fill[cand], kind="stable")].tolist():
                if len(rows[i]) <= budget:
                    held[i] = True
                    budget -= len(rows[i])
        keep: list[int] = []
        for i, r in enumerate(rows):
            if held[i]:
                keep.extend(r.tolist())
            else:
                self._pending.append([buf[j] for j in r.tolist()])
                self._stats.max_waited = max(self._stats.max_waited, int(ages[r].max()))
        keep.sort()
        self._buffer = [buf[i] for i in keep]
        self._ages = [int(ages[i]) + 1 for i in keep]
        self._stats.rounds += 1
        self._stats.held_rows += int(held.sum())

    def _build(self, row: list[_Item]) -> MultimodalBatch:
        batch = build_multimodal_row(
            [it.sample for it in row], row_width=self.max_seq_len, pad_multiple=self.pad_multiple, pad_id=self.pad_id
        )
        return replace(batch, sequence_ids=tuple(it.sequence_id for it in row))

    def _emit(self, row: list[_Item]) -> None:
        s = self._stats
        s.rows_out += 1
        s.sequences_out += len(row)
        s.real_tokens += sum(it.length for it in row)
        s.slots += self.max_seq_len
        s.images_out += sum(it.sample.num_images for it in row)
        s.patches_out += sum(it.patches for it in row)
