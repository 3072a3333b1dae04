"""How much packing saves on a set of lengths: the table behind ``sftpack bench``
and step 3 of ``sftpack demo``.

For rows of ``capacity`` tokens it compares every bin-packing algorithm with the
two layouts that do not pack (one conversation per row padded to the capacity;
batches of ``batch_size`` in input order padded to their longest) and reports
rows, the fraction of slots holding real tokens, sequences per row and the time
each packer took.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._types import Tokenizer
from ..binpack import Algorithm, lower_bounds, pack, packing_stats
from ..chat import ReadStats, TokenizeStats, tokenize_conversations

__all__ = ["BenchReport", "LayoutRow", "bench_lengths", "compare_layouts", "format_layouts", "format_table"]


@dataclass
class LayoutRow:
    layout: str
    rows: int
    efficiency: float  #: real tokens / row slots
    per_row: float | None  #: sequences per row (None for padded batches)
    seconds: float | None = None  #: packing time (None for the unpacked layouts)


def compare_layouts(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    algorithms: Sequence[str] = tuple(Algorithm),
    cost_multiple: int = 1,
    batch_size: int = 8,
    seed: int = 0,
) -> tuple[list[LayoutRow], tuple[int, int]]:
    """One :class:`LayoutRow` per algorithm plus the two unpacked layouts, and
    the ``(L1, L2)`` lower bounds on the row count.

    >>> rows, bounds = compare_layouts([5, 10, 3, 8, 6], 16, algorithms=["bfd", "next_fit"])
    >>> [(r.layout, r.rows) for r in rows], bounds
    ([('bfd', 2), ('next_fit', 3), ('one per row, padded to 16', 5), ('batches of 8, padded to longest', 1)], (2, 2))
    """
    arr = np.asarray(lengths, dtype=np.int64)
    real = int(arr.sum())
    out = []
    for name in algorithms:
        pack(arr[:64], capacity, name, cost_multiple=cost_multiple, seed=seed)  # load compiled kernels first
        t0 = time.perf_counter()
        bins = pack(arr, capacity, name, cost_multiple=cost_multiple, seed=seed)
        dt = time.perf_counter() - t0
        s = packing_stats(arr, bins, capacity, cost_multiple=cost_multiple)
        out.append(LayoutRow(str(name), s.rows, s.efficiency, s.packing_factor, dt))
    out.append(LayoutRow(f"one per row, padded to {capacity}", len(arr), real / (len(arr) * capacity), 1.0))
    groups = [arr[i : i + batch_size] for i in range(0, len(arr), batch_size)]
    slots = sum(int(g.max()) * len(g) for g in groups)
    out.append(LayoutRow(f"batches of {batch_size}, padded to longest", len(groups), real / slots, None))
    b = lower_bounds(arr, capacity, cost_multiple=cost_multiple)
    return out, (b.l1, b.l2)


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    """A plain aligned text table (first column left-aligned, the rest right-aligned).

    >>> print(format_table(("a", "bb"), [("x", 1), ("yy", 22)], indent=""))
    a   bb
    --  --
    x    1
    yy  22
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for j, r in enumerate(cells):
        lines.append(indent + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_layouts(rows: Sequence[LayoutRow], bounds: tuple[int, int]) -> str:
    """The :func:`compare_layouts` table as text, with the lower bounds under it."""
    table = format_table(
        ("layout", "rows", "real tokens / slots", "seqs per row", "pack time"),
        [
            (
                r.layout,
                f"{r.rows:,}",
                f"{r.efficiency:.2%}",
                "-" if r.per_row is None else f"{r.per_row:.2f}",
                "-" if r.seconds is None else f"{r.seconds * 1e3:.1f} ms",
            )
            for r in rows
        ],
    )
    return table + f"\n  lower bounds on rows: L1={bounds[0]:,}, L2={bounds[1]:,}"


@dataclass
class BenchReport:
    """What ``sftpack bench`` found: where the conversations came from, how they
    tokenized, and the layouts compared (the CLI renders it)."""

    source: str
    read_stats: ReadStats | None  #: the reader's (``None`` for the embedded corpus)
    tokenize_stats: TokenizeStats
    lengths: np.ndarray
    seconds: float
    layouts: list[LayoutRow]
    bounds: tuple[int, int]


def bench_lengths(
    conversations: Iterable[Any],
    tokenizer: Tokenizer,
    *,
    source: str,
    read_stats: ReadStats | None = None,
    max_seq_len: int,
    pad_multiple: int = 1,
    overlong: str = "split",
    on_bad_row: str = "error",
    num_proc: int = 1,
    seed: int = 0,
    progress: bool = False,
) -> BenchReport:
    """Tokenize ``conversations`` and compare the packing layouts of their lengths."""
    t0 = time.perf_counter()
    tokenized = tokenize_conversations(
        conversations,
        tokenizer,
        max_seq_len=max_seq_len,
        overlong=overlong,
        on_bad_row=on_bad_row,
        num_proc=num_proc,
        progress=progress,
    )
    lengths = np.fromiter((len(s) for s in tokenized), dtype=np.int64)
    dt = time.perf_counter() - t0
    layouts: list[LayoutRow] = []
    bounds = (0, 0)
    if len(lengths):
        layouts, bounds = compare_layouts(lengths, max_seq_len, cost_multiple=pad_multiple, seed=seed)
    return BenchReport(source, read_stats, tokenized.stats, lengths, dt, layouts, bounds)
