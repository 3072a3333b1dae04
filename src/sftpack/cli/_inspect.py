"""``sftpack inspect DIR``: a prepack's manifest in words, its histograms, and any row drawn."""

from __future__ import annotations

import argparse

from ._common import non_negative


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a prepack directory: fingerprint, counts, fill, histograms, a row")
    p.add_argument("directory", metavar="DIR", help="a directory written by sftpack prepack")
    p.add_argument("--row", type=non_negative, metavar="I", help="draw row I (segments, padding, cu_seqlens)")
    p.add_argument("--verify", action="store_true", help="recompute every file's SHA-256")
    p.add_argument("--png", metavar="FILE", help="draw the histograms as a PNG (needs matplotlib)")
    p.set_defaults(func=run)


def _bar(n: int, most: int, width: int = 40) -> str:
    return "#" * max(1 if n else 0, round(width * n / most)) if most else ""


def describe_lines(ds: object) -> list[str]:
    """The text ``sftpack inspect`` prints (without ``--row``)."""
    from ..offline._describe import describe

    d = describe(ds)
    m = d.manifest
    c, fp = m["counts"], m["fingerprint"]
    tok = fp.get("tokenizer") or {}
    out = [
        f"prepack {ds.path}  (format {m['format_version']}, sftpack {m['sftpack_version']}, source: {m['source']})",  # type: ignore[attr-defined]
        (
            f"  rows of {m['max_seq_len']:,} slots, each sequence padded to a multiple of {m['pad_multiple']}, "
            f"pad id {m['pad_id']}, tokens stored as {m['token_dtype']}"
        ),
        (
            f"  fingerprint {fp['sha256'][:16]}: tokenizer {tok.get('sha256', '?')[:16]} "
            f"({tok.get('vocab_size', '?')} ids{', ' + tok['name_or_path'] if tok.get('name_or_path') else ''}), "
            f"algorithm {fp.get('algorithm')}, seed {fp.get('seed')}, overlong {fp.get('overlong', '-')}, "
            f"train_on {fp.get('train_on', '-')}"
        ),
    ]
    for inp in fp.get("inputs", []):
        size = f"{inp['size']:,} bytes" if isinstance(inp.get("size"), int) else "?"
        out.append(f"  input {inp['name']}  {size}  sha256 {str(inp.get('sha256'))[:16]}")
    dropped = ", ".join(f"{k} {v:,}" for k, v in c["dropped"].items()) or "none dropped"
    out.append(f"  conversations: {c['read']:,} read, {c['kept']:,} kept ({dropped}), "
               f"{c['packed_conversations']:,} packed")
    oc = c.get("overlong")
    if oc:
        out.append(f"  over-long: {oc['fit']:,} fit, {oc['split']:,} split, {oc['truncated']:,} truncated, "
                   f"{oc['dropped']:,} dropped; {c['tokens_lost']:,} tokens lost")
    out.append(f"  {c['sequences']:,} sequences, {c['tokens']:,} tokens, {c['labels']:,} supervised labels")
    out.append(f"  {c['rows']:,} rows, fill {c['fill']:.3%}, L1 bound {c['l1']:,} (gap {c['gap_l1']:.3%}), "
               f"L2 {c['l2']:,}")
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


def _scaled(b: object, cells: int) -> tuple[object, int]:
    """``b`` shrunk to at most ``cells`` cells (one cell = ``k`` slots) for drawing, and ``k``."""
    import numpy as np
    import torch

    from ..handoff import PackedBatch

    T = b.num_tokens  # type: ignore[attr-defined]
    k = -(-T // cells)
    if k <= 1:
        return b, 1
    real = np.maximum(1, np.rint(b.seqlens.numpy() / k)).astype(np.int64)  # type: ignore[attr-defined]
    padded = np.maximum(real, np.rint(b.padded_seqlens.numpy() / k)).astype(np.int64)  # type: ignore[attr-defined]
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


def row_lines(ds: object, i: int, *, cells: int = 256) -> list[str]:
    """Row ``i`` drawn as ``sftpack map`` draws rows (one cell per slot, or per ``k`` slots
    for rows wider than ``cells``), with its boundaries and conversations."""
    from ..report.layout import draw_row

    b = ds.row(i)  # type: ignore[attr-defined]
    names = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    small, k = _scaled(b, cells)
    scale = "one cell per slot" if k == 1 else f"one cell per {k} slots"
    out = [
        (
            f"row {i}: {b.num_sequences} sequences, {b.num_real_tokens:,} real tokens in {b.num_tokens:,} slots, "
            f"{b.num_label_tokens:,} labels  (letters: real tokens, '.': padding, '|': segment start; {scale})"
        )
    ]
    out += ["  " + line for line in draw_row(small, width=64).split("\n")]
    out.append(f"  cu_seqlens={b.cu_seqlens.tolist()}")
    out.append(f"  cu_seqlens_padded={b.cu_seqlens_padded.tolist()}  max_seqlen={b.max_seqlen}")
    recs = ds.row_sequences(i)  # type: ignore[attr-defined]
    for j, (cid, rec) in enumerate(zip(b.sequence_ids or (), recs)):
        piece = f" piece {int(rec['piece'])}" if int(rec["piece"]) else ""
        out.append(f"  {names[j % len(names)]}: {cid}{piece}, {int(rec['length']):,} tokens")
    return out


def run(args: argparse.Namespace) -> int:
    from ..offline import PrepackedDataset
    from ..offline._describe import describe, save_histograms_png

    ds = PrepackedDataset(args.directory, verify="full" if args.verify else "size")
    for line in describe_lines(ds):
        print(line)
    if args.verify:
        print(f"\nverified: every file matches its SHA-256 ({len(ds.manifest['files'])} files)")
    if args.row is not None:
        if args.row >= ds.num_rows:
            from ._common import UsageError

            raise UsageError(f"--row {args.row} is out of range: the prepack has {ds.num_rows} rows")
        print()
        for line in row_lines(ds, args.row):
            print(line)
    if args.png:
        print(f"\nwrote {save_histograms_png(describe(ds), args.png)}")
    return 0
