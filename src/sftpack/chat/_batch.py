"""Many conversations to samples: batches, worker processes, progress, and the accounting.

:func:`tokenize_conversations` cuts its input into batches of ``batch_size``
(one render per conversation, one ``encode_batch`` call per batch, masks from
the encodings' offsets). In one process, a helper thread encodes batch ``k``
while the main thread renders batch ``k + 1`` and masks batch ``k``.
``num_proc > 1`` fans batches out to worker processes with a bounded number in
flight (``2 x num_proc``, so memory stays bounded for any input length) and
yields results in input order, so the output is the same for any ``num_proc``.
Workers are forked on Linux (the tokenizer is inherited, not pickled, which
saves rebuilding it in every worker), spawned elsewhere, and run the Rust
tokenizer single-threaded, as the processes already fill the cores.

:class:`TokenizeStats` counts every outcome (fit, truncated, dropped, split,
skipped by reason) and every lost token and supervised label, so
``conversations == fit + truncated + dropped + split + sum(skipped.values())`` and
``label_tokens + labels_lost == labels``, where ``label_tokens`` is exactly what
the packed rows train on. A bad conversation is decided inside its batch (in the
worker), and raised, under ``on_bad_row="error"``, only here in the caller's
process, so the error names it whatever ``num_proc`` is.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import Any

from .._base import pool_results, positive_int
from .._progress import Bar
from .._types import Tokenizer
from ..sample import DEFAULT_OVERLONG, Overlong, Sample
from ._options import OnBadRow, Outcome, SpecialTokensInContent, TrainOn
from ._tokenize import (
    Encoded,
    Item,
    _encode_many,
    _encode_stream,
    _Options,
    _options,
    _raise_for,
    as_item,
    fast_backend,
)

__all__ = ["TokenizeStats", "TokenizedConversations", "tokenize_conversations"]

logger = logging.getLogger("sftpack.chat")


@dataclass
class TokenizeStats:
    """What tokenizing did, every conversation and every supervised label accounted for.

    Identities (each checked by the tests):

    * ``conversations == fit + truncated + dropped + split + sum(skipped.values())``;
    * ``tokens + tokens_lost`` equals the tokens of all tokenized (not skipped) conversations;
    * ``label_tokens + labels_lost == labels``; ``label_tokens`` equals the
      supervised labels of the rows built from the samples (the sum of
      ``PackedBatch.num_label_tokens`` over rows of ``build_row`` / ``from_samples``).

    Attributes:
        conversations: conversations in (a preference pair is one).
        samples: samples out (each piece of a split conversation counts, and each member of a pair).
        fit / truncated / dropped / split: conversations per over-long outcome.
        skipped: reason (a :class:`BadRowReason` value) -> conversations left out
            under ``on_bad_row="skip"``: the row checks, ``template_error``,
            ``no_trainable_tokens``, ``invalid_text``.
        tokens / trainable_tokens: tokens (and ``loss_mask`` True ones) in the samples out.
        tokens_lost / trainable_tokens_lost: tokens removed by truncate and drop.
        no_trainable: samples out with no trainable token (e.g. a split piece of prompt only).
        labels: supervised labels of the tokenized conversations (``loss_mask[1:]``
            of each whole rendering: a sequence's first token is never a target).
        label_tokens: supervised labels the samples out give (``loss_mask[1:]`` of each).
        labels_lost: labels no sample gives: the tail cut by truncate, all of a
            dropped conversation, and one per split boundary whose first token is trainable.
        split_labels_lost: the part of ``labels_lost`` lost at split boundaries.
        special_text: special-token strings found in what the template writes (contents, tool
            calls, tools schemas, other message keys; kept as text
            unless ``special_tokens_in_content="control"``).
    """

    conversations: int = 0
    samples: int = 0
    fit: int = 0
    truncated: int = 0
    dropped: int = 0
    split: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    tokens_lost: int = 0
    trainable_tokens_lost: int = 0
    no_trainable: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    labels: int = 0
    label_tokens: int = 0
    labels_lost: int = 0
    split_labels_lost: int = 0
    special_text: int = 0

    def add(self, enc: Encoded) -> None:
        self.conversations += 1
        self.special_text += enc.special_text
        if enc.skip is not None:
            key = enc.skip[0].value
            self.skipped[key] = self.skipped.get(key, 0) + 1
            return
        setattr(self, enc.outcome.value, getattr(self, enc.outcome.value) + 1)
        self.samples += len(enc.samples)
        for s in enc.samples:
            n_train = s.num_trainable
            self.tokens += len(s)
            self.trainable_tokens += n_train
            self.no_trainable += n_train == 0
            self.label_tokens += int(s.loss_mask[1:].sum())
        self.tokens_lost += enc.tokens_lost
        self.trainable_tokens_lost += enc.trainable_lost
        self.labels += enc.labels
        self.labels_lost += enc.labels_lost
        if enc.outcome is Outcome.SPLIT:
            self.split_labels_lost += enc.labels_lost

    @property
    def num_skipped(self) -> int:
        """``sum(skipped.values())``."""
        return sum(self.skipped.values())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __getitem__(self, key: str) -> Any:
        if key == "skipped":
            return self.skipped
        if key in self.__dataclass_fields__:
            return int(getattr(self, key))
        raise KeyError(key)

    def _reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, {} if name == "skipped" else 0)


# ---------------------------------------------------------------------------- batches

_WORKER: tuple[Any, _Options] | None = None


def _init_worker(tokenizer: Tokenizer, opts: _Options) -> None:
    global _WORKER
    _WORKER = (tokenizer, opts)


def _work(items: list[Item]) -> list[Encoded]:
    assert _WORKER is not None, "worker not initialised"
    return _encode_many(items, *_WORKER)


def _batches(conversations: Iterable[Any], size: int) -> Iterator[list[Item]]:
    it = enumerate(conversations)
    while True:
        chunk = list(islice(it, size))
        if not chunk:
            return
        yield [as_item(obj, i) for i, obj in chunk]


@dataclass(eq=False, repr=False)
class TokenizedConversations:
    """Iterable of :class:`~sftpack.Sample` in input order, with :attr:`stats` (:class:`TokenizeStats`).

    Lazy: a batch is tokenized when iteration reaches it. Each ``iter()`` is a
    fresh pass over ``conversations`` and resets ``stats`` in place.
    """

    conversations: Iterable[Any]
    tokenizer: Tokenizer
    opts: _Options
    batch_size: int
    num_proc: int
    progress: bool | None = False
    stats: TokenizeStats = field(default_factory=TokenizeStats, init=False)

    def __repr__(self) -> str:
        return f"TokenizedConversations(num_proc={self.num_proc}, stats={self.stats})"

    def __iter__(self) -> Iterator[Sample]:
        self.stats._reset()
        show = sys.stderr.isatty() if self.progress is None else bool(self.progress)
        error_mode = self.opts.on_bad_row is OnBadRow.ERROR
        total = len(self.conversations) if hasattr(self.conversations, "__len__") else None  # type: ignore[arg-type]
        bar = Bar(total=total, unit="conv", desc="tokenize", disable=not show, delay=1.0, dynamic_ncols=True)
        try:
            for results in self._results():
                for enc in results:
                    self.stats.add(enc)
                    if enc.skip is not None and error_mode:
                        _raise_for(enc)
                    yield from enc.samples
                bar.update(len(results))
        finally:
            bar.close()
        # the counts are returned in ``stats`` (the CLI prints them in its summary): a
        # library call says nothing on stderr; these lines are for debugging only
        s = self.stats
        if s.skipped:
            reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(s.skipped.items()))
            logger.debug("skipped %d conversations (%s)", s.num_skipped, reasons)
        if s.truncated or s.dropped:
            logger.debug(
                "over max_seq_len=%s: %d conversations truncated, %d dropped, %d tokens lost (%d trainable)",
                self.opts.max_seq_len,
                s.truncated,
                s.dropped,
                s.tokens_lost,
                s.trainable_tokens_lost,
            )

    def _results(self) -> Iterator[list[Encoded]]:
        batches = _batches(self.conversations, self.batch_size)
        if self.num_proc == 1:
            yield from _encode_stream(batches, self.tokenizer, self.opts)
            return
        # fork on Linux: workers inherit the tokenizer instead of unpickling it (seconds for
        # a large vocabulary); elsewhere fork is unsafe or missing, so spawn.
        yield from pool_results(
            _work, batches, self.num_proc, initializer=_init_worker, initargs=(self.tokenizer, self.opts)
        )

    def to_list(self) -> list[Sample]:
        """All samples in a list (one full pass)."""
        return list(self)


def tokenize_conversations(
    conversations: Iterable[Any],
    tokenizer: Tokenizer,
    *,
    train_on: str | TrainOn = "all_assistant",
    max_seq_len: int | None = None,
    overlong: str | Overlong = DEFAULT_OVERLONG,
    batch_size: int = 256,
    num_proc: int = 1,
    progress: bool | None = False,
    on_bad_row: str | OnBadRow = "error",
    special_tokens_in_content: str | SpecialTokensInContent = "text",
) -> TokenizedConversations:
    """Tokenize many conversations in batches through the fast tokenizer.

    Args:
        conversations: an iterable of message lists, dicts with ``messages``
            (and optionally ``id``), or :class:`Conversation` (e.g. a
            :func:`read_conversations` reader). Ids default to the position.
        tokenizer, train_on, max_seq_len: as :func:`tokenize_conversation`.
        overlong: ``"split"`` (the default: pieces of at most ``max_seq_len``, nothing
            lost), ``"truncate"``, ``"drop"`` or ``"error"`` (:class:`~sftpack.sample.Overlong`).
        batch_size: conversations rendered and encoded per call.
        num_proc: worker processes; the output order and content do not depend on it.
        progress: show a tqdm bar (off by default; the CLI turns it on; ``None``:
            when stderr is a terminal; shown after 1 s).
        on_bad_row: what happens to a conversation that fails the row checks (for
            inputs that did not come from :func:`read_conversations`), that the
            chat template refuses or cannot render (``raise_exception``, a field it
            cannot handle), or whose rendering holds no trainable token:
            ``"error"`` raises :class:`BadRowError` (:class:`ConversationTemplateError`
            for the template) naming the conversation id and the fix; ``"skip"``
            leaves it out and counts it in ``stats.skipped[reason]``. The same
            word as the reader's, so one ``--on-bad-row`` flag drives both.
        special_tokens_in_content: ``"text"`` (default): special-token strings
            inside a content (``"<|im_end|>"``), or any other string the template writes
            (tool calls, tools schemas, a message's ``name``...), are tokenized as the plain
            text they are, never as control tokens, and counted in ``stats.special_text``;
            ``"control"``: they become the control tokens (Hugging Face's behaviour,
            for data that relies on it).

    Returns:
        :class:`TokenizedConversations`, a lazy iterable of samples with ``.stats``.

    >>> from sftpack.testing import tiny_chat_tokenizer
    >>> convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo " * n}]
    ...          for n in (1, 20)]
    >>> out = tokenize_conversations(convs, tiny_chat_tokenizer(), max_seq_len=32, overlong="split")
    >>> [len(s) for s in out], out.stats.split, out.stats.tokens_lost, out.stats.split_labels_lost
    ([20, 32, 7], 1, 0, 1)
    """
    opts = _options(train_on, max_seq_len, overlong, on_bad_row, special_tokens_in_content)
    batch_size = positive_int("batch_size", batch_size)
    num_proc = positive_int("num_proc", num_proc)
    fast_backend(tokenizer)  # fails now, not mid-stream, if it is not a fast tokenizer; a missing chat
    # template fails at the first row that needs one (plain-text rows need none)
    return TokenizedConversations(conversations, tokenizer, opts, batch_size, num_proc, progress)
