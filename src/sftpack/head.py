"""The output head and its loss in one pass: linear + cross-entropy over supervised rows.

With a real vocabulary the output head dominates a small model's step: every
supervised slot needs a logit per id (151,646 of them for the embedded
tokenizer), the softmax over those, and the gradients of both matmuls.
:func:`fused_linear_cross_entropy` computes the loss of ``hidden @ weight.T (+ bias)``
and, in the same pass, its gradients, so nothing is recomputed and no logits of
the whole run are ever held:

- the rows are walked in chunks whose logits fit ``chunk_bytes`` (a fixed memory
  budget, whatever the number of rows);
- each chunk's logits go into *one* buffer allocated once and reused, and the
  softmax gradient is formed in place there (``softmax - onehot``: 1 is subtracted
  at the target column by index; no one-hot tensor);
- the chunk's gradients go straight into ``grad_hidden`` (its rows) and
  ``grad_weight`` (accumulated); the backward pass only multiplies them by the
  incoming gradient.

The loss has :func:`sftpack.loss.token_mean_loss`'s meaning: the summed token loss
(computed in :func:`sftpack.loss.loss_dtype`) divided by the *global* number of
supervised targets, times ``average_over_ranks``. Rows whose label is
``ignore_index`` contribute nothing (they are dropped before the matmul). The
result is deterministic: the same inputs give the same bits.

On CUDA, where Liger-Kernel or Apple's cut-cross-entropy is installed,
``impl="auto"`` hands the work to their fused kernels behind the same function
(``impl="torch"`` forces the chunked PyTorch implementation, which is the one
used on CPU and in float64).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.autograd.function import FunctionCtx

from .loss import loss_dtype
from .sample import IGNORE_INDEX

__all__ = ["DEFAULT_CHUNK_BYTES", "fused_linear_cross_entropy", "head_impl"]

#: default memory budget of one chunk's logits (in the loss dtype): 64 MiB
DEFAULT_CHUNK_BYTES = 64 << 20

Impl = Literal["auto", "torch", "liger", "cce"]
_IMPLS = ("auto", "torch", "liger", "cce")


def _optional(module: str, name: str) -> Callable[..., Any] | None:
    """``module.name`` where the package is installed (imported on first use), else ``None``."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:  # an optional GPU kernel package may fail to import for reasons of its own (no triton, ...)
        return None


def _liger() -> Callable[..., Any] | None:
    fn = _optional("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")
    if fn is not None:
        return fn
    cls = _optional("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss")
    if cls is None:
        return None

    def call(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, bias: Any, ignore_index: int, reduction: str) -> Any:
        return cls(ignore_index=ignore_index, reduction=reduction)(w, h, y, bias)

    return call


def _cce() -> Callable[..., Any] | None:
    return _optional("cut_cross_entropy", "linear_cross_entropy")


