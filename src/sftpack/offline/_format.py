"""The on-disk format of a prepack directory: file names, dtypes, ``.npy`` headers,
checksums and the manifest.

One directory, six ``.npy`` arrays and a manifest (format version 1)::

    tokens.npy                (T,)   uint8 / uint16 / uint32   real tokens only, row after row, no padding
    loss_mask.npy             (T,)   bool                      True on tokens the model is trained to produce
    sequences.npy             (S,)   start i8, length i4, conversation i8, piece i4
    rows.npy                  (R+1,) sequence i8, token i8     row r = sequences[rows[r].sequence : rows[r+1].sequence]
    conversation_ids.npy      (B,)   uint8                     UTF-8 JSON of each conversation id, end to end
    conversation_offsets.npy  (C+1,) int64                     conversation c is bytes [off[c], off[c+1])
    manifest.json                                              fingerprint, counts, per-file size + sha256

Why this shape: tokens are stored once, without padding (the row builder lays
the padding from ``max_seq_len`` and the pad multiple, so padding costs no
disk), in the dtype the vocabulary needs (Qwen's 151,646 ids: 4 bytes; a
vocabulary under 65,536: 2 bytes). A row's tokens are one contiguous slice, so
reading row ``r`` is two index look-ups and two slices of ``(len,)``, about
5 bytes per token. Plain ``.npy`` files open with ``np.load(mmap_mode="r")``
in any numpy, so a prepack is readable without sftpack.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FILES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "ROW_DTYPE",
    "SEQUENCE_DTYPE",
    "PrepackError",
    "file_sha256",
    "npy_header",
    "open_npy",
    "read_manifest",
    "token_dtype",
    "write_json",
]

FORMAT = "sftpack.prepack"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

#: One record per sequence, in row order.
SEQUENCE_DTYPE = np.dtype(
    [("start", "<i8"), ("length", "<i4"), ("conversation", "<i8"), ("piece", "<i4")]
)
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


class PrepackError(ValueError):
    """A prepack directory that cannot be used: missing, damaged, foreign or mismatched.
    The message names the directory or file and the fix."""


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


def npy_header(dtype: np.dtype, length: int) -> bytes:
    """The ``.npy`` (version 1.0) header of a 1-D array of ``length`` items of ``dtype``:
    a file is this header followed by the raw little-endian items."""
    buf = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (int(length),)}
    np.lib.format.write_array_header_1_0(buf, d)
    return buf.getvalue()


def open_npy(path: Path) -> tuple[np.ndarray, mmap.mmap | None]:
    """Memory-map a 1-D ``.npy`` file read-only: ``(array, mapping)``.

    The mapping is returned so a reader can ``madvise`` pages away (resident
    pages of a file mapping count in RSS) or close it. An empty array has no
    mapping (``mmap`` refuses zero-length files).
    """
    with open(path, "rb") as f:
        major, minor = np.lib.format.read_magic(f)
        if (major, minor) != (1, 0):
            raise PrepackError(f"{path}: .npy version {major}.{minor}, expected 1.0")
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        offset = f.tell()
        if len(shape) != 1 or fortran:
            raise PrepackError(f"{path}: expected a 1-D array, got shape {shape}")
        n = int(shape[0])
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
    """Hex SHA-256 of a file, read in 4 MiB chunks (about 1.5 GB/s with SHA extensions)."""
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


def write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON (sorted keys, 2-space indent, trailing newline), flushed to disk."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a prepack directory, checked for format and version.

    Raises:
        PrepackError: not a directory, no manifest (not a prepack, or a write that
            never finished), invalid JSON, another format, or a newer format version.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise PrepackError(
            f"{directory}: no such directory" if not directory.exists() else f"{directory} is a file, not a prepack directory"
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
        raise PrepackError(f"{path}: format_version is {version!r}, expected an integer")
    if version > FORMAT_VERSION:
        raise PrepackError(
            f"{directory} was written by a newer sftpack (format version {version} > {FORMAT_VERSION}, "
            f"written by sftpack {manifest.get('sftpack_version', '?')}): upgrade sftpack to read it"
        )
    for key in ("files", "counts", "fingerprint", "pad_id"):
        if key not in manifest:
            raise PrepackError(f"{path} has no {key!r} entry: the manifest is damaged; write the prepack again")
    return manifest
