"""From options to a run: the samples, the data source of the chosen path, the model."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from ..handoff import Sample
from ._data import (
    LoaderSource,
    OfflineSource,
    PaddedSource,
    Source,
    TrainerSource,
    samples_fingerprint,
)
from ._options import Packing, TrainConfig

__all__ = ["make_source", "tokenized_samples"]


def tokenized_samples(
    tokenizer: Any,
    conversations: Iterable[Any] | None = None,
    *,
    max_seq_len: int,
    limit: int | None = None,
    num_proc: int = 1,
    progress: bool = False,
) -> tuple[list[Sample], Any]:
    """Tokenize ``conversations`` (default: the embedded corpus, first ``limit``);
    conversations longer than ``max_seq_len`` are split, every piece kept.

    Returns:
        ``(samples, stats)``: the samples in corpus order and the tokenizer's counts.
    """
    from ..chat import tokenize_conversations
    from ..data import default_corpus

    convs = default_corpus(limit=limit) if conversations is None else conversations
    out = tokenize_conversations(
        convs,
        tokenizer,
        max_seq_len=max_seq_len,
        overlong="split",
        num_proc=num_proc,
        progress=progress,
    )
    samples = out.to_list()
    if not samples:
        raise ValueError(
            "no conversation left to train on after tokenizing (all dropped?)"
        )
    return samples, out.stats


def make_source(
    config: TrainConfig,
    *,
    samples: Sequence[Sample] | None = None,
    prepacked: str | os.PathLike[str] | Any = None,
    rank: int = 0,
    world: int = 1,
    pad_id: int = 0,
) -> Source:
    """The data source of ``config.packing`` for this rank.

    Args:
        config: the run's :class:`TrainConfig`.
        samples: tokenized conversations (``trainer``, ``loader``, ``none``).
        prepacked: a prepacked directory (or an opened ``PrepackedDataset``) for ``offline``.
        rank, world: data-parallel coordinates.
        pad_id: token id of padding slots.
    """
    p = config.packing
    if p is Packing.OFFLINE:
        if prepacked is None:
            raise ValueError(
                "--packing offline needs a prepacked directory (sftpack prepack ... --out DIR)"
            )
        if isinstance(prepacked, (str, os.PathLike)):
            from ..offline import PrepackedDataset

            ds = PrepackedDataset(
                prepacked,
                verify="size",
                expect={
                    "max_seq_len": config.max_seq_len,
                    "pad_multiple": config.pad_multiple,
                },
                shuffle=True,
                seed=config.seed,
                rank=rank,
                world_size=world,
            )
        else:
            ds = prepacked
        return OfflineSource(
            ds, batch_size=config.batch_size, world=world, grad_accum=config.grad_accum
        )
    if samples is None:
        raise ValueError(f"--packing {p} needs tokenized samples")
    long = [i for i, s in enumerate(samples) if len(s) > config.max_seq_len]
    if long:
        raise ValueError(
            f"sample {long[0]} has {len(samples[long[0]])} tokens, more than max_seq_len={config.max_seq_len}: "
            "tokenize with the same max_seq_len (over-long conversations are split)"
        )
    common = {
        "batch_size": config.batch_size,
        "seed": config.seed,
        "rank": rank,
        "world": world,
        "grad_accum": config.grad_accum,
        "pad_id": pad_id,
    }
    if p is Packing.NONE:
        return PaddedSource(samples, **common)
    if p is Packing.TRAINER:
        return TrainerSource(
            samples,
            token_budget=config.micro_batch_tokens or config.max_seq_len,
            pad_multiple=config.pad_multiple,
            **common,
        )
    from ..loader import PackingDataset

    ds = PackingDataset(
        samples,
        max_seq_len=config.max_seq_len,
        buffer_size=config.buffer_size,
        pad_multiple=config.pad_multiple,
        seed=config.seed,
        shuffle=True,
        num_epochs=None,
        rank=rank,
        world_size=world,
        pad_id=pad_id,
        pad_between_seqs=config.pad_between_seqs,
    )
    return LoaderSource(
        ds,
        batch_size=config.batch_size,
        samples_fp=samples_fingerprint(samples),
        rank=rank,
        world=world,
        grad_accum=config.grad_accum,
    )
