"""Per-token weights (and signed advantages) from the sample into the packed row and the loss.

The rule (sftpack.loss): a weighted mean is sum(w * loss) / sum(|w|) over the same targets, the
denominator counted over the whole step (every micro-batch, every rank) by count_label_tokens.
A weighted packed step therefore equals every conversation run alone with the same weights and
the same rule, however the conversations were grouped into rows and micro-batches.

Tolerance, float64: 1e-10. The derivation is tests/consumers/test_exactness.py's (packed and
alone compute the same function in other summation orders; the longest chain of roundings in
one forward and backward pass of the 2-layer model is n <= 2,000, so each run is off by
<= n*u = 2.2e-13 relative, two runs by 4.4e-13, on values of magnitude <= 10: 4.4e-12). The
weights add one rounding per term (w * loss) and a sum of |w| over <= 400 targets to the chain
(n <= 2,401), and multiply the magnitudes by |w| <= 2 (the weights drawn here): 2 * 2 * 2,401 *
1.1e-16 * 10 = 1.1e-11, and 1e-10 is 9x that (observed: about 1e-16).

Negative control: the label-shift bug (a slot given its own token's weight, not its target's,
the next token's) moves the loss and the gradients by more than 1e-3 (asserted; observed: loss
8e-2, gradients 6e-1), eight orders of magnitude over the tolerance.
"""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sftpack import IGNORE_INDEX, PackedBatch, Sample
from sftpack.exactness import TinyCausalLM, random_samples, reference_labels
from sftpack.handoff import PackedBatchError, build_row, shard_for_cp, unshard_cp
from sftpack.handoff.cp import cp_slot_indices
from sftpack.loss import (
    count_label_tokens,
    count_sequences,
    sequence_logprob_sums,
    sequence_loss_sums,
    sequence_mean_loss,
    token_losses,
    token_mean_loss,
)

VOCAB = 97
TOL = 1e-10  # float64; see the docstring
CONTROL = 1e-3  # the label-shift bug moves the loss and gradients by more than this
F64 = torch.float64


@functools.cache
def model() -> TinyCausalLM:
    return TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=F64)


def weighted_samples(lengths: list[int], seed: int) -> list[Sample]:
    """Random samples, most with per-token weights in [-2, 2] (some exactly 0), one with a
    scalar weight, one without weights (weight 1 on its targets)."""
    rng = np.random.default_rng(seed + 1000)
    out = []
    for i, s in enumerate(random_samples(lengths, VOCAB, seed=seed)):
        if i % 4 == 1:
            w: object = None
        elif i % 4 == 2:
            w = 0.5
        else:
            w = rng.uniform(-2.0, 2.0, len(s))
            w[rng.random(len(s)) < 0.15] = 0.0
        out.append(Sample(s.input_ids, s.loss_mask, s.conversation_id, weights=w))
    return out


def target_weights(s: Sample) -> torch.Tensor:
    """``(L,)`` the weight of each position's target, computed on its own (not by the packer):
    position t's target is token t+1, so its weight is ``weights[t+1]``; 0 without a target."""
    lab = reference_labels(s)
    w = torch.ones(len(s), dtype=F64) if s.weights is None else torch.as_tensor(s.weights, dtype=F64)
    out = torch.zeros(len(s), dtype=F64)
    out[:-1] = w[1:]
    return torch.where(lab != IGNORE_INDEX, out, torch.zeros_like(out))


def forward(m: TinyCausalLM, b: PackedBatch) -> torch.Tensor:
    return m(b.input_ids, b.position_ids, b.to_packed_seq_params())


