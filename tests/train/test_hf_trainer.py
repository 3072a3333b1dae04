"""A real ``transformers.Trainer`` on packed rows against the same Trainer on padded
batches: same conversations per step (Trainer's seeded sampler over the same
dataset), gradient accumulation 2, loss normalised by Trainer's
``num_items_in_batch`` (the global count of supervised targets). Per-step losses
and final parameters agree within fp32 noise, for the trainer path (a collator)
and for offline rows (the PrepackedDataset as the train dataset)."""

from __future__ import annotations

import pytest
import torch

from sftpack.train import PackingCollator, PaddedCollator, RowsCollator

from ._tiny import max_loss_diff, max_param_diff, tiny_model

TOL = 1e-5


def _run(tmp_path, dataset, collator, *, batch=4, steps=4, seed=0):
    from transformers import Trainer, TrainingArguments

    model = tiny_model()
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        remove_unused_columns=False,
        use_cpu=True,
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=collator
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_with_packing_collator_equals_padded(samples, tmp_path):
    data = [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples]
    first = PackingCollator(pad_multiple=4)(data[:4])
    assert first["input_ids"].shape[0] == 1  # one packed row
    packed_losses, packed = _run(
        tmp_path / "a", data, PackingCollator(pad_multiple=4, pad_between_seqs=True)
    )
    padded_losses, padded = _run(tmp_path / "b", data, PaddedCollator())
    assert len(packed_losses) == 4
    assert max_loss_diff(packed_losses, padded_losses) <= TOL
    assert max_param_diff(packed, padded) <= TOL
    assert max_param_diff(packed, tiny_model()) > 1e-3  # it trained


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_on_offline_rows_equals_padded(samples, tmp_path):
    from sftpack.offline import PrepackedDataset, prepack_samples

    out = prepack_samples(samples, tmp_path / "rows", max_seq_len=128).path
    rows = PrepackedDataset(out)
    packed_losses, packed = _run(tmp_path / "a", rows, RowsCollator(), batch=2, steps=3)

    # The unpacked reference: the same rows' conversations, each row unpacked into its own padded batch.
    by_id = {s.conversation_id: s for s in samples}
    groups = [[by_id[c] for c in rows[i].sequence_ids] for i in range(len(rows))]

    class RowConversations(torch.utils.data.Dataset):
        def __len__(self):
            return len(groups)

        def __getitem__(self, i):
            return groups[i]

    def collate(items):
        return PaddedCollator()([s for group in items for s in group])

    padded_losses, padded = _run(
        tmp_path / "b", RowConversations(), collate, batch=2, steps=3
    )
    assert max_loss_diff(packed_losses, padded_losses) <= TOL
    assert max_param_diff(packed, padded) <= TOL
