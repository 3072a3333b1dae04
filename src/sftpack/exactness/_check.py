"""The comparison: each conversation alone against the packed row (logits, loss, gradients) on a
plain-PyTorch or a Hugging Face model, its :class:`ExactnessReport`, the independent reference
labels, and the table of worst differences ``benchmarks/bench_exactness.py`` prints."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..attention import register_hf_attention
from ..handoff import PackedBatch
from ..loss import loss_dtype
from ..sample import IGNORE_INDEX, Sample
from ._models import TinyCausalLM, tiny_llama


def reference_labels(sample: Sample) -> torch.Tensor:
    """``(L,)`` shifted labels of one conversation on its own: ``ids[t+1]`` where
    ``loss_mask[t+1]``, else -100; the last token has no target."""
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long)
    mask = torch.as_tensor(sample.loss_mask, dtype=torch.bool)
    out = torch.full_like(ids, IGNORE_INDEX)
    out[:-1] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], IGNORE_INDEX))
    return out


@dataclass
class ExactnessReport:
    """Largest differences between the packed run and the per-conversation reference."""

    max_logit_diff: float
    loss_packed: float
    loss_reference: float
    max_grad_diff: float
    num_label_tokens: int

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_packed - self.loss_reference)

    def within(self, logits: float, loss: float, grads: float) -> bool:
        return self.max_logit_diff <= logits and self.loss_diff <= loss and self.max_grad_diff <= grads


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for p in model.parameters()]


def _compare(
    model: nn.Module,
    samples: Sequence[Sample],
    packed: PackedBatch,
    run_packed: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    run_single: Callable[[Sample], tuple[torch.Tensor, torch.Tensor, int]],
) -> ExactnessReport:
    model.zero_grad(set_to_none=True)
    logits, loss = run_packed()
    loss.backward()
    g_packed = _grads(model)

    model.zero_grad(set_to_none=True)
    starts = packed.cu_seqlens_padded[:-1].tolist()
    total_sum = torch.zeros((), dtype=logits.dtype)
    total_count = 0
    max_logit = 0.0
    with_grad = []
    for s, start in zip(samples, starts):
        ref_logits, loss_sum, count = run_single(s)
        got = logits[start : start + len(s)].detach()
        max_logit = max(max_logit, float((got - ref_logits.detach()).abs().max()))
        total_sum = total_sum + loss_sum
        total_count += count
        with_grad.append(loss_sum)
    ref_loss = total_sum / max(total_count, 1)
    if total_count:
        ref_loss.backward()
    g_ref = _grads(model)
    model.zero_grad(set_to_none=True)
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(g_packed, g_ref))
    return ExactnessReport(max_logit, float(loss.detach()), float(ref_loss.detach()), grad_diff, total_count)


def _for_loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(loss_dtype(logits.dtype))


def check_plain_model(
    model: TinyCausalLM,
    samples: Sequence[Sample],
    packed: PackedBatch,
    *,
    pad_between_seqs: bool = True,
    contaminate: bool = False,
) -> ExactnessReport:
    """Run ``packed`` through ``model`` in one pass (Megatron ``PackedSeqParams`` boundaries
    in the given mode) and each sample alone; compare logits, token-mean loss, gradients.

    ``contaminate=True`` is the negative control: the packed row is run as *one*
    causal sequence (positions still restart), so later sequences see earlier ones
    and the check must fail whenever there are two or more sequences.
    """
    params = None if contaminate else packed.to_packed_seq_params(pad_between_seqs=pad_between_seqs)

    def run_packed() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(packed.input_ids, packed.position_ids, params)
        n = max(packed.num_label_tokens, 1)
        loss = F.cross_entropy(_for_loss(logits), packed.labels, ignore_index=IGNORE_INDEX, reduction="sum") / n
        return logits, loss

    def run_single(s: Sample) -> tuple[torch.Tensor, torch.Tensor, int]:
        ids = torch.as_tensor(s.input_ids)
        logits = model(ids, torch.arange(len(s)), None)
        lab = reference_labels(s)
        loss_sum = F.cross_entropy(_for_loss(logits), lab, ignore_index=IGNORE_INDEX, reduction="sum")
        return logits, loss_sum, int((lab != IGNORE_INDEX).sum())

    return _compare(model, samples, packed, run_packed, run_single)


def _hf_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``labels`` unshifted: slot ``t`` predicts
    ``labels[t + 1]``), summed, in the logits' own dtype where that is float64."""
    shifted = torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])
    return F.cross_entropy(_for_loss(logits), shifted, ignore_index=IGNORE_INDEX, reduction="sum")


