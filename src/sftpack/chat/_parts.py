"""A message content's parts (the reader's rows only, which know the data file's folder): a
content may also be a list of ``{"type": "text", "text": ...}`` and
``{"type": "image", ...}`` parts (Hugging Face's multimodal chat format). A
conversation without an image part is text: each list of text parts is joined
into one string (no separator), so it reads exactly as the same text written as
strings. A conversation with an image part keeps every content as a list of parts
(a string becomes one text part), each image part's source resolved: ``path`` (or
``image``) as a path relative to the data file's folder (made absolute), ``bytes``,
a Hugging Face ``{"bytes", "path"}`` image struct or a PIL image kept as given; a path
whose file lies outside the data folder (absolute, ``../``, a symlink out of it) is a bad
row, ``image_outside_data_dir``, unless the reader allows it (:class:`DataFolder`); a URL
is a malformed row (nothing is downloaded); an image part without a source takes
the next entry of the row's ``images`` list, which must hold exactly one entry per
such part; an image in an assistant turn is a malformed row. Images are not opened
here (that is the multimodal tokenizer's work).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._bad_row import RowProblem
from ._options import BadRowReason

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_SOURCES = ("path", "image", "bytes")  # the keys an image part names its image by


@dataclass(frozen=True)
class DataFolder:
    """Where a row's media paths lead: ``path``, the folder a relative path is read from (the
    data file's); ``within``, the real folders (symlinks resolved) a media file must lie in, or
    empty: anywhere (``allow_outside_images``)."""

    path: Path
    within: tuple[str, ...] = ()

    def holds(self, file: str) -> bool:
        """Whether ``file``, its symlinks resolved, lies in one of the ``within`` folders (or there are none)."""
        if not self.within:
            return True
        real = os.path.realpath(file)
        return any(real == f or real.startswith(f.rstrip(os.sep) + os.sep) for f in self.within)


def is_url(text: str) -> bool:
    """Whether ``text`` is a URL (``scheme://...``: ``http``, ``ftp``, ``s3``, ``file``, ...), not a path.

    >>> is_url("https://x/y.png"), is_url("imgs/y.png")
    (True, False)
    """
    return _URL.match(text) is not None


def _is_image_part(part: Any) -> bool:
    """An image or a video part (media the text path does not read)."""
    return isinstance(part, dict) and part.get("type") in ("image", "video")


def _is_pil(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "convert")


class _Images:
    """A row's ``images`` list, handed out to its source-less image parts in order."""

    def __init__(self, values: list[Any]):
        self.values, self.used = values, 0

    def take(self, where: str, base: DataFolder) -> dict[str, Any]:
        if self.used >= len(self.values):
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"{where}: image part {self.used + 1} without a source, but 'images' has {len(self.values)}",
                "give 'images' one entry per image part without a path",
            )
        value = self.values[self.used]
        self.used += 1
        return _source(value, "image", f"images[{self.used - 1}]", base)


def _images_column(row: dict[str, Any]) -> _Images | None:
    column = row.get("images")
    if column is None:
        return None
    if not isinstance(column, list):
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE,
            f"'images': a {type(column).__name__}, not a list",
            "give 'images' as a list of paths or image bytes",
        )
    return _Images(column)


def _parts(
    content: list[Any], where: str, role: str, base: DataFolder, pool: _Images | None
) -> tuple[list[dict[str, Any]], int]:
    """A content's parts, checked, image sources resolved, and how many are images."""
    parts: list[dict[str, Any]] = []
    images = 0
    for j, p in enumerate(content):
        part, is_image = _part(p, f"{where}[{j}]", base, pool)
        if is_image and role == "assistant":
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"{where}[{j}]: an image in an assistant turn",
                "move it to a user turn",
            )
        images += is_image
        parts.append(part)
    return parts, images


