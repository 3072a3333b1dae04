"""Tokenizing for training through the cache: :func:`start_training_samples` and the
job it starts (:class:`TokenizeJob`), the samples handed over conversation by
conversation as they come (:class:`ConversationSamples`), and :class:`Pending`,
the background thread the CLI tokenizes in.

A job first looks up its entry (:mod:`._cache_key` names it, :mod:`._cache_entry`
reads and writes it); on a miss it tokenizes here or in a forked producer process
(:mod:`._producer`), in the seeded conversation order training reads them in
(:func:`conversation_order`), so that the first step waits for the first batch's
conversations only, and it writes a new entry, in input order, at the end.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from ..data import default_corpus
from ..sample import DEFAULT_OVERLONG, Conversation, Overlong, Sample
from ._batch import TokenizeStats, tokenize_conversations
from ._cache_entry import DEFAULT_MAX_SIZE, EntryWriter, _cannot_write, read_entry
from ._cache_key import cache_key, source_identity, tokenizer_files_identity, tokenizer_identity, tokenizer_info
from ._options import OnBadRow, choose
from ._producer import _BATCH, _positioned, _Producer, _Run
from ._tokenize import as_item

__all__ = [
    "CachedSamples",
    "ConversationSamples",
    "Pending",
    "TokenizeJob",
    "cached_tokenize",
    "conversation_order",
    "start_training_samples",
]


@dataclass
class CachedSamples:
    """What :func:`cached_tokenize` returns.

    Attributes:
        samples: the samples in input order.
        stats: the tokenizer's :class:`~sftpack.chat.TokenizeStats` (stored with the entry).
        hit: the samples were read from the cache.
        entry: the cache entry's folder (``None``: no cache used).
        positions: each sample's conversation position (its index in the input);
            ``None`` for a one-pass iterator.
        conversations: how many conversations went in (``0``: not known).
        tokenizer: :func:`tokenizer_info` of the tokenizer (stored with the entry).
        read: the reader's :class:`~sftpack.chat.ReadStats` of this pass (rows read, kept,
            dropped by reason), when ``read_stats`` named them; ``None`` on a cache hit.
    """

    samples: list[Sample]
    stats: TokenizeStats
    hit: bool
    entry: Path | None
    positions: np.ndarray | None = None
    conversations: int = 0
    tokenizer: dict[str, int] = field(default_factory=dict)
    read: Any = None


def conversation_order(n: int, *, seed: int, epoch: int) -> np.ndarray:
    """The seeded permutation of ``n`` conversation positions of one epoch: the
    order ``sftpack train`` tokenizes them in (epoch 0) and trains on them.

    >>> conversation_order(5, seed=0, epoch=0).tolist()
    [2, 4, 3, 0, 1]
    """
    return np.random.default_rng([seed, epoch]).permutation(n)


class ConversationSamples:
    """The samples of ``n`` conversations, grouped by conversation position, filled
    in by a :class:`TokenizeJob` as they are tokenized (or all at once from the
    cache). :meth:`group` waits for one conversation's samples (none for a
    conversation that was skipped or dropped, several for one that was split), so
    training can start with the first batch's conversations while the rest are
    still being tokenized; :meth:`wait` waits for all of them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._groups: list[list[Sample] | None] = [None] * n
        self._cond = threading.Condition()
        self._result: CachedSamples | None = None
        self._error: BaseException | None = None

    @classmethod
    def complete(cls, got: CachedSamples) -> ConversationSamples:
        """All groups of ``got`` (samples in input order with their positions)."""
        assert got.positions is not None
        out = cls(got.conversations)
        groups: list[list[Sample]] = [[] for _ in range(out.n)]
        for pos, s in zip(got.positions.tolist(), got.samples):
            groups[pos].append(s)
        out._groups = list(groups)
        out._result = got
        return out

    def _put(self, pos: int, samples: list[Sample]) -> None:
        with self._cond:
            self._groups[pos] = samples
            self._cond.notify_all()

    def _finish(self, result: CachedSamples) -> None:
        with self._cond:
            self._result = result
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """Every conversation has been tokenized (or read)."""
        return self._result is not None

    def group(self, pos: int) -> list[Sample]:
        """The samples of conversation ``pos`` (in piece order), once tokenized."""
        with self._cond:
            while self._groups[pos] is None and self._error is None:
                self._cond.wait()
            if self._groups[pos] is None:
                raise self._error  # type: ignore[misc]
            return self._groups[pos]  # type: ignore[return-value]

    def wait(self) -> CachedSamples:
        """Everything, once every conversation is tokenized (re-raises a tokenizer error)."""
        with self._cond:
            while self._result is None and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            return self._result  # type: ignore[return-value]

    def samples(self) -> list[Sample]:
        """Every sample in input order (waits for the last conversation)."""
        return self.wait().samples


