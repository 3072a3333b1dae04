"""The trainer path with images: a padded multimodal batch packed at the step.

(1) ``pack_media_step(collate_media(samples))`` is field for field the row
``build_multimodal_row(samples)`` builds (text, MRoPE positions, patches, grids, image
runs, vision boundaries), for several pad multiples and a fixed row width.
(2) Exactness on the tiny float64 Qwen2-VL of tests/multimodal: the row packed from the
padded batch computes each sample alone (logits, token-mean loss, gradients of the
language model and of the vision tower), both boundary modes.
(3) Negative controls: a collator's bugs (1-D positions; positions counted through the
batch instead of restarting per sample; the images in the wrong order) are refused by
``validate()`` / ``pack_media_step`` or fail the comparison.

Tolerance: TOL = 1e-10 in float64, the derivation of tests/multimodal/test_exactness.py
(same six easy-vqa samples, same model: the longest rounding chain n <= 4,000, so each
run is off by <= n*u = 4.4e-13 relative, two runs 8.9e-13, on logits and gradients of
magnitude <= 10, asserted: <= 8.9e-12; 1e-10 is 11x that). BUG = 1e-4 as there: what a
wrong position or a wrong image moves something by, at least (1e6 x TOL).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("easy_vqa")
pytest.importorskip("PIL")

from sftpack.handoff import PackedBatchError  # noqa: E402
from sftpack.multimodal import (  # noqa: E402
    build_multimodal_row,
    check_packed,
    image_processor,
    qwen2vl_tokenizer,
    tokenize_multimodal_conversations,
    vqa_corpus,
)
from sftpack.trainer import PaddedMediaBatch, collate_media, pack_media_step  # noqa: E402
from tests.multimodal.conftest import Renumbered  # noqa: E402

TOL = 1e-10  # float64; the derivation of tests/multimodal/test_exactness.py (see the docstring)
BUG = 1e-4  # a wrong position or image moves something by at least this (1e6 x TOL)


@pytest.fixture(scope="module")
def renumbered():
    convs = list(vqa_corpus(seed=2, limit=6, min_side=56, max_side=112))
    got = list(tokenize_multimodal_conversations(convs, tokenizer=qwen2vl_tokenizer(), processor=image_processor()))
    return Renumbered(got)


@pytest.fixture(scope="module")
def model(renumbered):
    return renumbered.model()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("source_rows", "source_batch_size"):
            continue  # the trainer path records where each segment came from; a built row has no source batch
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("pad_multiple, width", [(1, None), (4, None), (4, 600)])
def test_packed_from_padded_is_the_built_row(renumbered, pad_multiple, width):
    items = renumbered.samples
    padded = collate_media(items, pad_id=renumbered.pad_id)
    assert padded.input_ids.shape == (len(items), max(len(s) for s in items))
    assert padded.num_images == sum(s.num_images for s in items) >= 8
    got = padded.pack(pad_multiple=pad_multiple, pad_to=width, pad_id=renumbered.pad_id).validate()
    want = build_multimodal_row(items, pad_multiple=pad_multiple, row_width=width, pad_id=renumbered.pad_id)
    assert type(got) is type(want)
    _same(got, want)
    assert got.source_rows == tuple(range(len(items)))


def _from_padded(renumbered, pad_multiple, edit=None):
    """A tamper for check_packed: the row it built replaced by the trainer path's row from the padded batch."""

    def swap(built):
        padded = collate_media(renumbered.samples, pad_id=renumbered.pad_id)
        if edit is not None:
            padded = edit(padded)
        row = padded.pack(pad_multiple=pad_multiple, pad_id=renumbered.pad_id)
        if edit is None:
            row.validate()
            assert torch.equal(row.input_ids, built.input_ids) and torch.equal(row.labels, built.labels)
        return row

    return swap


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_packed_from_padded_equals_each_sample_alone(renumbered, model, pad_between_seqs, pad_multiple):
    r = check_packed(
        model,
        renumbered.samples,
        pad_between_seqs=pad_between_seqs,
        pad_multiple=pad_multiple,
        pad_id=renumbered.pad_id,
        tamper=_from_padded(renumbered, pad_multiple),
    )
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r  # the premise of TOL
    assert r.within(TOL), r


