"""One name for one thing (issue 40, item 5): the row width is ``max_seq_len``, the patch
budget ``max_patches_per_row``.

Every keyword renamed to ``max_seq_len`` (or, on the loop's trainer path, to
``micro_batch_tokens``) or to ``max_patches_per_row`` still takes its old spelling for one
release: the call warns with a ``DeprecationWarning`` that names the new keyword and gives
what the new spelling gives; both spellings at once are refused; the new spelling does not
warn.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from sftpack import PackedBatch
from sftpack.exactness import rounding_chain, tiny_llama
from sftpack.handoff import build_row, pack_rows
from sftpack.handoff.build import build_parts
from sftpack.handoff.layout import lay_row
from sftpack.loop._sources import TrainerSource
from sftpack.testing import samples_from_lengths
from sftpack.trainer import pack_step, padded_batch, plan_microbatches
from tests.helpers import assert_same_batch

SAMPLES = samples_from_lengths([5, 10, 3], trainable_from=1)
LENGTHS = [len(s) for s in SAMPLES]
IDS = np.concatenate([s.input_ids for s in SAMPLES])
MASK = np.concatenate([s.loss_mask for s in SAMPLES])


def _old(call, old: str, new: str):
    """``call()`` under the old spelling: its result, after checking the one warning it gives."""
    with pytest.warns(DeprecationWarning) as seen:
        got = call()
    messages = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 1, messages
    assert f"{old}= is deprecated" in messages[0] and f"use {new}=" in messages[0], messages[0]
    assert seen[0].filename == __file__  # the warning points at the caller, not at sftpack
    return got


def _new(call):
    """``call()`` under the new spelling: no warning at all."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return call()


def _same_rows(a, b) -> None:
    """Two laid-out rows (numpy) equal field for field, dtypes included."""
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.max_seqlen == b.max_seqlen


def test_lay_row_row_width():
    want = _new(lambda: lay_row(IDS, MASK, LENGTHS, max_seq_len=24, pad_multiple=4))
    got = _old(lambda: lay_row(IDS, MASK, LENGTHS, row_width=24, pad_multiple=4), "row_width", "max_seq_len")
    assert int(want.cu_seqlens_padded[-1]) == 24
    _same_rows(got, want)


def test_build_row_row_width():
    want = _new(lambda: build_row(IDS, MASK, LENGTHS, max_seq_len=24, pad_multiple=4))
    got = _old(lambda: build_row(IDS, MASK, LENGTHS, row_width=24, pad_multiple=4), "row_width", "max_seq_len")
    assert want.num_tokens == 24
    assert_same_batch(got, want)


def test_build_parts_row_width():
    ids = [s.input_ids for s in SAMPLES]
    masks = [s.loss_mask for s in SAMPLES]
    want = _new(lambda: build_parts(ids, masks, LENGTHS, max_seq_len=24, pad_multiple=4))
    got = _old(lambda: build_parts(ids, masks, LENGTHS, row_width=24, pad_multiple=4), "row_width", "max_seq_len")
    assert want.num_tokens == 24
    assert_same_batch(got, want)


def test_from_samples_row_width():
    want = _new(lambda: PackedBatch.from_samples(SAMPLES, max_seq_len=24, pad_multiple=4))
    got = _old(lambda: PackedBatch.from_samples(SAMPLES, row_width=24, pad_multiple=4), "row_width", "max_seq_len")
    assert want.num_tokens == 24
    assert_same_batch(got, want)


def test_pack_step_pad_to():
    ids, lens, mask = padded_batch(SAMPLES)
    want = _new(lambda: pack_step(ids, lens, mask, pad_multiple=4, max_seq_len=24))
    got = _old(lambda: pack_step(ids, lens, mask, pad_multiple=4, pad_to=24), "pad_to", "max_seq_len")
    assert want.num_tokens == 24
    assert_same_batch(got, want)
    assert_same_batch(want, PackedBatch.from_samples(SAMPLES, max_seq_len=24, pad_multiple=4))


def test_plan_microbatches_token_budget():
    lengths = [5, 10, 3, 8, 6, 7]
    want = _new(lambda: plan_microbatches(lengths, max_seq_len=16, dp_size=2, pad_multiple=4))
    got = _old(
        lambda: plan_microbatches(lengths, token_budget=16, dp_size=2, pad_multiple=4), "token_budget", "max_seq_len"
    )
    assert [[m.tolist() for m in r] for r in got.microbatches] == [[m.tolist() for m in r] for r in want.microbatches]
    assert np.array_equal(got.tokens, want.tokens) and int(want.tokens.max()) <= 16
    assert (
        _new(lambda: plan_microbatches(lengths, 16, dp_size=2, pad_multiple=4)).tokens.tolist() == want.tokens.tolist()
    )


def test_microbatch_plan_token_budget_attribute():
    plan = plan_microbatches([5, 10, 3], max_seq_len=16, pad_multiple=4)
    assert _new(lambda: plan.max_seq_len) == 16
    with pytest.warns(DeprecationWarning, match="MicrobatchPlan: token_budget is deprecated.*use max_seq_len") as seen:
        assert plan.token_budget == 16
    assert seen[0].filename == __file__


def test_rounding_chain_row_width():
    model = tiny_llama(seed=0)
    want = _new(lambda: rounding_chain(model, 64))
    assert _new(lambda: rounding_chain(model, max_seq_len=64)) == want
    assert _old(lambda: rounding_chain(model, row_width=64), "row_width", "max_seq_len") == want
    assert want > rounding_chain(model, 32)  # the row width counts