class TokenizeJob:
    """Tokenizing through the cache in two halves: the constructor reads a whole
    entry if there is one, else starts the work (``in_child=True``: forks the
    producer process, :class:`_Producer`; ``ready=True``: reads the input and loads
    the tokenizer here, so that :attr:`sink` exists); :meth:`finish` tokenizes the
    rest (or collects it from the producer), handing each conversation's samples
    to :attr:`sink` (a :class:`ConversationSamples`, when the positions are known)
    as they come and writing a new entry, committed at the end. The CLI runs the
    first half before torch loads (a fork is safe only from a process not busy
    importing and with no other thread) and the second in a background thread.
    """

    def __init__(
        self,
        prepare: Callable[..., _Run],
        *,
        key: str | None,
        cache_dir: str | os.PathLike[str] | None,
        ready: bool = False,
        in_child: bool = False,
        max_size: int = DEFAULT_MAX_SIZE,
    ) -> None:
        self.entry = Path(cache_dir) / "tokenized" / key if key is not None and cache_dir is not None else None
        self.key = key or ""
        self.max_size = max_size
        self.prepare = prepare
        self.done: CachedSamples | None = None
        self._sink: ConversationSamples | None = None
        self._run: _Run | None = None
        self._it: Iterator[tuple[int, Sample]] | None = None
        self._child: _Producer | None = None
        self._lock = threading.Lock()
        if self.entry is not None:
            got = read_entry(self.entry, self.key)
            if got is not None:
                samples, stats, rest = got
                self.done = CachedSamples(samples, stats, True, self.entry, **rest)
                self._sink = ConversationSamples.complete(self.done)
                return
        if in_child:
            self._child = _Producer(prepare)
        elif ready:
            self._start()

    @property
    def sink(self) -> ConversationSamples | None:
        """The conversations' samples as they come (``None``: positions not known).
        With a producer process, waits for its conversation order (re-raises its error)."""
        if self._child is not None:
            self._head()
        return self._sink

    def info(self) -> dict[str, int]:
        """:func:`tokenizer_info` of the tokenizer: from the cache entry, else from the
        producer process (waits for it to load the tokenizer), else loaded here."""
        if self.done is not None:
            return dict(self.done.tokenizer)
        if self._child is not None:
            with self._lock:  # one reader of the pipe at a time (see _head)
                return self._child.info()
        if self._run is None:
            self._start()
        assert self._run is not None
        return self._run.info

    @property
    def pid(self) -> int | None:
        """The producer process's id (``None``: none was started)."""
        return self._child.pid if self._child is not None else None

    def close(self) -> None:
        """Stop the producer process, if any, and its workers (nothing is cached)."""
        if self._child is not None:
            self._child.close()

    def _head(self) -> list[int] | None:
        """The producer's conversation order, the sink made for it once."""
        assert self._child is not None
        with self._lock:
            order = self._child.order()
            if order is not None and self._sink is None:
                self._sink = ConversationSamples(len(order))
            return order

    def _start(self) -> None:
        run = self._run = self.prepare()
        if run.order is not None:
            self._sink = ConversationSamples(len(run.order))
        self._it = _positioned(run)

    def finish(self) -> CachedSamples:
        if self.done is not None:
            return self.done
        stats: Callable[[], TokenizeStats]
        if self._child is not None:
            child = self._child
            try:
                order, info = self._head(), self.info()
            except BaseException:
                child.close()
                raise
            it = child.samples()

            def stats() -> TokenizeStats:
                assert child.stats is not None
                return child.stats

            def read() -> Any:
                return child.read

        else:
            if self._it is None:
                self._start()
            run = self._run
            assert run is not None and self._it is not None
            it, order, info = self._it, run.order, run.info

            def stats() -> TokenizeStats:
                return run.out.stats

            def read() -> Any:
                return run.read

        sink = self._sink
        writer = None
        if self.entry is not None and order is not None:
            try:
                writer = EntryWriter(self.entry, self.key, max_size=self.max_size)
            except OSError as e:  # a read-only cache folder, a file in the way, a full disk: work without it
                _cannot_write(self.entry.parent.parent, e)
        samples: list[Sample] = []
        positions: list[int] = []
        last, group = -1, list[Sample]()
        try:
            for j, s in it:
                if sink is not None and order is not None and j != last:
                    if last >= 0:
                        sink._put(order[last], group)
                    for k in range(last + 1, j):  # skipped or dropped conversations: no sample
                        sink._put(order[k], [])
                    last, group = j, []
                group.append(s)
                samples.append(s)
                pos = order[j] if order is not None else j
                positions.append(pos)
                if writer is not None:
                    writer.add(s, pos)
            if sink is not None and order is not None:
                if last >= 0:
                    sink._put(order[last], group)
                for k in range(last + 1, len(order)):
                    sink._put(order[k], [])
            if writer is not None and not writer.commit(stats(), conversations=len(order or ()), tokenizer=info):
                writer = None
        except BaseException as e:
            if self._child is not None:
                self._child.close()
            if writer is not None:
                writer.abort()
            if sink is not None:
                sink._fail(e)
            raise
        if self._child is not None:
            self._child.close()
        if order is not None:  # input order, whatever order they were tokenized in
            by = np.argsort(np.asarray(positions, dtype=np.int64), kind="stable")
            samples = [samples[i] for i in by.tolist()]
            positions = [positions[i] for i in by.tolist()]
        self.done = CachedSamples(
            samples,
            stats(),
            False,
            self.entry if writer is not None else None,
            np.asarray(positions, dtype=np.int64) if order is not None else None,
            len(order) if order is not None else 0,
            info,
            read(),
        )
        if sink is not None:
            sink._finish(self.done)
        return self.done


