"""The trainer path with images: a padded batch of samples with media packed at the step.

(1) ``pack_step(*padded_batch(samples), media=[s.media for s in samples])`` is field for
field the row ``PackedBatch.from_samples(samples)`` builds (text, and the media: MRoPE
positions, patches, grids, image runs, vision boundaries), for several pad multiples and
a fixed row width.
(2) Exactness on the tiny float64 Qwen2-VL of tests/multimodal: the row packed from the
padded batch computes each sample alone (logits, token-mean loss, gradients of the
language model and of the vision tower), both boundary modes.
(3) Negative controls: a collator's bugs (1-D positions; positions counted through the
batch instead of restarting per sample; the media in the wrong order) are refused by
``validate()`` / ``pack_step`` or fail the comparison.

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

from sftpack.handoff import PackedBatch, PackedBatchError  # noqa: E402
from sftpack.multimodal import check_packed, family_for, tokenize_media_conversations, vqa_corpus  # noqa: E402
from sftpack.trainer import pack_step, padded_batch  # noqa: E402
from tests.multimodal.conftest import Renumbered  # noqa: E402

TOL = 1e-10  # float64; the derivation of tests/multimodal/test_exactness.py (see the docstring)
BUG = 1e-4  # a wrong position or image moves something by at least this (1e6 x TOL)


@pytest.fixture(scope="module")
def renumbered():
    convs = list(vqa_corpus(seed=2, limit=6, min_side=56, max_side=112))
    family = family_for()
    got = list(tokenize_media_conversations(convs, tokenizer=family.tokenizer(), processor=family.image_processor()))
    return Renumbered(got)


@pytest.fixture(scope="module")
def model(renumbered):
    return renumbered.model()


def _same(a, b, where: str = "") -> None:
    assert type(a) is type(b), where
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("source_rows", "source_batch_size"):
            continue  # the trainer path records where each segment came from; a built row has no source batch
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where + f.name
        elif dataclasses.is_dataclass(x):  # the media: one object, compared field for field
            _same(x, y, f"{where}{f.name}.")
        else:
            assert x == y, where + f.name


class Padded:
    """What a collator hands the step for samples with media: the padded batch (``padded_batch``)
    and one media entry per row (``sample.media``)."""

    def __init__(self, samples, pad_id: int, media=None) -> None:
        self.ids, self.lengths, self.mask = padded_batch(samples, pad_id=pad_id)
        self.media = [s.media for s in samples] if media is None else media
        self.sequence_ids = [s.conversation_id for s in samples]

    def pack(self, **kw):
        return pack_step(self.ids, self.lengths, self.mask, media=self.media, sequence_ids=self.sequence_ids, **kw)


@pytest.mark.parametrize("pad_multiple, width", [(1, None), (4, None), (4, 600)])
def test_packed_from_padded_is_the_built_row(renumbered, pad_multiple, width):
    items = renumbered.samples
    padded = Padded(items, renumbered.pad_id)
    assert padded.ids.shape == (len(items), max(len(s) for s in items))
    got = padded.pack(pad_multiple=pad_multiple, max_seq_len=width, pad_id=renumbered.pad_id).validate()
    assert got.num_media_items == sum(s.media.num_items for s in items) >= 8
    want = PackedBatch.from_samples(items, pad_multiple=pad_multiple, max_seq_len=width, pad_id=renumbered.pad_id)
    assert type(got) is type(want) and want.media is not None
    _same(got, want)
    assert torch.equal(got.media.vision_cu_seqlens, want.media.vision_cu_seqlens)
    assert got.source_rows == tuple(range(len(items)))


def test_rows_without_media_and_empty_rows(renumbered):
    """A text-only sample among samples with images (its positions 1-D) and an empty padded row
    (skipped): still the built row of the non-empty samples."""
    items = renumbered.samples[:3]
    text = dataclasses.replace(items[1], media=None)
    text_ids = text.input_ids.copy()
    text_ids[text_ids == renumbered.id(151655)] = renumbered.pad_id + 1  # no placeholder left in the text sample
    text = type(text)(text_ids, text.loss_mask, "text-only")
    samples = [items[0], text, items[2]]
    padded = Padded(samples, renumbered.pad_id)
    got = padded.pack(pad_multiple=4, pad_id=renumbered.pad_id).validate()
    _same(got, PackedBatch.from_samples(samples, pad_multiple=4, pad_id=renumbered.pad_id))
    empty = Padded(samples, renumbered.pad_id)
    empty.lengths[1] = 0
    empty.mask[1] = False
    empty.media[1] = None
    row = empty.pack(pad_id=renumbered.pad_id).validate()
    _same(row, PackedBatch.from_samples([samples[0], samples[2]], pad_id=renumbered.pad_id))
    assert row.source_rows == (0, 2)


def _from_padded(renumbered, pad_multiple, edit=None):
    """A tamper for check_packed: the row it built replaced by the trainer path's row from the padded batch."""

    def swap(built):
        padded = Padded(renumbered.samples, renumbered.pad_id)
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


