"""The engine interface (:class:`PrepackEngine`) and the values it passes to the driver;
documented, with the engines and the stage parts, in :mod:`sftpack.offline.engine`."""

from __future__ import annotations

import contextlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .._types import TokenizerSpec
from ..sample import Sample
from ._options import PrepackOptions
from ._plan import RowPlan
from ._result import PrepackResult
from ._stage import StagedSamples
from ._write import TokenSource

__all__ = ["Conversations", "MultimodalConversations", "PrepackEngine", "Samples", "Staged", "progress_bar"]


@dataclass(frozen=True)
class Conversations:
    """Stage 1's work for :func:`~sftpack.offline.prepack`: conversations to read and tokenize.

    Attributes:
        inputs: as :func:`~sftpack.offline.prepack` takes them (paths, a reader, an
            iterable, or ``None`` for the embedded corpus).
        tokenizer: a tokenizer object, the path of a tokenizer folder (engines that
            load it elsewhere), or ``None`` for the embedded default.
        options: the validated options.
    """

    inputs: Any
    tokenizer: TokenizerSpec
    options: PrepackOptions


@dataclass(frozen=True)
class Samples:
    """Stage 1's work for :func:`~sftpack.offline.prepack_samples`: already tokenized samples, in order.

    Attributes:
        samples: the samples; with ``in_rows``, rows of samples (each a sequence),
            whose sizes stage 1 records in :attr:`Staged.row_sizes` for a planner
            that keeps them (importers).
        in_rows: whether ``samples`` holds rows.
    """

    samples: Iterable[Sample] | Iterable[Sequence[Sample]]
    in_rows: bool = False


@dataclass(frozen=True)
class MultimodalConversations:
    """Stage 1's work for :func:`~sftpack.offline.prepack_multimodal`.

    Attributes:
        inputs: conversations (Hugging Face multimodal chat format), an iterable of mappings
            with ``messages`` (and ``id``).
        tokenizer, processor: ``None``: :func:`sftpack.multimodal.qwen2vl_tokenizer` and
            :func:`sftpack.multimodal.image_processor`.
        max_seq_len, max_patches, overlong, on_bad_row, num_proc, limit: as
            :func:`~sftpack.offline.prepack_multimodal`.
    """

    inputs: Iterable[Any]
    tokenizer: Any
    processor: Any
    max_seq_len: int
    overlong: str = "split"
    on_bad_row: str = "skip"
    num_proc: int = 1
    limit: int | None = None
    max_patches: int | None = None


@dataclass(frozen=True)
class Staged:
    """What stage 1 hands the driver.

    Attributes:
        samples: lengths, conversation numbers, pieces, id offsets and totals
            (:class:`StagedSamples`), in input order.
        source: the token source stage 3 gathers the rows' sequences from.
        conversation_ids: the file of the conversation ids' UTF-8 JSON, end to end.
        counts: the manifest counts reading gives (``read``, ``kept``,
            ``dropped``, and for conversations ``overlong`` and the tokens lost).
        inputs: the manifest's ``fingerprint["inputs"]`` (``None``: not an input of this engine's).
        tokenizer: the tokenizer's fingerprint (``None``: no tokenizer ran).
        row_sizes: samples per row of an input given in rows (:class:`Samples` ``in_rows``), else ``None``.
        media: the staged images of multimodal samples
            (:class:`~sftpack.offline._media.StagedMedia`), else ``None``.
    """

    samples: StagedSamples
    source: TokenSource
    conversation_ids: Path
    counts: dict[str, Any]
    inputs: list[dict[str, Any]] | None = None
    tokenizer: dict[str, Any] | None = None
    row_sizes: np.ndarray | None = None
    media: Any = None


def progress_bar(progress: bool, **kw: Any) -> Any:
    """A tqdm bar on stderr (disabled unless ``progress``): one per stage."""
    return tqdm(disable=not progress, dynamic_ncols=True, file=sys.stderr, **kw)


class PrepackEngine(ABC):
    """Where stages 1 and 3 of a prepack run (see the module docstring)."""

    #: the ``seconds`` entry :meth:`session` is timed under (``None``: not timed)
    start_timer: str | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Whatever the engine needs for one run (a cluster, a worker pool); released on leaving."""
        yield

    @abstractmethod
    def stage(self, work: Conversations | Samples | MultimodalConversations, staging: Path) -> Staged:
        """Stage 1: stage the samples of ``work`` under ``staging`` (an empty folder). Multimodal
        conversations (:func:`~sftpack.offline.prepack_multimodal`) are the local engine's only."""

    @abstractmethod
    def write(self, directory: Path, plan: RowPlan, staged: Staged, dtype: np.dtype) -> None:
        """Stage 3: fill every row of ``plan`` into the files :func:`~sftpack.offline.engine.allocate` created in ``directory``."""

    def result(self, path: Path, manifest: dict[str, Any], seconds: dict[str, float]) -> PrepackResult:
        """The run's result (an engine may add what it measured)."""
        return PrepackResult(path, manifest, seconds)
