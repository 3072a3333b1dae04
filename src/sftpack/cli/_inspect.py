"""``sftpack inspect DIR``: a prepack's manifest in words, its histograms, any row drawn, and
a row's text decoded with its trained tokens marked (``--decode``: how a template is checked).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..loop.inputs import load_tokenizer, tokenizer_folder
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
        "--decode",
        action="store_true",
        help="print the text of each sequence of row I (--row; default 0) decoded with the prepack's tokenizer, "
        "the trained tokens (loss_mask True: the ones the loss learns) marked: wrapped in [[ ]], or green when "
        "stdout is a terminal (unless NO_COLOR is set); each real control token (an id of the tokenizer's special "
        "or added vocabulary) between \u27e6 \u27e7, so text that only reads like one (<|im_end|> typed in a "
        "message, kept as text) shows bare; a run of one (an image's placeholders) as '\u27e6<|image_pad|>\u27e7 x 64'",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="for --decode: the tokenizer folder the prepack was made with (default: the folder the prepack "
        "records, else the embedded one; refused when its fingerprint differs from the prepack's)",
    )
    p.add_argument("--model", metavar="DIR", help="for --decode: a model folder whose tokenizer to use")
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
    from ..offline import describe  # start-up: the offline path loads torch

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
    formats = c.get("formats")  # none in a prepack of an iterable of conversations (or of messages rows before 0.1)
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
        how = (
            f"patch {proc['patch_size']}, merge {proc['merge_size']}, {proc['min_pixels']:,}-{proc['max_pixels']:,} "
            "pixels an image), patchified on read"
            if "patch_size" in proc
            else f"{proc['class']}'s values remade on read from the manifest's table)"
        )
        out.append(
            f"  media for {media['family']}: {media['images']:,} items ({media['patches']:,} vision "
            f"patches, {f'at most {budget:,} a row' if budget else 'no patch budget per row'}), stored as resized "
            f"uint8 pixels ({media['pixel_bytes']:,} bytes; {how}"
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
    from ..handoff import padded_lengths  # start-up: the handoff loads torch

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
    import torch  # start-up: not for `sftpack --help`

    from ..handoff import PackedBatch  # start-up: the handoff loads torch

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
    from ..report.layout import draw_row  # start-up: the drawing loads torch

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
    out.append(
        f"  cu_seqlens_padded={[int(x) for x in cup]}  max_seqlen={int(padded.max())} (the longest padded segment, "
        f"the row's tail padding included: the kernel's bound; the longest sequence has {int(real.max()):,} tokens)"
    )
    per_seq = _images_per_sequence(ds, i, len(seqs))
    for j, rec in enumerate(seqs):
        cid = ds.conversation_id(int(rec["conversation"]))
        piece = f" piece {int(rec['piece'])}" if int(rec["piece"]) else ""
        extra = ""
        if per_seq is not None and per_seq[j]:
            extra = "; media " + ", ".join(per_seq[j])
        out.append(f"  {names[j % len(names)]}: {cid}{piece}, {int(rec['length']):,} tokens{extra}")
    return out


def _images_per_sequence(ds: PrepackedDataset, i: int, n_seq: int) -> list[list[str]] | None:
    """For a prepack with media: each sequence's items, described from the index only (no pixel
    is read): ``image WxH px at slot S (N placeholders)``, a video's with its frames and seconds
    per temporal slice."""
    media = ds.media
    if media is None:
        return None
    first = int(ds.rows[i]["sequence"])
    out: list[list[str]] = [[] for _ in range(n_seq)]
    m2 = media.merge_size**2
    for rec in media.images[int(media.row_images[i]) : int(media.row_images[i + 1])]:
        n = int(rec["grid_t"]) * int(rec["grid_h"]) * int(rec["grid_w"]) // m2
        size = f"{int(rec['width'])}x{int(rec['height'])} px"
        what = f"video {int(rec['frames'])} frames of {size}" if rec["video"] else f"image {size}"
        extra = f", {float(rec['seconds']):.3g} s a slice" if rec["video"] else ""
        out[int(rec["sequence"]) - first].append(f"{what} at slot {int(rec['start'])} ({n} placeholders{extra})")
    return out


#: the marks around trained text: plain (a file, a pipe) and on a terminal (green)
BRACKETS = ("[[", "]]")
COLOUR = ("\x1b[32m", "\x1b[0m")
#: the marks around a real control token (one id of the tokenizer's special or added vocabulary), so that
#: it cannot be mistaken for content that merely reads like one (``<|im_end|>`` typed in a message, which
#: the tokenizer keeps as text: its pieces are shown bare)
CONTROL = ("\u27e6", "\u27e7")


def _pieces(ids: np.ndarray, mask: np.ndarray, control: frozenset[int]) -> list[tuple[int, int, bool, bool]]:
    """``(start, end, trained, control)`` spans of one sequence: a run of one ``control`` id (with
    one mask value) is a span of its own; a span of text ends where the mask changes or a control
    token starts."""
    out: list[tuple[int, int, bool, bool]] = []
    n, i = len(ids), 0
    while i < n:
        j, is_control = i + 1, int(ids[i]) in control
        while j < n and mask[j] == mask[i] and (ids[j] == ids[i] if is_control else int(ids[j]) not in control):
            j += 1
        out.append((i, j, bool(mask[i]), is_control))
        i = j
    return out


def marked_text(tokenizer: Any, ids: np.ndarray, mask: np.ndarray, marks: tuple[str, str] = BRACKETS) -> str:
    """One sequence's text, decoded whole, its trained tokens (``mask`` True) between ``marks``
    and each real control token between ``\u27e6 \u27e7`` (:data:`CONTROL`).

    Each span of text is the decode of the tokens up to its end less the decode up to its
    start: a span decoded alone could read otherwise (a SentencePiece decoder drops the
    leading space of the first token it decodes). A control token (an id of the tokenizer's
    special or added vocabulary) is shown by its name, marked; a run of one (an image's
    placeholders) as ``'\u27e6<|image_pad|>\u27e7 x 64'``. Text that only reads like a control
    token (the characters ``<|im_end|>`` in a message, kept as text) is shown bare. Costs one
    decode of a prefix per span: a few per turn.

    >>> from sftpack.testing import tiny_chat_tokenizer
    >>> tok = tiny_chat_tokenizer("chatml")
    >>> ids = np.array(tok("<|im_start|>hi<|im_end|>")["input_ids"])
    >>> marked_text(tok, ids, np.array([0, 0, 0, 1], bool))
    '\u27e6<|im_start|>\u27e7hi[[\u27e6<|im_end|>\u27e7]]'
    """
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.asarray(mask, dtype=bool)
    control = frozenset(int(t) for t in tokenizer.all_special_ids) | frozenset(tokenizer.get_added_vocab().values())

    def decode(part: np.ndarray) -> str:
        return str(tokenizer.decode(part.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    out: list[str] = []
    before, trained = "", False
    for start, end, on, is_control in _pieces(ids, mask, control):
        if on != trained:
            out.append(marks[0] if on else marks[1])
            trained = on
        upto = decode(ids[:end])
        if is_control:
            name = f"{CONTROL[0]}{tokenizer.convert_ids_to_tokens(int(ids[start]))}{CONTROL[1]}"
            out.append(name if end - start == 1 else f"{name} x {end - start}")
        else:
            out.append(upto[len(before) :] if upto.startswith(before) else decode(ids[start:end]))
        before = upto
    if trained:
        out.append(marks[1])
    return "".join(out)


def decode_tokenizer(ds: PrepackedDataset, model: str | None = None, tokenizer: str | None = None) -> Any:
    """The tokenizer to decode the prepack ``ds`` with: ``--model`` / ``--tokenizer``'s, else
    the folder the prepack records (when it is there), else the embedded one (the family's
    for a prepack with images); refused (a usage error) when its fingerprint is not the
    prepack's, whose ids it would misread."""
    from ..offline import tokenizer_fingerprint  # start-up: the offline path loads torch

    fp = ds.manifest["fingerprint"].get("tokenizer") or {}
    want = fp.get("sha256")
    given = tokenizer_folder(model, tokenizer)
    recorded = str(fp.get("name_or_path") or "")
    if given is not None:
        candidates: list[str | None] = [given]
    else:
        candidates = [recorded] if recorded and Path(recorded).is_dir() else []
        candidates.append(None)
    media = ds.media is not None
    have = ""
    for folder in candidates:
        try:
            tok = _family_tokenizer(ds, model, folder) if media else load_tokenizer(folder)
        except (UsageError, OSError, ValueError):
            if given is not None:
                raise
            continue  # the recorded folder is no tokenizer (any more): the next candidate
        have = str(tokenizer_fingerprint(tok)["sha256"])
        if want is None or have == want:
            return tok
    what = f"the one in {given}" if given is not None else "the embedded one"
    raise UsageError(
        f"--decode: {ds.path} was made with tokenizer {str(want)[:12]}{f' ({recorded})' if recorded else ''}, "
        f"not {what} ({have[:12]}): its ids would decode to other text; give --tokenizer DIR (or --model DIR) "
        "with the prepack's tokenizer"
    )