def test_trainer_source_token_budget():
    samples = samples_from_lengths([5, 10, 3, 8, 6, 7, 9, 4])
    draw = {"batch_size": 8, "seed": 0, "pad_multiple": 4}
    new = _new(lambda: TrainerSource(samples, micro_batch_tokens=16, **draw))
    old = _old(lambda: TrainerSource(samples, token_budget=16, **draw), "token_budget", "micro_batch_tokens")
    assert old.fingerprint() == new.fingerprint()
    got, want = old.next_step(), new.next_step()
    assert len(got) == len(want) >= 3  # 52 padded tokens need at least 4 micro-batches of 16
    for a, b in zip(got, want):
        assert a.num_tokens <= 16
        assert_same_batch(a, b)


# ------------------------------------------------------------------ the patch budget
def test_pack_rows_max_patches():
    kw = {"max_seq_len": 32, "pad_multiple": 4, "patches": [16, 16, 4]}
    want = _new(lambda: pack_rows([8, 8, 8], max_patches_per_row=20, **kw)).to_lists()
    got = _old(lambda: pack_rows([8, 8, 8], max_patches=20, **kw), "max_patches", "max_patches_per_row")
    assert got.to_lists() == want == [[0, 2], [1]]  # without the budget the three share one row
    assert pack_rows([8, 8, 8], **kw).to_lists() == [[0, 1, 2]]


def test_plan_microbatches_max_patches_per_microbatch():
    kw = {"max_seq_len": 32, "pad_multiple": 4, "patches": [16, 16, 4]}
    want = _new(lambda: plan_microbatches([8, 8, 8], max_patches_per_row=20, **kw))
    got = _old(
        lambda: plan_microbatches([8, 8, 8], max_patches_per_microbatch=20, **kw),
        "max_patches_per_microbatch",
        "max_patches_per_row",
    )
    assert [m.tolist() for m in got[0]] == [m.tolist() for m in want[0]]
    assert np.array_equal(got.patches, want.patches) and int(want.patches.max()) <= 20 and want.num_microbatches == 2


def test_plan_rows_max_patches():
    from sftpack.multimodal import plan_rows

    kw = {"max_seq_len": 32, "pad_multiple": 4}
    want = _new(lambda: plan_rows([8, 8, 8], [16, 16, 4], max_patches_per_row=20, **kw))
    got = _old(lambda: plan_rows([8, 8, 8], [16, 16, 4], max_patches=20, **kw), "max_patches", "max_patches_per_row")
    assert [r.tolist() for r in got] == [r.tolist() for r in want] and len(want) == 2  # the budget splits the row
    assert len(plan_rows([8, 8, 8], [16, 16, 4], **kw)) == 1


def test_compare_media_layouts_max_patches():
    from sftpack.report.savings import compare_media_layouts

    args = ([5, 10, 3, 8, 6], [1, 3, 0, 2, 2], [1, 3, 0, 2, 2], 16)
    want = _new(lambda: compare_media_layouts(*args, max_patches_per_row=3, algorithms=["ffd"]))
    got = _old(
        lambda: compare_media_layouts(*args, max_patches=3, algorithms=["ffd"]), "max_patches", "max_patches_per_row"
    )
    key = [(r.layout, r.patch_budget, r.rows, r.patches_max, r.over_budget) for r in want]
    assert [(r.layout, r.patch_budget, r.rows, r.patches_max, r.over_budget) for r in got] == key
    assert key[1] == ("ffd", 3, 3, 3, 0)


def test_patch_budget_error_max_patches_attribute():
    from types import SimpleNamespace

    from sftpack.multimodal import PatchBudgetError, check_patch_budget

    with pytest.raises(PatchBudgetError, match="more than max_patches_per_row=8") as e:
        check_patch_budget([SimpleNamespace(num_patches=9, conversation_id="c")], 8, "error")
    assert e.value.max_patches_per_row == 8
    with pytest.warns(
        DeprecationWarning, match=r"PatchBudgetError: \.max_patches is deprecated.*\.max_patches_per_row"
    ):
        assert e.value.max_patches == 8


def test_trainer_source_max_patches():
    samples = samples_from_lengths([5, 10, 3, 8])
    draw = {"micro_batch_tokens": 64, "batch_size": 4, "seed": 0}
    new = _new(lambda: TrainerSource(samples, max_patches_per_row=7, **draw))
    old = _old(lambda: TrainerSource(samples, max_patches=7, **draw), "max_patches", "max_patches_per_row")
    assert old.max_patches_per_row == new.max_patches_per_row == 7
    assert old.fingerprint() == new.fingerprint() != TrainerSource(samples, **draw).fingerprint()


@pytest.mark.parametrize(
    "call",
    [
        lambda: build_row(IDS, MASK, LENGTHS, max_seq_len=24, row_width=24),
        lambda: PackedBatch.from_samples(SAMPLES, max_seq_len=24, row_width=24),
        lambda: pack_step(torch.ones(1, 4, dtype=torch.long), [4], max_seq_len=4, pad_to=4),
        lambda: plan_microbatches([4], 8, token_budget=8),
        lambda: pack_rows([4], max_seq_len=8, patches=[1], max_patches_per_row=2, max_patches=2),
    ],
)
def test_both_spellings_are_refused(call):
    with pytest.raises(TypeError, match=r"give \w+= only \(\w+= is its old spelling\)"):
        call()


def test_a_missing_width_is_named():
    with pytest.raises(ValueError, match="plan_microbatches: max_seq_len must be a positive integer, got None"):
        plan_microbatches([4, 5])
