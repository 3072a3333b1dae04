"""Many conversations to samples: batches, worker processes, progress, and the accounting.

:func:`tokenize_conversations` cuts its input into batches of ``batch_size``
(one render per conversation, one ``encode_batch`` call per batch, masks from
the encodings' offsets). In one process, a helper thread encodes batch ``k``
while the main thread renders batch ``k + 1`` and masks batch ``k``.
``num_proc > 1`` fans batches out to worker processes with a bounded number in
flight (``2 x num_proc``, so memory stays bounded for any input length) and
yields results in input order, so the output is the same for any ``num_proc``.
Workers are forked on Linux (the tokenizer is inherited, not pickled: about
2 s saved per worker for the default one), spawned elsewhere, and run the Rust
tokenizer single-threaded, as the processes already fill the cores.

:class:`TokenizeStats` counts every outcome (fit, truncated, dropped, split) and
every lost token, so ``conversations == fit + truncated + dropped + split``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

from ._options import Overlong, TrainOn
from ._render import renderer_for
from ._tokenize import Encoded, _as_item, _backend, _encode_many, _encode_stream, _Options, _options
from ..handoff.sample import Sample

__all__ = ["TokenizeStats", "TokenizedConversations", "tokenize_conversations"]

logger = logging.getLogger("sftpack.chat")


@dataclass
class TokenizeStats:
    """What tokenizing did; ``conversations == fit + truncated + dropped + split`` and
    ``tokens + tokens_lost`` equals the tokens of all rendered conversations.

    Attributes:
        conversations: conversations in.
        samples: samples out (each piece of a split conversation counts).
        fit / truncated / dropped / split: conversations per over-long outcome.
        tokens / trainable_tokens: tokens (and trainable ones) in the samples out.
        tokens_lost / trainable_tokens_lost: tokens removed by truncate and drop.
        no_trainable: samples out with no trainable token (e.g. a split piece of prompt only).
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

    def add(self, enc: Encoded) -> None:
        self.conversations += 1
        setattr(self, enc.outcome.value, getattr(self, enc.outcome.value) + 1)
        self.samples += len(enc.samples)
        for s in enc.samples:
            n_train = s.num_trainable
            self.tokens += len(s)
            self.trainable_tokens += n_train
            self.no_trainable += n_train == 0
        self.tokens_lost += enc.tokens_lost
        self.trainable_tokens_lost += enc.trainable_lost

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __getitem__(self, key: str) -> int:
        if key in self.__dataclass_fields__:
            return int(getattr(self, key))
        raise KeyError(key)

    def _reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


# ---------------------------------------------------------------------------- batches

_WORKER: tuple[Any, _Options] | None = None


def _init_worker(tokenizer: Any, opts: _Options) -> None:
    global _WORKER
    _WORKER = (tokenizer, opts)


def _work(items: list[tuple[Any, Sequence[Mapping[str, Any]]]]) -> list[Encoded]:
    assert _WORKER is not None, "worker not initialised"
    return _encode_many(items, *_WORKER)


def _batches(conversations: Iterable[Any], size: int) -> Iterator[list[tuple[Any, Sequence[Mapping[str, Any]]]]]:
    it = enumerate(conversations)
    while True:
        chunk = list(islice(it, size))
        if not chunk:
            return
        yield [_as_item(obj, i) for i, obj in chunk]


class TokenizedConversations:
    """Iterable of :class:`~sftpack.Sample` in input order, with :attr:`stats` (:class:`TokenizeStats`).

    Lazy: a batch is tokenized when iteration reaches it. Each ``iter()`` is a
    fresh pass over ``conversations`` and resets ``stats`` in place.
    """

    def __init__(
        self,
        conversations: Iterable[Any],
        tokenizer: Any,
        opts: _Options,
        batch_size: int,
        num_proc: int,
        progress: bool | None,
    ):
        self.conversations = conversations
        self.tokenizer = tokenizer
        self.opts = opts
        self.batch_size = batch_size
        self.num_proc = num_proc
        self.progress = progress
        self.stats = TokenizeStats()

    def __repr__(self) -> str:
        return f"TokenizedConversations(num_proc={self.num_proc}, stats={self.stats})"

    def __iter__(self) -> Iterator[Sample]:
        self.stats._reset()
        from tqdm.auto import tqdm

        show = sys.stderr.isatty() if self.progress is None else bool(self.progress)
        total = len(self.conversations) if hasattr(self.conversations, "__len__") else None  # type: ignore[arg-type]
        bar = tqdm(total=total, unit="conv", desc="tokenize", disable=not show, delay=1.0, dynamic_ncols=True)
        try:
            for results in self._results():
                for enc in results:
                    self.stats.add(enc)
                    yield from enc.samples
                bar.update(len(results))
        finally:
            bar.close()
        s = self.stats
        if s.truncated or s.dropped:
            logger.warning(
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
        ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        # Each worker runs the tokenizer single-threaded; setting this before the fork also
        # keeps tokenizers from warning that it disables its thread pool in the children.
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            pool = ctx.Pool(self.num_proc, initializer=_init_worker, initargs=(self.tokenizer, self.opts))
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        try:
            pending: deque[Any] = deque()
            for items in batches:
                pending.append(pool.apply_async(_work, (items,)))
                if len(pending) >= 2 * self.num_proc:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
        finally:
            pool.terminate()
            pool.join()

    def to_list(self) -> list[Sample]:
        """All samples in a list (one full pass)."""
        return list(self)


def tokenize_conversations(
    conversations: Iterable[Any],
    tokenizer: Any,
    *,
    train_on: str | TrainOn = "all_assistant",
    max_seq_len: int | None = None,
    overlong: str | Overlong = "truncate",
    batch_size: int = 256,
    num_proc: int = 1,
    progress: bool | None = None,
) -> TokenizedConversations:
    """Tokenize many conversations in batches through the fast tokenizer.

    Args:
        conversations: an iterable of message lists, dicts with ``messages``
            (and optionally ``id``), or :class:`Conversation` (e.g. a
            :func:`read_conversations` reader). Ids default to the position.
        tokenizer, train_on, max_seq_len: as :func:`tokenize_conversation`.
        overlong: ``"truncate"``, ``"drop"``, ``"split"`` or ``"error"``.
        batch_size: conversations rendered and encoded per call.
        num_proc: worker processes; the output order and content do not depend on it.
        progress: show a tqdm bar (``None``: when stderr is a terminal; shown after 1 s).

    Returns:
        :class:`TokenizedConversations`, a lazy iterable of samples with ``.stats``.

    >>> from sftpack.testing import tiny_chat_tokenizer
    >>> convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo " * n}]
    ...          for n in (1, 20)]
    >>> out = tokenize_conversations(convs, tiny_chat_tokenizer(), max_seq_len=32, overlong="split")
    >>> [len(s) for s in out], out.stats.split, out.stats.tokens_lost
    ([20, 32, 7], 1, 0)
    """
    opts = _options(train_on, max_seq_len, overlong)
    for name, value in (("batch_size", batch_size), ("num_proc", num_proc)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    _backend(tokenizer)
    renderer_for(tokenizer)  # fails now, not mid-stream, if there is no chat template
    return TokenizedConversations(conversations, tokenizer, opts, batch_size, num_proc, progress)
