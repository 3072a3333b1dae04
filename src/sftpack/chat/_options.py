"""The choices of :mod:`sftpack.chat`, as string enums, and their up-front validation.

Every option that takes one of a few values is a ``StrEnum`` here, one line per
member, so a wrong value fails before any file is opened with a message that
lists the valid values (``train_on='assistant'`` is not valid: choose one of
'all_assistant', 'last_assistant', 'everything'). Plain strings and enum members
are both accepted. The over-long policy, :class:`~sftpack.sample.Overlong`, is
shared by every layer and lives in :mod:`sftpack.sample`.

The defaults every command shares (:data:`DEFAULT_ON_BAD_ROW`, :data:`DEFAULT_MAX_SEQ_LEN`)
and the input flags of the commands that read chat files (:class:`InputOptions`) are
declared here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._base import StrEnum as _StrEnum
from .._base import choose

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "DEFAULT_ON_BAD_ROW",
    "NO_PROGRESS_HELP",
    "ON_BAD_ROW_HELP",
    "OVERLONG_HELP",
    "BadRowReason",
    "FileSkipReason",
    "InputOptions",
    "OnBadRow",
    "Outcome",
    "RowFormat",
    "SpecialTokensInContent",
    "TrainOn",
    "choose",
]


class OnBadRow(_StrEnum):
    """What the reader and the tokenizer do with a row (or a file) they cannot use."""

    ERROR = "error"  #: raise an error naming the file and line (or the conversation id) and the fix
    SKIP = "skip"  #: leave it out and count it under its reason (``stats.dropped`` / ``stats.files_skipped``)


#: What ``sftpack prepack``, ``train``, ``bench`` and ``verify`` (and :class:`~sftpack.offline.PrepackOptions`)
#: do with a row they cannot use when not told: leave it out and count it by reason in the summary they
#: print, so that one bad line in a million does not stop a long run (``--on-bad-row error`` stops at it).
DEFAULT_ON_BAD_ROW = OnBadRow.SKIP
#: The row width, the longest conversation kept whole, of every command and of ``PrepackOptions`` /
#: ``TrainConfig`` when not told: long enough for most SFT chats, the context of common small models.
DEFAULT_MAX_SEQ_LEN = 4096
#: the ``--on-bad-row`` help of every command (``{default}``: filled in by the command's parser)
ON_BAD_ROW_HELP = (
    "a row (or file) that cannot be used: skip it, counted by reason in the summary, or error: stop at the first, "
    "naming its file, line and fix (default {default})"
)

#: the ``--no-progress`` help of ``sftpack prepack`` (:attr:`~sftpack.offline.PrepackOptions.progress`) and
#: ``train`` (whose parser must not load the offline package: it loads torch)
NO_PROGRESS_HELP = "no progress bars"

#: the ``--overlong`` help of ``sftpack prepack``, ``train`` and ``bench``: what the tokenizer's split costs
#: (:attr:`~sftpack.chat.TokenizeStats.split_labels_lost`), and a preference pair's rule
OVERLONG_HELP = (
    "a conversation longer than --max-seq-len (default {default}: every token kept, in pieces; each split point "
    "costs at most one supervised label, the first token of the next piece, counted as split_labels_lost); a "
    "preference pair follows it whole and is never split"
)


@dataclass(frozen=True)
class InputOptions:
    """The input flags of every command that reads chat files (``sftpack prepack``, ``train``,
    ``bench``, ``verify``), declared once (:func:`sftpack.cli._common.add_settings` reads the
    field metadata). In Python they are :func:`~sftpack.chat.read_conversations`' ``on_bad_row``,
    ``split`` and ``allow_outside_images``, and the tokenizer's ``chat_template`` (the file's text)."""

    on_bad_row: OnBadRow = field(default=DEFAULT_ON_BAD_ROW, metadata={"help": ON_BAD_ROW_HELP})
    split: str | None = field(
        default=None,
        metadata={
            "help": "the split to read from a saved Hugging Face DatasetDict (save_to_disk) among the inputs "
            "(default: its only split)",
            "metavar": "NAME",
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "a Jinja chat template file, used instead of the tokenizer's own (needed when the tokenizer "
            "has none; default: the tokenizer's)",
            "metavar": "FILE",
        },
    )
    allow_outside_images: bool = field(
        default=False,
        metadata={
            "help": "read image and video files outside the data folder (absolute paths, ../, symlinks out of it); "
            "by default such a part's conversation is left out, counted as image_outside_data_dir (a dataset "
            "from elsewhere cannot pull other files of this machine into the output)"
        },
    )


class BadRowReason(_StrEnum):
    """Why a row was rejected: the keys of ``ReadStats.dropped`` (reader) and of
    ``TokenizeStats.skipped`` (tokenizer; the row checks run again there on rows
    that did not come from the reader)."""

    INVALID_JSON = "invalid_json"  #: the line is not valid JSON, not UTF-8, or nested too deeply to parse
    NOT_AN_OBJECT = "not_an_object"  #: valid JSON, but not an object ``{...}``
    #: no field of a known format (``messages``, ShareGPT ``conversations``, ``prompt``/``completion``,
    #: ``chosen``/``rejected``, Alpaca ``instruction``/``output``, ``text``)
    MISSING_MESSAGES = "missing_messages"
    MISSING_FIELD = "missing_field"  #: a row of a known format without a field it needs (Alpaca without ``output``)
    MIXED_FORMATS = "mixed_formats"  #: a row of another format than the first row of its file
    EMPTY_MESSAGES = "empty_messages"  #: the message list is empty
    MALFORMED_MESSAGE = "malformed_message"  #: not a list of objects with a role and a content
    UNKNOWN_ROLE = "unknown_role"  #: a role outside system/user/assistant/tool (after ``role_map``)
    #: a content that is null, a number, an object, an empty list (the reader takes a list of content
    #: parts; the text tokenizer only strings), or a text part whose ``text`` is not a string
    NON_STRING_CONTENT = "non_string_content"
    EMPTY_CONTENT = "empty_content"  #: a content that is empty or only whitespace
    INVALID_TEXT = "invalid_text"  #: a content holding a lone surrogate (``"\\ud800"``): no tokenizer encodes it
    NO_ASSISTANT_TURN = "no_assistant_turn"  #: nothing to train on
    #: an image or video path (absolute, ``../``, or a symlink) whose file lies outside the data folder:
    #: not read unless ``allow_outside_images`` (``--allow-outside-images``)
    IMAGE_OUTSIDE_DATA_DIR = "image_outside_data_dir"
    UNREADABLE_TAIL = "unreadable_tail"  #: rows after a file's damaged point (a cut ``.gz``, a bad Parquet page)
    TEMPLATE_ERROR = "template_error"  #: (tokenizer) the chat template refused or failed to render the conversation
    NO_TRAINABLE_TOKENS = "no_trainable_tokens"  #: (tokenizer) the rendering holds no trainable token
    #: a preference pair with an explicit ``prompt`` whose ``chosen`` or ``rejected`` list does not start with
    #: the assistant's answer (it repeats the prompt, or holds another user turn first)
    PROMPT_MISMATCH = "prompt_mismatch"
    #: an implicit-prompt preference pair (no ``prompt``) whose ``chosen`` and ``rejected`` share no leading message
    NO_COMMON_PROMPT = "no_common_prompt"
    IDENTICAL_ANSWERS = "identical_answers"  #: a preference pair whose ``chosen`` and ``rejected`` are the same
    #: a row's ``weight`` / ``advantage`` (or an assistant message's ``weight``) that is not a finite number,
    #: both given, on a turn that is not the assistant's, or on a preference pair
    BAD_WEIGHT = "bad_weight"
    #: a row's ``group`` (the prompt an RL / GRPO completion belongs to) that is not a non-empty string or an
    #: integer, or a ``group`` on a preference pair (a pair is a group of its own)
    BAD_GROUP = "bad_group"


class FileSkipReason(_StrEnum):
    """Why a whole file was not read (the keys of ``ReadStats.files_skipped``)."""

    #: in a folder or a glob, a file whose name is not ``.jsonl`` / ``.json`` / ``.ndjson`` (``.gz``) / ``.parquet``
    UNSUPPORTED_FORMAT = "unsupported_format"
    HIDDEN = "hidden"  #: in a folder, an entry whose name starts with ``.`` (``.git``, ``.DS_Store``): not searched
    UNREADABLE = "unreadable"  #: a container that does not open: not gzip, not Parquet, 0 bytes, no permission
    JSON_DOCUMENT = "json_document"  #: one JSON array/object (pretty-printed or on one line), not JSON Lines
    CR_LINE_ENDINGS = "cr_line_endings"  #: lines end with a bare CR (classic Mac), so the file reads as one line
    UTF16 = "utf16"  #: UTF-16 (or UTF-32) text, not UTF-8
    MALFORMED_JSON = "malformed_json"  #: a JSON array file (``[{...}, ...]``) that does not parse


class RowFormat(_StrEnum):
    """The format of a row, detected from its fields (the keys of ``ReadStats.formats``).

    Looked for in this order, the first present (not null) field deciding: ``messages``,
    ``conversations``, ``prompt`` / ``completion`` (``completion`` given, or neither ``chosen`` nor
    ``rejected``), ``chosen`` / ``rejected`` (a preference pair), ``instruction`` / ``output``, ``text``.
    """

    MESSAGES = "messages"  #: OpenAI-style ``messages``: ``[{"role", "content"}]``, rendered by the chat template
    SHAREGPT = "sharegpt"  #: ShareGPT ``conversations``: ``[{"from", "value"}]``, rendered by the chat template
    #: Alpaca ``instruction``, optional ``input``, ``output``, optional ``system``: a system (when given), a
    #: user turn (the instruction, then a blank line and the input when the input is not empty) and an
    #: assistant turn (the output), rendered by the chat template
    ALPACA = "alpaca"
    #: TRL's standard prompt/completion, both strings: plain text, no chat template; the tokenizer's BOS where
    #: it adds one, the prompt (not trained), the completion and EOS (trained)
    PROMPT_COMPLETION = "prompt_completion"
    #: TRL's conversational prompt/completion, both lists of messages: rendered by the chat template, only the
    #: completion's assistant turns trained
    CONVERSATIONAL_PROMPT_COMPLETION = "conversational_prompt_completion"
    #: TRL's standard preference pair: ``prompt``, ``chosen`` and ``rejected``, all strings: two samples, each
    #: the prompt's tokens (the tokenizer's BOS where it adds one) then the answer's tokens and EOS (trained)
    PREFERENCE = "preference"
    #: TRL's conversational preference pair: ``chosen`` and ``rejected`` lists of messages, after an explicit
    #: ``prompt`` list or (no ``prompt``) both whole conversations whose common leading messages are the prompt:
    #: two samples rendered by the chat template, only the answers' assistant turns trained
    CONVERSATIONAL_PREFERENCE = "conversational_preference"
    #: plain ``text``: no chat template; the tokenizer's BOS where it adds one, the text and EOS, every token trained
    TEXT = "text"


class SpecialTokensInContent(_StrEnum):
    """What special-token text inside a message's content becomes (``"<|im_end|>"`` typed by a user)."""

    TEXT = "text"  #: plain text, tokenized like any other characters: never a control token (default)
    CONTROL = "control"  #: the control token itself, as Hugging Face's ``apply_chat_template`` does


class TrainOn(_StrEnum):
    """Which tokens are trainable (``loss_mask`` True)."""

    ALL_ASSISTANT = "all_assistant"  #: every assistant turn: its content and its end-of-turn token
    LAST_ASSISTANT = "last_assistant"  #: only the final assistant turn
    EVERYTHING = "everything"  #: every token, template and prompts included (continued pre-training)


class Outcome(_StrEnum):
    """What the over-long policy did to one conversation."""

    FIT = "fit"  #: at most ``max_seq_len`` tokens (or no limit): kept whole
    TRUNCATED = "truncated"  #: cut to its first ``max_seq_len`` tokens
    DROPPED = "dropped"  #: longer than ``max_seq_len``: left out
    SPLIT = "split"  #: cut into pieces of at most ``max_seq_len``
    SKIPPED = "skipped"  #: a bad row or a template error under ``on_bad_row='skip'``: no sample
