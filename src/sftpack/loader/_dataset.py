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
not its tokens: ``pack_rows(max_patches_per_row=...)``, and a row's fill is the larger of
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

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from .._base import non_negative_int
from ..binpack import Algorithm
from ..handoff import PackedBatch
from ..sample import DEFAULT_OVERLONG, Overlong
from ._cut import Cutter
from ._decided import DecidedRow
from ._settings import LoaderSettings, Setting
from ._shares import no_row, share_name, too_few
from ._source import Item, Lookahead, Source
from ._state import (
    STATE_VERSION,
    StateError,
    check_fields,
    check_loadable,
    check_refs,
    check_stats,
    position,
    unemitted,
)
from ._stats import LoaderStats
from ._stream import RowStream

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.packed_seq_params import PackedSeqParams

    from ..multimodal import Family

__all__ = ["PAD_BETWEEN_SEQS", "PackingDataset", "StateError"]

R = TypeVar("R")

#: What the loader hands the kernel by default: the padded boundaries for both
#: ``cu_seqlens`` and ``cu_seqlens_padded`` (Transformer Engine keeps FlashAttention-2).
PAD_BETWEEN_SEQS = False


class PackingDataset(RowStream, IterableDataset):
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
        groups: keep each group whole in one row: the samples of one ``meta["group"]`` that follow
            each other in the source (a preference pair, :func:`sftpack.chat.tokenize_pair`, or the N
            completions of one prompt, a chat row's ``group``; a map-style source whose group comes
            back after other samples is refused) are read,
            shuffled, dealt and planned as one unit (:func:`sftpack.binpack.pack`'s ``groups``); a
            pair member's sequence id is :func:`sftpack.sample.pair_sequence_id`, so
            ``sftpack.objectives.pairs_of(row, sftpack.sample.pair_meta(row.sequence_ids))`` reads
            the row's pairs. A group whose padded members do not fit one row is never split nor
            truncated: dropped whole (counted) under ``overlong="drop"``, else an
            :class:`~sftpack.sample.OverlongError`. Default ``False``: a pair member is refused, an SFT
            group's members are packed as independent conversations.
            Needs a map-style source, or one share, to find the groups.

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

    max_seq_len = Setting[int]()
    buffer_size = Setting[int]()
    pad_multiple = Setting[int]()
    algorithm = Setting[Algorithm]()
    overlong = Setting[Overlong]()
    pad_between_seqs = Setting[bool]()
    seed = Setting[int]()
    shuffle = Setting[bool]()
    max_wait = Setting[int]()
    min_fill = Setting[float]()
    num_epochs = Setting[int | None]()
    pad_id = Setting[int]()
    rank = Setting[int]()
    world_size = Setting[int]()
    max_patches_per_row = Setting[int | None]()
    on_bad_row = Setting[str]()
    groups = Setting[bool]()

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
        groups: bool = False,
    ) -> None:
        super().__init__()
        #: the checked arguments (each also readable as the dataset's attribute of its name)
        self.settings: LoaderSettings = LoaderSettings.check(
            max_seq_len=max_seq_len,
            buffer_size=buffer_size,
            pad_multiple=pad_multiple,
            algorithm=algorithm,
            pad_between_seqs=pad_between_seqs,
            overlong=overlong,
            seed=seed,
            shuffle=shuffle,
            max_wait=max_wait,
            min_fill=min_fill,
            num_epochs=num_epochs,
            rank=rank,
            world_size=world_size,
            pad_id=pad_id,
            max_patches_per_row=max_patches_per_row,
            on_bad_row=on_bad_row,
            groups=groups,
        )
        self.cutter: Cutter = Cutter(self.settings, family, tokenizer, processor)
        self.source: Source = Source(
            samples, shuffle=self.settings.shuffle, seed=self.settings.seed, groups=self.settings.groups
        )
        self._reset(epoch=0)

    @property
    def family(self) -> Family:
        """The model family of the samples with media (Qwen2-VL unless given; resolved on first use)."""
        return self.cutter.family

    # ----------------------------------------------------------------- state
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
        return row.to_packed_seq_params(pad_between_seqs=self.settings.pad_between_seqs)

    def _config(self) -> dict[str, object]:
        return self.settings.config(self.family.name if self.cutter.named_family else None)

    def _shard(self) -> tuple[int, int, int]:
        """``(share, number of shares, num_workers)`` of the calling (rank, worker)."""
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.settings.rank * nw + wid, self.settings.world_size * nw, nw

    @property
    def num_samples(self) -> int | None:
        """``len()`` of a map-style source (``None``: an iterable one)."""
        return len(self.source.samples) if self.source.map_style else None

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
            "rank": self.settings.rank,
            "world_size": self.settings.world_size,
            "num_workers": nw,
            "shard": shard,
            "num_shards": shards,
            "epoch": self._epoch,
            "end_epoch": self._end_epoch,
            "active": self._active,
            "cursor": self._cursor,
            "stats": self._stats.as_dict(),
            "num_samples": self.num_samples,
            **position(self._buffer, self._ages, self._pending, self._last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s output (taken from a dataset built with the same arguments).

        Raises:
            StateError: not such a state, other arguments, another rank or world size, a
                damaged field, a state saved over other data (checked now: see ``_state``);
                another ``num_workers`` (checked when iteration starts).
        """
        s = self.settings
        check_loadable(state, self._config(), s.rank, s.world_size)
        check_fields(state, s.max_wait)
        order = None
        if self.source.map_style:
            order = self.source.order(state["epoch"], state["shard"], state["num_shards"])
        check_refs(state, order, self.num_samples)
        stats = LoaderStats.from_dict(state["stats"])
        check_stats(
            state,
            stats,
            who="PackingDataset",
            max_seq_len=s.max_seq_len,
            max_wait=s.max_wait,
            max_patches=s.max_patches_per_row,
        )
        self._reset(epoch=int(state["epoch"]))
        self._restore = state
        self._stats = stats

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[PackedBatch]:
        # a worker restored after its share of the loader's pass had ended: that pass gets nothing
        return iter(()) if self._enter_iter(get_worker_info() is not None) else self._rows(self._build)

    def decided_rows(self) -> Iterator[DecidedRow]:
        """What ``iter()`` yields, each row decided but not laid: a :class:`~sftpack.loader.DecidedRow`
        (its sequences' lengths and ids; ``build()`` lays the row ``iter()`` would have yielded).

        The same rows in the same order, the same counts and the same state after each (a state
        taken here resumes ``iter()``, and the reverse). Deciding reads only lengths and patch
        counts, so several consumers of one stream can each run the decisions and lay only the
        rows they take: data-parallel ranks sharing one global stream (``sftpack train --packing
        loader``) lay only the rows dealt to them.
        """
        return iter(()) if self._enter_iter(get_worker_info() is not None) else self._rows(self._decided)

    def _decided(self, row: list[Item]) -> DecidedRow:
        return DecidedRow(row, self._build)

    def _rows(self, lay: Callable[[list[Item]], R]) -> Iterator[R]:
        shard, shards, nw = self._shard()
        n = self.num_samples
        if n is not None and n < shards:
            raise ValueError(too_few(self._share(shard, nw), shards, nw, self.settings.world_size, n))
        need: set[int] = set()
        if self._restore is not None:
            need = self._apply_restore(shard, shards, nw)
        elif self._shard_seen is not None and self._shard_seen != (shard, shards, nw):
            self.set_epoch(self._epoch)
        self._shard_seen = (shard, shards, nw)
        if not self._active:
            self._active = True
            epochs = self.settings.num_epochs
            self._end_epoch = None if epochs is None else self._epoch + epochs
        while self._end_epoch is None or self._epoch < self._end_epoch:
            got, stream = self.source.open(self._epoch, shard, shards, self._cursor, need)
            if self._restore is not None:
                self._rebuild(got)
            need = set()
            fresh = self._cursor == 0 and not self._buffer and not self._pending
            rows, read, dropped = self._stats.rows_out, self._stats.samples_in, self._stats.dropped
            yield from self._run_epoch(Lookahead(stream), lay)
            if fresh and self._stats.rows_out == rows:
                read, dropped = self._stats.samples_in - read, self._stats.dropped - dropped
                share = self._share(shard, nw)
                raise ValueError(
                    no_row(share, self._epoch - 1, shard, shards, read, dropped, self._stats, self.settings.max_seq_len)
                )
        if self._restore is not None:  # restored at the end of its last epoch: nothing to re-read
            self._rebuild({})
        self._active = False

    def _share(self, shard: int, nw: int) -> str:
        """How the refusals of an empty share name it (``_shares``)."""
        return share_name(self.settings.rank, self.settings.world_size, shard, nw, get_worker_info() is not None)
