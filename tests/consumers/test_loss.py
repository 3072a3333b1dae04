"""Packing at the step is exact: any micro-batch split, normalised by the global count,
gives the unpacked loss, logits and gradients (plain PyTorch model and a Hugging Face Llama).

In float64, to a fixed 1e-10: the derivation is tests/consumers/test_exactness.py's
(the same models, the same function in other summation orders, n*u with n <= 2,000
roundings: <= 4.4e-12). The per-row-mean bug moves the loss by more than 1e-2."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sftpack import IGNORE_INDEX, PackedBatch, Sample
from sftpack.exactness import TinyCausalLM, random_samples, reference_labels, tiny_llama
from sftpack.handoff import unpack
from sftpack.loss import (
    count_label_tokens,
    count_sequences,
    sequence_loss_sums,
    sequence_mean_loss,
    token_losses,
    token_mean_loss,
)
from sftpack.trainer import pack_step
from sftpack.trainer import padded_batch as _padded_batch

VOCAB = 97
TOL = 1e-10  # float64; see the docstring
F64 = torch.float64


@functools.cache
def plain_model() -> TinyCausalLM:
    return TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=F64)


@functools.cache
def hf_model():
    return tiny_llama(VOCAB, attn_implementation="sdpa", dtype=F64)


def padded_batch(samples: list[Sample], pad_id: int = 0):
    # extra right padding the packer must drop
    return _padded_batch(samples, max(len(s) for s in samples) + 3, pad_id=pad_id)


def forward_plain(model, packed: PackedBatch, pad_between_seqs: bool = True) -> torch.Tensor:
    return model(packed.input_ids, packed.position_ids, packed.to_packed_seq_params(pad_between_seqs=pad_between_seqs))


def forward_hf(model, packed: PackedBatch) -> torch.Tensor:
    kw = packed.to_hf_kwargs()
    kw.pop("labels")  # the loss is ours, normalised globally
    return model(**kw).logits[0]


def reference_plain(model, s: Sample) -> torch.Tensor:
    return model(torch.as_tensor(s.input_ids), torch.arange(len(s)), None)


def reference_hf(model, s: Sample) -> torch.Tensor:
    return model(input_ids=torch.as_tensor(s.input_ids)[None], use_cache=False).logits[0]


def grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def run_packed(model, forward, samples, splits, *, pad_multiple, mode="token", max_seq_len=None):
    """One optimizer step's worth of micro-batches, each packed at the step by pack_step."""
    model.zero_grad(set_to_none=True)
    batches = []
    for idx in splits:
        ids, L, mask = padded_batch([samples[i] for i in idx])
        batches.append(pack_step(ids, L, mask, pad_multiple=pad_multiple, max_seq_len=max_seq_len))
    n_tok = count_label_tokens(batches)  # no process group: nothing to all-reduce
    n_seq = count_sequences(batches)
    total = torch.zeros((), dtype=F64)
    logits_of: dict[int, torch.Tensor] = {}
    for idx, b in zip(splits, batches):
        logits = forward(model, b)
        if mode == "token":
            loss = token_mean_loss(logits, b, n_tok)
        else:
            loss = sequence_mean_loss(logits, b, n_seq)
        loss.backward()
        total = total + loss.detach()
        for i, part in zip(idx, unpack(logits.detach(), b)):
            logits_of[i] = part
    return float(total), grads(model), logits_of


def run_reference(model, reference, samples, *, mode="token"):
    """Every conversation alone, as an unpacked trainer would see it."""
    model.zero_grad(set_to_none=True)
    sums, counts, logits_of = [], [], {}
    for i, s in enumerate(samples):
        logits = reference(model, s)
        lab = reference_labels(s)
        sums.append(F.cross_entropy(logits, lab, ignore_index=IGNORE_INDEX, reduction="sum"))
        counts.append(int((lab != IGNORE_INDEX).sum()))
        logits_of[i] = logits.detach()
    if mode == "token":
        loss = torch.stack(sums).sum() / max(sum(counts), 1)
    else:
        means = [s / c for s, c in zip(sums, counts) if c]
        loss = torch.stack(means).sum() / len(means) if means else torch.stack(sums).sum() * 0
    loss.backward()
    return float(loss.detach()), grads(model), logits_of


