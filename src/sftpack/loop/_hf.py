"""Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``) on sftpack rows, no loop to write.

Two ways in, both ending in the keyword arguments of one packed row
(:meth:`~sftpack.PackedBatch.to_hf_kwargs`: ``input_ids``, ``position_ids``,
``labels`` of shape ``(1, T)``, ``cu_seq_lens_q/k``, ``max_length_q/k``,
``use_cache=False``) plus ``shift_labels``, the already-shifted labels:

- the trainer path: :class:`PackingCollator` takes the tokenized samples of a
  per-device batch (``{"input_ids", "loss_mask"}`` dicts or
  :class:`~sftpack.Sample`) and packs them at the step
  (:func:`sftpack.trainer.pack_step`);
- rows built beforehand (an offline ``PrepackedDataset``, a loader
  ``PackingDataset``): pass the dataset as it is and :class:`RowsCollator`
  lays the per-device rows end to end.

The loss is normalised over the *global* count of supervised tokens: Trainer
counts ``shift_labels != -100`` over all the micro-batches of a gradient
accumulation step (and across devices with ``average_tokens_across_devices``)
and passes that ``num_items_in_batch`` to the model, whose causal-LM loss then
divides its summed token loss by it. ``shift_labels`` makes the count and the
loss use exactly the targets of :class:`~sftpack.PackedBatch` (none crosses a
boundary). So a packed ``Trainer`` run and an unpacked one over the same
conversations take the same steps (tests/loop/test_hf_trainer.py).

Recipe::

    from transformers import Trainer, TrainingArguments
    from sftpack.loop import PackingCollator, build_model

    model = build_model(len(tok))              # or AutoModelForCausalLM(..., attn_implementation=...)
    args = TrainingArguments(out, per_device_train_batch_size=8, remove_unused_columns=False, ...)
    Trainer(model=model, args=args, train_dataset=samples, data_collator=PackingCollator()).train()

What each feature trains on must be said: a ``loss_mask``, or Hugging Face
``labels`` (unshifted: the token itself where trained, -100 elsewhere). A feature
with neither is refused with a ``KeyError`` naming its keys and the fix (Trainer's
default ``remove_unused_columns=True`` drops the ``loss_mask`` column: pass
``remove_unused_columns=False``), never trained on every token. An
``attention_mask`` that marks right padding is honoured (the padding is cut off);
left padding or holes are refused, as packing would make those pads context.

The model's attention must read the boundaries: ``flash_attention_2`` on GPU, or
on CPU :data:`~sftpack.loop._model.TRAIN_ATTENTION` (``build_model``'s default; register
it with :func:`~sftpack.loop._model.register_train_attention`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..handoff import PackedBatch
from ..sample import IGNORE_INDEX, Sample, as_sample
from ..trainer import pack_step, padded_batch
from ._micro_batch import media_of

__all__ = ["PackingCollator", "PaddedCollator", "RowsCollator", "hf_row_kwargs"]


def hf_row_kwargs(packed: PackedBatch, *, pad_between_seqs: bool = False) -> dict[str, Any]:
    """``packed.to_hf_kwargs()`` plus ``shift_labels`` ``(1, T)`` (and the real
    boundaries for :data:`~sftpack.loop._model.TRAIN_ATTENTION` when ``pad_between_seqs``)."""
    kw = packed.to_hf_kwargs()
    kw["shift_labels"] = packed.labels.unsqueeze(0)
    if pad_between_seqs:
        kw["sftpack_cu_seqlens_real"] = packed.cu_seqlens
    return kw


_FIX_KEYS = (
    "with Trainer, pass remove_unused_columns=False in TrainingArguments (its default drops every column the "
    "model's forward does not name, loss_mask included); to train on every token, say so with "
    "loss_mask=[1] * len(input_ids)"
)


def _sample(feature: Any, i: int) -> Any:
    """One feature as a :class:`~sftpack.Sample`, refusing what would train the wrong tokens.

    A mapping must say which tokens are trained: ``loss_mask``, or Hugging Face
    ``labels`` (unshifted: the token itself where trained, -100 elsewhere). An
    ``attention_mask`` is honoured when it only marks right padding (the padding is
    cut off); left padding or holes are refused (they would become context).
    """
    if isinstance(feature, Mapping):
        keys = sorted(str(k) for k in feature)
        if "input_ids" not in feature:
            raise KeyError(f"feature {i} has no 'input_ids' (keys: {', '.join(keys) or 'none'}); {_FIX_KEYS}")
        ids = np.asarray(feature["input_ids"], dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"feature {i}: input_ids has shape {ids.shape}, expected one sequence of ids (1-D)")
        if "loss_mask" in feature:
            mask = np.asarray(feature["loss_mask"]).astype(bool)
        elif "labels" in feature:
            labels = np.asarray(feature["labels"], dtype=np.int64)
            if labels.shape != ids.shape:
                raise ValueError(
                    f"feature {i}: labels has shape {labels.shape}, input_ids {ids.shape}: they must match"
                )
            mask = labels != IGNORE_INDEX
            if np.any(labels[mask] != ids[mask]):
                t = int(np.flatnonzero(mask & (labels != ids))[0])
                raise ValueError(
                    f"feature {i}: labels[{t}]={int(labels[t])} differs from input_ids[{t}]={int(ids[t])}: the "
                    "collators read Hugging Face's unshifted labels (the token itself where trained, -100 "
                    "elsewhere); pass loss_mask instead of shifted or other labels"
                )
        else:
            raise KeyError(
                f"feature {i} has neither 'loss_mask' nor 'labels' (keys: {', '.join(keys)}), so nothing says "
                f"which tokens to train on; {_FIX_KEYS}"
            )
        if mask.shape != ids.shape:
            raise ValueError(f"feature {i}: loss_mask has shape {mask.shape}, input_ids {ids.shape}: they must match")
        if "attention_mask" in feature:
            att = np.asarray(feature["attention_mask"])
            if att.shape != ids.shape or not np.isin(att, (0, 1)).all():
                raise ValueError(f"feature {i}: attention_mask must be 0/1 of the shape of input_ids {ids.shape}")
            real = int(att.sum())
            if not att[:real].all():
                first = int(np.flatnonzero(att == 0)[0])
                raise ValueError(
                    f"feature {i}: attention_mask has padding at position {first}, before real tokens (left "
                    "padding or holes): packing would turn those pads into context; tokenize without padding "
                    "(padding=False) or pad on the right"
                )
            ids, mask = ids[:real], mask[:real]  # right padding: cut off
        cid = feature["conversation_id"] if "conversation_id" in feature else i
        return as_sample({"input_ids": ids, "loss_mask": mask, "conversation_id": cid}, i)
    if isinstance(feature, Sample):
        return feature
    raise TypeError(
        f"feature {i} is a {type(feature).__name__}: give a Sample or a mapping with input_ids and loss_mask "
        "(or labels)"
    )


class PackingCollator:
    """The trainer path as a ``data_collator``: a per-device batch of samples -> one packed row.

    Args:
        pad_multiple: pad each sequence to a multiple of this (``2 * CP``).
        pad_id: token id of padding slots.
        pad_between_seqs: also hand the attention the real boundaries (``"real"`` mode).

    >>> from sftpack.testing import samples_from_lengths
    >>> batch = PackingCollator(pad_multiple=4)(samples_from_lengths([5, 10]))
    >>> batch["input_ids"].shape, batch["cu_seq_lens_q"].tolist(), batch["shift_labels"][0, :6].tolist()
    (torch.Size([1, 20]), [0, 8, 20], [1001, 1002, 1003, 1004, -100, -100])
    """

    def __init__(self, *, pad_multiple: int = 1, pad_id: int = 0, pad_between_seqs: bool = False) -> None:
        self.pad_multiple, self.pad_id, self.pad_between_seqs = (
            pad_multiple,
            pad_id,
            pad_between_seqs,
        )

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        samples = [_sample(f, i) for i, f in enumerate(features)]
        ids, lengths, mask = padded_batch(samples, pad_id=self.pad_id)
        packed = pack_step(
            ids, lengths, mask, pad_multiple=self.pad_multiple, pad_id=self.pad_id, media=media_of(samples)
        )
        return hf_row_kwargs(packed, pad_between_seqs=self.pad_between_seqs)


class RowsCollator:
    """Rows already packed (offline ``PrepackedDataset[i]``, loader ``PackingDataset``
    items: :class:`~sftpack.PackedBatch`) laid end to end into one flat run."""

    def __init__(self, *, pad_between_seqs: bool = False) -> None:
        self.pad_between_seqs = pad_between_seqs

    def __call__(self, rows: Sequence[PackedBatch]) -> dict[str, Any]:
        batch = getattr(rows, "batch", None)  # offline rows fetched together (PrepackedDataset.__getitems__)
        if not isinstance(batch, PackedBatch):
            batch = PackedBatch.concat(list(rows))
        return hf_row_kwargs(batch, pad_between_seqs=self.pad_between_seqs)


class PaddedCollator:
    """The unpacked baseline for ``Trainer``: right-padded ``input_ids``, ``attention_mask``
    and unshifted ``labels`` (the token itself where trainable, else -100)."""

    def __init__(self, *, pad_id: int = 0) -> None:
        self.pad_id = pad_id

    def __call__(self, features: Sequence[Any]) -> dict[str, torch.Tensor]:
        samples = [_sample(f, i) for i, f in enumerate(features)]
        ids, lengths, mask = padded_batch(samples, pad_id=self.pad_id)
        real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        labels = torch.where(mask & real, ids, torch.full_like(ids, IGNORE_INDEX))
        return {"input_ids": ids, "attention_mask": real.long(), "labels": labels}
