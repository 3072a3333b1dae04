"""The on-disk format of a prepack directory: file names, dtypes, ``.npy`` headers,
checksums and the manifest.

One directory, six ``.npy`` arrays and a manifest (format version 2)::

    tokens.npy                (T,)   uint8 / uint16 / uint32   real tokens only, row after row, no padding
    loss_mask.npy             (T,)   bool                      True on tokens the model is trained to produce
    sequences.npy             (S,)   start i8, length i4, conversation i8, piece i4
    rows.npy                  (R+1,) sequence i8, token i8     row r = sequences[rows[r].sequence : rows[r+1].sequence]
    conversation_ids.npy      (B,)   uint8                     UTF-8 JSON of each conversation id, end to end
    conversation_offsets.npy  (C+1,) int64                     conversation c is bytes [off[c], off[c+1])
    manifest.json                                              fingerprint, counts, per-file size + sha256,
                                                               and its own checksum (``manifest_sha256``)

Why this shape: tokens are stored once, without padding (the row builder lays
the padding from ``max_seq_len`` and the pad multiple, so padding costs no
disk), in the dtype the vocabulary needs (Qwen's 151,646 ids: 4 bytes; a
vocabulary under 65,536: 2 bytes). A row's tokens are one contiguous slice, so
reading row ``r`` is two index look-ups and two slices of ``(len,)``, about
5 bytes per token. Plain ``.npy`` files open with ``np.load(mmap_mode="r")``
in any numpy, so a prepack is readable without sftpack.

A prepack with images (format version 3, written by ``prepack(..., images=True)``) adds
the media columns: ``pixels.npy`` (every image's resized uint8 pixels, in row order),
``images.npy`` (one record per image, :data:`IMAGE_DTYPE`: pixel offset, size, grid,
sequence, placeholder start) and ``row_images.npy`` (each row's first image), written by
the same stage-3 writer as the tokens at offsets the plan fixes, and the manifest's
``media`` entry (what is stored, the image processor's settings, the model family whose
position rule rebuilds each sample's media on read, totals). Text prepacks stay version 2.

A text prepack whose samples carry per-token weights or are preference pairs (format version 5)
adds one or two optional columns, each listed in the manifest with the files and sealed the same way::

    weights.npy               (T,)   float64                   each token's weight (Sample.weights; 1 where a
                                                               sample had none), aligned with tokens.npy: the
                                                               row builder shifts it onto the labels
    roles.npy                 (S,)   uint8                     each sequence's role in its pair (an index into
                                                               manifest["pairs"]["roles"]: chosen, rejected)

with the manifest's ``weights`` entry (``{"dtype": "float64"}``) and ``pairs`` entry (the role
names and the pair count); a pair's two sequences share one conversation number (its group id),
always in one row, and a row reads each one's id back as ``(group, role)``
(:func:`sftpack.sample.pair_sequence_id`). Without weights and pairs nothing of this is written:
such a prepack is version 2, byte for byte what it was.

Every byte is covered by a checksum: the six files by the SHA-256 the manifest
records for each, the manifest by ``manifest_sha256``, the SHA-256 of its own
canonical JSON without that key (format version 2; version 1 had none and is
refused with the fix). :func:`read_manifest` checks that seal, every entry's
type and range, and the layout (``max_seq_len``, ``pad_multiple``, ``pad_id``)
against the fingerprint, whose own digest it also checks; an edited or damaged
manifest is a :class:`PrepackError` naming it, never a ``KeyError``.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ..objectives import CHOSEN, REJECTED

__all__ = [
    "FILES",
    "FORMAT",
    "COLUMNS_FORMAT_VERSION",
    "FORMAT_VERSION",
    "IMAGE_DTYPE",
    "INDEX_FILES",
    "MANIFEST",
    "MAX_ROW_WIDTH",
    "MEDIA_FILES",
    "MEDIA_FORMAT_VERSION",
    "MEDIA_INDEX_FILES",
    "PAIR_ROLES",
    "ROLES_FILE",
    "ROW_DTYPE",
    "SEQUENCE_DTYPE",
    "PrepackError",
    "check_row_width",
    "digest",
    "file_sha256",
    "npy_header",
    "open_npy",
    "read_manifest",
    "seal_manifest",
    "column_files",
    "token_dtype",
    "write_json",
    "WEIGHTS_FILE",
]

FORMAT = "sftpack.prepack"
#: 2: the manifest carries ``manifest_sha256`` and the fingerprint ``pad_id``; 1 is refused (no manifest checksum).
FORMAT_VERSION = 2
#: 4: a prepack with media (``manifest["media"]`` and the three media files; images and videos,
#: one :data:`IMAGE_DTYPE` record per item); an older sftpack refuses it ("written by a newer
#: sftpack") instead of reading its rows without their media. 3 (images only, records without
#: ``frames``, ``video``, ``seconds``) is refused with the fix: write it again.
MEDIA_FORMAT_VERSION = 4
#: The media format before videos: refused with the fix (no reader keeps its 40-byte records).
OLD_MEDIA_FORMAT_VERSION = 3
#: 5: a text prepack with per-token weights (``weights.npy``) and/or preference pairs (``roles.npy``);
#: an older sftpack refuses it ("written by a newer sftpack") instead of dropping the weights or
#: training a pair's answers as SFT targets.
COLUMNS_FORMAT_VERSION = 5
#: The optional columns of a version-5 prepack: the file, and the manifest entry that says it is there.
WEIGHTS_FILE, ROLES_FILE = "weights.npy", "roles.npy"
#: The role table of a preference prepack (``roles.npy`` holds indices into it): the objectives' two roles.
PAIR_ROLES = (CHOSEN, REJECTED)
#: The media files, checked like the others when the manifest has ``media``.
MEDIA_FILES = ("pixels.npy", "images.npy", "row_images.npy")
#: The small media index files: checked (SHA-256 and structure) on every default open.
MEDIA_INDEX_FILES = MEDIA_FILES[1:]
# What is stored per media item (the manifest's ``media.kind``) is the family's stored format
# (``Family.stored_format``, checked against the family the manifest names): a patch family's
# (Qwen-VL's) resized uint8 pixels ``(frames, H, W, 3)`` row-major (an image one frame, a video
# its frames padded to whole temporal slices) with the patch processor's settings; a fixed-size
# image family's (LLaVA, Gemma 3) resized (and cropped) uint8 pixels ``(H, W, 3)`` with the
# processor's rescale and normalisation of every uint8 value of each channel (``pixel_table``).
#: One record per media item (image or video), in row order (``sequence``: the output sequence it
#: belongs to; ``start``: its placeholder run's start in that sequence; ``pixels``: its first byte in
#: ``pixels.npy``; ``frames`` of ``height x width`` pixels stored, 1 for an image; ``grid_*``: its
#: patch grid, ``(1, 1, n)`` for a fixed-size image of ``n`` placeholders; ``video``: 1 for a video
#: item; ``seconds``: the seconds a video's temporal slice spans, 0 for an image).
IMAGE_DTYPE = np.dtype(
    [
        ("pixels", "<i8"),
        ("height", "<i4"),
        ("width", "<i4"),
        ("grid_t", "<i4"),
        ("grid_h", "<i4"),
        ("grid_w", "<i4"),
        ("sequence", "<i8"),
        ("start", "<i4"),
        ("frames", "<i4"),
        ("video", "<i4"),
        ("seconds", "<f4"),
    ]
)
MANIFEST = "manifest.json"
#: The widest row a prepack may have (16 Mi slots). A row is built as five int64
#: tensors of its width (40 bytes a slot: 640 MB at this width), the boundaries are
#: int32, and no model trains on longer contexts; wider is refused when writing and
#: when opening (a damaged manifest must not make a reader allocate terabytes).
MAX_ROW_WIDTH = 1 << 24

#: One record per sequence, in row order.
SEQUENCE_DTYPE = np.dtype([("start", "<i8"), ("length", "<i4"), ("conversation", "<i8"), ("piece", "<i4")])
#: ``rows + 1`` records: the first sequence and the first token of each row (the last is the end).
ROW_DTYPE = np.dtype([("sequence", "<i8"), ("token", "<i8")])

#: The data files, in the order they are written and checked.
FILES = (
    "tokens.npy",
    "loss_mask.npy",
    "sequences.npy",
    "rows.npy",
    "conversation_ids.npy",
    "conversation_offsets.npy",
)
#: The small index files: checked (SHA-256 and structure) on every default open.
INDEX_FILES = FILES[2:]


def column_files(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The optional column files a manifest lists (``weights.npy``, ``roles.npy``; none for SFT)."""
    return tuple(f for f, key in ((WEIGHTS_FILE, "weights"), (ROLES_FILE, "pairs")) if manifest.get(key) is not None)


