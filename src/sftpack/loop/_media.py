"""Multimodal training (issue 19): conversations with images through the training loop.

The pieces, beside the text loop's:

- data: :func:`vqa_samples` (the embedded easy-vqa corpus, tokenized with Qwen2-VL's
  tokenizer and image processor) and :func:`compact_media_vocabulary` (the ids that
  occur, renumbered: the text loop's ``--vocab data`` for multimodal samples);
- sources: :class:`MediaPaddedSource` (``--packing none``: each micro-batch a right-padded
  ``[b, S]`` batch with its MRoPE positions and images, :class:`PaddedMediaMicroBatch`)
  and :class:`MediaTrainerSource` (``--packing trainer``: the same conversations per
  step, binned into token-budget micro-batches and each packed at the step by
  :func:`sftpack.trainer.pack_media_step`). The step's conversations are the next slice
  of the same seeded permutation (:class:`~sftpack.loop._sources.SampleOrder`) for
  both, so both see the same samples and images every step;
- model: :func:`tiny_vqa_model` (a tiny Qwen2-VL from a config, nothing downloaded) and
  :class:`MediaLossModule` (the model plus the global token-mean loss of a micro-batch,
  packed or padded, through the fused head on the supervised slots only);
- :func:`train_media`: :func:`sftpack.loop.train` with :class:`MediaLossModule` (the text
  loop's AdamW, schedule, clipping and global token-mean normalisation, one process), its
  JSONL log adding ``images`` per step.

Why the losses are equal whatever the packing: as for text, each step's loss is the
sum of token losses over the step's supervised targets divided by their count. The
packed row gives every sample its own MRoPE positions (restarting at 0) and its own
attention segment, and the vision tower attends within each image, so each token's
loss is the one it has alone; only summation orders differ
(``tests/loop/test_media_train.py``: 20 AdamW steps in float64 to 1e-10).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..handoff import PackedBatch
from ..head import fused_linear_cross_entropy
from ..multimodal import (
    MultimodalSample,
    image_processor,
    qwen2vl_tokenizer,
    tiny_qwen2vl,
    tokenize_multimodal_conversations,
    vqa_corpus,
)
from ..multimodal._model import _image_outputs
from ..multimodal._sample import _QWEN2VL_IDS
from ..sample import IGNORE_INDEX
from ..trainer import plan_microbatches
from ..trainer._media import collate_media
from ._loop import StepLog, TrainResult, dist_info, train
from ._model import TRAIN_ATTENTION
from ._options import Packing, TrainConfig
from ._sources import LoaderSource, OfflineSource, PaddedMicroBatch, SampleOrder, Source

__all__ = [
    "MediaLossModule",
    "MediaPaddedSource",
    "MediaReplaySource",
    "MediaTrainerSource",
    "PaddedMediaMicroBatch",
    "RenumberedSource",
    "compact_media_vocabulary",
    "make_media_source",
    "media_ids",
    "tiny_vqa_model",
    "train_media",
    "vqa_samples",
]

#: Qwen2-VL's pad (``<|endoftext|>``) and the special ids a tiny model must know, used or not
PAD_ID = 151643
_SPECIALS = (PAD_ID, *(_QWEN2VL_IDS[k] for k in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")), 151656)


# ------------------------------------------------------------------------------ data
def vqa_samples(
    *,
    limit: int,
    seed: int = 0,
    max_seq_len: int | None = None,
    min_side: int = 56,
    max_side: int = 448,
) -> tuple[list[MultimodalSample], Any]:
    """The first ``limit`` easy-vqa conversations (:func:`sftpack.multimodal.vqa_corpus`, seeded
    image sizes ``min_side``-``max_side`` px a side) as multimodal samples, with Qwen2-VL's
    tokenizer and image processor; conversations longer than ``max_seq_len`` are split at
    text boundaries. Returns ``(samples, stats)`` (``stats``: ``MultimodalStats``)."""
    from ..multimodal import MultimodalStats

    stats = MultimodalStats()
    convs = vqa_corpus(seed=seed, limit=limit, min_side=min_side, max_side=max_side)
    got = list(
        tokenize_multimodal_conversations(
            convs, tokenizer=qwen2vl_tokenizer(), processor=image_processor(), max_seq_len=max_seq_len, stats=stats
        )
    )
    if not got:
        raise ValueError("no easy-vqa conversation left to train on (all dropped?)")
    return got, stats


def compact_media_vocabulary(samples: Sequence[MultimodalSample]) -> tuple[list[MultimodalSample], np.ndarray]:
    """Renumber the ids the samples use, plus Qwen2-VL's pad and vision ids, as ``0..U-1`` (in
    id order, so the special tokens keep their roles): a model over ``U`` ids instead of
    151,657 (see :func:`sftpack.loop.compact_vocabulary`, the same for text; a different model,
    for measuring and demonstrating). Returns the samples and the ``(U,)`` original ids."""
    if not samples:
        raise ValueError("compact_media_vocabulary needs at least one sample")
    ids = np.unique(np.concatenate([s.input_ids for s in samples] + [np.array(_SPECIALS, dtype=np.int64)]))
    out = [
        MultimodalSample(
            input_ids=np.searchsorted(ids, s.input_ids),
            loss_mask=s.loss_mask,
            conversation_id=s.conversation_id,
            meta=dict(s.meta),
            pixel_values=s.pixel_values,
            image_grid_thw=s.image_grid_thw,
            image_runs=s.image_runs,
            image_token_id=int(np.searchsorted(ids, s.image_token_id)),
            merge_size=s.merge_size,
        )
        for s in samples
    ]
    return out, ids


def media_ids(vocab: np.ndarray | None) -> dict[str, int]:
    """The pad and vision ids in a vocabulary (``None``: Qwen2-VL's own)."""

    def at(token_id: int) -> int:
        return token_id if vocab is None else int(np.searchsorted(vocab, token_id))

    return {
        "pad_id": at(PAD_ID),
        "image_token_id": at(_QWEN2VL_IDS["<|image_pad|>"]),
        "vision_start_token_id": at(_QWEN2VL_IDS["<|vision_start|>"]),
        "vision_end_token_id": at(_QWEN2VL_IDS["<|vision_end|>"]),
        "video_token_id": at(151656),
    }


def tiny_vqa_model(
    vocab: np.ndarray | None,
    *,
    dim: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The default model of ``sftpack train --corpus vqa``: a tiny Qwen2-VL
    (:func:`sftpack.multimodal.tiny_qwen2vl`, text ``dim``/``layers``/``heads``/``kv_heads``, a
    vision tower of width ``dim``, depth 2) over ``vocab`` (from
    :func:`compact_media_vocabulary`; ``None``: Qwen2-VL's 151,657 ids)."""
    ids = media_ids(vocab)
    return tiny_qwen2vl(
        151657 if vocab is None else len(vocab),
        image_token_id=ids["image_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        video_token_id=ids["video_token_id"],
        dim=dim,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        vision_dim=dim,
        vision_heads=heads,
        seed=seed,
        dtype=dtype,
    )


# --------------------------------------------------------------------------- sources
@dataclass(eq=False)
class PaddedMediaMicroBatch(PaddedMicroBatch):
    """The unpacked baseline's multimodal micro-batch: the text baseline's right-padded
    ``[b, S]`` batch (:class:`~sftpack.loop.PaddedMicroBatch`: ``input_ids``, ``labels``
    shifted within each row, ``lengths``, ``sequence_ids``) plus its images.

    Attributes:
        mrope_position_ids: ``(3, b, S)`` each row's own MRoPE positions.
        pixel_values, image_grid_thw: the rows' images in batch order.
    """

    mrope_position_ids: torch.Tensor = dataclasses.field(kw_only=True)
    pixel_values: torch.Tensor = dataclasses.field(kw_only=True)
    image_grid_thw: torch.Tensor = dataclasses.field(kw_only=True)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def to(self, device: torch.device | str) -> PaddedMediaMicroBatch:
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            labels=self.labels.to(device),
            mrope_position_ids=self.mrope_position_ids.to(device),
            pixel_values=self.pixel_values.to(device),
            image_grid_thw=self.image_grid_thw.to(device),
        )


def padded_media_micro_batch(samples: Sequence[MultimodalSample], *, pad_id: int) -> PaddedMediaMicroBatch:
    """:func:`sftpack.trainer.collate_media` of ``samples``, its labels shifted within each row."""
    b = collate_media(samples, pad_id=pad_id)
    shifted = torch.full_like(b.labels, IGNORE_INDEX)
    shifted[:, :-1] = b.labels[:, 1:]  # -100 on padding and untrained tokens already
    return PaddedMediaMicroBatch(
        b.input_ids,
        shifted,
        b.attention_mask.sum(1),
        b.sequence_ids,
        mrope_position_ids=b.mrope_position_ids,
        pixel_values=b.pixel_values,
        image_grid_thw=b.image_grid_thw,
    )


def media_fingerprint(samples: Sequence[MultimodalSample]) -> str:
    """sha256 over every sample's ids, loss mask, grids and patches, in order."""
    h = hashlib.sha256()
    for s in samples:
        for a in (np.int64(len(s)), s.input_ids, np.packbits(s.loss_mask), s.image_grid_thw, s.pixel_values):
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class _MediaSampleSource(Source):
    def __init__(
        self,
        samples: Sequence[MultimodalSample],
        *,
        batch_size: int,
        seed: int,
        grad_accum: int = 1,
        pad_id: int = PAD_ID,
    ) -> None:
        if batch_size < grad_accum:
            raise ValueError(f"batch_size={batch_size} conversations cannot make grad_accum={grad_accum} micro-batches")
        self.samples = list(samples)
        self.order = SampleOrder(len(self.samples), batch_size=batch_size, seed=seed)
        self.grad_accum, self.pad_id = grad_accum, pad_id
        self._fp = media_fingerprint(self.samples)

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.order.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state["order"])

    def fingerprint(self) -> str:
        key = {"samples": self._fp, "kind": type(self).__name__, "batch_size": self.order.batch_size}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


class MediaPaddedSource(_MediaSampleSource):
    """``--packing none`` with images: the step's conversations cut into ``grad_accum``
    right-padded micro-batches (in order), each with its rows' MRoPE positions and images."""

    def next_step(self) -> list[Any]:
        parts = np.array_split(self.order.take(), self.grad_accum)
        return [padded_media_micro_batch([self.samples[i] for i in p], pad_id=self.pad_id) for p in parts]


class MediaTrainerSource(_MediaSampleSource):
    """``--packing trainer`` with images: the step's conversations (the same as
    :class:`MediaPaddedSource`'s) binned into micro-batches of at most ``token_budget``
    padded tokens (:func:`sftpack.trainer.plan_microbatches`), each collated into a padded
    batch and packed at the step (:func:`sftpack.trainer.pack_media_step`)."""

    def __init__(
        self,
        samples: Sequence[MultimodalSample],
        *,
        token_budget: int,
        pad_multiple: int = 1,
        **kw: Any,
    ) -> None:
        super().__init__(samples, **kw)
        self.token_budget, self.pad_multiple = token_budget, pad_multiple

    def next_step(self) -> list[Any]:
        chosen = self.order.take()
        lengths = np.fromiter((len(self.samples[i]) for i in chosen), dtype=np.int64, count=len(chosen))
        plan = plan_microbatches(
            lengths, self.token_budget, pad_multiple=self.pad_multiple, min_microbatches=self.grad_accum
        )
        out = []
        for mb in plan[0]:
            picked = [self.samples[int(chosen[i])] for i in sorted(mb.tolist())]
            out.append(
                collate_media(picked, pad_id=self.pad_id).pack(pad_multiple=self.pad_multiple, pad_id=self.pad_id)
            )
        return out

    def fingerprint(self) -> str:
        key = {"base": super().fingerprint(), "budget": self.token_budget, "pad_multiple": self.pad_multiple}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


class MediaReplaySource(Source):
    """Given samples per step, as padded micro-batches with their images (``grad_accum`` per
    step, in order): the unpacked reference of a loader or offline run, whose rows decide
    which conversations a step holds (:attr:`TrainResult.conversations`)."""

    def __init__(
        self, steps: Sequence[Sequence[MultimodalSample]], *, grad_accum: int = 1, pad_id: int = PAD_ID
    ) -> None:
        self.steps = [list(s) for s in steps]
        self.grad_accum, self.pad_id = grad_accum, pad_id
        self.position = 0

    def next_step(self) -> list[Any]:
        if self.position >= len(self.steps):
            raise ValueError(f"MediaReplaySource: only {len(self.steps)} steps were given")
        mine = self.steps[self.position]
        self.position += 1
        parts = [p for p in np.array_split(np.arange(len(mine)), self.grad_accum) if len(p)]
        return [padded_media_micro_batch([mine[i] for i in p], pad_id=self.pad_id) for p in parts]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])

    def fingerprint(self) -> str:
        return media_fingerprint([s for step in self.steps for s in step])


