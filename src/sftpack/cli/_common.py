"""Shared by the commands: option types that refuse bad values up front, the
usage error, and the tokenizer loader."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["UsageError", "load_tokenizer", "positive", "non_negative"]


class UsageError(ValueError):
    """Options that cannot work (exit status 2)."""


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def load_tokenizer(path: str | None) -> Any:
    """The tokenizer in a local folder, or the embedded Qwen one."""
    from ..data import default_tokenizer

    if path is None:
        return default_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(
            f"cannot load a tokenizer from {path!r} ({' '.join(str(e).split())[:200]}); give a local folder written "
            "by tokenizer.save_pretrained(), or leave --tokenizer out for the embedded Qwen tokenizer"
        ) from None
