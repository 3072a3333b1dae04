"""Atomic publish: a file or folder is written under a temporary name beside its
destination, then renamed into place, so that a reader sees all of it or none.

One helper for every place sftpack writes something others may read while it is
written: the tokenized-data cache entry (:mod:`sftpack.chat`'s training cache), the
built tokenizer (:mod:`sftpack.data`), the checkpoint's folder, manifest and
``latest`` pointer (:mod:`sftpack.loop._checkpoint`), and the prepack's partial
folder (:mod:`sftpack.offline._publish`, which places it itself: it may only swap
out the very prepack it found at the start).

The temporary sibling lives on the same filesystem (a rename across filesystems
is a copy, not atomic). On success it is fsynced, renamed, and the parent folder
fsynced (the rename itself survives a power cut); a folder's files are fsynced by
whoever writes them. If the writing fails, the temporary is removed and the error
goes on: nothing is left behind. A folder that must replace a folder with contents
(``replace=True``: the trained model's ``--save-model --overwrite-model``) swaps with
it in one step (:func:`exchange`), the old one then removed.

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
import ctypes
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import TracebackType

__all__ = ["Publish", "exchange", "fsync_dir", "renameat2"]

_AT_FDCWD = -100
#: ``renameat2`` flags: fail if the destination exists; swap the two paths
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_libc: ctypes.CDLL | None | bool = None


def renameat2(src: str | os.PathLike[str], dst: str | os.PathLike[str], flags: int) -> bool:
    """``renameat2(src, dst, flags)``: True when done, False when this system or filesystem
    cannot (the caller falls back); any other failure is an ``OSError``."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    fn = getattr(_libc, "renameat2", None) if _libc else None
    if fn is None:
        return False
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def exchange(new: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """The folder ``new`` put at ``dest`` in place of the folder there, which is returned under
    a temporary sibling's name for the caller to remove. One step where ``renameat2`` swaps
    (Linux): ``dest`` is the old folder or the new one at every instant. Elsewhere two renames,
    the old folder parked at ``.old-<name>-<random>`` beside it between them (a kill there
    leaves it in that folder, whole)."""
    new, dest = Path(new), Path(dest)
    if renameat2(new, dest, RENAME_EXCHANGE):
        return new
    old = Path(tempfile.mkdtemp(prefix=f".old-{dest.name[:16]}-", dir=dest.parent))
    os.replace(dest, old)  # onto the empty folder just made
    try:
        os.replace(new, dest)
    except OSError:
        os.replace(old, dest)
        raise
    return old


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
        replace: bool = False,
    ) -> None:
        self.dest, self.folder, self.keep_existing = Path(dest), folder, keep_existing
        self.replace = replace and folder
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
            if self.replace and self.dest.is_dir() and not self.dest.is_symlink():
                old = exchange(self.tmp, self.dest)
                fsync_dir(self.dest.parent)
                shutil.rmtree(old, ignore_errors=True)
                return True
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
