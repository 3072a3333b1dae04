"""The extension module of the offline path: the engine interface, the two engines, and
the stage parts an engine is built from.

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
   staged token source (:func:`write_rows` on any split of the rows), and for
   conversations with images the media columns the driver's :class:`MediaLayout`
   places (the same :func:`write_rows` call).

Given the same samples in the same order, any engine writes the same bytes:
every byte's position comes from the plan. Two engines ship:
:class:`LocalEngine` (this process, ``num_proc`` tokenizer workers) and
:class:`RayEngine` (Ray Data actors tokenize, Ray actors write; Ray is imported
only when it runs). ``prepack(engine="local" | "ray")`` builds one from the
options; an engine object, one of these with settings of its own or a new
subclass of :class:`PrepackEngine`, is passed as ``prepack(..., engine=...)``.

The stage parts: :func:`stage_samples` / :class:`StagedSamples` /
:class:`StagingSource` (stage 1's staging files), :func:`plan_rows` /
:func:`plan_from_membership` / :class:`RowPlan` (stage 2), and
:func:`allocate` / :func:`write_rows` / :func:`write_index` (stage 3).

>>> rows = plan_rows([5, 10, 3, 8, 6], max_seq_len=16)
>>> rows.num_rows, isinstance(LocalEngine(), PrepackEngine)
(2, True)
"""

from __future__ import annotations

from ._engine import Conversations, PrepackEngine, Samples, Staged, progress_bar
from ._local import LocalEngine
from ._plan import RowPlan, plan_from_membership, plan_rows
from ._ray import RayEngine, RayPrepackResult
from ._ray_session import ray_session
from ._stage import StagedSamples, StagingSource, stage_samples
from ._write import MediaLayout, TokenSource, allocate, write_index, write_rows

__all__ = [
    "Conversations",
    "LocalEngine",
    "MediaLayout",
    "PrepackEngine",
    "RayEngine",
    "RayPrepackResult",
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
    "ray_session",
    "stage_samples",
    "write_index",
    "write_rows",
]
