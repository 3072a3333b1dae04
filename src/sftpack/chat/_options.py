"""The choices of :mod:`sftpack.chat`, as string enums, and their up-front validation.

Every option that takes one of a few values is a ``StrEnum`` here, one line per
member, so a wrong value fails before any file is opened with a message that
lists the valid values (``train_on='assistant'`` is not valid: choose one of
'all_assistant', 'last_assistant', 'everything'). Plain strings and enum members
are both accepted.
"""

from __future__ import annotations

from .._base import StrEnum as _StrEnum
from .._base import choose

__all__ = ["BadRowReason", "OnBadRow", "Outcome", "Overlong", "TrainOn", "choose"]


class OnBadRow(_StrEnum):
    """What :func:`~sftpack.chat.read_conversations` does with a row it cannot use."""

    ERROR = "error"  #: raise :class:`~sftpack.chat.BadRowError` naming the file, the line and the fix
    SKIP = "skip"  #: leave the row out and count it under its reason in ``stats.dropped``


class BadRowReason(_StrEnum):
    """Why a row was rejected (the keys of ``ReadStats.dropped``)."""

    INVALID_JSON = "invalid_json"  #: the line is not valid JSON (or not UTF-8)
    NOT_AN_OBJECT = "not_an_object"  #: valid JSON, but not an object ``{...}``
    MISSING_MESSAGES = "missing_messages"  #: no ``messages`` (or ShareGPT ``conversations``) field
    EMPTY_MESSAGES = "empty_messages"  #: the message list is empty
    MALFORMED_MESSAGE = "malformed_message"  #: not a list of objects with a role and a content
    UNKNOWN_ROLE = "unknown_role"  #: a role outside system/user/assistant/tool (after ``role_map``)
    NON_STRING_CONTENT = "non_string_content"  #: a content that is null, a list, a number...
    EMPTY_CONTENT = "empty_content"  #: a content that is empty or only whitespace
    NO_ASSISTANT_TURN = "no_assistant_turn"  #: nothing to train on


class TrainOn(_StrEnum):
    """Which tokens are trainable (``loss_mask`` True)."""

    ALL_ASSISTANT = "all_assistant"  #: every assistant turn: its content and its end-of-turn token
    LAST_ASSISTANT = "last_assistant"  #: only the final assistant turn
    EVERYTHING = "everything"  #: every token, template and prompts included (continued pre-training)


class Overlong(_StrEnum):
    """What happens to a conversation longer than ``max_seq_len`` tokens."""

    TRUNCATE = "truncate"  #: keep the first ``max_seq_len`` tokens; the tail is lost (counted)
    DROP = "drop"  #: leave the conversation out (counted, with its tokens)
    SPLIT = "split"  #: cut into pieces of at most ``max_seq_len`` tokens, each its own sample
    ERROR = "error"  #: raise :class:`~sftpack.chat.OverlongError` naming the conversation


class Outcome(_StrEnum):
    """What the over-long policy did to one conversation."""

    FIT = "fit"  #: at most ``max_seq_len`` tokens (or no limit): kept whole
    TRUNCATED = "truncated"
    DROPPED = "dropped"
    SPLIT = "split"
