"""Stage 1 of a prepack: samples in, staged tokens and the lengths array out.

Samples arrive in input order (from :func:`sftpack.chat.tokenize_conversations`,
or from an importer) and are appended to three flat staging files; only the
per-sample index (length, conversation number, piece: 20 bytes a sample) stays
in memory, because bin packing needs every length before any row is known::

    staging/tokens.u32     sample 0's ids, sample 1's ids, ...   (uint32, input order)
    staging/mask.u8        the same for the loss mask
    staging/ids.json8      each conversation's id as UTF-8 JSON, end to end

Samples with images (``media=True``) come as ``(sample, images)`` pairs (:class:`Images`: each
image's placeholder start, grid and resized uint8 pixels) and add the media columns::

    staging/pixels.u8      sample 0's images' pixels, sample 1's, ...   (uint8, input order)

with one 40-byte record per image (:data:`~sftpack.offline._format.IMAGE_DTYPE`) and the
sample's vision patches kept in memory (:class:`StagedMedia`).

Peak memory is the index plus one flush buffer (``flush_tokens`` tokens, 1M
by default: 5 MB), whatever the number of tokens. The sample order is the
tokenizer's output order, which does not depend on its ``num_proc``, so the
staged bytes (and everything after them) are identical for any process count.

A conversation starts with every sample whose ``meta["piece"]`` is 0 (or absent),
or whose conversation id differs from the previous sample's (a piece whose
earlier pieces were filtered out): the pieces of a split conversation share its
number.

The two optional columns (format version 5) are staged only when a sample needs them:

    staging/weights.f8     each token's weight (float64; 1 on a sample without weights), from the
                           first weighted sample's arrival on (the tokens before it filled with 1)

and, for preference pairs (``meta["role"]``, :func:`sftpack.chat.tokenize_pair`), each sample's
role (:data:`~sftpack.offline._format.PAIR_ROLES`) in memory, one byte a sample. A pair's members
come one after the other and share one conversation number, keyed by ``meta["group"]``: the
planner keeps each conversation number of a pair in one row. A prepack holds SFT conversations or
pairs, never both; a half pair, a member out of its pair's run, or a repeated role is refused,
naming the sample.
"""

from __future__ import annotations

import contextlib
import json
import os
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..sample import Sample, check_sft_sample, check_unweighted, sft_group
from ._format import IMAGE_DTYPE, PAIR_ROLES, PrepackError

__all__ = ["Images", "PairsOverRow", "StagedMedia", "StagedSamples", "StagingSource", "stage_samples"]

_TOKENS = "tokens.u32"
_MASK = "mask.u8"
_IDS = "ids.json8"
_PIXELS = "pixels.u8"
_WEIGHTS = "weights.f8"


@dataclass
class Images:
    """One sample's media items (images, videos) as a prepack stores them (its media columns).

    Attributes:
        starts: ``(I,)`` each item's placeholder run start in the sample.
        grids: ``(I, 3)`` each item's grid ``(t, h, w)`` (``(1, 1, n)``: a fixed-size image of ``n`` placeholders).
        pixels: each item's resized uint8 pixels, ``(H, W, 3)`` or ``(frames, H, W, 3)``.
        token_id, merge_size: the image placeholder id and the merge window (``None`` without media).
        video: ``(I,)`` which items are videos (``None``: none).
        seconds: ``(I,)`` float32 seconds a video item's temporal slice spans (``None``: 0 each).
    """

    starts: np.ndarray
    grids: np.ndarray
    pixels: list[np.ndarray]
    token_id: int | None = None
    merge_size: int | None = None
    video: np.ndarray | None = None
    seconds: np.ndarray | None = None


