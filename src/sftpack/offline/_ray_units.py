"""The Ray engine's units of work and the code that runs on the workers.

The driver cuts the input into numbered units (one per file, or ``unit_size``
conversations read on the driver); a Ray Data actor (:class:`TokenizeActor`)
reads, tokenizes and stages one unit per call into its own staging folder with
the local :func:`~sftpack.offline.engine.stage_samples` (so the same bytes), and
sends back only the lengths, conversation numbers, pieces, id offsets and
statistics. :func:`merge` lays the units' results end to end in unit order, as
the local engine stages them; conversations with images are tokenized by the
local engine's own :func:`~sftpack.offline._encode.encoded` (numbered from the
unit's first conversation, so the same samples) and staged with their media
columns, which :func:`merge` lays end to end too. :class:`UnitsSource` gathers any
samples (and their pixels) back from the units' staging folders for stage 3, which :class:`Writer` actors (or
the driver, :func:`write_part`) run on ranges of rows (:func:`split_rows`).

Every outcome of a unit, an error included, comes back as a result row: a raised
exception would make Ray Data retry or fail the whole dataset with a traceback,
and the driver could not tell which unit failed first (:func:`raise_first_error`
raises the error of the lowest unit, the one the local engine raises first).

>>> from sftpack.offline.engine import plan_rows
>>> split_rows(plan_rows([5, 10, 3, 8, 6, 9, 16, 2], max_seq_len=16), 2)
[(0, 2), (2, 4)]
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from .. import _optional
from .._base import chunks, positive_int
from .._types import Tokenizer, TokenizerSpec
from ..chat import Conversation, ConversationReader, OnBadRow, as_item, tokenize_conversations
from ..data import default_tokenizer
from ._encode import ImageCounts, ImageSettings, encoded
from ._fingerprint import tokenizer_fingerprint
from ._format import IMAGE_DTYPE, PrepackError
from ._inputs import Inputs
from ._plan import RowPlan
from ._ray_session import import_ray, node_label
from ._stage import PairsOverRow, StagedMedia, StagedSamples, StagingSource, stage_samples
from ._write import MediaLayout, TokenSource, write_rows

__all__ = [
    "TokenizeActor",
    "Unit",
    "UnitsSource",
    "Writer",
    "actor_table",
    "make_units",
    "merge",
    "raise_first_error",
    "split_rows",
    "sum_stats",
    "write_part",
    "writer_pool",
]


@dataclass
class Unit:
    """One call of the tokenize stage: a source file, or a list of conversations."""

    key: int
    staging: str
    source: Any = None  # a reader source (one file or saved dataset)
    conversations: list[Any] | None = None
    on_bad_row: str = "skip"
    role_map: dict[str, str] | None = None
    batch_size: int = 1024
    start: int = 0  # the number of its first conversation in the input (conversations with images)


def _as_conversations(items: Iterable[Any], start: int) -> list[Conversation]:
    """Items as :class:`Conversation` with the id the tokenizer would give at their global position."""
    return [Conversation(*as_item(obj, start + i)) for i, obj in enumerate(items)]


def make_units(inputs: Inputs, staging: Path, *, unit_size: int, raw: bool = False) -> tuple[list[Unit], bool]:
    """The units of ``inputs``, and whether the workers read the files (then the reading
    counts come from the units; else the driver read and its reader counted).

    Files are read on the workers, one unit per file (and per saved dataset); the
    embedded corpus, an iterable, or any input with ``limit`` (only a single reader
    knows where the first ``limit`` conversations end) is read here and shipped in
    units of ``unit_size`` conversations (``raw``: as given, each unit knowing the number
    of its first one: conversations with images)."""
    reader = inputs.reader
    if reader is not None and inputs.limit is None:
        units = [
            Unit(
                k,
                str(staging / f"u{k:06d}"),
                source=src,
                on_bad_row=reader.on_bad_row.value,
                role_map=reader.role_map,
                batch_size=reader.batch_size,
            )
            for k, src in enumerate(reader.sources)
        ]
        return units, True
    out, start = [], 0
    for k, chunk in enumerate(chunks(inputs.conversations, unit_size)):
        convs = chunk if raw else _as_conversations(chunk, start)
        out.append(Unit(k, str(staging / f"u{k:06d}"), conversations=convs, start=start))
        start += len(chunk)
    return out, False


# ---------------------------------------------------------------------------- the tokenize actor


def _load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    if spec is None:
        return default_tokenizer()
    if isinstance(spec, (str, os.PathLike)):
        return _optional.from_pretrained("AutoTokenizer", spec, local_files_only=True)
    return spec


class TokenizeActor:
    """A Ray Data actor: loads the tokenizer once, then read + tokenize + stage per unit.

    Args:
        tokenizer: ``None`` (the embedded default), a tokenizer folder, or a tokenizer object.
        options: ``max_seq_len``, ``overlong``, ``train_on`` and ``on_bad_row`` (default ``"error"``).
        after_unit: called with a unit's key once it is staged, before its result is
            sent (tests pass one that kills the actor there, as ``kill -9`` would).
        images: for conversations with images, their settings (the tokenizer and image
            processor included; ``tokenizer`` is then unused).
    """

    def __init__(
        self,
        tokenizer: TokenizerSpec,
        options: dict[str, Any],
        after_unit: Callable[[int], None] | None = None,
        images: ImageSettings | None = None,
    ):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per actor: the actors fill the cores
        self.spec = tokenizer if images is None else images.tokenizer
        self.options = options
        self.after_unit = after_unit
        self.images = images
        self.tokenizer: Tokenizer | None = None
        self.fingerprint: dict[str, Any] | None = None

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
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
                    f"a Ray worker (node {node_label()}, host {socket.gethostname()}, pid {os.getpid()}) cannot load "
                    f"the tokenizer {where}: {' '.join(str(e).split())[:300]}. The tokenizer folder must exist at the "
                    "same path on every node (a shared filesystem, or the same copy on each node)"
                ) from None
            self.tokenizer, self.fingerprint = tok, fp
        return self.tokenizer

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = [pickle.dumps(self._run(pickle.loads(blob)), protocol=5) for blob in batch["unit"]]
        return {"key": np.asarray(batch["key"]), "result": np.array(results, dtype=object)}

    def _run(self, unit: Unit) -> dict[str, Any]:
        t0 = time.perf_counter()
        base = {"key": unit.key, "pid": os.getpid(), "node": node_label()}
        try:
            tok = self._tokenizer()
            t_load = time.perf_counter() - t0  # the actor's first unit loads its tokenizer
            t0 = time.perf_counter()
            reader = None
            if self.images is not None:
                return self._run_images(unit, base, t_load, t0)
            if unit.source is not None:
                reader = ConversationReader([unit.source], OnBadRow(unit.on_bad_row), unit.role_map, unit.batch_size)
                convs: Iterable[Any] = reader
            else:
                convs = unit.conversations or []
            o = self.options
            tokenized = tokenize_conversations(
                convs,
                tok,
                max_seq_len=o["max_seq_len"],
                overlong=o["overlong"],
                train_on=o["train_on"],
                on_bad_row=o.get("on_bad_row", "error"),
            )
            over = PairsOverRow(o["max_seq_len"], int(o.get("pad_multiple", 1)), o["overlong"])
            staged = stage_samples(over.filter(tokenized), Path(unit.staging))
            if self.after_unit is not None:
                self.after_unit(unit.key)
        except Exception as e:  # noqa: BLE001 - sent back whole, raised by the driver in unit order
            try:
                portable: BaseException | None = pickle.loads(pickle.dumps(e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
                portable = None
            return {**base, "ok": False, "error": portable, "message": f"{type(e).__name__}: {e}"}
        return {
            **base,
            **_staged_result(staged),
            "ok": True,
            "fingerprint": self.fingerprint,
            "read": None if reader is None else reader.stats.as_dict(),
            "tokenize": over.apply(tokenized.stats.as_dict()),
            "seconds": time.perf_counter() - t0,
            "load_seconds": t_load,
        }

    def _run_images(self, unit: Unit, base: dict[str, Any], t_load: float, t0: float) -> dict[str, Any]:
        """A unit of conversations with images: encoded as the local engine encodes them, staged
        with their media columns; the media index comes back with the lengths."""
        assert self.images is not None
        counts = ImageCounts()
        pairs = counts.pairs(encoded(unit.conversations or [], self.images, 1, unit.start))
        staged = stage_samples(pairs, Path(unit.staging), media=True)
        if self.after_unit is not None:
            self.after_unit(unit.key)
        return {
            **base,
            **_staged_result(staged),
            "ok": True,
            "fingerprint": self.fingerprint,
            "read": None,
            "images": counts,
            "tokenize": {"conversations": counts.read},
            "seconds": time.perf_counter() - t0,
            "load_seconds": t_load,
        }


def _staged_result(staged: StagedSamples) -> dict[str, Any]:
    """What a unit sends back of its staging: the per-sample index, totals and media index
    (``None`` for a text unit)."""
    return {
        "lengths": staged.lengths,
        "conversation": staged.conversation,
        "piece": staged.piece,
        "id_offsets": staged.conversation_offsets,
        "max_id": staged.max_id,
        "tokens": staged.tokens,
        "trainable": staged.trainable,
        "labels": staged.labels,
        "first_trainable": staged.first_trainable,
        "media": staged.media,
        "roles": staged.roles,
        "weighted": staged.weighted,
        "sft_groups": staged.sft_groups is not None,
    }


def raise_first_error(results: list[dict[str, Any]]) -> None:
    """Raise the error of the lowest failing unit (the local engine's first), if any failed."""
    bad = [r for r in results if not r["ok"]]
    if not bad:
        return
    first = bad[0]
    if isinstance(first["error"], BaseException):
        raise first["error"]
    raise RuntimeError(f"the Ray tokenize stage failed in unit {first['key']}: {first['message']}")


def merge(results: list[dict[str, Any]], staging: Path) -> tuple[StagedSamples, np.ndarray]:
    """The units' stage-1 results laid end to end in unit order, as the local engine stages
    them, and the first global sample of each unit (``(units+1,)``)."""
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
    media = _merge_media([r["media"] for r in results]) if results and results[0].get("media") is not None else None
    if any(r.get("sft_groups") for r in results):
        raise PrepackError(
            "the samples carry SFT groups (meta['group'] without a role: a prompt's completions), which the Ray "
            "engine does not keep whole in one row yet: prepack them with the local engine (engine='local')"
        )
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
        media=media,
        roles=_merge_roles(results),
        weighted=any(r.get("weighted") for r in results),
    )
    return staged, unit_samples


