"""The Ray engine of ``sftpack prepack``: tokenize and write on a Ray cluster, pack on the driver.

The local engine's three stages, spread out; the files come out byte-identical
(every file but ``manifest.json``, and the manifest too: same counts, same
fingerprint, same checksums)::

    driver                                   Ray (a Ray Data actor pool, then writer actors)
    ------                                   -----------------------------------------------
    cut the input into units (one per file,  1. read + tokenize + stage, one unit per call,
      or 1,024 conversations), numbered  ->     one tokenizer per actor; unit k's samples go to
                                                _staging/u<k>/ (the local stage_samples, so the
                                                same bytes); only lengths, conversation numbers,
    merge the units IN UNIT ORDER        <-     pieces, id offsets and stats come back
    2. plan_rows(lengths) (the local
       engine's own planner), allocate
       the files at full size           ->   3. write_rows on disjoint row ranges (pwrite at
                                                the offsets the plan fixed), gathering each
    index, checksums, manifest, rename  <-      sequence from its unit's staging files

Determinism never depends on Ray: results are keyed by unit number and merged
in that order (Ray Data's ``preserve_order`` is off by default and the pool
answers in any order), staging and output file names are chosen here, and
every byte's position comes from the plan, so a unit retried after a worker
died rewrites the same files and any write order gives the same bytes. An
error in a unit (a bad row in ``on_bad_row="error"`` mode, a tokenizer that
does not load on a node) comes back as a value and the driver raises the one
of the lowest unit, which is the error the local engine raises first; the
partial directory is removed, so nothing that opens as a prepack is left.

Memory: the driver holds the lengths and the plan, never a token: 20 bytes a
sample merged from the units (length, conversation, piece) and 24 for the plan,
about 77 bytes a sample at the peak of packing (``benchmarks/bench_ray.py``,
BFD at 4,096: 10 M samples in 6.4 s and 1.1 GB RSS, 1e8 in 73 s and 7.6 GB). Ray
itself: a 1 GiB object store by default, and a process per actor (about 300 MB
each: sftpack imports torch; plus the tokenizer).

Small machines: ``ray.init`` on 2 cores takes 8-15 s and each actor 1-4 s to
import and load its tokenizer, so Ray pays off across nodes; on one machine the
local engine does the same work without that overhead (numbers in the README).
:func:`ray_session` starts a private local Ray with a short temporary root
(the Unix socket path limit is 107 bytes), an explicit object store and one
spare logical CPU beyond the actors (an actor pool that takes every CPU
starves Ray Data's own tasks and hangs), and always shuts it down.

>>> from sftpack.offline import plan_rows
>>> split_rows(plan_rows([5, 10, 3, 8, 6, 9, 16, 2], max_seq_len=16), 2)
[(0, 2), (2, 4)]
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice, pairwise
from pathlib import Path
from typing import Any

import numpy as np

from .._base import choose, positive_int
from ..binpack import Algorithm
from ..chat import (
    Conversation,
    ConversationReader,
    OnBadRow,
    Overlong,
    TrainOn,
    read_conversations,
)
from ._fingerprint import digest, input_fingerprints
from ._format import (
    FILES,
    MANIFEST,
    PrepackError,
    check_row_width,
    file_sha256,
    token_dtype,
    write_json,
)
from ._plan import RowPlan, plan_rows
from ._prepack import PrepackResult, _bar, _Hashing, _is_paths, build_manifest, check_out_outside_inputs
from ._publish import Output, writing
from ._stage import StagedSamples, StagingSource, stage_samples
from ._write import allocate, write_index, write_rows

__all__ = ["RayPrepackResult", "prepack_ray", "ray_session", "split_rows"]

logger = logging.getLogger("sftpack.offline")

#: Conversations per unit when the input is not files (the embedded corpus, an iterable, ``limit``).
UNIT_CONVERSATIONS = 1024
#: Tokens per write task when ``write_tasks`` is not given (about 80 MB of output, a few seconds).
WRITE_TOKENS = 1 << 24
#: Test hook, empty in use: ``{"kill_once": (unit key, marker path)}`` makes the actor that runs
#: that unit SIGKILL itself once, after staging it (the marker records it), as ``kill -9`` would.
_FAULTS: dict[str, Any] = {}
#: Longest allowed Ray temp root: the session adds about 65 bytes before the 107-byte socket limit.
_MAX_TEMP_ROOT = 40


# ---------------------------------------------------------------------------- the Ray session


@contextlib.contextmanager
def ray_session(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    object_store_memory: int = 1 << 30,
    temp_root: str = "/tmp",
) -> Iterator[bool]:
    """Ray for the length of a ``with`` block; yields whether this call started it.

    Args:
        address: join this running cluster (``"ray://host:10001"``, ``"host:6379"``
            or ``"auto"``); ``None`` starts a private local Ray.
        num_cpus: logical CPUs of the private Ray (default: the machine's).
        object_store_memory: bytes of the private object store (default 1 GiB,
            not Ray's 30 % of RAM).
        temp_root: where the private Ray's short ``sfr-XXXXXX`` folder goes.

    A Ray already initialised in this process is used as is and left running.
    A private Ray is shut down (and its folder removed) on leaving the block,
    also on an exception or Ctrl-C, so no worker process outlives the call.
    """
    import ray

    if ray.is_initialized():
        yield False
        return
    tmp: str | None = None
    try:
        if address is not None:
            try:
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise RuntimeError(
                    f"cannot reach the Ray cluster at {address!r} ({' '.join(str(e).split())[:300]}): check the "
                    "address (`ray status` on the head node prints it), or leave --ray-address out to run on a "
                    "private local Ray"
                ) from None
        else:
            if len(temp_root) > _MAX_TEMP_ROOT:
                raise ValueError(
                    f"temp_root={temp_root!r} is {len(temp_root)} characters: Ray's socket paths under it would "
                    f"pass the 107-byte Unix limit; use a root of at most {_MAX_TEMP_ROOT} characters such as /tmp"
                )
            tmp = tempfile.mkdtemp(prefix="sfr-", dir=temp_root)
            ray.init(
                num_cpus=num_cpus,
                object_store_memory=int(object_store_memory),
                _temp_dir=tmp,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        yield True
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- units (driver -> actors)


@dataclass
class _Unit:
    """One call of the tokenize stage: a source file, or a list of conversations."""

    key: int
    staging: str
    source: Any = None  # a reader source (one file or saved dataset)
    conversations: list[Any] | None = None
    on_bad_row: str = "skip"
    role_map: dict[str, str] | None = None
    batch_size: int = 1024


def _as_conversations(items: Iterable[Any], start: int) -> list[Conversation]:
    """Items as :class:`Conversation` with the id the tokenizer would give at their global position."""
    from ..chat._tokenize import _as_item

    return [Conversation(*_as_item(obj, start + i)) for i, obj in enumerate(items)]


def _chunks(conversations: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(conversations)
    while chunk := list(islice(it, size)):
        yield chunk


# ---------------------------------------------------------------------------- the tokenize actor


def _node() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()[:12]
    except Exception:  # noqa: BLE001 - only a label
        return socket.gethostname()


def _load_tokenizer(spec: Any) -> Any:
    if spec is None:
        from ..data import default_tokenizer

        return default_tokenizer()
    if isinstance(spec, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.fspath(spec), local_files_only=True)
    return spec


class _TokenizeActor:
    """A Ray Data actor: loads the tokenizer once, then read + tokenize + stage per unit.

    Every outcome, an error included, comes back as a result row: a raised
    exception would make Ray Data retry or fail the whole dataset with a
    traceback, and the driver could not tell which unit failed first.
    """

    def __init__(self, tokenizer: Any, options: dict[str, Any]):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per actor: the actors fill the cores
        self.spec = tokenizer
        self.options = options
        self.tokenizer: Any = None
        self.fingerprint: dict[str, Any] | None = None

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            from ._fingerprint import tokenizer_fingerprint

            try:
                tok = _load_tokenizer(self.spec)
                fp = tokenizer_fingerprint(tok)
            except Exception as e:  # noqa: BLE001 - any failure to load is reported the same way
                where = (
                    "the embedded default"
                    if self.spec is None
                    else repr(os.fspath(self.spec))
                    if isinstance(self.spec, (str, os.PathLike))
                    else type(self.spec).__name__
                )
                raise RuntimeError(
                    f"a Ray worker (node {_node()}, host {socket.gethostname()}, pid {os.getpid()}) cannot load the "
                    f"tokenizer {where}: {' '.join(str(e).split())[:300]}. The tokenizer folder must exist at the "
                    "same path on every node (a shared filesystem, or the same copy on each node)"
                ) from None
            self.tokenizer, self.fingerprint = tok, fp
        return self.tokenizer

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = [pickle.dumps(self._run(pickle.loads(blob)), protocol=5) for blob in batch["unit"]]
        return {"key": np.asarray(batch["key"]), "result": np.array(results, dtype=object)}

    def _run(self, unit: _Unit) -> dict[str, Any]:
        from ..chat import tokenize_conversations

        t0 = time.perf_counter()
        base = {"key": unit.key, "pid": os.getpid(), "node": _node()}
        try:
            tok = self._tokenizer()
            t_load = time.perf_counter() - t0  # the actor's first unit loads its tokenizer
            t0 = time.perf_counter()
            reader = None
            if unit.source is not None:
                reader = ConversationReader([unit.source], OnBadRow(unit.on_bad_row), unit.role_map, unit.batch_size)
                convs: Iterable[Any] = reader
            else:
                convs = unit.conversations or []
            o = self.options
            tokenized = tokenize_conversations(
                convs, tok, max_seq_len=o["max_seq_len"], overlong=o["overlong"], train_on=o["train_on"]
            )
            staged = stage_samples(tokenized, Path(unit.staging))
            kill = self.options.get("kill_once")
            if kill and kill[0] == unit.key and not os.path.exists(kill[1]):
                Path(kill[1]).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        except Exception as e:  # noqa: BLE001 - sent back whole, raised by the driver in unit order
            try:
                portable: BaseException | None = pickle.loads(pickle.dumps(e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
                portable = None
            return {**base, "ok": False, "error": portable, "message": f"{type(e).__name__}: {e}"}
        return {
            **base,
            "ok": True,
            "fingerprint": self.fingerprint,
            "lengths": staged.lengths,
            "conversation": staged.conversation,
            "piece": staged.piece,
            "id_offsets": staged.conversation_offsets,
            "max_id": staged.max_id,
            "tokens": staged.tokens,
            "trainable": staged.trainable,
            "labels": staged.labels,
            "first_trainable": staged.first_trainable,
            "read": None if reader is None else reader.stats.as_dict(),
            "tokenize": tokenized.stats.as_dict(),
            "seconds": time.perf_counter() - t0,
            "load_seconds": t_load,
        }


# ---------------------------------------------------------------------------- stage 3: token source + task


class _UnitsSource:
    """The token source of the write stage: samples gathered from their units' staging files.

    Global sample ``i`` lives in unit ``u`` with ``unit_samples[u] <= i < unit_samples[u+1]``.
    One :meth:`gather` sorts the requested samples by unit (one stable argsort),
    gathers each unit's share with the local :class:`StagingSource`, and scatters
    it back into request order.
    """

    def __init__(self, directories: list[str], lengths: np.ndarray, unit_samples: np.ndarray):
        self.lengths = np.asarray(lengths, np.int64)
        self.unit_samples = np.asarray(unit_samples, np.int64)
        self.directories = directories
        self._sources: dict[int, StagingSource] = {}

    def _source(self, u: int) -> StagingSource:
        if u not in self._sources:
            a, b = self.unit_samples[u], self.unit_samples[u + 1]
            self._sources[u] = StagingSource(Path(self.directories[u]), self.lengths[a:b])
        return self._sources[u]

    def gather(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = np.asarray(samples, np.int64)
        lens = self.lengths[samples]
        total = int(lens.sum())
        ids = np.empty(total, np.uint32)
        mask = np.empty(total, np.uint8)
        out_starts = np.zeros(samples.shape[0], np.int64)
        np.cumsum(lens[:-1], out=out_starts[1:])
        unit = np.searchsorted(self.unit_samples, samples, side="right") - 1
        by_unit = np.argsort(unit, kind="stable")
        cuts = np.flatnonzero(np.diff(unit[by_unit])) + 1
        for group in np.split(by_unit, cuts):
            if group.shape[0] == 0:
                continue
            u = int(unit[group[0]])
            got_ids, got_mask = self._source(u).gather(samples[group] - self.unit_samples[u])
            glens = lens[group]
            inner = np.zeros(group.shape[0], np.int64)
            np.cumsum(glens[:-1], out=inner[1:])
            pos = np.arange(got_ids.shape[0], dtype=np.int64) + np.repeat(out_starts[group] - inner, glens)
            ids[pos] = got_ids
            mask[pos] = got_mask
        return ids, mask


def _write_part(
    directory: str, plan: RowPlan, source: _UnitsSource, dtype: str, rows: tuple[int, int]
) -> dict[str, Any]:
    """Write rows ``[a, b)``: in a writer actor on any node that sees ``directory``, or in the driver."""
    t0 = time.perf_counter()
    write_rows(Path(directory), plan, source, np.dtype(dtype), rows=rows)
    return {"rows": rows, "seconds": time.perf_counter() - t0, "pid": os.getpid(), "node": _node()}


class _Writer:
    """A Ray actor that writes row ranges. The pool starts as soon as the lengths are in, so
    its imports (about 4 s, torch included) overlap merging and packing (73 s for 1e8
    samples); ``num_cpus=0``: writing is pwrite-bound, and no tokenize actor waits for it."""

    def write(
        self, directory: str, plan: RowPlan, source: _UnitsSource, dtype: str, rows: tuple[int, int]
    ) -> dict[str, Any]:
        return _write_part(directory, plan, source, dtype, rows)


@contextlib.contextmanager
def _writer_pool(size: int) -> Iterator[list[Any]]:
    """``size`` writer actors spread over the nodes, killed on leaving (also on an error)."""
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=1, max_task_retries=1)(_Writer)  # a killed writer reruns its range
    pool = [cls.options(scheduling_strategy="SPREAD").remote() for _ in range(size)]
    try:
        yield pool
    finally:
        for actor in pool:
            ray.kill(actor)


def split_rows(plan: RowPlan, parts: int) -> list[tuple[int, int]]:
    """Cut the rows into at most ``parts`` consecutive ranges of about equal tokens
    (the write stage's tasks); empty ranges are left out."""
    parts = positive_int("parts", parts)
    tok = plan.row_token_offsets()
    targets = np.linspace(0, tok[-1], parts + 1)[1:-1]
    cuts = np.searchsorted(tok, targets, side="left")
    edges = np.unique(np.concatenate([[0], cuts, [plan.num_rows]]))
    return [(int(a), int(b)) for a, b in pairwise(edges) if b > a]


# ---------------------------------------------------------------------------- the driver


@dataclass
class RayPrepackResult(PrepackResult):
    """:class:`~sftpack.offline.PrepackResult` plus what each tokenize actor and writer did.

    Attributes:
        actors: one dict per tokenize actor: ``node``, ``pid``, ``units``,
            ``conversations``, ``tokens``, ``load_seconds`` (loading its tokenizer),
            ``seconds`` (reading, tokenizing and staging its units) and
            ``tokens_per_s`` (``tokens / seconds``).
        writers: one dict per row range written: ``rows``, ``seconds``, ``pid``, ``node`` (one
            range written by the driver itself when a single writer suffices).
    """

    actors: list[dict[str, Any]] = field(default_factory=list)
    writers: list[dict[str, Any]] = field(default_factory=list)


def _units(
    inputs: Any, staging: Path, *, on_bad_row: str, limit: int | None, unit_size: int
) -> tuple[list[_Unit], ConversationReader | None, _Hashing | None, list[dict[str, Any]]]:
    """The units, the driver-side reader (its stats count when the driver reads), and the input fingerprint."""
    reader: ConversationReader | None = None
    hashing: _Hashing | None = None

    def lists(convs: Iterable[Any]) -> list[_Unit]:
        out, start = [], 0
        for k, chunk in enumerate(_chunks(convs, unit_size)):
            out.append(_Unit(k, str(staging / f"u{k:06d}"), conversations=_as_conversations(chunk, start)))
            start += len(chunk)
        return out

    if inputs is None:
        from ..data import default_corpus

        fp = input_fingerprints(None)
        fp[0]["limit"] = limit
        return lists(default_corpus(limit)), None, None, fp
    if isinstance(inputs, ConversationReader) or _is_paths(inputs):
        reader = inputs if isinstance(inputs, ConversationReader) else read_conversations(inputs, on_bad_row=on_bad_row)
        fp = input_fingerprints(reader)
        if limit is not None:  # the first `limit` conversations: only a single reader knows where they end
            return lists(islice(reader, limit)), reader, None, fp
        units = [
            _Unit(
                k,
                str(staging / f"u{k:06d}"),
                source=src,
                on_bad_row=reader.on_bad_row.value,
                role_map=reader.role_map,
                batch_size=reader.batch_size,
            )
            for k, src in enumerate(reader.sources)
        ]
        return units, reader, None, fp
    hashing = _Hashing(inputs if limit is None else islice(inputs, limit))
    return lists(hashing), None, hashing, []


def _raise_first_error(results: list[dict[str, Any]]) -> None:
    bad = [r for r in results if not r["ok"]]
    if not bad:
        return
    first = bad[0]
    if isinstance(first["error"], BaseException):
        raise first["error"]
    raise RuntimeError(f"the Ray tokenize stage failed in unit {first['key']}: {first['message']}")


def _merge(results: list[dict[str, Any]], staging: Path) -> tuple[StagedSamples, np.ndarray]:
    """The units' stage-1 results laid end to end in unit order, as the local engine stages them."""
    lengths = [r["lengths"] for r in results]
    conv, offsets = [], [np.zeros(1, np.int64)]
    n_conv = n_bytes = 0
    for r in results:
        conv.append(np.asarray(r["conversation"], np.int64) + n_conv)
        offsets.append(np.asarray(r["id_offsets"][1:], np.int64) + n_bytes)
        n_conv += len(r["id_offsets"]) - 1
        n_bytes += int(r["id_offsets"][-1])
    unit_samples = np.zeros(len(results) + 1, np.int64)
    np.cumsum([x.shape[0] for x in lengths], out=unit_samples[1:])
    empty64 = np.zeros(0, np.int64)
    staged = StagedSamples(
        directory=staging,
        lengths=np.concatenate(lengths) if lengths else empty64,
        conversation=np.concatenate(conv) if conv else empty64,
        piece=np.concatenate([r["piece"] for r in results]).astype(np.int32) if results else np.zeros(0, np.int32),
        conversation_offsets=np.concatenate(offsets),
        max_id=max((r["max_id"] for r in results), default=-1),
        tokens=sum(r["tokens"] for r in results),
        trainable=sum(r["trainable"] for r in results),
        labels=sum(r["labels"] for r in results),
        first_trainable=sum(r["first_trainable"] for r in results),
    )
    return staged, unit_samples


def _sum_stats(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise sum of stats dicts (ints add, ``{reason: count}`` dicts merge)."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, dict):
                into = out.setdefault(k, {})
                for kk, vv in v.items():
                    into[kk] = into.get(kk, 0) + vv
            elif isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + int(v)
    return out


def _counts_extra(read: dict[str, Any] | None, st: dict[str, Any]) -> dict[str, Any]:
    """The read / over-long part of the counts, as the local engine's ``counts_after`` builds it."""
    if read is not None:
        head = {"read": read["read"], "kept": read["kept"], "dropped": dict(sorted(read.get("dropped", {}).items()))}
    else:
        head = {"read": st["conversations"], "kept": st["conversations"], "dropped": {}}
    return {
        **head,
        "overlong": {
            "tokenized": st["conversations"],
            "fit": st["fit"],
            "truncated": st["truncated"],
            "split": st["split"],
            "dropped": st["dropped"],
        },
        "tokens_lost": st["tokens_lost"],
        "trainable_tokens_lost": st["trainable_tokens_lost"],
        "tokens_rendered": st["tokens"] + st["tokens_lost"],
        "no_trainable": st["no_trainable"],
    }


def _actor_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    per: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        a = per.setdefault(
            (r["node"], r["pid"]),
            {
                "node": r["node"],
                "pid": r["pid"],
                "units": 0,
                "conversations": 0,
                "tokens": 0,
                "seconds": 0.0,
                "load_seconds": 0.0,
            },
        )
        a["units"] += 1
        a["conversations"] += r["tokenize"]["conversations"]
        a["tokens"] += r["tokens"]
        a["seconds"] += r["seconds"]
        a["load_seconds"] += r["load_seconds"]
    for a in per.values():
        a["tokens_per_s"] = a["tokens"] / a["seconds"] if a["seconds"] else 0.0
    return sorted(per.values(), key=lambda a: (a["node"], a["pid"]))


def _tokenize_stage(
    units: list[_Unit], *, tokenizer: Any, options: dict[str, Any], workers: int, actor_cpus: float, progress: bool
) -> list[dict[str, Any]]:
    import ray.data

    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    rows = [{"key": u.key, "unit": pickle.dumps(u, protocol=5)} for u in units]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows)))
    ds = ds.map_batches(
        _TokenizeActor,
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=min(workers, max(1, len(units)))),
        fn_constructor_kwargs={"tokenizer": tokenizer, "options": options},
        num_cpus=actor_cpus,
    )
    if len(units) < workers:
        logger.warning(
            "only %d unit(s) of work (one per input file) for %d workers: %d worker(s) stay idle; split the input "
            "into more files to use them",
            len(units),
            workers,
            workers - len(units),
        )
    results: dict[int, dict[str, Any]] = {}
    # our own bar replaces Ray Data's; keep its INFO lines and its "progress bars disabled" note quiet
    quiet = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}
    saved = {name: logging.getLogger(name).level for name in quiet}
    for name, level in quiet.items():
        logging.getLogger(name).setLevel(level)
    try:
        with _bar(progress, total=len(units), desc="tokenize (ray)", unit="unit") as bar:
            for row in ds.iter_rows():
                r = pickle.loads(row["result"])
                results[int(r["key"])] = r
                bar.update(1)
    except ray.exceptions.RayError as e:
        raise RuntimeError(
            f"the Ray tokenize stage failed ({type(e).__name__}: {' '.join(str(e).split())[:500]}); nothing was written"
        ) from e
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
    missing = sorted(set(range(len(units))) - set(results))
    if missing:
        raise RuntimeError(f"the Ray tokenize stage lost units {missing[:10]}: nothing was written; run again")
    return [results[k] for k in range(len(units))]