def _with_positions(p: Padded, positions) -> Padded:
    p.media = [dataclasses.replace(m, positions=q) for m, q in zip(p.media, positions)]
    return p


def _one_d(p: Padded) -> Padded:
    """The collator's bug: plain 1-D positions (restarting per sample) in the three MRoPE rows."""
    return _with_positions(p, [torch.arange(m.positions.shape[1]).expand(3, -1).clone() for m in p.media])


def _not_restarted(p: Padded) -> Padded:
    """The collator's bug: each row's positions continue from the previous row's (one sequence)."""
    out, off = [], 0
    for m in p.media:
        out.append(m.positions + off)
        off += int(m.positions.max()) + 1
    return _with_positions(p, out)


def _media_reversed(p: Padded) -> Padded:
    """The collator's bug: the rows' media in the wrong order (each sample's images with another row)."""
    p.media = p.media[::-1]
    return p


def test_negative_control_1d_positions_fails(renumbered, model):
    r = check_packed(model, renumbered.samples, pad_id=renumbered.pad_id, tamper=_from_padded(renumbered, 1, _one_d))
    assert max(r.logits, r.loss, r.grads["language"], r.grads["vision"]) > BUG, r


def test_negative_control_positions_not_restarted_is_refused_and_fails(renumbered, model):
    padded = _not_restarted(Padded(renumbered.samples, renumbered.pad_id))
    with pytest.raises(PackedBatchError, match="restart at 0"):
        padded.pack(pad_id=renumbered.pad_id).validate()
    # unchecked, it computes something else: with boundaries from cu_seqlens a constant shift per
    # sample shows only through the model's float32 rotary angles (tests/multimodal/test_exactness.py)
    r = check_packed(
        model, renumbered.samples, pad_id=renumbered.pad_id, tamper=_from_padded(renumbered, 1, _not_restarted)
    )
    assert not r.within(TOL), r


def test_negative_control_media_reversed_is_refused(renumbered):
    padded = _media_reversed(Padded(renumbered.samples, renumbered.pad_id))
    with pytest.raises(PackedBatchError, match="positions has shape|not a run|placeholders but"):
        padded.pack(pad_id=renumbered.pad_id).validate()


def test_bad_batches_are_named(renumbered):
    padded = Padded(renumbered.samples[:2], renumbered.pad_id)
    with pytest.raises(PackedBatchError, match="media has 1 entries for a batch of B=2 rows"):
        pack_step(padded.ids, padded.lengths, padded.mask, media=padded.media[:1], pad_id=renumbered.pad_id)
    short = [dataclasses.replace(m, positions=m.positions[:, :-1]) for m in padded.media]
    with pytest.raises(PackedBatchError, match=r"media\[0\]\.positions has shape"):
        pack_step(padded.ids, padded.lengths, padded.mask, media=short, pad_id=renumbered.pad_id)
    with pytest.raises(PackedBatchError, match="pad_id"):
        pack_step(*padded_batch(renumbered.samples[:2]), media=padded.media, pad_id=padded.media[0].token_id)
    with pytest.raises(PackedBatchError, match="a sequence of B=2"):
        pack_step(padded.ids, padded.lengths, padded.mask, media=padded.media[0], pad_id=renumbered.pad_id)
