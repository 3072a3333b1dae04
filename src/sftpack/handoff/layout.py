"""Rows from flat arrays: the one row layout every path uses (numpy, no torch).

The offline path reads a row's sequences from memory-mapped arrays, the loader
from its buffer; neither materialises :class:`~sftpack.Sample` objects. Both
hand :func:`sftpack.handoff.build_row` three flat arrays::

    input_ids  A0 A1 A2 A3 A4 B0 B1 ... B9      (concatenated token ids, any integer dtype)
    loss_mask  F  F  T  T  T  F  T  ... T       (concatenated, bool or 0/1)
    lengths    [5, 10]

and get the contract's row: each sequence padded to ``pad_multiple``, the
row's tail folded into the last segment, labels shifted within each sequence.
:func:`lay_row` computes that row as numpy arrays (:class:`RowArrays`);
:func:`sftpack.handoff.build_row` (in :mod:`.build`) wraps them as a
:class:`~sftpack.PackedBatch`. This module sits below the batch module and never
imports it.
:func:`padded_lengths` is the cost a bin packer must charge for a sequence and
the width :func:`lay_row` lays for it: one function for both, so a planned
row can never overflow ("expanded size 517 vs 502" is what happens otherwise).
:func:`pack_rows` is the one row planner on that cost (bins from
:mod:`sftpack.binpack`, input order kept within a row).

:func:`fit_parts` and :func:`join_parts` lay the same row from each sequence's
own arrays, unchecked, for a caller that checked them already (the loader, which
never concatenates its samples first; :func:`sftpack.handoff.build.build_parts`
wraps them as a batch): :func:`join_parts` makes each of the row's three arrays
with one ``np.concatenate`` of views (the sequences and read-only padding runs;
the labels one ``np.where`` over the ids one slot on), so a row costs a few
numpy calls whatever its sequences.

:func:`lay_row` lays a row into arrays allocated once at its width: with up to
``_SLICE_COPY_MAX`` sequences by slice copies (a Python loop over sequences,
never over tokens; when only the last sequence is padded, ids and labels are
one block copy each), above that by one vectorised scatter. Every strategy
lays the same bytes (``tests/handoff/test_row_fast_path.py`` pins them against
the builder before issue 18); ``benchmarks/bench_rowbuild.py`` measures them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from .._base import check_width, non_negative_int, positive_int, renamed, round_up
from ..binpack import Bins, pack
from ..sample import IGNORE_INDEX, check_weights
from .errors import PackedBatchError

__all__ = [
    "RowArrays",
    "check_pad_id",
    "fit_parts",
    "join_parts",
    "lay_row",
    "lay_weights",
    "pack_rows",
    "padded_lengths",
]

#: up to this many sequences a row is laid by slice copies (a Python loop over
#: sequences, never over tokens); above it by one vectorised scatter
_SLICE_COPY_MAX = 32


def padded_lengths(lengths: ArrayLike, pad_multiple: int) -> np.ndarray:
    """``(N,)`` int64: the slots each sequence takes in a row, its length rounded up
    to ``pad_multiple`` (the bin cost, and the width :func:`lay_row` lays).

    >>> padded_lengths([5, 10, 8], 4).tolist()
    [8, 12, 8]
    """
    m = positive_int("pad_multiple", pad_multiple, error=PackedBatchError)
    return round_up(np.asarray(lengths, dtype=np.int64), m)


def check_pad_id(pad_id: object, who: str, error: type[ValueError] = PackedBatchError) -> int:
    """``pad_id`` as an ``int >= 0``, or ``error``: padding slots are fed to the embedding
    like any token, so a negative id fails there (or wraps to the last rows)."""
    return non_negative_int(
        "pad_id",
        pad_id,
        error=error,
        who=who,
        why="padding slots are fed to the embedding like any token, so it must be a token id >= 0: use the "
        "tokenizer's pad id (or 0: padding carries label -100 and is never trained on)",
    )


def pack_rows(
    lengths: ArrayLike,
    *,
    max_seq_len: int,
    pad_multiple: int = 1,
    algorithm: str = "bfd",
    seed: int = 0,
    patches: ArrayLike | None = None,
    max_patches_per_row: int | None = None,
    max_patches: int | None = None,
    groups: ArrayLike | None = None,
) -> Bins:
    """The one row planner: bin-pack sequences into rows of ``max_seq_len`` slots, each
    costed at :func:`padded_lengths` (what :func:`lay_row` lays, so a planned row
    never overflows), each row listing its sequences in input order, rows in the
    packer's order; with ``max_patches_per_row``, under a second budget too.

    Args:
        lengths: ``(n,)`` real lengths, each ``>= 1`` with
            ``padded_lengths(length, pad_multiple) <= max_seq_len``.
        max_seq_len: the row width (a multiple of ``pad_multiple``).
        pad_multiple: per-sequence pad multiple (``2 * CP``).
        algorithm: a :func:`sftpack.binpack.pack` algorithm.
        seed: for ``first_fit_shuffle``.
        patches: ``(n,)`` the vision patches of each sequence, with ``max_patches_per_row``
            (the weights of :func:`sftpack.binpack.pack`'s second budget).
        max_patches_per_row: the patch budget: a row's ``patches`` sum to at most this
            (``max_weight_per_bin``).
        max_patches: the deprecated spelling of ``max_patches_per_row`` (accepted, with a
            ``DeprecationWarning``, until the next release).
        groups: ``(n,)`` a group id per sequence (a preference pair's members share one): each
            group lands whole in one row (:func:`sftpack.binpack.pack`'s ``groups``).

    Returns:
        :class:`sftpack.binpack.Bins` of indices into ``lengths`` (``.order`` and
        ``.offsets``), every row ascending.

    >>> [r.tolist() for r in pack_rows([5, 10, 30, 20], max_seq_len=36, pad_multiple=4)]
    [[2], [1, 3], [0]]
    >>> pack_rows([8, 8, 8], max_seq_len=32, pad_multiple=4, patches=[16, 16, 4], max_patches_per_row=20).to_lists()
    [[0, 2], [1]]
    """
    cap = renamed("pack_rows", "max_patches_per_row", max_patches_per_row, "max_patches", max_patches)
    bins = pack(
        padded_lengths(lengths, pad_multiple),
        max_seq_len,
        algorithm,
        seed=seed,
        weights=patches,
        max_weight_per_bin=cap,
        groups=groups,
    )
    n = bins.order.shape[0]
    if n == 0:
        return bins
    offsets = bins.offsets
    row_base = np.repeat(np.arange(0, n * (offsets.shape[0] - 1), n, dtype=np.int64), np.diff(offsets))
    key = bins.order + row_base  # row r's items as r * n + index: one sort puts each row's items ascending
    key.sort()
    key -= row_base  # the rows keep their places (and sizes) in the packer's order
    return Bins._trusted(key, offsets)  # a permutation still, reordered within rows: nothing to check


class RowArrays(NamedTuple):
    """One row as numpy arrays: the fields of a :class:`~sftpack.PackedBatch` (``int64``
    per-slot arrays, ``int64`` boundaries; the batch stores them as ``int32``)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    max_seqlen: int


def _int_ids(name: str, arr: Any) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim != 1:
        raise PackedBatchError(f"build_row: {name} must be 1-D (the sequences concatenated), got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise PackedBatchError(
            f"build_row: {name} must hold integers, got dtype {a.dtype}; token ids are never fractional "
            "(convert with np.asarray(ids, dtype=np.int64) if they are whole numbers)"
        )
    return a


def lay_row(
    input_ids: ArrayLike,
    loss_mask: ArrayLike,
    lengths: ArrayLike,
    *,
    max_seq_len: int | None = None,
    pad_multiple: int = 1,
    pad_id: int = 0,
    sequence_ids: Sequence[Any] | None = None,
    row_width: int | None = None,
) -> RowArrays:
    """One contract row from flat arrays, as numpy arrays (see :func:`sftpack.handoff.build_row`).

    Args:
        input_ids: ``(L,)`` the sequences' token ids laid end to end (numpy array or
            memmap slice of any integer dtype), ``L = sum(lengths)``.
        loss_mask: ``(L,)`` bool (or 0/1): True on tokens the model is trained to
            produce. The target of token ``j`` is trainable iff token ``j+1`` is and
            belongs to the same sequence.
        lengths: ``(N,)`` real length of each sequence, each ``>= 1``.
        max_seq_len: fixed row width ``T`` (a multiple of ``pad_multiple``); the tail
            padding is folded into the last segment. ``None``: exactly as wide as
            the padded sequences.
        pad_multiple: pad each sequence to a multiple of this (``2*CP``).
        pad_id: integer id written into padding slots.
        sequence_ids: ``N`` ids, one per sequence (the conversation each holds).
        row_width: the deprecated spelling of ``max_seq_len`` (accepted, with a
            ``DeprecationWarning``, until the next release).

    Returns:
        :class:`RowArrays`.

    Raises:
        PackedBatchError: mismatched sizes, a non-integer dtype, a negative token id or
            ``pad_id``, an empty sequence,
            a ``max_seq_len`` that is not a multiple of ``pad_multiple``, or padded
            sequences that do not fit ``max_seq_len`` (the message gives the numbers).

    >>> r = lay_row(np.arange(1, 16), np.ones(15, bool), [5, 10], max_seq_len=36, pad_multiple=4)
    >>> r.cu_seqlens.tolist(), r.cu_seqlens_padded.tolist(), r.max_seqlen
    ([0, 5, 15], [0, 8, 36], 28)
    """
    max_seq_len = renamed("lay_row", "max_seq_len", max_seq_len, "row_width", row_width)
    m = positive_int("pad_multiple", pad_multiple, error=PackedBatchError)
    check_pad_id(pad_id, "build_row", PackedBatchError)
    ids = _int_ids("input_ids", input_ids)
    real = _int_ids("lengths", lengths).astype(np.int64, copy=False)
    mask = np.asarray(loss_mask)
    n = real.shape[0]
    if n == 0:
        raise PackedBatchError("build_row needs at least one sequence, got none")
    if mask.shape != ids.shape:
        raise PackedBatchError(
            f"build_row: loss_mask has shape {mask.shape} but input_ids has {ids.shape}; give one entry per token"
        )
    if int(real.min()) < 1:
        i = int(np.flatnonzero(real < 1)[0])
        raise PackedBatchError(f"build_row: lengths[{i}] = {int(real[i])}; every sequence needs at least one token")
    n_tok = int(real.sum())
    if n_tok != ids.shape[0]:
        raise PackedBatchError(
            f"build_row: lengths add up to {n_tok} tokens but input_ids holds {ids.shape[0]}; they must match"
        )
    if sequence_ids is not None and len(sequence_ids) != n:
        raise PackedBatchError(f"build_row: sequence_ids has {len(sequence_ids)} entries for {n} sequences")
    if ids.dtype.kind == "i" and n_tok and int(ids.min()) < 0:  # one pass over the ids
        t = int(np.flatnonzero(ids < 0)[0])
        i = int(np.searchsorted(np.cumsum(real), t, side="right"))
        who = f", id {sequence_ids[i]!r}" if sequence_ids is not None else ""
        raise PackedBatchError(
            f"build_row: sequence {i}{who} holds token id {int(ids[t])} at input position {t}: token ids must be "
            "non-negative (an embedding has no row for a negative id); tokenize the conversation again with "
            "the model's tokenizer"
        )
    padded = round_up(real, m)
    total = int(padded.sum())
    if max_seq_len is not None:
        max_seq_len = positive_int("max_seq_len", max_seq_len, error=PackedBatchError)
        check_width(max_seq_len, m, name="max_seq_len", who="build_row", error=PackedBatchError)
        if total > max_seq_len:
            raise PackedBatchError(
                f"{n} sequences of {n_tok} tokens take {total} slots after padding each to a multiple of {m}, "
                f"more than max_seq_len={max_seq_len}: pack fewer sequences per row (sftpack.binpack with "
                "cost_multiple=pad_multiple) or raise max_seq_len"
            )
    mask_b = mask.astype(bool, copy=False)
    if n > _SLICE_COPY_MAX:
        return _lay_scatter(ids, mask_b, real, padded, max_seq_len, pad_id)
    lens = real.tolist()
    return _lay_segments(None, None, lens, padded.tolist(), max_seq_len, pad_id, ids, mask_b)


def lay_weights(
    weight_parts: Sequence[np.ndarray | None],
    lengths: Sequence[int],
    cu_seqlens_padded: Sequence[int] | np.ndarray,
    labels: np.ndarray,
) -> np.ndarray:
    """``(T,)`` the per-slot weights of a laid row, aligned with its ``labels``: slot ``t`` of a
    sequence holds the weight of its *target*, the next token (``w[j+1]`` at the sequence's slot
    ``j``, the shift the labels make), and 0 wherever the label is ``-100`` (each sequence's last
    real token, every padding slot, every untrained target).

    ``weight_parts``: each sequence's ``(length,)`` float weights (checked:
    :func:`sftpack.sample.check_weights`), or ``None`` for weight 1 on its trained tokens. The row
    takes the widest dtype of the parts (float32 when every part is float32, else float64).

    >>> labels = np.array([2, 3, -100, -100, 6, -100])
    >>> lay_weights([np.array([9.0, 0.5, 2.0]), None], [3, 2], [0, 4, 6], labels).tolist()
    [0.5, 2.0, 0.0, 0.0, 1.0, 0.0]
    """
    given = [w for w in weight_parts if w is not None]
    dtype = np.result_type(*given) if given else np.dtype(np.float64)
    out = np.zeros(labels.shape[0], dtype=dtype)
    for w, k, a in zip(weight_parts, lengths, np.asarray(cu_seqlens_padded).tolist()):
        out[a : a + k - 1] = 1.0 if w is None else w[1:k]
    out[labels == IGNORE_INDEX] = 0
    return out


def split_weights(weights: ArrayLike, lengths: Sequence[int], who: str) -> list[np.ndarray]:
    """Flat ``(L,)`` weights (the sequences' laid end to end, what :func:`sftpack.handoff.build_row`
    takes) checked (:class:`PackedBatchError` naming ``who``) and cut into each sequence's part."""
    if np.ndim(weights) != 1:
        raise PackedBatchError(
            f"{who}: weights must be 1-D, one float per token (the sequences' laid end to end), got shape "
            f"{np.shape(weights)}"
        )
    try:
        flat = check_weights(weights, int(sum(lengths)), f"{who}: weights")
    except ValueError as e:
        raise PackedBatchError(str(e)) from None
    ends = list(accumulate(lengths))
    return [flat[b - k : b] for b, k in zip(ends, lengths)]


def fit_parts(lengths: Sequence[int], max_seq_len: int | None, pad_multiple: int) -> list[int]:
    """The slots each sequence of a row takes (its length rounded up to ``pad_multiple``),
    the row's tail folded into the last: what :func:`join_parts` lays. Raises
    :class:`PackedBatchError` when the padded sequences do not fit ``max_seq_len``."""
    m = pad_multiple
    padded = [-(-k // m) * m for k in lengths] if m != 1 else list(lengths)
    total = sum(padded)
    if max_seq_len is not None:
        if total > max_seq_len:
            raise PackedBatchError(
                f"{len(padded)} sequences take {total} slots after padding each to a multiple of {m}, "
                f"more than max_seq_len={max_seq_len}: plan rows with sftpack.handoff.pack_rows"
            )
        padded[-1] += max_seq_len - total  # the row's tail folds into the last segment
    return padded


def join_parts(
    id_parts: Sequence[np.ndarray],
    mask_parts: Sequence[np.ndarray],
    lengths: Sequence[int],
    padded: Sequence[int],
    pad_id: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's ``(input_ids, labels, position_ids)`` (``int64``) from each sequence's own
    arrays, ``padded`` from :func:`fit_parts`, each array made by one ``np.concatenate``
    of views (no per-token Python, no slice assignment into a preallocated row).

    ``input_ids`` is a view of the first ``T`` slots of ``T + 1`` laid ids (the extra
    slot is padding), so the labels are one ``np.where`` over the ids one slot on: a
    slot's label is the next slot's id where the next token is trained on and belongs to
    the same sequence, else ``-100``. The condition is laid from each sequence's mask
    from its second token, followed by ``False`` on its last real token and padding.
    """
    widest = max(padded)  # no sequence's padding (plus one slot) is wider
    pads = _filled(pad_id, widest)
    falses = _falses(widest)
    iota = _positions(widest)
    ids_parts: list[np.ndarray] = []
    ok_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    for x, mk, k, w in zip(id_parts, mask_parts, lengths, padded):
        ids_parts.append(x)
        if w > k:
            ids_parts.append(pads[: w - k])
        ok_parts.append(mk[1:])
        ok_parts.append(falses[: w - k + 1])
        pos_parts.append(iota[:w])
    ids_parts.append(pads[:1])
    ids = np.concatenate(ids_parts, dtype=np.int64, casting="unsafe")
    labels = np.where(np.concatenate(ok_parts), ids[1:], IGNORE_INDEX)
    positions = np.concatenate(pos_parts)
    return ids[:-1], labels, positions


#: read-only arrays of one value, grown on demand: padding is a view of them
_fills: dict[int, np.ndarray] = {}
_false: np.ndarray = np.zeros(0, dtype=bool)


def _filled(value: int, k: int) -> np.ndarray:
    """``k`` (or more) slots holding ``value``, int64, read-only."""
    a = _fills.get(value)
    if a is None or a.shape[0] < k:
        a = np.full(max(k, 4097 if a is None else 2 * a.shape[0]), value, dtype=np.int64)
        a.flags.writeable = False
        if len(_fills) >= 8:  # a few pad ids in use at once; never grows without bound
            _fills.clear()
        _fills[value] = a
    return a


def _falses(k: int) -> np.ndarray:
    global _false
    if _false.shape[0] < k:
        grown = np.zeros(max(k, 2 * _false.shape[0], 4097), dtype=bool)
        grown.flags.writeable = False
        _false = grown
    return _false


#: ``0, 1, 2, ...`` (read-only), grown on demand: a segment's positions are a slice copy of it
_iota: np.ndarray = np.arange(0, dtype=np.int64)


def _positions(k: int) -> np.ndarray:
    global _iota
    if _iota.shape[0] < k:
        grown = np.arange(max(k, 2 * _iota.shape[0], 4096), dtype=np.int64)
        grown.flags.writeable = False
        _iota = grown
    return _iota[:k]


def _lay_segments(
    id_parts: Sequence[np.ndarray] | None,
    mask_parts: Sequence[np.ndarray] | None,
    real: Sequence[int],
    padded: list[int],
    max_seq_len: int | None,
    pad_id: int,
    ids: np.ndarray | None = None,
    mask: np.ndarray | None = None,
) -> RowArrays:
    """A row of few sequences, laid by slice copies into preallocated arrays (a Python
    loop over sequences, never over tokens). Either the parts (each sequence's ids and
    bool mask) or ``ids`` / ``mask`` (laid end to end) are given, or both.

    When no sequence but the last is padded (``pad_multiple=1``, or lengths that are
    multiples of it), the real tokens are one block: ids and labels are one copy each
    and only the sequence ends are fixed up; otherwise each segment is copied in turn.
    """
    n = len(real)
    n_tok = sum(real)
    total = sum(padded)
    one_block = n == 1 or padded[:-1] == list(real[:-1])
    if max_seq_len is not None:
        padded[-1] += max_seq_len - total  # the row's tail folds into the last segment
        total = max_seq_len
    cu = np.array([0, *accumulate(real)], dtype=np.int64)  # (cheaper than np.cumsum for a few Python ints)
    cup = np.array([0, *accumulate(padded)], dtype=np.int64)
    out_ids = np.empty(total, dtype=np.int64)
    labels = np.empty(total, dtype=np.int64)
    labels.fill(IGNORE_INDEX)
    position_ids = np.empty(total, dtype=np.int64)
    iota = _positions(max(padded))
    if one_block:
        if ids is not None:
            out_ids[:n_tok] = ids
        else:
            assert id_parts is not None
            np.concatenate(id_parts, out=out_ids[:n_tok], casting="unsafe")
        out_ids[n_tok:] = pad_id
        if mask is None:
            assert mask_parts is not None
            mask = mask_parts[0] if n == 1 else np.concatenate(mask_parts)
        # label t is token t+1 where that token is trained on, and no sequence's last real token has one
        np.copyto(labels[: n_tok - 1], out_ids[1:n_tok], where=mask[1:])
        if n > 1:
            labels[cu[1:-1] - 1] = IGNORE_INDEX
        p = 0
        for w in padded:
            position_ids[p : p + w] = iota[:w]
            p += w
    else:
        if id_parts is None or mask_parts is None:
            assert ids is not None and mask is not None
            b = cu.tolist()
            id_parts = [ids[b[i] : b[i + 1]] for i in range(n)]
            mask_parts = [mask[b[i] : b[i + 1]] for i in range(n)]
        p = 0
        for i in range(n):
            k, w = real[i], padded[i]
            out_ids[p : p + k] = id_parts[i]
            if w > k:
                out_ids[p + k : p + w] = pad_id
            position_ids[p : p + w] = iota[:w]
            if k > 1:
                np.copyto(labels[p : p + k - 1], out_ids[p + 1 : p + k], where=mask_parts[i][1:])
            p += w
    return RowArrays(out_ids, labels, position_ids, cu, cup, max(padded))


def _lay_scatter(
    ids: np.ndarray,
    mask_b: np.ndarray,
    real: np.ndarray,
    padded: np.ndarray,
    max_seq_len: int | None,
    pad_id: int,
) -> RowArrays:
    """A row of many sequences, laid by one vectorised scatter (the ids, sequences laid
    end to end, go to their slots in one indexed assignment)."""
    n = real.shape[0]
    n_tok = int(ids.shape[0])
    padded = padded.copy()
    total = int(padded.sum())
    if max_seq_len is not None:
        padded[-1] += max_seq_len - total
        total = max_seq_len
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(real, out=cu[1:])
    cup = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(padded, out=cup[1:])
    out_ids = np.full(total, pad_id, dtype=np.int64)
    ok = np.zeros(total, dtype=bool)  # slot t has a trainable target (token t+1, same sequence)
    slot = np.arange(n_tok, dtype=np.int64) + np.repeat(cup[:-1] - cu[:-1], real)
    out_ids[slot] = ids
    ok[slot[:-1]] = mask_b[1:]
    ok[cup[:-1] + real - 1] = False  # the last real token of every sequence has no target
    labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(ok[:-1], out_ids[1:], IGNORE_INDEX)
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(cup[:-1], padded)
    return RowArrays(out_ids, labels, position_ids, cu, cup, int(padded.max()))
