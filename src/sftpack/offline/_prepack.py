"""``prepack`` and ``prepack_samples``: the offline path's entry points (and ``prepack_rows``,
the importers').

Each builds a job for the one driver (:mod:`~sftpack.offline._driver`): validated
options (:class:`~sftpack.offline.PrepackOptions`), the work of stage 1
(conversations to tokenize, with or without images, or samples), the planner of stage 2, and an engine
(:mod:`sftpack.offline.engine`) that runs stages 1 and 3: the local engine, or
Ray's. Given the same samples in the same order, every engine writes the same
bytes. The time each stage took is in the result's ``seconds``
(``benchmarks/bench_offline.py`` measures them on the embedded corpus).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .._base import choose
from .._types import Tokenizer
from ..binpack import Algorithm
from ..sample import Sample
from ._driver import Job, run, run_conversations
from ._encode import image_settings
from ._engine import PrepackEngine, Samples
from ._fingerprint import input_fingerprints, tokenizer_fingerprint
from ._local import LocalEngine
from ._options import Engine, PrepackOptions
from ._plan import BinPack, KeepRows
from ._ray import RayEngine
from ._result import PrepackResult

__all__ = ["prepack", "prepack_rows", "prepack_samples"]


def _engine_for(options: PrepackOptions) -> PrepackEngine:
    if options.engine is Engine.RAY:
        return RayEngine.from_options(options)
    return LocalEngine(num_proc=options.num_proc, progress=options.progress)


def prepack(
    inputs: Any = None,
    out: str | os.PathLike[str] = "prepack",
    *,
    tokenizer: Tokenizer | None = None,
    processor: Any = None,
    fingerprint: dict[str, Any] | None = None,
    options: PrepackOptions | None = None,
    **settings: Any,
) -> PrepackResult:
    """Read, tokenize, bin-pack and write conversations (with or without images) as a prepack directory.

    Args:
        inputs: paths as :func:`sftpack.chat.read_conversations` takes them (JSONL /
            ``.gz``, Parquet, saved Hugging Face datasets, folders, globs), a
            ``ConversationReader``, an iterable of conversations, or ``None`` for
            the embedded corpus (:func:`sftpack.data.default_corpus`).
        out: the directory to create (refused if it exists, unless ``overwrite``).
        tokenizer: a Hugging Face fast tokenizer with a chat template (default:
            :func:`sftpack.data.default_tokenizer`; with images, the family's tokenizer).
        processor: with images, the image processor (default: the family's).
        fingerprint: extra entries for the manifest's fingerprint (e.g. the corpus a caller names).
        options: the settings as one :class:`PrepackOptions` (then no setting is given by keyword
            but an engine object).
        settings: any field of :class:`PrepackOptions` by keyword, its default the field's (another
            keyword is a ``TypeError`` naming the settings). They are:

        max_seq_len: row width ``T``; also the over-long limit for one conversation.
        pad_multiple: pad each sequence to a multiple of this (``2*CP``; see
            :func:`sftpack.handoff.pad_multiple_for`); ``max_seq_len`` must be a multiple.
        algorithm, seed: the bin packer (:func:`sftpack.binpack.pack`).
        overlong, train_on: as :func:`sftpack.chat.tokenize_conversations`.
        on_bad_row: ``"skip"`` (count bad rows) or ``"error"`` (stop at the first, naming file and line).
        num_proc: tokenizer processes; the files do not depend on it.
        engine: ``"local"`` or ``"ray"`` (:func:`~sftpack.offline.prepack_ray`; the same files),
            or an engine object (:mod:`sftpack.offline.engine`), which then brings its own settings.
        workers, ray_address: the Ray engine's actors and cluster (``None``: a private local Ray).
        limit: first ``limit`` conversations only.
        overwrite: replace an existing prepack at ``out``.
        progress: tqdm bars per stage on stderr.
        images: the conversations have images (Hugging Face's multimodal chat format, an
            iterable such as :func:`sftpack.multimodal.vqa_corpus` or
            :func:`sftpack.chat.read_conversations`): each is tokenized by
            :func:`sftpack.multimodal.tokenize_media_conversations` for ``family``, and its
            images are stored as resized uint8 pixels beside the tokens (the media columns);
            :class:`PrepackedDataset` reads each row back as :meth:`sftpack.PackedBatch.from_samples`
            of its samples. ``overlong`` is then ``split`` (at text boundaries, never inside an
            image), ``drop`` or ``error``; ``on_bad_row="skip"`` counts bad images under their reasons.
        family: with images, the model family: a :func:`sftpack.multimodal.family_for` name
            (``"qwen2_vl"``, the default, ``"qwen2_5_vl"``, ``"qwen3_vl"``, ``"llava"``,
            ``"gemma3"``) or a configured :class:`~sftpack.multimodal.Family`
            (``family_for(model_dir)``); recorded in the manifest with its configuration.
        max_patches_per_row: with images, vision patches per row, a second budget beside
            ``max_seq_len`` (``None``: none). A conversation with a sample (or a piece) over it is
            dropped and counted as ``over_patch_budget``, or under ``overlong="error"`` raises
            :class:`~sftpack.multimodal.PatchBudgetError`, as the loader does.
        unit_size, write_tasks, actor_cpus: the Ray engine's, as :class:`RayEngine`.

    Returns:
        :class:`PrepackResult` (``.path``, ``.manifest``, ``.counts``, ``.seconds``).
    """
    engine_object = settings.pop("engine") if isinstance(settings.get("engine"), PrepackEngine) else None
    if options is None:
        options = PrepackOptions.from_settings("prepack", settings)
    elif settings:
        raise ValueError(f"prepack got options= and also {', '.join(sorted(settings))}: set them in the PrepackOptions")
    engine_run = engine_object or _engine_for(options)
    return run_conversations(inputs, out, tokenizer, options, engine_run, processor=processor, fingerprint=fingerprint)


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
    pad_id: int | None = None,
    tokenizer: Tokenizer | None = None,
    fingerprint: dict[str, Any] | None = None,
    source_kind: str = "samples",
    overwrite: bool = False,
    progress: bool = False,
    images: bool = False,
    processor: Any = None,
    family: Any = None,
    max_patches_per_row: int | None = None,
) -> PrepackResult:
    """Write already tokenized samples as a prepack (stages 1-3 without the tokenizer).

    Args:
        samples: :class:`~sftpack.Sample` objects in order (conversation ids kept).
        out, max_seq_len, pad_multiple, algorithm, seed, overwrite, progress: as :func:`prepack`.
        row_sizes: keep a given packing instead of bin packing: row ``r`` holds the
            next ``row_sizes[r]`` samples (importers use this). Then ``max_seq_len=None``
            makes the rows as wide as the widest one needs (rounded up to ``pad_multiple``).
        vocab_size: ids are below this (default: the tokenizer's, else the largest id + 1).
        pad_id: id of padding slots (``None``: the tokenizer's pad id, else 0; any
            id given, 0 included, is used as given).
        tokenizer: optional; recorded in the fingerprint so ``expect=`` can check it.
        fingerprint: extra entries for the manifest's fingerprint (e.g. the source file).
        source_kind: recorded as ``manifest["source"]``.
        images: the samples carry their images (``sample.media``, as
            :func:`sftpack.multimodal.tokenize_media_conversations` gives them): stored as
            :func:`prepack` ``(images=True)`` stores a conversation's, the same bytes, with no
            tokenizing again. ``family`` and ``processor``: the ones they were tokenized with
            (``None``: Qwen2-VL's), recorded in the manifest; ``max_patches_per_row``: the
            rows' vision-patch budget (a sample over it cannot be placed: ``ValueError``).

    >>> import tempfile, numpy as np
    >>> from sftpack import Sample
    >>> a = Sample(np.arange(1, 6), np.ones(5, bool), "A")
    >>> b = Sample(np.arange(101, 111), np.ones(10, bool), "B")
    >>> r = prepack_samples([a, b], tempfile.mkdtemp() + "/ab", max_seq_len=16)
    >>> r.counts["rows"], r.counts["tokens"], r.manifest["token_dtype"]
    (1, 15, 'uint8')
    """
    planner: BinPack | KeepRows
    media = None
    if images:
        if row_sizes is not None or max_seq_len is None:
            raise ValueError("images=True bin packs the samples: give max_seq_len, not row_sizes")
        media = image_settings(  # the samples are tokenized already: overlong and on_bad_row take no part
            family,
            tokenizer,
            processor,
            max_seq_len=max_seq_len,
            overlong="split",
            on_bad_row="error",
            max_patches_per_row=max_patches_per_row,
        )
    elif processor is not None or family is not None or max_patches_per_row is not None:
        raise ValueError("processor, family and max_patches_per_row are for samples with images: pass images=True")
    if row_sizes is None:
        if max_seq_len is None:
            raise ValueError("max_seq_len must be a positive integer, got None (None is only valid with row_sizes)")
        algo = choose(Algorithm, algorithm, "algorithm")
        planner = BinPack(max_seq_len, pad_multiple, algo, seed, max_patches_per_row)
    else:  # row_sizes is read only when planning, after the samples
        planner = KeepRows(row_sizes, max_seq_len, pad_multiple)
    return _write_samples(
        Samples(samples, media=media),
        out,
        planner,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        pad_id=pad_id,
        fingerprint=fingerprint,
        source_kind=source_kind,
        overwrite=overwrite,
        progress=progress,
    )


def prepack_rows(
    rows: Iterable[Sequence[Sample]],
    out: str | os.PathLike[str],
    planner: KeepRows,
    *,
    tokenizer: Tokenizer | None,
    source: Path,
    source_kind: str,
    fingerprint: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> PrepackResult:
    """Rows of samples (an importer's), each kept as one row of the prepack; the source
    file is fingerprinted as the input, and ``fingerprint`` adds entries of its own."""
    return _write_samples(
        Samples(rows, in_rows=True),
        out,
        planner,
        tokenizer=tokenizer,
        vocab_size=None,
        pad_id=None,
        fingerprint={"inputs": input_fingerprints([source]), **(fingerprint or {})},
        source_kind=source_kind,
        overwrite=overwrite,
        progress=progress,
    )


def _write_samples(
    work: Samples,
    out: str | os.PathLike[str],
    planner: BinPack | KeepRows,
    *,
    tokenizer: Tokenizer | None,
    vocab_size: int | None,
    pad_id: int | None,
    fingerprint: dict[str, Any] | None,
    source_kind: str,
    overwrite: bool,
    progress: bool,
) -> PrepackResult:
    fp: dict[str, Any] = {
        "max_seq_len": planner.max_seq_len,
        "pad_multiple": planner.pad_multiple,
        **(fingerprint or {}),
    }
    if tokenizer is not None:
        tok_fp = tokenizer_fingerprint(tokenizer)
        fp["tokenizer"] = tok_fp
        vocab_size = tok_fp["vocab_size"] if vocab_size is None else vocab_size
        pad_id = tok_fp["pad_id"] if pad_id is None else pad_id
    job = Job(
        Path(out),
        work,
        planner,
        fp,
        source=source_kind,
        vocab_size=vocab_size,
        pad_id=pad_id,
        overwrite=overwrite,
        progress=progress,
    )
    return run(job, LocalEngine(progress=progress))
