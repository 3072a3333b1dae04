"""Rows under two budgets: tokens per row and vision patches per row.

The vision encoder's activations grow with the patches of a row, not with its
tokens (a 448x448 image is 1,024 patches but 256 placeholder tokens), so a row
planner for multimodal data may cap both. :func:`plan_rows` is
``sftpack.binpack.pack(..., "ffd", cost_multiple=pad_multiple, weights=patches,
max_weight_per_bin=max_patches_per_row)``: first-fit decreasing over the token cost (length
rounded up to ``pad_multiple``, what the row builder lays), placing a sample in the
first row where both its tokens and its patches fit. Without ``max_patches_per_row`` its rows
are exactly binpack's first-fit decreasing rows. Each row lists its samples in input
order, as every path's rows do. Deterministic; numpy and the bin packer only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .._base import renamed, warn_renamed
from ..binpack import pack
from ..sample import Overlong, OverlongError

__all__ = ["OVER_PATCH_BUDGET", "PatchBudgetError", "check_patch_budget", "plan_rows"]

#: the counted drop reason of an item with a sample (or piece) over the patch budget
OVER_PATCH_BUDGET = "over_patch_budget"


class PatchBudgetError(OverlongError):
    """A sample with more vision patches than a row may hold, under ``overlong="error"``.

    Attributes:
        conversation_id: the sample's conversation id; patches: its vision patches;
        max_patches_per_row: the budget; who: how the message names the sample.
    """

    def __init__(
        self,
        message: str,
        conversation_id: Any = None,
        patches: int = 0,
        max_patches_per_row: int = 0,
        who: str = "",
    ):
        super().__init__(message, conversation_id)
        self.patches, self.max_patches_per_row, self.who = patches, max_patches_per_row, who

    @property
    def max_patches(self) -> int:
        """The old name of :attr:`max_patches_per_row` (one release, with a ``DeprecationWarning``)."""
        warn_renamed("PatchBudgetError", ".max_patches", ".max_patches_per_row", stacklevel=2)
        return self.max_patches_per_row

    def __reduce__(self) -> tuple[Any, ...]:  # keeps the fields across worker processes
        return (type(self), (str(self), self.conversation_id, self.patches, self.max_patches_per_row, self.who))


def check_patch_budget(
    samples: Iterable[Any], max_patches_per_row: int | None, overlong: Overlong | str, who: str | None = None
) -> str | None:
    """The patch-budget rule of every path, for the samples of one item (a sample, or the pieces
    of a split one; each with ``num_patches`` and ``conversation_id``).

    Returns ``None`` when every sample fits ``max_patches_per_row`` (or there is no budget), else
    :data:`OVER_PATCH_BUDGET`: the reason the whole item is dropped and counted.

    Raises:
        PatchBudgetError: ``overlong="error"`` and a sample is over the budget; the message names
            it (``who``, default ``conversation <id>``), its patches, the budget and the fix.

    >>> from types import SimpleNamespace as S
    >>> check_patch_budget([S(num_patches=8, conversation_id="c")], 8, "error") is None
    True
    >>> check_patch_budget([S(num_patches=8, conversation_id="c"), S(num_patches=9, conversation_id="c")], 8, "drop")
    'over_patch_budget'
    """
    if max_patches_per_row is None:
        return None
    big = next((s for s in samples if int(s.num_patches) > max_patches_per_row), None)
    if big is None:
        return None
    if Overlong(overlong) is Overlong.ERROR:
        name = who if who is not None else f"conversation {big.conversation_id!r}"
        patches = int(big.num_patches)
        raise PatchBudgetError(
            f"{name} has {patches} vision patches, more than max_patches_per_row={max_patches_per_row}: no row can "
            f"hold it; raise max_patches_per_row, lower the images' max_pixels, or use overlong='drop' or 'split' to drop it "
            f"(counted as {OVER_PATCH_BUDGET})",
            big.conversation_id,
            patches,
            int(max_patches_per_row),
            name,
        )
    return OVER_PATCH_BUDGET


def plan_rows(
    lengths: ArrayLike,
    patches: ArrayLike,
    *,
    max_seq_len: int,
    max_patches_per_row: int | None = None,
    pad_multiple: int = 1,
    max_patches: int | None = None,
) -> list[np.ndarray]:
    """Rows (arrays of sample indices, ascending) under a token and a patch budget.

    Args:
        lengths: ``(n,)`` sample lengths (vision tokens included), each ``>= 1``.
        patches: ``(n,)`` vision patches of each sample (``Sample.num_patches``).
        max_seq_len: tokens per row (of cost: lengths rounded up to ``pad_multiple``).
        max_patches_per_row: patches per row; ``None``: no patch budget.
        pad_multiple: the row builder's per-sample pad multiple.
        max_patches: the old spelling of ``max_patches_per_row`` (one release, with a
            ``DeprecationWarning``).

    Raises:
        ValueError: a sample that alone exceeds a budget (naming its index and the numbers).
    """
    max_patches_per_row = renamed("plan_rows", "max_patches_per_row", max_patches_per_row, "max_patches", max_patches)
    ln = np.asarray(lengths, dtype=np.int64).reshape(-1)
    pt = np.asarray(patches, dtype=np.int64).reshape(-1)
    if ln.shape != pt.shape:
        raise ValueError(f"plan_rows: {ln.size} lengths but {pt.size} patch counts")
    if pad_multiple < 1 or max_seq_len < 1:
        raise ValueError(f"plan_rows: need pad_multiple >= 1 and max_seq_len >= 1, got {pad_multiple}, {max_seq_len}")
    if ln.size and int(ln.min()) < 1:
        raise ValueError(
            f"plan_rows: sample {int(np.argmin(ln))} has length {int(ln.min())}; every sample needs a token"
        )
    cost = -(-ln // pad_multiple) * pad_multiple
    big = np.flatnonzero(cost > max_seq_len)
    if big.size:
        i = int(big[0])
        raise ValueError(
            f"plan_rows: sample {i} costs {int(cost[i])} tokens (length {int(ln[i])} padded to a multiple of "
            f"{pad_multiple}), more than max_seq_len={max_seq_len}: split or drop it first"
        )
    cap_p = np.iinfo(np.int64).max if max_patches_per_row is None else int(max_patches_per_row)
    if pt.size and int(pt.max()) > cap_p:
        i = int(np.argmax(pt))
        raise ValueError(
            f"plan_rows: sample {i} has {int(pt[i])} patches, more than max_patches_per_row={cap_p}: "
            "drop or refuse it first (check_patch_budget)"
        )
    if ln.size == 0:
        return []
    bins = pack(
        ln,
        max_seq_len,
        "ffd",
        cost_multiple=pad_multiple,
        weights=pt,
        max_weight_per_bin=max_patches_per_row,
    )
    return [np.sort(np.asarray(r, dtype=np.int64)) for r in bins]