def diffs(packed, reference):
    loss_p, g_p, l_p = packed
    loss_r, g_r, l_r = reference
    logit = max(float((l_p[i] - l_r[i]).abs().max()) for i in l_r)
    grad = max(float((a - b).abs().max()) for a, b in zip(g_p, g_r))
    return logit, abs(loss_p - loss_r), grad


@st.composite
def split_batches(draw, max_len=40):
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=10))
    order = draw(st.permutations(range(len(lens))))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(len(lens) - 1, 1)), max_size=4))))
    cuts = [c for c in cuts if 0 < c < len(lens)]
    bounds = [0, *cuts, len(lens)]
    splits = [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]
    return lens, splits, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real+padded", "padded-for-both"])
@pytest.mark.parametrize("pad_multiple", [1, 4])
@given(case=split_batches())
@example(case=([5, 10], [[0, 1]], 0))
@example(case=([5, 10, 3, 7], [[3], [1, 0], [2]], 1))
@settings(max_examples=6, deadline=None)
def test_plain_model_any_microbatch_split(pad_between_seqs, pad_multiple, case):
    lens, splits, seed = case
    samples = random_samples(lens, VOCAB, seed=seed)
    model = plain_model()
    forward = lambda m, b: forward_plain(m, b, pad_between_seqs)  # noqa: E731
    got = run_packed(model, forward, samples, splits, pad_multiple=pad_multiple)
    ref = run_reference(model, reference_plain, samples)
    logit, loss, grad = diffs(got, ref)
    assert logit <= TOL and loss <= TOL and grad <= TOL, (logit, loss, grad)


@given(case=split_batches(max_len=24))
@example(case=([5, 10], [[0, 1]], 0))
@settings(max_examples=6, deadline=None)
def test_hf_llama_any_microbatch_split(case):
    lens, splits, seed = case
    samples = random_samples(lens, VOCAB, seed=seed)
    model = hf_model()
    got = run_packed(model, forward_hf, samples, splits, pad_multiple=4)
    ref = run_reference(model, reference_hf, samples)
    logit, loss, grad = diffs(got, ref)
    assert logit <= TOL and loss <= TOL and grad <= TOL, (logit, loss, grad)


def test_fixed_width_microbatches_are_exact():
    """Pipeline parallelism: every micro-batch at one width, the last sequence absorbing the tail."""
    samples = random_samples([7, 3, 12, 9, 1], VOCAB, seed=3)
    model = plain_model()
    got = run_packed(model, forward_plain, samples, [[0, 1], [2], [3, 4]], pad_multiple=4, max_seq_len=16)
    logit, loss, grad = diffs(got, run_reference(model, reference_plain, samples))
    assert logit <= TOL and loss <= TOL and grad <= TOL, (logit, loss, grad)


@given(case=split_batches())
@example(case=([5, 10, 3, 7], [[3], [1, 0], [2]], 1))
@settings(max_examples=8, deadline=None)
def test_sequence_mean_is_exact(case):
    lens, splits, seed = case
    samples = random_samples(lens, VOCAB, seed=seed)
    model = plain_model()
    got = run_packed(model, forward_plain, samples, splits, pad_multiple=2, mode="sequence")
    ref = run_reference(model, reference_plain, samples, mode="sequence")
    logit, loss, grad = diffs(got, ref)
    assert loss <= TOL and grad <= TOL, (loss, grad)


