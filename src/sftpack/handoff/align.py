"""Alignment: how far each sequence and each row must be padded, and why.

Three rules (Megatron-LM / Transformer Engine conventions):

1. Context parallelism of size ``CP > 1`` cuts every sequence into ``2*CP`` equal
   chunks (rank ``r`` takes chunks ``r`` and ``2*CP-1-r`` so causal work is
   balanced), so each padded sequence is a multiple of ``2*CP``.
2. Sequence parallelism splits the (local) row once more over the ``TP`` ranks:
   the per-sequence multiple is multiplied by ``TP`` (as verl and NeMo-RL do).
3. FP8 GEMMs need the rows each rank sees, after the CP and TP split, to be a
   multiple of 16 (per-tensor "tensorwise" or "delayed" scaling), 32 (MXFP8
   blocks) or 128 (blockwise 1x128 / 128x128 scaling). That is a multiple for the
   whole row: ``16 * CP * TP`` etc. (the row's tail goes into the last segment).

``CP=2, TP=2`` with sequence parallelism and MXFP8: each sequence to a multiple of
8, the row to a multiple of ``lcm(8, 32*2*2) = 128``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._base import StrEnum, choose, positive_int, round_up
from .batch import PackedBatch

__all__ = ["Alignment", "AlignmentError", "FP8Recipe", "pad_multiple_for"]


class AlignmentError(ValueError):
    """A size breaks one of the alignment rules (the message names the rule)."""


class FP8Recipe(StrEnum):
    """FP8 scaling recipes and the row multiple (per CP/TP rank) each needs."""

    TENSORWISE = "tensorwise"  #: one scale per tensor, current scaling: rows multiple of 16
    DELAYED = "delayed"  #: one scale per tensor from an amax history: rows multiple of 16
    MXFP8 = "mxfp8"  #: microscaling, one scale per 32 elements: rows multiple of 32
    BLOCKWISE = "blockwise"  #: 1x128 / 128x128 block scales: rows multiple of 128

    @property
    def row_multiple(self) -> int:
        return {"tensorwise": 16, "delayed": 16, "mxfp8": 32, "blockwise": 128}[self.value]


def _parse_fp8(fp8: object) -> FP8Recipe | None:
    if fp8 is None or fp8 is False:
        return None
    return choose(FP8Recipe, fp8, "fp8 (or None)", AlignmentError)


def _size(name: str, value: object) -> int:
    return positive_int(name, value, error=AlignmentError)


@dataclass(frozen=True)
class Alignment:
    """Padding multiples for one parallel layout.

    Attributes:
        seq_multiple: pad every sequence to a multiple of this
            (``pack_step(pad_multiple=...)``, ``plan_microbatches(pad_multiple=...)``,
            ``build_row(pad_multiple=...)``).
        row_multiple: pad the whole packed row to a multiple of this
            (``pack_step(pad_to_multiple_of=...)``); always a multiple of ``seq_multiple``.
        cp_size, tp_size, sequence_parallel, fp8: the layout it was computed for.
    """

    seq_multiple: int
    row_multiple: int
    cp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    fp8: FP8Recipe | None = None

    @property
    def split(self) -> int:
        """Ranks that each hold a slice of one row's tokens (``CP``, times ``TP`` with SP)."""
        return self.cp_size * (self.tp_size if self.sequence_parallel else 1)

    def pack_step_kwargs(self) -> dict[str, int]:
        """``pad_multiple`` and ``pad_to_multiple_of`` for :func:`~sftpack.trainer.pack_step`."""
        return {"pad_multiple": self.seq_multiple, "pad_to_multiple_of": self.row_multiple}

    def fixed_width(self, width: int) -> int:
        """Check a fixed row width (pipeline parallelism's ``max_seq_len`` of :func:`~sftpack.trainer.pack_step`); return it."""
        _size("width", width)
        if width % self.row_multiple:
            up = round_up(width, self.row_multiple)
            raise AlignmentError(
                f"row width {width} is not a multiple of {self.row_multiple} ({self._why_row()}): use {up}"
            )
        return width

    def _why_seq(self) -> str:
        parts = []
        if self.cp_size > 1:
            parts.append(f"2*CP = {2 * self.cp_size}: context parallelism cuts each sequence into 2*CP chunks")
        if self.sequence_parallel and self.tp_size > 1:
            parts.append(f"times TP = {self.tp_size}: sequence parallelism splits each chunk over TP ranks")
        return "; ".join(parts) or "no parallel split"

    def _why_row(self) -> str:
        if self.fp8 is None:
            return f"every sequence is a multiple of {self.seq_multiple}"
        return (
            f"FP8 {self.fp8.value} needs each rank's rows to be a multiple of {self.fp8.row_multiple}, and a row "
            f"is split over {self.split} rank(s) (CP={self.cp_size}"
            + (f" x TP={self.tp_size} with sequence parallelism" if self.sequence_parallel else "")
            + ")"
        )

    def check(self, packed: PackedBatch) -> PackedBatch:
        """Raise :class:`AlignmentError` naming the rule a packed row breaks; return it.

        Every segment but the last must be a multiple of ``seq_multiple`` (the last
        too: it absorbs the tail, and context parallelism chunks it like any other),
        and the row width a multiple of ``row_multiple``. Reads the boundaries on the
        host.
        """
        padded = (packed.cu_seqlens_padded[1:] - packed.cu_seqlens_padded[:-1]).tolist()
        for i, p in enumerate(padded):
            if p % self.seq_multiple:
                raise AlignmentError(
                    f"segment {i} has padded length {p}, not a multiple of {self.seq_multiple} ({self._why_seq()}); "
                    f"pack with pad_multiple={self.seq_multiple}"
                )
        T = packed.num_tokens
        if T % self.row_multiple:
            raise AlignmentError(
                f"the row has T={T} slots, not a multiple of {self.row_multiple} ({self._why_row()}); pack with "
                f"pad_to_multiple_of={self.row_multiple}"
            )
        return packed


def pad_multiple_for(
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    fp8: FP8Recipe | str | None = None,
) -> Alignment:
    """The per-sequence and per-row padding multiples a parallel layout needs.

    Args:
        cp_size: context-parallel size (``CP``).
        tp_size: tensor-parallel size (``TP``); only matters with ``sequence_parallel``.
        sequence_parallel: Megatron sequence parallelism (activations split over TP
            along the token axis).
        fp8: ``None`` or an :class:`FP8Recipe` name: ``"tensorwise"``, ``"delayed"``,
            ``"mxfp8"``, ``"blockwise"``.

    Returns:
        :class:`Alignment` with ``seq_multiple`` (``2*CP`` if ``CP > 1``, times ``TP``
        with sequence parallelism) and ``row_multiple`` (``lcm(seq_multiple,
        f * CP * TP_sp)`` with FP8's ``f`` of 16/32/128, else ``seq_multiple``).

    >>> pad_multiple_for(cp_size=2)
    Alignment(seq_multiple=4, row_multiple=4, cp_size=2, tp_size=1, sequence_parallel=False, fp8=None)
    >>> a = pad_multiple_for(cp_size=2, tp_size=2, sequence_parallel=True, fp8="mxfp8")
    >>> a.seq_multiple, a.row_multiple
    (8, 128)
    """
    cp = _size("cp_size", cp_size)
    tp = _size("tp_size", tp_size)
    recipe = _parse_fp8(fp8)
    sp = bool(sequence_parallel)
    seq = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    split = cp * (tp if sp else 1)
    row = seq if recipe is None else math.lcm(seq, recipe.row_multiple * split)
    return Alignment(seq, row, cp, tp, sp, recipe)
