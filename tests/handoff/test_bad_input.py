"""Bad input to the handoff's builders and validation: a clear error naming the
field and the value, never a silent conversion (issue 9, validation gaps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sftpack import IGNORE_INDEX, PackedBatch, Sample
from sftpack.handoff import PackedBatchError, build_row
from sftpack.testing import samples_from_lengths
from sftpack.trainer import pack_step


@pytest.mark.parametrize(
    "ids, message",
    [
        ([1.9, 2.9], "must be integers, got dtype float64"),
        ([[1, 2], [3, 4]], r"must be 1-D .* got shape \(2, 2\)"),
        (["a", "b"], "must be integers"),
        ([2**64 - 1], "does not fit in int64"),
        ([2**70], "does not fit in int64"),
        ([True, False], "must be integers"),
    ],
)
def test_from_samples_refuses_ids_it_would_change(ids, message):
    with pytest.raises(ValueError, match=message):
        PackedBatch.from_samples([ids])
    with pytest.raises(ValueError, match=message):
        PackedBatch.from_samples([{"input_ids": ids, "conversation_id": "c7"}])


def test_uint64_ids_that_fit_are_kept_exactly():
    b = PackedBatch.from_samples([np.array([7, 2**40], dtype=np.uint64)])
    assert b.input_ids.tolist() == [7, 2**40]


@pytest.mark.parametrize("pad_id", [0.5, None, "0", True])
def test_pad_id_must_be_an_integer(pad_id):
    with pytest.raises(PackedBatchError, match="pad_id must be a non-negative integer, got"):
        PackedBatch.from_samples(samples_from_lengths([3]), pad_id=pad_id)
    with pytest.raises(PackedBatchError, match="pad_id must be a non-negative integer, got"):
        pack_step(torch.ones(1, 4, dtype=torch.long), [3], pad_id=pad_id)


def test_loss_mask_values_are_checked():
    with pytest.raises(ValueError, match="loss_mask must hold only 0/1"):
        Sample(np.arange(3), np.array([0, 2, 1]), "c")
    with pytest.raises(ValueError, match="loss_mask must be bool"):
        Sample(np.arange(3), np.array([0.5, 1.0, 0.0]), "c")


def test_build_row_checks_sizes_and_dtypes():
    with pytest.raises(PackedBatchError, match="lengths add up to 5 tokens but input_ids holds 4"):
        build_row(np.arange(4), np.ones(4, bool), [2, 3])
    with pytest.raises(PackedBatchError, match=r"lengths\[1\] = 0"):
        build_row(np.arange(4), np.ones(4, bool), [4, 0])
    with pytest.raises(PackedBatchError, match="input_ids must hold integers"):
        build_row(np.arange(4.0), np.ones(4, bool), [4])
    with pytest.raises(PackedBatchError, match="loss_mask has shape"):
        build_row(np.arange(4), np.ones(3, bool), [4])
    with pytest.raises(PackedBatchError, match="sequence_ids has 1 entries for 2 sequences"):
        build_row(np.arange(4), np.ones(4, bool), [2, 2], sequence_ids=["a"])


def _row() -> PackedBatch:
    return PackedBatch.from_samples(samples_from_lengths([3, 4]), pad_multiple=2)


@pytest.mark.parametrize("value", [None, 4.0, "8", True])
def test_validate_max_seqlen_type(value):
    b = _row()
    b.max_seqlen = value
    with pytest.raises(PackedBatchError, match="max_seqlen must be an int"):
        b.validate()


def test_validate_label_must_be_next_token_or_ignore():
    b = _row()
    assert b.labels[0] != IGNORE_INDEX
    b.labels[0] = -7  # would crash cross-entropy much later
    with pytest.raises(PackedBatchError, match=r"labels\[0\] = -7 but the next token input_ids\[1\] is 1001"):
        b.validate()
    b = _row()
    b.labels[0] = 1002  # a real id, but not the next one
    with pytest.raises(PackedBatchError, match=r"labels\[0\] = 1002"):
        b.validate()


@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("n", [1, 3, 40])
def test_build_row_copy_strategies_agree(monkeypatch, n, pad_multiple):
    """build_row lays rows by one block copy, slice copies or a scatter depending on the
    sequences; every strategy gives the same row, which validates."""
    import sftpack.handoff.layout as layout

    rng = np.random.default_rng(n * 7 + pad_multiple)
    lengths = rng.integers(1, 30, n)
    ids = rng.integers(0, 50_000, int(lengths.sum())).astype(np.int32)
    mask = rng.random(int(lengths.sum())) < 0.6
    width = int((-(-lengths // pad_multiple) * pad_multiple).sum()) + 2 * pad_multiple
    rows = []
    for limit in (0, 10_000):
        monkeypatch.setattr(layout, "_SLICE_COPY_MAX", limit)
        rows.append(build_row(ids, mask, lengths, max_seq_len=width, pad_multiple=pad_multiple).validate())
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        assert torch.equal(getattr(rows[0], name), getattr(rows[1], name)), name
    # and the labels are what the contract says: next token where it is trainable, same sequence
    start = 0
    cup = rows[0].cu_seqlens_padded.tolist()
    for i, L in enumerate(lengths.tolist()):
        seq_ids, seq_mask = ids[start : start + L], mask[start : start + L]
        want = [int(seq_ids[j + 1]) if seq_mask[j + 1] else IGNORE_INDEX for j in range(L - 1)] + [IGNORE_INDEX]
        assert rows[0].labels[cup[i] : cup[i] + L].tolist() == want
        start += L


# ---------------------------------------------------------------- negative ids (issue 16, item 10)
# The prepack path refuses ids outside [0, 2**32) at staging; the row builders and validate()
# refuse negative ids and pad ids the same way: an embedding has no row for them.
def test_build_row_refuses_a_negative_token_id_naming_the_sequence():
    ids = np.array([5, 6, 7, 8, -3, 9])
    with pytest.raises(
        PackedBatchError,
        match=r"build_row: sequence 1, id 'b' holds token id -3 at input position 4: "
        r"token ids must be non-negative",
    ):
        build_row(ids, np.ones(6, bool), [3, 3], max_seq_len=8, sequence_ids=["a", "b"])
    with pytest.raises(PackedBatchError, match=r"build_row: sequence 0 holds token id -1 at input position 0"):
        build_row(np.array([-1, 4]), np.ones(2, bool), [2], max_seq_len=4)  # no sequence ids given: none named
    with pytest.raises(PackedBatchError, match=r"sequence 1, id 'c7' holds token id -2 at input position 3"):
        PackedBatch.from_samples([[1, 2], {"input_ids": [3, -2], "conversation_id": "c7"}])
    # the same ids, non-negative, build (the check is not a blanket refusal)
    build_row(np.abs(ids), np.ones(6, bool), [3, 3], max_seq_len=8, sequence_ids=["a", "b"]).validate()


@pytest.mark.parametrize("pad_id", [-1, -100, np.int64(-7)])
def test_a_negative_pad_id_is_refused_by_every_row_builder(pad_id):
    msg = (
        rf"pad_id must be a non-negative integer, got \S*{int(pad_id)}\S*; padding slots are fed to the embedding.*>= 0"
    )
    with pytest.raises(PackedBatchError, match="build_row: " + msg):
        build_row(np.arange(1, 4), np.ones(3, bool), [3], max_seq_len=4, pad_id=pad_id)
    with pytest.raises(PackedBatchError, match="build_row: " + msg):
        PackedBatch.from_samples(samples_from_lengths([3]), pad_id=pad_id)
    with pytest.raises(PackedBatchError, match="pack_step: " + msg):
        pack_step(torch.ones(1, 4, dtype=torch.long), [3], pad_id=pad_id)


def test_validate_refuses_a_negative_id_naming_the_slot_and_segment():
    good = PackedBatch.from_samples(samples_from_lengths([3, 2]), max_seq_len=8).validate()
    for slot, what in ((6, "segment 1"), (1, "segment 0")):
        bad = good.to("cpu")
        bad.input_ids = good.input_ids.clone()
        bad.input_ids[slot] = -1  # a padding slot (6) or a real token (1), labels left as they were
        with pytest.raises(
            PackedBatchError,
            match=rf"PackedBatch.input_ids\[{slot}\] = -1 \({what}\): token ids, "
            r"padding included, must be non-negative",
        ):
            bad.validate()
