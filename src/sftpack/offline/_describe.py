"""What ``sftpack inspect`` shows about a prepack, computed (never printed).

:func:`describe` reads only the manifest and the small index files (``rows.npy``,
``sequences.npy``: 16 + 24 bytes per row and sequence), never the tokens, so
it takes milliseconds on any size: the fingerprint, the counts, the fill and
gap to the L1 bound, and two histograms (row fill in 10 buckets, sequences per
row). :func:`save_histograms_png` draws the histograms (matplotlib).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._optional import pyplot
from ..handoff import padded_lengths
from ._dataset import PrepackedDataset

__all__ = ["Description", "describe", "save_histograms_png"]


@dataclass
class Description:
    """A prepack summarised.

    Attributes:
        manifest: the manifest dict.
        fill: ``(R,)`` float, real tokens / ``max_seq_len`` of every row.
        sequences_per_row: ``(R,)`` int64.
        fill_histogram: ``[(low, high, rows)]`` for 10 buckets of fill.
        per_row_histogram: ``[(sequences, rows)]`` for the distinct counts (largest 40 buckets).
    """

    manifest: dict[str, Any]
    fill: np.ndarray
    sequences_per_row: np.ndarray
    padded_fill: np.ndarray
    fill_histogram: list[tuple[float, float, int]]
    per_row_histogram: list[tuple[int, int]]


def describe(ds: PrepackedDataset) -> Description:
    """Summarise a :class:`~sftpack.offline.PrepackedDataset`."""
    rows, seqs = ds.rows, ds.sequences
    width = ds.max_seq_len
    tokens = np.diff(rows["token"].astype(np.int64))
    per_row = np.diff(rows["sequence"].astype(np.int64))
    fill = tokens / width if width else tokens.astype(float)
    if seqs.shape[0]:
        padded = np.add.reduceat(padded_lengths(seqs["length"], ds.pad_multiple), rows["sequence"][:-1]) / width
    else:
        padded = np.zeros(0)
    edges = np.linspace(0.0, 1.0, 11)
    counts, _ = np.histogram(fill, bins=edges)
    fill_hist = [(float(edges[i]), float(edges[i + 1]), int(counts[i])) for i in range(10)]
    values, nums = np.unique(per_row, return_counts=True)
    per_hist = [(int(v), int(c)) for v, c in zip(values, nums)]
    return Description(ds.manifest, fill, per_row, padded, fill_hist, per_hist)


def save_histograms_png(desc: Description, path: str) -> str:
    """Draw the row-fill and sequences-per-row histograms as a PNG (needs matplotlib)."""
    plt = pyplot("sftpack inspect --png")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.hist(desc.fill * 100, bins=50, range=(0, 100), color="#4C72B0")
    a.set_xlabel("row fill (% of slots holding real tokens)")
    a.set_ylabel("rows")
    a.set_yscale("log")
    vals = [v for v, _ in desc.per_row_histogram]
    cnts = [c for _, c in desc.per_row_histogram]
    b.bar(vals, cnts, color="#DD8452", width=0.9)
    b.set_xlabel("sequences per row")
    b.set_ylabel("rows")
    b.set_yscale("log")
    c = desc.manifest["counts"]
    fig.suptitle(
        f"{c['rows']:,} rows of {desc.manifest['max_seq_len']:,} slots, fill {c['fill']:.2%}, "
        f"{c['sequences']:,} sequences",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
