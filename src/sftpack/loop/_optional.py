"""The optional dependencies of the training loop and the reports, each imported in one place.

``import sftpack.loop`` needs only the base install (numpy, torch, tqdm) and the
packages of sftpack itself; the model needs ``transformers`` (``pip install
'sftpack[train]'``) and the pictures ``matplotlib`` (``pip install
'sftpack[plot]'``). Each helper imports its dependency when first called; when it
is missing, :class:`MissingDependency` says which extra to install. It is an
``ImportError`` for library callers and a ``RuntimeError`` for the command line,
which prints it as one line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingDependency", "flash_attn_installed", "pyplot", "transformers"]


class MissingDependency(ImportError, RuntimeError):
    """An optional dependency is not installed (the message names the extra that brings it)."""


def _need(module: str, extra: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{what} needs {module.split('.')[0]}: pip install 'sftpack[{extra}]'") from e


def transformers() -> ModuleType:
    """``transformers``, its ``masking_utils`` loaded (the model, its attention, local model folders)."""
    _need("transformers.masking_utils", "train", "the training loop's model")
    return _need("transformers", "train", "the training loop's model")


def pyplot(what: str = "a PNG") -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display); ``what`` names the picture."""
    matplotlib = _need("matplotlib", "plot", what)
    matplotlib.use("Agg")
    return _need("matplotlib.pyplot", "plot", what)


def flash_attn_installed() -> bool:
    """Whether the ``flash-attn`` package can be imported (used on CUDA when present; never required)."""
    try:
        importlib.import_module("flash_attn")
    except ImportError:
        return False
    return True
