"""``PackingDataset``: rows of exactly ``max_seq_len`` packed from a bounded buffer while streaming.

Each (rank, worker) reads its share of the samples (see ``_source``) into a
buffer of ``buffer_size`` sequences. When the buffer is full it is packed
(:func:`~sftpack.handoff.pack_rows`: best-fit decreasing on the padded costs the
row builder lays), the rows are emitted one by one, and the few under-filled
rows may wait a round for fresh samples to fill them (``_hold.hold_back``)::

    read   s0 s1 ... s255            buffer full (buffer_size=256)
    pack   rows r0..r52 (>= min_fill) emitted,  r53 (71% full) held: its 3 samples wait
    read   s256 ... s508             buffer full again (3 held + 253 new)
    ...    end of the share: flush, every remaining sample emitted; next epoch

The bound: a sample is packed in the first round after it is read (within
``buffer_size`` further reads), held at most ``max_wait`` rounds (default 2),
and held samples never fill more than half the buffer, so every sample is in
a decided row before its worker has read ``(max_wait + 1) * buffer_size``
further samples (``buffer_size`` counts pieces of split samples); ``max_wait=0``
packs each buffer whole (Megatron-Energon's rule). At the end of
a share the buffer is flushed, so each epoch emits every sample exactly once
(or its pieces, or its truncation; dropped samples are counted). A share
that would emit no row at all (no sample, or all dropped) raises a
``ValueError`` naming the rank, worker, counts and fix, instead of spinning.

Fill (against offline BFD, per buffer size, with or without waiting) and the cost
per row are measured by ``benchmarks/bench_loader.py``.

Samples with media (a :class:`~sftpack.Sample` whose ``media`` holds its images,
in any mix with text-only ones) take the same road: each is costed at its padded
length (vision placeholders count), planned under the optional second budget
``max_patches_per_row`` (the vision tower's memory grows with a row's patches,
not its tokens: ``pack_rows(max_patches=...)``, and a row's fill is the larger of
its token and patch fill), split over-long at text boundaries only (never inside an image
block; each piece carries its own media, :meth:`~sftpack.handoff.payload.Media.piece`),
and a row holding media gets their payload laid in row order
(:meth:`~sftpack.handoff.payload.Media.lay`: the row equals
:meth:`sftpack.PackedBatch.from_samples` of its samples). A conversation item
(``{"messages": [...], "id": ...}``) is tokenized in the worker with
:func:`sftpack.multimodal.tokenize_media_conversation` for the dataset's model family, so
image decoding runs in the DataLoader's workers; a bad image or record is counted
under its reason or raises naming it (``on_bad_row``). Without media (or without
a patch budget) a buffer is planned exactly as text.

Exact resume: the state is indices only (epoch, cursor into the share, the
buffer as ``(source index, piece, rounds waited)``, the decided but not yet
emitted rows as ``(source index, piece)`` lists, the counts), updated before
every ``yield``. A restored dataset re-reads those samples (re-tokenizing a
conversation) and replays the decided rows as decided: it never re-packs them.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .._base import check_width, choose, non_negative_int, positive_int
from ..binpack import Algorithm
from ..handoff import PackedBatch, pack_rows, padded_lengths
from ..handoff.build import wrap_parts
from ..handoff.errors import PackedBatchError
from ..handoff.layout import check_pad_id, fit_parts, join_parts

# The multimodal core's modules (the package's own names would also load its exactness harness)
from ..multimodal._family import Family, family_for
from ..multimodal._plan import check_patch_budget
from ..multimodal._tokenize import split_sample, tokenize_record
from ..sample import DEFAULT_OVERLONG, Overlong, OverlongError, Sample
from ._hold import hold_back
from ._shares import dist_rank_world, no_row, share_name, too_few
from ._source import Item, Lookahead, Source, cut_overlong, first_negative, is_conversation, media_options
from ._state import (
    STATE_VERSION,
    StateError,
    check_fields,
    check_loadable,
    check_refs,
    check_share,
    check_stats,
    enter_iter,
    position,
    refs_needed,
    restore_items,
    unemitted,
)
from ._stats import OVERLONG, LoaderStats

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["PAD_BETWEEN_SEQS", "PackingDataset", "StateError"]

#: What the loader hands the kernel by default: the padded boundaries for both
#: ``cu_seqlens`` and ``cu_seqlens_padded`` (Transformer Engine keeps FlashAttention-2).
PAD_BETWEEN_SEQS = False


class PackingDataset(IterableDataset):
    """A torch ``IterableDataset`` of :class:`~sftpack.PackedBatch` rows, each exactly ``max_seq_len`` wide.

    Args:
        samples: a map-style dataset (``len()`` and ``[i]``), a re-iterable, or a
            callable returning a fresh iterable on each call (``lambda: vqa_corpus(seed=0)``);
            each item a :class:`~sftpack.Sample` (with or without ``media``), a dict with
            ``input_ids`` (and ``loss_mask``, ``conversation_id``), a bare id sequence,
            or a conversation (``{"messages": [...], "id": ...}`` or an object with
            ``.messages``) in the Hugging Face multimodal chat format, tokenized in the
            worker. ``sequence_ids`` of a row are the ``conversation_id`` s (the source
            index when there is none).
        max_seq_len: row width ``T`` (vision placeholders count), a multiple of ``pad_multiple``.
        buffer_size: sequences packed together per round (per worker).
        pad_multiple: pad each sequence to a multiple of this (``2 * CP``).
        algorithm: a :func:`sftpack.binpack.pack` algorithm (``"bfd"``).
        pad_between_seqs: what :meth:`packed_seq_params` hands the kernel:
            ``False`` (default) the padded boundaries for both (Transformer
            Engine keeps FlashAttention-2), ``True`` real + padded.
        overlong: samples longer than a row: ``"split"`` (default; a sample with media at
            text boundaries, never inside an image block), ``"truncate"`` (refused for a
            sample with media: it would cut a turn and possibly an image), ``"drop"`` or
            ``"error"``; all counted in :attr:`stats`.
        seed: permutation seed (``shuffle=True``) and ``first_fit_shuffle`` seed.
        shuffle: visit a map-style source in a seeded permutation per epoch
            (default: in order, so rows keep the source's order).
        max_wait: rounds an under-filled row's samples may wait for better
            company (0: each buffer is packed whole).
        min_fill: rows whose padded cost fills less than this fraction may wait.
        num_epochs: epochs one ``iter()`` runs (``None``: endless).
        rank, world_size: data-parallel coordinates (default: ``torch.distributed``'s, else 0 and 1).
        pad_id: token id of padding slots (never a media placeholder).
        max_patches_per_row: vision patches per row, the second budget (``None``: tokens
            only). A sample over it fits no row: dropped and counted as
            ``over_patch_budget``, or :class:`~sftpack.multimodal.PatchBudgetError` under
            ``overlong="error"``.
        on_bad_row: for conversation items: ``"error"`` (default; a bad image or record
            raises, naming the record and the field) or ``"skip"`` (counted under its reason
            in ``stats.dropped_by``).
        family: the model family of the samples with media (anything
            :func:`~sftpack.multimodal.family_for` takes: ``"qwen2_5_vl"``, a config, a model;
            default Qwen2-VL): how conversations are tokenized and where an over-long sample
            with media may be cut.
        tokenizer, processor: for conversation items (default the family's ``tokenizer()``
            and ``image_processor()``, built on first use).

    Raises:
        ValueError: when iteration starts, a map-style source with fewer samples than
            ``world_size * num_workers`` shares (every rank and worker raises, together);
            at the end of an epoch, a share that emitted no row (an empty stream share,
            every sample dropped as over-long). Such a share would never yield with
            ``num_epochs=None``, and with a fixed number of epochs the ranks would disagree
            on the row count (a DDP step waits forever), so it is refused, never looped over.

    One ``iter()`` continues from the current state (a fresh dataset: epoch 0);
    with DataLoader workers that are not persistent, call :meth:`set_epoch`
    before each epoch. Use one iterator at a time.

    The contract's worked example (A: 5 tokens, B: 10, ``max_seq_len=36``, multiple 4):

    >>> from sftpack.testing import samples_from_lengths
    >>> ds = PackingDataset(samples_from_lengths([5, 10]), max_seq_len=36, buffer_size=8, pad_multiple=4)
    >>> row = next(iter(ds))
    >>> row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist(), row.sequence_ids
    ([0, 5, 15], [0, 8, 36], (0, 1))
    >>> params = ds.packed_seq_params(row)   # pad_between_seqs=False: one tensor for all four
    >>> params.cu_seqlens_q is params.cu_seqlens_q_padded, params.cu_seqlens_q.tolist()
    (True, [0, 8, 36])
    """

    def __init__(
        self,
        samples: Any,
        *,
        max_seq_len: int,
        buffer_size: int,
        pad_multiple: int = 1,
        algorithm: str | Algorithm = "bfd",
        pad_between_seqs: bool = PAD_BETWEEN_SEQS,
        overlong: str | Overlong = DEFAULT_OVERLONG,
        seed: int = 0,
        shuffle: bool = False,
        max_wait: int = 2,
        min_fill: float = 0.99,
        num_epochs: int | None = 1,
        rank: int | None = None,
        world_size: int | None = None,
        pad_id: int = 0,
        max_patches_per_row: int | None = None,
        on_bad_row: str = "error",
        family: Any = None,
        tokenizer: Any = None,
        processor: Any = None,
    ) -> None:
        super().__init__()
        who = "PackingDataset"
        self.max_seq_len: int = positive_int("max_seq_len", max_seq_len, who=who)
        self.buffer_size: int = positive_int("buffer_size", buffer_size, who=who)
        self.pad_multiple: int = positive_int("pad_multiple", pad_multiple, who=who)
        check_width(self.max_seq_len, self.pad_multiple, who=who)
        self.algorithm: Algorithm = choose(Algorithm, algorithm, "algorithm")
        self.overlong: Overlong = choose(Overlong, overlong, "overlong")
        self.pad_between_seqs: bool = bool(pad_between_seqs)
        self.seed: int = non_negative_int("seed", seed, who="PackingDataset")
        self.max_wait: int = non_negative_int("max_wait", max_wait, who="PackingDataset")
        if not isinstance(min_fill, numbers.Real) or not 0.0 <= float(min_fill) <= 1.0:
            raise ValueError(f"{who}: min_fill must be a fraction in [0, 1], got {min_fill!r}")
        self.min_fill: float = float(min_fill)
        self.num_epochs: int | None = positive_int("num_epochs", num_epochs, allow_none=True, who=who)
        if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral):
            raise TypeError(f"{who}: pad_id must be an integer token id, got {pad_id!r}")
        self.pad_id: int = check_pad_id(pad_id, who, ValueError)
        dist_rank, dist_world = dist_rank_world()
        self.world_size: int = positive_int("world_size", world_size if world_size is not None else dist_world, who=who)
        self.rank: int = non_negative_int("rank", rank if rank is not None else dist_rank, who="PackingDataset")
        if self.rank >= self.world_size:
            raise ValueError(f"{who}: rank={self.rank} must be below world_size={self.world_size}")
        self.max_patches_per_row: int | None
        self.on_bad_row: str
        self.max_patches_per_row, self.on_bad_row = media_options(who, max_patches_per_row, self.overlong, on_bad_row)
        self._family: Family | None = None if family is None else family_for(family)
        self._named_family: bool = family is not None
        self._tokenizer: Any = tokenizer
        self._processor: Any = processor
        self.source: Source = Source(samples, shuffle=bool(shuffle), seed=self.seed)
        self.shuffle: bool = bool(shuffle)
        self._reset(epoch=0)

    @property
    def family(self) -> Family:
        """The model family of the samples with media (Qwen2-VL unless given; resolved on first use)."""
        if self._family is None:
            self._family = family_for(None)
        return self._family

    # ----------------------------------------------------------------- state
    def _reset(self, epoch: int) -> None:
        self._epoch = epoch
        self._end_epoch: int | None = None
        self._active = False
        self._cursor = 0
        self._buffer: list[Item] = []
        self._ages: list[int] = []
        self._pending: list[list[Item]] = []
        self._stats = LoaderStats()
        self._restore: dict[str, Any] | None = None
        self._skipped = False  # the first iter() after restoring an ended share (see first_iter) ran
        self._shard_seen: tuple[int, int, int] | None = None
        self._last: tuple[int, list[Item]] | None = None  # the last sample read this epoch, and its items

    @property
    def stats(self) -> LoaderStats:
        """Counts so far of this (worker's) dataset; see :class:`LoaderStats`."""
        return self._stats

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at the beginning of ``epoch`` (drops any partial state; the
        sequences it held are counted in ``stats.abandoned``)."""
        stats = self._stats
        stats.abandoned += unemitted(self._buffer, self._pending, self._restore)
        self._reset(epoch=non_negative_int("epoch", epoch, who="PackingDataset"))
        self._stats = stats

    def packed_seq_params(self, row: PackedBatch) -> PackedSeqParams:
        """Megatron's ``PackedSeqParams`` for ``row`` in this loader's boundary mode
        (``pad_between_seqs=False`` by default: the padded array for all four fields)."""
        return row.to_packed_seq_params(pad_between_seqs=self.pad_between_seqs)

    def _config(self) -> dict[str, Any]:
        return {
            "max_seq_len": self.max_seq_len,
            "buffer_size": self.buffer_size,
            "pad_multiple": self.pad_multiple,
            "algorithm": str(self.algorithm),
            "overlong": str(self.overlong),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "max_wait": self.max_wait,
            "min_fill": self.min_fill,
            "num_epochs": self.num_epochs,
        } | self._media_config()

    def _media_config(self) -> dict[str, Any]:
        """The media arguments a state records, each only when set (a text dataset's config is as before)."""
        out: dict[str, Any] = {}
        if self.max_patches_per_row is not None:
            out["max_patches_per_row"] = self.max_patches_per_row
        if self.on_bad_row != "error":
            out["on_bad_row"] = self.on_bad_row
        if self._named_family:
            out["family"] = self.family.name
        return out

    def _shard(self) -> tuple[int, int, int]:
        """``(share, number of shares, num_workers)`` of the calling (rank, worker)."""
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * nw + wid, self.world_size * nw, nw

    def state_dict(self) -> dict[str, Any]:
        """This (worker's) position as plain ints and lists: see the module docstring.

        With DataLoader workers, take the state from torchdata's ``StatefulDataLoader``
        (it calls this inside each worker), not from the dataset in the main process.
        """
        if self._restore is not None:  # loaded but not iterated yet: hand it on unchanged
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
        """Resume from :meth:`state_dict`'s output (taken from a dataset built with the same arguments).

        Raises:
            StateError: not such a state, other arguments, another rank or world size, a
                damaged field, a state saved over other data (checked now: see ``_state``);
                another ``num_workers`` (checked when iteration starts).
        """
        check_loadable(state, self._config(), self.rank, self.world_size)
        check_fields(state, self.max_wait)
        order = None
        if self.source.map_style:
            order = self.source.order(state["epoch"], state["shard"], state["num_shards"])
        check_refs(state, order, len(self.source.samples) if self.source.map_style else None)
        stats = LoaderStats.from_dict(state["stats"])
        check_stats(
            state,
            stats,
            who="PackingDataset",
            max_seq_len=self.max_seq_len,
            max_wait=self.max_wait,
            max_patches=self.max_patches_per_row,
        )
        self._reset(epoch=int(state["epoch"]))
        self._restore = state
        self._stats = stats

    def _apply_restore(self, shard: int, shards: int, nw: int) -> set[int]:
        st = self._restore
        assert st is not None
        check_share(st, shard, shards, nw, self.rank)
        self._epoch = int(st["epoch"])
        self._end_epoch = st["end_epoch"]
        self._active = bool(st["active"])
        self._cursor = int(st["cursor"])
        return refs_needed(st)

    def _rebuild(self, got: dict[int, Any]) -> None:
        """Buffer and decided rows of a restored state, from the re-read samples."""
        assert self._restore is not None
        self._buffer, self._ages, self._pending, self._last = restore_items(
            self._restore, got, lambda i, obj: self._cut(i, obj)[0]
        )
        cap = self.max_patches_per_row
        for r, row in enumerate(self._pending):
            cost = int(padded_lengths([it.length for it in row], self.pad_multiple).sum())
            if cost > self.max_seq_len:
                raise StateError(
                    f"state['pending'][{r}] holds {len(row)} sequences of {cost} padded slots, more than "
                    f"max_seq_len={self.max_seq_len}: the state was saved over other data (or edited); resume "
                    "with the same samples in the same order"
                )
            patches = sum(it.patches for it in row)
            if cap is not None and patches > cap:
                raise StateError(
                    f"state['pending'][{r}] holds {len(row)} sequences of {patches} vision patches, more than "
                    f"max_patches_per_row={cap}: the state was saved over other data (or edited); resume with the "
                    "same samples in the same order"
                )
        self._restore = None

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[PackedBatch]:
        # a worker restored after its share of the loader's pass had ended: that pass gets nothing
        return iter(()) if enter_iter(self, get_worker_info() is not None) else self._rows()

    def _rows(self) -> Iterator[PackedBatch]:
        shard, shards, nw = self._shard()
        if self.source.map_style and len(self.source.samples) < shards:
            raise ValueError(too_few(self._share(shard, nw), shards, nw, self.world_size, len(self.source.samples)))
        need: set[int] = set()
        if self._restore is not None:
            need = self._apply_restore(shard, shards, nw)
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
            before = (self._stats.rows_out, self._stats.samples_in, self._stats.dropped)
            yield from self._run_epoch(Lookahead(stream))
            if fresh and self._stats.rows_out == before[0]:
                read, dropped = self._stats.samples_in - before[1], self._stats.dropped - before[2]
                raise ValueError(
                    no_row(
                        self._share(shard, nw),
                        self._epoch - 1,
                        shard,
                        shards,
                        read,
                        dropped,
                        self._stats,
                        self.max_seq_len,
                    )
                )
        if self._restore is not None:  # restored at the end of its last epoch: nothing to re-read
            self._rebuild({})
        self._active = False

    # ------------------------------------------------------------ empty shares
    def _share(self, shard: int, nw: int) -> str:
        """How the refusals of an empty share name it (``_shares``)."""
        return share_name(self.rank, self.world_size, shard, nw, get_worker_info() is not None)

    def _run_epoch(self, stream: Lookahead) -> Iterator[PackedBatch]:
        """Rows of the rest of this epoch; the epoch advances *before* its last row is
        yielded, so the state after that row reads (next epoch, cursor 0)."""
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
            if stream.done and not self._buffer:  # an epoch that emits no row (empty share, all dropped)
                self._next_epoch()
                return
            self._fill(stream)
            if self._buffer:
                self._round(flush=stream.done)

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._cursor = 0
        self._last = None
        self._stats.epochs += 1

    def _fill(self, stream: Lookahead) -> None:
        """Read samples until the buffer holds ``buffer_size`` sequences or the share ends.

        Samples are taken from the stream a buffer's worth at a time; a text :class:`Sample` that
        fits (the common case) is buffered inline, anything else goes through :meth:`_read`,
        and when a split sample fills the buffer early the samples taken after it go back to
        the stream unread, so exactly the samples one-by-one reading reads are read.
        """
        buf, ages, size, width = self._buffer, self._ages, self.buffer_size, self.max_seq_len
        last: Item | None = None  # the last sample read on the fast path (None: _read recorded it)
        li = 0
        while len(buf) < size and not stream.done:
            taken = stream.take(size - len(buf))
            fast = 0
            for j, (index, obj) in enumerate(taken):
                if len(buf) >= size:  # a split sample filled the buffer early: the rest go back unread
                    stream.unread(taken[j:])
                    break
                if isinstance(obj, Sample) and obj.media is None:
                    ids = obj.input_ids
                    n = ids.shape[0]
                    if n <= width:
                        sid = obj.conversation_id
                        last = Item((index, 0), ids, obj.loss_mask, index if sid is None else sid, n)
                        li = index
                        buf.append(last)
                        ages.append(0)
                        fast += 1
                        continue
                self._cursor += fast
                self._stats.samples_in += fast
                fast = 0
                self._read(index, obj)  # any number of pieces, or none
                last = None
            self._cursor += fast
            self._stats.samples_in += fast
        if last is not None:
            self._last = (li, [last])

    def _cut(self, index: int, obj: Any) -> tuple[list[Item], int, str | None]:
        """The items of source sample ``index`` under the over-long policy, the tokens it loses,
        and the reason it is left out (``None``: kept)."""
        if is_conversation(obj) or (isinstance(obj, Sample) and obj.media is not None):
            return self._cut_media(index, obj)
        items, lost = cut_overlong(index, obj, self.max_seq_len, self.overlong)
        return items, lost, None if items else OVERLONG

    def _cut_media(self, index: int, obj: Any) -> tuple[list[Item], int, str | None]:
        """:meth:`_cut` of a sample with media or a conversation (tokenized here, accounted as
        ``tokenize_media_conversations`` accounts it): the multimodal split rule
        (``split_sample``: at text boundaries, never inside an image block), then the patch budget."""
        if self.overlong is Overlong.TRUNCATE:
            raise ValueError(
                f"PackingDataset: item {index} is a sample with media or a conversation, and overlong='truncate' is "
                "not offered for those (it would cut a turn and possibly an image): use 'split', 'drop' or 'error'"
            )
        if isinstance(obj, Sample):
            cid = obj.conversation_id
            try:
                pieces = split_sample(
                    obj, self.max_seq_len, self.overlong, self.family, who=f"item {index} (conversation {cid!r})"
                )
            except OverlongError:  # under split: an image block alone is longer than a row
                if self.overlong is Overlong.ERROR:
                    raise
                pieces = []
            if not pieces:
                return [], len(obj), OVERLONG
        else:
            if self._tokenizer is None:
                self._tokenizer = self.family.tokenizer()
            if self._processor is None:
                self._processor = self.family.image_processor()
            pieces, reason = tokenize_record(
                obj,
                index,
                tokenizer=self._tokenizer,
                processor=self._processor,
                family=self.family,
                max_seq_len=self.max_seq_len,
                overlong=self.overlong,
                on_bad_row=self.on_bad_row,
            )
            if reason is not None:
                return [], 0, reason
            cid = pieces[0].conversation_id
        reason = check_patch_budget(
            pieces, self.max_patches_per_row, self.overlong, who=f"item {index} (conversation {cid!r})"
        )
        if reason is not None:
            return [], sum(len(p) for p in pieces), reason
        sid = index if cid is None else cid
        starts = np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()
        return (
            [
                Item((index, k), p.input_ids, p.loss_mask, sid, len(p), start, p.media)
                for k, (p, start) in enumerate(zip(pieces, starts))
            ],
            0,
            None,
        )

    def _read(self, index: int, obj: Any) -> None:
        items, lost, reason = self._cut(index, obj)
        s = self._stats
        s.samples_in += 1
        self._cursor += 1
        self._last = (index, items)
        if len(items) == 1 and not lost:  # the sample fits
            self._buffer.append(items[0])
            self._ages.append(0)
            return
        if len(items) > 1:
            s.split += 1
            s.extra_pieces += len(items) - 1
        elif items and lost:
            s.truncated += 1
            s.tokens_truncated += lost
        elif not items:
            s.drop(reason or OVERLONG, lost)
        self._buffer.extend(items)
        self._ages.extend([0] * len(items))

    def _round(self, *, flush: bool) -> None:
        """Pack the buffer; its rows become decided rows, but the under-filled ones that may
        wait (``hold_back``) keep their samples in the buffer, one round older."""
        buf = self._buffer
        lengths = np.fromiter((it.length for it in buf), dtype=np.int64, count=len(buf))
        cap = self.max_patches_per_row
        patches = None
        if cap is not None and any(it.media is not None for it in buf):  # the second budget
            patches = np.fromiter((it.patches for it in buf), dtype=np.int64, count=len(buf))
        bins = pack_rows(
            lengths,
            max_seq_len=self.max_seq_len,
            pad_multiple=self.pad_multiple,
            algorithm=self.algorithm,
            seed=self.seed,
            patches=patches,
            max_patches=None if patches is None else cap,
        )
        order, offsets = bins.order, bins.offsets
        n_rows = offsets.shape[0] - 1
        bounds = offsets.tolist()
        planned = [buf[j] for j in order.tolist()]  # the buffer in row order
        stats = self._stats
        stats.rounds += 1
        held = None
        if not flush and self.max_wait > 0:
            held = hold_back(
                bins,
                padded_lengths(lengths, self.pad_multiple),
                np.asarray(self._ages, dtype=np.int64),
                max_seq_len=self.max_seq_len,
                min_fill=self.min_fill,
                max_wait=self.max_wait,
                max_items=self.buffer_size // 2,
                patches=patches,
                max_patches=cap,
            )
        if held is None or not held.any():  # every row decided (the last rounds, max_wait=0, full rows)
            self._pending.extend(planned[bounds[i] : bounds[i + 1]] for i in range(n_rows))
            if self._ages:
                stats.max_waited = max(stats.max_waited, max(self._ages))
            self._buffer, self._ages = [], []
            return
        ages = np.asarray(self._ages, dtype=np.int64)
        waits = np.repeat(held, np.diff(offsets))  # per planned position: does its row wait?
        for i in np.flatnonzero(~held).tolist():
            self._pending.append(planned[bounds[i] : bounds[i + 1]])
        if not waits.all():
            stats.max_waited = max(stats.max_waited, int(ages[order[~waits]].max()))
        keep = np.sort(order[waits])
        self._buffer = [buf[i] for i in keep.tolist()]
        self._ages = (ages[keep] + 1).tolist()
        stats.held_rows += int(held.sum())

    def _build(self, row: list[Item]) -> PackedBatch:
        # Every item's arrays are a Sample's (int64 ids, a bool mask; cut_overlong) and the row
        # was planned on padded_lengths, so the row is laid from the items' own arrays, not
        # concatenated first (build_parts' steps: fit_parts, join_parts, wrap_parts), and the
        # ids are checked once, on the laid row before it becomes tensors (padding is >= 0).
        lengths = [it.length for it in row]
        padded = fit_parts(lengths, self.max_seq_len, self.pad_multiple)
        ids, labels, positions = join_parts(
            [it.input_ids for it in row], [it.loss_mask for it in row], lengths, padded, self.pad_id
        )
        if np.minimum.reduce(ids) < 0:
            raise first_negative(row)
        batch = wrap_parts(ids, labels, positions, lengths, padded, [it.sequence_id for it in row])
        parts = [it.media for it in row]
        first = next((m for m in parts if m is not None), None)
        if first is not None:  # the media in row order, as PackedBatch.from_samples lays them
            if self.pad_id == first.token_id:
                raise PackedBatchError(
                    f"PackingDataset: pad_id {self.pad_id} is the media placeholder id; pad with another token"
                )
            cup = batch.cu_seqlens_padded.tolist()
            batch.media = type(first).lay(
                parts, lengths=lengths, offsets=cup[:-1], widths=padded, segments=[1] * len(row)
            )
        return batch

    def _emit(self, row: list[Item]) -> None:
        s = self._stats
        s.rows_out += 1
        s.sequences_out += len(row)
        s.real_tokens += sum([it.length for it in row])
        s.slots += self.max_seq_len
        for it in row:
            if it.media is not None:
                s.images_out += it.media.num_items
                s.patches_out += it.media.num_patches
