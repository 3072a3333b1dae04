"""``sftpack inspect DIR``: a prepack's manifest in words, its histograms, and any row drawn."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import numpy as np

from ._common import UsageError, non_negative

if TYPE_CHECKING:  # pragma: no cover
    from ..handoff import PackedBatch
    from ..offline import PrepackedDataset

# The offline path, the handoff and the drawing load torch: they are imported inside the
# functions below, when the command runs, so that `sftpack --help` stays fast.


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a prepack directory: fingerprint, counts, fill, histograms, a row")
    p.add_argument("directory", metavar="DIR", help="a directory written by sftpack prepack")
    p.add_argument("--row", type=non_negative, metavar="I", help="draw row I (segments, padding, cu_seqlens)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="recompute the SHA-256 of the token and mask data too "
        "(the manifest, the sizes, the headers and the index are always checked)",
    )
    p.add_argument("--png", metavar="FILE", help="draw the histograms as a PNG (needs matplotlib)")
    p.set_defaults(func=run)


def _bar(n: int, most: int, width: int = 40) -> str:
    return "#" * max(1 if n else 0, round(width * n / most)) if most else ""


def describe_lines(ds: PrepackedDataset) -> list[str]:
    """The text ``sftpack inspect`` prints (without ``--row``)."""
    from ..offline import describe

    d = describe(ds)
    m = d.manifest
    c, fp = m["counts"], m["fingerprint"]
    tok = (
        fp.get("tokenizer") or {}
    )  # the manifest's entries are checked on opening; the fingerprint's details are free-form
    out = [
        f"prepack {ds.path}  (format {m['format_version']}, sftpack {m['sftpack_version']}, source: {m['source']})",
        (
            f"  rows of {m['max_seq_len']:,} slots, each sequence padded to a multiple of {m['pad_multiple']}, "
            f"pad id {m['pad_id']}, tokens stored as {m['token_dtype']}"
        ),
        (
            f"  fingerprint {fp['sha256'][:16]}: tokenizer {str(tok.get('sha256', '?'))[:16]} "
            f"({tok.get('vocab_size', '?')} ids{', ' + str(tok['name_or_path']) if tok.get('name_or_path') else ''}), "
            f"algorithm {fp.get('algorithm')}, seed {fp.get('seed')}, overlong {fp.get('overlong', '-')}, "
            f"train_on {fp.get('train_on', '-')}"
        ),
    ]
    # input_files: the data files of a prepack with images (its "inputs" is then the conversations read)
    for inp in [*fp.get("input_files", []), *fp.get("inputs", [])]:
        iterable = inp.get("name") == "<iterable>"  # conversations hashed as they streamed: size counts them
        size = (
            f"{inp['size']:,} {'conversations' if iterable else 'bytes'}" if isinstance(inp.get("size"), int) else "?"
        )
        out.append(f"  input {inp.get('name', '?')}  {size}  sha256 {str(inp.get('sha256'))[:16]}")
    dropped = ", ".join(f"{k} {v:,}" for k, v in c["dropped"].items()) or "none dropped"
    out.append(
        f"  conversations: {c['read']:,} read, {c['kept']:,} kept ({dropped}), {c['packed_conversations']:,} packed"
    )
    formats = c.get("formats")  # a prepack of plain messages rows carries none
    if formats:
        out.append("  formats: " + ", ".join(f"{k} {v:,}" for k, v in formats.items()) + " (rows kept)")
    oc = c.get("overlong")
    if oc:
        out.append(
            f"  over-long: {oc['fit']:,} fit, {oc['split']:,} split, {oc['truncated']:,} truncated, "
            f"{oc['dropped']:,} dropped; {c['tokens_lost']:,} tokens lost"
        )
    out.append(f"  {c['sequences']:,} sequences, {c['tokens']:,} tokens, {c['labels']:,} supervised labels")
    out.append(
        f"  {c['rows']:,} rows, fill {c['fill']:.3%}, L1 bound {c['l1']:,} (gap {c['gap_l1']:.3%}), L2 {c['l2']:,}"
    )
    media = m.get("media")
    if media:
        proc = media["processor"]
        budget = fp.get("max_patches_per_row", fp.get("max_patches"))  # max_patches: the first format-3 prepacks
        out.append(
            f"  images for {media.get('family', 'qwen2_vl')}: {media['images']:,} ({media['patches']:,} vision "
            f"patches, {f'at most {budget:,} a row' if budget else 'no patch budget per row'}), stored as resized "
            "uint8 pixels "
            f"({media['pixel_bytes']:,} bytes; patch {proc['patch_size']}, merge {proc['merge_size']}, "
            f"{proc['min_pixels']:,}-{proc['max_pixels']:,} pixels an image), patchified on read"
        )
    out.append("")
    out.append("row fill:")
    most = max((n for _, _, n in d.fill_histogram), default=0)
    for lo, hi, n in d.fill_histogram:
        out.append(f"  {lo:4.0%}-{hi:4.0%}  {n:>9,}  {_bar(n, most)}")
    out.append("sequences per row:")
    hist = d.per_row_histogram
    most = max((n for _, n in hist), default=0)
    shown = hist if len(hist) <= 24 else sorted(sorted(hist, key=lambda t: -t[1])[:24])
    for k, n in shown:
        out.append(f"  {k:>5}  {n:>9,}  {_bar(n, most)}")
    if len(shown) < len(hist):
        out.append(f"  ({len(hist) - len(shown)} rarer counts not shown; max {max(k for k, _ in hist)})")
    return out


def row_layout(ds: PrepackedDataset, i: int) -> dict[str, Any]:
    """Row ``i``'s boundaries and counts from the index and its stored tokens only: what
    :meth:`PrepackedDataset.row` would build, without laying ``max_seq_len`` slots (a row
    is five int64 tensors of that width; drawing one must not cost that)."""
    from ..handoff import padded_lengths

    _, mask, seqs = ds.row_arrays(i)
    real = seqs["length"].astype(np.int64)
    padded = padded_lengths(real, ds.pad_multiple)
    padded[-1] += ds.max_seq_len - int(padded.sum())  # the tail, folded in
    cu = np.concatenate([[0], np.cumsum(real)])
    cup = np.concatenate([[0], np.cumsum(padded)])
    m = np.asarray(mask, dtype=bool)
    # slot t has a label when token t+1 is trainable and in the same sequence: every
    # trainable token but the first of each sequence
    labels = int(m.sum()) - int(m[cu[:-1]].sum())
    return {"real": real, "padded": padded, "cu": cu, "cup": cup, "labels": labels, "sequences": seqs}


def _scaled(real: np.ndarray, padded: np.ndarray, cells: int) -> tuple[PackedBatch, int]:
    """A boundary-only ``PackedBatch`` of the row, shrunk to at most ``cells`` cells
    (one cell = ``k`` slots) for drawing, and ``k``."""
    import torch

    from ..handoff import PackedBatch

    real, padded = np.asarray(real), np.asarray(padded)
    T = int(padded.sum())
    k = max(1, -(-T // cells))
    if k > 1:
        real = np.maximum(1, np.rint(real / k)).astype(np.int64)
        padded = np.maximum(real, np.rint(padded / k)).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(real)]).astype(np.int32)
    cup = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    n = int(cup[-1])
    small = PackedBatch(
        input_ids=torch.zeros(n, dtype=torch.long),
        labels=torch.full((n,), -100, dtype=torch.long),
        position_ids=torch.zeros(n, dtype=torch.long),
        cu_seqlens=torch.from_numpy(cu),
        cu_seqlens_padded=torch.from_numpy(cup),
        max_seqlen=int(padded.max()),
    )
    return small, k


def row_lines(ds: PrepackedDataset, i: int, *, cells: int = 256) -> list[str]:
    """Row ``i`` drawn as ``sftpack map`` draws rows (one cell per slot, or per ``k`` slots
    for rows wider than ``cells``), with its boundaries and conversations. Memory: the row's
    stored tokens and ``cells`` cells, whatever ``max_seq_len``."""
    from ..report.layout import draw_row

    lay = row_layout(ds, i)
    real, padded, cu, cup, seqs = lay["real"], lay["padded"], lay["cu"], lay["cup"], lay["sequences"]
    names = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    small, k = _scaled(real, padded, cells)
    scale = "one cell per slot" if k == 1 else f"one cell per {k} slots"
    out = [
        (
            f"row {i}: {len(real)} sequences, {int(cu[-1]):,} real tokens in {int(cup[-1]):,} slots, "
            f"{lay['labels']:,} labels  (letters: real tokens, '.': padding, '|': segment start; {scale})"
        )
    ]
    out += ["  " + line for line in draw_row(small, width=64).split("\n")]
    out.append(f"  cu_seqlens={[int(x) for x in cu]}")
    out.append(f"  cu_seqlens_padded={[int(x) for x in cup]}  max_seqlen={int(padded.max())}")
    per_seq = _images_per_sequence(ds, i, len(seqs))
    for j, rec in enumerate(seqs):
        cid = ds.conversation_id(int(rec["conversation"]))
        piece = f" piece {int(rec['piece'])}" if int(rec["piece"]) else ""
        extra = ""
        if per_seq is not None and per_seq[j]:
            extra = "; images " + ", ".join(f"{w}x{h} px at slot {s} ({n} placeholders)" for s, n, w, h in per_seq[j])
        out.append(f"  {names[j % len(names)]}: {cid}{piece}, {int(rec['length']):,} tokens{extra}")
    return out


def _images_per_sequence(ds: PrepackedDataset, i: int, n_seq: int) -> list[list[tuple[int, int, int, int]]] | None:
    """For a prepack with images: each sequence's images as ``(start slot in the sequence, placeholders,
    width, height)``, from the index only (no pixel is read)."""
    media = ds.media
    if media is None:
        return None
    first = int(ds.rows[i]["sequence"])
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n_seq)]
    m2 = media.merge_size**2
    for rec in media.images[int(media.row_images[i]) : int(media.row_images[i + 1])]:
        n = int(rec["grid_t"]) * int(rec["grid_h"]) * int(rec["grid_w"]) // m2
        out[int(rec["sequence"]) - first].append((int(rec["start"]), n, int(rec["width"]), int(rec["height"])))
    return out


def run(args: argparse.Namespace) -> int:
    from ..offline import PrepackedDataset, describe
    from ..offline._describe import save_histograms_png

    ds = PrepackedDataset(args.directory, verify="full" if args.verify else "size")
    for line in describe_lines(ds):
        print(line)
    if args.verify:
        print(
            f"\nverified: every file matches its SHA-256 ({len(ds.manifest['files'])} files), and the manifest its own"
        )
    if args.row is not None:
        if args.row >= ds.num_rows:
            raise UsageError(f"--row {args.row} is out of range: the prepack has {ds.num_rows} rows")
        print()
        for line in row_lines(ds, args.row):
            print(line)
    if args.png:
        print(f"\nwrote {save_histograms_png(describe(ds), args.png)}")
    return 0