def _write_stage(
    tmp: Path, plan: RowPlan, source: _UnitsSource, dtype: np.dtype, *, writers: list[Any], progress: bool
) -> list[dict[str, Any]]:
    import ray

    plan_ref, source_ref = ray.put(plan), ray.put(source)
    ranges = split_rows(plan, len(writers))
    pending = [
        writers[i].write.remote(str(tmp), plan_ref, source_ref, dtype.str, rows) for i, rows in enumerate(ranges)
    ]
    done: list[dict[str, Any]] = []
    try:
        with _bar(progress, total=len(pending), desc="write (ray)", unit="part") as bar:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                done.append(ray.get(ready[0]))
                bar.update(1)
    except ray.exceptions.RayError as e:
        raise RuntimeError(
            f"the Ray write stage failed ({type(e).__name__}: {' '.join(str(e).split())[:500]}); nothing was published"
        ) from e
    return sorted(done, key=lambda d: d["rows"])


def prepack_ray(
    inputs: Any = None,
    out: str | os.PathLike[str] = "prepack",
    *,
    tokenizer: Any = None,
    max_seq_len: int = 4096,
    pad_multiple: int = 1,
    algorithm: str | Algorithm = "bfd",
    seed: int = 0,
    overlong: str | Overlong = "split",
    train_on: str | TrainOn = "all_assistant",
    on_bad_row: str = "skip",
    workers: int = 2,
    ray_address: str | None = None,
    limit: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
    unit_size: int = UNIT_CONVERSATIONS,
    write_tasks: int | None = None,
    actor_cpus: float = 1.0,
) -> RayPrepackResult:
    """:func:`sftpack.offline.prepack` on Ray: the same directory, byte for byte.

    Args:
        inputs, out, max_seq_len, pad_multiple, algorithm, seed, overlong, train_on,
            on_bad_row, limit, overwrite, progress: as :func:`sftpack.offline.prepack`.
            Files are read on the workers, one unit per file (and per saved
            dataset); the embedded corpus, an iterable, or any input with
            ``limit`` is read on the driver and shipped in units of ``unit_size``
            conversations.
        tokenizer: ``None`` (the embedded Qwen tokenizer, on every worker), the path
            of a tokenizer folder that every node sees at that path (each actor
            loads it; the driver never does), or a tokenizer object (pickled to
            the actors; fine on one machine).
        workers: tokenize actors (at most one per unit).
        ray_address: join this running cluster; ``None`` starts a private local Ray
            (``workers + 1`` logical CPUs, 1 GiB object store) and stops it after.
            A Ray already initialised in this process is used as is.
        unit_size: conversations per unit for inputs read on the driver.
        write_tasks: writer actors, each writing one range of rows (default: one per
            16 M tokens, at most ``workers``; a single range is written by the driver);
            started after the tokenize stage, so their start overlaps packing.
        actor_cpus: CPUs each actor reserves (fractions allowed).

    Returns:
        :class:`RayPrepackResult`: as :func:`~sftpack.offline.prepack`'s result, with
        ``.seconds`` per stage (``ray_start``, ``read_tokenize``, ``pack``, ``write``,
        ``checksum``, ``finalize``) and per-actor throughput in ``.actors``.

    Raises:
        The first error of the lowest failing unit (a :class:`~sftpack.chat.BadRowError`
        naming file and line in ``on_bad_row="error"`` mode); ``RuntimeError`` when
        a worker cannot load the tokenizer or Ray fails. Nothing is left at ``out``.
    """
    choose(Algorithm, algorithm, "algorithm")
    width = check_row_width(positive_int("max_seq_len", max_seq_len))
    m = positive_int("pad_multiple", pad_multiple)
    if width % m:
        raise ValueError(
            f"max_seq_len={width} is not a multiple of pad_multiple={m}: use max_seq_len={width // m * m or m}"
        )
    workers = positive_int("workers", workers)
    positive_int("limit", limit, allow_none=True)
    unit_size = positive_int("unit_size", unit_size)
    parts = positive_int("write_tasks", write_tasks, allow_none=True)
    if not (isinstance(actor_cpus, (int, float)) and actor_cpus > 0):
        raise ValueError(f"actor_cpus must be a positive number of CPUs, got {actor_cpus!r}")
    ov = choose(Overlong, overlong, "overlong")
    to = choose(TrainOn, train_on, "train_on")
    choose(OnBadRow, on_bad_row, "on_bad_row")
    check_out_outside_inputs(inputs, out)
    out = Path(out)
    seconds: dict[str, float] = {}
    fingerprint: dict[str, Any] = {
        "tokenizer": None,
        "max_seq_len": width,
        "pad_multiple": m,
        "algorithm": str(choose(Algorithm, algorithm, "algorithm")),
        "seed": int(seed),
        "overlong": str(ov),
        "train_on": str(to),
        "on_bad_row": str(on_bad_row),
        "inputs": [],
    }
    options = {"max_seq_len": width, "overlong": str(ov), "train_on": str(to), **_FAULTS}
    t0 = time.perf_counter()
    # one spare logical CPU beyond the actors: Ray Data's own tasks must never wait for a CPU
    with ray_session(ray_address, num_cpus=None if ray_address else workers + 1):
        seconds["ray_start"] = time.perf_counter() - t0
        try:
            with writing(out, overwrite) as output:
                result = _run(
                    inputs,
                    output,
                    tokenizer=tokenizer,
                    options=options,
                    fingerprint=fingerprint,
                    width=width,
                    m=m,
                    algorithm=algorithm,
                    seed=seed,
                    on_bad_row=str(on_bad_row),
                    limit=limit,
                    unit_size=unit_size,
                    workers=workers,
                    parts=parts,
                    actor_cpus=float(actor_cpus),
                    progress=progress,
                    seconds=seconds,
                )
        except OSError as e:
            if isinstance(e, PrepackError) or e.errno is None:
                raise
            raise type(e)(
                e.errno,
                f"writing the prepack {out} failed ({e.strerror or e}{': ' + str(e.filename) if e.filename else ''}); "
                f"nothing was left at {out}: free space or fix permissions and run again",
            ) from e
    seconds["total"] = sum(v for k, v in seconds.items() if k != "total")
    return result


