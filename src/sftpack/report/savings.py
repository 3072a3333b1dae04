"""How much packing saves on a set of lengths: the table behind ``sftpack bench``
and step 3 of ``sftpack demo``; and, for multimodal samples, the same under a
second budget (vision patches per row): ``sftpack bench --corpus vqa``.

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

from .._base import renamed
from .._types import Tokenizer
from ..binpack import PLAIN_MAX_ITEMS, Algorithm, lower_bounds, pack, packing_stats
from ..chat import ReadStats, TokenizeStats, tokenize_conversations

__all__ = [
    "BenchReport",
    "LayoutRow",
    "MediaBenchReport",
    "MediaLayoutRow",
    "bench_lengths",
    "bench_media",
    "compare_layouts",
    "compare_media_layouts",
    "format_layouts",
    "format_media_layouts",
    "format_table",
]


@dataclass
class LayoutRow:
    layout: str
    rows: int
    efficiency: float  #: real tokens / row slots
    per_row: float | None  #: sequences per row (None for padded batches)
    seconds: float | None = None  #: packing time, kernels loaded (None for the unpacked layouts)
    #: the packer's first call in this process (:data:`WARM` lengths): loading or compiling its numba kernels
    load_seconds: float | None = None


#: lengths in the first, separately timed call of each packer: one past the plain-Python kernels' limit
WARM = PLAIN_MAX_ITEMS + 1


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
        t0 = time.perf_counter()
        # the numba kernels' first call (import, compile or load from the disk cache), timed apart: past
        # PLAIN_MAX_ITEMS sequences pack() runs them (fewer run as plain Python and load nothing)
        pack(arr[:WARM], capacity, name, cost_multiple=cost_multiple, seed=seed)
        t1 = time.perf_counter()
        bins = pack(arr, capacity, name, cost_multiple=cost_multiple, seed=seed)
        dt = time.perf_counter() - t1
        s = packing_stats(arr, bins, capacity, cost_multiple=cost_multiple)
        out.append(LayoutRow(str(name), s.rows, s.efficiency, s.packing_factor, dt, t1 - t0))
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


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def load_line(rows: Sequence[LayoutRow] | Sequence[MediaLayoutRow]) -> str:
    """The line under a layouts table: each packer's first call in this process (loading or
    compiling its numba kernels), which its ``pack time`` leaves out.

    >>> print(load_line([LayoutRow("bfd", 2, 0.9, 2.0, 0.0001, 0.4872), LayoutRow("one per row", 5, 0.4, 1.0)]))
      compiler load (each packer's first call, once per process; not in pack time): bfd 487.2 ms
    """
    parts = []
    for r in rows:
        if r.load_seconds is None:
            continue
        budget = getattr(r, "patch_budget", None)
        parts.append(f"{r.layout}{'' if budget is None else ' + patch budget'} {_ms(r.load_seconds)}")
    return "  compiler load (each packer's first call, once per process; not in pack time): " + ", ".join(parts)


def format_layouts(rows: Sequence[LayoutRow], bounds: tuple[int, int]) -> str:
    """The :func:`compare_layouts` table as text, with the lower bounds under it; the
    kernels' load (:func:`load_line`) apart from the packing time."""
    table = format_table(
        ("layout", "rows", "real tokens / slots", "seqs per row", "pack time"),
        [
            (
                r.layout,
                f"{r.rows:,}",
                f"{r.efficiency:.2%}",
                "-" if r.per_row is None else f"{r.per_row:.2f}",
                _ms(r.seconds),
            )
            for r in rows
        ],
    )
    return table + f"\n  lower bounds on rows: L1={bounds[0]:,}, L2={bounds[1]:,}\n{load_line(rows)}"


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


@dataclass
class MediaLayoutRow:
    """One packer (or the unpacked layout) on multimodal samples, with or without a patch budget."""

    layout: str
    patch_budget: int | None  #: the vision patches per row allowed (None: no second budget)
    rows: int
    fill: float  #: real tokens (text + vision placeholders) / row slots
    vision: float  #: vision placeholder tokens / row slots
    patches_mean: float  #: vision patches per row, mean
    patches_max: int  #: vision patches of the heaviest row
    over_budget: int  #: rows over ``max_patches_per_row`` (what the vision tower would have to take)
    seconds: float | None = None  #: packing time, kernels loaded (None for the unpacked layout)
    load_seconds: float | None = None  #: the packer's first call (:data:`WARM` samples): loading its numba kernels


def compare_media_layouts(
    lengths: Sequence[int] | np.ndarray,
    patches: Sequence[int] | np.ndarray,
    vision_tokens: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    max_patches_per_row: int | None = None,
    algorithms: Sequence[str] = tuple(Algorithm),
    cost_multiple: int = 1,
    seed: int = 0,
    max_patches: int | None = None,
) -> list[MediaLayoutRow]:
    """Each packer without and with the patch budget ``max_patches_per_row``, then one sample per row
    (``max_patches``: its old spelling, one release with a ``DeprecationWarning``).

    ``lengths``: sample lengths (vision placeholders included); ``patches``: each sample's
    vision patches (the second budget's weights); ``vision_tokens``: its placeholder tokens.

    >>> rows = compare_media_layouts([5, 10, 3, 8, 6], [1, 3, 0, 2, 2], [1, 3, 0, 2, 2], 16,
    ...                                   max_patches_per_row=3, algorithms=["ffd"])
    >>> [(r.layout, r.patch_budget, r.rows, r.patches_max, r.over_budget) for r in rows]
    [('ffd', None, 2, 5, 1), ('ffd', 3, 3, 3, 0), ('one per row', None, 5, 3, 0)]
    """
    budget_given = renamed(
        "compare_media_layouts", "max_patches_per_row", max_patches_per_row, "max_patches", max_patches
    )
    if budget_given is None:
        raise TypeError("compare_media_layouts: give max_patches_per_row (the patch budget of a row)")
    max_patches_per_row = budget_given
    ln = np.asarray(lengths, dtype=np.int64)
    pt = np.asarray(patches, dtype=np.int64)
    vt = np.asarray(vision_tokens, dtype=np.int64)
    real, vision = int(ln.sum()), int(vt.sum())

    def row(
        name: str, budget: int | None, order: np.ndarray, offsets: np.ndarray, dt: float | None, load: float | None
    ) -> Any:
        per_row = np.add.reduceat(pt[order], offsets[:-1]) if len(order) else np.zeros(0, np.int64)
        slots = (len(offsets) - 1) * capacity
        return MediaLayoutRow(
            name,
            budget,
            len(offsets) - 1,
            real / slots if slots else 0.0,
            vision / slots if slots else 0.0,
            float(per_row.mean()) if len(per_row) else 0.0,
            int(per_row.max()) if len(per_row) else 0,
            int((per_row > max_patches_per_row).sum()),
            dt,
            load,
        )

    out = []
    for name in algorithms:
        for budget in (None, max_patches_per_row):
            two: dict[str, Any] = {} if budget is None else {"weights": pt[:WARM], "max_weight_per_bin": budget}
            t0 = time.perf_counter()
            pack(ln[:WARM], capacity, name, cost_multiple=cost_multiple, seed=seed, **two)  # kernels' first call
            t1 = time.perf_counter()
            two = {} if budget is None else {"weights": pt, "max_weight_per_bin": budget}
            bins = pack(ln, capacity, name, cost_multiple=cost_multiple, seed=seed, **two)
            dt = time.perf_counter() - t1
            out.append(row(str(name), budget, bins.order, bins.offsets, dt, t1 - t0))
    n = len(ln)
    out.append(row("one per row", None, np.arange(n), np.arange(n + 1), None, None))
    return out


def format_media_layouts(rows: Sequence[MediaLayoutRow], capacity: int) -> str:
    """The :func:`compare_media_layouts` table as text, with the packers' compiler load under it."""
    return (
        format_table(
            (
                "layout",
                "patch budget",
                "rows",
                "fill (text+vision)",
                "of which vision",
                "patches/row mean",
                "max",
                "rows over budget",
                "pack time",
            ),
            [
                (
                    r.layout,
                    "-" if r.patch_budget is None else f"{r.patch_budget:,}",
                    f"{r.rows:,}",
                    f"{r.fill:.2%}",
                    f"{r.vision:.2%}",
                    f"{r.patches_mean:,.0f}",
                    f"{r.patches_max:,}",
                    f"{r.over_budget:,}",
                    _ms(r.seconds),
                )
                for r in rows
            ],
        )
        + "\n"
        + load_line(rows)
    )


@dataclass
class MediaBenchReport:
    """What ``sftpack bench --corpus vqa`` found: the samples' sizes and the layouts compared."""

    source: str
    stats: Any  #: the multimodal tokenizer's :class:`~sftpack.multimodal.MediaTokenizeStats`
    lengths: np.ndarray  #: sample lengths, vision placeholders included
    patches: np.ndarray  #: vision patches per sample
    vision_tokens: np.ndarray  #: vision placeholder tokens per sample
    seconds: float  #: tokenizing and image processing
    layouts: list[MediaLayoutRow]


def bench_media(
    conversations: Iterable[Any],
    *,
    source: str,
    max_seq_len: int,
    max_patches_per_row: int | None = None,
    pad_multiple: int = 1,
    overlong: str = "split",
    on_bad_row: str = "error",
    seed: int = 0,
    progress: bool = False,
    family: Any = None,
    tokenizer: Any = None,
    processor: Any = None,
    max_patches: int | None = None,
) -> MediaBenchReport:
    """Tokenize multimodal ``conversations`` for a vision-language ``family`` (a
    :func:`sftpack.multimodal.family_for` spec, e.g. a configured family; default Qwen2-VL) with
    ``tokenizer`` and ``processor`` (a model folder's, loaded once by the caller; ``None``: the
    family's: images to patches, placeholders expanded; over-long ones split at text boundaries)
    and compare the packers' layouts with and without ``max_patches_per_row`` vision patches per row
    (``progress``: a tqdm bar over the conversations, for the CLI; ``max_patches``: the old
    spelling of ``max_patches_per_row``, one release with a ``DeprecationWarning``)."""
    budget_given = renamed("bench_media", "max_patches_per_row", max_patches_per_row, "max_patches", max_patches)
    if budget_given is None:
        raise TypeError("bench_media: give max_patches_per_row (the patch budget of a row)")
    max_patches_per_row = budget_given
    from .._progress import Bar  # start-up: `sftpack bench` loads no tqdm without a bar
    from ..multimodal import (  # start-up: multimodal loads torch; text benches do not
        MediaTokenizeStats,
        family_for,
        tokenize_media_conversations,
    )

    t0 = time.perf_counter()
    stats = MediaTokenizeStats()
    fam = family_for(family)
    samples = tokenize_media_conversations(
        conversations,
        tokenizer=tokenizer if tokenizer is not None else fam.tokenizer(),
        processor=processor if processor is not None else fam.image_processor(),
        family=fam,
        max_seq_len=max_seq_len,
        overlong=overlong,
        on_bad_row=on_bad_row,
        stats=stats,
    )
    sizes = []
    heavy: list[tuple[int, str]] = []  # samples no row can hold under the patch budget
    with Bar(unit="conv", desc="tokenize + images", disable=not progress, delay=1.0, dynamic_ncols=True) as bar:
        for s in samples:
            sizes.append((len(s), s.num_patches, 0 if s.media is None else s.media.num_placeholders))
            bar.update(stats.read - bar.n)
            if s.num_patches > max_patches_per_row:
                heavy.append((s.num_patches, str(s.conversation_id)))
    dt = time.perf_counter() - t0
    if heavy:
        most, first = max(heavy)[0], heavy[0]
        raise ValueError(
            f"{len(heavy):,} sample(s) have more vision patches than the patch budget {max_patches_per_row:,}, so no row "
            f"can hold them (the first: conversation {first[1]}, {first[0]:,} patches): raise the patch budget "
            f"to at least {most:,}, or use smaller images"
        )
    arr = np.asarray(sizes, dtype=np.int64).reshape(-1, 3)
    layouts: list[MediaLayoutRow] = []
    if len(arr):
        layouts = compare_media_layouts(
            arr[:, 0],
            arr[:, 1],
            arr[:, 2],
            max_seq_len,
            max_patches_per_row=max_patches_per_row,
            cost_multiple=pad_multiple,
            seed=seed,
        )
    return MediaBenchReport(source, stats, arr[:, 0], arr[:, 1], arr[:, 2], dt, layouts)
