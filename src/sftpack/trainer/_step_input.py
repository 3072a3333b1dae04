"""What :func:`~sftpack.trainer.pack_step` is given, checked: the batch, its options and where each row ends.

:func:`check_options` reads the ``(B, S)`` batch and the padding options into a frozen
:class:`StepOptions` and :func:`check_padding` (or raise :class:`~sftpack.PackedBatchError` naming the option,
its value and the fix); :func:`source_lengths` reads each row's real length from ``lengths`` or
a right-padded ``attention_mask``; :func:`batch_tensor` checks a per-token tensor against
the batch. Every message starts ``pack_step:``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._base import check_width, positive_int
from ..handoff import PackedBatchError
from ..handoff.layout import check_pad_id

__all__ = ["StepOptions", "batch_tensor", "check_options", "check_padding", "source_lengths"]


@dataclass(frozen=True)
class StepOptions:
    """A checked ``pack_step`` call: the batch shape ``(B, S)`` and ``device``, the per-sequence
    multiple ``m``, the optional row multiple and fixed row ``width``, and ``pad_id``."""

    B: int
    S: int
    device: torch.device
    m: int
    row_multiple: int | None
    width: int | None
    pad_id: int


def _positive_int(name: str, value: object, *, allow_none: bool = False) -> int | None:
    return positive_int(name, value, error=PackedBatchError, allow_none=allow_none, who="pack_step")


def check_options(input_ids: object, *, pad_id: int, sequence_ids: Sequence[object] | None) -> StepOptions:
    """The batch, ``pad_id`` and ``sequence_ids`` checked; the padding options are
    :func:`check_padding`'s (the media, lengths and masks are checked by their own units)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise PackedBatchError(f"pack_step: input_ids must be a (B, S) tensor, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise PackedBatchError(f"pack_step: input_ids must hold integer ids, got {input_ids.dtype}")
    B, S = (int(x) for x in input_ids.shape)
    if B == 0 or S == 0:
        raise PackedBatchError(f"pack_step: the batch is empty (shape {(B, S)})")
    check_pad_id(pad_id, "pack_step")
    if sequence_ids is not None and len(sequence_ids) != B:
        raise PackedBatchError(f"pack_step: sequence_ids has {len(sequence_ids)} entries for a batch of B={B} rows")
    return StepOptions(B, S, input_ids.device, 1, None, None, pad_id)


def check_padding(
    opts: StepOptions, *, pad_multiple: object, pad_to_multiple_of: object, max_seq_len: object
) -> StepOptions:
    """``opts`` with the padding options checked: the per-sequence multiple, the row multiple
    (a multiple of it) and the fixed row width (a multiple of both)."""
    m = _positive_int("pad_multiple", pad_multiple)
    row_mult = _positive_int("pad_to_multiple_of", pad_to_multiple_of, allow_none=True)
    width = _positive_int("max_seq_len", max_seq_len, allow_none=True)
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
            width,
            row_mult or m,
            name="max_seq_len",
            multiple_name=multiple_name,
            who="pack_step",
            error=PackedBatchError,
        )
    return StepOptions(opts.B, opts.S, opts.device, m, row_mult, width, opts.pad_id)


def batch_tensor(name: str, t: object, opts: StepOptions) -> torch.Tensor:
    """``t`` if it is a tensor of the batch's shape on its device, else :class:`PackedBatchError`."""
    shape = (opts.B, opts.S)
    if not isinstance(t, torch.Tensor):
        raise PackedBatchError(f"pack_step: {name} must be a torch.Tensor of shape {shape}, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise PackedBatchError(
            f"pack_step: {name} has shape {tuple(t.shape)} but input_ids has shape {shape}; give one entry per token"
        )
    if t.device != opts.device:
        raise PackedBatchError(f"pack_step: {name} is on {t.device} but input_ids is on {opts.device}; move it first")
    return t


def source_lengths(
    opts: StepOptions,
    lengths: torch.Tensor | Sequence[int] | np.ndarray | None,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(lengths (B,) int64 where they live, per row: is its mask not right-padded)``; the second is
    ``None`` for ``lengths`` (checked with the others in one transfer: :func:`~._step_layout.read_shape`)."""
    B = opts.B
    not_right_padded = None
    if attention_mask is not None:
        am = batch_tensor("attention_mask", attention_mask, opts).bool()
        lens = am.sum(1)
        # Right-padded means no 0 -> 1 step along a row (one pass, cheaper than
        # comparing with "column < length").
        not_right_padded = (am[:, 1:] > am[:, :-1]).any(1)
    elif lengths is not None:
        if isinstance(lengths, torch.Tensor):
            lens = lengths.reshape(-1)
        else:
            lens = torch.as_tensor(np.asarray(lengths).reshape(-1))
        if lens.dtype.is_floating_point or lens.dtype == torch.bool:
            raise PackedBatchError(f"pack_step: lengths must be integers, got {lens.dtype}")
        if lens.shape[0] != B:
            raise PackedBatchError(f"pack_step: lengths has {lens.shape[0]} entries for a batch of B={B} rows")
    else:
        raise PackedBatchError("pack_step: give lengths (B,) or attention_mask (B, S) to say where each row ends")
    return lens.to(torch.int64), not_right_padded
