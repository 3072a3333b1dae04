"""Atomic publish: a file or folder is written under a temporary name beside its
destination, then renamed into place, so that a reader sees all of it or none.

One helper for every place sftpack writes something others may read while it is
written: the tokenized-data cache entry (:mod:`sftpack.chat._cache_entry`), the
built tokenizer (:mod:`sftpack.data`), the checkpoint's folder, manifest and
``latest`` pointer (:mod:`sftpack.loop._checkpoint`), and the prepack's partial
folder (:mod:`sftpack.offline._publish`, which places it itself: it may only swap
out the very prepack it found at the start).

The temporary sibling lives on the same filesystem (a rename across filesystems
is a copy, not atomic). On success it is fsynced, renamed, and the parent folder
fsynced (the rename itself survives a power cut); a folder's files are fsynced by
whoever writes them. If the writing fails, the temporary is removed and the error
goes on: nothing is left behind.

>>> import pathlib, tempfile
>>> dest = pathlib.Path(tempfile.mkdtemp()) / "note.txt"
>>> with Publish(dest, folder=False) as tmp:
...     _ = tmp.write_text("whole")
>>> dest.read_text(), [p.name for p in dest.parent.iterdir()]
('whole', ['note.txt'])

This module needs the standard library only (no torch, no path of sftpack's).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

__all__ = ["Publish", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a file created or renamed in it) to disk; a system or
    filesystem that cannot fsync a folder is not an error."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Publish:
    """``dest`` written under a temporary name beside it, then renamed into place.

    The temporary (:attr:`tmp`) is made at once: a new empty folder, or with
    ``folder=False`` a new empty file. ``with Publish(dest) as tmp:`` writes into it
    and publishes it when the body ends; if the body raises, it is removed and the
    error goes on. Writers whose work outlives one block call :meth:`publish` or
    :meth:`discard` themselves.

    Args:
        dest: where it appears.
        folder: a folder (default) or a file.
        tmp: the temporary's path (a sibling of ``dest``; for a folder, made here and
            not there yet; for a file, written by the caller, replacing what is there).
            Default: a new ``.tmp-<name>-<random>`` beside ``dest``.
        keep_existing: a folder only: when the rename finds a folder at ``dest``
            (another writer of the same thing finished first), keep it and drop
            this one (:meth:`publish` returns ``False``). Otherwise that is an
            ``OSError``. Either way a file replaces a file, a folder an empty
            folder, and anything else in the way is an ``OSError``.
    """

    def __init__(
        self,
        dest: str | os.PathLike[str],
        *,
        folder: bool = True,
        tmp: str | os.PathLike[str] | None = None,
        keep_existing: bool = False,
    ) -> None:
        self.dest, self.folder, self.keep_existing = Path(dest), folder, keep_existing
        prefix = f".tmp-{self.dest.name[:16]}-"
        if tmp is not None:
            self.tmp = Path(tmp)
            if folder:
                self.tmp.mkdir()
        elif folder:
            self.tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=self.dest.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, dir=self.dest.parent)
            os.close(fd)
            self.tmp = Path(name)

    def publish(self) -> bool:
        """fsync :attr:`tmp`, rename it to ``dest``, fsync the parent. Returns ``True``
        when it is in place, ``False`` when ``keep_existing`` found ``dest`` there
        (this one is removed). On any error the temporary is removed and the error raised."""
        try:
            if self.folder:
                fsync_dir(self.tmp)
            else:
                with open(self.tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(self.tmp, self.dest)  # a file replaces its target everywhere; a folder as rename
        except OSError:
            self.discard()
            there = self.dest.is_dir() if self.folder else self.dest.is_file()
            if self.keep_existing and there:
                return False
            raise
        fsync_dir(self.dest.parent)
        return True

    def discard(self) -> None:
        """Remove the temporary (whatever of it is there)."""
        if self.folder:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                self.tmp.unlink()

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.publish()
        else:
            self.discard()
