"""A real ``transformers.Trainer`` on packed rows against the same Trainer on padded
batches: same conversations per step (Trainer's seeded sampler over the same
dataset), gradient accumulation 2, loss normalised by Trainer's
``num_items_in_batch`` (the global count of supervised targets), for the trainer
path (a collator) and for offline rows (the PrepackedDataset as the train dataset).

In float64 per-step losses and final parameters agree to a fixed 1e-10 (the
derivation is tests/loop/test_equality.py's; 4 steps instead of 20). Hugging
Face's own causal-LM loss upcasts the logits to float32, so the float64 runs hand
Trainer the same loss (the same label shift, the same sum over
``num_items_in_batch``) computed in float64 through ``compute_loss_func``. The
float32 runs keep Hugging Face's own loss and compare the first step's loss and
gradient norm within the float32 bound derived there (2e-4 absolute, 1.5e-4
relative)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from sftpack.loop import PackingCollator, PaddedCollator, RowsCollator
from sftpack.offline import PrepackedDataset, prepack_samples
from tests.helpers import max_loss_diff, max_param_diff, tiny_model

TOL = 1e-10  # float64; see tests/loop/test_equality.py
LOSS_TOL_32 = 2e-4  # float32 first step; see tests/loop/test_equality.py
GRAD_NORM_RTOL_32 = 1.5e-4


def _causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """Hugging Face's causal-LM loss (slot t predicts labels[t + 1], summed over the
    targets, divided by Trainer's global count) in the logits' dtype."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    logits = outputs.logits
    total = F.cross_entropy(
        logits.flatten(0, 1), shifted.flatten().to(logits.device), ignore_index=-100, reduction="sum"
    )
    return total / num_items_in_batch


def _run(tmp_path, dataset, collator, *, batch=4, steps=4, seed=0, dtype=torch.float64):
    model = tiny_model(dtype=dtype)
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
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        compute_loss_func=_causal_lm_loss if dtype == torch.float64 else None,
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logged], model, [h["grad_norm"] for h in logged]


def _check32(packed, padded):
    (la,), _, (ga,) = packed
    (lb,), _, (gb,) = padded
    dl, dg = abs(la - lb), abs(ga - gb) / gb
    print(f"float32 step 1: |dloss| {dl:.2e}, |dgrad_norm|/norm {dg:.2e}")
    assert dl <= LOSS_TOL_32 and dg <= GRAD_NORM_RTOL_32, (dl, dg)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_with_packing_collator_equals_padded(samples, tmp_path):
    data = [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples]
    first = PackingCollator(pad_multiple=4)(data[:4])
    assert first["input_ids"].shape[0] == 1  # one packed row
    packed_losses, packed, _ = _run(tmp_path / "a", data, PackingCollator(pad_multiple=4, pad_between_seqs=True))
    padded_losses, padded, _ = _run(tmp_path / "b", data, PaddedCollator())
    assert len(packed_losses) == 4
    dl, dp = max_loss_diff(packed_losses, padded_losses), max_param_diff(packed, padded)
    print(f"float64: max |dloss| {dl:.2e}, max |dparam| {dp:.2e}")
    assert dl <= TOL and dp <= TOL, (dl, dp)
    assert max_param_diff(packed, tiny_model(dtype=torch.float64)) > 1e-3  # it trained
    # The default dtype with Hugging Face's own loss: the first step.
    _check32(
        _run(tmp_path / "c", data, PackingCollator(pad_multiple=4), steps=1, dtype=torch.float32),
        _run(tmp_path / "d", data, PaddedCollator(), steps=1, dtype=torch.float32),
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_on_offline_rows_equals_padded(samples, tmp_path):
    out = prepack_samples(samples, tmp_path / "rows", max_seq_len=128).path
    rows = PrepackedDataset(out)
    packed_losses, packed, _ = _run(tmp_path / "a", rows, RowsCollator(), batch=2, steps=3)

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

    padded_losses, padded, _ = _run(tmp_path / "b", RowConversations(), collate, batch=2, steps=3)
    dl, dp = max_loss_diff(packed_losses, padded_losses), max_param_diff(packed, padded)
    print(f"float64: max |dloss| {dl:.2e}, max |dparam| {dp:.2e}")
    assert dl <= TOL and dp <= TOL, (dl, dp)
    _check32(
        _run(tmp_path / "c", rows, RowsCollator(), batch=2, steps=1, dtype=torch.float32),
        _run(tmp_path / "d", RowConversations(), collate, batch=2, steps=1, dtype=torch.float32),
    )
