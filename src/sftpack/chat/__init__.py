"""Conversations to tokens: read chat files, render them with a chat template, mask the loss.

The public face of private modules, one concept each:

* ``_options``: the choices (``StrEnum``), validated up front.
* ``_rows``: a row's schema (OpenAI ``messages`` or ShareGPT
  ``conversations``) and its checks; :class:`BadRowError`.
* ``_read``: :func:`read_conversations` streams JSONL / Parquet / Hugging
  Face datasets (folders searched recursively) with bounded memory; every bad row
  is either an exception naming file, line and fix, or a count under its reason
  (``stats.read == stats.kept + sum(stats.dropped.values())``), and every file
  not read (other kinds, damaged, not JSON Lines) is an error or a count in
  ``stats.files_skipped``.
* ``_render``: the chat template's text and its trainable characters, with
  or without ``{% generation %}`` markers (one render per conversation on the
  fast path, the prefix-diff reference otherwise).
* ``_tokenize``: :func:`tokenize_conversation` / :func:`encode_conversation`:
  the same row checks, tokens, ``loss_mask`` (special-token text in contents
  stays text), the over-long policy and the labels it loses.
* ``_batch``: :func:`tokenize_conversations`: the same in batches,
  optionally in worker processes, in a deterministic order, with stats.

What is trained on (``train_on="all_assistant"``), in ChatML::

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    ..................................................Hello!<|im_end|>..   <- loss_mask True

the assistant's content and its end-of-turn token; not the role header, not the
system and user turns, not the newline between turns.

>>> from sftpack.testing import tiny_chat_tokenizer
>>> tok = tiny_chat_tokenizer("chatml")
>>> s = tokenize_conversation([{"role": "system", "content": "Be brief."},
...                            {"role": "user", "content": "Hi"},
...                            {"role": "assistant", "content": "Hello!"}], tok)
>>> tok.decode(s.input_ids[s.loss_mask])
'Hello!<|im_end|>'
"""

from __future__ import annotations

from ..sample import Overlong, OverlongError
from ._batch import TokenizedConversations, TokenizeStats, tokenize_conversations
from ._options import (
    BadRowReason,
    FileSkipReason,
    OnBadRow,
    Outcome,
    SpecialTokensInContent,
    TrainOn,
)
from ._read import (
    BadFileError,
    ConversationReader,
    FileProblem,
    ReadStats,
    read_conversations,
)
from ._render import ChatRenderer, TemplateError, renderer_for
from ._rows import ROLES, SHAREGPT_ROLES, BadRowError, Conversation, validate_messages
from ._tokenize import (
    ConversationTemplateError,
    Encoded,
    encode_conversation,
    mask_from_offsets,
    tokenize_conversation,
)

__all__ = [
    "ROLES",
    "SHAREGPT_ROLES",
    "BadFileError",
    "BadRowError",
    "BadRowReason",
    "ChatRenderer",
    "Conversation",
    "ConversationReader",
    "ConversationTemplateError",
    "Encoded",
    "FileProblem",
    "FileSkipReason",
    "OnBadRow",
    "Outcome",
    "Overlong",
    "OverlongError",
    "ReadStats",
    "SpecialTokensInContent",
    "TemplateError",
    "TokenizeStats",
    "TokenizedConversations",
    "TrainOn",
    "encode_conversation",
    "mask_from_offsets",
    "read_conversations",
    "renderer_for",
    "tokenize_conversation",
    "tokenize_conversations",
    "validate_messages",
]
