"""What one sequence costs to train: linear work per token plus attention work per token squared.

A sequence of ``l`` tokens costs ``per_token * l + per_token_squared * l**2``. For a
decoder the two coefficients are training FLOPs (forward and backward, three times the
forward's matmul FLOPs):

- ``per_token = 6 * P``, with ``P`` the weights a token multiplies through: every layer's
  token mixer (attention's q, k, v, o projections; a state-space or convolution layer's
  projections, counted with the same shape) and MLP, and the output head. The state-space
  layers' scan is linear in ``l`` too, a few per cent of their projections, and left out.
- ``per_token_squared = 6 * A * heads * head_dim``, with ``A`` the *full-attention* layers
  only: causal attention over ``l`` tokens does ``2 * 2 * heads * head_dim * l**2 / 2``
  forward FLOPs per layer (scores and weighted sum; a token sees ``(l + 1) / 2`` keys on
  average). Mamba, gated delta net, short-convolution and other linear-time mixers add
  nothing here: that is what makes a hybrid model's long sequences cheap.

For a 7B decoder (32 layers, ``d = 4096``) attention is a quarter of a 16k sequence's work
and 70% of a 128k one's, which is why a planner that balances tokens alone leaves ranks idle.

The coefficients come from a model's ``config.json`` (:meth:`SequenceCost.from_config`,
:meth:`~SequenceCost.from_model_dir`), a named size (:meth:`~SequenceCost.named`), or a fit
of measured step times (:meth:`~SequenceCost.fit`). ``"tokens"`` (``1, 0``) and
``"attention"`` (``0, 1``) are the two one-term models the planners always took.
:func:`sequence_cost` reads any of these spellings.

Every planner (``plan_microbatches``, the offline deal, the loader's deal, ``sftpack plan``)
prices sequences and rows with this one model; a micro-batch or a row costs the sum of its
sequences'.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["NAMED_SIZES", "CostError", "SequenceCost", "sequence_cost"]


class CostError(ValueError):
    """A cost model that cannot be read (the message names the field or the spelling, and the fix)."""


@dataclass(frozen=True)
class SequenceCost:
    """``per_token * l + per_token_squared * l**2`` for a sequence of ``l`` tokens.

    >>> cost = SequenceCost(per_token=2.0, per_token_squared=0.5)
    >>> cost([2, 4]).tolist()
    [6.0, 16.0]
    >>> cost.of_groups([2, 4, 1], [0, 2, 3]).tolist()  # groups [2, 4] and [1]
    [22.0, 2.5]
    """

    per_token: float
    per_token_squared: float
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("per_token", "per_token_squared"):
            v = getattr(self, field)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise CostError(f"SequenceCost.{field} must be a finite number >= 0, got {v!r}")
        if self.per_token == 0 and self.per_token_squared == 0:
            raise CostError("SequenceCost: per_token and per_token_squared are both 0: every sequence would be free")

    def __call__(self, lengths: ArrayLike) -> np.ndarray:
        """``(n,)`` float64 cost of each sequence."""
        l = np.asarray(lengths, dtype=np.float64)  # noqa: E741
        return self.per_token * l + self.per_token_squared * l * l

    def of_groups(self, lengths: ArrayLike, offsets: ArrayLike) -> np.ndarray:
        """``(G,)`` float64 cost of each group of ``lengths`` (a row, a micro-batch):
        group ``g`` holds ``lengths[offsets[g]:offsets[g + 1]]``."""
        per = self(lengths)
        off = np.asarray(offsets, dtype=np.int64)
        sums = np.concatenate([[0.0], np.cumsum(per)])
        return sums[off[1:]] - sums[off[:-1]]

    def attention_share(self, length: int) -> float:
        """The share of a ``length``-token sequence's cost that is attention."""
        quad = self.per_token_squared * float(length) ** 2
        return quad / (self.per_token * float(length) + quad)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def tokens(cls) -> SequenceCost:
        """One unit per token: memory, the linear layers, the loss."""
        return cls(1.0, 0.0, "tokens")

    @classmethod
    def attention(cls) -> SequenceCost:
        """``l**2`` per sequence: causal attention alone."""
        return cls(0.0, 1.0, "attention")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "model") -> SequenceCost:
        """Training FLOPs per sequence of the model a Hugging Face ``config.json`` describes.

        Reads ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` and ``vocab_size``
        (a vision model's ``text_config`` when it has one), and which layers are full
        attention: ``layer_types`` (``"full_attention"`` against ``"linear_attention"``,
        ``"conv"``, ``"mamba"``...), ``hybrid_override_pattern`` (Nemotron-H: ``*`` is
        attention), ``attn_layer_indices`` (Bamba), ``full_attn_idxs`` (LFM2); all layers
        otherwise.

        >>> c = SequenceCost.from_config({"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008,
        ...                               "num_attention_heads": 32, "vocab_size": 32000})
        >>> c.per_token_squared == 6 * 32 * 4096
        True
        >>> round(c.per_token / 6 / 1e9, 2)  # weights a token multiplies through, in billions
        6.61
        """
        c: Mapping[str, Any] = config.get("text_config") or config
        try:
            hidden = int(c["hidden_size"])
            layers = int(c["num_hidden_layers"])
            heads = int(c["num_attention_heads"])
            vocab = int(c["vocab_size"])
        except KeyError as e:
            raise CostError(
                f"{name}: config has no {e.args[0]!r}: a cost model needs hidden_size, num_hidden_layers, "
                "num_attention_heads and vocab_size (pass --size or a SequenceCost instead)"
            ) from None
        inter = int(c.get("intermediate_size") or 4 * hidden)
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        attn = _attention_layers(c, layers)
        mixer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim  # q, o; k, v
        mlp = 3 * hidden * inter  # gated: gate, up, down
        weights = layers * (mixer + mlp) + hidden * vocab
        return cls(6.0 * weights, 6.0 * attn * heads * head_dim, name)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> SequenceCost:
        """:meth:`from_config` of ``path/config.json`` (a Hugging Face model directory)."""
        p = Path(path)
        cfg = p / "config.json" if p.is_dir() else p
        if not cfg.is_file():
            raise CostError(f"{p}: no config.json there: give a Hugging Face model directory, or --size")
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise CostError(f"{cfg}: cannot read it as JSON ({e})") from None
        if not isinstance(data, dict):
            raise CostError(f"{cfg}: holds {type(data).__name__}, not a JSON object")
        return cls.from_config(data, name=str(p))

    @classmethod
    def named(cls, size: str) -> SequenceCost:
        """A dense decoder of a common size: ``"1b"``, ``"3b"``, ``"7b"``, ``"8b"``, ``"13b"``,
        ``"70b"`` (:data:`NAMED_SIZES`: the shapes of Llama 2 7B / 13B and Llama 3 1B / 3B /
        8B / 70B)."""
        key = size.strip().lower()
        if key not in NAMED_SIZES:
            raise CostError(f"unknown model size {size!r}: use one of {', '.join(NAMED_SIZES)}, or --model DIR")
        return cls.from_config(NAMED_SIZES[key], name=key)

    @classmethod
    def fit(cls, lengths: Sequence[Sequence[int]], seconds: Sequence[float], name: str = "measured") -> SequenceCost:
        """The two coefficients that best explain measured step times.

        ``lengths[i]`` are the sequence lengths of micro-batch ``i``, ``seconds[i]`` the time
        it took; fits ``seconds ~ c0 + per_token * sum(l) + per_token_squared * sum(l**2)``
        by least squares (the constant, a step's fixed overhead, is the same for every
        micro-batch and dropped; a negative coefficient is clamped to 0).
        """
        if len(lengths) != len(seconds) or len(lengths) < 3:
            raise CostError("SequenceCost.fit needs 3 or more micro-batches, each with its measured seconds")
        s1 = np.array([float(np.sum(np.asarray(g, np.float64))) for g in lengths])
        s2 = np.array([float(np.sum(np.asarray(g, np.float64) ** 2)) for g in lengths])
        scale1, scale2 = max(s1.max(), 1.0), max(s2.max(), 1.0)
        design = np.stack([np.ones_like(s1), s1 / scale1, s2 / scale2], axis=1)
        coef, *_ = np.linalg.lstsq(design, np.asarray(seconds, np.float64), rcond=None)
        a, b = max(float(coef[1]) / scale1, 0.0), max(float(coef[2]) / scale2, 0.0)
        if a == 0 and b == 0:
            raise CostError("SequenceCost.fit: the times do not grow with the lengths; measure longer micro-batches")
        return cls(a, b, name)


