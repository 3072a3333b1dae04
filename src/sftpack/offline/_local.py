"""The local engine: stages 1 and 3 in this process (and ``num_proc`` tokenizer workers).

Stage 1 streams the tokenizer's samples (:func:`sftpack.chat.tokenize_conversations`,
or for conversations with images :func:`~sftpack.offline._encode.encoded`, whose output
order does not depend on ``num_proc`` either) into one staging folder
(:func:`~sftpack.offline.engine.stage_samples`). The tokenizer's fingerprint (a
serialisation of the whole vocabulary: a fixed cost, not a per-token one) is
computed on a helper thread once the first samples are out, so it runs while the
tokenizer encodes the next batch instead of before the first; stage 3 gathers every row's
sequences back from it and writes them at the plan's offsets
(:func:`~sftpack.offline.engine.write_rows`). Memory: the per-sample index (20
bytes a sample) and one chunk of rows, whatever the number of tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np

from .._base import positive_int
from ..chat import tokenize_conversations
from ..data import default_tokenizer
from ..sample import Sample
from ._encode import ImageCounts, encoded, stored_samples
from ._engine import Conversations, PrepackEngine, Samples, Staged, progress_bar
from ._fingerprint import tokenizer_fingerprint
from ._inputs import KnownLength, input_total, open_image_inputs, open_inputs, reading_counts
from ._plan import RowPlan
from ._stage import PairsOverRow, stage_samples
from ._write import CHUNK_TOKENS, MediaLayout, write_rows

__all__ = ["LocalEngine"]


class _Counted:
    """Passes samples through, counting them (the ``read`` count of a samples input) and,
    for an input given in rows, the samples of each row."""

    def __init__(self, work: Samples):
        self.work = work
        self.count = 0
        self.sizes: list[int] = []

    def __iter__(self) -> Iterator[Sample]:
        for item in self.work.samples:
            if self.work.in_rows:
                row = list(cast("Sequence[Sample]", item))
                self.sizes.append(len(row))
            else:
                row = [cast(Sample, item)]
            self.count += len(row)
            yield from row


class _FingerprintAfterFirst:
    """Passes samples through; when the first one arrives (the tokenizer is then busy with
    the next batch), starts ``tokenizer_fingerprint`` on ``pool``. :meth:`result` waits for
    it, starting it first if no sample ever came."""

    def __init__(self, samples: Iterable[Sample], tokenizer: Any, pool: ThreadPoolExecutor):
        self.samples = samples
        self.tokenizer = tokenizer
        self.pool = pool
        self.future: Future[dict[str, Any]] | None = None

    def _start(self) -> Future[dict[str, Any]]:
        if self.future is None:
            self.future = self.pool.submit(tokenizer_fingerprint, self.tokenizer)
        return self.future

    def __iter__(self) -> Iterator[Sample]:
        it = iter(self.samples)
        for first in it:
            self._start()
            yield first
            yield from it

    def result(self) -> dict[str, Any]:
        return self._start().result()


class LocalEngine(PrepackEngine):
    """Stages 1 and 3 here.

    Args:
        num_proc: tokenizer processes (the files do not depend on it).
        progress: tqdm bars for tokenizing and writing.
        chunk_tokens: tokens gathered and written per step of stage 3.
        batch_size: conversations rendered and encoded per tokenizer call (the files
            do not depend on it either).
    """

    def __init__(
        self,
        *,
        num_proc: int = 1,
        progress: bool = False,
        chunk_tokens: int = CHUNK_TOKENS,
        batch_size: int = 256,
    ):
        self.num_proc = positive_int("num_proc", num_proc)
        self.batch_size = positive_int("batch_size", batch_size)
        self.progress = bool(progress)
        self.chunk_tokens = positive_int("chunk_tokens", chunk_tokens)

    def stage(self, work: Conversations | Samples, staging: Path) -> Staged:
        if isinstance(work, Samples):
            counted = _Counted(work)
            st = work.media
            if st is None:
                staged = stage_samples(counted, staging)
            else:  # tokenized with their images: each staged with its stored items
                staged = stage_samples(stored_samples(counted, st), staging, media=True)
            counts = {"read": counted.count, "kept": counted.count, "dropped": {}}
            sizes = np.asarray(counted.sizes, np.int64) if work.in_rows else None
            media = None if st is None or staged.media is None else st.manifest_entry(staged.media)
            return Staged(
                staged, staged.source(), staged.source().conversation_ids_path(), counts, row_sizes=sizes, media=media
            )
        o = work.options
        if o.images:
            return self._stage_images(work, staging)
        tokenizer = default_tokenizer() if work.tokenizer is None else work.tokenizer
        if isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(
                f"the local engine takes a tokenizer object, not the path {os.fspath(tokenizer)!r}: load it with "
                "transformers.AutoTokenizer.from_pretrained(path), or prepack with the Ray engine"
            )
        inputs = open_inputs(work.inputs, on_bad_row=o.on_bad_row, limit=o.limit)
        conversations: Iterable[Any] = inputs.conversations
        total = input_total(work.inputs, inputs.reader, o.limit) if self.progress else None
        if total is not None:
            conversations = KnownLength(conversations, total)  # the tokenize bar's total and ETA
        tokenized = tokenize_conversations(
            conversations,
            tokenizer,
            max_seq_len=o.max_seq_len,
            overlong=o.overlong,
            train_on=o.train_on,
            on_bad_row=o.on_bad_row,
            batch_size=self.batch_size,
            num_proc=self.num_proc,
            progress=self.progress,
        )
        over = PairsOverRow(o.max_seq_len, o.pad_multiple, str(o.overlong))  # a pair whole in one row
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sftpack-fingerprint") as pool:
            fingerprinted = _FingerprintAfterFirst(tokenized, tokenizer, pool)
            staged = stage_samples(over.filter(fingerprinted), staging)
            tok_fp = fingerprinted.result()
        read = inputs.reader.stats.as_dict() if inputs.reader is not None else None
        return Staged(
            staged,
            staged.source(),
            staged.source().conversation_ids_path(),
            reading_counts(read, over.apply(tokenized.stats.as_dict())),
            inputs=inputs.fingerprint(),
            tokenizer=tok_fp,
        )

    def _stage_images(self, work: Conversations, staging: Path) -> Staged:
        """Stage 1 for conversations with images: :func:`~sftpack.offline._encode.encoded` in
        ``num_proc`` forked workers, staged with their media columns."""
        o = work.options
        tokenizer = work.tokenizer
        if isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(
                f"the local engine takes a tokenizer object, not the path {os.fspath(tokenizer)!r}: load it with "
                "transformers.AutoTokenizer.from_pretrained(path)"
            )
        settings = work.image_settings()
        inputs = open_image_inputs(work.inputs, limit=o.limit)
        counts = ImageCounts()
        total = input_total(work.inputs, None, o.limit)
        with progress_bar(self.progress, total=total, desc="tokenize", unit="conv") as bar:

            def counted() -> Iterator[Any]:
                for item in encoded(inputs.conversations, settings, self.num_proc):
                    bar.update(1)
                    yield item

            staged = stage_samples(counts.pairs(counted()), staging, media=True)
        assert staged.media is not None
        return Staged(
            staged,
            staged.source(),
            staged.source().conversation_ids_path(),
            counts.manifest(),
            inputs=inputs.fingerprint(),
            tokenizer=tokenizer_fingerprint(settings.tokenizer),
            media=settings.manifest_entry(staged.media),
        )

    def write(
        self, directory: Path, plan: RowPlan, staged: Staged, dtype: np.dtype, media: MediaLayout | None = None
    ) -> None:
        with progress_bar(self.progress, total=plan.num_rows, desc="write", unit="row") as bar:
            write_rows(
                directory,
                plan,
                staged.source,
                dtype,
                chunk_tokens=self.chunk_tokens,
                on_chunk=bar.update,
                media=media,
            )
