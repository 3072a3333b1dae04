"""Same training as unpacked: every path, both boundary modes, 20 AdamW steps.

Each packed run records which conversations every step saw (its rows'
``sequence_ids``); the reference trains a fresh copy of the model on exactly
those conversations as right-padded batches (each conversation alone in its
row), with the same global token-mean normalisation. Per-step losses and the
final parameters must agree within fp32 noise.

The tolerance is measured, not guessed: the noise floor is the difference
between two *unpacked* runs that only group the same conversations into
micro-batches differently (1 vs 2 micro-batches per step: other matmul shapes,
another summation order). A packed run must stay within 20x that floor (and
within 1e-6 where the floor is smaller): packing may reorder sums, like any
regrouping, but must not change what is computed. A normalisation bug (per-row
means, a label across a boundary) moves the loss by 1e-2 or more.
"""

from __future__ import annotations

import pytest

from sftpack.train import ReplaySource, make_source, train

from ._tiny import max_loss_diff, max_param_diff, tiny_config, tiny_model

FACTOR = 20


@pytest.fixture(scope="module")
def floor(samples):
    a = train(
        tiny_config(packing="none"),
        source=make_source(tiny_config(packing="none"), samples=samples),
        model=tiny_model(),
    )
    cfg2 = tiny_config(packing="none", grad_accum=2)
    b = train(cfg2, source=make_source(cfg2, samples=samples), model=tiny_model())
    assert [sorted(x) for x in a.conversations] == [sorted(x) for x in b.conversations]
    return {
        "baseline": a,
        "loss": max(max_loss_diff(a.losses, b.losses), 1e-6 / FACTOR),
        "params": max(max_param_diff(a.model, b.model), 1e-6 / FACTOR),
    }


def _reference(samples, packed_run, cfg):
    by_id = {s.conversation_id: s for s in samples}
    steps = [[by_id[c] for c in step] for step in packed_run.conversations]
    return train(cfg, source=ReplaySource(steps), model=tiny_model())


def _check(packed, reference, floor):
    dl = max_loss_diff(packed.losses, reference.losses)
    dp = max_param_diff(packed.model, reference.model)
    assert dl <= FACTOR * floor["loss"], (dl, floor)
    assert dp <= FACTOR * floor["params"], (dp, floor)
    assert packed.losses[-1] < packed.losses[0] - 0.5  # it really trained
    print(
        f"max |dloss| {dl:.2e}, max |dparam| {dp:.2e} (floor {floor['loss']:.2e}, {floor['params']:.2e})"
    )
    return dl, dp


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_trainer_path_equals_padded_batches(samples, floor, boundaries):
    cfg = tiny_config(packing="trainer", boundaries=boundaries, pad_multiple=4)
    run = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model())
    base = floor["baseline"]
    # The contract: same seed and batch size -> the same conversations in every step.
    assert [sorted(c) for c in run.conversations] == [
        sorted(c) for c in base.conversations
    ]
    assert all(
        r.slots < b.slots for r, b in zip(run.logs, base.logs)
    )  # the packed steps really are packed
    _check(run, base, floor)


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_loader_path_equals_unpacked(samples, floor, boundaries):
    cfg = tiny_config(
        packing="loader",
        boundaries=boundaries,
        batch_size=2,
        buffer_size=16,
        pad_multiple=4,
    )
    run = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model())
    assert all(r.slots == 2 * 128 for r in run.logs)
    _check(run, _reference(samples, run, tiny_config(packing="none")), floor)


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_offline_path_equals_unpacked(samples, floor, boundaries, tmp_path_factory):
    from sftpack.offline import prepack_samples

    out = prepack_samples(
        samples, tmp_path_factory.mktemp("prepack") / "rows", max_seq_len=128
    ).path
    cfg = tiny_config(packing="offline", boundaries=boundaries, batch_size=2)
    run = train(cfg, source=make_source(cfg, prepacked=out), model=tiny_model())
    seen = [c for step in run.conversations for c in step]
    assert len(seen) > 2 * cfg.steps  # several conversations per row
    _check(run, _reference(samples, run, tiny_config(packing="none")), floor)