def _run(
    inputs: Any,
    output: Output,
    *,
    tokenizer: Any,
    options: dict[str, Any],
    fingerprint: dict[str, Any],
    width: int,
    m: int,
    algorithm: Any,
    seed: int,
    on_bad_row: str,
    limit: int | None,
    unit_size: int,
    workers: int,
    parts: int | None,
    actor_cpus: float,
    progress: bool,
    seconds: dict[str, float],
) -> RayPrepackResult:
    t0 = time.perf_counter()
    tmp = output.tmp
    staging = tmp / "_staging"
    staging.mkdir()
    units, reader, hashing, fp_inputs = _units(inputs, staging, on_bad_row=on_bad_row, limit=limit, unit_size=unit_size)
    with contextlib.ExitStack() as stack:  # closes the writer pool, however _stages ends
        return _stages(
            output,
            units,
            reader,
            hashing,
            fp_inputs,
            stack=stack,
            parts=parts,
            tokenizer=tokenizer,
            options=options,
            fingerprint=fingerprint,
            width=width,
            m=m,
            algorithm=algorithm,
            seed=seed,
            workers=workers,
            actor_cpus=actor_cpus,
            progress=progress,
            seconds=seconds,
            t0=t0,
        )


def _stages(
    output: Output,
    units: list[_Unit],
    reader: ConversationReader | None,
    hashing: _Hashing | None,
    fp_inputs: list[dict[str, Any]],
    *,
    stack: contextlib.ExitStack,
    parts: int | None,
    tokenizer: Any,
    options: dict[str, Any],
    fingerprint: dict[str, Any],
    width: int,
    m: int,
    algorithm: Any,
    seed: int,
    workers: int,
    actor_cpus: float,
    progress: bool,
    seconds: dict[str, float],
    t0: float,
) -> RayPrepackResult:

    out, tmp = output.out, output.tmp
    staging = tmp / "_staging"
    results = (
        _tokenize_stage(
            units, tokenizer=tokenizer, options=options, workers=workers, actor_cpus=actor_cpus, progress=progress
        )
        if units
        else []
    )
    _raise_first_error(results)
    # start the writers now: their imports overlap merging and packing. One range of rows is
    # written by the driver itself: a writer actor would only add its start (4-8 s) to it.
    tokens = sum(r["tokens"] for r in results)
    n_writers = parts or min(workers, max(1, math.ceil(tokens / WRITE_TOKENS)))
    writers = stack.enter_context(_writer_pool(n_writers)) if n_writers > 1 or parts else []
    staged, unit_samples = _merge(results, staging)
    st = _sum_stats([r["tokenize"] for r in results])
    for k in (
        "conversations",
        "fit",
        "truncated",
        "split",
        "dropped",
        "tokens",
        "tokens_lost",
        "trainable_tokens_lost",
        "no_trainable",
    ):
        st.setdefault(k, 0)
    if reader is not None and units and units[0].source is not None:
        read: dict[str, Any] | None = _sum_stats([r["read"] for r in results])
        read.setdefault("read", 0)
        read.setdefault("kept", 0)
    elif reader is not None:
        read = reader.stats.as_dict()
    else:
        read = None
    extra = _counts_extra(read, st)
    fingerprint["inputs"] = fp_inputs
    if hashing is not None:
        fingerprint["inputs"] = [{"name": "<iterable>", "size": hashing.count, "sha256": hashing.h.hexdigest()}]
    fps = {digest(r["fingerprint"]): r["fingerprint"] for r in results}
    if len(fps) > 1:
        nodes = sorted({(r["node"], r["fingerprint"]["sha256"][:12]) for r in results})
        raise RuntimeError(
            f"the Ray workers loaded different tokenizers (node, tokenizer sha256): {nodes}; give every node the same "
            "tokenizer folder"
        )
    seconds["read_tokenize"] = time.perf_counter() - t0
    if staged.num_samples == 0:
        raise PrepackError(f"nothing to pack: no sample came out of the input (counts: {extra})")
    tok_fp = next(iter(fps.values()))
    fingerprint["tokenizer"] = tok_fp

    t0 = time.perf_counter()
    with _bar(progress, total=1, desc="pack", unit="step") as bar:
        plan = plan_rows(staged.lengths, max_seq_len=width, pad_multiple=m, algorithm=algorithm, seed=seed)
        bar.update(1)
    seconds["pack"] = time.perf_counter() - t0

    vocab, pad_id = tok_fp["vocab_size"], tok_fp["pad_id"]
    if staged.max_id >= vocab:
        raise PrepackError(f"token id {staged.max_id} is outside the vocabulary of {vocab} ids")
    dtype = token_dtype(max(vocab, pad_id + 1))
    t0 = time.perf_counter()
    allocate(tmp, plan, dtype)
    source = _UnitsSource([u.staging for u in units], staged.lengths, unit_samples)
    if writers:
        written = _write_stage(tmp, plan, source, dtype, writers=writers, progress=progress)
    else:
        written = [_write_part(str(tmp), plan, source, dtype.str, (0, plan.num_rows))]
    ids_file = staging / "ids.json8"
    with open(ids_file, "wb") as f:
        for u in units:
            with open(Path(u.staging) / "ids.json8", "rb") as src:
                shutil.copyfileobj(src, f, 1 << 22)
    write_index(
        tmp,
        plan,
        conversation=staged.conversation,
        piece=staged.piece,
        conversation_offsets=staged.conversation_offsets,
        conversation_ids=ids_file,
    )
    seconds["write"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    files = {}
    with _bar(progress, total=len(FILES), desc="checksum", unit="file") as bar:
        for name in FILES:
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
            bar.update(1)
    seconds["checksum"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    shutil.rmtree(staging)
    manifest = build_manifest(
        staged,
        plan,
        extra,
        fingerprint,
        source="conversations",
        pad_id=pad_id,
        dtype=dtype,
        vocab=vocab,
        files=files,
    )
    write_json(tmp / MANIFEST, manifest)
    output.publish()
    seconds["finalize"] = time.perf_counter() - t0
    return RayPrepackResult(out, manifest, seconds, actors=_actor_table(results), writers=written)