def _merge_roles(results: list[dict[str, Any]]) -> np.ndarray | None:
    """The units' pair roles end to end (``None``: SFT conversations); units of both kinds are refused,
    as the local engine refuses a sample of the other kind."""
    filled = [r for r in results if len(r["lengths"])]
    pairs = bool(filled) and filled[0].get("roles") is not None
    other = next((r for r in filled if (r.get("roles") is not None) != pairs), None)
    if other is not None:
        raise ValueError(
            f"unit {other['key']} holds {'SFT conversations' if pairs else 'preference pairs'} and the units "
            "before it the other kind: a prepack holds one kind; prepack SFT data and preference data apart"
        )
    if not pairs:
        return None
    return np.concatenate([r["roles"] for r in filled])


def _merge_media(units: list[StagedMedia]) -> StagedMedia:
    """The units' media columns laid end to end, in unit order (each record's ``pixels`` stays the
    offset in its own unit's pixel file, ``sequence`` becomes the global sample)."""
    first, offsets, records, n_img, n_seq = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], [], 0, 0
    for m in units:
        first.append(m.first_image[1:] + n_img)
        offsets.append(m.pixel_offsets[1:])  # per unit: UnitsSource keeps each unit's own offsets
        rec = m.records.copy()
        rec["sequence"] += n_seq
        records.append(rec)
        n_img += m.num_images
        n_seq += m.patches.shape[0]
    ids = [(m.token_id, m.merge_size) for m in units if m.token_id is not None]
    if len(set(ids)) > 1:
        raise RuntimeError(
            f"the Ray workers staged images with different image tokens or merge sizes: {sorted(set(ids))}"
        )
    token_id, merge_size = ids[0] if ids else (None, None)
    return StagedMedia(
        np.concatenate(first),
        np.concatenate(records) if records else np.zeros(0, IMAGE_DTYPE),
        np.concatenate([m.patches for m in units]),
        _global_offsets(units),
        token_id,
        merge_size,
    )


