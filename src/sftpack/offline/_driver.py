"""The one driver of every prepack: an engine stages and writes, the driver decides the rest.

:func:`run` takes a :class:`Job` (the work of stage 1, the planner of stage 2,
the fingerprint entries the caller knows, the output) and an engine
(:class:`~sftpack.offline.engine.PrepackEngine`), and does, in order::

    engine.session()                     start what the engine needs (Ray: the cluster)
      writing(out)                       a hidden partial folder next to ``out``
        engine.stage(work)               1. read + tokenize + stage -> Staged
        planner.plan(lengths)            2. the RowPlan (the same for every engine; with images,
                                            their vision patches as the second budget's weights;
                                            with preference pairs, each pair one group)
        vocabulary and token dtype       from the tokenizer's fingerprint, else the largest id
        allocate; engine.write(plan)     3. the rows, at the offsets the plan fixed (and with
                                            images, the media columns: media_layout)
        write_index                      sequences, rows, conversation ids (row_images)
        checksums, manifest              counts checked against the accounting identities
        publish                          the atomic rename (``_publish``)

An ``OSError`` on the way (a full disk, a permission) is raised again naming
the output, the step and the fix; the partial folder is removed, so nothing
that opens as a prepack is left. The manifest is built from values only: the
staged result, the plan and the job's fingerprint entries; nothing changes
them after they are handed over.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike

from .. import __version__
from .._types import TokenizerSpec
from ._engine import Conversations, PrepackEngine, Samples, Staged, progress_bar
from ._format import (
    COLUMNS_FORMAT_VERSION,
    FILES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MEDIA_FILES,
    MEDIA_FORMAT_VERSION,
    PAIR_ROLES,
    PrepackError,
    column_files,
    digest,
    file_sha256,
    seal_manifest,
    token_dtype,
    write_json,
)
from ._inputs import check_inputs_found, check_out_outside_inputs
from ._options import PrepackOptions
from ._plan import RowPlan
from ._publish import writing
from ._result import PrepackResult
from ._stage import StagedSamples
from ._write import allocate, media_layout, write_index

__all__ = ["Job", "Planner", "build_manifest", "run", "run_conversations"]


class Planner(Protocol):
    """Stage 2: :class:`~sftpack.offline._plan.BinPack` or :class:`~sftpack.offline._plan.KeepRows`."""

    def plan(
        self,
        lengths: ArrayLike,
        row_sizes: Iterable[int] | None = None,
        weights: ArrayLike | None = None,
        groups: ArrayLike | None = None,
    ) -> RowPlan: ...

    def fingerprint(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Job:
    """One prepack to write.

    Attributes:
        out: the directory to create.
        work: stage 1's work (:class:`~sftpack.offline.engine.Conversations` or
            :class:`~sftpack.offline.engine.Samples`).
        planner: stage 2.
        fingerprint: the fingerprint entries the caller knows (options, a source
            file, a tokenizer); the staged inputs and tokenizer and the layout are added.
        source: recorded as ``manifest["source"]``.
        vocab_size: ids are below this (``None``: the tokenizer's, else the largest id + 1).
        pad_id: the id of padding slots (``None``: the tokenizer's, else 0).
        overwrite: replace a prepack at ``out``.
        progress: tqdm bars for the driver's stages.
    """

    out: Path
    work: Conversations | Samples
    planner: Planner
    fingerprint: dict[str, Any]
    source: str = "conversations"
    vocab_size: int | None = None
    pad_id: int | None = None
    overwrite: bool = False
    progress: bool = False


def _check_identity(counts: dict[str, Any]) -> None:
    """The accounting identities; a violation is a bug, raised, never written."""
    c = counts
    checks = [
        ("read == kept + sum(dropped)", c["read"], c["kept"] + sum(c["dropped"].values())),
        ("tokens_rendered == tokens + tokens_lost", c["tokens_rendered"], c["tokens"] + c["tokens_lost"]),
        (
            "labels == trainable_tokens - first_token_trainable",
            c["labels"],
            c["trainable_tokens"] - c["first_token_trainable"],
        ),
        ("slots == rows * max_seq_len", c["slots"], c["rows"] * c["max_seq_len"]),
    ]
    oc = c.get("overlong")
    if oc:
        checks.append(
            (
                "tokenized == fit + truncated + split + dropped",
                oc["tokenized"],
                oc["fit"] + oc["truncated"] + oc["split"] + oc["dropped"],
            )
        )
        checks.append(
            (
                "packed_conversations == fit + truncated + split",
                c["packed_conversations"],
                oc["fit"] + oc["truncated"] + oc["split"],
            )
        )
    for name, a, b in checks:
        if a != b:
            raise RuntimeError(f"prepack accounting broke: {name} ({a} != {b}); please report this bug")


def _counts(staged: StagedSamples, plan: RowPlan, reading: dict[str, Any]) -> dict[str, Any]:
    rows, width = plan.num_rows, plan.max_seq_len
    slots = rows * width
    counts = {
        "packed_conversations": staged.num_conversations,
        "sequences": staged.num_samples,
        "tokens": staged.tokens,
        "trainable_tokens": staged.trainable,
        "labels": staged.labels,
        "first_token_trainable": staged.first_trainable,
        "rows": rows,
        "max_seq_len": width,
        "slots": slots,
        "padding": slots - staged.tokens,
        "fill": staged.tokens / slots if slots else 0.0,
        "l1": plan.l1,
        "l2": plan.l2,
        "gap_l1": rows / plan.l1 - 1 if plan.l1 else 0.0,
        "max_sequences_per_row": int(np.diff(plan.row_offsets).max()) if rows else 0,
    }
    counts.update(reading)
    counts.setdefault("tokens_lost", 0)
    counts.setdefault("trainable_tokens_lost", 0)
    counts.setdefault("tokens_rendered", counts["tokens"] + counts["tokens_lost"])
    return counts


def build_manifest(
    staged: StagedSamples,
    plan: RowPlan,
    reading: dict[str, Any],
    fingerprint: dict[str, Any],
    *,
    source: str,
    pad_id: int,
    dtype: np.dtype,
    vocab: int,
    files: dict[str, Any],
    media: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of a finished prepack: the counts, checked against the accounting
    identities, and the fingerprint, sealed with its own digest, and the whole manifest
    sealed with ``manifest_sha256``. With ``media`` (a prepack with images): format version
    4 and the ``media`` entry (what is stored per image, the family, the processor's settings, totals).
    With weights or preference pairs (the staged ``weighted`` / ``roles``): format version 5 and
    the ``weights`` / ``pairs`` entries, named in the fingerprint's ``columns`` too."""
    counts = _counts(staged, plan, reading)
    _check_identity(counts)
    extra: dict[str, Any] = {}
    if staged.weighted:
        extra["weights"] = {"dtype": "float64"}
    if staged.roles is not None:
        extra["pairs"] = {"roles": list(PAIR_ROLES), "pairs": staged.num_conversations}
    if extra:  # an SFT prepack's fingerprint stays what it was
        fingerprint = dict(fingerprint, columns=sorted(extra))
    if media is not None:
        keys = ("kind", "family", "processor", "image_token_id")
        fingerprint = dict(fingerprint, media={k: media[k] for k in keys if k in media})
        extra["media"] = media
    # the layout the rows were built with, as the reader checks it against the manifest's own entries
    fingerprint = dict(
        fingerprint,
        sftpack_version=__version__,
        max_seq_len=plan.max_seq_len,
        pad_multiple=plan.pad_multiple,
        pad_id=int(pad_id),
    )
    fingerprint["sha256"] = digest({k: v for k, v in fingerprint.items() if k != "sha256"})
    return seal_manifest(
        {
            "format": FORMAT,
            "format_version": MEDIA_FORMAT_VERSION
            if media is not None
            else COLUMNS_FORMAT_VERSION
            if extra
            else FORMAT_VERSION,
            "sftpack_version": __version__,
            "source": source,
            "max_seq_len": plan.max_seq_len,
            "pad_multiple": plan.pad_multiple,
            "pad_id": int(pad_id),
            "pad_between_seqs": True,
            "token_dtype": dtype.name,
            "vocab_size": int(vocab),
            "fingerprint": fingerprint,
            "counts": counts,
            "files": files,
            **extra,
        }
    )


def _checksums(directory: Path, progress: bool, media: bool = False, columns: tuple[str, ...] = ()) -> dict[str, Any]:
    files = {}
    names = (FILES + MEDIA_FILES if media else FILES) + columns
    with progress_bar(progress, total=len(names), desc="checksum", unit="file") as bar:
        for name in names:
            files[name] = {"bytes": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
            bar.update(1)
    return files


def _fingerprint(job: Job, staged: Staged) -> dict[str, Any]:
    """The job's entries, the planner's, and what stage 1 found (a new dict: nothing handed over changes)."""
    fp = {**job.fingerprint, **job.planner.fingerprint()}
    if staged.tokenizer is not None:
        fp["tokenizer"] = staged.tokenizer
    if staged.inputs is not None:
        fp["inputs"] = staged.inputs
    return fp


def run(job: Job, engine: PrepackEngine) -> PrepackResult:
    """Write ``job`` with ``engine`` (see the module docstring); returns the engine's result."""
    out = Path(job.out)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    with engine.session():
        if engine.start_timer:
            seconds[engine.start_timer] = time.perf_counter() - t0
        step = "creating the output folder"
        try:
            with writing(out, job.overwrite) as output:
                tmp = output.tmp
                staging = tmp / "_staging"
                step = "staging the tokenized samples (stage 1)"
                t0 = time.perf_counter()
                staged = engine.stage(job.work, staging)
                seconds["read_tokenize"] = time.perf_counter() - t0
                s = staged.samples
                if s.num_samples == 0:
                    raise PrepackError(f"nothing to pack: no sample came out of the input (counts: {staged.counts})")
                t0 = time.perf_counter()
                with progress_bar(job.progress, total=1, desc="pack", unit="step") as bar:
                    # with images, their vision patches: the second budget's weights
                    patches = None if s.media is None else s.media.patches
                    plan = job.planner.plan(s.lengths, staged.row_sizes, weights=patches, groups=s.groups)
                    bar.update(1)
                seconds["pack"] = time.perf_counter() - t0
                tok = staged.tokenizer or {}
                vocab = job.vocab_size if job.vocab_size is not None else tok.get("vocab_size", s.max_id + 1)
                pad_id = job.pad_id if job.pad_id is not None else tok.get("pad_id", 0)
                if s.max_id >= vocab:
                    raise PrepackError(f"token id {s.max_id} is outside the vocabulary of {vocab} ids")
                dtype = token_dtype(max(vocab, pad_id + 1))
                step = "writing the rows (stage 3)"
                t0 = time.perf_counter()
                layout = None if s.media is None else media_layout(plan, s.media)
                allocate(tmp, plan, dtype, layout, weighted=s.weighted)
                if layout is None:  # an engine written for text takes no media
                    engine.write(tmp, plan, staged, dtype)
                else:
                    engine.write(tmp, plan, staged, dtype, media=layout)
                write_index(
                    tmp,
                    plan,
                    conversation=s.conversation,
                    piece=s.piece,
                    conversation_offsets=s.conversation_offsets,
                    conversation_ids=staged.conversation_ids,
                    media=layout,
                    roles=s.roles,
                )
                seconds["write"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                columns = column_files({"weights": s.weighted or None, "pairs": s.roles})
                files = _checksums(tmp, job.progress, media=staged.media is not None, columns=columns)
                seconds["checksum"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                step = "writing the manifest"
                shutil.rmtree(staging)
                manifest = build_manifest(
                    s,
                    plan,
                    staged.counts,
                    _fingerprint(job, staged),
                    source=job.source,
                    pad_id=pad_id,
                    dtype=dtype,
                    vocab=vocab,
                    files=files,
                    media=staged.media,
                )
                write_json(tmp / MANIFEST, manifest)
                step = "publishing the prepack"
                output.publish()
                seconds["finalize"] = time.perf_counter() - t0
        except OSError as e:
            if isinstance(e, PrepackError):
                raise
            why = e.strerror or str(e)
            where = f": {e.filename}" if e.filename else ""
            err = OSError(
                f"writing the prepack {out} failed while {step} ({why}{where}); nothing was left at {out}: "
                "free disk space or fix permissions and run again"
            )
            err.errno = e.errno
            raise err from e
        seconds["total"] = sum(v for k, v in seconds.items() if k != "total")
        return engine.result(out, manifest, seconds)


def run_conversations(
    inputs: Any,
    out: str | os.PathLike[str],
    tokenizer: TokenizerSpec,
    options: PrepackOptions,
    engine: PrepackEngine,
    *,
    processor: Any = None,
    fingerprint: dict[str, Any] | None = None,
) -> PrepackResult:
    """:func:`run` for conversations, with or without images (what :func:`~sftpack.offline.prepack`
    and :func:`~sftpack.offline.prepack_ray` write): the output checked against the inputs
    first, then the options' planner and fingerprint (``fingerprint``: the caller's extra entries)."""
    if not options.images:  # (a prepack with images takes conversations, never paths: refused as such)
        check_inputs_found(inputs)  # a missing input said as such, not as a failed write of the output
    check_out_outside_inputs(inputs, out)
    job = Job(
        Path(out),
        Conversations(inputs, tokenizer, options, processor),
        options.packing(),
        {**options.fingerprint(), **(fingerprint or {})},
        source="multimodal conversations" if options.images else "conversations",
        overwrite=options.overwrite,
        progress=options.progress,
    )
    return run(job, engine)