def grads(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


def run_packed(samples, microbatches, *, pad_multiple, mode="token", rows=None):
    """One step: each micro-batch is one or more rows (from_samples), laid end to end (concat)."""
    m = model()
    m.zero_grad(set_to_none=True)
    batches = []
    for idx in microbatches:
        groups = rows(idx) if rows else [idx]
        batches.append(
            PackedBatch.concat(
                [
                    PackedBatch.from_samples([samples[i] for i in g], pad_multiple=pad_multiple).validate()
                    for g in groups
                ]
            ).validate()
        )
    n_tok, n_seq = count_label_tokens(batches), count_sequences(batches)
    total = torch.zeros((), dtype=F64)
    for b in batches:
        logits = forward(m, b)
        loss = token_mean_loss(logits, b, n_tok) if mode == "token" else sequence_mean_loss(logits, b, n_seq)
        loss.backward()
        total = total + loss.detach()
    return float(total), grads(m)


def run_alone(samples, *, mode="token", weights_of=target_weights):
    """Every conversation alone, its loss weighted by hand with the one rule."""
    m = model()
    m.zero_grad(set_to_none=True)
    sums, masses = [], []
    for s in samples:
        logits = m(torch.as_tensor(s.input_ids), torch.arange(len(s)), None)
        ce = F.cross_entropy(logits, reference_labels(s), ignore_index=IGNORE_INDEX, reduction="none")
        w = weights_of(s)
        sums.append((w * ce).sum())
        masses.append(w.abs().sum())
    if mode == "token":
        loss = torch.stack(sums).sum() / torch.stack(masses).sum()
    else:
        means = [a / c for a, c in zip(sums, masses) if c > 0]
        loss = torch.stack(means).sum() / len(means)
    loss.backward()
    return float(loss.detach()), grads(m)


def max_diff(a, b) -> tuple[float, float]:
    return abs(a[0] - b[0]), max(float((x - y).abs().max()) for x, y in zip(a[1], b[1]))


CASES = [
    ([5, 10, 3, 7, 12, 1], [[0, 1], [2, 3, 4, 5]], 0),
    ([9, 4, 16, 2, 8], [[3], [1, 0], [2, 4]], 1),
    ([20, 6, 11, 5, 3, 14, 7], [[0, 6, 2], [1, 3, 4, 5]], 2),
]


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("case", CASES, ids=["a", "b", "c"])
def test_weighted_packed_step_equals_each_sample_alone(case, pad_multiple, mode):
    lengths, microbatches, seed = case
    samples = weighted_samples(lengths, seed)
    # two rows per micro-batch where it has two samples or more: concat carries the weights
    got = run_packed(
        samples,
        microbatches,
        pad_multiple=pad_multiple,
        mode=mode,
        rows=lambda idx: [idx[:1], idx[1:]] if len(idx) > 1 else [idx],
    )
    want = run_alone(samples, mode=mode)
    loss, grad = max_diff(got, want)
    assert loss <= TOL and grad <= TOL, (loss, grad)


def test_grouping_does_not_move_the_weighted_loss():
    """Gradient accumulation: one micro-batch, or every sample its own, give the same step."""
    samples = weighted_samples([5, 10, 3, 7, 12, 1], 3)
    one = run_packed(samples, [list(range(6))], pad_multiple=4)
    each = run_packed(samples, [[i] for i in range(6)], pad_multiple=4)
    loss, grad = max_diff(one, each)
    assert loss <= TOL and grad <= TOL, (loss, grad)


def test_negative_control_weights_shifted_by_one_slot():
    """The label-shift bug: each slot weighted by its own token, not by its target (the next
    token). The packed rows laid with the bug (every sample's weights moved one token on, so
    slot t gets w[t]) fail the check against the right per-sample reference by far more than
    the tolerance, while the right rows pass it."""
    samples = weighted_samples([5, 10, 3, 7, 12, 1], 0)

    def own_token_weights(x: Sample) -> Sample:
        w = np.ones(len(x)) if x.weights is None else x.weights
        return Sample(x.input_ids, x.loss_mask, x.conversation_id, weights=np.concatenate([[0.0], w[:-1]]))

    bugged = [own_token_weights(x) for x in samples]
    right = run_alone(samples)
    assert max(max_diff(run_packed(samples, [[0, 1, 2], [3, 4, 5]], pad_multiple=4), right)) <= TOL
    loss, grad = max_diff(run_packed(bugged, [[0, 1, 2], [3, 4, 5]], pad_multiple=4), right)
    assert loss > CONTROL and grad > CONTROL, (loss, grad)


def test_rows_without_weights_are_as_before():
    samples = random_samples([5, 10, 3], VOCAB, seed=4)
    row = PackedBatch.from_samples(samples, pad_multiple=4)
    assert row.weights is None and "weights" not in repr(row)
    assert count_label_tokens(row).dtype == torch.int64
    assert PackedBatch.concat([row, row]).weights is None
    shards = [shard_for_cp(row, 2, r) for r in range(2)]
    assert all(x.weights is None for x in [*shards, unshard_cp(shards)])
    # a sample without weights keeps today's fields, pickle and repr
    s = samples[0]
    assert list(vars(s)) == ["input_ids", "loss_mask", "conversation_id", "meta", "media"]
    assert b"weights" not in pickle.dumps(s) and "weights" not in repr(s)
    back = pickle.loads(pickle.dumps(s))
    assert back.weights is None and np.array_equal(back.input_ids, s.input_ids)
    # weight 1 everywhere is no weights, to the bit (loss and count)
    ones = [Sample(x.input_ids, x.loss_mask, x.conversation_id, weights=1.0) for x in samples]
    wrow = PackedBatch.from_samples(ones, pad_multiple=4)
    logits = forward(model(), row).detach()
    assert torch.equal(token_losses(logits, row), token_losses(logits, wrow))
    assert float(count_label_tokens(wrow)) == int(count_label_tokens(row))
    assert torch.equal(
        token_mean_loss(logits, row, count_label_tokens(row)), token_mean_loss(logits, wrow, count_label_tokens(wrow))
    )


def test_weights_follow_the_labels_through_every_row_operation():
    samples = weighted_samples([5, 10, 3, 7], 5)
    row = PackedBatch.from_samples(samples, pad_multiple=4).validate()
    assert row.weights is not None and row.weights.dtype == F64
    # slot by slot: each sequence's slots hold its targets' weights, padding 0
    cup = row.cu_seqlens_padded.tolist()
    for i, s in enumerate(samples):
        a = cup[i]
        assert torch.equal(row.weights[a : a + len(s)], target_weights(s))
        assert not row.weights[a + len(s) : cup[i + 1]].any()
    # build_row from flat arrays lays the same row
    flat = np.concatenate([np.ones(len(s)) if s.weights is None else s.weights for s in samples])
    built = build_row(
        np.concatenate([s.input_ids for s in samples]),
        np.concatenate([s.loss_mask for s in samples]),
        [len(s) for s in samples],
        pad_multiple=4,
        weights=flat,
    ).validate()
    assert torch.equal(built.weights, row.weights) and torch.equal(built.labels, row.labels)
    # concat: a row without weights takes 1 on its targets
    plain = PackedBatch.from_samples(random_samples([6], VOCAB, seed=9), pad_multiple=4)
    both = PackedBatch.concat([row, plain]).validate()
    assert torch.equal(both.weights, torch.cat([row.weights, (plain.labels != IGNORE_INDEX).to(F64)]))
    # context parallelism: each shard holds the row's weights at its slots, and they come back
    shards = [shard_for_cp(row, 2, r).validate() for r in range(2)]
    for r, sh in enumerate(shards):
        assert torch.equal(sh.weights, row.weights[cp_slot_indices(row, 2, r)])
    assert torch.equal(unshard_cp(shards).validate().weights, row.weights)
    # ... and the shards' losses and weighted counts add up to the row's (the CP group's sum)
    logits = forward(model(), row).detach()
    whole = token_losses(logits, row).sum()
    parts = sum(token_losses(logits[sh.slot_index], sh).sum() for sh in shards)
    assert abs(float(whole - parts)) <= TOL
    assert float(count_label_tokens(shards)) == pytest.approx(float(count_label_tokens(row)), abs=TOL)
    sums, mass = sequence_loss_sums(logits, row)
    assert mass.dtype == F64 and torch.allclose(mass, torch.stack([target_weights(s).abs().sum() for s in samples]))
    logps, _ = sequence_logprob_sums(logits, row)
    assert torch.equal(logps, -sums)
    # moving the row moves its weights
    assert row.to("cpu").weights is not None


def test_float32_weights_stay_float32_in_the_row():
    s = random_samples([6, 4], VOCAB, seed=1)
    a = Sample(s[0].input_ids, s[0].loss_mask, "a", weights=np.full(6, 0.25, dtype=np.float32))
    b = Sample(s[1].input_ids, s[1].loss_mask, "b")
    assert PackedBatch.from_samples([a, b]).weights.dtype == torch.float32
    c = Sample(s[1].input_ids, s[1].loss_mask, "c", weights=2)
    assert c.weights.dtype == np.float64 and PackedBatch.from_samples([a, c]).weights.dtype == F64


def test_a_zero_weight_is_a_token_not_trained():
    """Weight 0 on a target gives the loss and gradients of that target masked out."""
    s = random_samples([12], VOCAB, seed=7, p_train=1.0)[0]
    w = np.linspace(0.5, 1.5, 12)
    w[[3, 8]] = 0.0
    mask = s.loss_mask.copy()
    mask[[3, 8]] = False
    zeroed = Sample(s.input_ids, s.loss_mask, "z", weights=w)
    masked = Sample(s.input_ids, mask, "m", weights=w)
    got = run_packed([zeroed], [[0]], pad_multiple=1)
    want = run_packed([masked], [[0]], pad_multiple=1)
    loss, grad = max_diff(got, want)
    assert loss <= TOL and grad <= TOL


def test_count_dtype_for_data_parallel_ranks():
    plain = PackedBatch.from_samples(random_samples([5], VOCAB, seed=0))
    assert count_label_tokens(plain, weighted=True).dtype == F64  # a rank whose step has no weighted row
    weighted = PackedBatch.from_samples([Sample([1, 2, 3], [0, 1, 1], "w", weights=[1.0, -2.0, 0.5])])
    assert float(count_label_tokens([plain, weighted])) == float(plain.num_label_tokens) + 2.5
    with pytest.raises(ValueError, match="weighted=True"):
        count_label_tokens(weighted, weighted=False)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1.0, 2.0], r"Sample 'c7': weights has shape \(2,\) but the sample has 3 tokens"),
        ([1.0, float("nan"), 1.0], r"Sample 'c7': weights\[1\] is nan: every weight must be finite"),
        (["a", "b", "c"], r"Sample 'c7': weights must be real numbers"),
        ([[1.0, 1.0, 1.0]], r"Sample 'c7': weights has shape \(1, 3\)"),
        (True, r"Sample 'c7': weights must be numbers"),
    ],
)
def test_bad_sample_weights_name_the_conversation_and_the_field(weights, message):
    with pytest.raises(ValueError, match=message):
        Sample([1, 2, 3], [0, 1, 1], "c7", weights=weights)


