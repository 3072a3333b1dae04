"""Groups that no packer splits: :class:`Groups`, the items of each group as one unit.

A DPO pair (chosen and rejected) or the N completions of one GRPO prompt must share a
row, a micro-batch and a rank. Every packer honours that the same way: it packs the
groups as units (each unit's size the sum of its members'), then expands each unit back
to its members, in their input order. :class:`Groups` is that mapping, built once from a
``(n,)`` group id per item; :func:`sftpack.binpack.pack` and
:func:`sftpack.balance.assign` take ``groups=`` and use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ._inputs import _as_lengths


@dataclass(frozen=True, eq=False)
class Groups:
    """Items bound into groups, numbered ``0..G-1`` in the order each group first appears.

    Attributes:
        unit: ``(n,)`` int64: the group number of each item.
        ids: ``(G,)`` int64: the caller's id of each group.
        sizes: ``(G,)`` int64: the members of each group (``>= 1``).
        members: ``(n,)`` int64: the item indices group after group, each group's
            ascending: group ``g``'s are ``members[starts[g]:starts[g] + sizes[g]]``.
        starts: ``(G,)`` int64.

    >>> g = Groups.of([7, 3, 7, 3, 5])
    >>> g.unit.tolist(), g.ids.tolist(), g.sizes.tolist()
    ([0, 1, 0, 1, 2], [7, 3, 5], [2, 2, 1])
    >>> g.sum([10, 20, 30, 40, 50]).tolist()
    [40, 60, 50]
    >>> g.items([2, 0]).tolist()  # the members of groups 2 then 0
    [4, 0, 2]
    """

    unit: np.ndarray
    ids: np.ndarray
    sizes: np.ndarray
    members: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, groups: ArrayLike, n: int | None = None) -> Groups:
        """The groups of ``(n,)`` integer ids (any integers; equal ids share a group).

        Raises:
            ValueError: not one id per item (``n`` given), or ids that are not int64 integers
                (``TypeError`` for a non-integer, naming its index).
        """
        g = _as_lengths(groups, "groups")
        if n is not None and g.shape[0] != n:
            raise ValueError(
                f"groups has {g.shape[0]} entries but there are {n} sequences: give one group id per sequence"
            )
        ids, first, inverse = np.unique(g, return_index=True, return_inverse=True)
        by_first = np.argsort(first, kind="stable")  # groups in the order they first appear
        number = np.empty(ids.shape[0], np.int64)
        number[by_first] = np.arange(ids.shape[0], dtype=np.int64)
        unit = number[inverse.reshape(-1)]
        sizes = np.bincount(unit, minlength=ids.shape[0]).astype(np.int64)
        members = np.argsort(unit, kind="stable").astype(np.int64)
        starts = (np.cumsum(sizes) - sizes).astype(np.int64)
        return cls(unit, ids[by_first].astype(np.int64), sizes, members, starts)

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    def sum(self, values: ArrayLike) -> np.ndarray:
        """``(G,)``: each group's sum of the items' ``values`` (``(n,)``; integers stay exact)."""
        v = np.asarray(values)
        if v.shape != self.unit.shape:
            raise ValueError(f"values has shape {v.shape} but there are {self.unit.shape[0]} items")
        if len(self) == 0:
            return np.zeros(0, v.dtype)
        return np.add.reduceat(v[self.members], self.starts)

    def items(self, units: ArrayLike) -> np.ndarray:
        """``(k,)`` int64: the members of ``units`` (group numbers), group after group, each in input order."""
        u = np.asarray(units, dtype=np.int64)
        sizes = self.sizes[u]
        shift = self.starts[u] - (np.cumsum(sizes) - sizes)  # where each group's run starts, less its output start
        return self.members[np.repeat(shift, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)]

    def describe(self, g: int) -> str:
        """``group <id> (sequences [i, j, ...])``: how an error names group number ``g``."""
        idx = self.items([g]).tolist()
        shown = ", ".join(map(str, idx[:8])) + (", ..." if len(idx) > 8 else "")
        return f"group {int(self.ids[g])} ({len(idx)} sequence{'s' if len(idx) != 1 else ''}: [{shown}])"
