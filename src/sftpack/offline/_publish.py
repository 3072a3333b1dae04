"""Crash safety and races: a prepack appears at its path complete, or not at all, and a
run never deletes what it did not create.

Everything is written into a hidden sibling ``.<name>.sftpack-partial-<pid>-<nonce>``
on the same filesystem; the manifest is written last (after every data file is
fsynced), then the folder is published and the parent directory fsynced. A
partial folder never opens: it has no manifest until its last step, and
:func:`~sftpack.offline._format.read_manifest` refuses any folder whose name
marks it partial. The next run for the same output removes partial folders
whose process is gone.

Publishing depends on what was at the output when the run started
(:func:`writing` records it, device and inode):

- nothing: ``renameat2(RENAME_NOREPLACE)``. If anything appeared there meanwhile
  (a folder of the user's, the output of another prepack started at the same
  time) it is left untouched and this run fails with :class:`PrepackError`,
  discarding its own output: of two prepacks with the same ``--out`` one wins.
- an empty folder: a plain ``rename``, which the kernel lets replace an empty
  folder only.
- a prepack, with ``overwrite=True``: ``renameat2(RENAME_EXCHANGE)`` swaps the
  two folders in one step, so at every instant the output is the old prepack or
  the new one. The old one, now in the hidden folder, must be the folder found
  at the start: if another run replaced it meanwhile, the swap is undone and this
  run fails. Then it is removed (a kill before that leaves it in a partial
  folder, which the next run removes).

The partial folder is made and, on failure, removed by
:class:`sftpack._publish.Publish`, sftpack's one atomic-publish helper; the
placing is this module's own (the cases above): that helper's rename replaces an
empty folder at most and keeps or refuses anything else, while a prepack may
replace the very prepack it found at the start, and only that, in one step.

Where ``renameat2`` is missing (not Linux, or a filesystem without it), the
exchange is two renames with the old prepack parked at
``.<name>.sftpack-old-<pid>-<nonce>``, and a kill between them is repaired by the
next run for that output (:func:`recover`: it finishes the swap when the new
folder is complete, else puts the old one back); opening the missing output
meanwhile names the parked folder. ``overwrite`` replaces only a prepack or an
empty folder: any other directory is refused, never deleted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .._publish import RENAME_EXCHANGE as _RENAME_EXCHANGE
from .._publish import RENAME_NOREPLACE as _RENAME_NOREPLACE
from .._publish import Publish, fsync_dir
from .._publish import renameat2 as _renameat2
from ._format import MANIFEST, PrepackError

__all__ = ["Output", "check_target", "partial_dir", "recover", "writing"]

_PARTIAL = ".sftpack-partial-"
_OLD = ".sftpack-old-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _pid_of(p: Path, marker: str) -> int | None:
    text = p.name.rsplit(marker, 1)[1].split("-", 1)[0]
    return int(text) if text.isdigit() else None


def _stale(out: Path, marker: str, pid: int | None = None) -> Iterator[Path]:
    for p in sorted(out.parent.glob(f".{out.name}{marker}{'' if pid is None else f'{pid}-'}*")):
        owner = _pid_of(p, marker)
        if owner is not None and not _alive(owner) and p.is_dir():
            yield p


def partial_dir(out: Path) -> Path:
    """A fresh temporary sibling of ``out`` for this process."""
    return out.parent / f".{out.name}{_PARTIAL}{os.getpid()}-{secrets.token_hex(4)}"


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def check_target(out: Path, overwrite: bool) -> tuple[int, int] | None:
    """Refuse an existing output unless ``overwrite`` (and then only a prepack or an empty folder).

    Returns the identity (device, inode) of the folder found at ``out``, or ``None``.
    """
    if not os.path.lexists(out):
        return None
    if not out.is_dir() or out.is_symlink():
        raise PrepackError(f"{out} exists and is not a folder: choose another --out")
    is_prepack = (out / MANIFEST).is_file()
    empty = not any(out.iterdir())
    if not overwrite:
        if empty:
            return _identity(out)
        raise PrepackError(
            f"{out} already exists{' (a prepack)' if is_prepack else ''}: pass --overwrite "
            "(overwrite=True) to replace it, or choose another --out"
        )
    if not (is_prepack or empty):
        raise PrepackError(
            f"{out} exists and is not a prepack (no {MANIFEST}); --overwrite only replaces prepacks: "
            "choose another --out or remove it yourself"
        )
    return _identity(out)


def recover(out: Path) -> None:
    """Repair what a run killed between the two renames of the fallback exchange left: finish
    the swap if its new folder is complete, else put the old prepack back; then remove the
    parked old folder once the output is in place."""
    for old in _stale(out, _OLD):
        if not os.path.lexists(out):
            pid = _pid_of(old, _OLD)
            done = [p for p in _stale(out, _PARTIAL, pid) if (p / MANIFEST).is_file()]
            os.rename(done[0] if done else old, out)
            fsync_dir(out.parent)
            if not done:
                continue
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class Output:
    """A prepack being written: ``tmp`` (write here), then :meth:`publish` as the last step."""

    out: Path
    tmp: Path
    overwrite: bool
    found: tuple[int, int] | None  #: the folder at ``out`` when the run started (device, inode)
    found_prepack: bool

    def _appeared(self) -> PrepackError:
        return PrepackError(
            f"{self.out} appeared while this run was writing (another prepack with the same --out, or another "
            "process): it was left untouched and this run's output was discarded; choose another --out"
            + (", or pass --overwrite to replace a prepack" if not self.overwrite else "")
        )

    def _replaced(self) -> PrepackError:
        return PrepackError(
            f"{self.out} was replaced while this run was writing (another prepack with the same --out, or another "
            "process): it was left as it is and this run's output was discarded; run again"
        )

    def _place(self) -> None:
        """``tmp`` to ``out`` where nothing (or an empty folder) is: never over anything else."""
        try:
            if self.found is None and _renameat2(self.tmp, self.out, _RENAME_NOREPLACE):
                return
            if self.found is None and os.path.lexists(self.out):
                raise self._appeared()
            os.rename(self.tmp, self.out)  # replaces an empty folder only
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise self._appeared() from None
            raise

    def _exchange(self) -> None:
        """Swap ``tmp`` with the prepack at ``out`` in one step; then remove the old one."""
        try:
            swapped = _renameat2(self.tmp, self.out, _RENAME_EXCHANGE)
        except FileNotFoundError:  # the old prepack was removed meanwhile
            self.found = None
            return self._place()
        if not swapped:
            return self._two_renames()
        if _identity(self.tmp) != self.found:
            _renameat2(self.tmp, self.out, _RENAME_EXCHANGE)  # undo: the newcomer stays, ours is discarded
            raise self._replaced()
        fsync_dir(self.out.parent)
        shutil.rmtree(self.tmp, ignore_errors=True)  # the old prepack (a kill here: the next run removes it)

    def _two_renames(self) -> None:
        old = self.out.parent / f".{self.out.name}{_OLD}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(self.out, old)
        except FileNotFoundError:
            self.found = None
            return self._place()
        if _identity(old) != self.found:
            os.rename(old, self.out)
            raise self._replaced()
        os.rename(self.tmp, self.out)  # a kill between the renames: recover() repairs it
        fsync_dir(self.out.parent)
        shutil.rmtree(old, ignore_errors=True)

    def publish(self) -> None:
        """Move the finished ``tmp`` to ``out`` (see the module docstring for the cases)."""
        fsync_dir(self.tmp)
        if self.found is not None and self.found_prepack:
            self._exchange()
        else:
            self._place()
        fsync_dir(self.out.parent)


@contextlib.contextmanager
def writing(out: Path, overwrite: bool) -> Iterator[Output]:
    """An :class:`Output` whose ``tmp`` folder the body writes a prepack into and then
    publishes; the folder is removed if the body raises."""
    out = Path(out)
    if out.parent.is_dir():
        recover(out)
    found = check_target(out, overwrite)
    found_prepack = found is not None and (out / MANIFEST).is_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in _stale(out, _PARTIAL):
        shutil.rmtree(stale, ignore_errors=True)
    partial = Publish(out, tmp=partial_dir(out))  # made here; placed by Output.publish, removed on failure
    try:
        yield Output(out, partial.tmp, overwrite, found, found_prepack)
    except BaseException:
        partial.discard()
        raise
