"""Same training as unpacked: every path, both boundary modes, 20 AdamW steps.

Each packed run records which conversations every step saw (its rows'
``sequence_ids``); the reference trains a fresh copy of the model on exactly
those conversations as right-padded batches (each conversation alone in its
row), with the same global token-mean normalisation. The comparisons run in
**float64** (model, loss and optimizer), where packing must agree to a fixed
1e-10, and any real bug moves the loss by more than 1e-3 (the negative controls
below show it, at 1e7x the tolerance or more). No tolerance here is measured.

Why 1e-10 holds on any CPU (float64 unit roundoff u = 2**-53 = 1.1e-16):
packed and reference compute the same real-valued function of the same
conversations, so they differ only by rounding: other summation orders in the
matmuls, attention and reductions (other shapes, vector widths, thread counts),
never other terms. The longest chain of roundings behind one step's loss or
gradient is n <= 1.5e4 (forward and backward through 2 layers of width 16,
segments <= 60 tokens, 97 logits, <= 4 x 60 targets, and the clipping norm over
the ~11k parameters). Whatever the order, a sum's rounding error is at most
n*u = 1.7e-12 of the sum of its terms' magnitudes (Higham, Accuracy and Stability
of Numerical Algorithms, 2nd ed., section 3.1); twice that for two runs: 3.3e-12
relative per step. The loss is about 4.6, so one step's loss moves by <= 1.5e-11
from the same parameters: 1e-10 is 7x that worst case.

Later steps and the parameters after 20 steps also carry the optimizer's effect,
and there the worst case says little: AdamW's first update of a coordinate is
lr * g / (|g| + eps), so a rounding error d in a gradient g near zero moves the
update by up to lr * d / eps (lr / eps = 1e6 here; the smallest non-zero |g| in
these runs is about 9e-10, fixed by the seeded data and initialisation, the
same on any CPU). This amplification is what failed in float32 (below): 2.4e-5
after 20 steps on one CPU. Float64 rounds 2**29 = 5.4e8 times finer than
float32, so the same mechanism, however unlucky the CPU's summation order,
gives 2.4e-5 / 5.4e8 = 4.5e-14, and 1e-10 leaves a factor 2,000 above it
(observed here: about 1e-15 for the losses and 1e-14 for the parameters). A
packing bug is not rounding: it moves the loss by more than 1e-3 in the first
step already (the negative controls), so the first step's rigorous bound alone
separates bugs from rounding by 1e7.

The float32 check (the default dtype) compares the first optimizer step (loss
and gradient norm, both functions of the same initial parameters) with a fixed
tolerance from the same count (u = 2**-24 = 6.0e-8). In float32 the worst case
n*u is too coarse to say anything, but rounding errors grow like sqrt(n)*u, not
n*u (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019: an n-term sum's error
exceeds lambda*sqrt(n)*u of its magnitude sum with probability at most
2*exp(-lambda**2/2), whatever the order); lambda = 10 makes that 4e-22. The loss
is a forward pass only, n <= 1,000: 10 * sqrt(1000) * 6e-8 = 1.9e-5 relative per
run, 3.8e-5 for two, 1.75e-4 on a loss of 4.6 -> tolerance 2e-4 absolute. The
gradient norm adds the backward pass and the sum over the parameters, n <= 1.5e4:
2 * 10 * sqrt(1.5e4) * 6e-8 = 1.5e-4 relative. Whole 20-step float32 runs are
not compared parameter by parameter: AdamW divides by sqrt(v) + 1e-8, so a
coordinate whose gradient is within float32 rounding of zero can flip its first
update (+-lr): a float32 difference there is rounding amplified by lr/eps, not a
packing error (this is what failed once: 2.4e-5 against a tolerance that had been
measured, 1.6e-7, on another CPU).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sftpack import IGNORE_INDEX
from sftpack.loop import ReplaySource, make_source, train
from sftpack.loop._model import LossModule
from sftpack.loss import token_losses
from sftpack.offline import prepack_samples
from tests.helpers import max_loss_diff, max_param_diff, tiny_config, tiny_model

F64 = torch.float64
LOSS_TOL_64 = 1e-10  # float64: 7x the worst-case bound of one step's loss (1.5e-11); see above
PARAM_TOL_64 = 1e-10  # float64: 2,000x AdamW's amplified rounding scaled from float32 (4.5e-14); see above
LOSS_TOL_32 = 2e-4  # float32 first step: 2 * 10 * sqrt(1000) * 6e-8 * 4.6 = 1.75e-4
GRAD_NORM_RTOL_32 = 1.5e-4  # float32 first step: 2 * 10 * sqrt(1.5e4) * 6e-8, relative
BUG = 1e-3  # what every negative control below must move the loss by, at least


def _prepack(samples, tmp_path_factory):
    return prepack_samples(samples, tmp_path_factory.mktemp("prepack") / "rows", max_seq_len=128).path


PATHS = {
    "trainer": dict(packing="trainer", pad_multiple=4),
    "loader": dict(packing="loader", batch_size=2, buffer_size=16, pad_multiple=4),
    "offline": dict(packing="offline", batch_size=2),
}


def _run(path, boundaries, samples, prepacked, dtype=F64, **kw):
    cfg = tiny_config(boundaries=boundaries, **PATHS[path], **kw)
    src = make_source(
        cfg,
        samples=None if path == "offline" else samples,
        prepacked=prepacked if path == "offline" else None,
    )
    return train(cfg, source=src, model=tiny_model(dtype=dtype))


def _reference(samples, packed_run, dtype=F64, **kw):
    by_id = {s.conversation_id: s for s in samples}
    steps = [[by_id[c] for c in step] for step in packed_run.conversations]
    cfg = tiny_config(packing="none", **kw)
    return train(cfg, source=ReplaySource(steps), model=tiny_model(dtype=dtype))


def _check64(packed, reference):
    dl = max_loss_diff(packed.losses, reference.losses)
    dp = max_param_diff(packed.model, reference.model)
    print(f"float64: max |dloss| {dl:.2e}, max |dparam| {dp:.2e} (tolerance 1e-10)")
    assert dl <= LOSS_TOL_64, dl
    assert dp <= PARAM_TOL_64, dp
    assert packed.losses[-1] < packed.losses[0] - 0.5  # it really trained
    return dl, dp


@pytest.fixture(scope="module")
def prepacked(samples, tmp_path_factory):
    return _prepack(samples, tmp_path_factory)


@pytest.fixture(scope="module")
def baseline(samples):
    """The unpacked run of the trainer path's conversations (same seed, same batches)."""
    cfg = tiny_config(packing="none")
    return train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(dtype=F64))


