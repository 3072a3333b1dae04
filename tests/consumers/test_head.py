"""The fused output head equals ``token_mean_loss(F.linear(h, W, b), labels, n)``: loss and gradients.

Inputs are drawn uniform in [-1, 1] with H <= 16, V <= 64, n <= 41 rows, a count
``n`` at least this call's targets and ``average_over_ranks`` a <= 2. A logit is an
(H+1)-term dot product (with the bias) of magnitude sum <= 17; a row's loss
(logsumexp minus the target logit) is <= 2 * 17 + ln 64 < 39.

**float64** (u = 2**-53 = 1.1e-16), reference and fused head computed
independently; worst case (Higham, Accuracy and Stability, 2nd ed., section 3.1:
an m-term sum is off by <= m*u of its terms' magnitude sum, in any order):

- a logit: <= 17 * u * 17 = 3.2e-14 absolute;
- the exponential sum z of a row: each term off by 2 * 3.2e-14 + 2u relative (its
  logit and the max), the V-term sum adds 64u: 7.1e-14 relative, so log z is off by
  <= 7.2e-14; a row's loss (max + log z - target) by <= 3.2e-14 + 7.2e-14 + 3.2e-14
  + 3 * u * 39 = 1.5e-13;
- the loss, a sum of <= 41 rows over a count >= their number, times a <= 2:
  <= 2 * (1.5e-13 + 41 * u * 39) = 6.5e-13;
- a softmax value p = exp(x - max) / z: <= 2 * 3.2e-14 + 7.1e-14 + 2u = 1.4e-13
  relative; the logits' gradient is g * (p - onehot), g = a / count;
- d/dh: a V-term sum of magnitude <= g * sum_v |p - onehot| * 1 <= 2g <= 2a/8:
  <= 0.5 * (1.4e-13 + 64u) = 7.4e-14; d/dW and d/db: an n-term sum of magnitude
  <= g * n <= a = 2: <= 2 * (1.4e-13 + 41u) = 2.9e-13.

Two independent runs: twice that, at most 1.3e-12 -> ``TOL_64 = 2e-12``
(observed: about 1e-16).

**float32** (u = 2**-24 = 6.0e-8): the fused head in float32 against the float64
reference of the same inputs, one run's rounding, a = 1. Worst-case m*u is too
coarse here; rounding errors grow like sqrt(m)*u (Higham & Mary, SIAM J. Sci.
Comput. 41(5), 2019: exceeded by lambda*sqrt(m)*u of the magnitude sum with
probability <= 2*exp(-lambda**2/2); lambda = 10: 4e-22): a logit 10 * sqrt(17) * u
* 17 = 4.2e-5; a row's loss 2 * 4.2e-5 + 2 * 4.2e-5 + 10 * sqrt(64) * u = 1.7e-4,
the sum over rows adds 10 * sqrt(41) * u * 39 = 1.5e-4: 3.2e-4; a softmax value
1.3e-4 relative, so a gradient entry <= max(2g, g*n) * (1.3e-4 + 10 * sqrt(64) * u)
<= 1.4e-4 -> ``TOL_32 = 4e-4`` for all.

A wrong gradient (the softmax without the target's one-hot subtracted) moves the
gradients by more than 1e-2 (``test_negative_control``): 5e9x the float64 tolerance
and 25x the float32 one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sftpack.head import DEFAULT_CHUNK_BYTES, fused_linear_cross_entropy, head_impl
from sftpack.loss import token_mean_loss

F64 = torch.float64
TOL_64 = 2e-12  # float64, loss and gradients: 1.5x the worst case of two runs, 1.3e-12; see the docstring
TOL_32 = 4e-4  # float32 against the float64 reference: the lambda*sqrt(m)*u bound 3.2e-4
BUG = 1e-2  # what the negative control's wrong gradient moves, at least


def _inputs(n=23, h=16, v=61, *, dtype=F64, bias=True, ignore=(), seed=0):
    g = torch.Generator().manual_seed(seed)

    def u(*shape):
        return (torch.rand(*shape, generator=g, dtype=F64) * 2 - 1).to(dtype).requires_grad_()

    labels = torch.randint(0, v, (n,), generator=g)
    labels[list(ignore)] = -100
    return u(n, h), u(v, h), u(v) if bias else None, labels


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None and t.requires_grad])


def _reference(h, w, b, labels, n, avg=1):
    """token_mean_loss over F.linear in float64 with autograd (the definition)."""
    args = [t.detach().to(F64).requires_grad_(t.requires_grad) for t in (h, w)]
    b64 = None if b is None else b.detach().to(F64).requires_grad_(b.requires_grad)
    loss = token_mean_loss(F.linear(args[0], args[1], b64), labels, n, average_over_ranks=avg)
    return loss, _grads(loss, [*args, b64])


def _fused(h, w, b, labels, n, avg=1, **kw):
    loss = fused_linear_cross_entropy(h, w, labels, n, bias=b, average_over_ranks=avg, **kw)
    return loss, _grads(loss, [h, w, b])


def _diff(a, b):
    return max(float((x.detach().to(F64) - y.to(F64)).abs().max()) for x, y in zip(a, b))


def _check(ref, got, tol, tol_grad):
    (rl, rg), (fl, fg) = ref, got
    assert len(rg) == len(fg)
    dl, dg = abs(rl.item() - fl.item()), _diff(rg, fg)
    assert dl <= tol, dl
    assert dg <= tol_grad, dg


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 8, None])  # None: the default budget, one chunk
@pytest.mark.parametrize("bias", [True, False])
def test_float64_matches_reference(rows_per_chunk, bias):
    h, w, b, y = _inputs(bias=bias, ignore=(0, 5, 6, 22))
    n, v = 19 + 7, w.shape[0]  # a global count above this call's 19 targets (other micro-batches)
    chunk = DEFAULT_CHUNK_BYTES if rows_per_chunk is None else rows_per_chunk * v * 8
    _check(_reference(h, w, b, y, n, 2), _fused(h, w, b, y, n, 2, chunk_bytes=chunk), TOL_64, TOL_64)


def test_float32_matches_float64_reference():
    h, w, b, y = _inputs(n=40, dtype=torch.float32, ignore=range(0, 40, 7))
    n = int((y != -100).sum())
    fl, fg = _fused(h, w, b, y, n, chunk_bytes=5 * w.shape[0] * 4)
    assert fl.dtype == torch.float32 and all(g.dtype == torch.float32 for g in fg)
    _check(_reference(h, w, b, y, n), (fl, fg), TOL_32, TOL_32)


def test_all_rows_ignored_gives_zero_not_nan():
    h, w, b, y = _inputs(n=5, ignore=range(5))
    loss, grads = _fused(h, w, b, y, torch.tensor(0))
    assert loss.item() == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    empty = fused_linear_cross_entropy(h[:0], w, y[:0], 0, bias=b)
    assert empty.item() == 0.0


def test_reductions_and_integer_counts():
    h, w, b, y = _inputs(ignore=(1, 2))
    ref_sum = token_mean_loss(F.linear(h, w, b), y, 1)
    got = fused_linear_cross_entropy(h, w, y, bias=b)  # reduction="sum"
    assert abs(got.item() - ref_sum.item()) <= TOL_64 * 21  # a sum of 21 rows: 21x the mean's bound
    mean = fused_linear_cross_entropy(h, w, y, bias=b, reduction="mean")
    assert abs(mean.item() - ref_sum.item() / 21) <= TOL_64
    with pytest.raises(ValueError, match="not both"):
        fused_linear_cross_entropy(h, w, y, 21, reduction="mean")


def test_tied_weights_accumulate_both_uses():
    """The head's weight is the input embedding (tied): both gradients add up."""
    g = torch.Generator().manual_seed(1)
    emb = (torch.rand(61, 16, generator=g, dtype=F64) * 2 - 1).requires_grad_()
    ids = torch.randint(0, 61, (20,), generator=g)
    y = torch.randint(0, 61, (20,), generator=g)
    y[3] = -100

    def run(fused):
        hidden = torch.tanh(F.embedding(ids, emb))
        if fused:
            loss = fused_linear_cross_entropy(hidden, emb, y, 19, chunk_bytes=4 * 61 * 8)
        else:
            loss = token_mean_loss(F.linear(hidden, emb), y, 19)
        (grad,) = torch.autograd.grad(loss, emb)
        return loss, grad

    (rl, rg), (fl, fg) = run(False), run(True)
    assert abs(rl.item() - fl.item()) <= TOL_64
    assert float((rg - fg).abs().max()) <= TOL_64
    # the embedding's own share is in there: without it the gradient would differ
    only_head = torch.autograd.grad(
        token_mean_loss(F.linear(torch.tanh(F.embedding(ids, emb)).detach(), emb), y, 19), emb
    )[0]
    assert float((only_head - fg).abs().max()) > BUG


