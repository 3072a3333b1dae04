"""Exactness through the loader path: rows from PackingDataset (padded boundaries for both, the
loader's default) give the logits, loss and gradients of the conversations alone, and the same
real-token outputs as the same rows with real + padded boundaries.

In float64, to a fixed 1e-10 (the derivation is tests/consumers/test_exactness.py's:
the same function in other summation orders, <= 4.4e-12 for this model). The
negative control (the row run as one causal sequence) moves the logits by > 1e-3."""

from __future__ import annotations

import pytest
import torch

from sftpack.exactness import TinyCausalLM, check_plain_model, random_samples
from sftpack.loader import PackingDataset

VOCAB = 97
TOL = 1e-10  # float64; see the docstring
BUG = 1e-3


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_loader_rows_are_exact_in_both_boundary_modes(pad_multiple):
    samples = random_samples([5, 10, 37, 3, 22, 61, 9, 30], VOCAB, seed=pad_multiple)
    ds = PackingDataset(samples, max_seq_len=96, buffer_size=6, pad_multiple=pad_multiple)
    model = TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=torch.float64)
    rows = list(ds)
    assert len(rows) >= 2 and sum(r.num_sequences for r in rows) == len(samples)
    for row in rows:
        mine = [samples[i] for i in row.sequence_ids]
        padded = check_plain_model(model, mine, row, pad_between_seqs=ds.pad_between_seqs)
        assert ds.pad_between_seqs is False
        assert padded.within(logits=TOL, loss=TOL, grads=TOL), padded
        # identical outputs on real tokens in both modes (so the same loss and gradients)
        with torch.no_grad():
            a = model(row.input_ids, row.position_ids, row.to_packed_seq_params(pad_between_seqs=False))
            b = model(row.input_ids, row.position_ids, row.to_packed_seq_params(pad_between_seqs=True))
        m = row.real_token_mask
        assert torch.allclose(a[m], b[m], atol=TOL, rtol=0)
    row = next(r for r in rows if r.num_sequences > 1)  # the negative control: one causal run is not exact
    bad = check_plain_model(model, [samples[i] for i in row.sequence_ids], row, contaminate=True)
    print(f"contaminated: max |dlogit| {bad.max_logit_diff:.2e} = {bad.max_logit_diff / TOL:.1e} x TOL")
    assert bad.max_logit_diff > BUG, bad
