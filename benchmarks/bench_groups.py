"""The fill cost of keeping groups whole: rows with ``groups=`` against the same lengths without.

A DPO pair (groups of 2) or a prompt's GRPO completions (groups of 4 or 8) must share a
row (issue 42). :func:`sftpack.binpack.pack` packs each group as one unit of its members'
summed length, so the units are coarser than the sequences and the rows may fill less.
This measures how much less: chat-like lengths (``round(lognormal(ln 900, 1))``, as in
``bench_balance.py``) taken ``k`` at a time into groups, a group longer than the row
dropped whole (as ``--overlong drop`` would; its share is reported), then the kept
sequences packed by BFD into rows of 4,096 and 16,384 tokens with and without the
groups. Columns: rows and fill (tokens / row slots) each way, the extra rows whole
groups cost, and the Martello-Toth lower bound L2 of the sequences (no packing needs
fewer rows) and of the groups as units (no packing that keeps groups whole needs fewer:
what separates it from the first is the price of the constraint, not of the packer).

A second table does the same for the loader path's streaming packer
(:class:`sftpack.loader.PackingDataset`, ``groups=True``: a pair read, shuffled and packed as
one unit), which sees only its buffer: DPO pairs (groups of 2) of the same lengths, rows
decided by ``decided_rows()`` at two buffer sizes, against the same sequences as independent
conversations; the bound is ``ceil(tokens / width)``.

    python benchmarks/bench_groups.py            # 200,000 sequences per case
    python benchmarks/bench_groups.py --n 20000 --no-results
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section
from sftpack import Sample
from sftpack.binpack import Groups, lower_bounds, pack, packing_stats
from sftpack.loader import PackingDataset

CHAT_MEDIAN, CHAT_SIGMA = 900, 1.0
WIDTHS = (4096, 16_384)
GROUP_SIZES = (2, 4, 8)

COLUMNS = [
    ("width", "row width", "{:,}"),
    ("k", "group size", "{}"),
    ("sequences", "sequences kept", "{:,}"),
    ("dropped", "groups dropped (over the row)", "{:.2%}"),
    ("l2", "L2 bound", "{:,}"),
    ("rows_free", "rows, no groups", "{:,}"),
    ("fill_free", "fill, no groups", "{:.4f}"),
    ("l2_units", "L2 bound, groups as units", "{:,}"),
    ("rows_whole", "rows, groups whole", "{:,}"),
    ("fill_whole", "fill, groups whole", "{:.4f}"),
    ("extra", "extra rows", "{:+.2%}"),
    ("seconds", "pack s (grouped)", "{:.2f}"),
]


def grouped_lengths(rng: np.random.Generator, n: int, k: int, width: int) -> tuple[np.ndarray, np.ndarray, float]:
    """``(lengths, groups, dropped)``: ``n`` chat lengths, ``k`` consecutive ones a group, the
    groups longer than ``width`` dropped whole (``dropped``: their share of the groups)."""
    lengths = np.clip(np.rint(rng.lognormal(np.log(CHAT_MEDIAN), CHAT_SIGMA, n - n % k)), 1, width).astype(np.int64)
    per_group = lengths.reshape(-1, k)
    keep = per_group.sum(axis=1) <= width
    groups = np.repeat(np.flatnonzero(keep), k)
    return per_group[keep].reshape(-1), groups, float(1 - keep.mean())


def case(n: int, k: int, width: int, seed: int) -> dict:
    lengths, groups, dropped = grouped_lengths(np.random.default_rng(seed), n, k, width)
    free = pack(lengths, width)
    t = time.perf_counter()
    whole = pack(lengths, width, groups=groups)
    seconds = time.perf_counter() - t
    row = whole.bin_index()
    assert all(np.unique(row[groups == g]).size == 1 for g in np.unique(groups)[:1000])  # spot check: whole
    s_free, s_whole = packing_stats(lengths, free, width), packing_stats(lengths, whole, width)
    return {
        "width": width,
        "k": k,
        "sequences": int(lengths.shape[0]),
        "dropped": dropped,
        "l2": lower_bounds(lengths, width).l2,
        "rows_free": s_free.rows,
        "fill_free": s_free.efficiency,
        "l2_units": lower_bounds(Groups.of(groups).sum(lengths), width).l2,
        "rows_whole": s_whole.rows,
        "fill_whole": s_whole.efficiency,
        "extra": s_whole.rows / s_free.rows - 1,
        "seconds": seconds,
    }


LOADER_WIDTHS = (4096, 16_384)
LOADER_BUFFERS = (64, 256)
LOADER_COLUMNS = [
    ("width", "row width", "{:,}"),
    ("buffer", "buffer", "{:,}"),
    ("pairs", "pairs", "{:,}"),
    ("bound", "rows at 100% fill", "{:,}"),
    ("rows_free", "rows, no groups", "{:,}"),
    ("rows_whole", "rows, pairs whole", "{:,}"),
    ("fill_whole", "fill, pairs whole", "{:.4f}"),
    ("extra", "extra rows", "{:+.2%}"),
]


def loader_rows(samples: list[Sample], width: int, buffer: int, *, groups: bool) -> int:
    ds = PackingDataset(samples, max_seq_len=width, buffer_size=buffer, shuffle=True, seed=0, groups=groups)
    return sum(1 for _ in ds.decided_rows())


def loader_case(n: int, width: int, buffer: int, seed: int) -> dict:
    """Pairs (groups of 2) of chat lengths, those over the row dropped whole, through the loader's
    streaming packer with ``groups=True`` and, as plain conversations, without."""
    lengths, groups, _ = grouped_lengths(np.random.default_rng(seed), n, 2, width)
    ids = [np.zeros(int(n_), dtype=np.int64) for n_ in lengths]
    mask = [np.ones(int(n_), dtype=bool) for n_ in lengths]
    roles = ("chosen", "rejected")
    pairs = [
        Sample(ids[i], mask[i], f"p{g}", {"group": f"p{g}", "role": roles[i % 2], "group_size": 2})
        for i, g in enumerate(groups.tolist())
    ]
    plain = [Sample(ids[i], mask[i], f"c{i}") for i in range(len(ids))]
    free, whole = loader_rows(plain, width, buffer, groups=False), loader_rows(pairs, width, buffer, groups=True)
    return {
        "width": width,
        "buffer": buffer,
        "pairs": len(pairs) // 2,
        "bound": -(-int(lengths.sum()) // width),
        "rows_free": free,
        "rows_whole": whole,
        "fill_whole": float(lengths.sum()) / (whole * width),
        "extra": whole / free - 1,
    }


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores (one used), {platform.system()} {platform.machine()}; "
        f"load average {load_average():.1f} at start; python {platform.python_version()}, numpy {np.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200_000, help="sequences drawn per case (default 200,000)")
    parser.add_argument("--loader-n", type=int, default=20_000, help="sequences per loader case (default 20,000)")
    parser.add_argument("--seed", type=int, default=0)
    add_flag(parser)
    args = parser.parse_args(argv)
    where = machine()
    print(f"machine: {where}")
    pack([3, 5, 1, 3], 8, groups=[0, 0, 1, 1])  # compile or load the numba cache before timing
    rows = []
    for i, width in enumerate(WIDTHS):
        for j, k in enumerate(GROUP_SIZES):
            rows.append(case(args.n, k, width, seed=args.seed + 10 * i + j))
            r = rows[-1]
            print(
                f"  width {width:>6,} groups of {k}: {r['rows_free']:,} -> {r['rows_whole']:,} rows "
                f"({r['extra']:+.2%}), fill {r['fill_free']:.4f} -> {r['fill_whole']:.4f}",
                file=sys.stderr,
                flush=True,
            )
    loader = [
        loader_case(args.loader_n, width, buffer, seed=args.seed + 100 + i)
        for i, width in enumerate(LOADER_WIDTHS)
        for buffer in LOADER_BUFFERS
    ]
    body = formatted_table(rows, COLUMNS)
    body += (
        f"\n\nThe loader path's streaming packer ({args.loader_n:,} sequences per case as pairs, shuffled, seed "
        f"{args.seed}):\n\n" + formatted_table(loader, LOADER_COLUMNS)
    )
    print()
    print(body)
    if not args.no_results:
        title = (
            f"Issue 42, groups never split: BFD rows of the same chat lengths (lognormal(ln {CHAT_MEDIAN}, "
            f"{CHAT_SIGMA}), {args.n:,} drawn per case, seed {args.seed}) with `pack(..., groups=)` (k consecutive "
            "sequences a group: a DPO pair, a prompt's GRPO completions; a group over the row dropped whole) and "
            "without. fill = tokens / (rows x width)."
        )
        write_section(__file__, body, where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