def _family_tokenizer(ds: PrepackedDataset, model: str | None, folder: str | None) -> Any:
    from ..multimodal import DEFAULT_FAMILY, UnsupportedModelError, family_for  # start-up: multimodal loads torch

    family = (ds.manifest.get("media") or {}).get("family", DEFAULT_FAMILY)
    try:
        return family_for(model if model is not None else family).tokenizer(folder)
    except UnsupportedModelError as e:
        raise UsageError(str(e)) from None


def decode_lines(ds: PrepackedDataset, i: int, tokenizer: Any, marks: tuple[str, str] = BRACKETS) -> list[str]:
    """Row ``i``'s sequences as text (:func:`marked_text`), each under a ``--- A: id`` line
    naming it as :func:`row_lines` does, then a line with the row's padding."""
    ids, mask, seqs = ds.row_arrays(i)
    names = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    name = str(getattr(tokenizer, "name_or_path", "") or "the embedded tokenizer")
    out = [
        f"row {i} decoded with {name} ({CONTROL[0]}...{CONTROL[1]}: control tokens; {marks[0]}...{marks[1]}: "
        "trained tokens, loss_mask True):"
    ]
    at = 0
    for j, rec in enumerate(seqs):
        n = int(rec["length"])
        m = np.asarray(mask[at : at + n], dtype=bool)
        piece = f" piece {int(rec['piece'])}" if int(rec["piece"]) else ""
        cid = ds.conversation_id(int(rec["conversation"]))
        out.append(f"--- {names[j % len(names)]}: {cid}{piece}, {n:,} tokens, {int(m.sum()):,} trained")
        out.append(marked_text(tokenizer, np.asarray(ids[at : at + n]), m, marks).removesuffix("\n"))
        at += n
    out.append(f"--- end of row {i}: {ds.max_seq_len - at:,} padding slots not shown")
    return out


