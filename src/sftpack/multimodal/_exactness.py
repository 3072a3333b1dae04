"""Packed against alone: logits, the token-mean loss and every gradient (language model and vision tower).

:func:`check_packed` builds one row from samples, runs it through
:func:`packed_logits` and each sample through :func:`alone_logits` (Hugging Face's
own path: the model computes its MRoPE positions and runs its vision tower), and
compares. The loss is :func:`sftpack.loss.token_mean_loss` with one shared count of
supervised targets, so the packed loss is the sum of the samples' losses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..handoff import PackedBatch
from ..loss import token_mean_loss
from ..sample import IGNORE_INDEX, Sample
from ._family import family_for

__all__ = ["PackedCheck", "check_packed"]


@dataclass(frozen=True)
class PackedCheck:
    """Largest absolute differences, packed vs alone; ``grads`` by part of the model (the
    family's ``part_of``: ``"language"``, ``"vision"``, and LLaVA's ``"projector"``)."""

    logits: float
    loss: float
    grads: dict[str, float]
    max_abs_logit: float  #: the largest logit magnitude (a premise of the tolerance)
    max_abs_grad: float  #: the largest gradient entry (the other premise)

    @property
    def worst(self) -> float:
        return max(self.logits, self.loss, *self.grads.values())

    def within(self, tol: float) -> bool:
        return self.worst <= tol


def _shifted(sample: Sample) -> torch.Tensor:
    ids = torch.from_numpy(sample.input_ids)
    mask = torch.from_numpy(sample.loss_mask)
    lab = torch.full_like(ids, IGNORE_INDEX)
    lab[:-1] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], IGNORE_INDEX))
    return lab


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare_packed_alone(
    model: Any,
    samples: Sequence[Any],
    batch: PackedBatch,
    *,
    alone: Callable[[Any, Any], torch.Tensor],
    packed: Callable[[], torch.Tensor],
    part_of: Callable[[str], str],
) -> tuple[float, float, dict[str, float], float, float]:
    """The comparison both model families' checks run: each sample alone through
    ``alone(model, sample)`` and the packed run through ``packed()``, one token-mean loss
    over the same count of targets (``batch``'s), then the largest differences of the
    logits of every real token, of the loss and of the gradients grouped by
    ``part_of(parameter name)``. Returns ``(logits, loss, grads by part, max |logit|,
    max |grad|)``; the model's gradients are cleared."""
    n = int((batch.labels != IGNORE_INDEX).sum())
    model.zero_grad(set_to_none=True)
    outs, loss_a = [], None
    for s in samples:
        lg = alone(model, s)
        piece = token_mean_loss(lg, _shifted(s), n)
        loss_a = piece if loss_a is None else loss_a + piece
        outs.append(lg.detach())
    assert loss_a is not None
    loss_a.backward()
    g_a = _grads(model)
    model.zero_grad(set_to_none=True)
    lg_p = packed()
    loss_p = token_mean_loss(lg_p, batch.labels, n)
    loss_p.backward()
    g_p = _grads(model)
    model.zero_grad(set_to_none=True)
    cu, cup = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    d_logit = 0.0
    for i, a in enumerate(outs):
        L = cu[i + 1] - cu[i]
        if a.shape[0] != L:
            d_logit = float("inf")
            continue
        d_logit = max(d_logit, float((lg_p[cup[i] : cup[i] + L].detach() - a).abs().max()))
    parts: dict[str, float] = {}
    for name in g_a.keys() | g_p.keys():
        ga, gp = g_a.get(name), g_p.get(name)
        d = float("inf") if ga is None or gp is None else float((ga - gp).abs().max())
        part = part_of(name)
        parts[part] = max(parts.get(part, 0.0), d)
    return (
        d_logit,
        float((loss_p - loss_a).detach().abs()),
        parts,
        max(float(a.abs().max()) for a in outs),
        max(float(g.abs().max()) for g in g_a.values()),
    )


def check_packed(
    model: Any,
    samples: Sequence[Sample],
    *,
    pad_between_seqs: bool = True,
    pad_multiple: int = 1,
    row_width: int | None = None,
    pad_id: int = 151643,
    rows: int = 1,
    tamper: Callable[[PackedBatch], PackedBatch] | None = None,
) -> PackedCheck:
    """Compare a packed row of ``samples`` (with media) with each sample alone, through
    ``model``'s family (:func:`~sftpack.multimodal.family_for` of the model): logits of every
    real token, the token-mean loss (:func:`sftpack.loss.token_mean_loss`, one shared count of
    targets) and every gradient, grouped by the family's parts.

    ``rows``: cut the samples into this many consecutive rows (each ``row_width`` wide)
    and run them as one flat run (:meth:`PackedBatch.concat`). ``tamper`` (negative
    controls) edits the run before it runs: the check must then fail.
    """
    family = family_for(model)
    k = -(-len(samples) // rows)
    parts = [samples[i : i + k] for i in range(0, len(samples), k)]
    built = [
        PackedBatch.from_samples(p, pad_multiple=pad_multiple, max_seq_len=row_width, pad_id=pad_id) for p in parts
    ]
    batch = PackedBatch.concat(built).validate()
    if tamper is not None:
        batch = tamper(batch)
    logits, loss, by_part, max_logit, max_grad = compare_packed_alone(
        model,
        samples,
        batch,
        alone=family.alone_logits,
        packed=lambda: family.packed_logits(model, batch, pad_between_seqs=pad_between_seqs),
        part_of=family.part_of,
    )
    return PackedCheck(logits=logits, loss=loss, grads=by_part, max_abs_logit=max_logit, max_abs_grad=max_grad)
