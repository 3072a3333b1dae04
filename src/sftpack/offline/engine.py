"""The extension module of the offline path: the engine interface and the stage parts.

A prepack runs as one driver (:func:`sftpack.offline.prepack`) over an engine. The
driver owns everything that decides the bytes and the safety of the output:
options, planning (stage 2), the vocabulary and dtype, the index, the
checksums, the manifest, the atomic publish and the error messages. An engine
owns only where the two heavy stages run:

1. :meth:`PrepackEngine.stage`: read + tokenize + stage the samples of a
   :class:`Conversations` (or :class:`Samples`) work item into the staging
   folder, returning a :class:`Staged`: the lengths and per-sample index, a
   token source, the conversation id file, the reading counts and the
   tokenizer and input fingerprints;
2. :meth:`PrepackEngine.write`: fill the allocated ``tokens.npy`` /
   ``loss_mask.npy`` with the rows of the driver's :class:`RowPlan`, from the
   staged token source (:func:`write_rows` on any split of the rows).

Given the same samples in the same order, any engine writes the same bytes:
every byte's position comes from the plan. Two engines ship:
:class:`~sftpack.offline._local.LocalEngine` (this process, ``num_proc``
tokenizer workers) and :class:`~sftpack.offline._ray.RayEngine` (Ray Data
actors tokenize, Ray actors write). A new engine subclasses
:class:`PrepackEngine` and is passed as ``prepack(..., engine=MyEngine())``.

The stage parts an engine builds on are here too: :func:`stage_samples` /
:class:`StagedSamples` / :class:`StagingSource` (stage 1's staging files),
:func:`plan_rows` / :func:`plan_from_membership` / :class:`RowPlan` (stage 2),
and :func:`allocate` / :func:`write_rows` / :func:`write_index` (stage 3).
"""

from __future__ import annotations

import contextlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .. import Sample
from ._options import PrepackOptions
from ._plan import RowPlan, plan_from_membership, plan_rows
from ._result import PrepackResult
from ._stage import StagedSamples, StagingSource, stage_samples
from ._write import TokenSource, allocate, write_index, write_rows

__all__ = [
    "Conversations",
    "PrepackEngine",
    "RowPlan",
    "Samples",
    "Staged",
    "StagedSamples",
    "StagingSource",
    "TokenSource",
    "allocate",
    "plan_from_membership",
    "plan_rows",
    "progress_bar",
    "stage_samples",
    "write_index",
    "write_rows",
]


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
    tokenizer: Any
    options: PrepackOptions


@dataclass(frozen=True)
class Samples:
    """Stage 1's work for :func:`~sftpack.offline.prepack_samples`: already tokenized samples, in order."""

    samples: Iterable[Sample]


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
    """

    samples: StagedSamples
    source: TokenSource
    conversation_ids: Path
    counts: dict[str, Any]
    inputs: list[dict[str, Any]] | None = None
    tokenizer: dict[str, Any] | None = None


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
    def stage(self, work: Conversations | Samples, staging: Path) -> Staged:
        """Stage 1: stage the samples of ``work`` under ``staging`` (an empty folder)."""

    @abstractmethod
    def write(self, directory: Path, plan: RowPlan, staged: Staged, dtype: np.dtype) -> None:
        """Stage 3: fill every row of ``plan`` into the files :func:`allocate` created in ``directory``."""

    def result(self, path: Path, manifest: dict[str, Any], seconds: dict[str, float]) -> PrepackResult:
        """The run's result (an engine may add what it measured)."""
        return PrepackResult(path, manifest, seconds)