def _marks() -> tuple[str, str]:
    """Green on a terminal (unless ``NO_COLOR`` is set: https://no-color.org), brackets otherwise."""
    return COLOUR if sys.stdout.isatty() and not os.environ.get("NO_COLOR") else BRACKETS


def run(args: argparse.Namespace) -> int:
    from ..offline import PrepackedDataset, describe, save_histograms_png  # start-up: the offline path loads torch

    if not args.decode and (args.tokenizer is not None or args.model is not None):
        raise UsageError("--tokenizer and --model are for --decode: add --decode, or drop them")
    ds = PrepackedDataset(args.directory, verify="full" if args.verify else "size")
    for line in describe_lines(ds):
        print(line)
    if args.verify:
        print(
            f"\nverified: every file matches its SHA-256 ({len(ds.manifest['files'])} files), and the manifest its own"
        )
    if args.decode and args.row is None:
        args.row = 0
    if args.row is not None:
        if args.row >= ds.num_rows:
            raise UsageError(f"--row {args.row} is out of range: the prepack has {ds.num_rows} rows")
        print()
        for line in row_lines(ds, args.row):
            print(line)
    if args.decode:
        tokenizer = decode_tokenizer(ds, args.model, args.tokenizer)
        print()
        for line in decode_lines(ds, args.row, tokenizer, _marks()):
            print(line)
    if args.png:
        print(f"\nwrote {save_histograms_png(describe(ds), args.png)}")
    return 0