def _attention_layers(c: Mapping[str, Any], layers: int) -> int:
    """How many of the ``layers`` are full (quadratic) attention."""
    types = c.get("layer_types")
    if isinstance(types, list) and types:
        return sum(1 for t in types if "attention" in str(t) and "linear" not in str(t))
    pattern = c.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return pattern.count("*")
    for key in ("attn_layer_indices", "full_attn_idxs"):
        idx = c.get(key)
        if isinstance(idx, list):
            return len(idx)
    return layers


def _decoder(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int) -> dict[str, int]:
    return {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
    }


#: the shapes behind :meth:`SequenceCost.named` (public model cards' ``config.json`` values)
NAMED_SIZES: dict[str, dict[str, int]] = {
    "1b": _decoder(16, 2048, 8192, 32, 8, 128256),
    "3b": _decoder(28, 3072, 8192, 24, 8, 128256),
    "7b": _decoder(32, 4096, 11008, 32, 32, 32000),
    "8b": _decoder(32, 4096, 14336, 32, 8, 128256),
    "13b": _decoder(40, 5120, 13824, 40, 40, 32000),
    "70b": _decoder(80, 8192, 28672, 64, 8, 128256),
}


def sequence_cost(spec: str | Path | SequenceCost | None, *, default: str = "tokens") -> SequenceCost:
    """A cost model from any of its spellings: a :class:`SequenceCost`; ``"tokens"``,
    ``"attention"``; a named size (``"7b"``); a model directory (or its ``config.json``);
    ``None`` (``default``).

    >>> sequence_cost("attention").per_token_squared, sequence_cost(None).name
    (1.0, 'tokens')
    """
    if spec is None:
        spec = default
    if isinstance(spec, SequenceCost):
        return spec
    s = str(spec)
    key = s.strip().lower()
    if key == "tokens":
        return SequenceCost.tokens()
    if key == "attention":
        return SequenceCost.attention()
    if key in NAMED_SIZES:
        return SequenceCost.named(key)
    if Path(s).exists():
        return SequenceCost.from_model_dir(s)
    raise CostError(
        f"cost {s!r}: not 'tokens', 'attention', a model size ({', '.join(NAMED_SIZES)}) or a model directory "
        "with a config.json"
    )
