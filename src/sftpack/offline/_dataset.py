"""``PrepackedDataset``: a prepack directory as a map-style torch dataset of rows.

Row ``r`` is read as two slices of the memory-mapped ``tokens.npy`` and
``loss_mask.npy`` (its sequences are contiguous) plus its index entries, and
laid out by :func:`sftpack.handoff.build_row` with the width, pad multiple and
pad id of the manifest::

    tokens   ... A0 A1 A2 A3 A4 B0 B1 ... B9 ...   (row r's slice, no padding on disk)
    row      A0 A1 A2 A3 A4 B0 B1 ... B9 .         width max_seq_len = 16
    cu_seqlens [0, 5, 15]   cu_seqlens_padded [0, 5, 16]   sequence_ids ("A", "B")

Reading the stored slices (:meth:`~PrepackedDataset.row_arrays`) costs what
copying the same bytes out of a raw ``np.memmap`` costs; building the
``PackedBatch`` (five ``(max_seq_len,)`` tensors) adds the row builder's cost
(``benchmarks/bench_offline.py`` measures both). A prepack with images reads its media
columns too (:class:`MediaReader`, ``_row_images``): field for field what
:meth:`~sftpack.PackedBatch.from_samples` of the row's samples gives, each sequence's media
rebuilt by the family the manifest names and the row's images patchified from their stored
uint8 pixels into one buffer (a row with images is read as a batch of one). Several rows are read
together by :meth:`~PrepackedDataset.batch` (epoch positions) or
:meth:`~PrepackedDataset.read_rows` (global rows): one compiled pass
(:mod:`._collate`, numba) lays them end to end straight from the mappings,
field for field what reading them one by one and collating them gives, at a
fraction of the per-row cost (the same benchmark measures it). A ``DataLoader``
with a ``batch_size`` fetches through :meth:`~PrepackedDataset.__getitems__`
and ``ds.collate`` hands the batch on as is. Resident pages of a file
mapping count in a process's RSS, so the reader hands them back to the page
cache (``madvise(MADV_DONTNEED)``) after every 16 MB read: an epoch's peak RSS
stays about flat whatever the prepack's size (measured by the same benchmark).

Opening always checks the manifest (its own checksum, every entry's type,
the layout against the fingerprint), every file's size and every ``.npy``
header (dtype and length against the manifest). ``verify="size"`` (the
default) also checks the small index files: their SHA-256 and their structure
(offsets that increase, sequences that tile the tokens, conversation numbers in
range, every row fitting ``max_seq_len`` with its sequences padded to the pad
multiple), O(rows + sequences); ``verify="full"`` adds the SHA-256 of the bulk
token and mask data, O(tokens) (``benchmarks/bench_offline.py --verify-only``
measures each mode). ``verify=None`` skips the index checks (a DataLoader worker
re-opening what its parent checked). Any damage is a :class:`PrepackError`
naming the file. ``expect=`` compares the trainer's settings with the
fingerprint.

A prepack with per-token weights (``weights.npy``) gives every row its
:attr:`~sftpack.PackedBatch.weights` (label-aligned, as :meth:`~sftpack.PackedBatch.from_samples`
lays a sample's: 1 on the targets of a sample that had none); one of preference pairs
(``roles.npy``) gives each sequence the id ``(group, role)`` (:func:`sftpack.sample.pair_sequence_id`),
so ``sftpack.objectives.pairs_of(row, sftpack.sample.pair_meta(row.sequence_ids))`` reads its pairs.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, cast, overload

import numpy as np
import torch

from .._base import StrEnum, choose, renamed, warn_renamed
from ..balance import SequenceCost, sequence_cost
from ..handoff import PackedBatch, PackedBatchError, build_row, padded_lengths
from ..handoff.payload import Media
from ..sample import IGNORE_INDEX
from . import _collate, _shard
from ._fingerprint import tokenizer_fingerprint
from ._format import (
    FILES,
    IMAGE_DTYPE,
    INDEX_FILES,
    MEDIA_FILES,
    MEDIA_INDEX_FILES,
    PAIR_ROLES,
    ROLES_FILE,
    ROW_DTYPE,
    SEQUENCE_DTYPE,
    WEIGHTS_FILE,
    PrepackError,
    column_files,
    file_sha256,
    open_npy,
    read_manifest,
)
from ._row_images import MediaReader

__all__ = ["BatchedRows", "MediaReader", "PrepackedDataset", "Verify"]

_RELEASE_BYTES = 16 << 20
#: attributes that view the mappings: never pickled, opened again by a DataLoader worker
_MAPPED = (
    "_arrays",
    "_maps",
    "tokens",
    "loss_mask",
    "sequences",
    "rows",
    "_index",
    "_token_bytes",
    "media",
    "weights",
    "roles",
)
assert _collate.IGNORE == IGNORE_INDEX  # the kernel writes the label the handoff ignores


def collate(rows: Any) -> PackedBatch:
    """A ``DataLoader``'s ``collate_fn`` for :class:`PrepackedDataset`: the rows laid end to end.

    Takes what the loader fetched: the :class:`BatchedRows` of ``__getitems__`` (the batch the
    compiled reader already built, returned as is), one :class:`PackedBatch`, or any sequence of
    rows (:meth:`PackedBatch.concat`).
    """
    if isinstance(rows, BatchedRows):
        return rows.batch
    if isinstance(rows, PackedBatch):
        return rows
    return PackedBatch.concat(rows)


class BatchedRows(Sequence[PackedBatch]):
    """Rows read together (:meth:`PrepackedDataset.__getitems__`): a sequence of
    :class:`PackedBatch` rows whose :attr:`batch` is all of them laid end to end.

    ``rows.batch`` equals ``PackedBatch.concat(list(rows))``, field for field; it is built
    first, in one compiled pass, and :meth:`PrepackedDataset.collate` returns it as is. A
    ``collate_fn`` that iterates gets each row (tensor views of the batch, cut on first access;
    a row's media is its :meth:`~sftpack.handoff.payload.Media.piece` of the batch's).
    """

    __slots__ = ("_rows", "_seqs", "batch", "widths")

    def __init__(self, batch: PackedBatch, widths: Sequence[int], sequences: Sequence[int]):
        self.batch = batch
        self.widths = tuple(widths)  # slots of each row
        self._rows: list[PackedBatch] | None = None
        self._seqs = tuple(sequences)  # sequences of each row

    def __len__(self) -> int:
        return len(self.widths)

    @overload
    def __getitem__(self, i: int) -> PackedBatch: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[PackedBatch]: ...
    def __getitem__(self, i: int | slice) -> PackedBatch | Sequence[PackedBatch]:
        if self._rows is None:
            self._rows = self._cut()
        return self._rows[i]

    def _cut(self) -> list[PackedBatch]:
        b, out = self.batch, []
        slot = seq = 0
        for width, n in zip(self.widths, self._seqs):
            cu = b.cu_seqlens[seq : seq + n + 1]
            cup = b.cu_seqlens_padded[seq : seq + n + 1]
            out.append(
                PackedBatch(
                    input_ids=b.input_ids[slot : slot + width],
                    labels=b.labels[slot : slot + width],
                    position_ids=b.position_ids[slot : slot + width],
                    cu_seqlens=cu - cu[0],
                    cu_seqlens_padded=cup - cup[0],
                    max_seqlen=int((cup[1:] - cup[:-1]).max()),
                    sequence_ids=None if b.sequence_ids is None else b.sequence_ids[seq : seq + n],
                    media=None if b.media is None else _cut_media(b.media, slot, width, seq),
                    weights=None if b.weights is None else b.weights[slot : slot + width],
                )
            )
            slot, seq = slot + width, seq + n
        return out

    def __repr__(self) -> str:
        return f"BatchedRows({len(self)} rows, {self.batch!r})"


def _cut_media(media: Media, slot: int, width: int, seq: int) -> Media:
    """The media of the row at slots ``[slot, slot + width)`` of a batch, whose first segment is the
    batch's ``seq``-th: its items, runs and segments counted from the row's start (a row starts a
    segment, so its multimodal positions are the batch's as they are)."""
    own = media.piece(slot, slot + width)
    return dataclasses.replace(own, sequence=own.sequence - seq)


class Verify(StrEnum):
    """How much :class:`PrepackedDataset` checks when it opens a directory."""

    SIZE = "size"  #: the manifest, every file's size and header, the index files' SHA-256 and structure
    FULL = "full"  #: all of that plus the SHA-256 of tokens.npy and loss_mask.npy (reads every byte)


_EXPECT_KEYS = ("max_seq_len", "pad_multiple", "tokenizer", "pad_id", "train_on", "overlong")


class PrepackedDataset(torch.utils.data.Dataset):
    """The rows of a prepack directory (written by ``sftpack prepack``).

    Args:
        path: the directory.
        verify: ``"size"`` (default), ``"full"`` or ``None`` (see :class:`Verify`): ``None`` still
            checks the manifest, the sizes and the headers, but not the index.
        expect: the trainer's settings, checked against the fingerprint: a mapping
            with any of ``max_seq_len``, ``pad_multiple``, ``tokenizer`` (a tokenizer
            object, or its fingerprint's ``sha256``), ``pad_id``, ``train_on``,
            ``overlong``. A mismatch raises :class:`PrepackError` naming both values.
        shuffle, seed: the epoch's one order of all rows (the global stream) is a permutation
            seeded by ``(seed, epoch)`` (:meth:`set_epoch`); without ``shuffle``, row order.
        rank, world_size: this data-parallel rank among ``world_size``.
        rows_per_rank: the rows each rank takes per step (its ``DataLoader``'s ``batch_size``,
            times its micro-batches per step): a step is the next ``rows_per_rank *
            world_size`` rows of the stream, dealt to the ranks by cost.
        cost: what a row costs (a :class:`~sftpack.balance.SequenceCost` over its sequences'
            lengths): any :func:`~sftpack.balance.sequence_cost` spelling, ``"attention"``
            (default), ``"tokens"``, a model size (``"7b"``), a model directory. A prepack's
            rows are nearly full, so their tokens hardly differ and a deal by tokens is no
            better than none; what differs is attention, ``sum(len**2)``, which ranks rows of
            equal tokens as a decoder's FLOPs do (``"7b"`` deals 8 and 64 ranks alike).
        balance: the old name of ``cost`` (``"tokens"`` or ``"attention"``), accepted for one
            release with a ``DeprecationWarning``.

    The rows a rank reads (:mod:`._shard`): each epoch has one order of all rows, whatever
    ``world_size``; step ``s`` is positions ``[s * B, (s + 1) * B)`` of it (``B =
    rows_per_rank * world_size``), dealt to the ranks by cost, ``rows_per_rank`` each,
    heaviest first (:meth:`step_rows`). ``len(ds)`` is this rank's rows in the epoch's full
    steps (``rows_per_rank`` per step; the last ``num_rows mod B`` rows of the stream wait
    for another epoch) and ``ds[i]`` the ``i``-th of them: this rank's row ``i %
    rows_per_rank`` of step ``i // rows_per_rank``. So a ``DataLoader(ds,
    batch_size=rows_per_rank)`` without a sampler of its own gives each rank its share of the
    same global steps whatever ``world_size`` (one rank, the defaults: ``ds[i]`` is row
    ``i``). :meth:`row` reads any row by its global number. ``ds.batch(indices)`` reads several rows laid end to end in
    one compiled pass (``PackedBatch.concat([ds[i] for i in indices])``, field for
    field); ``ds.read_rows(rows)`` does the same by global row numbers. For a
    ``DataLoader(ds, batch_size=B, collate_fn=ds.collate)``, the loader fetches each
    batch through :meth:`__getitems__` (the same pass) and ``ds.collate`` returns it;
    any other ``collate_fn`` gets the rows one by one.

    >>> import tempfile, numpy as np
    >>> from sftpack import Sample
    >>> from sftpack.offline import prepack_samples
    >>> a = Sample(np.arange(1, 6), np.ones(5, bool), "A")
    >>> b = Sample(np.arange(101, 111), np.ones(10, bool), "B")
    >>> out = prepack_samples([a, b], tempfile.mkdtemp() + "/ab", max_seq_len=16).path
    >>> ds = PrepackedDataset(out)
    >>> row = ds[0]
    >>> row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist(), row.sequence_ids
    ([0, 5, 15], [0, 5, 16], ('A', 'B'))
    >>> two = ds.batch([0, 0])
    >>> two.cu_seqlens_padded.tolist(), two.sequence_ids
    ([0, 5, 16, 21, 32], ('A', 'B', 'A', 'B'))
    """

    collate = staticmethod(collate)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: str | Verify | None = "size",
        expect: Mapping[str, Any] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        rows_per_rank: int = 1,
        cost: str | Path | SequenceCost | None = None,
        balance: str | Path | SequenceCost | None = None,
    ):
        self.path = Path(path)
        self.manifest: dict[str, Any] = read_manifest(self.path)
        mode = None if verify is None else choose(Verify, verify, "verify")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")
        if rows_per_rank < 1:
            raise ValueError(f"rows_per_rank={rows_per_rank}: a rank takes at least one row per step")
        self.shuffle, self.seed, self.rank, self.world_size = bool(shuffle), int(seed), int(rank), int(world_size)
        self.rows_per_rank = int(rows_per_rank)
        spec = renamed("PrepackedDataset", "cost", cost, "balance", balance)  # mypy joins the unions to object
        self.cost: SequenceCost = sequence_cost(cast("str | Path | SequenceCost | None", spec), default="attention")
        self.max_seq_len = int(self.manifest["max_seq_len"])
        self.pad_multiple = int(self.manifest["pad_multiple"])
        self.pad_id = int(self.manifest["pad_id"])
        if expect is not None:
            self._check_expect(expect)
        self._open(mode)
        self._costs: np.ndarray | None = None  # row_costs() of self.cost, on first use
        self.set_epoch(0)

    # ------------------------------------------------------------------ opening and checks

    def _open(self, mode: Verify | None) -> None:
        files, counts = self.manifest["files"], self.manifest["counts"]
        media = self.manifest.get("media")
        columns = column_files(self.manifest)
        names = (FILES + MEDIA_FILES if media is not None else FILES) + columns
        for name in names:
            p = self.path / name
            if not p.is_file():
                raise PrepackError(
                    f"{p} is missing (deleted or renamed?): the prepack is incomplete; write it again with sftpack prepack"
                )
            if p.stat().st_size != files[name]["bytes"]:
                raise PrepackError(
                    f"{p} is {p.stat().st_size} bytes, the manifest says {files[name]['bytes']}: the file is "
                    "truncated or was replaced; write the prepack again"
                )
        if mode is not None:  # the index always, the bulk token and mask data with "full"
            index: tuple[str, ...] = INDEX_FILES + MEDIA_INDEX_FILES if media is not None else INDEX_FILES
            index += tuple(c for c in columns if c == ROLES_FILE)  # roles: per sequence, small
            for name in names if mode is Verify.FULL else index:
                if file_sha256(self.path / name) != files[name]["sha256"]:
                    raise PrepackError(
                        f"{self.path / name} does not match its checksum in the manifest (SHA-256 differs): the "
                        "file is damaged; write the prepack again"
                    )
        shapes = {
            "tokens": (np.dtype(self.manifest["token_dtype"]), counts["tokens"]),
            "loss_mask": (np.dtype(np.bool_), counts["tokens"]),
            "sequences": (SEQUENCE_DTYPE, counts["sequences"]),
            "rows": (ROW_DTYPE, counts["rows"] + 1),
            "conversation_ids": (np.dtype(np.uint8), None),
            "conversation_offsets": (np.dtype("<i8"), None),
        }
        self._arrays = {}
        self._maps: dict[str, mmap.mmap | None] = {}
        for name in FILES:
            key = name[: -len(".npy")]
            dtype, length = shapes[key]
            arr, mm = open_npy(self.path / name, dtype, length)
            self._arrays[key], self._maps[key] = arr, mm
        self.tokens = self._arrays["tokens"]
        self.loss_mask = self._arrays["loss_mask"]
        self.sequences = self._arrays["sequences"]
        self.rows = self._arrays["rows"]
        # the index fields as plain strided views, what the compiled batch reader takes (in its order)
        self._index = (
            self.rows["sequence"],
            self.rows["token"],
            self.sequences["length"],
            self.sequences["conversation"],
            self._arrays["conversation_offsets"],
            self._arrays["conversation_ids"],
        )
        self._token_bytes = self.tokens.view(np.uint8)
        #: ``(T,)`` float64 each token's weight (``weights.npy``), ``None`` without weights
        self.weights: np.ndarray | None = None
        #: ``(S,)`` uint8 each sequence's role in its pair (``roles.npy``), ``None`` for SFT
        self.roles: np.ndarray | None = None
        for name, dtype, length in (
            (WEIGHTS_FILE, np.float64, counts["tokens"]),
            (ROLES_FILE, np.uint8, counts["sequences"]),
        ):
            if name in columns:
                arr, mm = open_npy(self.path / name, np.dtype(dtype), length)
                key = name[: -len(".npy")]
                self._arrays[key], self._maps[key] = arr, mm
                setattr(self, key, arr)
        self.media: MediaReader | None = None
        if media is not None:
            shapes = {
                "pixels": (np.dtype(np.uint8), media["pixel_bytes"]),
                "images": (IMAGE_DTYPE, media["images"]),
                "row_images": (np.dtype("<i8"), counts["rows"] + 1),
            }
            for name in MEDIA_FILES:
                key = name[: -len(".npy")]
                arr, mm = open_npy(self.path / name, *shapes[key])
                self._arrays[key], self._maps[key] = arr, mm
            self.media = MediaReader(self.path, self.manifest, self._arrays)
        if mode is not None:
            self._check_index()
            if self.media is not None:
                self.media.check(self.rows, self.sequences, counts)
        self._read_bytes = 0

    def _check_index(self) -> None:
        """The index files' structure, against each other and the manifest: O(rows + sequences),
        never the tokens. Each failed check names the file and the first bad entry."""
        rows, seqs, n_tok = self.rows, self.sequences, self.tokens.shape[0]
        offs, blob = self._arrays["conversation_offsets"], self._arrays["conversation_ids"]
        n_conv = offs.shape[0] - 1

        def fail(name: str, what: str) -> PrepackError:
            return PrepackError(f"{self.path / name} is inconsistent ({what}): the prepack is damaged; write it again")

        def first(bad: np.ndarray) -> int:
            return int(np.flatnonzero(bad)[0])

        if n_conv < 0 or int(offs[0]) != 0 or int(offs[-1]) != blob.shape[0]:
            raise fail(
                "conversation_offsets.npy", f"it must run from 0 to {blob.shape[0]}, the size of conversation_ids.npy"
            )
        if np.any(np.diff(offs) < 1):
            raise fail("conversation_offsets.npy", f"entry {first(np.diff(offs) < 1) + 1} does not increase")
        r_seq, r_tok = rows["sequence"], rows["token"]
        if rows.shape[0] < 2 or int(r_seq[0]) != 0 or int(r_tok[0]) != 0:
            raise fail("rows.npy", "it must start at sequence 0, token 0 and hold at least one row")
        if int(r_seq[-1]) != seqs.shape[0] or int(r_tok[-1]) != n_tok:
            raise fail("rows.npy", f"it must end at sequence {seqs.shape[0]}, token {n_tok}")
        if np.any(np.diff(r_seq) < 1):
            raise fail(
                "rows.npy", f"row {first(np.diff(r_seq) < 1)} holds no sequence (sequence offsets must increase)"
            )
        length, start = seqs["length"].astype(np.int64), seqs["start"]
        if np.any(length < 1):
            raise fail("sequences.npy", f"sequence {first(length < 1)} has length {int(length[first(length < 1)])}")
        ends = np.cumsum(length)
        tiled = start != ends - length
        if np.any(tiled) or int(ends[-1]) != n_tok:
            k = first(tiled) if np.any(tiled) else seqs.shape[0] - 1
            raise fail(
                "sequences.npy",
                f"sequence {k} does not start where the one before it ends (the sequences "
                f"must tile the {n_tok} tokens)",
            )
        if np.any(r_tok[:-1] != start[r_seq[:-1]]):
            raise fail(
                "rows.npy", f"row {first(r_tok[:-1] != start[r_seq[:-1]])} does not start at its first sequence's token"
            )
        conv = seqs["conversation"]
        if np.any((conv < 0) | (conv >= n_conv)):
            k = first((conv < 0) | (conv >= n_conv))
            raise fail("sequences.npy", f"sequence {k} names conversation {int(conv[k])}, there are {n_conv}")
        if np.any(seqs["piece"] < 0):
            raise fail("sequences.npy", f"sequence {first(seqs['piece'] < 0)} has a negative piece number")
        if self.roles is not None:  # a pair's two sequences: one conversation, one row, two roles
            if np.any(self.roles >= len(PAIR_ROLES)):
                raise fail(ROLES_FILE, f"sequence {first(self.roles >= len(PAIR_ROLES))} has no role")
            row_of = np.repeat(np.arange(r_seq.shape[0] - 1), np.diff(r_seq))
            order = np.lexsort((self.roles, conv))
            same = conv[order][1:] == conv[order][:-1]
            apart = same & (
                (row_of[order][1:] != row_of[order][:-1]) | (self.roles[order][1:] == self.roles[order][:-1])
            )
            if np.any(apart):
                raise fail(
                    ROLES_FILE,
                    f"pair {int(conv[order][1:][apart][0])} is not one chosen and one rejected sequence in one row",
                )
        loads = np.add.reduceat(padded_lengths(length, self.pad_multiple), r_seq[:-1])
        if int(loads.max()) > self.max_seq_len:
            r = int(np.argmax(loads))
            raise fail(
                "sequences.npy",
                f"row {r} needs {int(loads[r])} slots with each sequence padded to a multiple "
                f"of {self.pad_multiple}, more than max_seq_len={self.max_seq_len}",
            )
        c = self.manifest["counts"]
        if n_conv != c["packed_conversations"]:
            raise fail(
                "conversation_offsets.npy",
                f"it holds {n_conv} conversations, the manifest counts {c['packed_conversations']}",
            )
        if int(np.diff(r_seq).max()) != c["max_sequences_per_row"]:
            raise fail(
                "rows.npy",
                f"its longest row holds {int(np.diff(r_seq).max())} sequences, the manifest "
                f"counts {c['max_sequences_per_row']}",
            )

    def _check_expect(self, expect: Mapping[str, Any]) -> None:
        unknown = sorted(set(expect) - set(_EXPECT_KEYS))
        if unknown:
            raise ValueError(f"expect= has unknown keys {unknown}: valid keys are {', '.join(_EXPECT_KEYS)}")
        fp = self.manifest["fingerprint"]
        for key in ("max_seq_len", "pad_multiple", "pad_id", "train_on", "overlong"):
            if key not in expect:
                continue
            have = self.manifest.get(key, fp.get(key))
            want = expect[key]
            if str(have) != str(want):
                flag = "--" + key.replace("_", "-")
                raise PrepackError(
                    f"{self.path} was prepacked with {key}={have!r} but the trainer expects {key}={want!r}: "
                    f"prepack again with {flag} {want} or set the trainer's {key} to {have}"
                )
        if "tokenizer" in expect:
            want_tok = expect["tokenizer"]
            want = want_tok if isinstance(want_tok, str) else tokenizer_fingerprint(want_tok)["sha256"]
            have_fp = fp.get("tokenizer") or {}
            if have_fp.get("sha256") != want:
                name = have_fp.get("name_or_path") or "?"
                raise PrepackError(
                    f"{self.path} was prepacked with another tokenizer (fingerprint {str(have_fp.get('sha256'))[:12]}, "
                    f"{name!r}) than the trainer's (fingerprint {want[:12]}): token ids would mean different "
                    "things; prepack again with --tokenizer pointing at the trainer's tokenizer"
                )

    # ------------------------------------------------------------------ epochs and shards

    @property
    def balance(self) -> str:
        """The old name of :attr:`cost`'s name (deprecated: read ``ds.cost``)."""
        warn_renamed("PrepackedDataset", ".balance", ".cost", stacklevel=2)
        return self.cost.name

    def row_costs(self, cost: str | Path | SequenceCost | None = None) -> np.ndarray:
        """``(R,)`` float64 cost of every row: its sequences' :class:`~sftpack.balance.SequenceCost`
        summed (``"attention"``: ``sum(len**2)``; ``"tokens"``: its real tokens); ``cost``
        defaults to the dataset's (:attr:`cost`)."""
        model = self.cost if cost is None else sequence_cost(cost)
        if model == self.cost and self._costs is not None:
            return self._costs.copy()
        out = model.of_groups(self.sequences["length"], self.rows["sequence"])
        if model == self.cost:
            self._costs = out
        return out.copy()

    def _row_cost_cache(self) -> np.ndarray:
        if self._costs is None:
            self.row_costs()
        assert self._costs is not None
        return self._costs

    def set_epoch(self, epoch: int) -> None:
        """Go to ``epoch``'s order of the rows (with ``shuffle``, a fresh seeded one); every rank must
        call it alike."""
        self.epoch = int(epoch)
        self._stream = _shard.epoch_order(self.num_rows, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle)
        self._order: np.ndarray | None = None  # this rank's rows of the epoch, on first use

    @property
    def num_rows(self) -> int:
        """Rows in the whole prepack (all ranks)."""
        return int(self.rows.shape[0] - 1)

    @property
    def steps_per_epoch(self) -> int:
        """The epoch's full steps of ``rows_per_rank * world_size`` rows."""
        return self.num_rows // (self.rows_per_rank * self.world_size)

    def epoch_order(self) -> np.ndarray:
        """``(num_rows,)`` int64: this epoch's one order of all rows (the same on every rank, for any
        ``world_size``)."""
        return self._stream.copy()

    def step_rows(self, start: int, count: int) -> np.ndarray:
        """``(world_size, count // world_size)`` int64: the global rows at positions ``[start, start +
        count)`` of this epoch's order dealt to the ranks by cost (:mod:`._shard`): line ``r`` is
        rank ``r``'s rows, heaviest first. What one training step reads (``count``: its rows over all
        ranks), computed alike on every rank.

        >>> import tempfile
        >>> from sftpack.offline import prepack_samples
        >>> from sftpack.testing import samples_from_lengths
        >>> out = prepack_samples(samples_from_lengths([6, 9, 7, 8]), tempfile.mkdtemp() + "/p", max_seq_len=9).path
        >>> ds = PrepackedDataset(out, rank=1, world_size=2)
        >>> ds.row_costs().tolist()  # four rows of one sequence each: len**2
        [81.0, 64.0, 49.0, 36.0]
        >>> ds.step_rows(0, 4).tolist()  # rank 0: 81 + 36, rank 1: 64 + 49
        [[0, 3], [1, 2]]
        >>> ds.epoch_rows().tolist()  # what ds[0], ds[1] read: rank 1's rows of steps 0 and 1
        [1, 3]
        """
        start, count = int(start), int(count)
        if start < 0 or count < 1 or start + count > self.num_rows:
            raise IndexError(
                f"rows [{start}, {start + count}) of the epoch's order: the prepack has {self.num_rows} rows"
            )
        return _shard.deal_rows(self._stream[start : start + count], self._row_cost_cache(), self.world_size)

    def epoch_rows(self) -> np.ndarray:
        """``(len(self),)`` int64: the global rows this rank reads this epoch, in order."""
        return self._rank_rows().copy()

    def _rank_rows(self) -> np.ndarray:
        if self._order is None:
            k, w = self.rows_per_rank, self.world_size
            n = self.steps_per_epoch * k * w
            if w == 1:
                self._order = self._stream[:n].copy()
            else:
                self._order = np.concatenate(
                    [self.step_rows(s, k * w)[self.rank] for s in range(0, n, k * w)] or [np.zeros(0, np.int64)]
                )
        return self._order

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return self.steps_per_epoch * self.rows_per_rank

    def __getitem__(self, i: int) -> PackedBatch:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} is out of range for {n} rows")
        return self.row(int(self._rank_rows()[i]))

    def conversation_id(self, c: int) -> Any:
        """The id of conversation number ``c`` (as the source gave it)."""
        offs, blob = self._arrays["conversation_offsets"], self._arrays["conversation_ids"]
        raw = blob[int(offs[c]) : int(offs[c + 1])].tobytes()
        try:
            if (
                raw[:1] == b'"' and raw[-1:] == b'"' and b"\\" not in raw
            ):  # a plain string: skip the JSON parser (5x faster)
                return raw[1:-1].decode("utf-8")
            return json.loads(raw)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise PrepackError(
                f"{self.path / 'conversation_ids.npy'}: the id of conversation {c} is not valid JSON ({e}): the "
                "file is damaged (verify='full' checks it); write the prepack again"
            ) from None

    def row_sequences(self, r: int) -> np.ndarray:
        """The index records (start, length, conversation, piece) of row ``r``'s sequences."""
        a, b = int(self.rows[r]["sequence"]), int(self.rows[r + 1]["sequence"])
        return self.sequences[a:b]

    def row_arrays(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global row ``r`` as stored: ``(ids (L,), loss_mask (L,) bool, sequences (N,) records)``,
        read-only memmap slices (no copy, no padding)."""
        n = self.num_rows
        if not -n <= r < n:
            raise IndexError(f"row {r} is out of range for {n} rows")
        r %= n
        lo, hi = self.rows[r], self.rows[r + 1]
        t0, t1 = int(lo["token"]), int(hi["token"])
        self._read_bytes += (t1 - t0) * (self.tokens.itemsize + 1)
        if self._read_bytes >= _RELEASE_BYTES:
            self.release_pages()
        return self.tokens[t0:t1], self.loss_mask[t0:t1], self.sequences[int(lo["sequence"]) : int(hi["sequence"])]

    def row(self, r: int) -> PackedBatch:
        """Global row ``r`` as a :class:`PackedBatch` of width ``max_seq_len``; ``sequence_ids`` holds
        each segment's conversation id (a row with images: :meth:`read_rows` of the one row)."""
        if self.media is not None:
            n = self.num_rows
            if not -n <= r < n:
                raise IndexError(f"row {r} is out of range for {n} rows")
            return self.read_rows(np.array([r % n], np.int64))
        ids, mask, seqs = self.row_arrays(r)
        weights = None
        if self.weights is not None:
            t0 = int(seqs["start"][0]) if seqs.shape[0] else 0
            weights = self.weights[t0 : t0 + ids.shape[0]]
        try:
            a = int(self.rows[r % self.num_rows]["sequence"])
            return build_row(
                ids,
                mask,
                seqs["length"],
                max_seq_len=self.max_seq_len,
                pad_multiple=self.pad_multiple,
                pad_id=self.pad_id,
                sequence_ids=self._ids([self.conversation_id(int(c)) for c in seqs["conversation"]], a, a + len(seqs)),
                weights=weights,
            )
        except (
            PackedBatchError,
            IndexError,
        ) as e:  # only a damaged index gets here (opening with verify=None skips its checks)
            raise PrepackError(
                f"{self.path}: row {r} cannot be read ({e}): the index is damaged; open it with verify='size' to "
                "find the file, and write the prepack again"
            ) from None

    def row_images(self, r: int) -> list[np.ndarray]:
        """Global row ``r``'s images as stored: resized ``(H, W, 3)`` uint8 arrays, in row order
        (empty for a prepack without media)."""
        return [] if self.media is None else self.media.stored_images(r)

    # ------------------------------------------------------------------ batched reading

    def _positions(self, indices: Iterable[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices), dtype=np.int64).reshape(-1)
        n = len(self)
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            raise IndexError(f"row {int(idx[np.flatnonzero(bad)[0]])} is out of range for {n} rows")
        return self._rank_rows()[idx % n] if n else idx

    def batch(self, indices: Iterable[int] | np.ndarray) -> PackedBatch:
        """Rows ``ds[i]`` for ``i`` in ``indices`` laid end to end, as one :class:`PackedBatch`:
        field for field ``PackedBatch.concat([ds[i] for i in indices])``, built in one compiled pass."""
        return self.read_rows(self._positions(indices))

    def __getitems__(self, indices: Sequence[int]) -> BatchedRows:
        """What a ``DataLoader`` with ``batch_size`` fetches (torch's batched-fetch protocol): the rows
        ``ds[i]`` as a :class:`BatchedRows`, whose collated batch :meth:`collate` returns as is."""
        rows = self._positions(indices)
        seqs = self.rows["sequence"]
        counts = (seqs[rows + 1] - seqs[rows]).tolist()
        return BatchedRows(self.read_rows(rows), [self.max_seq_len] * len(counts), counts)

    def read_rows(self, rows: Iterable[int] | np.ndarray) -> PackedBatch:
        """Global rows laid end to end, as one :class:`PackedBatch`: field for field
        ``PackedBatch.concat([ds.row(r) for r in rows])``, built in one compiled pass. Rows with
        images add their media (:meth:`MediaReader.lay_rows`): every sequence's laid at once and every
        image of the batch patchified from its stored pixels into the batch's one ``pixel_values``."""
        r = np.asarray(rows if isinstance(rows, np.ndarray) else list(rows), dtype=np.int64).reshape(-1)
        n = self.num_rows
        if r.shape[0] == 0:
            raise PackedBatchError("PrepackedDataset.read_rows needs at least one row, got none")
        bad = (r < -n) | (r >= n)
        if bad.any():
            raise IndexError(f"row {int(r[np.flatnonzero(bad)[0]])} is out of range for {n} rows")
        r = r % n
        if r.shape[0] * self.max_seq_len >= 1 << 31:  # int32 boundaries: leave the overflow to concat's own rules
            return PackedBatch.concat([self.row(int(x)) for x in r])
        out = _collate.collate_rows(
            self._token_bytes,
            self.tokens.itemsize,
            self.loss_mask,
            self._index,
            r,
            self.max_seq_len,
            self.pad_multiple,
            self.pad_id,
        )
        status, ids, labels, pos, cu, cup, max_seqlen, conv, id_buf, id_bounds, plain = out
        if status != _collate.OK:  # a damaged index (opened with verify=None): the row reader names it
            if self.media is not None:
                self._damaged(r, f"its index fails check {status} of the batch reader")
            return PackedBatch.concat([self.row(int(x)) for x in r])
        self._read_bytes += int(cu[-1]) * (self.tokens.itemsize + 1)
        media = None
        if self.media is not None:
            try:
                media = self.media.lay_rows(r, self.rows["sequence"], ids, cu, cup)
            except (PackedBatchError, IndexError, ValueError) as e:  # a damaged index (verify=None skips its checks)
                self._damaged(r, str(e))
            self._read_bytes += self.media.stored_bytes(self.media.image_range(r))
        if self._read_bytes >= _RELEASE_BYTES:
            self.release_pages()
        return PackedBatch(
            input_ids=torch.from_numpy(ids),
            labels=torch.from_numpy(labels),
            position_ids=torch.from_numpy(pos),
            cu_seqlens=torch.from_numpy(cu),
            cu_seqlens_padded=torch.from_numpy(cup),
            max_seqlen=int(max_seqlen),
            sequence_ids=self._batch_ids(r, self._decode_ids(conv, id_buf, id_bounds, plain)),
            media=media,
            weights=None if self.weights is None else torch.from_numpy(self._lay_weights(r, cup, labels)),
        )

    def _sequences_of(self, rows: np.ndarray) -> np.ndarray:
        """The global sequence numbers of ``rows``, row after row."""
        seq = self.rows["sequence"]
        a, b = seq[rows].astype(np.int64), seq[rows + 1].astype(np.int64)
        n = b - a
        return np.repeat(a - np.cumsum(n) + n, n) + np.arange(int(n.sum()), dtype=np.int64)

    def _ids(self, groups: list[Any], a: int, b: int) -> Any:
        """Sequences ``a:b``'s ids: their conversation ids, or for pairs ``(group, role)``."""
        if self.roles is None:
            return groups
        return [(g, PAIR_ROLES[k]) for g, k in zip(groups, self.roles[a:b].tolist())]

    def _batch_ids(self, rows: np.ndarray, groups: tuple) -> tuple:
        if self.roles is None:
            return groups
        roles = self.roles[self._sequences_of(rows)].tolist()
        return tuple((g, PAIR_ROLES[k]) for g, k in zip(groups, roles))

    def _lay_weights(self, rows: np.ndarray, cup: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """``(slots,)`` float64 label-aligned weights of ``rows`` laid end to end (cu_seqlens_padded
        ``cup``): a sequence's slot ``j`` holds its token ``j + 1``'s weight, what
        :func:`~sftpack.handoff.layout.lay_weights` lays for one row, 0 where the label is ``-100``."""
        assert self.weights is not None
        seqs = self.sequences[self._sequences_of(rows)]
        n = np.maximum(seqs["length"].astype(np.int64) - 1, 0)
        seg = np.repeat(np.arange(n.shape[0], dtype=np.int64), n)
        j = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        out = np.zeros(labels.shape[0], np.float64)
        out[np.asarray(cup, np.int64)[:-1][seg] + j] = self.weights[seqs["start"][seg] + j + 1]
        out[labels == IGNORE_INDEX] = 0
        return out

    def _damaged(self, rows: np.ndarray, what: str) -> NoReturn:
        which = f"row {int(rows[0])}" if rows.shape[0] == 1 else f"one of rows {rows[:8].tolist()}"
        raise PrepackError(
            f"{self.path}: {which}{'...' if rows.shape[0] > 8 else ''} cannot be read with its images ({what}): the "
            "index is damaged; open it with verify='size' to find the file, and write the prepack again"
        )

    def _decode_ids(self, conv: np.ndarray, buf: np.ndarray, bounds: np.ndarray, plain: np.ndarray) -> tuple:
        """The conversation ids of a batch from their raw bytes (gathered by the kernel): a plain
        string decoded directly, anything else through :meth:`conversation_id` (JSON, and its error)."""
        raw = buf.tobytes()
        b = bounds.tolist()
        out = []
        for k, simple in enumerate(plain.tolist()):
            if simple:
                try:
                    out.append(raw[b[k] + 1 : b[k + 1] - 1].decode("utf-8"))
                    continue
                except UnicodeDecodeError:
                    pass
            out.append(self.conversation_id(int(conv[k])))
        return tuple(out)

    def release_pages(self) -> None:
        """Hand the pages read so far back to the page cache (they stop counting in RSS)."""
        self._read_bytes = 0
        for mm in self._maps.values():  # the index too: over an epoch it is touched end to end
            if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                mm.madvise(mmap.MADV_DONTNEED)

    def __repr__(self) -> str:
        c = self.manifest["counts"]
        return (
            f"PrepackedDataset({str(self.path)!r}, rows={self.num_rows}, max_seq_len={self.max_seq_len}, "
            f"pad_multiple={self.pad_multiple}, fill={c['fill']:.2%}, rank={self.rank}/{self.world_size})"
        )

    # ------------------------------------------------------------------ pickling (DataLoader workers)

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in _MAPPED}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open(None)
