"""Pictures of a packed run: the worked example of the contract, as text or PNG.

``sftpack map`` prints, for each packing moment, how two conversations A (5
tokens) and B (10 tokens) lie in the row and which boundaries the kernel gets::

    offline  max_seq_len=16, no per-sequence pad        width 16
      A A A A A B B B B B B B B B B .
      cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 5, 16]  kernel gets: real + padded
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._optional import pyplot
from ..handoff import PackedBatch
from ..loader import worked_example_row
from ..sample import Sample
from ..trainer import pack_step

__all__ = [
    "MapRow",
    "draw_row",
    "draw_row_to_scale",
    "render_map",
    "demo_figure",
    "save_demo_png",
    "save_map_png",
    "worked_example",
]


@dataclass
class MapRow:
    path: str
    settings: str
    batch: PackedBatch
    kernel_gets: str


def _worked_samples() -> list[Sample]:
    a = Sample(np.arange(1, 6), np.ones(5, dtype=bool), "A")
    b = Sample(np.arange(101, 111), np.ones(10, dtype=bool), "B")
    return [a, b]


def worked_example() -> list[MapRow]:
    """The three rows of ``docs/contract.md`` section 2 (the worked example), each built by the library."""
    a, b = _worked_samples()
    offline = PackedBatch.from_samples([a, b], max_seq_len=16)
    loader = worked_example_row()
    ids = torch.zeros(2, 10, dtype=torch.long)
    ids[0, :5] = torch.from_numpy(a.input_ids)
    ids[1, :10] = torch.from_numpy(b.input_ids)
    trainer = pack_step(ids, torch.tensor([5, 10]), pad_multiple=4)
    return [
        MapRow("offline", "max_seq_len=16, no per-sequence pad", offline, "real + padded"),
        MapRow("loader", "max_seq_len=36, pad each sequence to a multiple of 4", loader, "padded for both"),
        MapRow("trainer", "batch [2, 10] right-padded, pad each sequence to a multiple of 4", trainer, "real + padded"),
    ]


def _segment_letters(batch: PackedBatch) -> list[str]:
    """One character per slot: the segment's letter on real tokens, '.' on padding."""
    real = batch.real_token_mask.tolist()
    seg = np.repeat(np.arange(batch.num_sequences), batch.padded_seqlens.tolist())
    names = string.ascii_uppercase + string.ascii_lowercase
    return [names[s % len(names)] if r else "." for s, r in zip(seg.tolist(), real)]


def draw_row(batch: PackedBatch, width: int = 64) -> str:
    """Text drawing of a packed run, ``width`` slots a line, ``|`` between segments."""
    cells = _segment_letters(batch)
    starts = set(batch.cu_seqlens_padded[1:-1].tolist())
    lines: list[str] = []
    line: list[str] = []
    for t, c in enumerate(cells):
        if t and t % width == 0:
            lines.append(" ".join(line))
            line = []
        line.append(("|" if t in starts else "") + c)
    lines.append(" ".join(line))
    return "\n".join(lines)


def _slot_cells(batch: PackedBatch) -> list[str]:
    """One character per slot: the segment's letter on text, '#' on image placeholders, '.' on padding."""
    cells = _segment_letters(batch)
    if batch.media is not None:
        for start, n in batch.media.slots.tolist():
            cells[start : start + n] = ["#"] * n
    return cells


