"""Matmul FLOPs of a Llama-style decoder, and the speed-up packing can give at most.

Counts the multiply-adds of the matrix products (2 FLOPs each) in one forward
pass; a training step is about three times that (forward, and the backward's two
products per matmul) for every part alike, so ratios are the same. Norms,
activations, rotary embeddings and the softmax are left out (a few per cent at
most); the embedding lookup is not a matmul.

Per token and layer, with ``H`` the hidden size, ``I`` the MLP width, ``d = H /
heads`` and ``K = kv_heads * d``:

- attention projections: ``2 * (H*H + 2*H*K + H*H)`` (q, k, v, o);
- MLP (gated: gate, up, down): ``2 * 3 * H * I``;
- attention scores and the weighted sum: ``2 * 2 * H * c`` where ``c`` is the
  number of keys the token sees; causal over a sequence of ``L`` tokens, ``c``
  averages ``(L + 1) / 2``.

The head is ``2 * H * V`` per token that is scored. sftpack scores only the
supervised tokens (those with a target), on every path and on the padded
baseline.

:func:`step_flops` prices a micro-batch as the kernels run it: the projections and
the MLP on every slot (padding included), attention within each sequence (a
packed row: one causal attention per conversation; a right-padded ``[b, S]``
batch: one over all ``S`` slots of each row), the head on the supervised tokens.
:func:`flop_bound` is the speed-up over padded batches that the saved FLOPs allow:
with attention a large share of the work, it is above the slot ratio (packing
saves attention quadratically), which is why the slot ratio is the wrong bound.
``benchmarks/flops.py`` prints the split for real models.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Decoder", "expected_speedup", "flop_bound", "split", "step_flops"]


@dataclass(frozen=True)
class Decoder:
    """The shape of a Llama-style decoder (gated MLP, grouped-query attention)."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def of(cls, model: Any, name: str = "model") -> Decoder:
        """The shape of a Hugging Face causal LM (its ``config``; a text config inside a vision one)."""
        c = model.config
        c = getattr(c, "text_config", None) or c
        return cls(
            name,
            c.hidden_size,
            c.num_hidden_layers,
            c.intermediate_size,
            c.num_attention_heads,
            getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            c.vocab_size,
        )

    def projections(self) -> int:
        """FLOPs per token of the q, k, v, o projections, all layers."""
        h, k = self.hidden, self.kv_heads * (self.hidden // self.heads)
        return self.layers * 2 * (2 * h * h + 2 * h * k)

    def mlp(self) -> int:
        """FLOPs per token of the gated MLP, all layers."""
        return self.layers * 2 * 3 * self.hidden * self.intermediate

    def attention(self, context: int) -> float:
        """FLOPs per token of the scores and the weighted sum, all layers, causal over
        sequences of ``context`` tokens (a token sees ``(context + 1) / 2`` keys on average)."""
        return self.layers * 2 * 2 * self.hidden * (context + 1) / 2

    def body(self, context: int) -> float:
        """FLOPs per token of the transformer body."""
        return self.projections() + self.mlp() + self.attention(context)

    def head(self) -> int:
        """FLOPs per scored token of the output head."""
        return 2 * self.hidden * self.vocab


def split(model: Decoder, context: int, supervised: float) -> dict[str, float]:
    """Per-token FLOPs of the body and of the head (averaged over all tokens, of which
    the fraction ``supervised`` is scored), and the head's share of the step."""
    body = model.body(context)
    head = supervised * model.head()
    return {"body": body, "head": head, "head_share": head / (body + head)}


def expected_speedup(bound: float, head_to_body: float) -> float:
    """A packed step's speed-up over a padded one when only the body's work scales with slots.

    Per real token a packed step (rows nearly full) costs ``body + head``; a padded step
    costs ``bound * body + head`` (``bound`` = packed fill / padded fill, the slots saved)
    and the same head (supervised tokens only, on both). With ``head_to_body = head / body``
    the ratio is ``(bound + head_to_body) / (1 + head_to_body)``: the bound when the head is
    free, 1 when the body is.

    >>> expected_speedup(2.0, 0.0), expected_speedup(2.0, 1.0)
    (2.0, 1.5)
    """
    return (bound + head_to_body) / (1.0 + head_to_body)


def step_flops(model: Decoder, slots: int, sequences: Iterable[int], scored: int) -> float:
    """Forward FLOPs of one micro-batch: ``slots`` through the projections and the MLP,
    causal attention within each of ``sequences`` (their lengths in tokens), the head on
    ``scored`` tokens.

    >>> m = Decoder("m", hidden=4, layers=1, intermediate=8, heads=2, kv_heads=1, vocab=10)
    >>> per_slot = m.projections() + m.mlp()
    >>> step_flops(m, 6, [6], 0) == 6 * per_slot + 6 * m.attention(6)
    True
    >>> step_flops(m, 6, [3, 3], 0) < step_flops(m, 6, [6], 0)  # two conversations attend less than one
    True
    """
    attention = sum(n * model.attention(n) for n in sequences)
    return slots * (model.projections() + model.mlp()) + attention + scored * model.head()


def flop_bound(model: Decoder, padded: Iterable[Any], packed: Iterable[Any]) -> float:
    """The speed-up in real tokens per second of ``packed`` micro-batches over ``padded``
    ones that the saved FLOPs allow: (FLOPs per real token of ``padded``) / (FLOPs per real
    token of ``packed``), each priced by :func:`step_flops` as its kernels run it.

    A packed micro-batch (a :class:`~sftpack.handoff.PackedBatch`: ``seqlens``) attends
    within each conversation; a right-padded one (``input_ids`` of shape ``[b, S]``) over
    all ``S`` slots of each row, padding included (no mask: causal attention never looks
    right). Costs the two share per step (the optimizer) are left out, which makes the
    bound looser, never tighter.
    """

    def per_token(batches: Iterable[Any]) -> float:
        flops, real = 0.0, 0
        for mb in batches:
            if hasattr(mb, "seqlens"):
                seqs = [int(n) for n in mb.seqlens.tolist()]
            else:
                b, s = mb.input_ids.shape
                seqs = [int(s)] * int(b)
            flops += step_flops(model, mb.num_tokens, seqs, mb.num_label_tokens)
            real += mb.num_real_tokens
        if not real:
            raise ValueError("no real token in the micro-batches: nothing to price")
        return flops / real

    return per_token(padded) / per_token(packed)
