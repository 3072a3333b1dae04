"""Matmul FLOPs per token of a Llama-style decoder: the body against the output head.

Counts the multiply-adds of the matrix products (2 FLOPs each) in one forward
pass; a training step is about three times that (forward, and the backward's two
products per matmul) for the body and the head alike, so the split is the same.
Norms, activations, rotary embeddings and the softmax are left out (a few per
cent at most); the embedding lookup is not a matmul.

Per token and layer, with ``H`` the hidden size, ``I`` the MLP width, ``d = H /
heads`` and ``K = kv_heads * d``:

- attention projections: ``2 * (H*H + 2*H*K + H*H)`` (q, k, v, o);
- MLP (gated: gate, up, down): ``2 * 3 * H * I``;
- attention scores and the weighted sum: ``2 * 2 * H * c`` where ``c`` is the
  number of keys the token sees; causal over a sequence of ``L`` tokens, ``c``
  averages ``(L + 1) / 2``.

The head is ``2 * H * V`` per token that is scored. sftpack scores only the
supervised tokens (those with a target), on every path and on the padded
baseline, so the head's share is ``supervised * head / (body + supervised * head)``.

    python benchmarks/flops.py [--context 4096] [--supervised 0.38] [--bound 2]

Prints a table (the last column: :func:`expected_speedup` of a packed step over a
padded one at that bound); ``docs/performance.md`` quotes it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["MODELS", "Decoder", "expected_speedup", "split"]


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


#: the models ``docs/performance.md`` discusses, and the benchmark's tiny one
MODELS = (
    Decoder("Qwen2.5-0.5B", 896, 24, 4864, 14, 2, 151_936),
    Decoder("Llama-3-8B", 4096, 32, 14336, 32, 8, 128_256),
    Decoder("bench_train (data vocabulary)", 128, 4, 512, 4, 2, 34_460),
    Decoder("bench_train (tokenizer vocabulary)", 128, 4, 512, 4, 2, 151_646),
)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096, help="sequence length in tokens (default 4096)")
    p.add_argument("--bound", type=float, default=2.0, help="slots saved by packing, for the last column (default 2)")
    p.add_argument(
        "--supervised",
        type=float,
        default=0.38,
        help="fraction of tokens with a target (default 0.38, the embedded corpus)",
    )
    args = p.parse_args(argv)
    print(f"forward matmul FLOPs per token, causal sequences of {args.context:,} tokens")
    head = (
        f"{'model':36s} {'body GFLOP':>10s} {'(attn)':>7s} {'head/scored':>11s} "
        f"{'head share, all scored':>22s} {f'at {args.supervised:.0%} scored':>15s} "
        f"{f'step at bound {args.bound:g}x':>17s}"
    )
    print(head)
    print("-" * len(head))
    for m in MODELS:
        everything = split(m, args.context, 1.0)
        some = split(m, args.context, args.supervised)
        print(
            f"{m.name:36s} {m.body(args.context) / 1e9:10.3f} {m.attention(args.context) / 1e9:7.3f} "
            f"{m.head() / 1e9:11.3f} {everything['head_share']:22.1%} {some['head_share']:15.1%} "
            f"{expected_speedup(args.bound, some['head'] / some['body']):16.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
