"""Stage 1's tokenizer for conversations with media: each conversation to samples and their
media columns, for :func:`~sftpack.offline.engine.stage_samples` (``media=True``).

Each conversation is tokenized by :func:`sftpack.multimodal.tokenize_media_conversations`
for the model family the prepack names (its tokenizer and image processor unless given), then
the patch budget's rule (:func:`sftpack.multimodal._plan.check_patch_budget`: a conversation
with a sample over ``max_patches_per_row`` is dropped and counted as ``over_patch_budget``, or
refused under ``overlong="error"``, as the loader does). What is stored per media item (an
image, a video, a Qwen3-VL video slice) is its **resized uint8 pixels** (3 bytes a pixel; a
video's frames) and its grid, not the float32 values (24 bytes a pixel for a Qwen-VL image):
the sample's own values are turned back into pixels
(:func:`~sftpack.multimodal._stored.stored_items`, the exact inverse, refused when the values
are not a uint8 image's), so what is stored is exactly what the in-memory sample carries; the
reader remakes the values byte for byte as the processor does.

The local engine runs :func:`encoded` in ``num_proc`` forked workers (results in input order);
the Ray engine's actors run it in-process on their units. Either way a conversation without an
id gets its position in the input, as the in-memory tokenizer gives it, so the samples (and the
files) do not depend on how the input was cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._base import chunks, pool_results
from ..chat import warm_tokenizer
from ..sample import Sample
from ._format import PrepackError
from ._stage import Images, StagedMedia

__all__ = ["ImageCounts", "ImageSettings", "encode", "encoded", "image_settings", "stored", "stored_samples"]

#: conversations per task of the worker pool
_CHUNK = 8


@dataclass(frozen=True)
class ImageSettings:
    """What tokenizing a conversation with media takes (plain values, the configured family and
    the two HF objects)."""

    tokenizer: Any
    processor: Any
    family: Any  #: the :class:`~sftpack.multimodal.Family` (configured by a model folder's config)
    max_seq_len: int
    overlong: str
    on_bad_row: str
    max_patches_per_row: int | None

    def manifest_entry(self, media: StagedMedia) -> dict[str, Any]:
        """The manifest's ``media`` entry for the staged ``media``: what is stored, the family (its
        name and the settings its media payload depends on), totals, and what remakes the values
        (a patch family's processor settings; a fixed-size image family's value table)."""
        fam = self.family
        return {  # what the family stores of each item, and what remakes its values (Family.stored_processor)
            "kind": fam.stored_format,
            "family": fam.name,
            "family_settings": fam.media_settings(),
            "images": media.num_images,
            "patches": int(media.patches.sum()),
            "pixel_bytes": media.pixel_bytes,
            "image_token_id": int(media.token_id if media.token_id is not None else fam.placeholder_id(self.tokenizer)),
            **fam.stored_processor(self.processor, media.merge_size),
        }


def image_settings(
    family: Any,
    tokenizer: Any,
    processor: Any,
    *,
    max_seq_len: int,
    overlong: str,
    on_bad_row: str,
    max_patches_per_row: int | None,
) -> ImageSettings:
    """The settings, the family's tokenizer and image processor filled in where not given.

    Raises:
        ValueError: an image processor whose output the stored pixels cannot reproduce (the
            family's :meth:`~sftpack.multimodal.Family.check_stored`, in one line).
    """
    from ..multimodal import family_for  # multimodal loads only for media (~0.5 s over the offline path)

    fam = family_for(family)
    proc = processor if processor is not None else fam.image_processor()
    fam.check_stored(proc)
    tok = tokenizer if tokenizer is not None else fam.tokenizer()
    return ImageSettings(tok, proc, fam, max_seq_len, overlong, on_bad_row, max_patches_per_row)


def encode(conv: Any, index: int, st: ImageSettings) -> tuple[dict[str, Any], list[tuple[Sample, Images]]]:
    """Conversation number ``index`` to ``(stats delta, [(sample, images), ...])`` (plain arrays:
    cheap to send between processes)."""
    from ..multimodal import (  # multimodal loads only for media (~0.5 s over the offline path)
        MediaTokenizeStats,
        PixelRecorder,
        check_patch_budget,
        tokenize_media_conversations,
    )

    if isinstance(conv, dict):
        messages, cid = conv.get("messages"), conv.get("id")
    else:
        messages, cid = getattr(conv, "messages", conv), getattr(conv, "id", None)
    stats = MediaTokenizeStats()
    # a patch family's images are resized only: their pixels are what is stored (no patches made);
    # a conversation with a video is made whole (one sample's items take one kind of values)
    record = st.family.media_class.kind == "patches" and not _has_video(messages)
    recorder = PixelRecorder(st.processor) if record else None
    samples = list(
        tokenize_media_conversations(
            [{"id": cid or index, "messages": messages}],
            tokenizer=st.tokenizer,
            processor=recorder if recorder is not None else st.processor,
            max_seq_len=st.max_seq_len,
            overlong=st.overlong,
            on_bad_row=st.on_bad_row,
            stats=stats,
            family=st.family,
        )
    )
    reason = check_patch_budget(samples, st.max_patches_per_row, st.overlong)
    if reason is not None:  # kept by the tokenizer, but no row can hold it: counted under the budget's reason
        stats, samples = MediaTokenizeStats(read=stats.read, dropped={reason: 1}), []
    pieces, first = [], 0
    recorded = recorder.pixels if recorder is not None else None
    for s in samples:  # the pieces of a split conversation hold its images in order
        n = 0 if s.media is None else s.media.num_items - int(getattr(s.media, "num_videos", 0))
        pieces.append(stored(s, st, None if recorded is None else recorded[first : first + n]))
        first += n
    if recorded is not None and samples and first != len(recorded):
        raise PrepackError(f"conversation {cid or index!r}: {len(recorded)} images resized, {first} in its samples")
    delta = {"read": stats.read, "kept": stats.kept, "dropped": dict(stats.dropped)}
    return delta, pieces


def _has_video(messages: Any) -> bool:
    """Whether a conversation's messages hold a video part (malformed ones: no; the tokenizer names them)."""
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "video" for p in content):
            return True
    return False