def test_bad_row_weights_are_refused():
    row = PackedBatch.from_samples([Sample([1, 2, 3], [0, 1, 1], "a", weights=[1.0, 2.0, 3.0])], max_seq_len=4)
    bad = row.weights.clone()
    bad[2] = 5.0  # the last real token has no target
    with pytest.raises(PackedBatchError, match=r"PackedBatch.weights\[2\] = 5.0 but labels\[2\] is -100"):
        PackedBatch(**{**vars(row), "weights": bad}).validate()
    with pytest.raises(PackedBatchError, match="float32 or float64"):
        PackedBatch(**{**vars(row), "weights": row.weights.long()}).validate()
    with pytest.raises(PackedBatchError, match=r"weights has shape \(3,\)"):
        PackedBatch(**{**vars(row), "weights": row.weights[:3]}).validate()
    with pytest.raises(PackedBatchError, match=r"build_row: weights has shape \(2,\) but the sample has 3 tokens"):
        build_row(np.array([1, 2, 3]), np.ones(3, bool), [3], weights=np.ones(2))
    with pytest.raises(PackedBatchError, match="build_row: weights must be 1-D"):
        build_row(np.array([1, 2, 3]), np.ones(3, bool), [3], weights=1.0)


def test_dict_samples_carry_weights():
    row = PackedBatch.from_samples([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "weights": [0.0, 2.0, 3.0]}])
    assert row.weights.tolist() == [2.0, 3.0, 0.0]


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_pack_step_lays_the_weights_from_samples_lays(pad_multiple):
    """The trainer path: a right-padded batch with a (B, S) weights tensor packs to the row
    from_samples builds from the same samples (an empty row of the batch skipped)."""
    from sftpack.trainer import pack_step, padded_batch

    samples = weighted_samples([5, 10, 3, 7, 1], 6)
    ids, lengths, mask = padded_batch(samples, 12)
    w = torch.full((len(samples), 12), float("nan"), dtype=F64)  # padding is never read
    for i, s in enumerate(samples):
        w[i, : len(s)] = torch.ones(len(s), dtype=F64) if s.weights is None else torch.as_tensor(s.weights)
    zero = torch.zeros(1, 12, dtype=torch.long)
    got = pack_step(
        torch.cat([ids, zero]),
        torch.cat([lengths, torch.zeros(1, dtype=lengths.dtype)]),
        torch.cat([mask, zero.bool()]),
        pad_multiple=pad_multiple,
        weights=torch.cat([w, w[:1]]),
    ).validate()
    want = PackedBatch.from_samples(samples, pad_multiple=pad_multiple)
    assert torch.equal(got.labels, want.labels) and torch.equal(got.weights, want.weights)
    with pytest.raises(PackedBatchError, match=r"pack_step: weights must be a \(5, 12\) tensor"):
        pack_step(ids, lengths, mask, weights=w[:, :5])
    w[0, 2] = float("inf")
    with pytest.raises(PackedBatchError, match="batch row 0, token 2 is inf"):
        pack_step(ids, lengths, mask, weights=w)