def test_per_row_means_are_wrong_and_ours_are_not():
    """The bug seen in the wild: averaging each micro-batch's own mean weighs short
    and long answers differently from the unpacked loss."""
    samples = random_samples([40, 3, 4], VOCAB, seed=0, p_train=1.0)
    model = plain_model()
    splits = [[0], [1, 2]]
    batches = [pack_step(*padded_batch([samples[i] for i in idx])) for idx in splits]
    with torch.no_grad():
        per_row = [token_losses(forward_plain(model, b), b) for b in batches]
        row_means = torch.stack([loss.sum() / b.num_label_tokens for loss, b in zip(per_row, batches)]).mean()
        n = count_label_tokens(batches)
        ours = sum(token_mean_loss(forward_plain(model, b), b, n) for b in batches)
    ref = run_reference(model, reference_plain, samples)[0]
    assert abs(float(ours) - ref) <= TOL
    print(f"per-row means: |dloss| {abs(float(row_means) - ref):.2e} = {abs(float(row_means) - ref) / TOL:.1e} x TOL")
    assert abs(float(row_means) - ref) > 1e-2


def test_no_targets_gives_zero_not_nan():
    samples = [Sample([5, 6, 7], [True, False, False], 0)]  # the only trainable token is the first: no target
    b = pack_step(*padded_batch(samples))
    assert b.num_label_tokens == 0
    model = plain_model()
    model.zero_grad(set_to_none=True)
    logits = forward_plain(model, b)
    n = count_label_tokens(b)
    loss = token_mean_loss(logits, b, n) + sequence_mean_loss(logits, b, count_sequences(b))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads(model))


def test_counts_and_sums_from_boundaries():
    samples = [Sample([1, 2, 3, 4], [0, 1, 1, 1], 0), Sample([5, 6], [0, 0], 1), Sample([7, 8, 9], [0, 0, 1], 2)]
    b = pack_step(*padded_batch(samples), pad_multiple=4)
    assert int(count_label_tokens([b, b], group=False)) == 8
    assert int(count_sequences(b)) == 2  # sample 1 has no target
    logits = torch.zeros(b.num_tokens, VOCAB)  # uniform: every target costs log(V)
    sums, counts = sequence_loss_sums(logits, b)
    assert counts.tolist() == [3, 0, 1]
    assert torch.allclose(sums, torch.tensor([3, 0, 1]) * np.log(VOCAB))
    assert torch.allclose(sequence_mean_loss(logits, b, 2), torch.tensor(np.log(VOCAB), dtype=torch.float32))
    # HF-shaped logits (1, T, V) are accepted as is.
    assert torch.allclose(token_mean_loss(logits[None], b, 4), torch.tensor(np.log(VOCAB), dtype=torch.float32))
    with pytest.raises(ValueError, match="logits cover 3 slots but labels has 12"):
        token_losses(logits[:3], b)


def test_loss_dtype_follows_the_logits():
    """float64 logits keep float64 (the exactness tests rely on it); float32 stays
    float32; bfloat16 and float16 are computed in float32."""
    samples = [Sample([1, 2, 3, 4], [0, 1, 1, 1], 0)]
    b = pack_step(*padded_batch(samples))
    logits = torch.randn(b.num_tokens, VOCAB, generator=torch.Generator().manual_seed(0), dtype=F64)
    for dtype, want in [(F64, F64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)]:
        x = logits.to(dtype)
        assert token_losses(x, b).dtype == want
        assert token_mean_loss(x, b, count_label_tokens(b)).dtype == want
        assert sequence_mean_loss(x, b, count_sequences(b)).dtype == want
    exact = F.cross_entropy(logits[:3], b.labels[:3], reduction="sum") / 3
    # float64, two computations of a 3-term mean of log-softmaxes over 97 logits: n <= 100
    # roundings each on magnitudes <= 10, 2 * 100 * 1.1e-16 * 10 = 2.2e-13 (any summation order)
    assert abs(float(token_mean_loss(logits, b, 3)) - float(exact)) <= 1e-12
