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
conversations take the same steps (tests/train/test_hf_trainer.py).

Recipe::

    from transformers import Trainer, TrainingArguments
    from sftpack.train import PackingCollator, build_model

    model = build_model(len(tok))              # or AutoModelForCausalLM(..., attn_implementation=...)
    args = TrainingArguments(out, per_device_train_batch_size=8, remove_unused_columns=False, ...)
    Trainer(model=model, args=args, train_dataset=samples, data_collator=PackingCollator()).train()

The model's attention must read the boundaries: ``flash_attention_2`` on GPU, or
on CPU :data:`~sftpack.train.TRAIN_ATTENTION` (``build_model``'s default; register
it with :func:`~sftpack.train.register_train_attention`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..handoff import IGNORE_INDEX, PackedBatch, as_sample

__all__ = ["PackingCollator", "PaddedCollator", "RowsCollator", "hf_row_kwargs"]


def hf_row_kwargs(
    packed: PackedBatch, *, pad_between_seqs: bool = False
) -> dict[str, Any]:
    """``packed.to_hf_kwargs()`` plus ``shift_labels`` ``(1, T)`` (and the real
    boundaries for :data:`~sftpack.train.TRAIN_ATTENTION` when ``pad_between_seqs``)."""
    kw = packed.to_hf_kwargs()
    kw["shift_labels"] = packed.labels.unsqueeze(0)
    if pad_between_seqs:
        kw["sftpack_cu_seqlens_real"] = packed.cu_seqlens
    return kw


def _sample(feature: Any, i: int) -> Any:
    if (
        isinstance(feature, Mapping)
        and "loss_mask" not in feature
        and "labels" in feature
    ):
        ids = np.asarray(feature["input_ids"], dtype=np.int64)
        labels = np.asarray(feature["labels"], dtype=np.int64)
        return as_sample({"input_ids": ids, "loss_mask": labels != IGNORE_INDEX}, i)
    return as_sample(feature, i)


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

    def __init__(
        self, *, pad_multiple: int = 1, pad_id: int = 0, pad_between_seqs: bool = False
    ) -> None:
        self.pad_multiple, self.pad_id, self.pad_between_seqs = (
            pad_multiple,
            pad_id,
            pad_between_seqs,
        )

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        from ..trainer import pack_step, padded_batch

        samples = [_sample(f, i) for i, f in enumerate(features)]
        ids, lengths, mask = padded_batch(samples, pad_id=self.pad_id)
        packed = pack_step(
            ids, lengths, mask, pad_multiple=self.pad_multiple, pad_id=self.pad_id
        )
        return hf_row_kwargs(packed, pad_between_seqs=self.pad_between_seqs)


class RowsCollator:
    """Rows already packed (offline ``PrepackedDataset[i]``, loader ``PackingDataset``
    items: :class:`~sftpack.PackedBatch`) laid end to end into one flat run."""

    def __init__(self, *, pad_between_seqs: bool = False) -> None:
        self.pad_between_seqs = pad_between_seqs

    def __call__(self, rows: Sequence[PackedBatch]) -> dict[str, Any]:
        return hf_row_kwargs(
            PackedBatch.concat(list(rows)), pad_between_seqs=self.pad_between_seqs
        )


class PaddedCollator:
    """The unpacked baseline for ``Trainer``: right-padded ``input_ids``, ``attention_mask``
    and unshifted ``labels`` (the token itself where trainable, else -100)."""

    def __init__(self, *, pad_id: int = 0) -> None:
        self.pad_id = pad_id

    def __call__(self, features: Sequence[Any]) -> dict[str, torch.Tensor]:
        from ..trainer import padded_batch

        samples = [_sample(f, i) for i, f in enumerate(features)]
        ids, lengths, mask = padded_batch(samples, pad_id=self.pad_id)
        real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        labels = torch.where(mask & real, ids, torch.full_like(ids, IGNORE_INDEX))
        return {"input_ids": ids, "attention_mask": real.long(), "labels": labels}