class RenumberedSource(Source):
    """Another source's packed rows with their token ids renumbered into ``vocab`` (the ids
    :func:`compact_media_vocabulary` kept, in order): a prepack stores the tokenizer's ids,
    a model over the data's vocabulary reads them renumbered. An id outside ``vocab`` is an error."""

    def __init__(self, inner: Source, vocab: np.ndarray, *, pad_id: int) -> None:
        self.inner, self.pad_id = inner, pad_id
        self.lut = torch.full((int(vocab.max()) + 2,), -1, dtype=torch.int64)
        self.lut[torch.from_numpy(np.asarray(vocab, dtype=np.int64))] = torch.arange(len(vocab))

    def _map(self, ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        out = torch.where(where, self.lut[ids.clamp(0, len(self.lut) - 1)], self.pad_id)
        if bool((out < 0).any()):
            bad = int(ids[out < 0][0])
            raise ValueError(f"token id {bad} of the rows is not in the model's vocabulary (the data's ids)")
        return out

    def next_step(self) -> list[Any]:
        out = []
        for b in self.inner.next_step():
            assert isinstance(b, PackedBatch)  # the offline and loader sources hand packed rows
            keep = b.labels != IGNORE_INDEX
            labels = torch.where(keep, self._map(b.labels, keep), IGNORE_INDEX)
            ids = self._map(b.input_ids, b.real_token_mask)  # padding slots: the model's pad id
            image_id = b.image_token_id if b.image_token_id is None else int(self.lut[int(b.image_token_id)])
            out.append(dataclasses.replace(b, input_ids=ids, labels=labels, image_token_id=image_id))
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()


def make_media_source(
    config: TrainConfig,
    samples: Sequence[MultimodalSample],
    *,
    pad_id: int = PAD_ID,
    prepacked: Any = None,
    vocab: np.ndarray | None = None,
) -> Source:
    """The multimodal source of ``config.packing``.

    Args:
        config: the run's :class:`TrainConfig`.
        samples: the multimodal samples (``trainer``, ``none``, ``loader``).
        pad_id: the pad id of ``samples``' vocabulary.
        prepacked: ``offline``: a prepack with images (its directory, or an opened
            :class:`sftpack.offline.PrepackedDataset`), from :func:`sftpack.offline.prepack_multimodal`.
        vocab: ``offline`` with a model over the data's ids: the original id of each
            (:func:`compact_media_vocabulary`); the prepack's rows are renumbered on read.

    Raises:
        ValueError: a sample longer than ``config.max_seq_len``, samples with no supervised
            target, or ``offline`` without a prepack.
    """
    long = [i for i, s in enumerate(samples) if len(s) > config.max_seq_len]
    if long:
        raise ValueError(
            f"sample {long[0]} has {len(samples[long[0]])} tokens, more than max_seq_len={config.max_seq_len}: "
            "tokenize with the same max_seq_len (over-long conversations are split at text boundaries)"
        )
    if not any(bool(s.loss_mask[1:].any()) for s in samples):
        raise ValueError("the samples hold no supervised target, so training would learn nothing")
    common: dict[str, Any] = {
        "batch_size": config.batch_size,
        "seed": config.seed,
        "grad_accum": config.grad_accum,
        "pad_id": pad_id,
    }
    if config.packing is Packing.NONE:
        return MediaPaddedSource(samples, **common)
    if config.packing is Packing.TRAINER:
        budget = config.micro_batch_tokens or config.max_seq_len
        return MediaTrainerSource(samples, token_budget=budget, pad_multiple=config.pad_multiple, **common)
    if config.packing is Packing.LOADER:
        from ..loader import MultimodalPackingDataset

        loader = MultimodalPackingDataset(
            list(samples),
            max_seq_len=config.max_seq_len,
            buffer_size=config.buffer_size,
            pad_multiple=config.pad_multiple,
            seed=config.seed,
            shuffle=True,
            num_epochs=None,
            pad_id=pad_id,
            pad_between_seqs=config.pad_between_seqs,
        )
        return LoaderSource(
            loader, batch_size=config.batch_size, samples_fp=media_fingerprint(samples), grad_accum=config.grad_accum
        )
    if prepacked is None:
        raise ValueError("--packing offline needs a prepack with images (sftpack.offline.prepack_multimodal)")
    from ..offline import PrepackedDataset

    ds = (
        PrepackedDataset(prepacked, verify="size", shuffle=True, seed=config.seed)
        if isinstance(prepacked, (str, os.PathLike))
        else prepacked
    )
    if ds.max_seq_len != config.max_seq_len:
        raise ValueError(f"the prepack's rows are {ds.max_seq_len} wide, not max_seq_len={config.max_seq_len}")
    source: Source = OfflineSource(ds, batch_size=config.batch_size, grad_accum=config.grad_accum)
    return source if vocab is None else RenumberedSource(source, vocab, pad_id=pad_id)


# ----------------------------------------------------------------------------- model
class MediaLossModule(nn.Module):
    """A Qwen2-VL-style model plus the loss, as one module: ``forward(mb, n)`` returns the
    micro-batch's share of the global token-mean loss (``sum of token losses / n *
    average_over_ranks``), as :class:`sftpack.loop._model.LossModule` does for text.

    A packed row (a ``PackedBatch`` with media): the vision tower runs over the row's
    ``vision_cu_seqlens`` (within each image), the language model over the row's
    boundaries and per-sample MRoPE positions (``to_hf_kwargs()``; with
    ``pad_between_seqs`` the real boundaries too). A padded batch
    (:class:`PaddedMediaMicroBatch`): the model's own path with the rows' MRoPE positions;
    causal attention never looks right, so no mask is needed. Then the output head on the
    supervised slots only, through :func:`sftpack.head.fused_linear_cross_entropy`.
    """

    #: :func:`sftpack.loop.train` logs the step's ``images`` for this module's runs
    counts_images = True

    def __init__(self, model: Any, *, pad_between_seqs: bool, average_over_ranks: int = 1) -> None:
        super().__init__()
        self.model = model
        self.pad_between_seqs = pad_between_seqs
        self.average_over_ranks = average_over_ranks

    def forward(self, mb: Any, num_label_tokens: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        head = self.model.get_output_embeddings()
        if isinstance(mb, PackedBatch):
            kw = mb.to_hf_kwargs()
            for key in ("labels", "pixel_values", "image_grid_thw"):  # the tower runs here
                kw.pop(key, None)
            if self.model.config.text_config._attn_implementation == TRAIN_ATTENTION:
                if self.pad_between_seqs:
                    kw["sftpack_cu_seqlens_real"] = mb.cu_seqlens
            else:  # other kernels find the boundaries where the text position row restarts
                kw = {"input_ids": kw["input_ids"], "position_ids": kw["position_ids"], "use_cache": False}
            if mb.num_images:
                assert mb.pixel_values is not None and mb.image_grid_thw is not None
                assert mb.vision_cu_seqlens is not None
                kw["mm_encoder_outputs"] = {
                    "image": _image_outputs(self.model, mb.pixel_values, mb.image_grid_thw, mb.vision_cu_seqlens)
                }
            hidden = inner(**kw).last_hidden_state[0]
            labels = mb.labels
        else:
            kw = {"input_ids": mb.input_ids, "position_ids": mb.mrope_position_ids, "use_cache": False}
            if mb.num_images:
                kw["pixel_values"] = mb.pixel_values
                kw["image_grid_thw"] = mb.image_grid_thw
            hidden = inner(**kw).last_hidden_state.flatten(0, 1)
            labels = mb.labels.reshape(-1)
        keep = labels != IGNORE_INDEX
        return fused_linear_cross_entropy(
            hidden[keep],
            head.weight,
            labels[keep],
            num_label_tokens,
            bias=getattr(head, "bias", None),
            average_over_ranks=self.average_over_ranks,
        )


# ------------------------------------------------------------------------------ loop
def train_media(
    config: TrainConfig,
    *,
    source: Source,
    model: Any,
    log: str | os.PathLike[str] | None = None,
    progress: bool = False,
    on_step: Callable[[StepLog], None] | None = None,
) -> TrainResult:
    """Train a Qwen2-VL-style ``model`` on ``source`` (:func:`make_media_source`) for
    ``config.steps`` optimizer steps, one process: the text loop's AdamW, schedule,
    clipping, non-finite handling and global token-mean loss, through
    :class:`MediaLossModule`: :func:`sftpack.loop.train` itself, whose log adds ``images``
    per step. ``log``: one :class:`~sftpack.loop.StepLog` per line.

    Raises:
        NonFiniteError: a step's loss or gradient norm was not finite (``on_nonfinite="error"``).
        ValueError: an unusable device, or a run under ``torch.distributed`` with several ranks.
    """
    if dist_info()[1] > 1:
        raise ValueError("multimodal training runs on one process for now: start it without torchrun")
    return train(
        config, source=source, model=model, log=log, progress=progress, on_step=on_step, loss_module=MediaLossModule
    )