def test_frozen_weight_and_frozen_hidden():
    h, w, b, y = _inputs(ignore=(4,))
    w.requires_grad_(False)
    b.requires_grad_(False)
    ref = _reference(h, w, b, y, 22)
    got = _fused(h, w, b, y, 22)
    assert len(got[1]) == 1  # hidden only
    _check(ref, got, TOL_64, TOL_64)
    h2, w2, b2, _ = _inputs(ignore=(4,))
    h2.requires_grad_(False)
    _check(_reference(h2, w2, b2, y, 22), _fused(h2, w2, b2, y, 22), TOL_64, TOL_64)


def test_no_grad_gives_the_loss():
    h, w, b, y = _inputs(ignore=(0,))
    with torch.no_grad():
        got = fused_linear_cross_entropy(h, w, y, 22, bias=b)
        ref = token_mean_loss(F.linear(h, w, b), y, 22)
    assert not got.requires_grad
    assert abs(float(got) - float(ref)) <= TOL_64


def test_deterministic_bytes():
    h, w, b, y = _inputs(n=30, dtype=torch.float32, ignore=(2, 9))
    runs = [_fused(h, w, b, y, 28, chunk_bytes=7 * 61 * 4) for _ in range(2)]
    assert runs[0][0].detach().numpy().tobytes() == runs[1][0].detach().numpy().tobytes()
    for a, c in zip(runs[0][1], runs[1][1]):
        assert a.numpy().tobytes() == c.numpy().tobytes()


