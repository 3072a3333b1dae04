"""``prepack``: conversations in, a checksummed prepack directory out, in three stages.

    1. read + tokenize  (:func:`~sftpack.offline._stage.stage_samples`)   samples -> staging files + lengths
    2. pack             (:func:`~sftpack.offline._plan.plan_rows`)        lengths -> RowPlan
    3. write            (:func:`~sftpack.offline._write.write_rows`)      RowPlan + token source -> files

then the index, the checksums and the manifest, and an atomic rename
(:mod:`~sftpack.offline._publish`). The stages share nothing but the staged
lengths and the plan, so another engine can run stages 1 and 3 elsewhere and,
given the same samples in the same order, write the same bytes.

On the embedded corpus (4,017 conversations, 3.55 M Qwen tokens, 2-core Xeon)
the run is dominated by tokenizing; packing takes milliseconds and writing
and hashing about 0.1 s (numbers: ``benchmarks/bench_offline.py``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from .._base import StrEnum, choose, positive_int, round_up
from ..binpack import Algorithm
from ..chat import ConversationReader, Overlong, TrainOn, read_conversations, tokenize_conversations
from ..handoff import Sample, padded_lengths
from ._fingerprint import digest, input_fingerprints, pad_id_of, tokenizer_fingerprint
from ._format import (
    FILES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PrepackError,
    check_row_width,
    file_sha256,
    seal_manifest,
    token_dtype,
    write_json,
)
from ._plan import RowPlan, plan_from_membership, plan_rows
from ._publish import writing
from ._stage import StagedSamples, stage_samples
from ._write import allocate, write_index, write_rows

__all__ = ["Engine", "PrepackResult", "prepack", "prepack_samples"]


class Engine(StrEnum):
    """Where stages 1 and 3 run."""

    LOCAL = "local"  #: this process (and ``num_proc`` tokenizer workers)
    RAY = "ray"  #: Ray Data actors tokenize, Ray actors write (:func:`~sftpack.offline.prepack_ray`): same bytes


@dataclass
class PrepackResult:
    """What :func:`prepack` wrote: the directory, its manifest, and the time per stage (s)."""

    path: Path
    manifest: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, Any]:
        return self.manifest["counts"]


def _bar(progress: bool, **kw: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, dynamic_ncols=True, file=sys.stderr, **kw)


def _is_paths(inputs: Any) -> bool:
    if isinstance(inputs, (str, os.PathLike)):
        return True
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(p, (str, os.PathLike)) for p in inputs):
        return True
    return type(inputs).__module__.startswith("datasets.")


class _Hashing:
    """Passes conversations through, hashing their ids and messages (for iterable inputs)."""

    def __init__(self, items: Iterable[Any]):
        self.items = items
        self.h = hashlib.sha256()
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            cid = getattr(item, "id", None)
            msgs = getattr(item, "messages", item.get("messages") if isinstance(item, dict) else item)
            self.h.update(json.dumps([cid, msgs], sort_keys=True, default=str).encode())
            self.count += 1
            yield item


def check_out_outside_inputs(inputs: Any, out: str | os.PathLike[str]) -> None:
    """Refuse an output folder inside an input folder (a folder is read recursively, so the
    next run would read the prepack's own files as conversations), an input inside the output,
    or the output given as an input."""
    if inputs is None or not _is_paths(inputs) or type(inputs).__module__.startswith("datasets."):
        return
    given = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    target = Path(out).resolve()
    for p in given:
        text = os.fspath(p)
        found = sorted(glob.glob(text, recursive=True)) if not os.path.exists(text) and glob.has_magic(text) else [text]
        for f in found:
            src = Path(f).resolve()
            if src == target or src.is_relative_to(target):
                raise PrepackError(
                    f"the input {f} is inside --out {out}: a prepack's own files are not conversations; "
                    "name the inputs without the output folder, or choose an --out outside them"
                )
            if Path(f).is_dir() and target.is_relative_to(src):
                raise PrepackError(
                    f"--out {out} is inside the input folder {f}, which is read recursively: the next run would "
                    "read the prepack's own files as input; choose an --out outside it"
                )


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


def _write_all(
    tmp: Path,
    staged: StagedSamples,
    plan: RowPlan,
    dtype: np.dtype,
    *,
    progress: bool,
    seconds: dict[str, float],
) -> dict[str, Any]:
    t0 = time.perf_counter()
    allocate(tmp, plan, dtype)
    with _bar(progress, total=plan.num_rows, desc="write", unit="row") as bar:
        write_rows(tmp, plan, staged.source(), dtype, on_chunk=bar.update)
    write_index(
        tmp,
        plan,
        conversation=staged.conversation,
        piece=staged.piece,
        conversation_offsets=staged.conversation_offsets,
        conversation_ids=staged.source().conversation_ids_path(),
    )
    seconds["write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    files = {}
    with _bar(progress, total=len(FILES), desc="checksum", unit="file") as bar:
        for name in FILES:
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
            bar.update(1)
    seconds["checksum"] = time.perf_counter() - t0
    return files


def _counts(staged: StagedSamples, plan: RowPlan, extra: dict[str, Any]) -> dict[str, Any]:
    rows, width = plan.num_rows, plan.row_width
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
    counts.update(extra)
    counts.setdefault("tokens_lost", 0)
    counts.setdefault("trainable_tokens_lost", 0)
    counts.setdefault("tokens_rendered", counts["tokens"] + counts["tokens_lost"])
    return counts


def build_manifest(
    staged: Any,
    plan: RowPlan,
    extra: dict[str, Any],
    fingerprint: dict[str, Any],
    *,
    source: str,
    pad_id: int,
    dtype: np.dtype,
    vocab: int,
    files: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of a finished prepack (every engine writes exactly this): the
    counts, checked against the accounting identities, and the fingerprint, sealed
    with its own digest, and the whole manifest sealed with ``manifest_sha256``."""
    from .. import __version__

    counts = _counts(staged, plan, extra)
    _check_identity(counts)
    # the layout the rows were built with, as the reader checks it against the manifest's own entries
    fingerprint = dict(
        fingerprint,
        sftpack_version=__version__,
        max_seq_len=plan.row_width,
        pad_multiple=plan.pad_multiple,
        pad_id=int(pad_id),
    )
    fingerprint["sha256"] = digest({k: v for k, v in fingerprint.items() if k != "sha256"})
    return seal_manifest(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "sftpack_version": __version__,
            "source": source,
            "max_seq_len": plan.row_width,
            "pad_multiple": plan.pad_multiple,
            "pad_id": int(pad_id),
            "pad_between_seqs": True,
            "token_dtype": dtype.name,
            "vocab_size": int(vocab),
            "fingerprint": fingerprint,
            "counts": counts,
            "files": files,
        }
    )


