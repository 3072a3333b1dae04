"""The loader's streaming engine: one share's position and the rounds that move it.

:class:`RowStream` holds where a (rank, worker) share stands in its epoch, which is all a
saved state records (``_state``): the epoch, the cursor into the share, the buffer of items
read but not yet in a row (with the rounds each waited), the decided rows not yet emitted,
the last sample read and the counts. :meth:`RowStream._run_epoch` moves it: fill the buffer
from the share's stream (``_fill``, ``_read``: each source item cut by the dataset's
:class:`~sftpack.loader._cut.Cutter`), plan a round (``_round``:
:func:`~sftpack.loader._round.plan_round`), then emit the decided rows one by one (``_build``:
:func:`~sftpack.loader._row.lay_items`, now or later; ``_emit``: counted), the position updated before each
row is yielded. :class:`~sftpack.loader.PackingDataset` is a ``RowStream`` over a source, with
shares, ``iter()`` and states around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..handoff import PackedBatch, padded_lengths
from ..sample import Overlong, OverlongError, Sample
from ._cut import Cutter
from ._round import plan_round
from ._row import lay_items
from ._settings import LoaderSettings
from ._source import Item, Lookahead, group_of
from ._state import check_pending, check_share, first_iter, refs_needed, restore_items
from ._stats import OVERLONG, LoaderStats

__all__ = ["RowStream"]

R = TypeVar("R")


class RowStream:
    """One share's streaming position (epoch, cursor, buffer, decided rows, counts) and its rounds.

    A subclass sets ``settings`` and ``cutter`` and calls :meth:`_reset` before streaming; a
    loaded state (``_restore``, checked by the subclass) becomes the position when the share
    that saved it starts streaming (:meth:`_apply_restore`, then :meth:`_rebuild` from the
    re-read samples).
    """

    settings: LoaderSettings
    cutter: Cutter

    def _reset(self, epoch: int) -> None:
        """The position at the start of ``epoch``, with fresh counts and nothing to restore."""
        self._epoch = epoch
        self._end_epoch: int | None = None
        self._active = False
        self._cursor = 0
        self._buffer: list[Item] = []
        self._ages: list[int] = []
        self._pending: list[list[Item]] = []
        self._stats = LoaderStats()
        self._last: tuple[int, list[Item]] | None = None  # the last sample read this epoch, and its items
        self._restore: dict[str, Any] | None = None  # a loaded state, applied when iteration starts
        self._skipped = False  # the first iter() after restoring an ended share (see first_iter) ran
        self._shard_seen: tuple[int, int, int] | None = None  # the share the last iter() streamed

    def _enter_iter(self, in_worker: bool) -> bool:
        """What an ``iter()`` settles before it reads: ``True`` when it must yield nothing
        (:func:`~sftpack.loader._state.first_iter`); else, with nothing to restore and no pass
        running, the last ``iter()`` ended (or none ran), so this one starts the next epoch."""
        skip, self._restore = first_iter(self._restore, in_worker, self._skipped)
        if skip:
            self._skipped = True
            return True
        if self._restore is None and not self._active:
            self._end_epoch = None
        return False

    def _apply_restore(self, shard: int, shards: int, nw: int) -> set[int]:
        """The loaded state's position, once the iterating share is found to be the one that saved
        it; returns the source indices to re-read (:meth:`_rebuild` takes them)."""
        st = self._restore
        assert st is not None
        check_share(st, shard, shards, nw, self.settings.rank)
        self._epoch = int(st["epoch"])
        self._end_epoch = st["end_epoch"]
        self._active = bool(st["active"])
        self._cursor = int(st["cursor"])
        return refs_needed(st)

    def _rebuild(self, got: dict[int, object]) -> None:
        """Buffer and decided rows of a restored state, from the re-read samples."""
        assert self._restore is not None
        self._buffer, self._ages, self._pending, self._last = restore_items(
            self._restore, got, lambda i, obj: self.cutter.cut(i, obj).items
        )
        s = self.settings
        check_pending(self._pending, s.pad_multiple, s.max_seq_len, s.max_patches_per_row)
        self._restore = None

    def _run_epoch(self, stream: Lookahead, lay: Callable[[list[Item]], R]) -> Iterator[R]:
        """Rows of the rest of this epoch, each decided row handed to ``lay`` (:meth:`_build`: the
        laid :class:`~sftpack.PackedBatch`; or a :class:`~sftpack.loader.DecidedRow` that lays it
        later); the epoch advances *before* its last row is yielded, so the state after that row
        reads (next epoch, cursor 0)."""
        while True:
            while self._pending:
                row = lay(self._pending[0])
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
        if self.settings.groups:
            self._fill_groups(stream)
            return
        buf, ages = self._buffer, self._ages
        size, width = self.settings.buffer_size, self.settings.max_seq_len
        last: Item | None = None  # the last sample read on the fast path (None: _read recorded it)
        li = 0
        while len(buf) < size and not stream.done:
            taken = stream.take(size - len(buf))
            fast = 0
            for j, (index, obj) in enumerate(taken):
                if len(buf) >= size:  # a split sample filled the buffer early: the rest go back unread
                    stream.unread(taken[j:])
                    break
                if isinstance(obj, Sample) and obj.media is None and "role" not in obj.meta:
                    ids = obj.input_ids
                    n = ids.shape[0]
                    if n <= width:
                        sid = obj.conversation_id
                        last = Item(
                            (index, 0), ids, obj.loss_mask, index if sid is None else sid, n, weights=obj.weights
                        )
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

    def _fill_groups(self, stream: Lookahead) -> None:
        """:meth:`_fill` with ``groups=True``: read whole units (a group's consecutive members, or a
        sample of no group) until the buffer holds ``buffer_size`` sequences or the share ends, so a
        round never plans half a group."""
        size = self.settings.buffer_size
        while len(self._buffer) < size and not stream.done:
            unit = [stream.pop()]
            group = group_of(unit[0][1])
            if group is not None:
                while (head := stream.head) is not None and group_of(head[1]) == group:
                    unit.append(stream.pop())
            if len(unit) == 1 and group is None:
                self._read(*unit[0])
            else:
                self._read_group(group, unit)

    def _read_group(self, group: Any, unit: list[tuple[int, Any]]) -> None:
        """Read a group's members (source items, consecutive): into the buffer whole when their padded
        lengths fit one row, else under the over-long policy as one unit (dropped whole and counted
        under ``overlong="drop"``; a group is never split nor truncated: any other policy raises)."""
        index, first = unit[0]
        want = first.meta.get("group_size")
        if want is not None and want != len(unit):
            raise ValueError(
                f"PackingDataset: group {group!r} (sample {index}) has {len(unit)} member(s) in a row but "
                f"meta['group_size'] = {want}: a group's members follow each other in the source, whole (a pair "
                "is never half); tokenize the pairs with sftpack.chat.tokenize_pair / tokenize_conversations and "
                "keep their order"
            )
        s, stats = self.settings, self._stats
        cuts = [self.cutter.cut(i, obj) for i, obj in unit]
        lengths = [len(obj) for _, obj in unit]
        cost = int(padded_lengths(lengths, s.pad_multiple).sum())
        stats.samples_in += len(unit)
        self._cursor += len(unit)
        self._last = (unit[-1][0], cuts[-1].items)
        if cost <= s.max_seq_len:
            for c in cuts:
                self._buffer.extend(c.items)
                self._ages.extend([0] * len(c.items))
            return
        if s.overlong is not Overlong.DROP:
            raise OverlongError(
                f"PackingDataset: group {group!r} (samples {unit[0][0]}..{unit[-1][0]}: {' + '.join(map(str, lengths))} "
                f"tokens, {cost} padded slots) does not fit one row of max_seq_len={s.max_seq_len}, and a group "
                f"is never split or truncated (overlong={str(s.overlong)!r}): raise max_seq_len, or pass "
                "overlong='drop' (the group left out whole, counted)",
                group,
                sum(lengths),
                s.max_seq_len,
            )
        for n in lengths:
            stats.drop(OVERLONG, n)

    def _read(self, index: int, obj: object) -> None:
        """Read source item ``index``: its items into the buffer, its fate counted."""
        items, lost, reason = self.cutter.cut(index, obj)
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
        wait keep their samples in the buffer, one round older (:func:`plan_round`)."""
        planned = plan_round(self._buffer, self._ages, self.settings, flush=flush)
        stats = self._stats
        stats.rounds += 1
        self._pending.extend(planned.decided)
        stats.max_waited = max(stats.max_waited, planned.waited)
        self._buffer, self._ages = planned.buffer, planned.ages
        stats.held_rows += planned.held_rows

    def _build(self, row: list[Item]) -> PackedBatch:
        s = self.settings
        return lay_items(row, max_seq_len=s.max_seq_len, pad_multiple=s.pad_multiple, pad_id=s.pad_id)

    def _emit(self, row: list[Item]) -> None:
        self._stats.count_row(row, self.settings.max_seq_len)
