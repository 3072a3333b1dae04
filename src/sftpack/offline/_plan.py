"""Stage 2 of a prepack: lengths in, the row assignment out.

Bin packing sees only the lengths: each sample costs
:func:`sftpack.handoff.padded_lengths` (its length rounded up to the pad
multiple), the same function the row builder uses to lay it, so a planned row
never overflows ``max_seq_len`` once padded. Within a row the samples keep
their input order (the contract's rows built from samples: A before B);
rows come in the packer's order. The plan is a pure function of the lengths
and the options, so any engine that feeds it the same lengths writes the same
files.

A :class:`RowPlan` also fixes where every sequence lands in ``tokens.npy``,
so stage 3 can write any range of rows independently (in parallel, in any
order) and still produce the same bytes::

    lengths        [5, 10, 3, 8, 6]                   max_seq_len 16
    order          [1, 4, 0, 2, 3]                    rows: [1, 4] and [0, 2, 3]
    row_offsets    [0, 2, 5]
    starts         [0, 10, 16, 21, 24]                (output token offset of each sequence)

Samples with images bring a second size, their vision patches: :class:`BinPack` with
``max_patches_per_row`` hands them to the same planner as its second budget
(:func:`sftpack.handoff.pack_rows`' ``patches`` / ``max_patches``, the packer's weights), so a
row's patches never exceed the budget either.

Preference pairs come with ``groups`` (a pair's two samples share one group): each group is one
unit of the planner (:func:`sftpack.handoff.pack_rows`' ``groups``, :func:`sftpack.binpack.pack`'s),
so a pair always lands whole in one row; its cost is its members' padded lengths summed.

Memory: about 24 bytes per sample (the order, the output lengths and starts).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .._base import check_width as multiple_of
from .._base import choose, positive_int, round_up
from ..binpack import Algorithm, lower_bounds
from ..handoff import pack_rows, padded_lengths
from ._format import PrepackError, check_row_width

__all__ = ["BinPack", "KeepRows", "RowPlan", "check_width", "plan_from_membership", "plan_rows"]


@dataclass(frozen=True)
class RowPlan:
    """Which samples each row holds, and where their tokens go.

    Attributes:
        order: ``(S,)`` int64 sample index of every output sequence, row after row.
        row_offsets: ``(R+1,)`` int64: row ``r`` holds ``order[row_offsets[r]:row_offsets[r+1]]``.
        lengths: ``(S,)`` int64 length of every output sequence (``lengths_in[order]``).
        starts: ``(S,)`` int64 offset of every output sequence in ``tokens.npy``.
        max_seq_len: the row width; pad_multiple: the per-sequence multiple.
        l1, l2: lower bounds on the row count (on padded costs).
    """

    order: np.ndarray
    row_offsets: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray
    max_seq_len: int
    pad_multiple: int
    l1: int
    l2: int

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def row_token_offsets(self) -> np.ndarray:
        """``(R+1,)`` int64: row ``r``'s tokens are ``tokens[off[r]:off[r+1]]``."""
        out = np.empty(self.num_rows + 1, np.int64)
        out[:-1] = self.starts[self.row_offsets[:-1]] if self.num_rows else np.zeros(0, np.int64)
        out[-1] = self.num_tokens
        return out


