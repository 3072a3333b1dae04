"""The heart: a packed multimodal row equals each sample run alone on a tiny Qwen2-VL, in float64.

Packed: one row of several easy-vqa samples (one or two images each, runs of 4 to 16
placeholders), the vision tower over the row's per-image ``vision_cu_seqlens``, the
language model over sftpack's varlen training attention with the row's per-sample MRoPE
positions. Alone: each sample through Hugging Face's own path (the model computes its
MRoPE positions with ``get_rope_index`` and runs its vision tower). Compared: logits of
every real token, the token-mean loss (one shared count of targets), and the gradient
of every parameter of the language model and of the vision tower.

Tolerance, fixed: 1e-10 in float64 (u = 2**-53 = 1.1e-16). Both runs compute the same
function; only summation orders may differ, and an n-term sum in any order is off by at
most n*u of its terms' magnitude sum (Higham, Accuracy and Stability, section 3.1). The
longest chain of roundings in one forward and backward pass here is n <= 4,000 (the
patch embedding's 1,176-term dot products, then width 32 over 2 vision and 2 text
layers, segments <= 90 tokens, <= 30 logits per row over <= 110 ids, <= 300 patches per
image), so each run is off by <= 4.4e-13 relative, the two by <= 8.9e-13, on logits
and gradients of magnitude <= 10 (asserted): <= 8.9e-12; 1e-10 is 11x that (observed:
below 1e-15). The rotary angles are computed in float32 by the model from the integer
positions: identical positions give identical angles in both runs, so they add nothing,
and a position that differs shows at the float32 level (the first negative control).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sftpack import PackedBatch
from sftpack.multimodal import check_packed, family_for
from sftpack.multimodal.families.qwen2_vl import mrope_positions
from sftpack.sample import IGNORE_INDEX

TOL = 1e-10  # float64; see the docstring
# What a wrong image, a wrong position or a crossing label moves something by, at least:
# 1e6 x TOL, far above any rounding (observed: 1e-3 to 0.6; the smallest, 1-D positions, moves
# only the rotary dimensions the MRoPE sections give to height and width, 2 of 8 here).
BUG = 1e-4


def _width(items, pad_multiple, extra):
    return sum(-(-len(s) // pad_multiple) * pad_multiple for s in items) + extra if extra else None


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
@pytest.mark.parametrize("pad_multiple, extra", [(1, 0), (4, 8)])
def test_packed_equals_alone(renumbered, model, pad_between_seqs, pad_multiple, extra):
    """sftpack's varlen attention, boundaries from cu_seqlens, both boundary modes."""
    items = renumbered.samples
    width = _width(items, pad_multiple, extra)
    r = check_packed(
        model,
        items,
        pad_between_seqs=pad_between_seqs,
        pad_multiple=pad_multiple,
        row_width=width,
        pad_id=renumbered.pad_id,
    )
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r  # the premise of TOL
    assert r.within(TOL), r
    assert sum(s.media.num_items for s in items) >= 8


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
def test_two_fixed_width_rows_in_one_run_equal_alone(renumbered, model, pad_between_seqs):
    """Two rows of a fixed width (tail padding folded into each row's last segment) laid end to end."""
    items = renumbered.samples
    width = max(_width(items[:3], 4, 12), _width(items[3:], 4, 12))
    r = check_packed(
        model,
        items,
        pad_between_seqs=pad_between_seqs,
        pad_multiple=4,
        row_width=width,
        rows=2,
        pad_id=renumbered.pad_id,
    )
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r
    assert r.within(TOL), r


@pytest.mark.parametrize("pad_multiple, extra", [(1, 0), (4, 8)])
def test_packed_equals_alone_with_hf_boundaries_from_positions(renumbered, sdpa_model, pad_multiple, extra):
    """Hugging Face's sdpa, given only the (4, 1, T) positions: it finds the boundaries where the
    text position row restarts, so the row's text positions carry them for kernels without cu_seqlens."""
    items = renumbered.samples
    r = check_packed(
        sdpa_model,
        items,
        pad_multiple=pad_multiple,
        row_width=_width(items, pad_multiple, extra),
        pad_id=renumbered.pad_id,
    )
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r
    assert r.within(TOL), r