@dataclass
class StagedMedia:
    """The media columns of stage 1, in input order (the samples' order).

    Attributes:
        first_image: ``(S+1,)`` int64: sample ``s`` holds images ``first_image[s]:first_image[s+1]``.
        records: ``(I,)`` :data:`~sftpack.offline._format.IMAGE_DTYPE` in input order (``pixels``: the
            offset in the staging pixel file; ``sequence``: the input sample).
        patches: ``(S,)`` int64 vision patches of each sample (the planner's second budget).
        pixel_offsets: ``(S+1,)`` int64: sample ``s``'s pixels are bytes
            ``pixel_offsets[s]:pixel_offsets[s+1]`` of the staging pixel file.
        token_id, merge_size: the samples' placeholder id and merge window (``None``: no image).
    """

    first_image: np.ndarray
    records: np.ndarray
    patches: np.ndarray
    pixel_offsets: np.ndarray
    token_id: int | None
    merge_size: int | None

    @property
    def num_images(self) -> int:
        return int(self.records.shape[0])

    @property
    def pixel_bytes(self) -> int:
        return int(self.pixel_offsets[-1])


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
        media: the media columns of samples with images, else ``None``.
        roles: ``(S,)`` uint8 each sample's role in its preference pair (an index into
            :data:`~sftpack.offline._format.PAIR_ROLES`), ``None`` for SFT conversations.
        weighted: some sample carries weights: ``weights.f8`` holds every token's.
        sft_groups: ``(S,)`` int64 each SFT sample's group for the planner (``meta["group"]`` without a
            role: a prompt's RL completions, numbered by first appearance; a sample of no group, a
            number of its own), ``None`` when no SFT sample has a group (the plan of before groups).
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
    media: StagedMedia | None = None
    roles: np.ndarray | None = None
    weighted: bool = False
    sft_groups: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_conversations(self) -> int:
        return int(self.conversation_offsets.shape[0] - 1)

    def source(self) -> StagingSource:
        """The token source stage 3 reads the rows' sequences from."""
        return StagingSource(
            self.directory,
            self.lengths,
            None if self.media is None else self.media.pixel_offsets,
            weighted=self.weighted,
        )

    @property
    def groups(self) -> np.ndarray | None:
        """``(S,)`` the group of each sample for the planner, each kept whole in one row (a pair's
        conversation number; an SFT group's number, :attr:`sft_groups`), ``None`` for SFT without groups."""
        return self.sft_groups if self.roles is None else self.conversation