def _global_offsets(units: list[StagedMedia]) -> np.ndarray:
    """``(S+1,)`` each sample's pixel bytes laid end to end over the units (their sizes, for the layout)."""
    sizes = np.concatenate([np.diff(m.pixel_offsets) for m in units]) if units else np.zeros(0, np.int64)
    out = np.zeros(sizes.shape[0] + 1, np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def sum_stats(dicts: list[dict[str, Any]]) -> dict[str, Any]:
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


def actor_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per tokenize actor: its units, conversations, tokens, seconds and tokens per second."""
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


# ---------------------------------------------------------------------------- stage 3: token source + writers


class UnitsSource:
    """The token source of the write stage: samples gathered from their units' staging files.

    Global sample ``i`` lives in unit ``u`` with ``unit_samples[u] <= i < unit_samples[u+1]``.
    One :meth:`gather` sorts the requested samples by unit (one stable argsort),
    gathers each unit's share with the local :class:`StagingSource`, and scatters
    it back into request order.
    """

    def __init__(
        self,
        directories: list[str],
        lengths: np.ndarray,
        unit_samples: np.ndarray,
        pixel_offsets: list[np.ndarray] | None = None,
        weighted: list[bool] | None = None,
    ):
        self.lengths = np.asarray(lengths, np.int64)
        self.unit_weighted = weighted  # each unit's samples carry weights (None: no unit's do)
        self.weighted = bool(weighted and any(weighted))
        self.unit_samples = np.asarray(unit_samples, np.int64)
        self.directories = directories
        self.pixel_offsets = pixel_offsets  # each unit's own (samples+1,) offsets into its pixel file
        self._sources: dict[int, StagingSource] = {}

    def _source(self, u: int) -> StagingSource:
        if u not in self._sources:
            a, b = self.unit_samples[u], self.unit_samples[u + 1]
            po = None if self.pixel_offsets is None else self.pixel_offsets[u]
            w = bool(self.unit_weighted and self.unit_weighted[u])
            self._sources[u] = StagingSource(Path(self.directories[u]), self.lengths[a:b], po, weighted=w)
        return self._sources[u]

    def _by_unit(self, samples: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """``(unit, positions in samples)`` of each unit the samples come from."""
        unit = np.searchsorted(self.unit_samples, samples, side="right") - 1
        by_unit = np.argsort(unit, kind="stable")
        for group in np.split(by_unit, np.flatnonzero(np.diff(unit[by_unit])) + 1):
            if group.shape[0]:
                yield int(unit[group[0]]), group

    def gather_pixels(self, samples: np.ndarray) -> np.ndarray:
        """The samples' images' pixels end to end, in the given order (each from its unit)."""
        if self.pixel_offsets is None:
            raise ValueError("these staged samples hold no images")
        samples = np.asarray(samples, np.int64)
        sizes = np.zeros(samples.shape[0], np.int64)
        for u, group in self._by_unit(samples):
            po = self.pixel_offsets[u]
            local = samples[group] - self.unit_samples[u]
            sizes[group] = po[local + 1] - po[local]
        out = np.empty(int(sizes.sum()), np.uint8)
        out_starts = np.zeros(samples.shape[0], np.int64)
        np.cumsum(sizes[:-1], out=out_starts[1:])
        for u, group in self._by_unit(samples):
            got = self._source(u).gather_pixels(samples[group] - self.unit_samples[u])
            out[_scatter(got.shape[0], out_starts[group], sizes[group])] = got
        return out

    def gather(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = np.asarray(samples, np.int64)
        lens = self.lengths[samples]
        total = int(lens.sum())
        ids = np.empty(total, np.uint32)
        mask = np.empty(total, np.uint8)
        out_starts = np.zeros(samples.shape[0], np.int64)
        np.cumsum(lens[:-1], out=out_starts[1:])
        for u, group in self._by_unit(samples):
            got_ids, got_mask = self._source(u).gather(samples[group] - self.unit_samples[u])
            pos = _scatter(got_ids.shape[0], out_starts[group], lens[group])
            ids[pos] = got_ids
            mask[pos] = got_mask
        return ids, mask

    def gather_weights(self, samples: np.ndarray) -> np.ndarray:
        """The samples' token weights end to end, in the given order (1 for a unit without weights)."""
        samples = np.asarray(samples, np.int64)
        lens = self.lengths[samples]
        out = np.ones(int(lens.sum()), np.float64)
        out_starts = np.zeros(samples.shape[0], np.int64)
        np.cumsum(lens[:-1], out=out_starts[1:])
        for u, group in self._by_unit(samples):
            source = self._source(u)
            if source.weighted:
                got = source.gather_weights(samples[group] - self.unit_samples[u])
                out[_scatter(got.shape[0], out_starts[group], lens[group])] = got
        return out


def _scatter(n: int, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``(n,)`` int64: where each of ``n`` values gathered end to end (pieces of ``sizes``) goes in
    an output whose piece ``k`` starts at ``starts[k]``."""
    inner = np.zeros(sizes.shape[0], np.int64)
    np.cumsum(sizes[:-1], out=inner[1:])
    return np.arange(n, dtype=np.int64) + np.repeat(starts - inner, sizes)


def write_part(
    directory: str,
    plan: RowPlan,
    source: TokenSource,
    dtype: str,
    rows: tuple[int, int],
    media: MediaLayout | None = None,
) -> dict[str, Any]:
    """Write rows ``[a, b)`` (and their images): in a writer actor on any node that sees ``directory``,
    or in the driver."""
    t0 = time.perf_counter()
    write_rows(Path(directory), plan, source, np.dtype(dtype), rows=rows, media=media)
    return {"rows": rows, "seconds": time.perf_counter() - t0, "pid": os.getpid(), "node": node_label()}


class Writer:
    """A Ray actor that writes row ranges (its ``write`` is :func:`write_part`). The pool starts as
    soon as the lengths are in, so its imports (torch included) overlap merging and packing;
    ``num_cpus=0``: writing is pwrite-bound, and no tokenize actor waits for it."""

    write = staticmethod(write_part)


@contextlib.contextmanager
def writer_pool(size: int) -> Iterator[list[Any]]:
    """``size`` writer actors spread over the nodes, killed on leaving (also on an error)."""
    ray = import_ray()
    cls = ray.remote(num_cpus=0, max_restarts=1, max_task_retries=1)(Writer)  # a killed writer reruns its range
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
