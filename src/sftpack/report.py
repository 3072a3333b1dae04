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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .binpack import Algorithm, lower_bounds, pack, packing_stats

__all__ = ["LayoutRow", "compare_layouts", "print_table"]


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


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> None:
    """A plain aligned text table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print(indent + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print(indent + "  ".join("-" * w for w in widths))


def print_layouts(rows: Sequence[LayoutRow], bounds: tuple[int, int]) -> None:
    print_table(
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
    print(f"  lower bounds on rows: L1={bounds[0]:,}, L2={bounds[1]:,}")


def _load_tokenizer(path: str | None):  # type: ignore[no-untyped-def]
    from .data import default_tokenizer

    if path is None:
        return default_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"sftpack bench: cannot load a tokenizer from {path!r} ({e}); give a local folder written by "
            "tokenizer.save_pretrained(), or leave --tokenizer out for the embedded Qwen tokenizer"
        ) from None


def run_bench(args) -> int:  # type: ignore[no-untyped-def]
    """``sftpack bench``: read, tokenize and pack conversations; print what packing saves."""
    from itertools import islice

    from .chat import BadRowError, read_conversations, tokenize_conversations
    from .data import default_corpus

    t0 = time.perf_counter()
    tok = _load_tokenizer(args.tokenizer)
    if args.paths:
        try:
            reader = read_conversations(args.paths, on_bad_row=args.on_bad_row)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"sftpack bench: {e}") from None
        source = f"{', '.join(args.paths)}"
    else:
        reader = None
        source = "the embedded chitchat corpus"
    conversations = reader if reader is not None else default_corpus()
    if args.limit:
        conversations = islice(conversations, args.limit)
    tokenized = tokenize_conversations(
        conversations, tok, max_seq_len=args.max_seq_len, overlong=args.overlong, num_proc=args.num_proc
    )
    try:
        lengths = np.fromiter((len(s) for s in tokenized), dtype=np.int64)
    except BadRowError as e:
        raise SystemExit(f"sftpack bench: {e}") from None
    st = tokenized.stats
    dt = time.perf_counter() - t0
    print(f"source: {source}")
    if reader is not None:
        rs = reader.stats
        dropped = ", ".join(f"{k} {v:,}" for k, v in rs.dropped.items()) or "none"
        print(f"  read {rs.read:,} rows: {rs.kept:,} kept, dropped: {dropped}")
    print(
        f"  {st.conversations:,} conversations -> {len(lengths):,} samples ({st.fit:,} fit, {st.split:,} split, "
        f"{st.truncated:,} truncated, {st.dropped:,} dropped; {st.tokens_lost:,} tokens lost) in {dt:.1f} s"
    )
    if not len(lengths):
        print("  nothing to pack")
        return 1
    print(
        f"  {int(lengths.sum()):,} tokens; lengths median {int(np.median(lengths))}, "
        f"p90 {int(np.percentile(lengths, 90))}, max {int(lengths.max())}"
    )
    print(f"\nrows of {args.max_seq_len} tokens, each sequence padded to a multiple of {args.pad_multiple}:")
    rows, bounds = compare_layouts(lengths, args.max_seq_len, cost_multiple=args.pad_multiple, seed=args.seed)
    print_layouts(rows, bounds)
    return 0