def _finish(
    out: Path,
    *,
    samples: Iterable[Sample],
    make_plan: Callable[[np.ndarray], RowPlan],
    counts_after: Callable[[], dict[str, Any]],
    vocab_size: int | None,
    pad_id: int,
    fingerprint: dict[str, Any],
    source_kind: str,
    overwrite: bool,
    progress: bool,
    seconds: dict[str, float],
) -> PrepackResult:

    out = Path(out)
    stage = "creating the output folder"
    try:
        with writing(out, overwrite) as output:
            tmp = output.tmp
            stage = "staging the tokenized samples (stage 1)"
            t0 = time.perf_counter()
            staged = stage_samples(samples, tmp / "_staging")
            seconds["read_tokenize"] = time.perf_counter() - t0
            extra = counts_after()
            if staged.num_samples == 0:
                raise PrepackError(f"nothing to pack: no sample came out of the input (counts: {extra})")
            t0 = time.perf_counter()
            with _bar(progress, total=1, desc="pack", unit="step") as bar:
                plan = make_plan(staged.lengths)
                bar.update(1)
            seconds["pack"] = time.perf_counter() - t0
            vocab = vocab_size if vocab_size is not None else staged.max_id + 1
            if staged.max_id >= vocab:
                raise PrepackError(f"token id {staged.max_id} is outside the vocabulary of {vocab} ids")
            dtype = token_dtype(max(vocab, pad_id + 1))
            stage = "writing the rows (stage 3)"
            files = _write_all(tmp, staged, plan, dtype, progress=progress, seconds=seconds)
            t0 = time.perf_counter()
            import shutil

            stage = "writing the manifest"
            shutil.rmtree(tmp / "_staging")
            manifest = build_manifest(
                staged,
                plan,
                extra,
                fingerprint,
                source=source_kind,
                pad_id=pad_id,
                dtype=dtype,
                vocab=vocab,
                files=files,
            )
            write_json(tmp / MANIFEST, manifest)
            stage = "publishing the prepack"
            output.publish()
            seconds["finalize"] = time.perf_counter() - t0
    except OSError as e:
        if isinstance(e, PrepackError):
            raise
        why = e.strerror or str(e)
        where = f": {e.filename}" if e.filename else ""
        err = OSError(
            f"writing the prepack {out} failed while {stage} ({why}{where}); nothing was left at {out}: "
            "free disk space or fix permissions and run again"
        )
        err.errno = e.errno
        raise err from e
    seconds["total"] = sum(v for k, v in seconds.items() if k != "total")
    return PrepackResult(out, manifest, seconds)


