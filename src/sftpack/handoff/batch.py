"""The handoff: :class:`PackedBatch`, one flat run of tokens plus its boundaries.

Every packing path (offline, loader, trainer) ends here, and every consumer
(Megatron / Transformer Engine, Hugging Face, flash-attn, our own reference
attention) starts here. Two conversations A (5 tokens) and B (10 tokens),
each padded to a multiple of 4, laid in one row of width 20::

    slot            0  1  2  3  4  5  6  7 | 8  9 10 11 12 13 14 15 16 17 18 19
    segment         A  A  A  A  A  .  .  . | B  B  B  B  B  B  B  B  B  B  .  .
    position_ids    0  1  2  3  4  5  6  7 | 0  1  2  3  4  5  6  7  8  9 10 11
    labels          a1 a2 a3 a4 -  -  -  - | b1 b2 .. .. .. .. .. .. b9 -  -  -
    cu_seqlens          [0, 5, 15]      (real lengths, cumulative)
    cu_seqlens_padded   [0, 8, 20]      (physical segment starts; last == T)

``labels[t]`` is the token at ``t+1`` when that token is trainable and belongs to
the same sequence, else ``IGNORE_INDEX`` (-100): no label ever crosses a
boundary, and the last real token and every padding slot carry -100.

The real boundaries (``cu_seqlens``) are the same whichever path built the
batch; only the padding, and hence ``cu_seqlens_padded``, differs.

Optional per-slot ``weights`` (from :attr:`sftpack.Sample.weights`) follow the labels:
slot ``t``'s weight is its target's, the weight of token ``t+1`` (``wa2`` below is the
weight of token ``a2``, the label of slot 1), 0 wherever the label is -100::

    labels          a1  a2  a3  a4  -  -  -  - | b1 ...
    weights         wa1 wa2 wa3 wa4 0  0  0  0 | wb1 ...
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._base import renamed
from ..sample import IGNORE_INDEX, Sample, as_sample
from .errors import PackedBatchError
from .layout import RowArrays, lay_row, lay_weights
from .payload import Media, map_tensors
from .slots import real_token_mask

if TYPE_CHECKING:  # pragma: no cover - typing only; megatron-core is imported lazily
    from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["PackedBatch", "PackedBatchError"]


def packed_seq_params(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int, pad_between_seqs: bool
) -> PackedSeqParams:
    """Megatron-core's ``PackedSeqParams(qkv_format="thd", ...)`` for these boundaries
    (see :meth:`PackedBatch.to_packed_seq_params`; a CP shard passes the global ones)."""
    with warnings.catch_warnings():
        # megatron-core announces its fallbacks when Transformer Engine is absent (CPU).
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.packed_seq_params import PackedSeqParams  # optional: Megatron only for this conversion

    if pad_between_seqs:
        q = kv = cu_seqlens
        q_pad = kv_pad = cu_seqlens_padded
    else:
        q = kv = q_pad = kv_pad = cu_seqlens_padded
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=q,
        cu_seqlens_kv=kv,
        cu_seqlens_q_padded=q_pad,
        cu_seqlens_kv_padded=kv_pad,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )


@dataclass(eq=False)
class PackedBatch:
    """One flat run of ``T`` token slots holding ``N`` sequences, each followed by its padding.

    Attributes:
        input_ids: ``(T,)`` int64; padding slots hold the pad id.
        labels: ``(T,)`` int64; shifted within each sequence, ``-100`` where there is
            no trainable target (the last real token, every padding slot).
        position_ids: ``(T,)`` int64; ``t - cu_seqlens_padded[i]`` for slot ``t`` of
            segment ``i`` (restarts at 0 per sequence, keeps counting through its padding).
        cu_seqlens: ``(N+1,)`` int32; cumulative real lengths ``[0, l0, l0+l1, ...]``.
        cu_seqlens_padded: ``(N+1,)`` int32; physical segment starts, last entry ``T``.
        max_seqlen: the largest padded segment length (a kernel may be given a larger
            static bound; never a smaller one).
        sequence_ids: optional, one id per sequence: which sample / conversation
            each segment holds (``Sample.conversation_id``); carried along, never
            read by the kernels.
        source_rows: optional, one int per sequence: the row of the padded
            ``[B, S]`` batch each segment came from (set by
            :func:`sftpack.trainer.pack_step`, read by :func:`unpack_padded`).
        source_batch_size: optional ``B`` of that padded batch.

        media: optional :class:`~sftpack.handoff.payload.Media`: the row's images (their
            pixels, each one's placeholder run and segment, and, for models with their own
            positions, the multimodal positions); ``None`` on a text row. It validates itself
            against the row, concatenates in row order, moves with the row and adds its part
            to :meth:`to_hf_kwargs`. :meth:`from_samples` lays the samples' ``media``.
        weights: optional ``(T,)`` float32 or float64, aligned with ``labels``: the weight (or
            advantage) of the target of each slot, i.e. of the *next* token (the shift the
            labels make), 0 wherever the label is ``-100``; any sign, finite. ``None`` (every
            row built from samples without weights): weight 1 on every target. The loss reads
            it (:mod:`sftpack.loss`); Hugging Face's own loss (``labels`` in
            :meth:`to_hf_kwargs`) does not, so compute a weighted loss from the logits.

    A batch of several rows is one ``PackedBatch`` whose flat run is the rows laid
    end to end (THD has no row axis): see :meth:`concat`.

    >>> from sftpack.testing import samples_from_lengths
    >>> b = PackedBatch.from_samples(samples_from_lengths([5, 10]), pad_multiple=4)
    >>> b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist(), b.max_seqlen
    ([0, 5, 15], [0, 8, 20], 12)
    >>> b.position_ids.tolist()[:10]
    [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    sequence_ids: tuple | None = None
    source_rows: tuple | None = None
    source_batch_size: int | None = None
    media: Media | None = None
    weights: torch.Tensor | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        """``T``: slots in the flat run, padding included."""
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        """``N``: sequences (segments) in the flat run."""
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def seqlens(self) -> torch.Tensor:
        """``(N,)`` real length of each sequence."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def padded_seqlens(self) -> torch.Tensor:
        """``(N,)`` padded length of each segment (real tokens + its padding)."""
        return self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def loss_mask(self) -> torch.Tensor:
        """``(T,)`` bool: slots whose label is trained on (``labels != -100``)."""
        return self.labels != IGNORE_INDEX

    @property
    def num_label_tokens(self) -> int:
        """Supervised targets in this batch: the denominator of a token-mean loss."""
        return int(self.loss_mask.sum())

    @property
    def real_token_mask(self) -> torch.Tensor:
        """``(T,)`` bool: True on real tokens, False on padding slots."""
        return real_token_mask(self.cu_seqlens, self.cu_seqlens_padded, self.num_tokens)

    @property
    def has_media(self) -> bool:
        """True when the row carries media (a row built from samples with media, possibly no items)."""
        return self.media is not None

    @property
    def num_media_items(self) -> int:
        """Media items (images) in the row (0 on a text row)."""
        return 0 if self.media is None else self.media.num_items

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"PackedBatch(T={self.num_tokens}, N={self.num_sequences}, "
            f"cu_seqlens={self.cu_seqlens.tolist()}, cu_seqlens_padded={self.cu_seqlens_padded.tolist()}, "
            f"max_seqlen={self.max_seqlen}, "
            + (f"media_items={self.num_media_items}, " if self.media is not None else "")
            + (f"weights={self.weights.dtype}, " if self.weights is not None else "")
            + f"device={self.device})"
        )

    # ------------------------------------------------------------- validation
    def validate(self) -> PackedBatch:
        """Check every invariant of the contract; raise :class:`PackedBatchError`
        naming the field, the expectation and the numbers. Returns ``self``.

        This reads the boundary arrays on the host (a device sync on CUDA): call it
        in tests and at data-loading time, not inside the training step.
        """
        ids, lab, pos = self.input_ids, self.labels, self.position_ids
        for name, t in (("input_ids", ids), ("labels", lab), ("position_ids", pos)):
            if not isinstance(t, torch.Tensor):
                raise PackedBatchError(f"PackedBatch.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 1:
                raise PackedBatchError(f"PackedBatch.{name} must be 1-D (T,), got shape {tuple(t.shape)}")
            if t.dtype != torch.int64:
                raise PackedBatchError(f"PackedBatch.{name} must be int64, got {t.dtype}")
        T = ids.shape[0]
        for name, t in (("labels", lab), ("position_ids", pos)):
            if t.shape[0] != T:
                raise PackedBatchError(
                    f"PackedBatch.{name} has {t.shape[0]} slots but input_ids has T={T}: all per-slot "
                    "fields must have the same length"
                )
        cu, cup = self.cu_seqlens, self.cu_seqlens_padded
        for name, t in (("cu_seqlens", cu), ("cu_seqlens_padded", cup)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise PackedBatchError(f"PackedBatch.{name} must be a 1-D tensor (N+1,)")
            if t.dtype != torch.int32:
                raise PackedBatchError(f"PackedBatch.{name} must be int32 (what attention kernels take), got {t.dtype}")
            if t.shape[0] < 2:
                raise PackedBatchError(
                    f"PackedBatch.{name} must hold N+1 >= 2 entries (at least one sequence), got {t.tolist()}"
                )
        if cu.shape[0] != cup.shape[0]:
            raise PackedBatchError(
                f"PackedBatch.cu_seqlens has {cu.shape[0]} entries but cu_seqlens_padded has "
                f"{cup.shape[0]}: both must be N+1 long"
            )
        devices = {t.device for t in (ids, lab, pos, cu, cup)}
        if isinstance(self.weights, torch.Tensor):
            devices.add(self.weights.device)
        if len(devices) > 1:
            raise PackedBatchError(
                f"PackedBatch tensors are on several devices {sorted(map(str, devices))}: call .to(device)"
            )
        cu_h, cup_h = cu.cpu().numpy().astype(np.int64), cup.cpu().numpy().astype(np.int64)
        if T and int(ids.min()) < 0:
            slot = int(torch.nonzero(ids < 0)[0, 0])
            seg = int(np.searchsorted(cup_h, slot, side="right")) - 1
            what = f"segment {seg}" if 0 <= seg < len(cup_h) - 1 else "no segment"
            raise PackedBatchError(
                f"PackedBatch.input_ids[{slot}] = {int(ids[slot])} ({what}): token ids, padding included, must be "
                "non-negative (an embedding has no row for a negative id); build rows with a pad_id >= 0 from "
                "samples tokenized by the model's tokenizer"
            )
        if cu_h[0] != 0:
            raise PackedBatchError(f"PackedBatch.cu_seqlens must start with 0, got {cu_h[0]}")
        if cup_h[0] != 0:
            raise PackedBatchError(f"PackedBatch.cu_seqlens_padded must start with 0, got {cup_h[0]}")
        real = np.diff(cu_h)
        padded = np.diff(cup_h)
        bad = np.flatnonzero(real < 1)
        if bad.size:
            i = int(bad[0])
            raise PackedBatchError(
                f"PackedBatch.cu_seqlens: sequence {i} has real length {int(real[i])} "
                f"(cu_seqlens[{i}]={cu_h[i]}, cu_seqlens[{i + 1}]={cu_h[i + 1]}); every real length must be >= 1"
            )
        bad = np.flatnonzero(padded < real)
        if bad.size:
            i = int(bad[0])
            raise PackedBatchError(
                f"PackedBatch.cu_seqlens_padded: segment {i} has padded length {int(padded[i])} < real "
                f"length {int(real[i])}; every padded length must be >= its real length"
            )
        if cup_h[-1] != T:
            raise PackedBatchError(
                f"PackedBatch.cu_seqlens_padded[-1] must equal T = len(input_ids) = {T}, got "
                f"{cup_h[-1]}; fold the row's tail padding into the last segment"
            )
        if isinstance(self.max_seqlen, bool) or not isinstance(self.max_seqlen, (int, np.integer)):
            raise PackedBatchError(
                f"PackedBatch.max_seqlen must be an int (the largest padded segment length, here "
                f"{int(padded.max())}), got {self.max_seqlen!r}"
            )
        if int(self.max_seqlen) < int(padded.max()):
            raise PackedBatchError(
                f"PackedBatch.max_seqlen = {self.max_seqlen} is smaller than the largest padded segment "
                f"length {int(padded.max())}; kernels would read out of bounds"
            )
        for name in ("sequence_ids", "source_rows"):
            val = getattr(self, name)
            if val is not None and len(val) != len(real):
                raise PackedBatchError(f"PackedBatch.{name} has {len(val)} entries for N={len(real)} sequences")
        starts = np.repeat(cup_h[:-1], padded)
        expect_pos = np.arange(T, dtype=np.int64) - starts
        pos_h = pos.cpu().numpy()
        wrong = np.flatnonzero(pos_h != expect_pos)
        if wrong.size:
            slot = int(wrong[0])
            raise PackedBatchError(
                f"PackedBatch.position_ids[{slot}] = {int(pos_h[slot])}, expected {int(expect_pos[slot])} "
                "(t - cu_seqlens_padded[i]: positions restart at 0 for each sequence)"
            )
        # No label may cross a boundary: the last real token and all padding carry -100.
        is_real = expect_pos < np.repeat(real, padded)
        last_real = np.zeros(T, dtype=bool)
        last_real[cup_h[:-1] + real - 1] = True
        must_ignore = ~is_real | last_real
        lab_h = lab.cpu().numpy()
        wrong = np.flatnonzero(must_ignore & (lab_h != IGNORE_INDEX))
        if wrong.size:
            slot = int(wrong[0])
            what = "a padding slot" if not is_real[slot] else "the last real token of its sequence"
            raise PackedBatchError(
                f"PackedBatch.labels[{slot}] = {int(lab_h[slot])} but slot {slot} is {what}; its label must be "
                f"{IGNORE_INDEX} so that no label crosses a sequence boundary"
            )
        # Every other label is the next token (shifted within the sequence) or -100.
        ids_h = ids.cpu().numpy()
        nxt = np.empty(T, dtype=np.int64)
        nxt[:-1] = ids_h[1:]
        nxt[-1] = IGNORE_INDEX
        wrong = np.flatnonzero((lab_h != IGNORE_INDEX) & (lab_h != nxt))
        if wrong.size:
            slot = int(wrong[0])
            raise PackedBatchError(
                f"PackedBatch.labels[{slot}] = {int(lab_h[slot])} but the next token input_ids[{slot + 1}] is "
                f"{int(nxt[slot])}; a label is the next token of its sequence (shifted) or {IGNORE_INDEX}"
            )
        if self.media is not None:
            self.media.check(ids, cu_h, cup_h)
        if self.weights is not None:
            check_slot_weights(self.weights, lab, "PackedBatch")
        return self

    # ----------------------------------------------------------- construction
    @classmethod
    def from_samples(
        cls,
        samples: Iterable[Sample | dict | Sequence[int]],
        *,
        pad_multiple: int = 1,
        max_seq_len: int | None = None,
        pad_id: int = 0,
        device: torch.device | str | None = None,
        row_width: int | None = None,
    ) -> PackedBatch:
        """Lay tokenized samples end to end in one row (what
        :func:`sftpack.handoff.build_row` does from flat arrays).

        Args:
            samples: :class:`~sftpack.Sample` objects (or dicts with ``input_ids`` and
                ``loss_mask``, or bare id sequences, all tokens trainable). When any sample has
                ``weights``, the row has :attr:`weights` (a sample without them: weight 1 on
                its targets); else ``weights`` is ``None``.
            pad_multiple: pad each sequence to a multiple of this (``2 * CP`` for
                context parallelism, see :func:`sftpack.handoff.pad_multiple_for`).
            max_seq_len: fixed row width ``T``, a multiple of ``pad_multiple``; the tail
                padding is folded into the last segment. ``None``: the row is exactly
                as wide as its padded sequences.
            pad_id: token id written into padding slots.
            device: where to put the tensors.
            row_width: the deprecated spelling of ``max_seq_len`` (accepted, with a
                ``DeprecationWarning``, until the next release).

        Raises:
            PackedBatchError: no samples, a ``max_seq_len`` that is not a multiple of
                ``pad_multiple``, or padded sequences that do not fit ``max_seq_len``.
        """
        max_seq_len = renamed("PackedBatch.from_samples", "max_seq_len", max_seq_len, "row_width", row_width)
        items = [as_sample(s, i) for i, s in enumerate(samples)]
        if not items:
            raise PackedBatchError("PackedBatch.from_samples needs at least one sample, got none")
        ids = [s.conversation_id for s in items]
        row = lay_row(
            np.concatenate([s.input_ids for s in items]),
            np.concatenate([s.loss_mask for s in items]),
            np.fromiter((len(s) for s in items), dtype=np.int64, count=len(items)),
            max_seq_len=max_seq_len,
            pad_multiple=pad_multiple,
            pad_id=pad_id,
            sequence_ids=ids,
        )
        batch = cls.from_row(row, sequence_ids=ids)
        if any(s.weights is not None for s in items):
            batch.weights = torch.from_numpy(
                lay_weights([s.weights for s in items], [len(s) for s in items], row.cu_seqlens_padded, row.labels)
            )
        if any(s.media is not None for s in items):
            cup = row.cu_seqlens_padded.tolist()
            first = next(s.media for s in items if s.media is not None)
            if pad_id == first.token_id:
                raise PackedBatchError(f"pad_id {pad_id} is the media placeholder id; pad with another token")
            batch.media = type(first).lay(
                [s.media for s in items],
                lengths=[len(s) for s in items],
                offsets=cup[:-1],
                widths=[b - a for a, b in zip(cup[:-1], cup[1:])],
                segments=[1] * len(items),
            )
        return batch.to(device) if device is not None else batch

    @classmethod
    def from_row(
        cls, row: RowArrays, *, sequence_ids: Sequence[Any] | None = None, device: torch.device | str | None = None
    ) -> PackedBatch:
        """The batch of one laid-out row (:func:`sftpack.handoff.layout.lay_row`): the arrays as
        tensors (``int64`` per slot, ``int32`` boundaries), on ``device`` if given."""
        batch = cls(
            input_ids=torch.from_numpy(row.input_ids),
            labels=torch.from_numpy(row.labels),
            position_ids=torch.from_numpy(row.position_ids),
            cu_seqlens=torch.from_numpy(row.cu_seqlens.astype(np.int32)),
            cu_seqlens_padded=torch.from_numpy(row.cu_seqlens_padded.astype(np.int32)),
            max_seqlen=row.max_seqlen,
            sequence_ids=tuple(sequence_ids) if sequence_ids is not None else None,
        )
        return batch.to(device) if device is not None else batch

    @classmethod
    def concat(cls, batches: Sequence[PackedBatch]) -> PackedBatch:
        """Lay several rows end to end in one flat run (THD has no row axis).

        Usable as a ``collate_fn`` for a ``torch.utils.data.DataLoader`` that yields
        ``PackedBatch`` rows. Weights: ``None`` when no row has any; else each row's, a row
        without weights taking 1 on its targets (what ``None`` means).

        >>> from sftpack.testing import samples_from_lengths
        >>> a = PackedBatch.from_samples(samples_from_lengths([3]), max_seq_len=4)
        >>> b = PackedBatch.from_samples(samples_from_lengths([2, 2]), max_seq_len=4)
        >>> PackedBatch.concat([a, b]).cu_seqlens_padded.tolist()
        [0, 4, 6, 8]
        """
        batches = list(batches)
        if not batches:
            raise PackedBatchError("PackedBatch.concat needs at least one batch, got none")
        if len(batches) == 1:
            return batches[0]
        dev = batches[0].device
        cu_parts = [batches[0].cu_seqlens]
        cup_parts = [batches[0].cu_seqlens_padded]
        real_off = batches[0].cu_seqlens[-1:]
        pad_off = batches[0].cu_seqlens_padded[-1:]
        for b in batches[1:]:
            if b.device != dev:
                raise PackedBatchError(f"PackedBatch.concat: batches on {dev} and {b.device}; move them first")
            cu_parts.append(b.cu_seqlens[1:] + real_off)
            cup_parts.append(b.cu_seqlens_padded[1:] + pad_off)
            real_off = cu_parts[-1][-1:]
            pad_off = cup_parts[-1][-1:]
        ids = None
        if all(b.sequence_ids is not None for b in batches):
            ids = tuple(x for b in batches for x in b.sequence_ids)  # type: ignore[union-attr]
        return cls(
            input_ids=torch.cat([b.input_ids for b in batches]),
            labels=torch.cat([b.labels for b in batches]),
            position_ids=torch.cat([b.position_ids for b in batches]),
            cu_seqlens=torch.cat(cu_parts),
            cu_seqlens_padded=torch.cat(cup_parts),
            max_seqlen=max(int(b.max_seqlen) for b in batches),
            sequence_ids=ids,
            media=_concat_media(batches),
            weights=_concat_weights(batches),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor (the media's too) on ``device``."""
        return map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """Pinned host copies (DataLoader ``pin_memory=True`` calls this)."""
        return map_tensors(self, lambda t: t.pin_memory())

    # --------------------------------------------------------------- adapters
    def to_packed_seq_params(self, pad_between_seqs: bool = True) -> PackedSeqParams:
        """Megatron-core's ``PackedSeqParams(qkv_format="thd", ...)``.

        ``pad_between_seqs=True``: ``cu_seqlens_q/kv`` are the real boundaries and
        ``cu_seqlens_q/kv_padded`` the physical ones (Transformer Engine then uses
        its fused/cuDNN backend or FA3).

        ``pad_between_seqs=False``: all four fields are the *same tensor object*,
        ``cu_seqlens_padded``. Transformer Engine detects that and keeps
        FlashAttention-2 usable; padding sits at the end of each causal segment, so
        real tokens never attend to it (it only costs FLOPs).
        """
        return packed_seq_params(self.cu_seqlens, self.cu_seqlens_padded, self.max_seqlen, pad_between_seqs)

    def hf_labels(self) -> torch.Tensor:
        """``(T,)`` labels in the *unshifted* Hugging Face convention: slot ``t`` holds
        ``input_ids[t]`` when it is a trainable target (the model shifts itself)."""
        out = torch.full_like(self.labels, IGNORE_INDEX)
        out[1:] = self.labels[:-1]
        return out

    def to_hf_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM on one packed row.

        ``input_ids``, ``position_ids`` and ``labels`` have shape ``(1, T)`` (labels
        unshifted, as Hugging Face expects). Models detect the packing from
        ``position_ids`` for eager, sdpa and flex attention *only* when no
        ``attention_mask`` is passed and no cache exists, so ``use_cache=False`` is
        included. ``cu_seq_lens_q/k`` (physical offsets: padding is part of each
        segment) and ``max_length_q/k`` feed flash-attention kernels.

        A row with media adds its part (:meth:`~sftpack.handoff.payload.Media.hf_kwargs`): the
        pixel inputs, and for a model with multimodal positions (Qwen2-VL) ``position_ids`` of
        shape ``(4, 1, T)``, the text positions (restarting per sequence) on top of the three
        MRoPE rows, Qwen2-VL's packed form. ``Qwen2VLForConditionalGeneration(**kw)`` then runs
        its own vision tower, and each sample's logits equal it run alone (tested; the
        ``use_cache=False`` matters: with a cache Hugging Face ignores the restarts).
        Media whose model's own forward cannot run a packed row (Gemma 3: it needs
        ``token_type_ids`` for its images' two-way attention, and its packed form joins the
        samples) carries why (:attr:`~sftpack.handoff.payload.Media.hf_refusal`): this raises
        :class:`PackedBatchError` with it, naming the family's packed forward instead
        (``family_for(model).packed_logits(model, row)``).

        >>> from sftpack.testing import samples_from_lengths
        >>> kw = PackedBatch.from_samples(samples_from_lengths([2, 3])).to_hf_kwargs()
        >>> kw["labels"].tolist(), kw["cu_seq_lens_q"].tolist()
        ([[-100, 1001, -100, 2001, 2002]], [0, 2, 5])
        """
        kw: dict[str, Any] = {
            "input_ids": self.input_ids.unsqueeze(0),
            "position_ids": self.position_ids.unsqueeze(0),
            "labels": self.hf_labels().unsqueeze(0),
            "cu_seq_lens_q": self.cu_seqlens_padded,
            "cu_seq_lens_k": self.cu_seqlens_padded,
            "max_length_q": int(self.max_seqlen),
            "max_length_k": int(self.max_seqlen),
            "use_cache": False,
        }
        if self.media is not None:
            if self.media.hf_refusal is not None:  # the model's own forward would not run this row as packed
                raise PackedBatchError(f"PackedBatch.to_hf_kwargs: {self.media.hf_refusal}")
            kw.update(self.media.hf_kwargs(self.position_ids))
        return kw

    def flash_attn_kwargs(self) -> dict[str, Any]:
        """Boundary arguments of ``flash_attn.flash_attn_varlen_func`` for this run.

        flash-attn takes one offset array per side and reads it as physical
        offsets, so both get ``cu_seqlens_padded`` (padding trails each causal
        segment and never reaches a real token).
        """
        return {
            "cu_seqlens_q": self.cu_seqlens_padded,
            "cu_seqlens_k": self.cu_seqlens_padded,
            "max_seqlen_q": int(self.max_seqlen),
            "max_seqlen_k": int(self.max_seqlen),
        }


def check_slot_weights(weights: object, labels: torch.Tensor, who: str) -> None:
    """The checks of a row's (or shard's) ``weights`` against its ``labels``: a 1-D float32 or
    float64 tensor of the same length, finite, 0 wherever the label is -100."""
    if not isinstance(weights, torch.Tensor):
        raise PackedBatchError(f"{who}.weights must be a torch.Tensor or None, got {type(weights).__name__}")
    if weights.dim() != 1 or weights.shape[0] != labels.shape[0]:
        raise PackedBatchError(
            f"{who}.weights has shape {tuple(weights.shape)} but labels has ({labels.shape[0]},): one weight per slot"
        )
    if weights.dtype not in (torch.float32, torch.float64):
        raise PackedBatchError(f"{who}.weights must be float32 or float64, got {weights.dtype}")
    bad = torch.nonzero(~torch.isfinite(weights)).reshape(-1)
    if bad.numel():
        k = int(bad[0])
        raise PackedBatchError(f"{who}.weights[{k}] = {float(weights[k])}: every weight must be finite")
    stray = torch.nonzero((labels == IGNORE_INDEX) & (weights != 0)).reshape(-1)
    if stray.numel():
        k = int(stray[0])
        raise PackedBatchError(
            f"{who}.weights[{k}] = {float(weights[k])} but labels[{k}] is {IGNORE_INDEX}: a slot without a target "
            "has weight 0 (a slot's weight is its target's, the next token's: build rows with from_samples or "
            "build_row(weights=))"
        )


def _concat_weights(batches: Sequence[PackedBatch]) -> torch.Tensor | None:
    """The rows' weights laid end to end (``None`` when no row has any; a row without weights
    takes 1 on its targets, 0 elsewhere)."""
    given = [b.weights for b in batches if b.weights is not None]
    if not given:
        return None
    dtype = functools.reduce(torch.promote_types, (w.dtype for w in given))
    parts = [b.weights.to(dtype) if b.weights is not None else (b.labels != IGNORE_INDEX).to(dtype) for b in batches]
    return torch.cat(parts)


def _concat_media(batches: Sequence[PackedBatch]) -> Media | None:
    """The rows' media laid end to end (``None`` when no row has any)."""
    with_media = [b.media is not None for b in batches]
    if not any(with_media):
        return None
    if not all(with_media):
        raise PackedBatchError(
            f"PackedBatch.concat: row {with_media.index(False)} has no media but row {with_media.index(True)} has; "
            "build every row of a batch with media from samples that carry media (a row without images then "
            "carries empty media)"
        )
    first = batches[0].media
    assert first is not None
    sizes = [b.num_tokens for b in batches]
    return type(first).lay(
        [b.media for b in batches],
        lengths=sizes,
        offsets=np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist(),
        widths=sizes,
        segments=[b.num_sequences for b in batches],
    )
