"""PackedBatch: the contract's fields, invariants, worked example and adapters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sftpack import IGNORE_INDEX, PackedBatch, Sample
from sftpack.handoff import PackedBatchError
from sftpack.testing import samples_from_lengths

A, B = samples_from_lengths([5, 10])  # ids 1000.. and 2000..


# ---------------------------------------------------------------- worked example
WORKED = [
    # path, kwargs, width, cu_seqlens, cu_seqlens_padded
    ("offline", dict(max_seq_len=16), 16, [0, 5, 15], [0, 5, 16]),
    ("loader", dict(max_seq_len=36, pad_multiple=4), 36, [0, 5, 15], [0, 8, 36]),
    ("trainer", dict(pad_multiple=4), 20, [0, 5, 15], [0, 8, 20]),
]


@pytest.mark.parametrize("path,kwargs,width,cu,cup", WORKED, ids=[w[0] for w in WORKED])
def test_worked_example(path, kwargs, width, cu, cup):
    b = PackedBatch.from_samples([A, B], pad_id=999, **kwargs).validate()  # an id no sample uses
    assert b.num_tokens == width
    assert b.cu_seqlens.tolist() == cu and b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens_padded.tolist() == cup and b.cu_seqlens_padded.dtype == torch.int32
    assert b.max_seqlen == max(np.diff(cup))
    a0, b0 = cup[0], cup[1]
    expect_ids = np.full(width, 999)
    expect_ids[a0 : a0 + 5] = np.arange(1000, 1005)
    expect_ids[b0 : b0 + 10] = np.arange(2000, 2010)
    assert b.input_ids.tolist() == expect_ids.tolist()
    expect_lab = np.full(width, IGNORE_INDEX)
    expect_lab[a0 : a0 + 4] = np.arange(1001, 1005)
    expect_lab[b0 : b0 + 9] = np.arange(2001, 2010)
    assert b.labels.tolist() == expect_lab.tolist()
    expect_pos = np.concatenate([np.arange(cup[1] - cup[0]), np.arange(cup[2] - cup[1])])
    assert b.position_ids.tolist() == expect_pos.tolist()

    # Megatron, both boundary modes
    p = b.to_packed_seq_params(pad_between_seqs=True)
    assert type(p).__module__ == "megatron.core.packed_seq_params"
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == cu and p.cu_seqlens_kv.tolist() == cu
    assert p.cu_seqlens_q_padded.tolist() == cup and p.cu_seqlens_kv_padded.tolist() == cup
    assert p.cu_seqlens_q is not p.cu_seqlens_q_padded
    assert p.max_seqlen_q == p.max_seqlen_kv == b.max_seqlen
    p = b.to_packed_seq_params(pad_between_seqs=False)
    assert p.cu_seqlens_q is p.cu_seqlens_kv is p.cu_seqlens_q_padded is p.cu_seqlens_kv_padded
    assert p.cu_seqlens_q.tolist() == cup

    # Hugging Face
    kw = b.to_hf_kwargs()
    assert kw["input_ids"].shape == kw["labels"].shape == kw["position_ids"].shape == (1, width)
    hf_lab = np.full(width, IGNORE_INDEX)
    hf_lab[a0 + 1 : a0 + 5] = np.arange(1001, 1005)
    hf_lab[b0 + 1 : b0 + 10] = np.arange(2001, 2010)
    assert kw["labels"][0].tolist() == hf_lab.tolist()
    assert kw["cu_seq_lens_q"].tolist() == kw["cu_seq_lens_k"].tolist() == cup
    assert kw["max_length_q"] == kw["max_length_k"] == b.max_seqlen
    assert kw["use_cache"] is False

    # flash-attn
    fa = b.flash_attn_kwargs()
    assert fa["cu_seqlens_q"].tolist() == cup and fa["max_seqlen_k"] == b.max_seqlen


def test_keyword_construction_and_properties():
    b = PackedBatch(
        input_ids=torch.tensor([7, 8, 9, 0]),
        labels=torch.tensor([8, -100, -100, -100]),
        position_ids=torch.tensor([0, 1, 0, 1]),
        cu_seqlens=torch.tensor([0, 2, 3], dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, 2, 4], dtype=torch.int32),
        max_seqlen=2,
    ).validate()
    assert b.num_sequences == 2 and b.num_tokens == 4 and b.num_real_tokens == 3
    assert b.seqlens.tolist() == [2, 1] and b.padded_seqlens.tolist() == [2, 2]
    assert b.loss_mask.tolist() == [True, False, False, False]
    assert b.real_token_mask.tolist() == [True, True, True, False]
    assert b.num_label_tokens == 1


def _good():
    return PackedBatch.from_samples([A, B], pad_multiple=4)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(cu_seqlens=torch.tensor([1, 5, 15], dtype=torch.int32)), "cu_seqlens must start with 0, got 1"),
        (dict(cu_seqlens_padded=torch.tensor([2, 8, 20], dtype=torch.int32)), "cu_seqlens_padded must start"),
        (dict(cu_seqlens=torch.tensor([0, 5, 5], dtype=torch.int32)), "sequence 1 has real length 0"),
        (dict(cu_seqlens=torch.tensor([0, 9, 15], dtype=torch.int32)), "segment 0 has padded length 8 < real length 9"),
        (
            dict(cu_seqlens_padded=torch.tensor([0, 8, 18], dtype=torch.int32)),
            "must equal T = len(input_ids) = 20, got 18",
        ),
        (dict(cu_seqlens=torch.tensor([0, 5, 15])), "cu_seqlens must be int32"),
        (dict(input_ids=torch.zeros(20, dtype=torch.int32)), "input_ids must be int64"),
        (dict(labels=torch.zeros(19, dtype=torch.int64)), "labels has 19 slots but input_ids has T=20"),
        (dict(max_seqlen=11), "max_seqlen = 11 is smaller than the largest padded segment length 12"),
        (dict(position_ids=torch.arange(20)), "position_ids[8] = 8, expected 0"),
        (dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), "both must be N+1 long"),
        (dict(cu_seqlens=torch.tensor([0], dtype=torch.int32)), "at least one sequence"),
        (dict(sequence_ids=(1, 2, 3)), "sequence_ids has 3 entries for N=2"),
    ],
)
def test_validate_names_field_and_numbers(change, message):
    b = _good()
    for k, v in change.items():
        setattr(b, k, v)
    with pytest.raises(PackedBatchError) as e:
        b.validate()
    assert message in str(e.value)


@pytest.mark.parametrize("slot,what", [(4, "last real token"), (6, "padding slot"), (19, "padding slot")])
def test_validate_rejects_labels_crossing_boundaries(slot, what):
    b = _good()
    b.labels[slot] = 2000
    with pytest.raises(PackedBatchError, match=f"labels\\[{slot}\\].*{what}"):
        b.validate()


def test_from_samples_errors():
    with pytest.raises(PackedBatchError, match="at least one sample"):
        PackedBatch.from_samples([])
    with pytest.raises(PackedBatchError, match="take 20 slots .* more than max_seq_len=16"):
        PackedBatch.from_samples([A, B], pad_multiple=4, max_seq_len=16)
    # A width that is not a multiple of the per-sequence pad would leave the last
    # segment (which absorbs the tail) misaligned: refused, with both fixes.
    with pytest.raises(
        PackedBatchError, match="max_seq_len=22 is not a multiple of pad_multiple=4.*use max_seq_len=24 or 20"
    ):
        PackedBatch.from_samples([A, B], pad_multiple=4, max_seq_len=22)
    with pytest.raises(PackedBatchError, match="pad_multiple must be a positive integer"):
        PackedBatch.from_samples([A], pad_multiple=0)
    with pytest.raises(ValueError, match="has no tokens"):
        Sample(np.array([], dtype=np.int64), np.array([], dtype=bool), "empty")


def test_accepts_dicts_and_bare_sequences():
    b = PackedBatch.from_samples([{"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]}, [8, 9]]).validate()
    assert b.labels.tolist() == [-100, 7, -100, 9, -100]


@given(
    lens=st.lists(st.integers(1, 30), min_size=1, max_size=12),
    pad_multiple=st.sampled_from([1, 2, 4, 8]),
    extra=st.integers(0, 9),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_from_samples_properties(lens, pad_multiple, extra, data):
    rng = np.random.default_rng(len(lens) * 31 + extra)
    samples = [Sample(rng.integers(1, 50, n), rng.random(n) < 0.6, i) for i, n in enumerate(lens)]
    padded = [-(-n // pad_multiple) * pad_multiple for n in lens]
    width = sum(padded) + extra * pad_multiple if data.draw(st.booleans()) else None
    b = PackedBatch.from_samples(samples, pad_multiple=pad_multiple, max_seq_len=width, pad_id=0).validate()
    assert b.num_tokens == (width or sum(padded))
    cu = b.cu_seqlens.tolist()
    assert cu == [0, *np.cumsum(lens).tolist()]
    assert all(x < y for x, y in zip(cu, cu[1:]))
    seg = b.padded_seqlens.tolist()
    assert all(p % pad_multiple == 0 for p in seg[:-1])
    assert b.num_real_tokens == sum(lens)
    # Token multiset preserved, and each sample readable back from its segment.
    for s, start in zip(samples, b.cu_seqlens_padded[:-1].tolist()):
        assert b.input_ids[start : start + len(s)].tolist() == s.input_ids.tolist()
    # Supervised label count equals packed and unpacked.
    assert b.num_label_tokens == sum(int(s.loss_mask[1:].sum()) for s in samples)


def test_concat_and_dataloader_collate():
    rows = [PackedBatch.from_samples(samples_from_lengths(ls), max_seq_len=8) for ls in ([3, 4], [8], [1, 1, 1])]
    b = PackedBatch.concat(rows).validate()
    assert b.cu_seqlens.tolist() == [0, 3, 7, 15, 16, 17, 18]
    assert b.cu_seqlens_padded.tolist() == [0, 3, 8, 16, 17, 18, 24]
    assert b.max_seqlen == 8
    assert b.sequence_ids == (0, 1, 0, 0, 1, 2)
    loader = torch.utils.data.DataLoader(rows, batch_size=3, collate_fn=PackedBatch.concat)
    (batch,) = list(loader)
    assert torch.equal(batch.input_ids, b.input_ids) and torch.equal(batch.cu_seqlens_padded, b.cu_seqlens_padded)


def test_to_device_moves_every_tensor():
    b = _good().to("meta")
    assert all(
        t.device.type == "meta" for t in (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.cu_seqlens_padded)
    )
    mixed = _good()
    mixed.labels = mixed.labels.to("meta")
    with pytest.raises(PackedBatchError, match="several devices"):
        mixed.validate()


# ------------------------------------------------------------------- media fields
IMG = 151655  # Qwen2-VL's <|image_pad|>


def _mm_rows():
    """Rows of samples with Qwen2-VL-shaped media (tests/handoff/test_payload.py's ``_patch_sample``)."""
    from tests.handoff.test_payload import _patch_sample

    a = _patch_sample(0, [1, 2], [(1, 4, 4)])
    b = _patch_sample(1, [1], [(1, 2, 4), (2, 2, 2)])
    c = _patch_sample(2, [5, 6, 7], [])
    return (
        PackedBatch.from_samples([a, b], pad_multiple=4, pad_id=151643),
        PackedBatch.from_samples([c], max_seq_len=8, pad_id=151643),
    )


def test_a_text_row_carries_no_media_and_its_hf_kwargs_are_unchanged():
    b = PackedBatch.from_samples([A, B], pad_multiple=4).validate()
    assert not b.has_media and b.num_media_items == 0 and b.media is None
    kw = b.to_hf_kwargs()
    assert kw["position_ids"].shape == (1, 20) and "pixel_values" not in kw and "image_grid_thw" not in kw
    assert not PackedBatch.concat([b, b]).has_media


def test_a_media_row_validates_moves_and_gives_qwen2vl_kwargs():
    ab, c = _mm_rows()
    ab.validate()
    c.validate()
    assert ab.has_media and ab.num_media_items == 3 and c.has_media and c.num_media_items == 0
    m = ab.media
    assert m.vision_cu_seqlens.tolist() == [0, 16, 24, 28, 32]  # the (2, 2, 2) image: one segment per frame
    assert m.vision_cu_seqlens.dtype == torch.int32
    assert m.slots.tolist() == [[2, 4], [13, 2], [16, 2]] and m.sequence.tolist() == [0, 1, 1]
    kw = ab.to_hf_kwargs()
    assert kw["position_ids"].shape == (4, 1, ab.num_tokens)
    assert kw["position_ids"][0, 0].tolist() == ab.position_ids.tolist()
    assert torch.equal(kw["position_ids"][1:, 0], m.positions)
    assert kw["pixel_values"] is m.pixel_values and kw["image_grid_thw"] is m.grid_thw
    assert "pixel_values" not in c.to_hf_kwargs()  # no images: positions only
    moved = ab.to("cpu")
    assert all(torch.equal(getattr(moved.media, n), getattr(m, n)) for n in ("pixel_values", "slots"))
    assert moved.media.token_id == IMG and moved.media.merge_size == 2


def test_media_rows_concatenate_with_shifted_offsets_also_after_a_row_without_images():
    ab, c = _mm_rows()
    run = PackedBatch.concat([c, ab, c, ab]).validate()
    T, Tc = ab.num_tokens, c.num_tokens
    m = run.media
    assert run.num_media_items == 6 and m.pixel_values.shape[0] == 2 * ab.media.pixel_values.shape[0]
    assert m.slots[:, 0].tolist() == [s + Tc for s in ab.media.slots[:, 0].tolist()] + [
        s + 2 * Tc + T for s in ab.media.slots[:, 0].tolist()
    ]
    assert m.sequence.tolist() == [1, 2, 2, 4, 5, 5]
    assert m.vision_cu_seqlens.tolist() == [0, 16, 24, 28, 32, 48, 56, 60, 64]
    assert torch.equal(m.positions[:, Tc : Tc + T], ab.media.positions)
    with pytest.raises(PackedBatchError, match="row 1 has no media"):
        PackedBatch.concat([ab, PackedBatch.from_samples([A])])


def _media(b, **kw):
    import dataclasses

    return dataclasses.replace(b, media=dataclasses.replace(b.media, **kw))


def _grid_as_int32(b):
    """A grid of the wrong dtype (set on a copy after construction, which would cast it)."""
    out = _media(b)
    out.media.grid_thw = out.media.grid_thw.int()
    return out


def _ids(b, ids):
    import dataclasses

    return dataclasses.replace(b, input_ids=ids)


# The media is one object: its fields cannot be half set (``image_slots=None`` beside the rest), and
# the tower's boundaries are the grids' own (``vision_cu_seqlens`` cannot disagree with them). What
# can still be wrong is each field against the others and against the row, and each is named.
@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda b: _media(b, grid_thw=b.media.grid_thw[1:]), r"media\.grid_thw must have shape \(3, 3\)"),
        (lambda b: _media(b, positions=b.media.positions[:, 1:]), r"media\.positions must have shape"),
        (_grid_as_int32, r"media\.grid_thw must be torch\.int64"),
        (lambda b: _media(b, pixel_values=b.media.pixel_values.long()), "pixel_values must be floating"),
        (lambda b: _media(b, pixel_values=b.media.pixel_values[1:]), "pixel_values has 31 patches"),
        (lambda b: _media(b, sequence=b.media.sequence[1:]), r"media\.sequence must have shape \(3,?\), got \(2,\)"),
        (lambda b: _media(b, merge_size=1), r"media\.slots\[0\] has 4 placeholders"),
        (lambda b: _media(b, slots=b.media.slots + torch.tensor([1, 0])), r"media\.slots\[0\] = \[3, 7\)"),
        (lambda b: _media(b, sequence=torch.tensor([1, 1, 1])), r"media\.slots\[0\].*segment 1"),
        (lambda b: _media(b, slots=b.media.slots.flip(0)), "row order"),
        (lambda b: _media(b, positions=b.media.positions + 1), "restart at 0"),
        (lambda b: _ids(b, b.input_ids.index_fill(0, torch.tensor([9]), IMG)), r"slot 9 holds the placeholder"),
    ],
    ids=[
        "grid-count",
        "mrope-shape",
        "grid-dtype",
        "pv-dtype",
        "patch-count",
        "sequence-count",
        "merge",
        "slot-off",
        "wrong-segment",
        "order",
        "mrope-restart",
        "stray-placeholder",
    ],
)
def test_validate_names_the_wrong_media_field(edit, match):
    ab, _ = _mm_rows()
    with pytest.raises(PackedBatchError, match=match):
        edit(ab).validate()
