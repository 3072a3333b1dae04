"""Types shared across the package that need no torch: what sftpack needs of a tokenizer.

A Hugging Face *fast* tokenizer (``PreTrainedTokenizerFast``, what
``AutoTokenizer.from_pretrained(..., use_fast=True)`` and
:func:`sftpack.data.default_tokenizer` return) has all of it. Functions that take
a tokenizer are annotated with :class:`Tokenizer`; functions that return one
return the full Hugging Face object (typed ``Any``, as ``transformers`` ships no
type information), so callers keep its whole API.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Tokenizer", "TokenizerSpec"]


class Tokenizer(Protocol):
    """What sftpack reads or calls on a tokenizer, and nothing more.

    The optional parts are read with ``getattr(tokenizer, name, None)``, so a
    tokenizer without them gets a clear error naming what is missing (or, for
    ``eos_token_id`` and ``name_or_path``, a default), not an ``AttributeError``.
    """

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` behind a fast tokenizer: its offsets map
        trainable characters to tokens, its serialisation is fingerprinted."""

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The Jinja chat template (or several named ones)."""

    @property
    def special_tokens_map(self) -> Mapping[str, Any]:
        """Special-token names to their strings (``bos_token``, ``eos_token``, ...), passed to the template."""

    @property
    def pad_token_id(self) -> int | None:
        """The id padding slots hold, where the tokenizer has a pad token."""

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id (the padding id where there is no pad token)."""

    @property
    def name_or_path(self) -> str:
        """Where the tokenizer was loaded from (recorded in a prepack's fingerprint)."""

    def __len__(self) -> int:
        """The vocabulary size, added tokens included."""
        ...

    def apply_chat_template(
        self, conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]], **kwargs: Any
    ) -> Any:
        """Render (and by default tokenize) a conversation, or a batch of them, with the chat template."""
        ...


#: A tokenizer as the offline engines take it: the object, the path of a tokenizer
#: folder (loaded where it is needed), or ``None`` for the embedded default.
TokenizerSpec = Tokenizer | str | os.PathLike[str] | None