class PrepackError(ValueError):
    """A prepack directory that cannot be used: missing, damaged, foreign or mismatched.
    The message names the directory or file and the fix."""


def digest(obj: object) -> str:
    """SHA-256 of the canonical JSON of ``obj`` (sorted keys, no spaces).

    >>> digest({"b": 1, "a": [2, 3]}) == digest({"a": [2, 3], "b": 1})
    True
    """
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_row_width(max_seq_len: int, what: str = "max_seq_len") -> int:
    """``max_seq_len`` if it is at most :data:`MAX_ROW_WIDTH`, else a ``ValueError`` with the limit and why."""
    if max_seq_len > MAX_ROW_WIDTH:
        raise ValueError(
            f"{what}={max_seq_len:,} is wider than sftpack's limit of {MAX_ROW_WIDTH:,} slots per row (a row is "
            f"built as five int64 tensors of its width: {max_seq_len * 40 / 1e9:,.1f} GB each time one is read): "
            "use the context length your model trains on"
        )
    return max_seq_len


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with ``manifest_sha256``: the digest of its canonical JSON (as written and
    read back, so keys and numbers are what a reader will see) without that key."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != "manifest_sha256"}))
    return dict(manifest, manifest_sha256=digest(body))


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below ``vocab_size``.

    >>> token_dtype(256), token_dtype(270), token_dtype(151_646)
    (dtype('uint8'), dtype('uint16'), dtype('uint32'))
    """
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise PrepackError(f"vocabulary of {vocab_size} ids does not fit 32 bits; token ids must be below 2**32")


def npy_header(dtype: DTypeLike, length: int) -> bytes:
    """The ``.npy`` (version 1.0) header of a 1-D array of ``length`` items of ``dtype``:
    a file is this header followed by the raw little-endian items."""
    buf = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (int(length),)}
    np.lib.format.write_array_header_1_0(buf, d)
    return buf.getvalue()


def open_npy(
    path: Path, dtype: np.dtype | None = None, length: int | None = None
) -> tuple[np.ndarray, mmap.mmap | None]:
    """Memory-map a 1-D ``.npy`` file read-only: ``(array, mapping)``.

    The mapping is returned so a reader can ``madvise`` pages away (resident
    pages of a file mapping count in RSS) or close it. An empty array has no
    mapping (``mmap`` refuses zero-length files). With ``dtype`` / ``length``, a
    header that says otherwise is refused. A header that does not parse (one
    flipped bit is enough) is a :class:`PrepackError` naming the file.
    """
    path = Path(path)
    damaged = f"{path}: the .npy header is damaged"
    with open(path, "rb") as f:
        try:
            major, minor = np.lib.format.read_magic(f)
        except (ValueError, OSError) as e:
            raise PrepackError(f"{damaged} ({e}); write the prepack again") from None
        if (major, minor) != (1, 0):
            raise PrepackError(
                f"{path}: .npy version {major}.{minor}, expected 1.0: {damaged}; write the prepack again"
            )
        try:
            shape, fortran, found = np.lib.format.read_array_header_1_0(f)
        except Exception as e:  # noqa: BLE001 - numpy's header parser raises SyntaxError, tokenize.TokenError, ...
            why = " ".join(str(e).split())[:120] or type(e).__name__
            raise PrepackError(f"{damaged} ({type(e).__name__}: {why}); write the prepack again") from None
        offset = f.tell()
        if not isinstance(shape, tuple) or len(shape) != 1 or fortran:
            raise PrepackError(f"{damaged}: expected a 1-D array, got shape {shape}; write the prepack again")
        if dtype is not None and found != np.dtype(dtype):
            raise PrepackError(
                f"{path}: its .npy header says {found}, the prepack format needs {np.dtype(dtype)}: the file or "
                "the manifest is damaged; write the prepack again"
            )
        dtype = found
        n = int(shape[0])
        if length is not None and n != length:
            raise PrepackError(
                f"{path}: its .npy header says {n} items, the manifest counts {length}: the file or the manifest "
                "is damaged; write the prepack again"
            )
        size = os.fstat(f.fileno()).st_size
        need = offset + n * dtype.itemsize
        if size != need:
            raise PrepackError(
                f"{path.name} is {size} bytes but its header promises {need} ({n} items of {dtype}): "
                "the file is truncated or damaged; write the prepack again"
            )
        if n == 0:
            return np.zeros(0, dtype), None
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mm, dtype=dtype, count=n, offset=offset), mm


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def write_json(path: Path, obj: object) -> None:
    """Deterministic JSON (sorted keys, 2-space indent, trailing newline), flushed to disk."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _table_row(row: Any) -> bool:
    return isinstance(row, list) and len(row) == 256 and all(_number(x) and np.isfinite(x) for x in row)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a prepack directory, checked for format and version.

    Raises:
        PrepackError: not a directory, no manifest (not a prepack, or a write that
            never finished), invalid JSON, another format, or a newer format version.
    """
    directory = Path(directory)
    if not directory.exists():
        parked = sorted(directory.parent.glob(f".{directory.name}.sftpack-old-*"))
        if parked:
            raise PrepackError(
                f"{directory}: no such directory; an interrupted --overwrite left the previous prepack at "
                f"{parked[0]}: run the same sftpack prepack again (it finishes or undoes the swap first)"
            )
    if not directory.is_dir():
        raise PrepackError(
            f"{directory}: no such directory (give a directory written by sftpack prepack)"
            if not directory.exists()
            else f"{directory} is a file, not a prepack directory"
        )
    if ".sftpack-partial-" in directory.name:
        raise PrepackError(
            f"{directory} is the temporary directory of a prepack that did not finish; "
            "delete it and run sftpack prepack again"
        )
    path = directory / MANIFEST
    if not path.is_file():
        raise PrepackError(
            f"{directory} is not a sftpack prepack (no {MANIFEST}); write one with "
            f"`sftpack prepack INPUT... --out {directory}`"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise PrepackError(f"{path} is not valid JSON ({e}): the prepack is damaged; write it again") from None
    found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    if found != FORMAT:
        raise PrepackError(f"{path} is not a sftpack prepack manifest (format {found!r}, expected {FORMAT!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise PrepackError(
            f"{path}: format_version is {version!r}, expected an integer: the manifest is damaged; write the prepack again"
        )
    if version > COLUMNS_FORMAT_VERSION:
        raise PrepackError(
            f"{directory} was written by a newer sftpack (format version {version} > {COLUMNS_FORMAT_VERSION}, "
            f"written by sftpack {manifest.get('sftpack_version', '?')}): upgrade sftpack to read it"
        )
    if version == OLD_MEDIA_FORMAT_VERSION:
        raise PrepackError(
            f"{directory} holds images in the media format before videos (format version {version}, sftpack "
            f"{manifest.get('sftpack_version', '?')}), which this sftpack no longer reads: write it again with this "
            f"sftpack (sftpack prepack ... --out {directory} --overwrite)"
        )
    if version < FORMAT_VERSION:
        raise PrepackError(
            f"{directory} was written by an older sftpack (format version {version} < {FORMAT_VERSION}, "
            f"sftpack {manifest.get('sftpack_version', '?')}), whose manifest carries no checksum: write it again "
            f"with this sftpack (sftpack prepack ... --out {directory} --overwrite)"
        )
    seal = manifest.get("manifest_sha256")
    if seal_manifest(manifest)["manifest_sha256"] != seal:
        raise PrepackError(
            f"{path} does not match its own checksum (manifest_sha256): the manifest was edited or damaged; "
            "write the prepack again"
        )
    check_manifest(manifest, path)
    return manifest


_HEX64 = re.compile(r"[0-9a-f]{64}")
_TOKEN_DTYPES = ("uint8", "uint16", "uint32")
_COUNT_INTS = (
    "read",
    "kept",
    "packed_conversations",
    "sequences",
    "tokens",
    "trainable_tokens",
    "labels",
    "first_token_trainable",
    "rows",
    "max_seq_len",
    "slots",
    "padding",
    "l1",
    "l2",
    "max_sequences_per_row",
    "tokens_lost",
    "trainable_tokens_lost",
    "tokens_rendered",
)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_manifest(m: dict[str, Any], path: Path) -> None:
    """Every manifest entry a reader uses has its type and range, and the layout agrees with the
    fingerprint (whose own digest is checked). Raises :class:`PrepackError` naming the entry."""

    def bad(where: str, value: object, want: str) -> PrepackError:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return PrepackError(
            f"{path}: {where} is {shown}, expected {want}: the manifest is damaged; write the prepack again"
        )

    def get(obj: dict[str, Any], key: str, where: str, ok: Any, want: str) -> Any:
        if key not in obj:
            raise PrepackError(f"{path} has no {where!r} entry: the manifest is damaged; write the prepack again")
        if not ok(obj[key]):
            raise bad(where, obj[key], want)
        return obj[key]

    is_dict = lambda v: isinstance(v, dict)  # noqa: E731
    for key in ("sftpack_version", "source", "token_dtype"):
        get(m, key, key, lambda v: isinstance(v, str), "a string")
    width = get(
        m,
        "max_seq_len",
        "max_seq_len",
        lambda v: _int(v) and 1 <= v <= MAX_ROW_WIDTH,
        f"an integer from 1 to {MAX_ROW_WIDTH:,}",
    )
    mult = get(
        m,
        "pad_multiple",
        "pad_multiple",
        lambda v: _int(v) and 1 <= v <= width and width % v == 0,
        f"a positive divisor of max_seq_len={width}",
    )
    if m["token_dtype"] not in _TOKEN_DTYPES:
        raise bad("token_dtype", m["token_dtype"], " or ".join(_TOKEN_DTYPES))
    top = int(np.iinfo(np.dtype(m["token_dtype"])).max)
    pad_id = get(m, "pad_id", "pad_id", lambda v: _int(v) and 0 <= v <= top, f"an integer id from 0 to {top}")
    get(m, "vocab_size", "vocab_size", lambda v: _int(v) and 1 <= v <= top + 1, f"an integer from 1 to {top + 1}")
    get(m, "pad_between_seqs", "pad_between_seqs", lambda v: isinstance(v, bool), "true or false")
    files = get(m, "files", "files", is_dict, "an object")
    media = m.get("media")
    if (m.get("format_version") == MEDIA_FORMAT_VERSION) != (media is not None):
        raise bad("media", media, f"an object exactly when format_version is {MEDIA_FORMAT_VERSION}")
    columns = column_files(m)
    if (m.get("format_version") == COLUMNS_FORMAT_VERSION) != bool(columns):
        raise bad(
            "weights/pairs",
            {k: m.get(k) for k in ("weights", "pairs")},
            f"an entry exactly when format_version is {COLUMNS_FORMAT_VERSION}",
        )
    if m.get("weights") is not None:
        get(m, "weights", "weights", lambda v: is_dict(v) and v.get("dtype") == "float64", '{"dtype": "float64"}')
    if m.get("pairs") is not None:
        pairs = get(m, "pairs", "pairs", is_dict, "an object")
        get(pairs, "roles", "pairs.roles", lambda v: v == list(PAIR_ROLES), repr(list(PAIR_ROLES)))
        get(pairs, "pairs", "pairs.pairs", lambda v: _int(v) and v >= 0, "a count (an integer >= 0)")
    if media is not None:
        get(m, "media", "media", is_dict, "an object")
        for key in ("images", "patches", "pixel_bytes", "image_token_id", "merge_size"):
            get(media, key, f"media.{key}", lambda v: _int(v) and v >= 0, "an integer >= 0")
        from ..multimodal import (  # multimodal loads only for media (~0.5 s over the offline path)
            family_for,
            family_names,
        )

        names = family_names()
        name = get(media, "family", "media.family", lambda v: v in names, f"a model family's name ({', '.join(names)})")
        family = family_for(name)
        stored = family.stored_format  # what the family stores of each media item
        get(media, "kind", "media.kind", lambda v: v == stored, f"{stored!r} (what the {name} family stores)")
        proc = get(media, "processor", "media.processor", is_dict, "an object")
        if family.media_class.kind == "patches":
            for key in ("patch_size", "temporal_patch_size", "merge_size"):
                get(proc, key, f"media.processor.{key}", lambda v: _int(v) and v >= 1, "a positive integer")
            video = get(media, "video_processor", "media.video_processor", is_dict, "an object")
            for key in ("patch_size", "temporal_patch_size", "merge_size"):  # one tower takes both
                get(video, key, f"media.video_processor.{key}", lambda v, k=key: v == proc[k], f"{proc[key]!r}")
        else:
            get(
                media,
                "pixel_table",
                "media.pixel_table",
                lambda v: isinstance(v, list) and len(v) == 3 and all(_table_row(r) for r in v),
                "three lists of 256 finite numbers",
            )
        for key in ("image_mean", "image_std"):
            get(
                proc,
                key,
                f"media.processor.{key}",
                lambda v: isinstance(v, list) and len(v) == 3 and all(_number(x) for x in v),
                "three numbers",
            )
        get(proc, "rescale_factor", "media.processor.rescale_factor", _number, "a number")
    for name in FILES + (MEDIA_FILES if media is not None else ()) + columns:
        entry = get(files, name, f"files.{name}", is_dict, "an object")
        get(entry, "bytes", f"files.{name}.bytes", lambda v: _int(v) and v >= 0, "a byte count")
        get(
            entry,
            "sha256",
            f"files.{name}.sha256",
            lambda v: isinstance(v, str) and _HEX64.fullmatch(v),
            "64 hex digits",
        )
    counts = get(m, "counts", "counts", is_dict, "an object")
    for key in _COUNT_INTS:
        get(counts, key, f"counts.{key}", lambda v: _int(v) and v >= 0, "a count (an integer >= 0)")
    for key in ("fill", "gap_l1"):
        get(counts, key, f"counts.{key}", _number, "a number")
    get(
        counts,
        "dropped",
        "counts.dropped",
        lambda v: is_dict(v) and all(_int(n) and n >= 0 for n in v.values()),
        "an object of counts",
    )
    if "overlong" in counts:
        get(
            counts,
            "overlong",
            "counts.overlong",
            lambda v: (
                is_dict(v) and all(_int(v.get(k)) and v[k] >= 0 for k in ("fit", "split", "truncated", "dropped"))
            ),
            "an object with the counts fit, split, truncated, dropped",
        )
    fp = get(m, "fingerprint", "fingerprint", is_dict, "an object")
    get(fp, "sha256", "fingerprint.sha256", lambda v: isinstance(v, str) and _HEX64.fullmatch(v), "64 hex digits")
    if "tokenizer" in fp:
        get(fp, "tokenizer", "fingerprint.tokenizer", lambda v: v is None or is_dict(v), "an object")
    if "inputs" in fp:
        get(
            fp,
            "inputs",
            "fingerprint.inputs",
            lambda v: isinstance(v, list) and all(is_dict(i) for i in v),
            "a list of objects",
        )
    if digest({k: v for k, v in fp.items() if k != "sha256"}) != fp["sha256"]:
        raise PrepackError(
            f"{path}: the fingerprint does not match its own digest (fingerprint.sha256): the manifest was edited "
            "or damaged; write the prepack again"
        )
    # the layout the rows are read with must be the one they were written with
    for key, have in (("max_seq_len", width), ("pad_multiple", mult), ("pad_id", pad_id)):
        if fp.get(key) != have:
            raise PrepackError(
                f"{path}: {key} is {have!r} but the fingerprint says {fp.get(key)!r}: the manifest was edited or "
                "damaged (the rows were written for the fingerprint's value); write the prepack again"
            )
    if counts["max_seq_len"] != width or counts["slots"] != counts["rows"] * width:
        raise PrepackError(
            f"{path}: the counts (max_seq_len {counts['max_seq_len']}, {counts['slots']} slots in {counts['rows']} "
            f"rows) disagree with max_seq_len={width}: the manifest is damaged; write the prepack again"
        )
