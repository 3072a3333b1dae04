"""Stage 1 of a prepack: samples in, staged tokens and the lengths array out.

Samples arrive in input order (from :func:`sftpack.chat.tokenize_conversations`,
or from an importer) and are appended to three flat staging files; only the
per-sample index (length, conversation number, piece: 20 bytes a sample) stays
in memory, because bin packing needs every length before any row is known::

    staging/tokens.u32     sample 0's ids, sample 1's ids, ...   (uint32, input order)
    staging/mask.u8        the same for the loss mask
    staging/ids.json8      each conversation's id as UTF-8 JSON, end to end

Peak memory is the index plus one flush buffer (``flush_tokens`` tokens, 1M
by default: 5 MB), whatever the number of tokens. The sample order is the
tokenizer's output order, which does not depend on its ``num_proc``, so the
staged bytes (and everything after them) are identical for any process count.

A conversation starts with every sample whose ``meta["piece"]`` is 0 (or absent),
or whose conversation id differs from the previous sample's (a piece whose
earlier pieces were filtered out): the pieces of a split conversation share its
number.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..sample import Sample

__all__ = ["StagedSamples", "StagingSource", "stage_samples"]

_TOKENS = "tokens.u32"
_MASK = "mask.u8"
_IDS = "ids.json8"


@dataclass
class StagedSamples:
    """The result of stage 1.

    Attributes:
        directory: the staging folder (three files, see the module docstring).
        lengths: ``(S,)`` int64, tokens of each sample in input order.
        conversation: ``(S,)`` int64, the conversation number of each sample.
        piece: ``(S,)`` int32, the piece number within a split conversation (0 otherwise).
        conversation_offsets: ``(C+1,)`` int64 byte offsets into the id file.
        max_id: the largest token id seen (-1 if none).
        tokens / trainable / labels / first_trainable: totals over the samples;
            ``labels == trainable - first_trainable`` (a sequence's first token
            is never a target).
    """

    directory: Path
    lengths: np.ndarray
    conversation: np.ndarray
    piece: np.ndarray
    conversation_offsets: np.ndarray
    max_id: int
    tokens: int
    trainable: int
    labels: int
    first_trainable: int

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_conversations(self) -> int:
        return int(self.conversation_offsets.shape[0] - 1)

    def source(self) -> StagingSource:
        """The token source stage 3 reads the rows' sequences from."""
        return StagingSource(self.directory, self.lengths)