def cached_tokenize(
    tokenize: Callable[[], Any],
    *,
    key: str | None,
    cache_dir: str | os.PathLike[str] | None,
    cache_max_size: int = DEFAULT_MAX_SIZE,
) -> CachedSamples:
    """``tokenize()`` (a lazy :class:`~sftpack.chat.TokenizedConversations`) through the cache.

    With ``key`` and ``cache_dir`` both given, a whole entry under that key is
    read instead of tokenizing; otherwise the samples are tokenized once and
    written into a new entry (positions: the order of the samples' conversations).
    ``key=None`` or ``cache_dir=None``: no cache, nothing written.
    ``cache_max_size``: the cache's size limit in bytes (``0``: none).
    """
    run = TokenizeJob(
        lambda *_: _Run(tokenize(), None, None, {}), key=key, cache_dir=cache_dir, max_size=cache_max_size
    )
    return run.finish()


def start_training_samples(
    tokenizer: Any,
    conversations: Iterable[Any] | None = None,
    *,
    max_seq_len: int,
    limit: int | None = None,
    num_proc: int = 1,
    progress: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    source: dict[str, Any] | None = None,
    tokenizer_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    ready: bool = False,
    in_child: bool = False,
    seed: int | None = None,
    load_tokenizer: tuple[str, Callable[[], Any]] | None = None,
    cache_max_size: int = DEFAULT_MAX_SIZE,
    read_stats: Any = None,
    on_bad_row: str = "error",
    overlong: str | Overlong = DEFAULT_OVERLONG,
) -> TokenizeJob:
    """Tokenize ``conversations`` (default: the embedded corpus, first ``limit``) for
    training, over-long ones split (``overlong``), through the cache in ``cache_dir`` (``None``: no cache),
    in two halves (:class:`TokenizeJob`): the cache is looked up now (and with
    ``ready=True`` the input read and the tokenizer loaded; with ``in_child=True`` a
    producer process forked that does all of that and tokenizes), the rest is done by
    the job's ``finish()``, which returns the :class:`CachedSamples`.

    Args:
        source: names the input for the key (:func:`source_identity`; by default it
            is worked out from ``conversations``: the embedded corpus or a list); input
            it cannot name is tokenized without the cache.
        tokenizer_files: see :func:`tokenizer_identity`.
        seed: tokenize the conversations in the order of
            ``conversation_order(n, seed=seed, epoch=0)``, the order training reads
            them in (the job's ``sink`` hands them over as they come); ``None``: in
            input order. The samples returned and cached are in input order either way.
        in_child: on a cache miss, fork one producer process now that loads the
            tokenizer, reads the input, orders it and tokenizes it (with its own
            ``num_proc`` workers), sending the tokenizer's info, the order and the
            samples back as they come; ``finish()`` collects them. Fork from a
            process with no other thread and not busy importing (the CLI does it
            before torch loads). Its errors are raised here, with their type and message.
        load_tokenizer: with ``tokenizer=None``: ``(name, load)``, a tokenizer that
            ``load()`` builds from ``tokenizer_files`` alone, named ``name`` in the key
            (:func:`tokenizer_files_identity`); it is loaded only if there is
            something to tokenize (not on a cache hit).
        cache_max_size: the cache's size limit in bytes (``0``: none): the entries used
            least recently make room for a new one; see :class:`EntryWriter`.
        read_stats: the :class:`~sftpack.chat.ReadStats` of the reader ``conversations``
            comes from (``reader.stats``); its counts of this pass come back as
            :attr:`CachedSamples.read` (from the producer process too).
        on_bad_row: a conversation the tokenizer cannot use (the chat template refuses it, it
            holds no trainable token...): ``"error"`` raises naming it, ``"skip"`` counts it in
            ``stats.skipped`` and tokenizes the rest (as :func:`~sftpack.chat.tokenize_conversations`).
        overlong: what a conversation longer than ``max_seq_len`` becomes (:class:`~sftpack.sample.Overlong`;
            default ``split``); a preference pair follows it whole (``split`` refuses it, naming it). Part
            of the cache key, as the other options: a ``drop`` run never reads a ``split`` run's entry.
    """

    if tokenizer is None and (load_tokenizer is None or tokenizer_files is None):
        raise ValueError("start_training_samples: give a tokenizer, or load_tokenizer with tokenizer_files")
    options = {
        "max_seq_len": max_seq_len,
        "overlong": choose(Overlong, overlong, "overlong").value,  # "split" by default: the key of before
        "train_on": "all_assistant",
        "on_bad_row": choose(OnBadRow, on_bad_row, "on_bad_row").value,
        "special_tokens_in_content": "text",
    }
    key = None
    if cache_dir is not None:
        if source is None:
            source = source_identity(conversations, limit=limit)
        if source is not None:
            if tokenizer is None:
                assert load_tokenizer is not None and tokenizer_files is not None
                tok_id = tokenizer_files_identity(tokenizer_files, loader=load_tokenizer[0])
            else:
                tok_id = tokenizer_identity(tokenizer, files=tokenizer_files)
            key = cache_key(tok_id, options, source)

    def prepare(tell: Callable[[dict[str, int]], None] | None = None) -> _Run:
        tok = tokenizer
        if tok is None:
            assert load_tokenizer is not None
            tok = load_tokenizer[1]()
        info = tokenizer_info(tok)
        if tell is not None:  # before reading the input: the model can be built meanwhile
            tell(info)
        convs: Any = default_corpus(limit=limit) if conversations is None else conversations
        order = ids = None
        if seed is not None or key is not None or isinstance(convs, (list, tuple)) or conversations is None:
            # positions known: each conversation with its id, as the tokenizer would name it
            items = [as_item(c, i) for i, c in enumerate(convs)]
            convs = [Conversation(cid, payload, checked=checked) for cid, payload, checked in items]
            ids = [c.id for c in convs]
            order = (
                list(range(len(convs))) if seed is None else conversation_order(len(convs), seed=seed, epoch=0).tolist()
            )
            convs = [convs[p] for p in order]
        # batches of 64 conversations (the tokenizer's default is 256): the first step waits for
        # the first batch only, and the samples do not depend on the batch size
        out = tokenize_conversations(
            convs,
            tok,
            num_proc=num_proc,
            progress=progress,
            batch_size=_BATCH,
            **options,  # type: ignore[arg-type]
        )
        return _Run(out, order, ids, info, read_stats)

    return TokenizeJob(prepare, key=key, cache_dir=cache_dir, ready=ready, in_child=in_child, max_size=cache_max_size)


T = TypeVar("T")


class Pending(Generic[T]):
    """``fn()`` run in a background thread (``background=False``: right away, in this
    one); :meth:`result` waits for it and returns its value or raises its exception.
    The CLI uses it to tokenize while torch loads and the model is built."""

    def __init__(self, fn: Callable[[], T], *, background: bool = True) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        # Waited on instead of Thread.join(): on Python 3.11 a KeyboardInterrupt raised in a
        # join() (Ctrl-C, or SIGTERM through the CLI) marks the thread ended while it still
        # runs, and the clean-up's second result() would return before the work is aborted.
        self._done = threading.Event()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(fn,), name="sftpack-tokenize", daemon=True)
            self._thread.start()
        else:
            self._run(fn)

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to the caller by result()
            self._error = e
        finally:
            self._done.set()

    def result(self) -> T:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
