"""The Hugging Face collators refuse features that would train the wrong tokens
(issue 16 item 10): no ``loss_mask``/``labels`` (Trainer's default
``remove_unused_columns=True`` drops ``loss_mask``; a typo'd key), labels that are
not Hugging Face's unshifted ones, and left padding; right padding marked by
``attention_mask`` is cut off, giving exactly the unpadded batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainingArguments

from sftpack.loop import PackingCollator, PaddedCollator
from tests.helpers import tiny_model

COLLATORS = [PackingCollator(pad_multiple=4), PaddedCollator()]


def _features(samples, n=3):
    return [{"input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.tolist()} for s in samples[:n]]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("collate", COLLATORS, ids=type)
def test_a_feature_without_loss_mask_or_labels_is_refused(samples, collate):
    feats = _features(samples)
    feats[1] = {"input_ids": feats[1]["input_ids"], "loss_maks": feats[1]["loss_mask"]}  # a typo
    with pytest.raises(
        KeyError,
        match=r"feature 1 has neither 'loss_mask' nor 'labels' \(keys: input_ids, "
        r"loss_maks\).*remove_unused_columns=False",
    ):
        collate(feats)
    with pytest.raises(TypeError, match="feature 0 is a list"):
        collate([f["input_ids"] for f in feats])  # bare ids say nothing about what to train on


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_default_remove_unused_columns_is_refused(samples, tmp_path):
    """A real Trainer with its default ``remove_unused_columns=True`` drops the
    ``loss_mask`` column before the collator: refused, naming the fix."""
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    assert args.remove_unused_columns is True
    trainer = Trainer(
        model=tiny_model(), args=args, train_dataset=_features(samples, 4), data_collator=PackingCollator()
    )
    with pytest.raises(KeyError, match="remove_unused_columns=False"):
        trainer.train()


@pytest.mark.parametrize("collate", COLLATORS, ids=type)
def test_unshifted_labels_equal_the_loss_mask_and_other_labels_are_refused(samples, collate):
    feats = _features(samples)
    with_labels = [
        {"input_ids": f["input_ids"], "labels": [t if m else -100 for t, m in zip(f["input_ids"], f["loss_mask"])]}
        for f in feats
    ]
    _same(collate(with_labels), collate(feats))
    shifted = [dict(f, labels=f["labels"][1:] + [-100]) for f in with_labels]
    with pytest.raises(ValueError, match=r"feature 0: labels\[\d+\]=\d+ differs from input_ids"):
        collate(shifted)


@pytest.mark.parametrize("collate", COLLATORS, ids=type)
def test_right_padding_is_cut_and_left_padding_refused(samples, collate):
    feats = _features(samples)
    width = max(len(f["input_ids"]) for f in feats) + 3
    right, left = [], []
    for f in feats:
        n, pad = len(f["input_ids"]), width - len(f["input_ids"])
        right.append(
            {
                "input_ids": f["input_ids"] + [0] * pad,
                "loss_mask": f["loss_mask"] + [1] * pad,
                "attention_mask": [1] * n + [0] * pad,
            }
        )
        left.append(
            {
                "input_ids": [0] * pad + f["input_ids"],
                "loss_mask": [0] * pad + f["loss_mask"],
                "attention_mask": [0] * pad + [1] * n,
            }
        )
    # the padding (even marked trainable) is cut off: exactly the unpadded batch
    _same(collate(right), collate(feats))
    with pytest.raises(ValueError, match="feature 0: attention_mask has padding at position 0, before real tokens"):
        collate(left)
    holes = [dict(right[0], attention_mask=[1, 0] + right[0]["attention_mask"][2:])]
    with pytest.raises(ValueError, match="position 1"):
        collate(holes)


def test_all_ones_attention_mask_changes_nothing(samples):
    feats = _features(samples)
    marked = [dict(f, attention_mask=np.ones(len(f["input_ids"]), dtype=np.int64)) for f in feats]
    _same(PackingCollator()(marked), PackingCollator()(feats))