def _as_one_sequence(b: PackedBatch) -> PackedBatch:
    """The bug: positions of the whole row as one sequence (never restarted): the model's rope
    rule over the row, and a text position row counting straight through."""
    m = b.media
    pos = torch.from_numpy(mrope_positions(b.num_tokens, m.slots.numpy(), m.grid_thw.numpy(), m.merge_size))
    return dataclasses.replace(b, media=dataclasses.replace(m, positions=pos), position_ids=torch.arange(b.num_tokens))


def _one_d(b: PackedBatch) -> PackedBatch:
    """The bug: plain 1-D positions (restarting per sample) in all three MRoPE rows; the grids ignored."""
    return dataclasses.replace(b, media=dataclasses.replace(b.media, positions=b.position_ids.expand(3, -1).clone()))


def _media_reversed(b: PackedBatch) -> PackedBatch:
    """The bug: the images in the wrong order (each image's patches still with its own grid; the
    tower's per-image boundaries follow the grids)."""
    m = b.media
    grid = m.grid_thw
    per = (grid[:, 0] * grid[:, 1] * grid[:, 2]).tolist()
    blocks = list(torch.split(m.pixel_values, per))
    return dataclasses.replace(
        b, media=dataclasses.replace(m, pixel_values=torch.cat(blocks[::-1]), grid_thw=grid.flip(0))
    )


def _label_across(b: PackedBatch) -> PackedBatch:
    """The bug: the last real token of the first sample is trained to predict the next sample's first token."""
    t = b
    labels = t.labels.clone()
    last = int(t.cu_seqlens[1]) - 1
    assert int(t.labels[last]) == IGNORE_INDEX
    labels[last] = t.input_ids[int(t.cu_seqlens_padded[1])]
    return dataclasses.replace(b, labels=labels)


CONTROLS = [_as_one_sequence, _one_d, _media_reversed, _label_across]
IDS = ["positions-not-restarted", "positions-1d", "media-reversed", "label-across-boundary"]


@pytest.mark.parametrize("tamper", CONTROLS, ids=IDS)
def test_negative_controls_fail_with_hf_boundaries(renumbered, sdpa_model, tamper):
    r = check_packed(sdpa_model, renumbered.samples, pad_id=renumbered.pad_id, tamper=tamper)
    assert max(r.logits, r.loss, r.grads["language"], r.grads["vision"]) > BUG, r


@pytest.mark.parametrize("tamper", CONTROLS, ids=IDS)
def test_negative_controls_fail_with_sftpack_attention(renumbered, model, tamper):
    """With boundaries from cu_seqlens, positions that do not restart shift each sample's positions
    by a constant, which RoPE cannot see in exact arithmetic (its scores depend on position
    differences): that control fails only through the model's float32 rotary angles (observed
    2.5e-9, 25x TOL). It is the other kernels, which read boundaries from positions, that it
    breaks outright (the test above). The other controls fail by more than BUG here too."""
    r = check_packed(model, renumbered.samples, pad_id=renumbered.pad_id, tamper=tamper)
    assert not r.within(TOL), r
    if tamper is not _as_one_sequence:
        assert max(r.logits, r.loss, r.grads["language"], r.grads["vision"]) > BUG, r


def test_the_rows_hf_kwargs_run_qwen2vl_as_is(renumbered, sdpa_model):
    """``to_hf_kwargs()`` of a row with media goes straight into Qwen2VLForConditionalGeneration
    (sdpa: boundaries from the text position row, which needs ``use_cache=False``; the model
    runs its own vision tower on ``pixel_values`` / ``image_grid_thw``): each sample's logits
    equal it run alone, to TOL."""
    items = renumbered.samples[:4]
    row = PackedBatch.from_samples(items, pad_multiple=4, pad_id=renumbered.pad_id).validate()
    kw = row.to_hf_kwargs()
    assert kw["position_ids"].shape == (4, 1, row.num_tokens) and kw["pixel_values"] is row.media.pixel_values
    family = family_for(sdpa_model)
    keys = ("input_ids", "position_ids", "pixel_values", "image_grid_thw", "use_cache")
    with torch.no_grad():
        logits = sdpa_model(**{k: kw[k] for k in keys}).logits[0]
        cu, cup = row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist()
        for i, s in enumerate(items):
            alone = family.alone_logits(sdpa_model, s)
            assert float((logits[cup[i] : cup[i] + cu[i + 1] - cu[i]] - alone).abs().max()) <= TOL
