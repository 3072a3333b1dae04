"""What a pass of the reader reports: :class:`ReadStats`, its counts (every row read lands in
``kept`` or one ``dropped`` reason, every file not read in ``files_skipped``), and
:class:`BadFileError`, the error of a file it cannot read in ``on_bad_row="error"`` mode."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ._find import FileProblem
from ._options import BadRowReason, FileSkipReason, RowFormat

__all__ = ["BadFileError", "ReadStats"]


class BadFileError(ValueError):
    """A file that cannot be read (or the damaged rest of one), in ``on_bad_row='error'`` mode.

    Attributes: ``path``, ``reason`` (a :class:`FileSkipReason`, or
    ``BadRowReason.UNREADABLE_TAIL`` for damage after some rows), ``detail`` and ``fix``.
    """

    def __init__(self, path: str, reason: FileSkipReason | BadRowReason, detail: str, fix: str):
        self.path, self.reason, self.detail, self.fix = path, reason, detail, fix
        super().__init__(
            f"{path}: {detail} [{reason.value}]. Fix: {fix}; or pass --on-bad-row skip (on_bad_row='skip' in "
            "Python) to count such files "
            "(stats.files_skipped, stats.dropped['unreadable_tail']) and read the rest."
        )

    def __reduce__(self) -> Any:
        return (type(self), (self.path, self.reason, self.detail, self.fix))


@dataclass(repr=False)
class ReadStats:
    """Counts of one pass over the sources: ``read == kept + sum(dropped.values())``.

    Attributes:
        read: rows seen (blank JSONL lines are not rows; the damaged tail of a
            file counts as its rows where known, else as one).
        kept: rows yielded as conversations.
        images: image content parts in the kept rows (0 for text data).
        formats: format (a :class:`RowFormat` value) -> kept rows of it;
            ``sum(formats.values()) == kept``.
        dropped: reason (a :class:`BadRowReason` value) -> rows left out for it.
        files_read: files (and datasets) opened and read, wholly or up to damage.
        files_skipped: reason (a :class:`FileSkipReason` value) -> files not read.
        file_problems: every skipped file and every damaged tail, with its path
            and what is wrong (for a report naming them).
        media_files: image and video files the folder and glob searches found: the
            data's media (read where its image parts name them), not data files, so
            neither read as data nor skipped.
    """

    read: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    images: int = 0
    formats: dict[str, int] = field(default_factory=dict)
    files_read: int = 0
    files_skipped: dict[str, int] = field(default_factory=dict)
    file_problems: list[FileProblem] = field(default_factory=list)
    media_files: int = 0

    @property
    def num_dropped(self) -> int:
        """``sum(dropped.values())``."""
        return sum(self.dropped.values())

    def __repr__(self) -> str:  # the file fields only when a file was skipped or damaged
        text = f"ReadStats(read={self.read}, kept={self.kept}, dropped={self.dropped}"
        if set(self.formats) - {RowFormat.MESSAGES.value}:
            text += f", formats={self.formats}"
        if self.images:
            text += f", images={self.images}"
        if self.files_skipped or self.file_problems:
            text += f", files_read={self.files_read}, files_skipped={self.files_skipped}"
            text += f", file_problems=[{len(self.file_problems)} files]"
        if self.media_files:
            text += f", media_files={self.media_files}"
        return text + ")"

    def __getitem__(self, key: str) -> Any:
        if key in (
            *("read", "kept", "dropped", "images", "formats"),
            *("files_read", "files_skipped", "file_problems", "media_files"),
        ):
            return getattr(self, key)
        raise KeyError(key)

    def as_dict(self, *, files: bool = False) -> dict[str, Any]:
        """``read``, ``kept``, ``dropped`` and ``formats`` (JSON-ready; a stats dict of each key,
        so that the dicts of several readers add up key by key), and ``images`` where an image
        part was kept; with ``files=True`` also ``files_read``, ``files_skipped``,
        ``file_problems`` (a list of dicts), and ``media_files`` where a search found one."""
        out: dict[str, Any] = {"read": self.read, "kept": self.kept, "dropped": dict(self.dropped)}
        out["formats"] = dict(sorted(self.formats.items()))
        if self.images:
            out["images"] = self.images
        if files:
            out["files_read"] = self.files_read
            out["files_skipped"] = dict(self.files_skipped)
            out["file_problems"] = [asdict(p) for p in self.file_problems]
            if self.media_files:
                out["media_files"] = self.media_files
        return out

    def _reset(self) -> None:
        self.read = self.kept = self.images = self.files_read = 0
        self.dropped.clear()
        self.formats.clear()
        self.files_skipped.clear()
        self.file_problems.clear()

    def _skip_file(self, problem: FileProblem) -> None:
        self.files_skipped[problem.reason] = self.files_skipped.get(problem.reason, 0) + 1
        self.file_problems.append(problem)