def _finish(lengths_in: np.ndarray, order: np.ndarray, row_offsets: np.ndarray, width: int, m: int) -> RowPlan:
    lengths = lengths_in[order]
    starts = np.zeros(lengths.shape[0], np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    costs = padded_lengths(lengths, m)
    if lengths.shape[0]:
        loads = np.add.reduceat(costs, row_offsets[:-1])
        if loads.max() > width:
            r = int(np.argmax(loads))
            raise ValueError(
                f"row {r} needs {int(loads[r])} slots once each sequence is padded to a multiple of {m}, "
                f"more than max_seq_len={width}: raise max_seq_len"
            )
        bounds = lower_bounds(costs, width)
    else:
        bounds = lower_bounds([], width)
    return RowPlan(order, row_offsets, lengths, starts, width, m, bounds.l1, bounds.l2)


def check_width(max_seq_len: object, pad_multiple: object) -> tuple[int, int]:
    """``(max_seq_len, pad_multiple)`` as ints, or the one ``ValueError`` for each problem
    (not positive, wider than the format allows, not a multiple of the pad multiple)."""
    width = check_row_width(positive_int("max_seq_len", max_seq_len))
    m = positive_int("pad_multiple", pad_multiple)
    return multiple_of(width, m), m


def plan_rows(
    lengths: ArrayLike,
    *,
    max_seq_len: int,
    pad_multiple: int = 1,
    algorithm: str | Algorithm = "bfd",
    seed: int = 0,
) -> RowPlan:
    """Bin-pack ``lengths`` into rows of ``max_seq_len`` slots.

    Args:
        lengths: ``(S,)`` integer sample lengths, each ``1 <= len <= max_seq_len``.
        max_seq_len: row width ``T`` (a multiple of ``pad_multiple``).
        pad_multiple: each sample is padded to a multiple of this (``2*CP``).
        algorithm: a :class:`sftpack.binpack.Algorithm` name.
        seed: for ``first_fit_shuffle``.

    >>> p = plan_rows([5, 10, 3, 8, 6], max_seq_len=16)
    >>> p.order.tolist(), p.row_offsets.tolist(), p.starts.tolist()
    ([1, 4, 0, 2, 3], [0, 2, 5], [0, 10, 16, 21, 24])
    """
    return BinPack(max_seq_len, pad_multiple, choose(Algorithm, algorithm, "algorithm"), seed).plan(lengths)


def _bin_pack(
    lengths: ArrayLike,
    width: int,
    m: int,
    algorithm: Algorithm,
    seed: int,
    weights: ArrayLike | None = None,
    max_weight: int | None = None,
    groups: ArrayLike | None = None,
) -> RowPlan:
    """:func:`plan_rows` on settings already checked; with ``max_weight``, each row's ``weights``
    (vision patches) also sum to at most it; with ``groups``, each group whole in one row."""
    lengths_in = np.asarray(lengths, dtype=np.int64)
    patches = None
    if max_weight is not None:
        patches = np.zeros_like(lengths_in) if weights is None else np.asarray(weights, np.int64)
    try:
        bins = pack_rows(  # the one planner
            lengths_in,
            max_seq_len=width,
            pad_multiple=m,
            algorithm=algorithm,
            seed=seed,
            patches=patches,
            max_patches_per_row=max_weight,
            groups=groups,
        )
    except ValueError as e:
        if groups is None:
            raise
        raise PrepackError(
            f"{e}; a preference pair is packed whole in one row: raise max_seq_len to hold the longest pair's two "
            "sequences (each padded to the pad multiple) together, or leave that pair out (an SFT group, a prompt's "
            "completions, likewise: all its sequences together)"
        ) from None
    order = np.asarray(bins.order, dtype=np.int64).copy()
    offsets = np.asarray(bins.offsets, dtype=np.int64).copy()
    return _finish(lengths_in, order, offsets, width, m)


def plan_from_membership(
    lengths: ArrayLike, row_offsets: ArrayLike, *, max_seq_len: int, pad_multiple: int = 1
) -> RowPlan:
    """A plan that keeps a given packing: samples in input order, row ``r`` holding
    samples ``row_offsets[r]:row_offsets[r+1]`` (what an importer read)."""
    width, m = check_width(max_seq_len, pad_multiple)
    return _membership(lengths, row_offsets, width, m)


def _membership(lengths: ArrayLike, row_offsets: ArrayLike, width: int, m: int) -> RowPlan:
    """:func:`plan_from_membership` on a width already checked."""
    lengths_in = np.asarray(lengths, dtype=np.int64)
    offsets = np.asarray(row_offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets[0] != 0 or offsets[-1] != lengths_in.shape[0] or np.any(np.diff(offsets) < 1):
        raise ValueError("row_offsets must run from 0 to the number of samples, strictly increasing")
    return _finish(lengths_in, np.arange(lengths_in.shape[0], dtype=np.int64), offsets, width, m)


@dataclass(frozen=True)
class BinPack:
    """Stage 2 by bin packing: :func:`plan_rows` with these settings (validated here, once).
    ``max_patches_per_row``: the second budget of samples with images (their vision patches,
    the ``weights`` :meth:`plan` takes); ``None``: tokens only."""

    max_seq_len: int
    pad_multiple: int = 1
    algorithm: Algorithm = Algorithm.BFD
    seed: int = 0
    max_patches_per_row: int | None = None

    def __post_init__(self) -> None:
        width, m = check_width(self.max_seq_len, self.pad_multiple)
        object.__setattr__(self, "max_seq_len", width)
        object.__setattr__(self, "pad_multiple", m)
        object.__setattr__(self, "algorithm", choose(Algorithm, self.algorithm, "algorithm"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        budget = positive_int("max_patches_per_row", self.max_patches_per_row, allow_none=True)
        object.__setattr__(self, "max_patches_per_row", budget)

    def plan(
        self,
        lengths: ArrayLike,
        row_sizes: Iterable[int] | None = None,
        weights: ArrayLike | None = None,
        groups: ArrayLike | None = None,
    ) -> RowPlan:
        if row_sizes is not None:
            raise ValueError("bin packing plans its own rows, but the samples came in rows: keep them with KeepRows")
        return _bin_pack(
            lengths,
            self.max_seq_len,
            self.pad_multiple,
            self.algorithm,
            self.seed,
            weights,
            self.max_patches_per_row,
            groups,
        )

    def fingerprint(self) -> dict[str, Any]:
        """The manifest fingerprint's entries for the packing."""
        fp: dict[str, Any] = {"algorithm": str(self.algorithm), "seed": self.seed}
        if self.max_patches_per_row is not None:
            fp["max_patches_per_row"] = self.max_patches_per_row
        return fp


@dataclass(frozen=True)
class KeepRows:
    """Stage 2 that keeps a given packing: row ``r`` holds the next ``row_sizes[r]``
    samples. The sizes are the ones stage 1 recorded for samples given in rows (the
    importers), else ``row_sizes`` (read when planning, after every sample came in).
    ``max_seq_len=None``: as wide as the widest row needs, rounded up to ``pad_multiple``."""

    row_sizes: Iterable[int] | None
    max_seq_len: int | None
    pad_multiple: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "pad_multiple", positive_int("pad_multiple", self.pad_multiple))
        if self.max_seq_len is not None:
            object.__setattr__(self, "max_seq_len", check_width(self.max_seq_len, self.pad_multiple)[0])

    def plan(
        self,
        lengths: ArrayLike,
        row_sizes: Iterable[int] | None = None,
        weights: ArrayLike | None = None,
        groups: ArrayLike | None = None,
    ) -> RowPlan:
        sizes = row_sizes if row_sizes is not None else self.row_sizes
        if sizes is None:
            raise ValueError("KeepRows needs the row sizes: samples given in rows, or row_sizes")
        lengths = np.asarray(lengths, np.int64)
        offsets = np.concatenate([[0], np.cumsum(np.fromiter(sizes, np.int64))]).astype(np.int64)
        if offsets[-1] != lengths.shape[0]:
            raise PrepackError(f"row_sizes add up to {int(offsets[-1])} samples but {lengths.shape[0]} came in")
        if groups is not None:  # the rows given must keep each pair whole too
            g, cut = np.asarray(groups, np.int64), offsets[1:-1]
            split = cut[(cut > 0) & (g[cut - 1] == g[np.minimum(cut, g.shape[0] - 1)])]
            if split.shape[0]:
                raise PrepackError(
                    f"the rows given split a preference pair (samples {int(split[0]) - 1} and {int(split[0])}, one "
                    "group): a pair is kept whole in one row; give rows that hold each pair whole"
                )
        width = self.max_seq_len
        if width is None:  # as wide as the widest row needs (checked against the format's limit)
            loads = np.add.reduceat(padded_lengths(lengths, self.pad_multiple), offsets[:-1])
            width = check_width(round_up(int(loads.max()), self.pad_multiple), self.pad_multiple)[0]
        return _membership(lengths, offsets, width, self.pad_multiple)

    def fingerprint(self) -> dict[str, Any]:
        return {"algorithm": "kept from the source", "seed": None}
