"""From options and data to a run: the samples, their supervised targets, the chosen path's source."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._optional import CustomCodeError, from_pretrained
from .._types import Tokenizer
from ..balance import CostError, SequenceCost
from ..chat import ConversationSamples, default_cache_dir, start_training_samples
from ..loader import PackingDataset
from ..multimodal import MediaTokenizeStats, family_for, tokenize_media_conversations
from ..offline import PrepackedDataset
from ..sample import Sample, check_sft_sample, sft_group
from ._options import Objective, Packing, TrainConfig
from ._source_loader import LoaderSource
from ._source_offline import OfflineSource
from ._sources import (
    PaddedSource,
    RenumberedSource,
    Source,
    TrainerSource,
    _no_targets,
    _pair_units,
    check_targets,
    samples_fingerprint,
    supervised_targets,
)

__all__ = [
    "check_targets",
    "compact_vocabulary",
    "make_source",
    "media_samples",
    "model_vocab_size",
    "supervised_targets",
    "tokenized_samples",
]


def model_vocab_size(path: str | os.PathLike[str]) -> int:
    """The vocabulary size in the config of the local model folder ``path`` (no weights read)."""
    try:
        cfg = from_pretrained("AutoConfig", path, local_files_only=True)
    except CustomCodeError:
        raise
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot read a model config from {str(path)!r} ({' '.join(str(e).split())[:200]}); give a local "
            "folder written by model.save_pretrained(), or leave --model out for the default small Llama"
        ) from None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    size = getattr(text, "vocab_size", None)
    if not isinstance(size, int):
        raise ValueError(f"{path}: the model config names no vocab_size")
    return size


def tokenized_samples(
    tokenizer: Tokenizer,
    conversations: Iterable[Any] | None = None,
    *,
    cache: bool | str | os.PathLike[str] = False,
    **options: Any,
) -> tuple[list[Sample], Any]:
    """Tokenize ``conversations`` (default: the embedded corpus, first ``limit``);
    conversations longer than ``max_seq_len`` are split, every piece kept.

    Args:
        cache: ``False`` (default): tokenize; ``True``: through the tokenized-data
            cache in its default folder (``$SFTPACK_CACHE_DIR``, else
            ``$XDG_CACHE_HOME/sftpack``, else ``~/.cache/sftpack``); a path: through
            the cache in that folder. A second call with the same tokenizer, options,
            conversations (the embedded corpus, or a list) and sftpack code reads the
            samples back instead of tokenizing; a one-pass iterator is never cached.
            A cache that cannot be written is warned about and done without.
        options: the keywords of
            :func:`~sftpack.chat._training_samples.start_training_samples`, among
            them ``max_seq_len`` (required), ``limit``, ``num_proc`` (worker
            processes, default 1), ``progress`` (a bar) and ``cache_max_size`` (the
            cache's size limit in bytes, default 10 GiB, ``0`` for none; the entries
            used least recently are removed to make room for a new one).

    Returns:
        ``(samples, stats)``: the samples in corpus order and the tokenizer's counts.
    """
    got = start_training_samples(tokenizer, conversations, cache_dir=resolve_cache(cache), **options).finish()
    return checked_samples(got.samples), got.stats


def media_samples(
    conversations: Iterable[Any],
    *,
    max_seq_len: int,
    family: Any = None,
    tokenizer: Any = None,
    processor: Any = None,
    on_bad_row: str = "error",
) -> tuple[list[Sample], Any]:
    """Tokenize conversations with image parts (the Hugging Face multimodal chat format) for a
    vision-language ``family`` (:func:`sftpack.multimodal.family_for`; default Qwen2-VL, its
    tokenizer and image processor unless given): samples whose ``media`` holds their images,
    conversations longer than ``max_seq_len`` split at text boundaries. Returns ``(samples,
    stats)`` (``stats``: :class:`~sftpack.multimodal.MediaTokenizeStats`)."""
    fam = family_for(family)
    stats = MediaTokenizeStats()
    got = list(
        tokenize_media_conversations(
            conversations,
            tokenizer=tokenizer if tokenizer is not None else fam.tokenizer(),
            processor=processor if processor is not None else fam.image_processor(),
            max_seq_len=max_seq_len,
            on_bad_row=on_bad_row,
            stats=stats,
            family=fam,
        )
    )
    return checked_samples(got), stats


def resolve_cache(cache: bool | str | os.PathLike[str] | None) -> Path | None:
    """The cache folder ``cache`` names: ``False``/``None``: none, ``True``: the default one."""
    if cache is None or cache is False:
        return None
    return default_cache_dir() if cache is True else Path(cache)


def checked_samples(samples: list[Sample]) -> list[Sample]:
    """``samples``, or a ``ValueError`` when there is none."""
    if not samples:
        raise ValueError("no conversation left to train on after tokenizing (all dropped?)")
    return samples


def make_source(
    config: TrainConfig,
    *,
    samples: Sequence[Sample] | ConversationSamples | None = None,
    prepacked: str | os.PathLike[str] | Any = None,
    rank: int = 0,
    world: int = 1,
    pad_id: int = 0,
    tokenizer: Tokenizer | str | None = None,
    vocab: np.ndarray | None = None,
    model_cost: SequenceCost | None = None,
) -> Source:
    """The data source of ``config.packing`` for this rank.

    Samples with images (``sample.media``) take every path as they are; with
    ``config.max_patches_per_row`` the trainer and loader paths plan under that
    vision-patch budget too.

    Args:
        config: the run's :class:`TrainConfig`.
        samples: tokenized conversations (``trainer``, ``loader``, ``none``): a list,
            or a :class:`~sftpack.chat._training_samples.ConversationSamples` still being filled
            (``sftpack train``): ``trainer`` and ``none`` then draw conversations in
            seeded order and start with the first batch's, the loader waits for all.
        prepacked: a prepacked directory (or an opened ``PrepackedDataset``) for ``offline``.
        rank, world: data-parallel coordinates.
        pad_id: token id of padding slots.
        tokenizer: the model's tokenizer (or its fingerprint's ``sha256``): a prepacked
            directory written with another one is refused (``PrepackedDataset(expect=)``).
        vocab: ``offline`` with a model over the data's ids (:func:`compact_vocabulary`):
            the original id of each; the prepack's rows are renumbered as they are read.
        model_cost: what the run's model costs per sequence (:func:`model_cost` of it): how
            each step's work is dealt to the ranks where ``config.cost`` is ``None``; without
            it, each path's own default (tokens; attention on the offline path).

    Raises:
        ValueError: data with no supervised target at all (nothing to learn), or that
            does not fit the options; ``PrepackError`` for a prepack of other
            settings or another tokenizer.
    """
    p = config.packing
    cost = config.cost if config.cost is not None else model_cost
    if p is Packing.OFFLINE:
        if prepacked is None:
            raise ValueError("--packing offline needs a prepacked directory (sftpack prepack ... --out DIR)")
        if isinstance(prepacked, (str, os.PathLike)):
            expect: dict[str, Any] = {"pad_multiple": config.pad_multiple}
            if not config.preference:  # a preference run's rows: checked below, with their own fix
                expect["max_seq_len"] = config.max_seq_len
            if tokenizer is not None:
                expect["tokenizer"] = tokenizer
            ds = PrepackedDataset(
                prepacked,
                verify="size",
                expect=expect,
                shuffle=True,
                seed=config.seed,
                rank=rank,
                world_size=world,
                rows_per_rank=max(1, config.batch_size // world),
                **({} if cost is None else {"cost": cost}),
            )
        else:
            ds = prepacked
        counts = (getattr(ds, "manifest", None) or {}).get("counts") or {}
        if counts.get("labels") == 0:
            raise _no_targets(
                f"{getattr(ds, 'path', 'the prepack')} ({counts.get('sequences', 0):,} sequences)",
                int(ds.sequences["length"].max()) if len(getattr(ds, "sequences", ())) else 0,
                config.max_seq_len,
            )
        pairs = getattr(ds, "roles", None) is not None
        width = (getattr(ds, "manifest", None) or {}).get("max_seq_len")
        if config.preference and width is not None and width != config.row_width:
            raise ValueError(
                f"{getattr(ds, 'path', 'the prepack')} has rows of {width} slots, but a preference run's rows hold a "
                f"pair whole: 2 x --max-seq-len = {config.row_width} slots; train it with --max-seq-len {width // 2}, "
                f"or prepack again with --max-seq-len {config.row_width}"
            )
        if pairs != config.preference:
            where = getattr(ds, "path", "the prepack")
            raise ValueError(
                f"{where} holds preference pairs (prompt/chosen/rejected): train it with --objective dpo or simpo"
                if pairs
                else f"{where} holds SFT conversations, not preference pairs: --objective {config.objective} trains a "
                "prepack of pairs (sftpack prepack of prompt/chosen/rejected rows)"
            )
        offline: Source = OfflineSource(ds, batch_size=config.batch_size, world=world, grad_accum=config.grad_accum)
        return offline if vocab is None else RenumberedSource(offline, vocab, pad_id=pad_id)
    if samples is None:
        raise ValueError(f"--packing {p} needs tokenized samples")
    grouped = samples if isinstance(samples, ConversationSamples) else None
    if grouped is not None and (p is Packing.LOADER or grouped.done):
        samples = grouped.samples()  # the loader shuffles the whole list: it waits for every sample
    if not isinstance(samples, ConversationSamples):  # all there: checked now, else as the steps read them
        long = [i for i, s in enumerate(samples) if len(s) > config.max_seq_len]
        if long:
            raise ValueError(
                f"sample {long[0]} has {len(samples[long[0]])} tokens, more than max_seq_len={config.max_seq_len}: "
                "tokenize with the same max_seq_len (over-long conversations are split)"
            )
        check_targets(samples, config.max_seq_len)
        if config.objective is Objective.SFT:  # conversations still being tokenized: as the steps read them
            for sample in samples:
                check_sft_sample(sample)
    if grouped is not None and p is not Packing.LOADER:
        samples = grouped  # trainer / none: conversations in seeded order, as they are tokenized
    common: dict[str, Any] = {
        "batch_size": config.batch_size,
        "seed": config.seed,
        "rank": rank,
        "world": world,
        "grad_accum": config.grad_accum,
        "pad_id": pad_id,
    }
    if p is Packing.NONE or p is Packing.TRAINER:
        source: PaddedSource | TrainerSource
        if p is Packing.NONE:
            source = PaddedSource(samples, **common)
        else:
            source = TrainerSource(
                samples,
                micro_batch_tokens=config.micro_batch_width,
                pad_multiple=config.pad_multiple,
                max_patches_per_row=config.max_patches_per_row,
                cost="tokens" if cost is None else cost,
                pairs=config.preference,  # batch_size counts pairs, each whole in one micro-batch
                **common,
            )
        source.max_seq_len = config.max_seq_len
        return source
    assert not isinstance(samples, ConversationSamples)
    pairs = config.preference  # DPO or SimPO
    if pairs:  # every sample a pair's member, each pair whole (the loader reads, deals and packs it as one unit)
        _pair_units(samples)
    # SFT groups (a prompt's RL completions, a row's 'group'): each whole in one row, as a pair is
    group_of = {s.conversation_id: g for s in samples if (g := sft_group(s)) is not None} if not pairs else {}
    # the run's settings the loader takes under the same names
    same = ("buffer_size", "pad_multiple", "seed", "pad_between_seqs", "max_patches_per_row")
    # a pair's two members (each at most max_seq_len) share one row: config.row_width, 2 x max_seq_len for
    # pairs, so no pair the tokenizer kept is refused mid-stream
    width = config.row_width
    # one global stream on every rank (rank 0 of 1): the rows one process packs, dealt to the ranks at each step
    loader = PackingDataset(
        samples,
        shuffle=True,
        num_epochs=None,
        rank=0,
        world_size=1,
        pad_id=pad_id,
        groups=pairs or bool(group_of),  # each pair (group) whole in one row (--batch-size counts rows, as for SFT)
        max_seq_len=width,
        **{name: getattr(config, name) for name in same},
    )
    return LoaderSource(
        loader,
        batch_size=config.batch_size,
        samples_fp=samples_fingerprint(samples),
        rank=rank,
        world=world,
        grad_accum=config.grad_accum,
        cost=cost,
        group_of=group_of or None,
    )


def model_cost(model: Any) -> SequenceCost | None:
    """The cost model of a model (:meth:`SequenceCost.from_config` of its config, a Hugging Face
    ``PretrainedConfig`` or a dataclass with the same field names, as :class:`SmallLlama`'s: its
    linear work per token and its full-attention layers' work per token squared), or ``None`` for
    a model without a readable config."""
    config: Any = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        fields = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields = dataclasses.asdict(config)
    else:
        return None
    try:
        return SequenceCost.from_config(fields, name=str(fields.get("model_type") or type(model).__name__))
    except (CostError, TypeError, ValueError):
        return None


def compact_vocabulary(samples: Sequence[Sample], keep: Iterable[int] = ()) -> tuple[list[Sample], np.ndarray]:
    """Renumber the token ids that occur in ``samples`` (and the ids in ``keep``) as
    ``0..U-1`` (in id order, so special tokens keep their order).

    A model over the ``U`` ids of the data has a ``U``-row embedding and head instead
    of the tokenizer's (the embedded corpus uses 34,460 of the Qwen BPE's 151,646 ids),
    which makes a tiny CPU model's head 4.4x cheaper. It is a different model (the
    softmax runs over ``U`` classes), so use it to measure and demonstrate, not to
    ship. Returns the renumbered samples and the ``(U,)`` int64 original id of each new id.
    A sample's media keeps its pixels; its placeholder id is renumbered (``keep`` the ids
    a model's config names, used or not: the pad, the vision block's tokens).

    >>> from sftpack.testing import samples_from_lengths
    >>> new, ids = compact_vocabulary(samples_from_lengths([2, 1]))
    >>> [s.input_ids.tolist() for s in new], ids.tolist()
    ([[0, 1], [2]], [1000, 1001, 2000])
    """
    if not samples:
        raise ValueError("compact_vocabulary needs at least one sample")
    extra = np.fromiter((int(i) for i in keep), dtype=np.int64)
    ids = np.unique(np.concatenate([s.input_ids for s in samples] + ([extra] if extra.size else [])))
    out = [
        Sample(
            np.searchsorted(ids, s.input_ids),
            s.loss_mask,
            s.conversation_id,
            dict(s.meta),
            media=None if s.media is None else s.media.renumbered(lambda i: int(np.searchsorted(ids, i))),
            weights=s.weights,
        )
        for s in samples
    ]
    return out, ids