def _id_json(cid: Any) -> bytes:
    try:
        return json.dumps(cid, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except TypeError:
        return json.dumps(str(cid), ensure_ascii=False).encode("utf-8")


class _MediaStager:
    """Appends each sample's images to the staging pixel file and keeps their records."""

    def __init__(self, f: Any):
        self.f = f
        self.records: list[tuple] = []
        self.first_image = array("q", [0])
        self.pixel_offsets = array("q", [0])
        self.patches = array("q")
        self.token_id: int | None = None
        self.merge_size: int | None = None

    def add(self, n: int, s: Sample, im: Images) -> None:
        if im.token_id is not None:
            self.token_id = int(im.token_id) if self.token_id is None else self.token_id
            self.merge_size = int(im.merge_size or 1) if self.merge_size is None else self.merge_size
            if (int(im.token_id), int(im.merge_size or 1)) != (self.token_id, self.merge_size):
                raise PrepackError(
                    f"conversation {s.conversation_id!r}: another image token or merge size than the others"
                )
        offset = self.pixel_offsets[-1]
        grids = np.asarray(im.grids, np.int64).reshape(-1, 3)
        k = grids.shape[0]
        video = np.zeros(k, np.int64) if im.video is None else np.asarray(im.video, np.int64)
        seconds = np.zeros(k, np.float32) if im.seconds is None else np.asarray(im.seconds, np.float32)
        items = zip(np.asarray(im.starts).tolist(), grids.tolist(), im.pixels, video.tolist(), seconds.tolist())
        for start, g, px, vid, sec in items:
            frames, h, w, _c = px.shape if px.ndim == 4 else (1, *px.shape)
            self.records.append((offset, h, w, g[0], g[1], g[2], n, start, frames, vid, sec))
            self.f.write(np.ascontiguousarray(px, dtype=np.uint8).data.cast("B"))
            offset += px.nbytes
        self.first_image.append(len(self.records))
        self.pixel_offsets.append(offset)
        self.patches.append(int(grids.prod(axis=1).sum()))

    def result(self) -> StagedMedia:
        records = np.array(self.records, dtype=IMAGE_DTYPE) if self.records else np.zeros(0, IMAGE_DTYPE)
        return StagedMedia(
            np.frombuffer(self.first_image, np.int64).copy(),
            records,
            np.frombuffer(self.patches, np.int64).copy() if len(self.patches) else np.zeros(0, np.int64),
            np.frombuffer(self.pixel_offsets, np.int64).copy(),
            self.token_id,
            self.merge_size,
        )


class _Pairs:
    """Each sample's kind (an SFT conversation or a pair member) checked as it arrives: one kind per
    prepack, a pair's members one after the other, each role once, the pair whole."""

    def __init__(self) -> None:
        self.roles = array("B")
        self.pairs = 0
        self.kind: str | None = None  # "sft" or "pairs", set by the first sample
        self.group: bytes | None = None  # the open pair's group (JSON), its roles and size
        self.seen: list[int] = []
        self.size = 0
        self.groups: set[bytes] = set()

    def add(self, i: int, s: Sample) -> bytes | None:
        """Sample ``i``: ``None`` for an SFT conversation; a pair member's group (JSON) and whether it opens it."""
        role = s.meta.get("role") if s.meta else None
        kind = "sft" if role is None else "pairs"
        if self.kind is None:
            self.kind = kind
        elif kind != self.kind:
            first = "preference pair members" if self.kind == "pairs" else "SFT conversations"
            what = "an SFT conversation" if role is None else f"the {role} answer of a preference pair"
            raise ValueError(
                f"sample {i} (conversation {s.conversation_id!r}) is {what}, but the samples before it are {first}: "
                "a prepack holds one kind; prepack SFT data and preference data apart"
            )
        if role is None:
            return None
        if role not in PAIR_ROLES or "group" not in s.meta:
            raise ValueError(
                f"sample {i} (conversation {s.conversation_id!r}): meta role {role!r} / group "
                f"{s.meta.get('group')!r}: a preference sample carries meta['group'] and a role in {list(PAIR_ROLES)} "
                "(sftpack.chat.tokenize_pair sets both)"
            )
        group = _id_json(s.meta["group"])
        if group != self.group:
            self.close(i)
            if group in self.groups:
                raise ValueError(
                    f"sample {i} (conversation {s.conversation_id!r}): pair {s.meta['group']!r} comes back after other "
                    "samples: give a pair's two samples one after the other (as tokenize_pair returns them)"
                )
            self.groups.add(group)
            self.group, self.seen, self.size = group, [], int(s.meta.get("group_size", len(PAIR_ROLES)))
            self.pairs += 1
        r = PAIR_ROLES.index(role)
        if r in self.seen:
            raise ValueError(
                f"sample {i} (conversation {s.conversation_id!r}): pair {s.meta['group']!r} has two {role} samples: "
                "a pair is one chosen and one rejected answer"
            )
        self.seen.append(r)
        self.roles.append(r)
        return group

    def close(self, i: int) -> None:
        """The open pair is complete (called when the next one opens and at the end)."""
        if self.group is not None and len(self.seen) != self.size:
            have = ", ".join(PAIR_ROLES[r] for r in self.seen)
            raise ValueError(
                f"pair {json.loads(self.group)!r} (before sample {i}) has {len(self.seen)} of its {self.size} samples "
                f"({have}): a pair is packed whole or not at all; give both answers, or leave the pair out"
            )
        self.group = None

    def result(self) -> np.ndarray | None:
        if self.kind != "pairs":
            return None
        return np.frombuffer(self.roles, np.uint8).copy()


class _SftGroups:
    """Each SFT sample's group number for the planner: ``meta["group"]`` of a sample without a role
    (a prompt's RL completions, a chat row's ``group``), numbered by first appearance; a sample of
    no group gets a number of its own."""

    def __init__(self) -> None:
        self.numbers = array("q")
        self.keys: dict[bytes, int] = {}
        self.count = 0  # numbers given

    def add(self, s: Sample) -> None:
        group = sft_group(s)
        if group is None:
            self.numbers.append(self.count)
            self.count += 1
            return
        number = self.keys.setdefault(_id_json(group), self.count)
        self.count += number == self.count
        self.numbers.append(number)

    def result(self) -> np.ndarray | None:
        return np.frombuffer(self.numbers, np.int64).copy() if self.keys else None


@dataclass
class PairsOverRow:
    """The over-long rule of a prepack for a preference pair whose two sequences fit the row each
    (the tokenizer's rule, :func:`sftpack.chat.tokenize_pair`) but not together: a pair is packed
    whole in one row, so under ``overlong="drop"`` it is left out whole and counted as an
    over-long drop (its tokens lost), and under any other policy refused, naming it and the fix.

    :meth:`filter` passes the tokenizer's samples through; :meth:`apply` moves what it dropped
    into the tokenizer's statistics (``fit`` to ``dropped``, tokens to ``tokens_lost``).
    """

    max_seq_len: int
    pad_multiple: int
    overlong: str
    dropped: int = 0
    tokens: int = 0
    trainable: int = 0

    def filter(self, samples: Iterable[Sample]) -> Iterator[Sample]:
        held: list[Sample] = []
        for s in samples:
            group = s.meta.get("group") if s.meta and s.meta.get("role") is not None else None
            if held and (group is None or group != held[0].meta["group"]):
                yield from self._whole(held)
                held = []
            if group is None:
                yield s
            else:
                held.append(s)
        yield from self._whole(held)

    def _whole(self, pair: list[Sample]) -> list[Sample]:
        m = self.pad_multiple
        cost = sum(-(-len(s) // m) * m for s in pair)
        if cost <= self.max_seq_len:
            return pair
        if self.overlong != "drop":
            raise ValueError(
                f"preference pair {pair[0].meta['group']!r}: its {len(pair)} sequences take {cost} slots together "
                f"(each padded to a multiple of {m}), more than max_seq_len={self.max_seq_len}, and a prepack keeps a "
                f"pair whole in one row: raise --max-seq-len to at least {cost}, or pass --overlong drop (the pair "
                "left out, counted)"
            )
        self.dropped += 1
        self.tokens += sum(len(s) for s in pair)
        self.trainable += sum(s.num_trainable for s in pair)
        return []

    def apply(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The tokenizer's statistics with the pairs dropped here moved from kept to dropped."""
        if not self.dropped:
            return stats
        out = dict(stats)
        out["fit"] = int(out.get("fit", 0)) - self.dropped
        out["dropped"] = int(out.get("dropped", 0)) + self.dropped
        out["tokens"] = int(out.get("tokens", 0)) - self.tokens
        out["tokens_lost"] = int(out.get("tokens_lost", 0)) + self.tokens
        out["trainable_tokens"] = int(out.get("trainable_tokens", 0)) - self.trainable
        out["trainable_tokens_lost"] = int(out.get("trainable_tokens_lost", 0)) + self.trainable
        return out


class _Weights:
    """Every token's weight, staged once the first weighted sample comes (the earlier tokens: 1)."""

    def __init__(self, directory: Path):
        self.path = directory / _WEIGHTS
        self.f: Any = None
        self.buf: list[np.ndarray] = []

    def add(self, s: Sample, tokens_before: int) -> None:
        if self.f is None:
            if s.weights is None:
                return
            self.f = open(self.path, "wb")  # noqa: SIM115 - closed by close()
            ones = np.ones(min(tokens_before, 1 << 20), np.float64)
            left = tokens_before
            while left:
                k = min(left, ones.shape[0])
                self.f.write(ones[:k].data.cast("B"))
                left -= k
        w = np.ones(len(s), np.float64) if s.weights is None else np.asarray(s.weights, np.float64)
        self.buf.append(w)

    def flush(self) -> None:
        if self.f is not None and self.buf:
            self.f.write(np.concatenate(self.buf).data.cast("B"))
        self.buf.clear()

    def close(self) -> bool:
        """Flushed to disk and closed: whether any sample had weights."""
        if self.f is None:
            return False
        self.flush()
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return True


def stage_samples(
    samples: Iterable[Sample] | Iterable[tuple[Sample, Images]],
    directory: Path,
    *,
    flush_tokens: int = 1 << 20,
    media: bool = False,
) -> StagedSamples:
    """Append every sample's tokens and mask to staging files in ``directory``.

    Args:
        samples: :class:`~sftpack.Sample` objects in input order (each ``len >= 1``;
            ids in ``[0, 2**32)``); with ``media``, ``(sample, images)`` pairs
            (:class:`Images`: the sample's media columns).
        directory: an empty or new folder (created).
        flush_tokens: tokens buffered between writes.
        media: the samples come with their images.

    Returns:
        :class:`StagedSamples` (with ``media`` when ``media``).

    Raises:
        ValueError: a token id that is negative or does not fit 32 bits (naming the sample),
            or a sample with ``media`` given without its :class:`Images` (its images would be lost).
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
    with (
        open(directory / _TOKENS, "wb") as ft,
        open(directory / _MASK, "wb") as fm,
        open(directory / _IDS, "wb") as fi,
        open(directory / _PIXELS, "wb") if media else contextlib.nullcontext() as fp,
    ):
        stager = _MediaStager(fp) if media else None

        def flush() -> None:
            nonlocal buffered
            if ids_buf:
                # file.write, not ndarray.tofile: tofile loses the errno of a full disk
                ft.write(np.concatenate(ids_buf).astype(np.uint32, copy=False).data.cast("B"))
                fm.write(np.concatenate(mask_buf).astype(np.uint8, copy=False).data.cast("B"))
                ids_buf.clear()
                mask_buf.clear()
            buffered = 0

        pairs, weights, sft_groups = _Pairs(), _Weights(directory), _SftGroups()
        tokens_staged = 0
        for item in samples:
            if stager is not None:
                s, images = cast("tuple[Sample, Images]", item)
                stager.add(len(lengths), s, images)
                check_sft_sample(s)
                check_unweighted(s, "a prepack with images")
                group = None
            else:
                s = cast(Sample, item)
                if s.media is not None:
                    raise ValueError(
                        f"sample {len(lengths)} (conversation {s.conversation_id!r}) carries media, which a text "
                        "prepack would lose: prepack conversations with images with prepack(..., images=True)"
                    )
                group = pairs.add(len(lengths), s)
                if group is None:
                    sft_groups.add(s)
                weights.add(s, tokens_staged)
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
            blob = _id_json(s.conversation_id) if group is None else group
            # A new conversation starts at piece 0, and also at a later piece whose
            # conversation differs from the previous sample's (its earlier pieces
            # were filtered out upstream): ids are never inherited. A pair's members
            # share its group's number (the second member continues the first's).
            opens = len(pairs.seen) == 1 if group is not None else k == 0
            if opens or n_conv < 0 or blob != prev_blob:
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
            tokens_staged += n
            if buffered >= flush_tokens:
                flush()
                weights.flush()
        flush()
        pairs.close(len(lengths))
        weighted = weights.close()
        for f in (ft, fm, fi) if fp is None else (ft, fm, fi, fp):
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
        media=None if stager is None else stager.result(),
        roles=pairs.result(),
        weighted=weighted,
        sft_groups=sft_groups.result(),
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
    :meth:`gather_pixels` does the same for the samples' images (``pixel_offsets``:
    the staged media's, ``None`` for samples without images).
    """

    def __init__(
        self,
        directory: Path,
        lengths: np.ndarray,
        pixel_offsets: np.ndarray | None = None,
        *,
        weighted: bool = False,
    ):
        self.directory = Path(directory)
        self.weighted = weighted  #: the samples carry weights: :meth:`gather_weights` reads them
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.zeros(self.lengths.shape[0] + 1, np.int64)
        np.cumsum(self.lengths, out=self.starts[1:])
        self.pixel_offsets = None if pixel_offsets is None else np.asarray(pixel_offsets, np.int64)

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

    def gather_weights(self, samples: np.ndarray) -> np.ndarray:
        """``(sum(lengths[samples]),)`` float64: the samples' token weights, in the given order."""
        samples = np.asarray(samples, dtype=np.int64)
        lens = self.lengths[samples]
        out = np.empty(int(lens.sum()), np.float64)
        if not out.shape[0]:
            return out
        with open(self.directory / _WEIGHTS, "rb", buffering=0) as f:
            o = 0
            for a, k in zip(self.starts[samples].tolist(), lens.tolist()):
                _read_into(f, out[o : o + k].data.cast("B"), 8 * a)
                o += k
        return out

    def gather_pixels(self, samples: np.ndarray) -> np.ndarray:
        """``(sum of the samples' pixel bytes,)`` uint8: their images' pixels, in the given order."""
        if self.pixel_offsets is None:
            raise ValueError("these staged samples hold no images")
        samples = np.asarray(samples, dtype=np.int64)
        po = self.pixel_offsets
        sizes = (po[samples + 1] - po[samples]).tolist()
        out = np.empty(int(sum(sizes)), np.uint8)
        if not out.shape[0]:
            return out
        with open(self.directory / _PIXELS, "rb", buffering=0) as f:
            o = 0
            for a, k in zip(po[samples].tolist(), sizes):
                if k:
                    _read_into(f, out[o : o + k].data.cast("B"), a)
                o += k
        return out

    def conversation_ids_path(self) -> Path:
        return self.directory / _IDS
