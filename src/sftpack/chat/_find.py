"""Which files to read: paths, folders (searched recursively) and globs resolved to sources of a known kind.

A folder is searched in sorted path order (so ids and output are the same on
every machine); a sub-folder written by ``save_to_disk`` is a dataset, not
searched; a glob's ``**`` matches any depth. A file of another kind and a hidden
entry found in a folder become a :class:`FileProblem` (counted by the reader);
an image or video file found there is the data's media (read where an image part
names it), not a data file: counted apart (``ReadStats.media_files``), not as a
problem. A file named explicitly must be of a known kind. Reading the sources is
``_read``'s part.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._options import FileSkipReason

__all__ = ["FileProblem"]

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
_PARQUET_SUFFIXES = (".parquet", ".pq")
#: image and video files: the media a folder's data names in its image parts, not data files
_MEDIA_SUFFIXES = (
    *(".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".avif", ".heic", ".ico"),
    *(".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v", ".mpeg", ".mpg"),
)


@dataclass(frozen=True)
class FileProblem:
    """One file not read, or not read to its end: ``reason`` is a :class:`FileSkipReason`
    value or ``"unreadable_tail"``; ``rows_lost`` the rows counted for it in ``dropped``."""

    path: str
    reason: str
    detail: str
    rows_lost: int = 0


@dataclass
class _Source:
    kind: str  # "jsonl" | "parquet" | "dataset"
    name: str
    target: Any  # a path, or a datasets object
    root: Path | None = None  # the folder it was found in by a search (its media may lie anywhere in it)


@dataclass
class _Found:
    """What a path, folder or glob names: the sources to read, the files not read, and how
    many image or video files (media, not data) the searches passed."""

    sources: list[_Source]
    skipped: list[FileProblem]
    media: int = 0


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _kind_of(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    return None


_FORMATS = (
    f"JSON Lines or a JSON array ({', '.join(_JSONL_SUFFIXES)}), Parquet ({', '.join(_PARQUET_SUFFIXES)}), "
    "or a Hugging Face dataset directory (save_to_disk)"
)


def _resolve(paths: Any, split: str | None) -> _Found:
    """The sources to read, the files found in folders / globs that will not be, and the media files found."""
    if _is_datasets_object(paths):
        return _Found([_Source("dataset", "dataset", _pick_split(paths, split, "dataset"))], [])
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    sources: list[_Source] = []
    skipped: list[FileProblem] = []
    media = [0]
    for p in paths:
        if _is_datasets_object(p):
            sources.append(_Source("dataset", f"dataset{len(sources)}", _pick_split(p, split, "dataset")))
            continue
        text = os.fspath(p)
        if not os.path.exists(text) and glob.has_magic(text):
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                raise FileNotFoundError(f"no file matches {text!r}")
            found: list[_Source] = []
            for m in matches:
                path = Path(m)
                if path.is_dir():
                    found.extend(_walk(path, split, skipped, media, path))
                elif _kind_of(path):
                    found.append(_Source(_kind_of(path) or "", str(path), path))
                elif _is_media(path):
                    media[0] += 1
                else:
                    skipped.append(_unsupported(path))
            if not found:
                raise ValueError(
                    f"{text!r} matches {len(matches)} paths but no file of a known kind; supported: {_FORMATS}"
                )
            sources.extend(found)
            continue
        path = Path(text)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        if path.is_dir():
            found = _walk(path, split, skipped, media, path)
            if not found:
                raise ValueError(
                    f"{path} is a directory with no .jsonl / .json / .parquet file (searched recursively) and is "
                    "not a dataset saved with datasets' save_to_disk: point at the files or the saved dataset"
                )
            sources.extend(found)
            continue
        kind = _kind_of(path)
        if kind is None:
            raise ValueError(f"{path}: unknown format; supported: {_FORMATS}")
        sources.append(_Source(kind, str(path), path))
    return _Found(sources, skipped, media[0])


def _is_media(path: Path) -> bool:
    return path.name.lower().endswith(_MEDIA_SUFFIXES)


def _unsupported(path: Path) -> FileProblem:
    return FileProblem(
        str(path),
        FileSkipReason.UNSUPPORTED_FORMAT.value,
        f"not read: its name does not end in {', '.join(_JSONL_SUFFIXES + _PARQUET_SUFFIXES)}",
    )


def _walk(
    root: Path,
    split: str | None,
    skipped: list[FileProblem],
    media: list[int],
    top: Path,
    seen: set[Path] | None = None,
) -> list[_Source]:
    """Sources under ``root``, recursively, in sorted order; the rest goes to ``skipped``, and
    ``media[0]`` counts the image and video files. ``top``: the folder the search started from.
    A folder reached twice (a symlink loop) is searched once."""
    seen = set() if seen is None else seen
    real = root.resolve()
    if real in seen:
        return []
    seen.add(real)
    if _is_saved_dataset(root):
        return [_Source("dataset", str(root), (root, split), top)]
    found: list[_Source] = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.startswith("."):
            skipped.append(FileProblem(str(entry), FileSkipReason.HIDDEN.value, "not read: a hidden entry"))
        elif entry.is_dir():
            found.extend(_walk(entry, split, skipped, media, top, seen))
        elif not entry.is_file():
            skipped.append(FileProblem(str(entry), FileSkipReason.UNSUPPORTED_FORMAT.value, "not a regular file"))
        elif _kind_of(entry):
            found.append(_Source(_kind_of(entry) or "", str(entry), entry, top))
        elif _is_media(entry):
            media[0] += 1
        else:
            skipped.append(_unsupported(entry))
    return found


def _is_datasets_object(obj: object) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("datasets.") and hasattr(obj, "column_names")


def _pick_split(ds: Any, split: str | None, name: str) -> Any:
    if isinstance(ds.column_names, dict):  # a DatasetDict: one split has to be chosen
        splits = list(ds.column_names)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            given = "" if split is None else f", not {split!r}"
            raise ValueError(
                f"{name} is a DatasetDict with splits {', '.join(splits)}{given}: name the one to read "
                f"(--split NAME; split= in Python)"
            )
        return ds[split]
    return ds


# ---------------------------------------------------------------------------- telling files apart
