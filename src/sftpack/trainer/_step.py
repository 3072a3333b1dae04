"""``pack_step``: a right-padded ``[B, S]`` batch packed into one flat row at the step.

Vectorised tensor operations over the ``T`` output slots, the same code on CPU
and CUDA; one small host transfer for the output shape and the checks. Rows with
media (images) hand their samples' :class:`~sftpack.handoff.payload.Media` along
(``media=``): laid at the packed offsets by :meth:`Media.lay
<sftpack.handoff.payload.Media.lay>`, as :meth:`PackedBatch.from_samples
<sftpack.PackedBatch.from_samples>` lays them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._base import check_width, positive_int, round_up
from ..handoff import PackedBatch, PackedBatchError
from ..handoff.layout import check_pad_id
from ..handoff.payload import Media
from ..sample import IGNORE_INDEX

__all__ = ["pack_step"]


def _positive_int(name: str, value: object, *, allow_none: bool = False) -> int | None:
    return positive_int(name, value, error=PackedBatchError, allow_none=allow_none, who="pack_step")


def _batch_tensor(name: str, t: Any, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise PackedBatchError(f"pack_step: {name} must be a torch.Tensor of shape {shape}, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise PackedBatchError(
            f"pack_step: {name} has shape {tuple(t.shape)} but input_ids has shape {shape}; give one entry per token"
        )
    if t.device != device:
        raise PackedBatchError(f"pack_step: {name} is on {t.device} but input_ids is on {device}; move it first")
    return t


def pack_step(
    input_ids: torch.Tensor,
    lengths: torch.Tensor | Sequence[int] | np.ndarray | None = None,
    loss_mask: torch.Tensor | None = None,
    *,
    pad_multiple: int = 1,
    pad_to_multiple_of: int | None = None,
    pad_to: int | None = None,
    pad_id: int = 0,
    sequence_ids: Sequence[Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    media: Sequence[Media | None] | None = None,
) -> PackedBatch:
    """Pack a right-padded ``[B, S]`` batch into one flat row.

    Args:
        input_ids: ``(B, S)`` integer token ids, each row's real tokens first
            (right padding). Any device; the result lives on the same one.
        lengths: ``(B,)`` real length of each row, ``0 <= lengths[b] <= S``: a
            tensor on any device, a list or a numpy array. A host-side ``lengths``
            (list, numpy, CPU tensor) with CUDA ``input_ids`` costs no device sync
            at all. Give either ``lengths`` or ``attention_mask``.
        loss_mask: ``(B, S)`` bool, True on tokens the model is trained to produce
            (the assistant's tokens). The target of slot ``t`` is trainable iff
            token ``t+1`` is. ``None`` and no ``labels``: every token is trainable.
        pad_multiple: pad each sequence to a multiple of this (``2*CP`` for context
            parallelism; see :func:`pad_multiple_for`).
        pad_to_multiple_of: pad the whole row to a multiple of this (FP8 needs 16,
            32 or 128 per CP/TP rank). Must be a multiple of ``pad_multiple`` so the
            last segment, which absorbs the tail, stays aligned.
        pad_to: fixed row width ``T`` (pipeline parallelism needs one width for
            every micro-batch). Must be a multiple of ``pad_multiple`` and of
            ``pad_to_multiple_of``; raises if the padded sequences do not fit.
        pad_id: integer id written into padding slots.
        sequence_ids: optional ``B`` ids, one per batch row (the conversation each
            row holds); the result's ``sequence_ids`` keeps those of the non-empty
            rows. Default ``None``.
        attention_mask: ``(B, S)``, nonzero on real tokens; must be right-padded
            (ones then zeros in every row). Alternative to ``lengths``.
        labels: ``(B, S)`` int, Hugging Face convention (unshifted, -100 = ignore):
            ``labels[b, t] != -100`` marks token ``t`` trainable and is its target
            value (normally ``input_ids[b, t]``). Alternative to ``loss_mask``.
        media: optional ``B`` entries, one per batch row: the
            :class:`~sftpack.handoff.payload.Media` of the sample the row holds
            (``sample.media``: slots relative to the sample, multimodal positions of its
            own tokens) or ``None`` for a row without media. The row's media
            (``batch.media``) is theirs laid at the packed offsets
            (:meth:`Media.lay <sftpack.handoff.payload.Media.lay>`), on ``input_ids.device``.
            Cheap checks only (counts, kinds, widths, ``pad_id``); :meth:`PackedBatch.validate
            <sftpack.PackedBatch.validate>` checks every run against the tokens.

    Returns:
        A :class:`~sftpack.PackedBatch` on ``input_ids.device``: the ``N`` non-empty
        rows in batch order, each padded to ``pad_multiple``, the row's tail folded
        into the last segment. ``source_rows`` holds each segment's batch row
        and ``source_batch_size`` is ``B`` (what :func:`unpack_padded` reads).
        Identical to ``PackedBatch.from_samples`` on the same sequences (their media included).

    Rows of length 0 are skipped (they hold no tokens and no targets; a data-parallel
    rank that pads its batch with empty rows keeps working): ``N`` is the number of
    non-empty rows and ``source_rows`` says which rows they were. A batch whose
    rows are all empty raises.

    Raises:
        PackedBatchError: bad shapes or options, a length outside ``[0, S]``, a
            mask that is not right-padded, or a batch that does not fit ``pad_to``;
            the message names the numbers.

    >>> ids = torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0, 0, 0],
    ...                     [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    >>> b = pack_step(ids, torch.tensor([5, 10]), pad_multiple=4)
    >>> b.num_tokens, b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist(), b.max_seqlen
    (20, [0, 5, 15], [0, 8, 20], 12)
    >>> b.input_ids.tolist()
    [1, 2, 3, 4, 5, 0, 0, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 0, 0]
    >>> b.labels.tolist()[:9]
    [2, 3, 4, 5, -100, -100, -100, -100, 12]
    >>> b.position_ids.tolist()[6:10]
    [6, 7, 0, 1]
    """
    # ------------------------------------------------------------ options
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise PackedBatchError(f"pack_step: input_ids must be a (B, S) tensor, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise PackedBatchError(f"pack_step: input_ids must hold integer ids, got {input_ids.dtype}")
    B, S = (int(x) for x in input_ids.shape)
    if B == 0 or S == 0:
        raise PackedBatchError(f"pack_step: the batch is empty (shape {(B, S)})")
    dev = input_ids.device
    check_pad_id(pad_id, "pack_step")
    if sequence_ids is not None and len(sequence_ids) != B:
        raise PackedBatchError(f"pack_step: sequence_ids has {len(sequence_ids)} entries for a batch of B={B} rows")
    parts = _media_parts(media, B, pad_id)
    m = _positive_int("pad_multiple", pad_multiple)
    row_mult = _positive_int("pad_to_multiple_of", pad_to_multiple_of, allow_none=True)
    width = _positive_int("pad_to", pad_to, allow_none=True)
    assert m is not None
    # The row's tail is folded into the last segment, so the tail itself must be a
    # multiple of the per-sequence multiple or the last segment loses its CP alignment.
    if row_mult is not None and row_mult % m:
        raise PackedBatchError(
            f"pack_step: pad_to_multiple_of={row_mult} is not a multiple of pad_multiple={m}; the last sequence "
            f"absorbs the row's tail and would lose its alignment: use pad_to_multiple_of={np.lcm(row_mult, m)}"
        )
    if width is not None:
        multiple_name = "pad_to_multiple_of" if row_mult else "pad_multiple"
        check_width(
            width, row_mult or m, name="pad_to", multiple_name=multiple_name, who="pack_step", error=PackedBatchError
        )
    if lengths is not None and attention_mask is not None:
        raise PackedBatchError("pack_step: give lengths or attention_mask, not both")
    if loss_mask is not None and labels is not None:
        raise PackedBatchError("pack_step: give loss_mask or labels, not both")

    # ------------------------------------------------------------ lengths
    mask_not_right_padded = None
    if attention_mask is not None:
        am = _batch_tensor("attention_mask", attention_mask, (B, S), dev).bool()
        lens_src = am.sum(1)
        # Right-padded means no 0 -> 1 step along a row (one pass, cheaper than
        # comparing with "column < length").
        mask_not_right_padded = (am[:, 1:] > am[:, :-1]).any(1)
    elif lengths is not None:
        if isinstance(lengths, torch.Tensor):
            lens_src = lengths.reshape(-1)
        else:
            lens_src = torch.as_tensor(np.asarray(lengths).reshape(-1))
        if lens_src.dtype.is_floating_point or lens_src.dtype == torch.bool:
            raise PackedBatchError(f"pack_step: lengths must be integers, got {lens_src.dtype}")
        if lens_src.shape[0] != B:
            raise PackedBatchError(f"pack_step: lengths has {lens_src.shape[0]} entries for a batch of B={B} rows")
    else:
        raise PackedBatchError("pack_step: give lengths (B,) or attention_mask (B, S) to say where each row ends")
    lens_src = lens_src.to(torch.int64)

    # One host transfer for everything the output shape and the checks need. It
    # happens where `lengths` lives: a host-side lengths costs no device sync.
    padded_src = round_up(lens_src, m)
    nonempty = lens_src > 0
    last = torch.argmax(nonempty.to(torch.int64) * torch.arange(1, B + 1, device=lens_src.device))
    stats_parts = [
        padded_src.sum(),
        nonempty.sum(),
        padded_src.max(),
        padded_src[last],
        lens_src.min(),
        lens_src.max(),
    ]
    if mask_not_right_padded is not None:
        stats_parts.append(mask_not_right_padded.any().to(torch.int64))
    stats = torch.stack(stats_parts).tolist()
    total, n, max_padded, last_padded, lmin, lmax = (int(x) for x in stats[:6])
    if lmin < 0 or lmax > S:
        bad = int(torch.nonzero((lens_src < 0) | (lens_src > S))[0, 0])
        raise PackedBatchError(
            f"pack_step: lengths[{bad}] = {int(lens_src[bad])} is outside [0, S={S}]; each row holds at most S tokens"
        )
    if mask_not_right_padded is not None and stats[6]:
        bad = int(torch.nonzero(mask_not_right_padded)[0, 0])
        raise PackedBatchError(
            f"pack_step: attention_mask row {bad} is not right-padded (its ones are not a prefix); pack_step takes "
            "right-padded batches: pad on the right in the collator, or give lengths of left-aligned rows"
        )
    if n == 0:
        raise PackedBatchError(f"pack_step: every row of the [{B}, {S}] batch is empty; nothing to pack")

    # ------------------------------------------------------------ row width
    T = total
    if row_mult is not None:
        T = round_up(T, row_mult)
    if width is not None:
        if total > width:
            raise PackedBatchError(
                f"pack_step: {n} sequences take {total} slots after padding each to a multiple of {m}, more than "
                f"pad_to={width}: lower the micro-batch token budget (plan_microbatches(token_budget={width}, "
                f"pad_multiple={m})) or raise pad_to"
            )
        T = width
    tail = T - total
    max_seqlen = max(max_padded, last_padded + tail)

    lens = lens_src.to(dev, non_blocking=True)
    if n < B:  # rare: drop empty rows (one more read where `lengths` lives, only on this path)
        kept = torch.nonzero(lens_src > 0).reshape(-1)
        source_rows: tuple = tuple(kept.tolist())
        rows = kept.to(dev, non_blocking=True)
        lens = lens.index_select(0, rows)
    else:
        rows = torch.arange(B, device=dev)
        source_rows = tuple(range(B))
    padded = round_up(lens, m)
    if tail:
        padded = torch.cat([padded[:-1], padded[-1:] + tail])
    cup = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(padded, 0, out=cup[1:])
    cu = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lens, 0, out=cu[1:])

    # ------------------------------------------------------------ slots
    # index_select rather than x[idx]: the generic advanced-indexing kernel is ~6x
    # slower on CPU for 1-D gathers, and these gathers are most of the work.
    seg = torch.repeat_interleave(torch.arange(n, device=dev), padded, output_size=T)
    pos = torch.arange(T, device=dev) - cup.index_select(0, seg)
    seg_len = lens.index_select(0, seg)
    real = pos < seg_len
    # Flat index of each slot's source token in the [B, S] batch. Padding slots may
    # point past their row; clamp keeps them in bounds and `real` overwrites them.
    src = (pos + (rows * S).index_select(0, seg)).clamp_(max=B * S - 1)
    out_ids = torch.where(real, input_ids.reshape(-1).index_select(0, src).to(torch.int64), pad_id)
    # Real tokens are contiguous in the row, so "the next token" of a real slot is the
    # next slot whenever it is still real in the same sequence: shift, don't re-gather.
    ok = torch.zeros_like(real)
    ok[:-1] = (pos[:-1] + 1) < seg_len[:-1]
    target = torch.empty_like(out_ids)
    target[-1] = IGNORE_INDEX
    if labels is not None:
        lab = _batch_tensor("labels", labels, (B, S), dev).reshape(-1).index_select(0, src).to(torch.int64)
        target[:-1] = lab[1:]
        ok &= target != IGNORE_INDEX
    else:
        target[:-1] = out_ids[1:]
        if loss_mask is not None:
            lm = _batch_tensor("loss_mask", loss_mask, (B, S), dev).reshape(-1).index_select(0, src)
            ok[:-1] &= lm[1:].bool()
    out_labels = torch.where(ok, target, IGNORE_INDEX)

    batch = PackedBatch(
        input_ids=out_ids,
        labels=out_labels,
        position_ids=pos,
        cu_seqlens=cu.to(torch.int32),
        cu_seqlens_padded=cup.to(torch.int32),
        max_seqlen=int(max_seqlen),
        sequence_ids=None if sequence_ids is None else tuple(sequence_ids[r] for r in source_rows),
        source_rows=source_rows,
        source_batch_size=B,
    )
    if parts is not None:
        batch.media = _lay(parts, batch, dev)
    return batch


def _media_parts(media: Sequence[Media | None] | None, B: int, pad_id: int) -> list[Media | None] | None:
    """``media`` checked against the batch: ``B`` entries of one kind and placeholder id
    (never ``pad_id``); ``None`` when no row has media."""
    if media is None:
        return None
    if isinstance(media, Media) or not isinstance(media, Sequence):
        raise PackedBatchError(
            f"pack_step: media must be a sequence of B={B} entries (a Media or None per row), got "
            f"{type(media).__name__}"
        )
    parts = list(media)
    if len(parts) != B:
        raise PackedBatchError(f"pack_step: media has {len(parts)} entries for a batch of B={B} rows; give one per row")
    real = [(b, m) for b, m in enumerate(parts) if m is not None]
    for b, m in real:
        if not isinstance(m, Media):
            raise PackedBatchError(f"pack_step: media[{b}] is a {type(m).__name__}, not a Media or None")
    if not real:
        return None
    b0, first = real[0]
    for b, m in real:
        if type(m) is not type(first) or int(m.token_id) != int(first.token_id):
            raise PackedBatchError(
                f"pack_step: media[{b0}] is a {type(first).__name__} with placeholder {first.token_id} but "
                f"media[{b}] a {type(m).__name__} with placeholder {m.token_id}: one row feeds one vision tower"
            )
    if int(pad_id) == int(first.token_id):
        raise PackedBatchError(
            f"pack_step: pad_id {pad_id} is the media placeholder id; pad with another token (the tokenizer's pad)"
        )
    return parts


def _lay(parts: list[Media | None], batch: PackedBatch, dev: torch.device) -> Media | None:
    """The rows' media laid at their packed offsets (on the host, where the samples' media
    live; one transfer of the boundaries), then moved to ``dev``."""
    assert batch.source_rows is not None
    cup = batch.cu_seqlens_padded.tolist()
    lens = batch.seqlens.tolist()
    kept = [parts[r] for r in batch.source_rows]
    kept_rows = set(batch.source_rows)
    dropped = [r for r, m in enumerate(parts) if m is not None and m.num_items and r not in kept_rows]
    if dropped:
        raise PackedBatchError(f"pack_step: row {dropped[0]} is empty (length 0) but media[{dropped[0]}] has items")
    for r, m, L in zip(batch.source_rows, kept, lens):
        pos = getattr(m, "positions", None)
        if pos is not None and tuple(pos.shape) != (3, L):
            raise PackedBatchError(
                f"pack_step: media[{r}].positions has shape {tuple(pos.shape)} but row {r} holds {L} tokens: "
                f"give each row its own sample's media, (3, {L}) positions"
            )
    if all(m is None for m in kept):  # media only on empty rows, without items
        return None
    out = Media.lay(
        kept,
        lengths=lens,
        offsets=cup[:-1],
        widths=[b - a for a, b in zip(cup[:-1], cup[1:])],
        segments=[1] * len(kept),
    )
    return out.to(dev) if out.device != dev else out