def test_unpacked_regrouping_is_exact_in_float64(samples, baseline):
    """Two unpacked runs that group each step's conversations into 1 or 2
    micro-batches: other matmul shapes and summation orders, the same function."""
    cfg = tiny_config(packing="none", grad_accum=2)
    other = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(dtype=F64))
    assert [sorted(x) for x in other.conversations] == [sorted(x) for x in baseline.conversations]
    _check64(other, baseline)


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_trainer_path_equals_padded_batches(samples, baseline, boundaries):
    run = _run("trainer", boundaries, samples, None)
    # The contract: same seed and batch size -> the same conversations in every step.
    assert [sorted(c) for c in run.conversations] == [sorted(c) for c in baseline.conversations]
    assert all(r.slots < b.slots for r, b in zip(run.logs, baseline.logs))  # really packed
    _check64(run, baseline)


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_loader_path_equals_unpacked(samples, boundaries):
    run = _run("loader", boundaries, samples, None)
    assert all(r.slots == 2 * 128 for r in run.logs)
    _check64(run, _reference(samples, run))


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_offline_path_equals_unpacked(samples, prepacked, boundaries):
    run = _run("offline", boundaries, samples, prepacked)
    seen = [c for step in run.conversations for c in step]
    assert len(seen) > 2 * run.logs[-1].step  # several conversations per row
    _check64(run, _reference(samples, run))


