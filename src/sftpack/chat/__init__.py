"""Conversations to tokens: read chat files, render them with a chat template, mask the loss.

``__all__`` is the everyday face (reading, tokenizing, their stats, options and
errors). The building blocks stay importable from here but out of ``__all__``:
``ConversationReader``, ``TokenizedConversations``, ``Encoded``, ``FileProblem``,
``ChatRenderer`` / ``renderer_for`` / ``chat_template_of``, ``mask_from_offsets``, ``validate_messages``,
``RowFormat``, ``FormattedMessages``, ``PreferencePair``, ``detect_format``,
``ROLES`` / ``SHAREGPT_ROLES``, ``FileSkipReason``, ``Outcome``,
``SpecialTokensInContent``.

The seams the other packages build on, importable from here too (never from the
private modules: a contract in ``pyproject.toml``) and out of ``__all__``:

* the input options every command shares: ``InputOptions``, ``DEFAULT_MAX_SEQ_LEN``,
  ``DEFAULT_ON_BAD_ROW`` and the help texts ``ON_BAD_ROW_HELP``, ``NO_PROGRESS_HELP``,
  ``OVERLONG_HELP``;
* the row checks the media tokenizer shares: ``RowProblem``, ``checked_tool_calls``,
  ``checked_tools``, ``is_url``;
* the tokenizing steps it shares: ``fast_backend``, ``render_spans``, ``encode_pieces``,
  ``as_item`` (one input as ``(id, payload, checked)``), ``warm_tokenizer``;
* the training cache and the tokenizing job of ``sftpack train``: ``start_training_samples``,
  ``ConversationSamples``, ``conversation_order``, ``Pending``, ``default_cache_dir``,
  ``DEFAULT_MAX_SIZE``, ``parse_size``, ``source_identity``, ``tokenizer_info``,
  ``default_tokenizer_files``.

The over-long policy (``Overlong``,
``OverlongError``) lives in :mod:`sftpack.sample`, shared by every layer, and is
reachable here too (aliases listed in ``sftpack._ALIASES``).

Private modules, one concept each:

* ``_options``: the choices (``StrEnum``), validated up front.
* ``_rows``: a row's schema (OpenAI ``messages``, ShareGPT ``conversations``,
  Alpaca, TRL prompt/completion, TRL preference pairs or plain ``text``, detected from its fields as a
  :class:`RowFormat`) and its checks; ``_parts``: a content's list of text / image /
  video parts, their sources resolved against the data folder; ``_bad_row``:
  :class:`BadRowError` and ``RowProblem``, what a failed check raises.
* ``_read``: :func:`read_conversations` streams JSONL / Parquet / Hugging
  Face datasets (folders searched recursively) with bounded memory; every bad row
  is either an exception naming file, line and fix, or a count under its reason
  (``stats.read == stats.kept + sum(stats.dropped.values())``), and every file
  not read (other kinds, damaged, not JSON Lines) is an error or a count in
  ``stats.files_skipped``. A file holding one JSON array of rows is read too
  (``_json_array``).
* ``_render``: the chat template's text and its trainable characters, with
  or without ``{% generation %}`` markers (one render per conversation on the
  fast path, the prefix-diff reference otherwise).
* ``_tokenize``: :func:`tokenize_conversation` / :func:`encode_conversation`:
  the same row checks, tokens, ``loss_mask`` (special-token text in contents
  stays text), the over-long policy and the labels it loses.
* ``_batch``: :func:`tokenize_conversations`: the same in batches,
  optionally in worker processes, in a deterministic order, with stats.

``sftpack train``'s disk cache of tokenized samples, one concept per module too:

* ``_cache_key``: what names an entry (tokenizer, options, input, code, format).
* ``_cache_entry``: one entry on disk: layout, atomic write, checked read,
  least-recently-used eviction, the cache's root and size limit.
* ``_producer``: the forked tokenizer process and its pipe protocol.
* ``_training_samples``: :func:`~._training_samples.start_training_samples` and the
  job it starts, samples handed over conversation by conversation, the background thread.

:class:`Conversation` lives in :mod:`sftpack.sample` (below both this package and
:mod:`sftpack.data`, which makes the embedded corpus of them); it is public here.

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

from ..data import CacheWarning
from ..sample import Conversation  # its home is sftpack.sample, below sftpack.data; public here
from ..sample import Overlong as Overlong  # aliases of sftpack.sample's (sftpack._ALIASES)
from ..sample import OverlongError as OverlongError
from ._bad_row import BadRowError
from ._bad_row import RowProblem as RowProblem
from ._batch import TokenizedConversations as TokenizedConversations
from ._batch import TokenizeStats, tokenize_conversations
from ._cache_entry import DEFAULT_MAX_SIZE as DEFAULT_MAX_SIZE
from ._cache_entry import default_cache_dir as default_cache_dir
from ._cache_entry import parse_size as parse_size
from ._cache_key import default_tokenizer_files as default_tokenizer_files
from ._cache_key import source_identity as source_identity
from ._cache_key import tokenizer_info as tokenizer_info
from ._find import FileProblem as FileProblem
from ._options import DEFAULT_MAX_SEQ_LEN as DEFAULT_MAX_SEQ_LEN
from ._options import DEFAULT_ON_BAD_ROW as DEFAULT_ON_BAD_ROW
from ._options import NO_PROGRESS_HELP as NO_PROGRESS_HELP
from ._options import ON_BAD_ROW_HELP as ON_BAD_ROW_HELP
from ._options import OVERLONG_HELP as OVERLONG_HELP
from ._options import BadRowReason, OnBadRow, TrainOn
from ._options import FileSkipReason as FileSkipReason
from ._options import InputOptions as InputOptions
from ._options import Outcome as Outcome
from ._options import RowFormat as RowFormat
from ._options import SpecialTokensInContent as SpecialTokensInContent
from ._parts import is_url as is_url
from ._read import ConversationReader as ConversationReader
from ._read import read_conversations
from ._read_stats import BadFileError, ReadStats
from ._render import ChatRenderer as ChatRenderer
from ._render import TemplateError
from ._render import chat_template_of as chat_template_of
from ._render import renderer_for as renderer_for
from ._rows import ROLES as ROLES
from ._rows import SHAREGPT_ROLES as SHAREGPT_ROLES
from ._rows import FormattedMessages as FormattedMessages
from ._rows import PreferencePair as PreferencePair
from ._rows import checked_tool_calls as checked_tool_calls
from ._rows import checked_tools as checked_tools
from ._rows import detect_format as detect_format
from ._rows import validate_messages as validate_messages
from ._tokenize import ConversationTemplateError, encode_conversation, tokenize_conversation, tokenize_pair
from ._tokenize import Encoded as Encoded
from ._tokenize import as_item as as_item
from ._tokenize import encode_pieces as encode_pieces
from ._tokenize import fast_backend as fast_backend
from ._tokenize import mask_from_offsets as mask_from_offsets
from ._tokenize import render_spans as render_spans
from ._tokenize import warm_tokenizer as warm_tokenizer
from ._training_samples import ConversationSamples as ConversationSamples
from ._training_samples import Pending as Pending
from ._training_samples import conversation_order as conversation_order
from ._training_samples import start_training_samples as start_training_samples

__all__ = [
    "BadFileError",
    "BadRowError",
    "BadRowReason",
    "CacheWarning",
    "Conversation",
    "ConversationTemplateError",
    "OnBadRow",
    "ReadStats",
    "TemplateError",
    "TokenizeStats",
    "TrainOn",
    "encode_conversation",
    "read_conversations",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenize_pair",
]