def check_hf_model(model: Any, samples: Sequence[Sample], packed: PackedBatch) -> ExactnessReport:
    """Same check for a Hugging Face causal LM fed ``packed.to_hf_kwargs()``; the
    reference runs each conversation as its own ``(1, L)`` batch.

    The loss is the model's own (``labels`` passed in), except for a float64 model:
    Hugging Face's loss upcasts the logits to float32, so there the same loss (the
    same shift of the same ``labels``) is computed from the logits in float64."""
    native = next(model.parameters()).dtype != torch.float64

    def run_packed() -> tuple[torch.Tensor, torch.Tensor]:
        kw = packed.to_hf_kwargs()
        labels = kw["labels"] if native else kw.pop("labels")
        out = model(**kw)
        if packed.num_label_tokens == 0:  # Hugging Face's mean over no targets is NaN
            return out.logits[0], out.logits.sum() * 0.0
        if native:
            return out.logits[0], out.loss
        return out.logits[0], _hf_loss_sum(out.logits[0], labels[0]) / packed.num_label_tokens

    def run_single(s: Sample) -> tuple[torch.Tensor, torch.Tensor, int]:
        ids = torch.as_tensor(s.input_ids)[None]
        lab = torch.as_tensor(s.input_ids).clone()
        lab[~torch.as_tensor(s.loss_mask)] = IGNORE_INDEX
        lab[0] = IGNORE_INDEX  # the first token is never a target
        count = int((lab != IGNORE_INDEX).sum())
        if not native:
            out = model(input_ids=ids, use_cache=False)
            loss_sum = _hf_loss_sum(out.logits[0], lab) if count else out.logits.sum() * 0.0
            return out.logits[0], loss_sum, count
        out = model(input_ids=ids, labels=lab[None] if count else None, use_cache=False)
        loss_sum = out.loss * count if count else out.logits.sum() * 0.0
        return out.logits[0], loss_sum, count

    return _compare(model, samples, packed, run_packed, run_single)


def random_samples(lengths: Sequence[int], vocab_size: int, seed: int = 0, p_train: float = 0.7) -> list[Sample]:
    """Random ids and loss masks for the given lengths (seeded)."""
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(1, vocab_size, n), rng.random(n) < p_train, i) for i, n in enumerate(lengths)]


def exactness_table(
    trials: int = 5,
    pad_multiples: Sequence[int] = (1, 4, 8),
    seed: int = 0,
    max_len: int = 64,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, Any]]:
    """Measure the worst differences over ``trials`` seeded random rows for every
    consumer and boundary mode; one dict per (consumer, mode, pad multiple).

    ``dtype=torch.float64`` runs every model in float64 (Hugging Face's ``eager``
    attention still takes its softmax in float32)."""
    rng = np.random.default_rng(seed)
    vocab = 97
    plain = TinyCausalLM(vocab_size=vocab, seed=seed, dtype=dtype)
    hf_impl = register_hf_attention()
    consumers: list[tuple[str, str, Callable[[list[Sample], PackedBatch], ExactnessReport]]] = [
        ("plain + PackedSeqParams", "real+padded", lambda s, p: check_plain_model(plain, s, p, pad_between_seqs=True)),
        (
            "plain + PackedSeqParams",
            "padded-for-both",
            lambda s, p: check_plain_model(plain, s, p, pad_between_seqs=False),
        ),
    ]
    for impl in ("sdpa", "eager", hf_impl):
        model = tiny_llama(vocab, attn_implementation=impl, seed=seed, dtype=dtype)
        mode = "cu_seq_lens (padded)" if impl == hf_impl else "position_ids"
        consumers.append((f"HF Llama ({impl})", mode, functools.partial(check_hf_model, model)))
    rows = []
    batches = []
    for _ in range(trials):
        lens = rng.integers(1, max_len + 1, size=int(rng.integers(1, 9))).tolist()
        batches.append(random_samples(lens, vocab, seed=int(rng.integers(1 << 30))))
    for name, mode, fn in consumers:
        for pm in pad_multiples:
            worst = dict(logits=0.0, loss=0.0, grads=0.0)
            for samples in batches:
                r = fn(samples, PackedBatch.from_samples(samples, pad_multiple=pm))
                worst["logits"] = max(worst["logits"], r.max_logit_diff)
                worst["loss"] = max(worst["loss"], r.loss_diff)
                worst["grads"] = max(worst["grads"], r.max_grad_diff)
            rows.append({"consumer": name, "mode": mode, "pad_multiple": pm, "trials": trials, **worst})
    return rows