def draw_row_to_scale(batch: PackedBatch, width: int = 64) -> str:
    """A row in one line of ``width`` characters or fewer, to scale: each character stands
    for ``ceil(T / width)`` slots and shows what most of them hold (a segment's letter on
    its text, ``#`` on image placeholders, ``.`` on padding; ties: the first slot's).

    >>> from sftpack.testing import samples_from_lengths
    >>> draw_row_to_scale(PackedBatch.from_samples(samples_from_lengths([6, 3]), pad_multiple=4), width=6)  # AAAAAA..BBB.
    'AAA.BB'
    """
    cells = _slot_cells(batch)
    scale = max(1, -(-len(cells) // width))
    out = []
    for c in range(0, len(cells), scale):
        chunk = cells[c : c + scale]
        out.append(max(chunk, key=lambda ch: (chunk.count(ch), -chunk.index(ch))))
    return "".join(out)


def render_map(rows: list[MapRow] | None = None) -> str:
    rows = rows if rows is not None else worked_example()
    out = ["Two conversations, A (5 tokens) and B (10 tokens), packed at three moments:", ""]
    for r in rows:
        b = r.batch
        out.append(f"{r.path:8} {r.settings}  -> row width {b.num_tokens}")
        out.append("  " + draw_row(b).replace("\n", "\n  "))
        out.append(
            f"  cu_seqlens={b.cu_seqlens.tolist()}  cu_seqlens_padded={b.cu_seqlens_padded.tolist()}  "
            f"max_seqlen={b.max_seqlen}  kernel gets: {r.kernel_gets}"
        )
        out.append("")
    out.append("Letters are real tokens, '.' is padding, '|' starts a segment.")
    return "\n".join(out)


def save_map_png(path: str, rows: list[MapRow] | None = None) -> str:
    """Draw the map as a PNG (needs matplotlib: ``pip install 'sftpack[plot]'``)."""
    plt = pyplot("sftpack map --png")
    Rectangle = plt.Rectangle
    rows = rows if rows is not None else worked_example()
    width = max(r.batch.num_tokens for r in rows)
    fig, ax = plt.subplots(figsize=(max(8, width * 0.32), 1.3 * len(rows) + 0.8))
    colours = {"A": "#4C72B0", "B": "#DD8452"}
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        cells = _segment_letters(r.batch)
        for t, c in enumerate(cells):
            face = colours.get(c, "#55A868") if c != "." else "#E6E6E6"
            ax.add_patch(Rectangle((t, y + 0.15), 0.95, 0.6, facecolor=face, edgecolor="white"))
            ax.text(t + 0.47, y + 0.45, c if c != "." else "", ha="center", va="center", fontsize=7, color="white")
        for s in r.batch.cu_seqlens_padded.tolist():
            ax.plot([s - 0.025, s - 0.025], [y + 0.05, y + 0.85], color="black", lw=1.5)
        ax.text(-0.5, y + 0.45, f"{r.path}\n{r.kernel_gets}", ha="right", va="center", fontsize=8)
        ax.text(
            0,
            y + 0.9,
            f"cu_seqlens={r.batch.cu_seqlens.tolist()}  cu_seqlens_padded={r.batch.cu_seqlens_padded.tolist()}",
            fontsize=7,
        )
    ax.set_xlim(-6, width + 0.5)
    ax.set_ylim(0, len(rows) + 0.2)
    ax.axis("off")
    ax.set_title("sftpack: A (5 tokens) and B (10 tokens) at three packing moments", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


#: the loss curves: the trainer path's equals the padded run's (the same conversations), so it is
#: drawn over it dashed with open markers, both visible
_LOSS_STYLES: dict[str, dict[str, Any]] = {
    "offline": {"marker": "s", "linestyle": "-"},
    "loader": {"marker": "^", "linestyle": "-"},
    "trainer": {"marker": "o", "linestyle": "--", "markerfacecolor": "none", "markersize": 11, "zorder": 3},
    "none": {"marker": ".", "linestyle": "-", "linewidth": 3, "alpha": 0.6},
}


def _width_note(path: str, rows: Sequence[PackedBatch]) -> str:
    """Why a path's rows are as wide as they are (written beside them in the demo's PNG)."""
    widest = max(r.num_tokens for r in rows)
    if path == "trainer":
        return f"trainer rows: as wide as each batch\nneeds (up to {widest:,} slots here)"
    if path == "none":
        return "padded: each conversation as\nwide as its batch's longest"
    return f"{path} rows: {widest:,} slots\n(max_seq_len)"


def save_demo_png(
    directory: str | Path,
    summary: Mapping[str, Any],
    media_rows: Sequence[PackedBatch] = (),
    media_bars: Mapping[str, Mapping[str, float]] | None = None,
) -> Path:
    """The demo's PNG report, ``directory/sftpack_demo.png``: rows to scale, fill per
    path, loss curves, tokens/s bars (``summary``: path name -> the demo's ``PathSummary``;
    ``media_rows``: rows with images, drawn under the others with their image runs
    hatched; ``media_bars``: ``{"fill": {label: fraction}, "tokens_per_s": {label: value}}``,
    bars added (in green) to the fill and throughput panels)."""
    plt = pyplot("sftpack demo --report")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    fig = demo_figure(summary, media_rows, media_bars)
    path = out / "sftpack_demo.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def demo_figure(
    summary: Mapping[str, Any],
    media_rows: Sequence[PackedBatch] = (),
    media_bars: Mapping[str, Mapping[str, float]] | None = None,
) -> Any:
    """The matplotlib figure :func:`save_demo_png` writes (the same arguments)."""
    plt = pyplot("sftpack demo --report")
    Rectangle = plt.Rectangle
    fig = plt.figure(figsize=(13, 8.5), layout="constrained")  # every title and label inside the figure
    grid = fig.add_gridspec(2, 3)
    ax_rows = fig.add_subplot(grid[0, :])
    colours = plt.get_cmap("tab10").colors
    y = 0.0
    width = max((r.num_tokens for p in summary.values() for r in p.first_rows), default=1)
    labels = []
    notes: list[tuple[float, str]] = []
    for p in summary.values():
        for r in p.first_rows:
            starts = r.cu_seqlens_padded.tolist()
            real = r.seqlens.tolist()
            for i, (s, n) in enumerate(zip(starts[:-1], real)):
                ax_rows.add_patch(
                    Rectangle(
                        (s, y),
                        n,
                        0.8,
                        facecolor=colours[i % len(colours)],
                        edgecolor="white",
                    )
                )
                ax_rows.add_patch(Rectangle((s + n, y), starts[i + 1] - s - n, 0.8, facecolor="#E6E6E6"))
            labels.append((y + 0.4, p.path))
            y += 1
        if p.first_rows:
            notes.append((y - 0.6 * len(p.first_rows), _width_note(p.path, p.first_rows)))
        y += 0.5
    for r in media_rows:
        width = max(width, r.num_tokens)
        starts = r.cu_seqlens_padded.tolist()
        for i, (s, n) in enumerate(zip(starts[:-1], r.seqlens.tolist())):
            ax_rows.add_patch(Rectangle((s, y), n, 0.8, facecolor=colours[i % len(colours)], edgecolor="white"))
            ax_rows.add_patch(Rectangle((s + n, y), starts[i + 1] - s - n, 0.8, facecolor="#E6E6E6"))
        for start, n in r.media.slots.tolist() if r.media is not None else []:
            ax_rows.add_patch(Rectangle((start, y), n, 0.8, facecolor="none", edgecolor="black", hatch="////", lw=0))
        labels.append((y + 0.4, "vqa (images hatched)"))
        y += 1
    if media_rows:
        wide = max(r.num_tokens for r in media_rows)
        notes.append((y - 0.6 * len(media_rows), f"vqa rows: {wide:,} slots\nand a vision-patch budget"))
    for at, note in notes:  # one column right of the widest row: why each path's rows are that wide
        ax_rows.text(width * 1.02, at, note, va="center", fontsize=8)
    ax_rows.set_xlim(0, width * 1.4)
    ax_rows.set_ylim(y, -0.2)
    ax_rows.set_yticks([a for a, _ in labels], [b for _, b in labels])
    ax_rows.set_xlabel("token slots (colour: a conversation; grey: padding)")
    ax_rows.set_title("first rows of each path, to scale", fontsize=10)
    names = list(summary)
    extra = media_bars or {}
    mm_fill, mm_speed = dict(extra.get("fill", {})), dict(extra.get("tokens_per_s", {}))
    ax_fill = fig.add_subplot(grid[1, 0])
    ax_fill.bar(names, [summary[n].fill * 100 for n in names], color="#4C72B0")
    if mm_fill:
        ax_fill.bar(list(mm_fill), [v * 100 for v in mm_fill.values()], color="#55A868")
        ax_fill.tick_params(axis="x", labelrotation=30)
    ax_fill.set(ylabel="real tokens / slots (%)", ylim=(0, 105))
    ax_fill.set_title("fill", fontsize=10)
    ax_loss = fig.add_subplot(grid[1, 1])
    for n in names:
        if summary[n].losses:
            style = _LOSS_STYLES.get(n, {"marker": "o", "linestyle": "-"})
            ax_loss.plot(range(1, len(summary[n].losses) + 1), summary[n].losses, label=n, **style)
    ax_loss.set(xlabel="step", ylabel="loss")
    ax_loss.set_title("training loss\n(trainer: the padded run's conversations, drawn over it)", fontsize=10)
    ax_loss.xaxis.get_major_locator().set_params(integer=True)
    if any(summary[n].losses for n in names):
        ax_loss.legend()
    else:
        ax_loss.text(0.5, 0.5, "(the text story did not run)", ha="center", va="center", transform=ax_loss.transAxes)
    ax_speed = fig.add_subplot(grid[1, 2])
    ax_speed.bar(names, [summary[n].tokens_per_s for n in names], color="#DD8452")
    if mm_speed:
        ax_speed.bar(list(mm_speed), list(mm_speed.values()), color="#55A868")
        ax_speed.tick_params(axis="x", labelrotation=30)
    ax_speed.set(ylabel="real tokens / s")
    ax_speed.set_title("training throughput" + ("\n(green: tiny Qwen2-VL)" if mm_speed else ""), fontsize=10)
    fig.suptitle("sftpack demo: the three packing paths and padded batches on the embedded corpus")
    return fig
