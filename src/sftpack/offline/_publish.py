"""Crash safety: a prepack appears at its path complete, or not at all.

Everything is written into a hidden sibling ``.<name>.sftpack-partial-<pid>-<nonce>``
on the same filesystem; the manifest is written last (after every data file is
fsynced), then the folder is renamed into place and the parent directory
fsynced. A run killed at any moment (``kill -9``, power loss) leaves at most a
partial folder, which never opens: it has no manifest until its last step, and
:func:`~sftpack.offline._format.read_manifest` refuses any folder whose name
marks it partial. The next run for the same output removes partial folders
whose process is gone. ``overwrite=True`` replaces an existing prepack (only a
prepack or an empty folder: any other directory is refused, never deleted).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from ._format import MANIFEST, PrepackError

__all__ = ["partial_dir", "publish", "writing"]

_PARTIAL = ".sftpack-partial-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _stale_partials(out: Path) -> Iterator[Path]:
    for p in out.parent.glob(f".{out.name}{_PARTIAL}*"):
        pid_text = p.name.rsplit(_PARTIAL, 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not _alive(int(pid_text)) and p.is_dir():
            yield p


def partial_dir(out: Path) -> Path:
    """A fresh temporary sibling of ``out`` for this process."""
    return out.parent / f".{out.name}{_PARTIAL}{os.getpid()}-{secrets.token_hex(4)}"


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite`` (and then only a prepack or an empty folder)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise PrepackError(f"{out} exists and is a file: choose another --out")
    is_prepack = (out / MANIFEST).is_file()
    empty = not any(out.iterdir())
    if not overwrite:
        if empty:
            return
        raise PrepackError(
            f"{out} already exists{' (a prepack)' if is_prepack else ''}: pass --overwrite "
            "(overwrite=True) to replace it, or choose another --out"
        )
    if not (is_prepack or empty):
        raise PrepackError(
            f"{out} exists and is not a prepack (no {MANIFEST}); --overwrite only replaces prepacks: "
            "choose another --out or remove it yourself"
        )


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out`` (replacing an old prepack or empty folder there)."""
    _fsync_dir(tmp)
    if out.exists():
        old = out.parent / f".{out.name}.sftpack-old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    _fsync_dir(out.parent)


@contextlib.contextmanager
def writing(out: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary folder to write a prepack into; removed if the body raises.

    The caller calls :func:`publish` as its last step.
    """
    out = Path(out)
    check_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in _stale_partials(out):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = partial_dir(out)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