def _part(part: Any, where: str, base: DataFolder, pool: _Images | None) -> tuple[dict[str, Any], bool]:
    """One content part, its image source resolved; returns (part, is_image). Keys holding
    None (a struct column's absent fields in Parquet / Arrow) are dropped; an image part
    with no source takes the next entry of the row's ``images`` list, if it has one."""
    if isinstance(part, dict):
        part = {k: v for k, v in part.items() if v is not None}
    if not isinstance(part, dict) or part.get("type") not in ("text", "image", "video"):
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE,
            f"{where}: {str(part)[:60]!r} is not a text, image or video part",
            'write parts as {"type": "text", "text": ...}, {"type": "image", "path": ...} or '
            '{"type": "video", "path": ...} / {"type": "video", "frames": [...]}',
        )
    if part["type"] == "text":
        if not isinstance(part.get("text"), str):
            raise RowProblem(BadRowReason.NON_STRING_CONTENT, f"{where}.text: not a string", "give it a string")
        return part, False
    if part["type"] == "video":
        return _video_part(part, where, base), True
    src = next((k for k in _SOURCES if k in part), None)
    out = {k: v for k, v in part.items() if k not in _SOURCES}
    if src is None:
        if pool is None:
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"{where}: an image part with no path",
                'give it "path": "<file relative to the data file>", or give the row an \'images\' list',
            )
        out.update(pool.take(where, base))
        return out, True
    if src == "bytes" and not isinstance(part[src], (bytes, bytearray, memoryview)):
        out["bytes"] = part[src]  # left to the image loader, which names it (BadImageError)
        return out, True
    out.update(_source(part[src], src, where, base))
    return out, True


def _video_part(part: dict[str, Any], where: str, base: DataFolder) -> dict[str, Any]:
    """A video part with its file (``path``) or its frames (``frames``, a list of image files)
    resolved against the data file's folder; its other keys (``fps``) kept for the decoder,
    which checks them and the files (``BadImageError`` naming the field)."""
    out = dict(part)
    if isinstance(part.get("path"), str):
        out.update(_source(part["path"], "path", where, base))
    elif isinstance(part.get("frames"), list):
        out["frames"] = [
            _source(f, f"frames[{k}]", where, base).get("path", f) if isinstance(f, str) else f
            for k, f in enumerate(part["frames"])
        ]
    else:
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE,
            f"{where}: a video part with neither 'path' (a video file) nor 'frames' (a list of image files)",
            'write it as {"type": "video", "path": "clip.mp4"} or {"type": "video", "frames": ["f0.png", ...]}',
        )
    return out


def _source(value: Any, key: str, where: str, base: DataFolder) -> dict[str, Any]:
    """An image value (a path string, bytes, a ``{"bytes", "path"}`` struct as Hugging Face
    stores an ``Image`` feature, or a PIL image) as the source keys of a part."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # an Arrow Image struct
        if value.get("bytes") is not None:
            return {"bytes": value["bytes"]}
        value = value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(value)}
    if _is_pil(value):
        return {"image": value}
    if isinstance(value, str) and value:
        if is_url(value):
            raise RowProblem(
                BadRowReason.MALFORMED_MESSAGE,
                f"{where}.{key}: a URL {value[:60]!r}",
                "download the image and give its path",
            )
        path = os.fspath(Path(value) if os.path.isabs(value) else base.path / value)
        if not base.holds(path):
            raise RowProblem(
                BadRowReason.IMAGE_OUTSIDE_DATA_DIR,
                f"{where}.{key}: {value[:80]!r} is outside the data folder {base.within[0]!r} "
                f"(it resolves to {os.path.realpath(path)[:120]!r})",
                "copy the file into the data folder and give its path relative to the data file, or, if you "
                "trust the data, pass --allow-outside-images (allow_outside_images=True in Python)",
            )
        return {"path": path}
    raise RowProblem(
        BadRowReason.MALFORMED_MESSAGE,
        f"{where}.{key}: a {type(value).__name__}, not a path string or image bytes",
        "give the image as a path string (or bytes)",
    )
