"""Context parallelism: one packed row cut over ``CP`` ranks, and put back together.

Each padded sequence is cut into ``2*CP`` equal chunks; rank ``r`` takes chunks
``r`` and ``2*CP-1-r``. Under a causal mask early chunks are cheap and late ones
expensive, so pairing them balances the attention work. The worked example of
the contract (A: 5 tokens, B: 10, each padded to a multiple of 4, ``CP=2``)::

    global row    A0 A1 A2 A3 A4 .  .  . | B0 B1 B2 B3 B4 B5 B6 B7 B8 B9 .  .
    chunks        [ 0 ][ 1 ][ 2 ][ 3 ]   | [  0  ][  1  ][  2  ][  3  ]
    rank 0        A0 A1          .  .    | B0 B1 B2                B9 .  .      chunks 0, 3
    rank 1              A2 A3 A4 .       |          B3 B4 B5 B6 B7 B8           chunks 1, 2

What a rank's :class:`CPShard` holds (a :class:`~sftpack.PackedBatch` subclass):

- ``input_ids``, ``labels`` (and ``weights``, when the row has them): the global row's
  values at the rank's slots. Labels
  were shifted on the whole row, so a slot at the end of chunk ``r`` keeps its
  target (the first token of chunk ``r+1``, held by another rank): the shard's
  loss is exactly its share of the row's loss. Sum the shards' losses and counts
  over the CP group (see :mod:`sftpack.loss`).
- ``position_ids``: each slot's position in its *whole* sequence (A0 A1 A6 A7 ->
  0 1 6 7), what rotary or absolute position embeddings need; Megatron slices
  ``position_ids`` the same way.
- ``cu_seqlens_padded``: rank-local offsets, the padded lengths divided by ``CP``
  and cumulated (``[0, 4, 10]`` above), ``T_local = T / CP``.
- ``cu_seqlens``: how many real tokens of each sequence this rank holds (rank 0:
  ``[0, 2, 6]``, rank 1: ``[0, 3, 9]``). They always lie at the start of the
  rank's segment (chunk ``r`` fills before chunk ``2*CP-1-r`` holds anything), so
  ``shard.real_token_mask`` and a real-prefix reading work; a count can be 0 when
  a segment is mostly padding.
- ``slot_index``: ``(T_local,)`` the global slot of each local slot (the map that
  gathers and scatters per-slot values), and ``global_cu_seqlens``,
  ``global_cu_seqlens_padded``, ``global_max_seqlen``, ``cp_size``, ``cp_rank``.

A row with media (images, video frames: any :class:`~sftpack.handoff.payload.Media`) is
sharded too; what the vision features need is this. The tower attends within each whole
item (bidirectionally over its patches), so an item cannot be cut: a rank runs the
tower over every item *whose placeholder run reaches its slots*, whole (an item whose
run a chunk boundary cuts runs on each rank that holds part of it; an item wholly on
other ranks does not run here), and ``feature_index`` picks, for each of its
placeholder slots in local order, the feature it takes. So a rank's embeddings, and the gradients that flow
back into the tower, are exactly its slots' share of the row's; summing the parameter
gradients over the CP group gives the row's (items on two ranks contribute each
feature's gradient once, from the rank that holds that placeholder). In the example, if
B3..B6 were one image's run, rank 1 alone runs its tower; were it B1..B4, both ranks
would, rank 0 taking features 0, 1 (slots B1 B2) and rank 1 features 2, 3.

- ``media``: the row's media of the held items only (their pixels and grids), in row
  order; its ``slots`` and ``sequence`` are the items' runs and segments *in the whole
  row* (a run is cut in local order), and its multimodal positions (MRoPE; any leading
  shape, the slot axis last) are the row's at the rank's slots, sharded with the tokens:
  ``shard.media.hf_kwargs(shard.position_ids)`` gives Qwen2-VL's ``(4, 1, T/CP)`` form.
- ``media_items``: ``(I_held,)`` int64, the held items' indices in the row's media.
- ``feature_index``: ``(P_local,)`` int64: for each placeholder slot of the shard, in local
  order, its feature among the held items' features concatenated in item order (placeholder
  ``k`` of an item's run takes its feature ``k``): ``features[shard.feature_index]`` is what
  the embedding scatter of the rank's tokens takes (:func:`sftpack.multimodal.cp_hidden`).

The kernel adapter :meth:`CPShard.to_packed_seq_params` returns the *global*
boundaries: Transformer Engine's context-parallel attention takes the whole
sequences' ``cu_seqlens`` / ``cu_seqlens_padded`` and finds each rank's chunks
itself (``thd_get_partitioned_indices`` is the same map as ``slot_index``).

Why :class:`CPShard` is a :class:`~sftpack.PackedBatch` subclass, not a type of
its own: the contract promises that ``shard_for_cp`` returns the rank's
``PackedBatch``, and everything that reads per-slot data works on a shard
unchanged (the loss, ``segment_ids``, ``real_token_mask``, ``.to()``,
``pin_memory()``, and Megatron's ``PackedSeqParams``, which takes the
*global* boundaries and which :meth:`CPShard.to_packed_seq_params` returns).
What differs is exactly two things, both overridden here rather than hidden:

- ``validate()``: no shard satisfies the plain invariants. The label at the end
  of chunk ``r`` legitimately points into chunk ``r+1``; the plain rule would
  demand ``-100`` there (it is the last local real token) and drop targets from
  the loss. The shard checks its own invariants: every field recomputed from the
  global boundaries, padding labelled ``-100``.
- the standalone adapters (``to_hf_kwargs``, ``flash_attn_kwargs``,
  ``hf_labels``) treat each segment as a whole sequence attending only to
  itself; a chunk needs the other ranks' keys and values, so they raise with
  the two ways forward (Transformer Engine with the global boundaries, or
  ``unshard_cp``). Composition would drop the ``PackedBatch`` promise to remove
  three methods; a subclass keeps the promise and says no where it must.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn, overload

import torch

from .._base import non_negative_int, positive_int
from ..sample import IGNORE_INDEX
from .batch import PackedBatch, check_slot_weights, packed_seq_params
from .errors import PackedBatchError
from .payload import Media

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["CPShard", "cp_slot_indices", "shard_for_cp", "unshard_cp"]


def _check_cp(cp_size: object, cp_rank: object = 0) -> tuple[int, int]:
    cp_size = positive_int("cp_size", cp_size, error=PackedBatchError)
    cp_rank = non_negative_int("cp_rank", cp_rank, error=PackedBatchError)
    if cp_rank >= cp_size:
        raise PackedBatchError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    return cp_size, cp_rank


def _check_divisible(cup: torch.Tensor, cp_size: int) -> None:
    """Every padded length must split into ``2*CP`` equal chunks (one host read)."""
    if cp_size == 1:
        return
    padded = (cup[1:] - cup[:-1]).long()
    bad = torch.nonzero(padded % (2 * cp_size)).reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise PackedBatchError(
            f"context parallelism {cp_size} cuts each sequence into 2*CP = {2 * cp_size} chunks, but segment {i} "
            f"has padded length {int(padded[i])} (cu_seqlens_padded[{i}:{i + 2}] = {cup[i : i + 2].tolist()}); pack "
            f"with pad_multiple a multiple of {2 * cp_size} (pad_multiple_for(cp_size={cp_size}).seq_multiple), and a "
            "fixed width / row multiple that keeps the last segment aligned too"
        )


@dataclass
class _Layout:
    slot: torch.Tensor  # (T/CP,) global slot of each local slot
    position: torch.Tensor  # (T/CP,) position of the slot in its whole sequence
    local_cu: torch.Tensor  # (N+1,) int64 real tokens held, cumulated
    local_cup: torch.Tensor  # (N+1,) int64 local padded lengths, cumulated
    global_real: torch.Tensor  # (T/CP,) real length of the slot's sequence


def _layout(cu: torch.Tensor, cup: torch.Tensor, T: int, cp: int, r: int) -> _Layout:
    """The rank's slots, computed with tensor ops only (no host sync: ``T/CP`` is known)."""
    dev = cup.device
    padded = (cup[1:] - cup[:-1]).long()
    real = (cu[1:] - cu[:-1]).long()
    n = padded.shape[0]
    if cp == 1:
        chunk = padded  # one chunk of the whole segment; nothing moves
        local_padded = padded
    else:
        chunk = padded // (2 * cp)
        local_padded = 2 * chunk
    T_local = T // cp
    local_cup = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(local_padded, 0, out=local_cup[1:])
    seg = torch.repeat_interleave(torch.arange(n, device=dev), local_padded, output_size=T_local)
    q = torch.arange(T_local, device=dev) - local_cup[seg]
    k = chunk[seg]
    if cp == 1:
        position = q
        held = real
    else:
        first = q < k
        position = torch.where(first, r * k + q, (2 * cp - 1 - r) * k + (q - k))
        held = (real - r * chunk).clamp(0).minimum(chunk) + (real - (2 * cp - 1 - r) * chunk).clamp(0).minimum(chunk)
    local_cu = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(held, 0, out=local_cu[1:])
    return _Layout(cup.long()[seg] + position, position, local_cu, local_cup, real[seg])