def _one_d(p: PaddedMediaBatch) -> PaddedMediaBatch:
    """The collator's bug: plain 1-D positions (restarting per sample) in the three MRoPE rows."""
    S = p.input_ids.shape[1]
    return dataclasses.replace(p, mrope_position_ids=torch.arange(S).expand(3, p.input_ids.shape[0], S).clone())


def _not_restarted(p: PaddedMediaBatch) -> PaddedMediaBatch:
    """The collator's bug: each row's positions continue from the previous row's (one sequence)."""
    m = p.mrope_position_ids.clone()
    lengths = p.attention_mask.sum(1).tolist()
    off = 0
    for b, L in enumerate(lengths):
        top = int(m[:, b, :L].max()) + 1
        m[:, b] += off
        off += top
    return dataclasses.replace(p, mrope_position_ids=m)


def _media_reversed(p: PaddedMediaBatch) -> PaddedMediaBatch:
    """The collator's bug: the images in the wrong order (each image's patches still with its grid)."""
    grid = p.image_grid_thw
    blocks = list(torch.split(p.pixel_values, grid.prod(-1).tolist()))
    return dataclasses.replace(p, pixel_values=torch.cat(blocks[::-1]), image_grid_thw=grid.flip(0))


def test_negative_control_1d_positions_fails(renumbered, model):
    r = check_packed(model, renumbered.samples, pad_id=renumbered.pad_id, tamper=_from_padded(renumbered, 1, _one_d))
    assert max(r.logits, r.loss, r.grads_language, r.grads_vision) > BUG, r


def test_negative_control_positions_not_restarted_is_refused_and_fails(renumbered, model):
    padded = _not_restarted(collate_media(renumbered.samples, pad_id=renumbered.pad_id))
    with pytest.raises(PackedBatchError, match="restart at 0"):
        padded.pack(pad_id=renumbered.pad_id).validate()
    # unchecked, it computes something else: with boundaries from cu_seqlens a constant shift per
    # sample shows only through the model's float32 rotary angles (tests/multimodal/test_exactness.py)
    r = check_packed(
        model, renumbered.samples, pad_id=renumbered.pad_id, tamper=_from_padded(renumbered, 1, _not_restarted)
    )
    assert not r.within(TOL), r


def test_negative_control_media_reversed_is_refused(renumbered):
    padded = _media_reversed(collate_media(renumbered.samples, pad_id=renumbered.pad_id))
    with pytest.raises(PackedBatchError, match="not in the order of the images|not a run"):
        padded.pack(pad_id=renumbered.pad_id).validate()


def test_bad_batches_are_named(renumbered):
    padded = collate_media(renumbered.samples[:2], pad_id=renumbered.pad_id)
    with pytest.raises(PackedBatchError, match="grids give"):
        pack_media_step(
            padded.input_ids,
            padded.attention_mask,
            padded.labels,
            padded.mrope_position_ids,
            padded.pixel_values,
            padded.image_grid_thw[:-1],
            image_token_id=padded.image_token_id,
            pad_id=renumbered.pad_id,
        )
    with pytest.raises(PackedBatchError, match="mrope_position_ids has shape"):
        pack_media_step(
            padded.input_ids,
            padded.attention_mask,
            padded.labels,
            padded.mrope_position_ids[:2],
            padded.pixel_values,
            padded.image_grid_thw,
            image_token_id=padded.image_token_id,
            pad_id=renumbered.pad_id,
        )
    with pytest.raises(ValueError, match="pad_id"):
        collate_media(renumbered.samples, pad_id=padded.image_token_id)
