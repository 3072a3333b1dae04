"""The Ray engine: stage 1 on a Ray Data actor pool, stage 3 on Ray writer actors.

The same driver as the local engine plans, checks and publishes; only stages 1
and 3 run on Ray, and the files come out byte-identical (every file, the
manifest included: same counts, same fingerprint, same checksums)::

    driver                                   Ray (a Ray Data actor pool, then writer actors)
    ------                                   -----------------------------------------------
    cut the input into units (one per file,  1. read + tokenize + stage, one unit per call,
      or unit_size conversations), numbered ->  one tokenizer per actor; unit k's samples go to
                                                _staging/u<k>/ (the local stage_samples, so the
                                                same bytes); only lengths, conversation numbers,
    merge the units IN UNIT ORDER        <-     pieces, id offsets and stats come back
    2. plan the rows (the driver's own
       planner), allocate the files      ->  3. write_rows on disjoint row ranges (pwrite at
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
sample merged from the units (length, conversation, piece) and 24 for the plan
(``benchmarks/bench_ray.py`` measures the peak). Ray itself: a 1 GiB object
store by default, and a process per actor (sftpack's imports plus the tokenizer).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._types import TokenizerSpec
from ._driver import run_conversations
from ._encode import ImageCounts, ImageSettings
from ._engine import Conversations, PrepackEngine, Samples, Staged, progress_bar
from ._format import digest
from ._inputs import open_image_inputs, open_inputs, reading_counts
from ._options import PrepackOptions
from ._plan import RowPlan
from ._ray_session import import_ray, ray_session
from ._ray_units import (
    TokenizeActor,
    UnitsSource,
    actor_table,
    make_units,
    merge,
    raise_first_error,
    split_rows,
    sum_stats,
    write_part,
    writer_pool,
)
from ._result import PrepackResult
from ._write import MediaLayout

# split_rows is named here too: benchmarks/bench_ray.py imports it from this module
__all__ = ["RayEngine", "RayPrepackResult", "prepack_ray", "split_rows"]

#: Tokens per write task when ``write_tasks`` is not given (about 80 MB of output).
WRITE_TOKENS = 1 << 24


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


def _failed(stage: str, e: BaseException, outcome: str) -> RuntimeError:
    """A Ray failure of one stage as one line: what failed, and what was left."""
    return RuntimeError(
        f"the Ray {stage} stage failed ({type(e).__name__}: {' '.join(str(e).split())[:500]}); {outcome}"
    )


@dataclass
class _Run:
    """What one run of the engine holds between its stages (the engine's own, never handed out)."""

    stack: contextlib.ExitStack
    writers: list[Any] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    written: list[dict[str, Any]] = field(default_factory=list)


class RayEngine(PrepackEngine):
    """Stages 1 and 3 on Ray (see the module docstring).

    All but ``progress`` and ``after_unit`` are fields of :class:`~sftpack.offline.PrepackOptions`,
    with its defaults and checks (:attr:`SETTINGS`).

    Args:
        workers: tokenize actors (at most one per unit).
        ray_address: join this running cluster; ``None`` starts a private local Ray
            (``workers + 1`` logical CPUs, 1 GiB object store) and stops it after.
            A Ray already initialised in this process is used as is.
        unit_size: conversations per unit for inputs read on the driver.
        write_tasks: writer actors, each writing one range of rows (default: one per
            16 M tokens, at most ``workers``; a single range is written by the driver);
            started after the tokenize stage, so their start overlaps packing.
        actor_cpus: CPUs each actor reserves (fractions allowed).
        progress: tqdm bars for tokenizing and writing.
        after_unit: called in the actor with a unit's key once the unit is staged
            (a hook for tests: one that kills the actor shows a retried unit
            rewrites the same files).
    """

    start_timer = "ray_start"
    #: the fields of :class:`~sftpack.offline.PrepackOptions` this engine takes, with their defaults and checks
    SETTINGS = ("workers", "ray_address", "unit_size", "write_tasks", "actor_cpus")
    workers: int
    ray_address: str | None
    unit_size: int
    write_tasks: int | None
    actor_cpus: float

    def __init__(
        self,
        *,
        progress: bool = False,
        after_unit: Callable[[int], None] | None = None,
        **settings: Any,
    ):
        checked = PrepackOptions.from_settings("RayEngine", settings, self.SETTINGS)
        for name in self.SETTINGS:
            setattr(self, name, getattr(checked, name))
        self.progress = bool(progress)
        self.after_unit = after_unit
        self._run: _Run | None = None

    @classmethod
    def from_options(cls, options: PrepackOptions) -> RayEngine:
        return cls(**{name: getattr(options, name) for name in cls.SETTINGS}, progress=options.progress)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        # one spare logical CPU beyond the actors: Ray Data's own tasks must never wait for a CPU
        with (
            ray_session(self.ray_address, num_cpus=None if self.ray_address else self.workers + 1),
            contextlib.ExitStack() as stack,  # closes the writer pool, however the run ends
        ):
            self._run = _Run(stack)
            try:
                yield
            finally:
                self._run = None

    def _state(self) -> _Run:
        if self._run is None:
            raise RuntimeError("RayEngine.stage/write run inside RayEngine.session() (the driver enters it)")
        return self._run

    def stage(self, work: Conversations | Samples, staging: Path) -> Staged:
        if not isinstance(work, Conversations):
            raise TypeError("the Ray engine tokenizes conversations; write samples with the local engine")
        state = self._state()
        o = work.options
        staging.mkdir(parents=True, exist_ok=True)
        images: ImageSettings | None = None
        if o.images:  # settings made here, once: the actors get the tokenizer and processor objects
            if isinstance(work.tokenizer, (str, os.PathLike)):
                raise TypeError(
                    f"a prepack with images takes a tokenizer object (or None: the family's), not the path "
                    f"{os.fspath(work.tokenizer)!r}"
                )
            images = work.image_settings()
            inputs = open_image_inputs(work.inputs, limit=o.limit)
        else:
            inputs = open_inputs(work.inputs, on_bad_row=o.on_bad_row, limit=o.limit)
        units, workers_read = make_units(inputs, staging, unit_size=self.unit_size, raw=images is not None)
        options = {
            "max_seq_len": o.max_seq_len,
            "pad_multiple": o.pad_multiple,
            "overlong": str(o.overlong),
            "train_on": str(o.train_on),
            "on_bad_row": str(o.on_bad_row),
        }
        results = self._tokenize(units, work.tokenizer, options, images) if units else []
        raise_first_error(results)
        # start the writers now: their imports overlap merging and packing. One range of rows is
        # written by the driver itself: a writer actor would only add its start to it.
        tokens = sum(r["tokens"] for r in results)
        n_writers = self.write_tasks or min(self.workers, max(1, math.ceil(tokens / WRITE_TOKENS)))
        if n_writers > 1 or self.write_tasks:
            state.writers = state.stack.enter_context(writer_pool(n_writers))
        staged, unit_samples = merge(results, staging)
        if images is not None:
            image_counts = ImageCounts()
            for r in results:
                image_counts.merge(r["images"])
            counts = image_counts.manifest()
        elif workers_read:
            counts = reading_counts(
                sum_stats([r["read"] for r in results]), sum_stats([r["tokenize"] for r in results])
            )
        else:
            read = inputs.reader.stats.as_dict() if inputs.reader is not None else None
            counts = reading_counts(read, sum_stats([r["tokenize"] for r in results]))
        fps = {digest(r["fingerprint"]): r["fingerprint"] for r in results}
        if len(fps) > 1:
            nodes = sorted({(r["node"], r["fingerprint"]["sha256"][:12]) for r in results})
            raise RuntimeError(
                f"the Ray workers loaded different tokenizers (node, tokenizer sha256): {nodes}; give every node the "
                "same tokenizer folder"
            )
        ids_file = staging / "ids.json8"
        with open(ids_file, "wb") as f:
            for u in units:
                with open(Path(u.staging) / "ids.json8", "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 22)
        state.results = results
        pixel_offsets = None if staged.media is None else [r["media"].pixel_offsets for r in results]
        return Staged(
            staged,
            UnitsSource(
                [u.staging for u in units],
                staged.lengths,
                unit_samples,
                pixel_offsets,
                weighted=[bool(r.get("weighted")) for r in results],
            ),
            ids_file,
            counts,
            inputs=inputs.fingerprint(),
            tokenizer=next(iter(fps.values()), None),
            media=None if images is None or staged.media is None else images.manifest_entry(staged.media),
        )

    def _tokenize(
        self,
        units: list[Any],
        tokenizer: TokenizerSpec,
        options: dict[str, Any],
        images: ImageSettings | None = None,
    ) -> list[dict[str, Any]]:
        ray = import_ray()
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        rows = [{"key": u.key, "unit": pickle.dumps(u, protocol=5)} for u in units]
        ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows)))
        ds = ds.map_batches(
            TokenizeActor,
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=min(self.workers, max(1, len(units)))),
            fn_constructor_kwargs={
                "tokenizer": tokenizer,
                "options": options,
                "after_unit": self.after_unit,
                "images": images,
            },
            num_cpus=self.actor_cpus,
        )
        if len(units) < self.workers:
            warnings.warn(
                f"only {len(units)} unit(s) of work (one per input file) for {self.workers} workers: "
                f"{self.workers - len(units)} worker(s) stay idle; split the input into more files to use them",
                UserWarning,
                stacklevel=2,
            )
        results: dict[int, dict[str, Any]] = {}
        # our own bar replaces Ray Data's; keep its INFO lines and its "progress bars disabled" note quiet
        quiet = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}
        saved = {name: logging.getLogger(name).level for name in quiet}
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)
        try:
            with progress_bar(self.progress, total=len(units), desc="tokenize (ray)", unit="unit") as bar:
                for row in ds.iter_rows():
                    r = pickle.loads(row["result"])
                    results[int(r["key"])] = r
                    bar.update(1)
        except ray.exceptions.RayError as e:
            raise _failed("tokenize", e, "nothing was written") from e
        finally:
            for name, level in saved.items():
                logging.getLogger(name).setLevel(level)
        missing = sorted(set(range(len(units))) - set(results))
        if missing:
            raise RuntimeError(f"the Ray tokenize stage lost units {missing[:10]}: nothing was written; run again")
        return [results[k] for k in range(len(units))]

    def write(
        self, directory: Path, plan: RowPlan, staged: Staged, dtype: np.dtype, media: MediaLayout | None = None
    ) -> None:
        state = self._state()
        source = staged.source
        if not state.writers:
            state.written = [write_part(str(directory), plan, source, dtype.str, (0, plan.num_rows), media)]
            return
        ray = import_ray()
        plan_ref, source_ref, media_ref = ray.put(plan), ray.put(source), ray.put(media)
        ranges = split_rows(plan, len(state.writers))
        pending = [
            state.writers[i].write.remote(str(directory), plan_ref, source_ref, dtype.str, rows, media_ref)
            for i, rows in enumerate(ranges)
        ]
        done: list[dict[str, Any]] = []
        try:
            with progress_bar(self.progress, total=len(pending), desc="write (ray)", unit="part") as bar:
                while pending:
                    ready, pending = ray.wait(pending, num_returns=1)
                    done.append(ray.get(ready[0]))
                    bar.update(1)
        except ray.exceptions.RayError as e:
            raise _failed("write", e, "nothing was published") from e
        state.written = sorted(done, key=lambda d: d["rows"])

    def result(self, path: Path, manifest: dict[str, Any], seconds: dict[str, float]) -> RayPrepackResult:
        state = self._state()
        return RayPrepackResult(path, manifest, seconds, actors=actor_table(state.results), writers=state.written)


