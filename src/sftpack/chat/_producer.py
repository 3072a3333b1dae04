"""The producer process: a tokenizer pass forked into a child process and streamed
back over a pipe, so that ``sftpack train`` tokenizes while torch loads.

The protocol, in order (one message each, pickled by ``multiprocessing``)::

    ("info", tokenizer_info)            as soon as the tokenizer is loaded
    ("order", order)                    the conversation positions, in tokenize order
    ("samples", [(j, sample), ...])     one message per tokenizer batch (_BATCH conversations)
    ("end", stats)                      the tokenizer's TokenizeStats
    ("error", pickled exception)        at any point instead

The child runs in its own process group, so that killing the group kills its
tokenizer workers too; it dies with the thread that forked it (Linux's
``PR_SET_PDEATHSIG``; elsewhere at its next send, on the broken pipe).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..sample import Sample
from ._batch import TokenizeStats
from ._rows import PAIR_ROLES

__all__: list[str] = []

#: conversations per tokenizer batch when tokenizing for training
_BATCH = 64


@dataclass
class _Run:
    """One tokenizer pass: the lazy samples, the conversation positions in the order
    they are tokenized, the conversation id of each position, the tokenizer's info, and
    the reader's counts (:class:`~sftpack.chat.ReadStats`, complete once the samples are;
    ``None`` when no reader read the input)."""

    out: Any
    order: list[int] | None
    ids: list[Any] | None
    info: dict[str, int]
    read: Any = None


def _continues(s: Sample) -> bool:
    """Whether ``s`` continues the previous sample's conversation: a later piece of a split
    one, or a later member of a preference pair (``meta["role"]`` not the first of ``PAIR_ROLES``)."""
    return bool(s.meta.get("piece")) or s.meta.get("role", PAIR_ROLES[0]) != PAIR_ROLES[0]


def _last_of_its_conversation(s: Sample) -> bool:
    return s.meta.get("piece", 0) == s.meta.get("pieces", 1) - 1 and s.meta.get("role", "") != PAIR_ROLES[0]


def _positioned(run: _Run) -> Iterator[tuple[int, Sample]]:
    """``(j, sample)``: the sample and the index ``j`` into ``run.order`` of its
    conversation (found by its id: a sample that does not continue the previous
    conversation (:func:`_continues`) belongs to the next conversation with its id; the ones
    passed over gave no sample). Without an order, ``j`` counts conversations."""
    order, ids = run.order, run.ids
    j = -1
    for s in run.out:
        if j < 0 or not _continues(s):
            j += 1
            if order is not None and ids is not None:
                while j < len(order) and ids[order[j]] != s.conversation_id:
                    j += 1
                if j == len(order):
                    raise RuntimeError(f"sample of conversation {s.conversation_id!r} matches no conversation left")
        yield j, s


class _Producer:
    """``prepare()`` and its tokenizer pass in a forked child process (its own
    process group, so that its tokenizer workers go with it), streamed back over a
    pipe in this order: ``("info", tokenizer_info)`` as soon as the tokenizer is
    loaded, ``("order", order)``, ``("samples", [(j, sample), ...])`` one message
    per tokenizer batch, ``("end", stats)``; or ``("error", error)`` at any point.

    The child dies with the thread that forked it (``PR_SET_PDEATHSIG`` on Linux;
    else at its next send, which finds the pipe broken), its workers with it, and
    :meth:`close` kills it and its workers. One reader at a time: :meth:`info` and
    :meth:`order` are called under the job's lock, :meth:`samples` only after :meth:`order`.
    """

    def __init__(self, prepare: Callable[..., _Run]) -> None:
        import multiprocessing  # start-up: only the forked producer needs it; `import sftpack.chat` does not

        ctx = multiprocessing.get_context("fork")
        self._conn, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_produce, args=(prepare, child_end, self._conn, os.getpid()), name="sftpack-tokenize", daemon=True
        )
        self._proc.start()
        self.pid = self._proc.pid
        child_end.close()  # only the child writes: its end closing is what EOF means here
        try:  # the child does it too: whichever runs first, the group exists before it forks workers
            os.setpgid(self.pid, self.pid)  # type: ignore[arg-type]
        except OSError:  # the child has already done it, or has already ended
            pass
        self._info: dict[str, int] | None = None
        self._order: list[int] | None = None
        self._ordered = False
        self._error: BaseException | None = None
        self.stats: TokenizeStats | None = None
        self.read: Any = None  # the reader's counts, sent with the end

    def _recv(self) -> tuple[Any, ...]:
        """The next message (raises the child's error, or one naming how it ended)."""
        if self._error is not None:
            raise self._error
        while True:
            if self._conn.poll(0.2):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    msg = None
                break
            if self._ended():  # (outside Linux, the workers of a killed child may hold the pipe open)
                try:  # what it sent before it ended
                    msg = self._conn.recv() if self._conn.poll(0) else None
                except (EOFError, OSError):
                    msg = None
                break
        if msg is None:
            self.close()
            code = self._proc.exitcode
            how = f"exit code {code}"
            if code is not None and code < 0:
                how = f"signal {signal.Signals(-code).name} (exit code {code})"
            self._error = RuntimeError(
                f"the tokenizer process (pid {self.pid}) ended with {how} before it had sent all the samples"
            )
        elif msg[0] == "error":
            self._error = _rebuilt(msg[1])
        if self._error is not None:
            self.close()
            raise self._error
        return msg

    def info(self) -> dict[str, int]:
        while self._info is None:
            msg = self._recv()
            assert msg[0] == "info", msg[0]
            self._info = msg[1]
        return self._info

    def order(self) -> list[int] | None:
        self.info()
        if not self._ordered:
            msg = self._recv()
            assert msg[0] == "order", msg[0]
            self._order, self._ordered = msg[1], True
        return self._order

    def samples(self) -> Iterator[tuple[int, Sample]]:
        assert self._ordered
        while True:
            msg = self._recv()
            if msg[0] == "end":
                self.stats, self.read = msg[1], msg[2]
                return
            # preference pairs pass as they are: the training loop refuses them unless its objective trains pairs
            yield from msg[1]

    def _ended(self) -> bool:
        """The child has ended (told without reaping it: its pid keeps naming its group)."""
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None  # type: ignore[arg-type]
        except ChildProcessError:  # reaped already (multiprocessing does when it starts another process)
            return True

    def close(self) -> None:
        """Kill the child's process group (the child and its workers) and reap the child."""

        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # type: ignore[arg-type]
            os.killpg(self.pid, signal.SIGKILL)  # type: ignore[arg-type]  # running or unreaped: still its group
        except (ChildProcessError, ProcessLookupError, PermissionError):  # reaped, or the group is gone
            pass
        self._proc.join()  # the pipe stays open: a reader in another thread now finds it ended


def _produce(prepare: Callable[..., _Run], conn: Any, parents_end: Any, parent: int) -> None:
    """The body of the producer process (see :class:`_Producer`)."""
    import multiprocessing  # start-up: only the forked producer needs it; `import sftpack.chat` does not

    parents_end.close()  # else a dead parent would not break the pipe
    # daemonic for the parent (terminated when it exits), not for itself: it starts the tokenizer's workers
    multiprocessing.current_process().daemon = False
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills this process
    _die_with(parent)
    me = os.getpid()
    # the tokenizer's workers die with this process (else, killed, it would leave them waiting for work
    # forever, holding the pipe open)
    os.register_at_fork(after_in_child=lambda: _die_with(me))
    sent = False

    def tell(info: dict[str, int]) -> None:
        nonlocal sent
        conn.send(("info", info))
        sent = True

    try:
        run = prepare(tell)
        if not sent:
            tell(run.info)
        conn.send(("order", run.order))
        batch: list[tuple[int, Sample]] = []
        for j, s in _positioned(run):
            batch.append((j, s))
            # the last piece of a tokenizer batch's last conversation: send the batch
            if _last_of_its_conversation(s) and run.out.stats.conversations % _BATCH == 0:
                conn.send(("samples", batch))
                batch = []
        conn.send(("samples", batch))
        conn.send(("end", run.out.stats, run.read))
    except (BrokenPipeError, EOFError):  # the parent is gone or stopped listening
        os._exit(1)
    except Exception as e:
        conn.send(("error", _portable(e)))


def _die_with(parent: int) -> None:
    """Linux: this process gets SIGKILL when ``parent`` (the process that forked it) ends,
    however it ends (an exception, Ctrl-C, ``os._exit``, killed)."""

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: it ends at its next send, on the broken pipe
        return
    if os.getppid() != parent:  # the parent ended before that
        os._exit(1)


def _portable(e: BaseException) -> bytes:
    """``e`` pickled, if it comes back of the same type and with the same message;
    else a ``RuntimeError`` naming its type and message (an exception whose
    ``__init__`` takes other arguments than its ``args`` and that does not say how
    to rebuild it with ``__reduce__`` does not survive pickling)."""

    try:
        blob = pickle.dumps(e)
        back = pickle.loads(blob)
        if type(back) is type(e) and str(back) == str(e):
            return blob
    except Exception:  # not picklable, or not rebuilt: the fallback below
        pass
    return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))


def _rebuilt(blob: bytes) -> BaseException:
    err = pickle.loads(blob)
    return err if isinstance(err, BaseException) else RuntimeError(repr(err))
