"""The tolerance of a packed-vs-alone comparison, derived from the model's shape: the longest
chain of roundings a logit goes through (:func:`rounding_chain`) times the unit roundoff
(:func:`tolerance`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._base import positive_int, renamed

#: unit roundoff of each dtype a comparison may run in
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24}
#: the config keys of a feed-forward block's width, by the names Hugging Face's configs use
_MLP_WIDTH_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "mlp_dim", "inner_dim")


def _int_of(cfg: Any, *names: str) -> int:
    """The first of ``names`` that ``cfg`` holds as a positive integer, else 0."""
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _widest_matmul(model: Any) -> int:
    """The longest dot product of any linear map of ``model`` but its output head: the largest
    ``in_features`` of a ``Linear`` (or of transformers' ``Conv1D``, GPT-2's, whose weight is
    ``(in, out)``); 0 when there is none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    widest = 0
    for mod in model.modules():
        if mod is head:
            continue
        if isinstance(mod, nn.Linear):
            widest = max(widest, mod.in_features)
        elif type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2:
            widest = max(widest, int(mod.weight.shape[0]))
    return widest


def rounding_chain(
    model: Any, max_seq_len: int | None = None, patches: int = 0, *, row_width: int | None = None
) -> int:
    """An upper bound of the longest chain of roundings (terms of one sum, summed along one
    path) in one forward and backward pass of ``model`` over a row of ``max_seq_len`` slots
    holding ``patches`` vision patches: per language layer the hidden width, the widest
    feed-forward or projection (the config's MLP width, ``intermediate_size``, OPT's
    ``ffn_dim``, GPT-2's ``n_inner``... or the longest dot product of any of the model's linear
    maps, whichever is larger) and the row (attention and the gradients' sums over tokens), per
    vision layer the same over the patches, twice (forward and backward), plus the vocabulary
    (the softmax) and the row (the loss). ``row_width``: the deprecated spelling of
    ``max_seq_len`` (accepted, with a ``DeprecationWarning``, until the next release).

    Raises:
        ValueError: a config that names no layer count or vocabulary (nothing to bound), or
            no positive ``max_seq_len``.
    """
    width = positive_int("max_seq_len", renamed("rounding_chain", "max_seq_len", max_seq_len, "row_width", row_width))
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layers = _int_of(text, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _int_of(text, "vocab_size")
    widest = _widest_matmul(model)
    hidden = _int_of(text, "hidden_size", "n_embd", "d_model") or widest
    mlp = max(_int_of(text, *_MLP_WIDTH_KEYS), widest)
    if not (layers and vocab and hidden):
        missing = [
            n for n, v in (("num_hidden_layers", layers), ("vocab_size", vocab), ("hidden_size", hidden)) if not v
        ]
        raise ValueError(
            f"{type(model).__name__}: its config names no {' or '.join(missing)}, so no tolerance can be derived "
            "from the model's shape: this model cannot be checked"
        )
    n = layers * (hidden + mlp + width)
    vision = getattr(cfg, "vision_config", None)
    if vision is not None and patches:
        width = int(getattr(vision, "embed_dim", 0) or getattr(vision, "hidden_size", 0))
        vmlp = int(getattr(vision, "intermediate_size", 0) or width * getattr(vision, "mlp_ratio", 4))
        depth = int(getattr(vision, "depth", 0) or getattr(vision, "num_hidden_layers", 0))
        n += depth * (width + vmlp + patches)
    return 2 * n + vocab + width


def tolerance(chain: int, dtype: torch.dtype, magnitude: float) -> float:
    """The largest difference two runs of one function in other summation orders may show on
    values of ``magnitude`` (floored at 1), over a rounding ``chain``: an ``n``-term sum is off
    by at most ``n * u`` of its terms' magnitude sum (Higham, *Accuracy and Stability of
    Numerical Algorithms*, section 3.1); in float64 ``2 * n * u`` (two runs), ``u = 2**-53``; in
    float32 the ``sqrt(n) * u`` growth of Higham & Mary (2019) with ``lambda = 10`` (exceeded
    with probability below 1e-20), ``2 * 10 * sqrt(n) * u``, ``u = 2**-24``."""
    u = UNIT_ROUNDOFF[dtype]
    scale = max(1.0, magnitude)
    if dtype == torch.float64:
        return 2 * chain * u * scale
    return 2 * 10 * math.sqrt(chain) * u * scale