def prepack(
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
    num_proc: int = 1,
    engine: str | Engine = "local",
    workers: int = 2,
    ray_address: str | None = None,
    limit: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> PrepackResult:
    """Read, tokenize, bin-pack and write conversations as a prepack directory.

    Args:
        inputs: paths as :func:`sftpack.chat.read_conversations` takes them (JSONL /
            ``.gz``, Parquet, saved Hugging Face datasets, folders, globs), a
            ``ConversationReader``, an iterable of conversations, or ``None`` for
            the embedded corpus (:func:`sftpack.data.default_corpus`).
        out: the directory to create (refused if it exists, unless ``overwrite``).
        tokenizer: a Hugging Face fast tokenizer with a chat template (default:
            :func:`sftpack.data.default_tokenizer`).
        max_seq_len: row width ``T``; also the over-long limit for one conversation.
        pad_multiple: pad each sequence to a multiple of this (``2*CP``; see
            :func:`sftpack.handoff.pad_multiple_for`); ``max_seq_len`` must be a multiple.
        algorithm, seed: the bin packer (:func:`sftpack.binpack.pack`).
        overlong, train_on: as :func:`sftpack.chat.tokenize_conversations`.
        on_bad_row: ``"skip"`` (count bad rows) or ``"error"`` (stop at the first, naming file and line).
        num_proc: tokenizer processes; the files do not depend on it.
        engine: ``"local"`` or ``"ray"`` (:func:`~sftpack.offline.prepack_ray`; the same files).
        workers, ray_address: the Ray engine's actors and cluster (``None``: a private local Ray).
        limit: first ``limit`` conversations only.
        overwrite: replace an existing prepack at ``out``.
        progress: tqdm bars per stage on stderr.

    Returns:
        :class:`PrepackResult` (``.path``, ``.manifest``, ``.counts``, ``.seconds``).
    """
    if choose(Engine, engine, "engine") is Engine.RAY:
        from ._ray import prepack_ray  # imports ray only when called

        return prepack_ray(
            inputs,
            out,
            tokenizer=tokenizer,
            max_seq_len=max_seq_len,
            pad_multiple=pad_multiple,
            algorithm=algorithm,
            seed=seed,
            overlong=overlong,
            train_on=train_on,
            on_bad_row=on_bad_row,
            workers=workers,
            ray_address=ray_address,
            limit=limit,
            overwrite=overwrite,
            progress=progress,
        )
    choose(Algorithm, algorithm, "algorithm")
    width = check_row_width(positive_int("max_seq_len", max_seq_len))
    m = positive_int("pad_multiple", pad_multiple)
    if width % m:
        raise ValueError(
            f"max_seq_len={width} is not a multiple of pad_multiple={m}: use max_seq_len={width // m * m or m}"
        )
    check_out_outside_inputs(inputs, out)
    positive_int("num_proc", num_proc)
    positive_int("limit", limit, allow_none=True)
    if tokenizer is None:
        from ..data import default_tokenizer

        tokenizer = default_tokenizer()
    reader: ConversationReader | None = None
    hashing: _Hashing | None = None
    if inputs is None:
        from ..data import default_corpus

        conversations: Iterable[Any] = default_corpus(limit)
        fp_inputs = input_fingerprints(None)
        fp_inputs[0]["limit"] = limit
    elif isinstance(inputs, ConversationReader) or _is_paths(inputs):
        reader = inputs if isinstance(inputs, ConversationReader) else read_conversations(inputs, on_bad_row=on_bad_row)
        conversations = reader if limit is None else islice(reader, limit)
        fp_inputs = input_fingerprints(reader)
    else:
        hashing = _Hashing(inputs if limit is None else islice(inputs, limit))
        conversations = hashing
        fp_inputs = []
    tokenized = tokenize_conversations(
        conversations,
        tokenizer,
        max_seq_len=width,
        overlong=overlong,
        train_on=train_on,
        num_proc=num_proc,
        progress=progress,
    )
    tok_fp = tokenizer_fingerprint(tokenizer)
    opts = tokenized.opts
    fingerprint = {
        "tokenizer": tok_fp,
        "max_seq_len": width,
        "pad_multiple": m,
        "algorithm": str(choose(Algorithm, algorithm, "algorithm")),
        "seed": int(seed),
        "overlong": str(opts.overlong),
        "train_on": str(opts.train_on),
        "on_bad_row": str(on_bad_row),
        "inputs": fp_inputs,
    }

    def counts_after() -> dict[str, Any]:
        st = tokenized.stats
        if reader is not None:
            rs = reader.stats
            read = {"read": rs.read, "kept": rs.kept, "dropped": dict(sorted(rs.dropped.items()))}
        else:
            read = {"read": st.conversations, "kept": st.conversations, "dropped": {}}
        if hashing is not None:
            fingerprint["inputs"] = [{"name": "<iterable>", "size": hashing.count, "sha256": hashing.h.hexdigest()}]
        return {
            **read,
            "overlong": {
                "tokenized": st.conversations,
                "fit": st.fit,
                "truncated": st.truncated,
                "split": st.split,
                "dropped": st.dropped,
            },
            "tokens_lost": st.tokens_lost,
            "trainable_tokens_lost": st.trainable_tokens_lost,
            "tokens_rendered": st.tokens + st.tokens_lost,
            "no_trainable": st.no_trainable,
        }

    seconds: dict[str, float] = {}
    return _finish(
        Path(out),
        samples=tokenized,
        make_plan=lambda lengths: plan_rows(lengths, max_seq_len=width, pad_multiple=m, algorithm=algorithm, seed=seed),
        counts_after=counts_after,
        vocab_size=tok_fp["vocab_size"],
        pad_id=tok_fp["pad_id"],
        fingerprint=fingerprint,
        source_kind="conversations",
        overwrite=overwrite,
        progress=progress,
        seconds=seconds,
    )


def prepack_samples(
    samples: Iterable[Sample],
    out: str | os.PathLike[str],
    *,
    max_seq_len: int | None,
    pad_multiple: int = 1,
    algorithm: str | Algorithm = "bfd",
    seed: int = 0,
    row_sizes: Iterable[int] | None = None,
    vocab_size: int | None = None,
    pad_id: int = 0,
    tokenizer: Any = None,
    fingerprint: dict[str, Any] | None = None,
    source_kind: str = "samples",
    overwrite: bool = False,
    progress: bool = False,
) -> PrepackResult:
    """Write already tokenized samples as a prepack (stages 1-3 without the tokenizer).

    Args:
        samples: :class:`~sftpack.Sample` objects in order (conversation ids kept).
        out, max_seq_len, pad_multiple, algorithm, seed, overwrite, progress: as :func:`prepack`.
        row_sizes: keep a given packing instead of bin packing: row ``r`` holds the
            next ``row_sizes[r]`` samples (importers use this). Then ``max_seq_len=None``
            makes the rows as wide as the widest one needs (rounded up to ``pad_multiple``).
        vocab_size: ids are below this (default: the tokenizer's, else the largest id + 1).
        pad_id: id of padding slots (default: the tokenizer's pad id, else 0).
        tokenizer: optional; recorded in the fingerprint so ``expect=`` can check it.
        fingerprint: extra entries for the manifest's fingerprint (e.g. the source file).
        source_kind: recorded as ``manifest["source"]``.

    >>> import tempfile, numpy as np
    >>> from sftpack import Sample
    >>> a = Sample(np.arange(1, 6), np.ones(5, bool), "A")
    >>> b = Sample(np.arange(101, 111), np.ones(10, bool), "B")
    >>> r = prepack_samples([a, b], tempfile.mkdtemp() + "/ab", max_seq_len=16)
    >>> r.counts["rows"], r.counts["tokens"], r.manifest["token_dtype"]
    (1, 15, 'uint8')
    """
    m = positive_int("pad_multiple", pad_multiple)
    width = positive_int("max_seq_len", max_seq_len, allow_none=row_sizes is not None)
    if width is not None:
        check_row_width(width)
    fp: dict[str, Any] = {"max_seq_len": width, "pad_multiple": m, **(fingerprint or {})}
    if tokenizer is not None:
        tok_fp = tokenizer_fingerprint(tokenizer)
        fp["tokenizer"] = tok_fp
        vocab_size = tok_fp["vocab_size"] if vocab_size is None else vocab_size
        pad_id = tok_fp["pad_id"] if pad_id == 0 else pad_id
    sizes = row_sizes  # read only when planning: an importer may fill it while the samples stream
    if sizes is None:
        fp.update(algorithm=str(choose(Algorithm, algorithm, "algorithm")), seed=int(seed))

        def make_plan(lengths: np.ndarray) -> RowPlan:
            return plan_rows(lengths, max_seq_len=width, pad_multiple=m, algorithm=algorithm, seed=seed)
    else:
        fp.update(algorithm="kept from the source", seed=None)

        def make_plan(lengths: np.ndarray) -> RowPlan:
            offsets = np.concatenate([[0], np.cumsum(np.fromiter(sizes, np.int64))]).astype(np.int64)
            if offsets[-1] != lengths.shape[0]:
                raise PrepackError(f"row_sizes add up to {int(offsets[-1])} samples but {lengths.shape[0]} came in")
            w = width
            if w is None:  # as wide as the widest row needs
                loads = np.add.reduceat(padded_lengths(lengths, m), offsets[:-1])
                w = round_up(int(loads.max()), m)
                fp["max_seq_len"] = w
            return plan_from_membership(lengths, offsets, max_seq_len=w, pad_multiple=m)

    counter = {"n": 0}

    def counted() -> Iterator[Sample]:
        for s in samples:
            counter["n"] += 1
            yield s

    def counts_after() -> dict[str, Any]:
        return {"read": counter["n"], "kept": counter["n"], "dropped": {}}

    seconds: dict[str, float] = {}
    return _finish(
        Path(out),
        samples=counted(),
        make_plan=make_plan,
        counts_after=counts_after,
        vocab_size=vocab_size,
        pad_id=pad_id_of(tokenizer) if tokenizer is not None and pad_id == 0 else pad_id,
        fingerprint=fp,
        source_kind=source_kind,
        overwrite=overwrite,
        progress=progress,
        seconds=seconds,
    )
