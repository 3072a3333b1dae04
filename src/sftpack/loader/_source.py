"""Where a loader's samples come from: one worker's share of one epoch, by index.

A source is either *map-style* (``len()`` and ``[i]``: a list, a Hugging Face
dataset, any ``torch`` map-style dataset) or *iterable* (re-iterable, such as
the output of :func:`sftpack.chat.tokenize_conversations`). Every sample is
named by its index in the source, and that index is all a loader's state
stores: restoring reads the samples again.

Epoch ``e`` visits the map-style source in ``permutation(seed, e)`` order
(``shuffle=True``) or in order; (rank, worker) share ``s`` of ``S`` takes
positions ``s, s + S, s + 2S, ...`` of that order, so the shares are disjoint
and their union is every sample exactly once. An iterable source is read in
order and dealt the same way; resuming it re-reads the stream up to the saved
cursor (O(cursor) reads, no packing), so prefer a map-style source for long
epochs.

:func:`cut_overlong` applies the over-long policy (:class:`sftpack.sample.Overlong`,
shared by every layer) to a sample *before* it is costed (costing before
truncation crashed jobs upstream). Token ids are checked (none negative) on the
row they are laid in, before it is emitted (:func:`first_negative` names the sample).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

import numpy as np

from .._base import positive_int
from ..handoff.payload import Media
from ..sample import Overlong, Sample, as_sample, overlong_spans
from ._state import StateError, digest

__all__ = [
    "Calls",
    "Item",
    "Lookahead",
    "Source",
    "cut_overlong",
    "first_negative",
    "group_of",
    "is_conversation",
    "media_layout",
    "media_options",
]


class Item:
    """One sequence in a loader's buffer: a sample, or one piece of a split sample.

    ``ref`` is ``(source index, piece)``; the state stores only refs. ``start`` is
    the piece's first token in its sample (0 for a whole sample); ``media`` its
    :class:`~sftpack.handoff.payload.Media` (``None``: text only); ``weights`` its per-token
    weights (:attr:`sftpack.Sample.weights`; ``None``: none); ``group`` the group it must share a
    row with (``meta["group"]`` of a preference pair's member, read with ``groups=True``; ``None``:
    none). (A slotted class: the loader makes one per sample, so a dataclass's overhead shows.)
    """

    __slots__ = (
        "_digest",
        "group",
        "input_ids",
        "length",
        "loss_mask",
        "media",
        "ref",
        "sequence_id",
        "start",
        "weights",
    )

    def __init__(
        self,
        ref: tuple[int, int],
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        sequence_id: Any,
        length: int,
        start: int = 0,
        media: Media | None = None,
        weights: np.ndarray | None = None,
        group: Any = None,
    ) -> None:
        self.ref = ref
        self.input_ids = input_ids
        self.loss_mask = loss_mask
        self.sequence_id = sequence_id
        self.length = length
        self.start = start
        self.media = media
        self.weights = weights
        self.group = group
        self._digest: str | None = None

    @property
    def patches(self) -> int:
        """Vision patches of its media (0 without)."""
        return 0 if self.media is None else self.media.num_patches

    def digest(self) -> str:
        """The fingerprint a state records of this sequence (its tokens, id, media layout and weights),
        computed once (a sequence without weights or media fingerprints as a text one always did)."""
        if self._digest is None:
            extra = media_layout(self.media)
            if self.weights is not None:
                extra += (np.ascontiguousarray(self.weights, dtype=np.float64).view(np.int64),)
            self._digest = digest(self.input_ids, self.sequence_id, *extra)
        return self._digest


def media_layout(media: Media | None) -> tuple[np.ndarray, ...]:
    """What a fingerprint covers of a sample's media: each item's patch grid (a patch kind), else
    each item's placeholder run; nothing without media (so a text sample's is the text one)."""
    if media is None:
        return ()
    grid = getattr(media, "grid_thw", None)
    return (grid.cpu().numpy(),) if grid is not None else (media.slots.cpu().numpy(),)


def is_conversation(obj: Any) -> bool:
    """A conversation to tokenize (``{"messages": [...], "id": ...}`` or an object with
    ``.messages``), not a tokenized sample."""
    if isinstance(obj, Mapping):
        return "messages" in obj and "input_ids" not in obj
    return not isinstance(obj, Sample) and hasattr(obj, "messages")


def media_options(who: str, max_patches_per_row: Any, overlong: Overlong, on_bad_row: Any) -> tuple[int | None, str]:
    """The media options every loader class takes, checked: the patch budget (``None`` or a
    positive int; not with ``overlong="truncate"``, which could cut a turn and an image) and
    ``on_bad_row`` (``"error"`` or ``"skip"``)."""
    budget = positive_int("max_patches_per_row", max_patches_per_row, allow_none=True, who=who)
    if budget is not None and overlong is Overlong.TRUNCATE:
        raise ValueError(
            f"{who}: overlong='truncate' is not offered with max_patches_per_row (samples with media: it would "
            "cut a turn and possibly an image): use 'split', 'drop' or 'error'"
        )
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"{who}: on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    return budget, str(on_bad_row)


def cut_overlong(index: int, obj: Any, max_seq_len: int, overlong: Overlong) -> tuple[list[Item], int]:
    """The items of source sample ``index`` under the over-long policy, and the
    tokens it loses (truncated or dropped).

    The ids are not scanned here: a sample's arrays are read when its row is laid,
    and :func:`first_negative` is checked on the laid row then (one pass over the
    ids, while they are in cache, instead of a second one when the sample is read).

    >>> items, lost = cut_overlong(3, list(range(1, 11)), 4, Overlong.SPLIT)
    >>> [i.input_ids.tolist() for i in items], [i.ref for i in items], [i.start for i in items], lost
    ([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]], [(3, 0), (3, 1), (3, 2)], [0, 4, 8], 0)
    """
    s = obj if isinstance(obj, Sample) else as_sample(obj, index)
    sid = s.conversation_id if s.conversation_id is not None else index
    n = s.input_ids.shape[0]
    w = s.weights
    if n <= max_seq_len:  # fits: the sample's own arrays, whole (what the one span (0, n) would slice)
        return [Item((index, 0), s.input_ids, s.loss_mask, sid, n, weights=w)], 0
    spans = overlong_spans(n, max_seq_len, overlong, f"sample {index} (conversation {sid!r})", sid)
    items = [
        Item((index, k), s.input_ids[a:b], s.loss_mask[a:b], sid, b - a, a, weights=None if w is None else w[a:b])
        for k, (a, b) in enumerate(spans)
    ]
    return items, n - sum(b - a for a, b in spans)


def first_negative(row: list[Item]) -> ValueError:
    """The error for the first item of ``row`` that holds a negative token id (the row's
    laid ids were found to hold one), naming its source index, conversation and the
    position in its sample."""
    for it in row:
        ids = it.input_ids
        if ids.shape[0] and np.minimum.reduce(ids) < 0:
            t = int(np.argmin(ids))
            return ValueError(
                f"sample {it.ref[0]} (conversation {it.sequence_id!r}) holds token id {int(ids[t])} at position "
                f"{it.start + t}: token ids must be non-negative (an embedding has no row for a negative id); "
                "tokenize it again with the model's tokenizer, or leave it out"
            )
    raise AssertionError("first_negative: no item of the row holds a negative id")  # pragma: no cover


class Calls:
    """A re-iterable over a callable that returns a fresh iterable of items on each call."""

    def __init__(self, fn: Callable[[], Iterable[Any]]) -> None:
        self.fn = fn

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fn())


class Source:
    """Index-addressed access to the samples of a map-style or re-iterable source, or a callable
    returning a fresh iterable of them on each call."""

    def __init__(self, samples: Any, *, shuffle: bool, seed: int, groups: bool = False) -> None:
        if callable(samples) and not hasattr(samples, "__iter__") and not hasattr(samples, "__getitem__"):
            samples = Calls(samples)
        self.samples = samples
        self.map_style = hasattr(samples, "__getitem__") and hasattr(samples, "__len__")
        if not self.map_style and not isinstance(samples, Iterable):
            raise TypeError(
                f"samples must be a map-style dataset (len() and [i]), an iterable of samples or a callable "
                f"returning one, got {type(samples).__name__}"
            )
        if shuffle and not self.map_style:
            raise ValueError(
                "shuffle=True needs a map-style source (len() and [i]) to permute; an iterable is read in "
                "order: shuffle it upstream or pass a list / map-style dataset"
            )
        self.shuffle = shuffle
        self.seed = seed
        self.groups = groups
        self._units: np.ndarray | None = None  # with groups, map-style: each unit's first index, then len()
        self._opened = False

    def units(self) -> np.ndarray:
        """``(U + 1,)`` the first source index of each unit (a group's consecutive members, or a
        sample of no group), then ``len()``: what ``groups=True`` permutes and deals (map-style;
        read once, every sample's ``meta["group"]``)."""
        if self._units is None:
            starts = []
            prev: Any = None
            opened: dict[Any, int] = {}  # each group's first sample
            for i in range(len(self.samples)):
                g = group_of(self.samples[i])
                if g is None or g != prev:
                    if g is not None and opened.setdefault(g, i) != i:
                        raise ValueError(
                            f"PackingDataset: group {g!r} comes back at sample {i} after other samples (it opened at "
                            f"sample {opened[g]}): groups=True reads a group's members one after the other; give "
                            "each group's samples consecutively (sort the rows by their 'group')"
                        )
                    starts.append(i)
                prev = g
            starts.append(len(self.samples))
            self._units = np.asarray(starts, dtype=np.int64)
        return self._units

    def order(self, epoch: int, shard: int, num_shards: int) -> np.ndarray:
        """Source indices of one share of epoch ``epoch``, in reading order (map-style only).

        With ``groups``, the units (:meth:`units`) are permuted and dealt, each unit's members
        following each other in source order, so a group is read whole by one share."""
        if self.groups:
            starts = self.units()
            u = starts.shape[0] - 1
            perm = np.random.default_rng([self.seed, epoch]).permutation(u) if self.shuffle else np.arange(u)
            mine = perm[shard::num_shards]
            sizes = starts[mine + 1] - starts[mine]
            base = np.repeat(starts[mine] - np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes)
            return base + np.arange(int(sizes.sum()), dtype=np.int64)
        n = len(self.samples)
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
        else:
            perm = np.arange(n, dtype=np.int64)
        return perm[shard::num_shards]

    def open(
        self, epoch: int, shard: int, num_shards: int, start: int, need: set[int]
    ) -> tuple[dict[int, Any], Iterator[tuple[int, Any]]]:
        """``(samples of the indices in need, iterator of (index, sample) of the share from position start)``.

        ``need`` are indices read before ``start`` (a restored buffer's).
        """
        got: dict[int, Any]
        if self.map_style:
            mine = self.order(epoch, shard, num_shards)
            got = {i: self.samples[i] for i in sorted(need)}
            return got, ((i, self.samples[i]) for i in mine[start:].tolist())
        if self.groups and num_shards > 1:
            raise ValueError(
                f"groups=True deals whole groups to the {num_shards} shares (ranks x DataLoader workers), which "
                "needs a map-style source (len() and [i]) to find them: pass a list or a map-style dataset, or "
                "read the iterable in one share (world_size=1, num_workers=0)"
            )
        it = iter(self.samples)
        if it is self.samples and self._opened:
            raise ValueError(
                "samples is a one-shot iterator, so it cannot be read for a second epoch or a resume: pass a "
                "re-iterable (a list, a map-style dataset, or sftpack.chat.tokenize_conversations output)"
            )
        self._opened = True
        got = {}
        own = 0
        for i, obj in enumerate(it):
            if i % num_shards != shard:
                continue
            if own >= start:
                return got, _chain_first((i, obj), _own(it, i + 1, shard, num_shards))
            if i in need:
                got[i] = obj
            own += 1
        if start > own:  # a restored cursor beyond the share: other (shorter) data
            raise StateError(
                f"the state's cursor is {start} but share {shard} of {num_shards} holds {own} samples in this "
                "stream: the state was saved over other data; resume with the same samples in the same order"
            )
        return got, iter(())


def group_of(obj: Any) -> Any:
    """The group a source item belongs to: ``meta["group"]`` of a :class:`~sftpack.Sample` (a
    preference pair's member, :func:`sftpack.chat.tokenize_pair`; a prompt's RL completions, a
    row's ``group``), else ``None``."""
    meta = obj.meta if isinstance(obj, Sample) else None
    return meta.get("group") if meta else None


def _own(it: Iterator[Any], first: int, shard: int, num_shards: int) -> Iterator[tuple[int, Any]]:
    for i, obj in enumerate(it, start=first):
        if i % num_shards == shard:
            yield i, obj


def _chain_first(head: tuple[int, Any], rest: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    yield head
    yield from rest


class Lookahead:
    """An iterator with its next item read ahead, so the end of a share is known before
    its last row is emitted. The read-ahead sample is not consumed (the cursor does not
    count it): a resume reads it again. Items taken but not used can be put back
    (:meth:`unread`); they come out again first, in order."""

    def __init__(self, it: Iterator[tuple[int, Any]]) -> None:
        self._it = it
        self._back: deque[tuple[int, Any]] = deque()
        self._head = next(it, None)

    @property
    def done(self) -> bool:
        return self._head is None

    @property
    def head(self) -> tuple[int, Any] | None:
        """The next item :meth:`pop` gives (``None``: the stream is done), not consumed."""
        return self._head

    def _next(self) -> tuple[int, Any] | None:
        return self._back.popleft() if self._back else next(self._it, None)

    def pop(self) -> tuple[int, Any]:
        head = self._head
        assert head is not None
        self._head = self._next()
        return head

    def take(self, k: int) -> list[tuple[int, Any]]:
        """The next ``k`` items (fewer at the end of the stream), as :meth:`pop` would give them."""
        head = self._head
        if head is None or k <= 0:
            return []
        out = [head]
        back = self._back
        while back and len(out) < k:
            out.append(back.popleft())
        if len(out) < k:
            out.extend(islice(self._it, k - len(out)))
        self._head = self._next()
        return out

    def unread(self, items: list[tuple[int, Any]]) -> None:
        """Put ``items`` (the last taken, in order) back in front of the stream."""
        if not items:
            return
        if self._head is not None:
            self._back.appendleft(self._head)
        self._back.extendleft(reversed(items[1:]))
        self._head = items[0]