def prepack_ray(
    inputs: Any = None,
    out: str | os.PathLike[str] = "prepack",
    *,
    tokenizer: TokenizerSpec = None,
    **options: Any,
) -> RayPrepackResult:
    """:func:`sftpack.offline.prepack` on Ray: the same directory, byte for byte.

    Args:
        inputs, out: as :func:`sftpack.offline.prepack`. Files are read on the workers,
            one unit per file (and per saved dataset); the embedded corpus, an
            iterable, or any input with ``limit`` is read on the driver and shipped
            in units of ``unit_size`` conversations.
        tokenizer: ``None`` (the embedded Qwen tokenizer, on every worker), the path
            of a tokenizer folder that every node sees at that path (each actor
            loads it; the driver never does), or a tokenizer object (pickled to
            the actors; fine on one machine).
        options: any field of :class:`~sftpack.offline.PrepackOptions` by keyword:
            ``max_seq_len``, ``pad_multiple``, ``algorithm``, ``seed``, ``overlong``,
            ``train_on``, ``on_bad_row``, ``limit``, ``overwrite``, ``progress`` as
            :func:`sftpack.offline.prepack`; ``workers`` (default 2), ``ray_address``,
            ``unit_size`` (1,024), ``write_tasks`` and ``actor_cpus`` (1.0) as
            :class:`RayEngine`.

    Returns:
        :class:`RayPrepackResult`: as :func:`~sftpack.offline.prepack`'s result, with
        ``.seconds`` per stage (``ray_start``, ``read_tokenize``, ``pack``, ``write``,
        ``checksum``, ``finalize``) and per-actor throughput in ``.actors``.

    Raises:
        The first error of the lowest failing unit (a :class:`~sftpack.chat.BadRowError`
        naming file and line in ``on_bad_row="error"`` mode); ``RuntimeError`` when
        a worker cannot load the tokenizer or Ray fails. Nothing is left at ``out``.
    """
    if options.get("engine", "ray") != "ray":
        raise ValueError(f"prepack_ray runs the Ray engine, not engine={options['engine']!r}: call prepack")
    settings = PrepackOptions.from_settings("prepack_ray", {**options, "engine": "ray"})
    result = run_conversations(inputs, out, tokenizer, settings, RayEngine.from_options(settings))
    assert isinstance(result, RayPrepackResult)
    return result
