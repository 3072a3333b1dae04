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

from .._progress import Bar
from .._types import TokenizerSpec
from ..sample import Sample
from ._encode import ImageSettings, image_settings
from ._options import PrepackOptions
from ._plan import RowPlan
from ._result import PrepackResult
from ._stage import StagedSamples
from ._write import MediaLayout, TokenSource

__all__ = ["Conversations", "PrepackEngine", "Samples", "Staged", "progress_bar"]


@dataclass(frozen=True)
class Conversations:
    """Stage 1's work for :func:`~sftpack.offline.prepack`: conversations to read and tokenize.

    Attributes:
        inputs: as :func:`~sftpack.offline.prepack` takes them (paths, a reader, an
            iterable, or ``None`` for the embedded corpus; with images, an iterable).
        tokenizer: a tokenizer object, the path of a tokenizer folder (engines that
            load it elsewhere), or ``None`` for the embedded default (with images: the family's).
        options: the validated options (``options.images``: conversations with images,
            tokenized for ``options.family``).
        processor: with images, the image processor (``None``: the family's).
    """

    inputs: Any
    tokenizer: TokenizerSpec
    options: PrepackOptions
    processor: Any = None

    def image_settings(self) -> ImageSettings:
        """The :class:`~sftpack.offline._encode.ImageSettings` of conversations with images: these
        options, the tokenizer and processor given (the family's where ``None``)."""
        o = self.options
        return image_settings(
            o.family,
            self.tokenizer,
            self.processor,
            max_seq_len=o.max_seq_len,
            overlong=str(o.overlong),
            on_bad_row=str(o.on_bad_row),
            max_patches_per_row=o.max_patches_per_row,
        )


@dataclass(frozen=True)
class Samples:
    """Stage 1's work for :func:`~sftpack.offline.prepack_samples`: already tokenized samples, in order.

    Attributes:
        samples: the samples; with ``in_rows``, rows of samples (each a sequence),
            whose sizes stage 1 records in :attr:`Staged.row_sizes` for a planner
            that keeps them (importers).
        in_rows: whether ``samples`` holds rows.
        media: samples tokenized with their images (``sample.media``): the settings their images
            are stored with (:func:`~sftpack.offline._encode.image_settings`); ``None``: samples
            without media.
    """

    samples: Iterable[Sample] | Iterable[Sequence[Sample]]
    in_rows: bool = False
    media: ImageSettings | None = None


@dataclass(frozen=True)
class Staged:
    """What stage 1 hands the driver.

    Attributes:
        samples: lengths, conversation numbers, pieces, id offsets and totals
            (:class:`StagedSamples`), in input order, and the media columns of samples with images.
        source: the token source stage 3 gathers the rows' sequences from.
        conversation_ids: the file of the conversation ids' UTF-8 JSON, end to end.
        counts: the manifest counts reading gives (``read``, ``kept``,
            ``dropped``, and for conversations ``overlong`` and the tokens lost).
        inputs: the manifest's ``fingerprint["inputs"]`` (``None``: not an input of this engine's).
        tokenizer: the tokenizer's fingerprint (``None``: no tokenizer ran).
        row_sizes: samples per row of an input given in rows (:class:`Samples` ``in_rows``), else ``None``.
        media: with images, the manifest's ``media`` entry (what is stored, the family, the
            image processor's settings, totals), else ``None``.
    """

    samples: StagedSamples
    source: TokenSource
    conversation_ids: Path
    counts: dict[str, Any]
    inputs: list[dict[str, Any]] | None = None
    tokenizer: dict[str, Any] | None = None
    row_sizes: np.ndarray | None = None
    media: dict[str, Any] | None = None


def progress_bar(progress: bool, **kw: Any) -> Any:
    """A tqdm bar on stderr (disabled unless ``progress``): one per stage."""
    return Bar(disable=not progress, dynamic_ncols=True, file=sys.stderr, **kw)


class PrepackEngine(ABC):
    """Where stages 1 and 3 of a prepack run (see the module docstring)."""

    #: the ``seconds`` entry :meth:`session` is timed under (``None``: not timed)
    start_timer: str | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Whatever the engine needs for one run (a cluster, a worker pool); released on leaving."""
        yield

    @abstractmethod
    def stage(self, work: Conversations | Samples, staging: Path) -> Staged:
        """Stage 1: stage the samples of ``work`` under ``staging`` (an empty folder), with the media
        columns when the conversations have images (``work.options.images``)."""

    @abstractmethod
    def write(
        self, directory: Path, plan: RowPlan, staged: Staged, dtype: np.dtype, media: MediaLayout | None = None
    ) -> None:
        """Stage 3: fill every row of ``plan`` into the files :func:`~sftpack.offline.engine.allocate` created in
        ``directory``. The driver passes ``media`` only for conversations with images: the rows' images are
        then written too (:func:`~sftpack.offline.engine.write_rows` takes it)."""

    def result(self, path: Path, manifest: dict[str, Any], seconds: dict[str, float]) -> PrepackResult:
        """The run's result (an engine may add what it measured)."""
        return PrepackResult(path, manifest, seconds)