def head_impl(impl: Impl, hidden: torch.Tensor) -> str:
    """The implementation ``impl`` resolves to for ``hidden``: ``"torch"``, ``"liger"`` or ``"cce"``.

    ``"auto"`` picks Liger-Kernel, then cut-cross-entropy, for CUDA tensors of a
    floating type other than float64 when the package is installed; otherwise the
    chunked PyTorch implementation. Naming a kernel that cannot run raises.

    >>> head_impl("auto", torch.zeros(2, 3))
    'torch'
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {', '.join(map(repr, _IMPLS))}")
    if impl == "torch":
        return "torch"
    kernel_ok = hidden.is_cuda and hidden.dtype != torch.float64
    if impl == "auto":
        if kernel_ok and _liger() is not None:
            return "liger"
        if kernel_ok and _cce() is not None:
            return "cce"
        return "torch"
    if not kernel_ok:
        raise ValueError(
            f"impl={impl!r} needs CUDA tensors of a half or float32 type, got {hidden.dtype} on {hidden.device}; "
            "use impl='torch' (or 'auto')"
        )
    if (_liger() if impl == "liger" else _cce()) is None:
        package = "liger-kernel" if impl == "liger" else "cut-cross-entropy"
        raise ImportError(f"impl={impl!r} needs {package}: pip install {package} (or use impl='auto')")
    return impl


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H) with the same H, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}; flatten the batch first (hidden.flatten(0, -2))"
        )
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must be ({hidden.shape[0]},) like hidden's rows, got {tuple(labels.shape)}")
    if labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64 class ids, got {labels.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},) like weight's rows, got {tuple(bias.shape)}")


class _FusedHead(torch.autograd.Function):
    """``sum of token losses / denom * avg`` of ``hidden @ weight.T + bias``, gradients formed in the forward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        denom: torch.Tensor,
        avg: int,
        ignore_index: int,
        chunk_bytes: int,
        grads: bool,
        row_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        need_h, need_w, need_b = (grads and bool(n) for n in ctx.needs_input_grad[:3])  # type: ignore[attr-defined]
        ldt = loss_dtype(hidden.dtype)
        V = weight.shape[0]
        valid = labels != ignore_index
        every = bool(valid.all())
        keep = None if every else valid.nonzero().flatten()
        h_all = hidden.detach() if keep is None else hidden.detach().index_select(0, keep)
        y_all = labels if keep is None else labels.index_select(0, keep)
        w_all = None
        if row_weights is not None:
            w_all = (row_weights if keep is None else row_weights.index_select(0, keep)).to(loss_dtype(hidden.dtype))
        n = h_all.shape[0]
        if n and bool(((y_all < 0) | (y_all >= V)).any()):
            bad = int(((y_all < 0) | (y_all >= V)).nonzero()[0, 0])
            slot = bad if keep is None else int(keep[bad])
            raise ValueError(
                f"labels[{slot}] = {int(y_all[bad])} is not a class id in [0, {V}) nor ignore_index={ignore_index}: "
                "the labels do not fit the head's vocabulary"
            )
        w = weight.detach()
        b = None if bias is None else bias.detach()
        dev = hidden.device
        g = torch.full((), avg, dtype=ldt, device=dev) / denom  # d loss / d (summed token loss)
        total = torch.zeros((), dtype=ldt, device=dev)
        g_h = torch.empty_like(h_all) if need_h else None
        acc_dt = ldt if w.dtype != ldt else w.dtype  # half weights: accumulate their gradient in float32
        g_w = torch.zeros(w.shape, dtype=acc_dt, device=dev) if need_w else None
        g_b = torch.zeros(V, dtype=ldt, device=dev) if need_b else None
        rows = max(1, min(n, chunk_bytes // (V * torch.finfo(ldt).bits // 8)))
        buf = torch.empty(rows, V, dtype=hidden.dtype, device=dev) if n else None
        lbuf = torch.empty(rows, V, dtype=ldt, device=dev) if n and hidden.dtype != ldt else None
        for s in range(0, n, rows):
            e = min(n, s + rows)
            h, y = h_all[s:e], y_all[s:e]
            out = buf[: e - s]  # type: ignore[index]
            if b is None:
                torch.mm(h, w.t(), out=out)
            else:
                torch.addmm(b, h, w.t(), out=out)
            lg = out if lbuf is None else lbuf[: e - s].copy_(out)
            r = torch.arange(e - s, device=dev)
            target = lg[r, y]
            m = lg.amax(dim=1, keepdim=True)
            lg.sub_(m).exp_()
            z = lg.sum(dim=1, keepdim=True)
            per_row = m.squeeze(1) + z.log().squeeze(1) - target
            if w_all is None:
                total += per_row.sum()
            else:
                total += (per_row * w_all[s:e]).sum()
            if not (need_h or need_w or need_b):
                continue
            if w_all is None:
                lg.mul_(g / z)  # the softmax, times the gradient's scale
                lg.index_put_((r, y), -g.expand(e - s), accumulate=True)  # minus the one-hot, by index
            else:  # each row's gradient times its weight
                gw = g * w_all[s:e].unsqueeze(1)
                lg.mul_(gw / z)
                lg.index_put_((r, y), -gw.squeeze(1), accumulate=True)
            d = lg if lbuf is None else out.copy_(lg)  # the logits' gradient in the matmuls' dtype
            if need_h:
                torch.mm(d, w, out=g_h[s:e])  # type: ignore[index]
            if need_w:
                if acc_dt == d.dtype:
                    g_w.addmm_(d.t(), h)  # type: ignore[union-attr]
                else:
                    g_w += d.t().mm(h).to(acc_dt)  # type: ignore[operator]
            if need_b:
                g_b += lg.sum(dim=0)  # type: ignore[operator]
        empty = torch.empty(0, device=dev)
        grad_h = empty
        if g_h is not None:
            grad_h = g_h if keep is None else torch.zeros_like(hidden).index_copy_(0, keep, g_h)
        grad_w = empty if g_w is None else g_w.to(weight.dtype)
        grad_b = empty if g_b is None or bias is None else g_b.to(bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.has = (need_h, need_w, need_b)  # type: ignore[attr-defined]
        return total / denom * avg

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # backward(create_graph=True): a second derivative was asked for
            raise RuntimeError(
                "fused_linear_cross_entropy has no second derivative (its gradients are formed in the forward "
                "pass); for double backward use token_mean_loss(F.linear(hidden, weight, bias), labels, n)"
            )
        grads: list[torch.Tensor | None] = [
            t * grad_out.to(t.dtype) if has else None
            for t, has in zip(ctx.saved_tensors, ctx.has)  # type: ignore[attr-defined]
        ]
        return (*grads, None, None, None, None, None, None, None)


def _denominator(
    num_label_tokens: int | torch.Tensor | None,
    reduction: str,
    labels: torch.Tensor,
    ignore_index: int,
    dtype: torch.dtype,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction={reduction!r}: choose 'sum' or 'mean' (or give num_label_tokens)")
    if num_label_tokens is None:
        if reduction == "sum":
            count = torch.ones((), device=labels.device)
        elif weights is None:
            count = (labels != ignore_index).sum()
        else:  # the weighted count of this call's targets
            count = weights.abs().to(torch.float64).masked_fill(labels == ignore_index, 0).sum()
    elif reduction == "mean":
        raise ValueError("give num_label_tokens or reduction='mean', not both: the count is the denominator")
    elif isinstance(num_label_tokens, torch.Tensor):
        count = num_label_tokens
    else:
        count = torch.tensor(int(num_label_tokens), device=labels.device)
    count = count.to(device=labels.device, dtype=dtype)
    if weights is not None:  # a weight sum may lie below 1 (sum |w|): only 0 is replaced
        return torch.where(count > 0, count, torch.ones_like(count))
    return count.clamp_min(1)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_label_tokens: int | torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    average_over_ranks: int = 1,
    reduction: Literal["sum", "mean"] = "sum",
    ignore_index: int = IGNORE_INDEX,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    impl: Impl = "auto",
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, without the logits.

    The same value and gradients as
    ``token_mean_loss(F.linear(hidden, weight, bias), labels, num_label_tokens,
    average_over_ranks=...)``, computed chunk by chunk in one pass (see the module
    docstring). The weight may be shared with the input embedding (tied) or frozen.

    Args:
        hidden: ``(N, H)`` the body's last hidden states (best: only the rows with a target).
        weight: ``(V, H)`` the output head's weight.
        labels: ``(N,)`` int64 target ids; ``ignore_index`` = no target.
        num_label_tokens: the *global* count of supervised targets
            (:func:`sftpack.loss.count_label_tokens`); a step with none gives 0, not NaN.
            ``None``: ``reduction`` decides.
        bias: ``(V,)`` the head's bias, if it has one.
        average_over_ranks: as in :func:`sftpack.loss.token_mean_loss`.
        reduction: without ``num_label_tokens``: ``"sum"`` of the token losses, or their
            ``"mean"`` over this call's targets.
        ignore_index: the label of rows without a target.
        chunk_bytes: memory budget of one chunk's logits (PyTorch implementation).
        impl: ``"auto"``, ``"torch"``, ``"liger"`` or ``"cce"`` (:func:`head_impl`). With
            ``weights``, ``"auto"`` is the PyTorch implementation (the fused kernels take no
            per-token weights) and ``"liger"`` / ``"cce"`` raise.
        weights: ``None``, or ``(N,)`` float per-row weights (:attr:`sftpack.PackedBatch.weights`
            of the same rows): the summed loss is ``sum(w * loss)`` and ``num_label_tokens``
            must be the weighted count ``sum |w|`` (:func:`sftpack.loss.count_label_tokens`),
            as :func:`sftpack.loss.token_mean_loss` reads a batch with weights.

    Returns:
        0-dim tensor in :func:`sftpack.loss.loss_dtype` of ``hidden``'s dtype.

    >>> h = torch.zeros(3, 2, dtype=torch.float64)
    >>> w = torch.zeros(4, 2, dtype=torch.float64)
    >>> float(fused_linear_cross_entropy(h, w, torch.tensor([1, -100, 3]), 2))  # log(4) per target
    1.3862943611198906
    """
    _check(hidden, weight, labels, bias)
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}: give a positive memory budget in bytes")
    ldt = loss_dtype(hidden.dtype)
    if weights is not None:
        if weights.shape != labels.shape or not weights.is_floating_point():
            raise ValueError(
                f"weights must be ({labels.shape[0]},) floats like labels, got {tuple(weights.shape)} {weights.dtype}"
            )
        if impl in ("liger", "cce"):
            raise ValueError(
                f"impl={impl!r} takes no per-token weights (its fused kernel sums unweighted token losses): "
                "use impl='torch' (or 'auto') for a batch with weights"
            )
    denom = _denominator(num_label_tokens, reduction, labels, ignore_index, ldt, weights)
    which = "torch" if weights is not None else head_impl(impl, hidden)
    if which == "torch":
        grads = torch.is_grad_enabled()
        return _FusedHead.apply(
            hidden, weight, bias, labels, denom, average_over_ranks, ignore_index, chunk_bytes, grads, weights
        )
    if which == "liger":
        total = _liger()(hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction="sum")  # type: ignore[misc]
    else:
        kw = {} if bias is None else {"bias": bias}
        total = _cce()(hidden, weight, labels, ignore_index=ignore_index, reduction="sum", **kw)  # type: ignore[misc]
    if isinstance(total, tuple):  # some versions return (loss, z_loss)
        total = total[0]
    return total.to(ldt) / denom * average_over_ranks