def stored(s: Sample, st: ImageSettings, images: list[np.ndarray] | None = None) -> tuple[Sample, Images]:
    """Sample ``s`` as stage 1 stages it: without its media, which become its stored items
    (:func:`_images`; ``images``: its image items' resized pixels where they were kept); what
    :func:`encode` gives for each sample of a conversation, and what
    :func:`~sftpack.offline.prepack_samples` stages of samples tokenized with their images."""
    return Sample(s.input_ids, s.loss_mask, s.conversation_id, dict(s.meta or {})), _images(s, st, images)


def stored_samples(samples: Iterable[Sample], st: ImageSettings) -> Iterator[tuple[Sample, Images]]:
    """:func:`stored` of samples tokenized with their images (what
    :func:`~sftpack.offline.prepack_samples` ``(images=True)`` stages). A sample over
    ``st.max_patches_per_row`` is refused, naming it: no row can hold it, and a sample is not a
    conversation the prepack may drop and count."""
    budget = st.max_patches_per_row
    for i, s in enumerate(samples):
        if budget is not None and s.num_patches > budget:
            raise ValueError(
                f"sample {i} (conversation {s.conversation_id!r}) has {s.num_patches:,} vision patches, more than "
                f"max_patches_per_row={budget:,}: no row can hold it; raise the patch budget to at least "
                f"{s.num_patches:,} (--max-patches-per-row), or leave its conversation out"
            )
        yield stored(s, st)


_NO_IMAGES = Images(np.zeros(0, np.int64), np.zeros((0, 3), np.int64), [])