@pytest.mark.parametrize("boundaries", ["real", "padded"])
@pytest.mark.parametrize("path", ["trainer", "loader", "offline"])
def test_float32_first_step_matches(samples, prepacked, path, boundaries):
    """The default dtype: the first step's loss and gradient norm (same initial
    parameters, other grouping) within the float32 rounding bound derived above."""
    run = _run(path, boundaries, samples, prepacked, dtype=torch.float32, steps=1)
    ref = _reference(samples, run, dtype=torch.float32, steps=1)
    (a,), (b,) = run.logs, ref.logs
    assert a.label_tokens == b.label_tokens and a.sequences == b.sequences
    dl, dg = abs(a.loss - b.loss), abs(a.grad_norm - b.grad_norm) / b.grad_norm
    print(f"float32 step 1: |dloss| {dl:.2e} (tol {LOSS_TOL_32:.0e}), |dgrad_norm|/norm {dg:.2e}")
    assert dl <= LOSS_TOL_32, dl
    assert dg <= GRAD_NORM_RTOL_32, dg


# ------------------------------------------------------------ negative controls
class _Broken:
    """A source whose packed micro-batches carry one real packing bug."""

    def __init__(self, inner, bug):
        self.inner, self.bug = inner, bug

    def next_step(self):
        return [self.bug(mb) for mb in self.inner.next_step()]

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)

    def fingerprint(self):
        return self.inner.fingerprint()


def _one_segment(mb):
    """Cross-conversation attention: the row's boundaries dropped (one causal
    sequence over the whole row; positions still restart)."""
    T = mb.num_tokens
    whole = torch.tensor([0, T], dtype=mb.cu_seqlens.dtype)
    return dataclasses.replace(mb, cu_seqlens=whole, cu_seqlens_padded=whole.clone(), max_seqlen=T)


def _label_across_boundary(mb):
    """The last real token of each conversation trained to predict the next
    conversation's first token."""
    labels = mb.labels.clone()
    cu, cup = mb.cu_seqlens.tolist(), mb.cu_seqlens_padded.tolist()
    for i in range(len(cu) - 2):
        last = cup[i] + (cu[i + 1] - cu[i]) - 1
        labels[last] = mb.input_ids[cup[i + 1]]
    assert int((labels != mb.labels).sum()) == len(cu) - 2
    return dataclasses.replace(mb, labels=labels)


@pytest.mark.parametrize(
    "bug", [_one_segment, _label_across_boundary], ids=["cross-attention", "label-across-boundary"]
)
def test_negative_controls_fail_by_orders_of_magnitude(samples, baseline, bug):
    """The same float64 comparison on a trainer-path run with one packing bug:
    the loss moves by more than 1e-3, >= 1e7x the tolerance."""
    cfg = tiny_config(packing="trainer", boundaries="padded", pad_multiple=4)
    src = _Broken(make_source(cfg, samples=samples), bug)
    run = train(cfg, source=src, model=tiny_model(dtype=F64))
    assert [sorted(c) for c in run.conversations] == [sorted(c) for c in baseline.conversations]
    dl = max_loss_diff(run.losses, baseline.losses)
    print(f"{bug.__name__}: max |dloss| {dl:.2e} = {dl / LOSS_TOL_64:.1e} x the float64 tolerance")
    assert dl > BUG, dl


def test_negative_control_per_row_mean(samples):
    """Averaging each row's own token mean (the bug seen in the wild) instead of the
    global token mean: on the same rows, same float64 model, the loss moves > 1e-3."""
    cfg = tiny_config(packing="trainer", pad_multiple=4, max_seq_len=64, grad_accum=2)
    src = make_source(cfg, samples=samples)
    model = tiny_model(dtype=F64)
    loss_module = LossModule(model, pad_between_seqs=True)  # what train() runs
    worst = 0.0
    with torch.no_grad():
        for _ in range(5):
            mbs = src.next_step()
            n = sum(mb.num_label_tokens for mb in mbs)
            ours = sum(float(loss_module(mb, torch.tensor(n))) for mb in mbs)  # the global token mean
            means = []
            for mb in mbs:
                kw = mb.to_hf_kwargs()
                kw.pop("labels")
                logits = model(**kw).logits[0]
                means.append(float(token_losses(logits, mb).sum()) / mb.num_label_tokens)
            per_row = sum(means) / len(means)
            assert len(mbs) >= 2 and all(mb.labels.ne(IGNORE_INDEX).any() for mb in mbs)
            worst = max(worst, abs(per_row - ours))
    print(f"per-row mean: max |dloss| {worst:.2e} = {worst / LOSS_TOL_64:.1e} x the float64 tolerance")
    assert worst > BUG, worst