def _id_json(cid: Any) -> bytes:
    try:
        return json.dumps(cid, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except TypeError:
        return json.dumps(str(cid), ensure_ascii=False).encode("utf-8")


def stage_samples(samples: Iterable[Sample], directory: Path, *, flush_tokens: int = 1 << 20) -> StagedSamples:
    """Append every sample's tokens and mask to staging files in ``directory``.

    Args:
        samples: :class:`~sftpack.Sample` objects in input order (each ``len >= 1``;
            ids in ``[0, 2**32)``).
        directory: an empty or new folder (created).
        flush_tokens: tokens buffered between writes.

    Returns:
        :class:`StagedSamples`.

    Raises:
        ValueError: a token id that is negative or does not fit 32 bits (naming the sample).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lengths, conv, piece = array("q"), array("q"), array("i")
    id_offsets = array("q", [0])
    ids_buf: list[np.ndarray] = []
    mask_buf: list[np.ndarray] = []
    buffered = 0
    max_id = -1
    trainable = labels = first_trainable = 0
    n_conv = -1
    prev_blob = b""
    with open(directory / _TOKENS, "wb") as ft, open(directory / _MASK, "wb") as fm, open(directory / _IDS, "wb") as fi:

        def flush() -> None:
            nonlocal buffered
            if ids_buf:
                # file.write, not ndarray.tofile: tofile loses the errno of a full disk
                ft.write(np.concatenate(ids_buf).astype(np.uint32, copy=False).data.cast("B"))
                fm.write(np.concatenate(mask_buf).astype(np.uint8, copy=False).data.cast("B"))
                ids_buf.clear()
                mask_buf.clear()
            buffered = 0

        for s in samples:
            ids = s.input_ids
            n = ids.shape[0]
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= 1 << 32:
                raise ValueError(
                    f"sample {len(lengths)} (conversation {s.conversation_id!r}) holds token id "
                    f"{lo if lo < 0 else hi}, outside [0, 2**32): token ids must be non-negative 32-bit integers"
                )
            max_id = max(max_id, hi)
            k = int(s.meta.get("piece", 0)) if s.meta else 0
            blob = _id_json(s.conversation_id)
            # A new conversation starts at piece 0, and also at a later piece whose
            # conversation differs from the previous sample's (its earlier pieces
            # were filtered out upstream): ids are never inherited.
            if k == 0 or n_conv < 0 or blob != prev_blob:
                n_conv += 1
                fi.write(blob)
                id_offsets.append(id_offsets[-1] + len(blob))
                prev_blob = blob
            mask = s.loss_mask
            t = int(np.count_nonzero(mask))
            first = bool(mask[0])
            trainable += t
            first_trainable += first
            labels += t - first
            lengths.append(n)
            conv.append(n_conv)
            piece.append(k)
            ids_buf.append(ids)
            mask_buf.append(mask)
            buffered += n
            if buffered >= flush_tokens:
                flush()
        flush()
        for f in (ft, fm, fi):
            f.flush()
            os.fsync(f.fileno())
    lens = np.frombuffer(lengths, dtype=np.int64).copy() if len(lengths) else np.zeros(0, np.int64)
    return StagedSamples(
        directory=directory,
        lengths=lens,
        conversation=np.frombuffer(conv, dtype=np.int64).copy() if len(conv) else np.zeros(0, np.int64),
        piece=np.frombuffer(piece, dtype=np.int32).copy() if len(piece) else np.zeros(0, np.int32),
        conversation_offsets=np.frombuffer(id_offsets, dtype=np.int64).copy(),
        max_id=max_id,
        tokens=int(lens.sum()),
        trainable=trainable,
        labels=labels,
        first_trainable=first_trainable,
    )


def _read_into(f: Any, buf: memoryview, offset: int) -> None:
    fd = f.fileno()
    while buf.nbytes:
        n = os.preadv(fd, [buf], offset) if hasattr(os, "preadv") else _seek_read(f, buf, offset)
        if n <= 0:
            raise OSError(f"{f.name}: unexpected end of the staging file at byte {offset}")
        buf = buf[n:]
        offset += n


def _seek_read(f: Any, buf: memoryview, offset: int) -> int:  # pragma: no cover - no preadv
    f.seek(offset)
    return f.readinto(buf)


class StagingSource:
    """Reads samples back from the staging files (stage 3's local token source).

    :meth:`gather` returns the tokens and masks of the given samples laid end to
    end, in the given order, with one positioned read per sample (``os.preadv``)
    into the output arrays: nothing is mapped, so nothing piles up in RSS.
    """

    def __init__(self, directory: Path, lengths: np.ndarray):
        self.directory = Path(directory)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.zeros(self.lengths.shape[0] + 1, np.int64)
        np.cumsum(self.lengths, out=self.starts[1:])

    def gather(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids uint32, mask uint8)``, each ``(sum(lengths[samples]),)``."""
        samples = np.asarray(samples, dtype=np.int64)
        lens = self.lengths[samples]
        total = int(lens.sum())
        ids = np.empty(total, np.uint32)
        mask = np.empty(total, np.uint8)
        if total == 0:
            return ids, mask
        with (
            open(self.directory / _TOKENS, "rb", buffering=0) as ft,
            open(self.directory / _MASK, "rb", buffering=0) as fm,
        ):
            # one positioned read per sample straight into the output: no mapping (the kernel's
            # fault-around would map 64 KB around every small sample and count it in RSS) and no
            # index array as large as the chunk
            o = 0
            for a, k in zip(self.starts[samples].tolist(), lens.tolist()):
                _read_into(ft, ids[o : o + k].data.cast("B"), 4 * a)
                _read_into(fm, mask[o : o + k].data.cast("B"), a)
                o += k
        return ids, mask

    def conversation_ids_path(self) -> Path:
        return self.directory / _IDS