def _images(s: Sample, st: ImageSettings, images: list[np.ndarray] | None = None) -> Images:
    """What a prepack stores of sample ``s``'s media: each item's placeholder start, grid, uint8
    pixels (the exact inverse of its values: :func:`~sftpack.multimodal._stored.stored_items`),
    kind and seconds; :data:`_NO_IMAGES` without media."""
    from ..multimodal import stored_items  # multimodal loads only for media (~0.5 s over the offline path)

    media = s.media
    if media is None:  # a conversation without media
        return _NO_IMAGES
    try:
        items = stored_items(media, st.processor, st.family.video_processor(st.processor), images)
    except ValueError as e:
        raise PrepackError(
            f"conversation {s.conversation_id!r}, {e}; the prepack stores resized uint8 pixels, which give back "
            "the processor's values exactly only for transformers' own PIL/numpy image processors"
        ) from None
    return Images(
        media.slots.numpy()[:, 0].copy(),
        items.grids,
        items.pixels,
        int(media.token_id),
        items.merge_size,
        items.video,
        items.seconds,
    )


_worker_settings: list[ImageSettings] = []


def _init_worker(settings: ImageSettings) -> None:
    # A sample's media are torch tensors (validated with torch reductions). A forked child whose
    # parent has run an OpenMP parallel region hangs in its first one (libgomp is not fork-safe):
    # one intra-op thread per worker never opens one (what torch's DataLoader workers do too).
    torch.set_num_threads(1)
    _worker_settings[:] = [settings]


def _work(items: list[tuple[int, Any]]) -> list[tuple[dict[str, Any], list[tuple[Sample, Images]]]]:
    return [encode(c, i, _worker_settings[0]) for i, c in items]


def encoded(
    conversations: Iterable[Any], settings: ImageSettings, num_proc: int = 1, start: int = 0
) -> Iterator[tuple[dict[str, Any], list[tuple[Sample, Images]]]]:
    """:func:`encode` of every conversation (numbered from ``start``), in input order, in this
    process or ``num_proc`` forked ones."""

    # every conversation with media is tokenized in pieces around its control tokens: the plain
    # copy of the tokenizer that takes is built here once, before the workers fork (each would
    # build its own otherwise)
    warm_tokenizer(settings.tokenizer)
    numbered = enumerate(conversations, start)
    if num_proc == 1:
        for i, c in numbered:
            yield encode(c, i, settings)
        return
    for results in pool_results(
        _work, chunks(numbered, _CHUNK), num_proc, initializer=_init_worker, initargs=(settings,)
    ):
        yield from results


@dataclass
class ImageCounts:
    """What stage 1 counted over conversations with images (summed over workers or units)."""

    read: int = 0
    kept: int = 0
    split: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def add(self, delta: dict[str, Any], pieces: int) -> None:
        self.read += int(delta["read"])
        self.kept += int(delta["kept"])
        for k, v in delta["dropped"].items():
            self.dropped[k] = self.dropped.get(k, 0) + int(v)
        self.split += pieces > 1

    def merge(self, other: ImageCounts) -> None:
        self.read, self.kept, self.split = self.read + other.read, self.kept + other.kept, self.split + other.split
        for k, v in other.dropped.items():
            self.dropped[k] = self.dropped.get(k, 0) + v

    def pairs(self, encoded: Iterable[tuple[dict[str, Any], list[tuple[Sample, Images]]]]) -> Iterator[Any]:
        """The ``(sample, images)`` pairs of ``encoded``, counted as they pass."""
        for delta, pieces in encoded:
            self.add(delta, len(pieces))
            yield from pieces

    def manifest(self) -> dict[str, Any]:
        """The manifest's reading counts."""
        over = self.dropped.get("overlong", 0)
        return {
            "read": self.read,
            "kept": self.kept,
            "dropped": dict(sorted(self.dropped.items())),
            "overlong": {
                "tokenized": self.kept + over,
                "fit": self.kept - self.split,
                "truncated": 0,
                "split": self.split,
                "dropped": over,
            },
        }
