"""Where the trained model goes (``sftpack train --save-model DIR``): checked before training,
written whole beside it and renamed into place.

:func:`check_model_dir` is what ``sftpack train`` asks before any work (so a bad path costs no
training) and what :func:`~sftpack.loop._export.save_model` asks again before it writes:

- nothing there yet: its nearest existing parent must be a folder this process may write in;
- an empty folder: taken;
- a folder with contents (a model saved before, or anything else): refused, untouched, unless
  ``overwrite`` (``--overwrite-model``), which replaces it whole: nothing of it stays beside
  the new model;
- a file or a symbolic link: refused.

:func:`publish_model_dir` writes the folder under a temporary sibling
(:class:`sftpack._publish.Publish`) and renames it into place, so ``DIR`` is the old folder
or the complete new one, never a new ``config.json`` over old weights: a run killed or
failing while it writes leaves ``DIR`` as it was and removes its temporary.

This module needs the standard library only (``sftpack train`` checks before torch loads).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .._publish import Publish

__all__ = ["check_model_dir", "publish_model_dir"]


def _parent_to_write(out: Path) -> Path:
    """The nearest existing folder above ``out`` (what the new folders are made in)."""
    parent = out.absolute().parent
    while not os.path.lexists(parent):
        parent = parent.parent
    return parent


def check_model_dir(out: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Raise ``ValueError`` (one line naming ``out`` and the fix) unless a model folder can be
    written at ``out`` (see the module text); ``overwrite``: a folder with contents is replaced."""
    out = Path(out)
    fix = "give a new folder's path (or an empty folder)"
    if out.is_symlink():
        raise ValueError(f"{out} is a symbolic link: {fix}, or the linked folder's own path")
    if os.path.lexists(out):
        if not out.is_dir():
            raise ValueError(f"{out} is a file, not a folder: {fix}")
        if not overwrite and any(out.iterdir()):
            what = "a model folder" if (out / "config.json").is_file() else "not a model folder"
            raise ValueError(
                f"{out} is a folder with files in it ({what}): {fix}, or pass --overwrite-model "
                "(overwrite=True) to replace it whole"
            )
        parent = out.absolute().parent
    else:
        parent = _parent_to_write(out)
        if not parent.is_dir():
            raise ValueError(f"{out}: {parent} is a file, not a folder: {fix}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{out}: cannot write in {parent} (permission denied): {fix} where you may write")


def publish_model_dir(out: str | os.PathLike[str], write: Callable[[Path], None], *, overwrite: bool = False) -> Path:
    """``write(tmp)`` fills a temporary sibling of ``out``, which then takes ``out``'s place
    (checked first, :func:`check_model_dir`; with ``overwrite`` a folder there is replaced
    whole). If ``write`` raises, nothing at ``out`` changed and the temporary is gone. Returns ``out``.

    Raises:
        ValueError: ``out`` cannot take the model (:func:`check_model_dir`).
    """
    out = Path(out)
    check_model_dir(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    with Publish(out, replace=overwrite) as tmp:
        write(tmp)
        for f in tmp.rglob("*"):  # the files on disk before the rename makes them the model
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    return out