def _boundaries(packed_or_cup: PackedBatch | torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    if isinstance(packed_or_cup, CPShard):
        raise PackedBatchError("pass the whole row's PackedBatch, not a CPShard")
    if isinstance(packed_or_cup, PackedBatch):
        return packed_or_cup.cu_seqlens, packed_or_cup.cu_seqlens_padded, packed_or_cup.num_tokens
    if isinstance(packed_or_cup, torch.Tensor) and packed_or_cup.dim() == 1 and packed_or_cup.numel() >= 2:
        return None, packed_or_cup, int(packed_or_cup[-1])
    raise PackedBatchError(
        f"expected a PackedBatch or its cu_seqlens_padded (N+1,), got {type(packed_or_cup).__name__}"
    )


def cp_slot_indices(packed: PackedBatch | torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``(T/CP,)`` int64: the global slots rank ``cp_rank`` holds, in its local order.

    ``packed`` is the whole row (or its ``cu_seqlens_padded``). ``values[idx]`` gives a
    rank its share of any per-slot tensor; ``full[idx] = local`` scatters it back.

    >>> cp_slot_indices(torch.tensor([0, 8, 20], dtype=torch.int32), 2, 0).tolist()
    [0, 1, 6, 7, 8, 9, 10, 17, 18, 19]
    """
    cp, r = _check_cp(cp_size, cp_rank)
    cu, cup, T = _boundaries(packed)
    _check_divisible(cup, cp)
    if cu is None:
        cu = cup  # only the slots are asked for; real counts do not matter
    return _layout(cu, cup, T, cp, r).slot


def _is_placeholder(media: Media, input_ids: torch.Tensor) -> torch.Tensor:
    """``input_ids``' slots that hold any of ``media``'s placeholders (an image's, a video's)."""
    every = torch.tensor(media._placeholder_ids(), dtype=input_ids.dtype, device=input_ids.device)
    return torch.isin(input_ids, every)


def _placeholders(
    media: Media, input_ids: torch.Tensor, slot: torch.Tensor, runs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The placeholder slots among a rank's (``input_ids`` at global ``slot``), in local order:
    ``(global slot, item, offset in the item's run)``; ``runs``: the items' ``(start, length)``."""
    at = slot[_is_placeholder(media, input_ids)]
    if not runs.shape[0]:
        return at, torch.full_like(at, -1), at
    item = torch.searchsorted(runs[:, 0].contiguous(), at, right=True) - 1
    return at, item, at - runs[item.clamp(min=0), 0]


def _feature_index(item: torch.Tensor, offset: torch.Tensor, runs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(held items, feature_index)``: the items the placeholders reach (increasing), and each
    placeholder's feature among the held items' features laid end to end in item order."""
    held = torch.unique(item)
    lengths = runs[held, 1]
    first = torch.cumsum(lengths, 0) - lengths
    return held, first[torch.searchsorted(held, item)] + offset


def _no_positions(media: Media) -> Media:
    """``media`` without its multimodal positions (a kind that has them), so that selecting
    items never reads positions of slots the owner does not hold."""
    return replace(media, positions=None) if getattr(media, "positions", None) is not None else media  # type: ignore[call-arg]


def _items(media: Media, keep: torch.Tensor) -> Media:
    """The items ``keep`` of ``media`` (their pixels and grids), runs and segments unchanged, no positions."""
    bare = _no_positions(media)
    return replace(bare, slots=bare.slots[keep], sequence=bare.sequence[keep], **bare._piece(keep, 0, 0))


def _shard_media(media: Media, input_ids: torch.Tensor, slot: torch.Tensor) -> tuple[Media, torch.Tensor, torch.Tensor]:
    """A rank's ``(media, media_items, feature_index)`` (see the module docstring)."""
    _, item, offset = _placeholders(media, input_ids, slot, media.slots)
    held, feature_index = _feature_index(item, offset, media.slots)
    out = _items(media, held)
    positions = getattr(media, "positions", None)
    if positions is not None:
        out = replace(out, positions=positions[..., slot])  # type: ignore[call-arg]
    return out, held, feature_index


def _unshard_media(shards: Sequence[CPShard], cup: torch.Tensor, cp: int) -> Media | None:
    """The row's media from every rank's: each item from the first rank that holds it, the
    multimodal positions put back in row order."""
    if all(s.media is None for s in shards):
        return None
    held = [s.media_items for s in shards]
    if any(s.media is None for s in shards) or any(h is None for h in held):
        raise PackedBatchError("unshard_cp: some shards carry media and some do not; give shards of one row")
    medias = [s.media for s in shards]
    n = max((int(h.max()) + 1 for h in held if h is not None and h.numel()), default=0)
    parts: list[Media] = []
    for g in range(n):
        r = next((r for r, h in enumerate(held) if h is not None and bool((h == g).any())), None)
        if r is None:
            raise PackedBatchError(f"unshard_cp: no shard holds media item {g}; give all ranks' shards")
        m, h = medias[r], held[r]
        assert m is not None and h is not None
        parts.append(_items(m, (h == g).nonzero().reshape(-1)))
    first = medias[0]
    assert first is not None
    zeros = [0] * n
    if n:
        out = type(first).lay(parts, lengths=zeros, offsets=zeros, widths=zeros, segments=zeros)
    else:  # media without items (a row of text-only samples)
        out = _items(first, torch.zeros(0, dtype=torch.int64, device=first.slots.device))
    positions = [getattr(m, "positions", None) for m in medias]
    if positions[0] is not None:
        whole = unshard_cp([p.movedim(-1, 0) for p in positions if p is not None], cup, cp)
        out = replace(out, positions=whole.movedim(0, -1))  # type: ignore[call-arg]
    return out


def _unshard_weights(shards: Sequence[CPShard], cup: torch.Tensor, cp: int) -> torch.Tensor | None:
    """The row's weights from every rank's (``None`` when no shard has any)."""
    w = [s.weights for s in shards]
    if all(x is None for x in w):
        return None
    if any(x is None for x in w):
        raise PackedBatchError("unshard_cp: some shards carry weights and some do not; give shards of one row")
    return unshard_cp([x for x in w if x is not None], cup, cp)


def _listed(t: torch.Tensor | None) -> list | None:
    return None if t is None else t.tolist()


@dataclass(eq=False)
class CPShard(PackedBatch):
    """One context-parallel rank's share of a packed row (see the module docstring).

    Extra attributes:
        cp_size, cp_rank: the layout.
        slot_index: ``(T/CP,)`` int64 global slot of each local slot.
        global_cu_seqlens, global_cu_seqlens_padded: ``(N+1,)`` int32, the whole row's
            boundaries (what Transformer Engine's CP attention takes).
        global_max_seqlen: the whole row's ``max_seqlen``.
        media_items, feature_index: on a row with media, the held items and the feature of
            each placeholder slot (``media`` then holds the held items; see the module docstring).
    """

    cp_size: int = 1
    cp_rank: int = 0
    slot_index: torch.Tensor | None = None
    global_cu_seqlens: torch.Tensor | None = None
    global_cu_seqlens_padded: torch.Tensor | None = None
    global_max_seqlen: int = 0
    media_items: torch.Tensor | None = None
    feature_index: torch.Tensor | None = None

    @property
    def real_token_mask(self) -> torch.Tensor:
        """``(T/CP,)`` bool: True on real tokens (by global position and length)."""
        lay = self._layout()
        return lay.position < lay.global_real

    @property
    def placeholder_mask(self) -> torch.Tensor:
        """``(T/CP,)`` bool: the shard's placeholder slots (of any item kind); in local order they
        take the features ``feature_index`` names. All False without media."""
        if self.media is None:
            return torch.zeros_like(self.input_ids, dtype=torch.bool)
        return _is_placeholder(self.media, self.input_ids)

    @property
    def global_num_tokens(self) -> int:
        return int(self.num_tokens * self.cp_size)

    def _layout(self) -> _Layout:
        if self.global_cu_seqlens is None or self.global_cu_seqlens_padded is None:
            raise PackedBatchError("CPShard lacks its global boundaries; build it with shard_for_cp")
        return _layout(
            self.global_cu_seqlens, self.global_cu_seqlens_padded, self.global_num_tokens, self.cp_size, self.cp_rank
        )

    def __repr__(self) -> str:
        return (
            f"CPShard(rank {self.cp_rank}/{self.cp_size}, T_local={self.num_tokens}, N={self.num_sequences}, "
            f"cu_seqlens={self.cu_seqlens.tolist()}, cu_seqlens_padded={self.cu_seqlens_padded.tolist()}, "
            f"global cu_seqlens_padded={_listed(self.global_cu_seqlens_padded)}"
            + (f", media_items={_listed(self.media_items)}" if self.media is not None else "")
            + ")"
        )

    def validate(self) -> CPShard:
        """Check the shard's invariants; raise :class:`PackedBatchError` naming the field.

        The global boundaries must be a valid contract row (starts at 0, real
        lengths >= 1, padded >= real, every padded length a multiple of ``2*CP``);
        ``slot_index``, ``position_ids``, ``cu_seqlens`` and ``cu_seqlens_padded``
        must be exactly what :func:`shard_for_cp` computes from them; padding slots
        and the last real token of each sequence carry ``-100``. With media: every
        placeholder slot lies in a held item's run, every held item is reached, and
        ``feature_index`` and the positions' slot axis are the rank's.
        """
        cp, r = _check_cp(self.cp_size, self.cp_rank)
        gcu, gcup = self.global_cu_seqlens, self.global_cu_seqlens_padded
        if gcu is None or gcup is None or self.slot_index is None:
            raise PackedBatchError("CPShard lacks slot_index or its global boundaries; build it with shard_for_cp")
        T = self.num_tokens * cp
        # The global boundaries as a contract row of T slots (labels and positions
        # are not needed for that part of the check).
        PackedBatch(
            input_ids=torch.zeros(T, dtype=torch.int64, device=gcu.device),
            labels=torch.full((T,), IGNORE_INDEX, dtype=torch.int64, device=gcu.device),
            position_ids=torch.arange(T, device=gcu.device)
            - torch.repeat_interleave(gcup[:-1].long(), (gcup[1:] - gcup[:-1]).long(), output_size=T),
            cu_seqlens=gcu,
            cu_seqlens_padded=gcup,
            max_seqlen=self.global_max_seqlen,
        ).validate()
        _check_divisible(gcup, cp)
        for name, t in (("input_ids", self.input_ids), ("labels", self.labels), ("position_ids", self.position_ids)):
            if t.dim() != 1 or t.dtype != torch.int64 or t.shape[0] != self.num_tokens:
                raise PackedBatchError(
                    f"CPShard.{name} must be int64 of shape ({self.num_tokens},), got {t.dtype} {tuple(t.shape)}"
                )
        lay = self._layout()
        for name, have, want in (
            ("slot_index", self.slot_index, lay.slot),
            ("position_ids", self.position_ids, lay.position),
            ("cu_seqlens", self.cu_seqlens, lay.local_cu),
            ("cu_seqlens_padded", self.cu_seqlens_padded, lay.local_cup),
        ):
            if have.shape != want.shape or not torch.equal(have.long(), want):
                raise PackedBatchError(
                    f"CPShard.{name} = {have.tolist()[:16]} does not match rank {r} of CP={cp} over the global "
                    f"boundaries (expected {want.tolist()[:16]})"
                )
        for name, t in (("cu_seqlens", self.cu_seqlens), ("cu_seqlens_padded", self.cu_seqlens_padded)):
            if t.dtype != torch.int32:
                raise PackedBatchError(f"CPShard.{name} must be int32, got {t.dtype}")
        local_max = int((lay.local_cup[1:] - lay.local_cup[:-1]).max())
        if int(self.max_seqlen) < local_max:
            raise PackedBatchError(f"CPShard.max_seqlen = {self.max_seqlen} < largest local segment {local_max}")
        must_ignore = lay.position >= lay.global_real - 1  # padding and each sequence's last real token
        wrong = torch.nonzero(must_ignore & (self.labels != IGNORE_INDEX)).reshape(-1)
        if wrong.numel():
            k = int(wrong[0])
            raise PackedBatchError(
                f"CPShard.labels[{k}] = {int(self.labels[k])} but local slot {k} (global slot "
                f"{int(lay.slot[k])}) is padding or a sequence's last real token; its label must be {IGNORE_INDEX}"
            )
        if self.weights is not None:
            check_slot_weights(self.weights, self.labels, "CPShard")
        if self.media is not None:
            self._validate_media(self.media)
        return self

    def _validate_media(self, media: Media) -> None:
        held, fi = self.media_items, self.feature_index
        if held is None or fi is None:
            raise PackedBatchError(
                "CPShard.media needs media_items and feature_index; build the shard with shard_for_cp"
            )
        n = media.num_items
        if held.shape != (n,) or (n > 1 and bool((held[1:] <= held[:-1]).any())) or (n and int(held[0]) < 0):
            raise PackedBatchError(
                f"CPShard.media_items = {held.tolist()[:16]} must be the {n} held items' indices in the row, increasing"
            )
        assert self.slot_index is not None
        at, item, offset = _placeholders(media, self.input_ids, self.slot_index, media.slots)
        outside = item < 0
        if n:
            outside |= offset >= media.slots[item.clamp(min=0), 1]
        if bool(outside.any()):
            k = int(outside.nonzero()[0, 0])
            raise PackedBatchError(
                f"CPShard.input_ids holds a placeholder at global slot {int(at[k])}, in no run of "
                f"the shard's media items (runs {media.slots.tolist()[:8]}): shard the row with shard_for_cp"
            )
        reached, want = _feature_index(item, offset, media.slots)
        if reached.shape[0] != n:
            raise PackedBatchError(
                f"CPShard.media holds {n} items but the rank's placeholders reach {reached.shape[0]}: hold exactly "
                "the items with a placeholder on this rank (shard the row with shard_for_cp)"
            )
        if fi.shape != want.shape or not torch.equal(fi, want):
            raise PackedBatchError(
                f"CPShard.feature_index = {fi.tolist()[:16]} does not match the rank's placeholders "
                f"(expected {want.tolist()[:16]})"
            )
        positions = getattr(media, "positions", None)
        if positions is not None and positions.shape[-1] != self.num_tokens:
            raise PackedBatchError(
                f"CPShard.media.positions has shape {tuple(positions.shape)}: its slot axis (last) must be the "
                f"rank's T/CP = {self.num_tokens}"
            )

    # ------------------------------------------------------------- adapters
    def to_packed_seq_params(self, pad_between_seqs: bool = True, *, cp_group: Any = None) -> PackedSeqParams:
        """Megatron ``PackedSeqParams`` with the *global* boundaries.

        Transformer Engine's context-parallel THD attention takes the whole
        sequences' ``cu_seqlens`` (and ``cu_seqlens_padded``) on every CP rank and
        works out each rank's chunks itself; feed it this shard's ``input_ids`` /
        ``position_ids`` and these parameters.

        ``cp_group``: dynamic context parallelism (a CP size chosen per micro-batch,
        :func:`sftpack.balance.dynamic_cp`): the process group of this micro-batch's ranks
        (``dist.new_group(mb.cp_group_ranks)``). Given, the parameters carry it and the
        shard's ``cp_size`` as ``cp_group`` and ``local_cp_size``, the fields Megatron's
        attention reads in place of the model's fixed CP group.
        """
        assert self.global_cu_seqlens is not None and self.global_cu_seqlens_padded is not None
        params = packed_seq_params(
            self.global_cu_seqlens, self.global_cu_seqlens_padded, self.global_max_seqlen, pad_between_seqs
        )
        if cp_group is not None:
            params.local_cp_size = int(self.cp_size)
            params.cp_group = cp_group
        return params

    def _no_standalone(self, what: str) -> NoReturn:
        raise PackedBatchError(
            f"CPShard.{what}: a context-parallel shard is not a set of whole sequences (its chunks need the other "
            "ranks' keys and values); use to_packed_seq_params() with Transformer Engine, or unshard_cp the row"
        )

    def hf_labels(self) -> torch.Tensor:
        return self._no_standalone("hf_labels")

    def to_hf_kwargs(self) -> dict[str, Any]:
        return self._no_standalone("to_hf_kwargs")

    def flash_attn_kwargs(self) -> dict[str, Any]:
        return self._no_standalone("flash_attn_kwargs")


def shard_for_cp(packed: PackedBatch, cp_size: int, cp_rank: int) -> CPShard:
    """Rank ``cp_rank``'s share of a packed row under context parallelism ``cp_size``.

    Args:
        packed: the whole row; every padded length a multiple of ``2*cp_size``
            (pack with ``pad_multiple=pad_multiple_for(cp_size=...).seq_multiple``).
        cp_size: context-parallel size; 1 returns the whole row as a shard.
        cp_rank: this rank, ``0 <= cp_rank < cp_size``.

    Returns:
        A :class:`CPShard` of ``T / cp_size`` slots (see the module docstring for
        what each field holds). One host read checks divisibility; the rest is
        tensor operations on the row's device. A row with media: the shard holds the
        media of the items its placeholders reach, their ``media_items`` and each
        placeholder's ``feature_index``, and the multimodal positions at its slots
        (selecting the items reads their count on the host).

    Raises:
        PackedBatchError: a padded length not divisible by ``2*cp_size`` (naming
            the segment and its length), or a bad ``cp_size`` / ``cp_rank``.

    >>> from sftpack.testing import samples_from_lengths
    >>> row = PackedBatch.from_samples(samples_from_lengths([5, 10]), pad_multiple=4)
    >>> s = shard_for_cp(row, cp_size=2, cp_rank=0)
    >>> s.input_ids.tolist()  # A[0:2], A[6:8] (padding), B[0:3], B[9:12]
    [1000, 1001, 0, 0, 2000, 2001, 2002, 2009, 0, 0]
    >>> s.position_ids.tolist(), s.cu_seqlens.tolist(), s.cu_seqlens_padded.tolist()
    ([0, 1, 6, 7, 0, 1, 2, 9, 10, 11], [0, 2, 6], [0, 4, 10])
    """
    if isinstance(packed, CPShard):
        raise PackedBatchError("shard_for_cp takes the whole row; this is already a CPShard")
    cp, r = _check_cp(cp_size, cp_rank)
    _check_divisible(packed.cu_seqlens_padded, cp)
    lay = _layout(packed.cu_seqlens, packed.cu_seqlens_padded, packed.num_tokens, cp, r)
    local_max = int(packed.max_seqlen) // cp  # >= every local padded length, no sync
    input_ids = packed.input_ids[lay.slot]
    media, held, feature_index = (None, None, None)
    if packed.media is not None:
        media, held, feature_index = _shard_media(packed.media, input_ids, lay.slot)
    return CPShard(
        input_ids=input_ids,
        labels=packed.labels[lay.slot],
        weights=None if packed.weights is None else packed.weights[lay.slot],
        position_ids=lay.position,
        cu_seqlens=lay.local_cu.to(torch.int32),
        cu_seqlens_padded=lay.local_cup.to(torch.int32),
        max_seqlen=max(local_max, 1),
        sequence_ids=packed.sequence_ids,
        cp_size=cp,
        cp_rank=r,
        slot_index=lay.slot,
        global_cu_seqlens=packed.cu_seqlens,
        global_cu_seqlens_padded=packed.cu_seqlens_padded,
        global_max_seqlen=int(packed.max_seqlen),
        media=media,
        media_items=held,
        feature_index=feature_index,
    )


@overload
def unshard_cp(
    pieces: Sequence[CPShard], packed: PackedBatch | torch.Tensor | None = None, cp_size: int | None = None
) -> PackedBatch: ...


@overload
def unshard_cp(
    pieces: Sequence[torch.Tensor] | torch.Tensor,
    packed: PackedBatch | torch.Tensor | None = None,
    cp_size: int | None = None,
) -> torch.Tensor: ...


def unshard_cp(
    pieces: Sequence[CPShard] | Sequence[torch.Tensor] | torch.Tensor,
    packed: PackedBatch | torch.Tensor | None = None,
    cp_size: int | None = None,
) -> PackedBatch | torch.Tensor:
    """Put a row back together from every CP rank's piece (the inverse of sharding).

    Args:
        pieces: in rank order, either the ranks' :class:`CPShard` objects (returns
            the whole :class:`~sftpack.PackedBatch`), or per-slot values of each
            shard, ``(T/CP, ...)`` each, as a list or stacked ``(CP, T/CP, ...)``
            (what ``all_gather`` yields; returns ``(T, ...)`` in the row's order).
        packed: the whole row (or its ``cu_seqlens_padded``); needed for values,
            not for shards (they carry the global boundaries).
        cp_size: defaults to the number of pieces.

    >>> from sftpack.testing import samples_from_lengths
    >>> row = PackedBatch.from_samples(samples_from_lengths([5, 10]), pad_multiple=4)
    >>> parts = [row.input_ids[cp_slot_indices(row, 2, r)] for r in range(2)]
    >>> torch.equal(unshard_cp(parts, row), row.input_ids)
    True
    """
    items: list[CPShard | torch.Tensor] = list(pieces.unbind(0)) if isinstance(pieces, torch.Tensor) else list(pieces)
    if not items:
        raise PackedBatchError("unshard_cp needs one piece per CP rank, got none")
    cp = len(items) if cp_size is None else cp_size
    if len(items) != cp:
        raise PackedBatchError(
            f"unshard_cp: got {len(items)} pieces for cp_size={cp}; give one per rank, in rank order"
        )
    if all(isinstance(p, CPShard) for p in items):
        shards = [p for p in items if isinstance(p, CPShard)]
        for r, s in enumerate(shards):
            if s.cp_rank != r or s.cp_size != cp:
                raise PackedBatchError(
                    f"unshard_cp: piece {r} is rank {s.cp_rank} of CP={s.cp_size}; give all {cp} ranks in rank order"
                )
        first = shards[0]
        assert first.global_cu_seqlens is not None and first.global_cu_seqlens_padded is not None
        cup = first.global_cu_seqlens_padded
        return PackedBatch(
            input_ids=unshard_cp([s.input_ids for s in shards], cup, cp),
            labels=unshard_cp([s.labels for s in shards], cup, cp),
            position_ids=unshard_cp([s.position_ids for s in shards], cup, cp),
            cu_seqlens=first.global_cu_seqlens,
            cu_seqlens_padded=cup,
            max_seqlen=first.global_max_seqlen,
            sequence_ids=first.sequence_ids,
            media=_unshard_media(shards, cup, cp),
            weights=_unshard_weights(shards, cup, cp),
        )
    if packed is None:
        raise PackedBatchError("unshard_cp: pass the whole row (packed=) to reassemble per-slot values")
    _, cup, T = _boundaries(packed)
    cp, _ = _check_cp(cp)
    if T % cp:
        raise PackedBatchError(f"unshard_cp: a row of T={T} slots does not split over cp_size={cp}")
    values: list[torch.Tensor] = []
    for r, p in enumerate(items):
        if not isinstance(p, torch.Tensor) or p.dim() < 1 or p.shape[0] != T // cp:
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise PackedBatchError(f"unshard_cp: piece {r} has shape {shape}, expected (T/CP = {T // cp}, ...)")
        values.append(p)
    order = torch.cat([cp_slot_indices(cup, cp, r) for r in range(cp)]).to(values[0].device)
    local = torch.cat(values)
    out = torch.empty_like(local)
    # A permutation: every slot written exactly once (index_copy keeps autograd).
    return out.index_copy(0, order, local)