def test_negative_control():
    """Forgetting the target's one-hot in the gradient (the softmax alone) moves the
    gradients by far more than the tolerance: the comparison would catch it."""
    h, w, b, y = _inputs(ignore=(3,))
    _, fg = _fused(h, w, b, y, 22)
    wrong = torch.logsumexp(F.linear(h, w, b)[y != -100], dim=1).sum() / 22  # no target term
    wg = _grads(wrong, [h, w, b])
    print(f"no one-hot: max |dgrad| {_diff(fg, wg):.2e}")
    assert _diff(fg, wg) > BUG


def test_double_backward_is_refused():
    h, w, b, y = _inputs()
    loss = fused_linear_cross_entropy(h, w, y, 23, bias=b)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, h, create_graph=True)


def test_bad_input_says_what_and_where():
    h, w, b, y = _inputs()
    y = y.clone()
    y[7] = 61
    with pytest.raises(ValueError, match=r"labels\[7\] = 61 is not a class id in \[0, 61\)"):
        fused_linear_cross_entropy(h, w, y, 23)
    with pytest.raises(ValueError, match="same H"):
        fused_linear_cross_entropy(h, w[:, :3], y, 23)
    with pytest.raises(ValueError, match="labels must be"):
        fused_linear_cross_entropy(h, w, y[:3], 23)
    with pytest.raises(ValueError, match="impl='nope'"):
        fused_linear_cross_entropy(h, w, y, 23, impl="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs CUDA"):
        head_impl("liger", h)
    assert head_impl("auto", h) == "torch"


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(8, 40),
    hdim=st.integers(1, 16),
    v=st.integers(2, 64),
    rows=st.integers(1, 41),
    seed=st.integers(0, 2**16),
    bias=st.booleans(),
)
def test_hypothesis_shapes(n, hdim, v, rows, seed, bias):
    h, w, b, y = _inputs(n=n, h=hdim, v=v, bias=bias, seed=seed)
    y[torch.arange(n) % 5 == 0] = -100
    cnt = int((y != -100).sum())
    ref = _reference(h, w, b, y, cnt)
    got = _fused(h, w, b, y, cnt, chunk_bytes=rows * v * 8)
    _check(ref, got, TOL_64, TOL_64)


def _kernels():
    if not torch.cuda.is_available():
        return []
    return [k for k in ("liger", "cce") if _installed(k)]


def _installed(k):
    try:
        head_impl(k, torch.zeros(1, 1, device="cuda"))
    except (ImportError, ValueError):
        return False
    return True


@pytest.mark.skipif(not _kernels(), reason="needs CUDA and liger-kernel or cut-cross-entropy")
@pytest.mark.parametrize("kernel", ["liger", "cce"])
def test_cuda_kernel_agrees_with_torch(kernel):
    """The CUDA kernel and the chunked PyTorch head on the same bf16 inputs: loss and gradients
    within bf16 rounding of a 4096-wide head (relative 2 * 2**-8 of each quantity's scale)."""
    if kernel not in _kernels():
        pytest.skip(f"{kernel} not installed")
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(512, 256, generator=g) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(4096, 256, generator=g) * 0.05).to("cuda", torch.bfloat16).requires_grad_()
    y = torch.randint(0, 4096, (512,), generator=g).cuda()
    y[::9] = -100
    n = int((y != -100).sum())
    out = {}
    for impl in ("torch", kernel):
        loss = fused_linear_cross_entropy(h, w, y, n, impl=impl)
        out[impl] = (loss, torch.autograd.grad(loss, (h, w)))
    (tl, tg), (kl, kg) = out["torch"], out[kernel]
    assert abs(tl.item() - kl.item()) <= 2 * 2**-8 * abs(tl.item())
    for a, c in zip(tg, kg):
        assert float((a.float() - c.float()).abs().max()) <= 2 * 2**-8 * float(a.float().abs().max()) + 1e-6
