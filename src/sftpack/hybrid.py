"""Packed rows through hybrid models: layers that carry a state along the sequence keep
the row's sequences apart.

A Mamba2 mixer (Nemotron-H, Bamba, Falcon-H1, Granite-4 hybrid, Zamba2), a gated delta net
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next) and a short convolution (LFM2) mix tokens by a causal
convolution and a recurrence. On a packed row, run as Hugging Face runs them, the first
tokens of every sequence see the last tokens of the one before it (the convolution's
window) and start from its final state (the scan): packed training is then not the same
training. :func:`keep_apart` makes every such layer of a Hugging Face model take the row's
boundaries, the way :func:`sftpack.attention.register_hf_attention` does for attention: the
model's own classes, weights and configs, nothing copied. Each covered layer picks its route
at each call:

- ``kernels`` (CUDA tensors, and the layer's kernel packages installed: ``mamba_ssm`` and
  ``causal_conv1d`` for a Mamba2 mixer, ``fla`` and ``causal_conv1d`` for a gated delta
  net): the layer's own forward with the kernels' boundary arguments, ``seq_idx`` (the
  segment of every slot, which mamba_ssm's scans and causal-conv1d's convolution read) and
  ``cu_seq_lens_q`` (the offsets transformers hands flash-linear-attention as
  ``cu_seqlens``);
- ``torch`` (everywhere else: CPU, or a GPU without those kernels): the row's segments laid
  out as the rows of right-padded batches, segments of similar length together
  (:func:`length_groups`: the padding stays within :data:`PADDING_BUDGET` of the tokens), a
  call of the layer's own forward over each, and the real slots put back. Each segment starts
  at position 0 of its own batch row, so its convolution sees zeros on its left and its scan
  starts from a zero state, exactly as the sequence alone; the right padding comes after
  every real token and a causal layer never lets it reach them.

The boundaries are the row's physical offsets (``cu_seq_lens_q``, what
:meth:`~sftpack.PackedBatch.to_hf_kwargs` hands the model), so both boundary modes give the
same real outputs: a segment's own padding trails its real tokens. A model called with
Hugging Face's other packed form (``position_ids`` restarting per sequence, no mask, no
``cu_seq_lens_q``) gets the offsets from the restarts (:func:`keep_apart`'s forward
pre-hook). A call with no boundaries runs the layer as it is (generation, one sequence); a
packed row with a cache is refused (a cache holds one sequence's state: ``use_cache=False``).
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "LAYER_KINDS",
    "MODEL_TYPES",
    "PADDING_BUDGET",
    "ROUTES",
    "CoveredLayer",
    "LayerKind",
    "covered_layers",
    "keep_apart",
    "kernel_route_available",
    "layer_kind",
    "leaking",
    "length_groups",
    "refuse_context_parallel",
    "rounding_dtype",
    "segment_offsets",
    "state_layers_of_config",
]

#: the routes a covered layer can take: chosen per call (``auto``), or forced
ROUTES = ("auto", "torch", "kernels")


@dataclass(frozen=True)
class LayerKind:
    """A kind of layer that carries state along the sequence."""

    name: str  #: e.g. ``"Mamba2 mixer"``
    classes: tuple[str, ...]  #: the Hugging Face classes of this kind
    kernels: tuple[str, ...]  #: the import names of the packages its kernel route needs
    #: the boundary arguments its kernel route passes (``seq_idx``, ``cu_seq_lens_q``)
    kernel_args: tuple[str, ...]
    #: the dtype its own PyTorch code rounds to whatever the model's dtype (``None``: the model's)
    rounds_to: torch.dtype | None


#: every kind covered, with the Hugging Face classes of each (transformers 5.x names)
LAYER_KINDS: tuple[LayerKind, ...] = (
    LayerKind(
        "Mamba2 mixer",
        (
            "NemotronHMamba2Mixer",
            "BambaMixer",
            "FalconH1Mixer",
            "GraniteMoeHybridMambaLayer",
            "Zamba2MambaMixer",
        ),
        ("mamba_ssm", "causal_conv1d"),
        ("seq_idx",),
        torch.float32,  # the reference scan computes in float32 (``hidden_states.float()``)
    ),
    LayerKind(
        "gated delta net",
        ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"),
        ("fla", "causal_conv1d"),
        ("seq_idx", "cu_seq_lens_q"),
        torch.float32,  # the reference chunked rule computes in float32
    ),
    LayerKind("short conv", ("Lfm2ShortConv", "Lfm2MoeShortConv"), (), (), None),
)

_BY_CLASS = {cls: kind for kind in LAYER_KINDS for cls in kind.classes}
#: the ``model_type`` of each family's config (``config.json``; a text config's own too), and the
#: kind of its layers that carry state
MODEL_TYPES: dict[str, str] = {
    **dict.fromkeys(("nemotron_h", "bamba", "falcon_h1", "granitemoehybrid", "zamba2"), "Mamba2 mixer"),
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"), "gated delta net"),
    **dict.fromkeys(("lfm2", "lfm2_moe"), "short conv"),
}
#: the keyword arguments that carry boundaries; the torch route hands the layer none of them
#: the offsets the model's forward pre-hook reads from restarting positions (covered layers only)
_RESTARTS = "sftpack_restart_offsets"
_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens", _RESTARTS)
_ROUTE = "_sftpack_route"  # the covered layer's route (attribute on the layer)
_LEAK = "leak"  # the negative control: the row runs as one sequence (see :func:`leaking`)
_HOOKED = "_sftpack_keep_apart_hook"


@dataclass(frozen=True)
class CoveredLayer:
    """One layer :func:`keep_apart` covers."""

    name: str  #: its qualified name in the model, e.g. ``model.layers.0.mixer``
    kind: str  #: :attr:`LayerKind.name`
    cls: str  #: its class


def layer_kind(module: nn.Module) -> LayerKind | None:
    """The :class:`LayerKind` of ``module``'s class, ``None`` for any other layer."""
    return _BY_CLASS.get(type(module).__name__) or next(
        (_BY_CLASS[c.__name__] for c in type(module).__mro__ if c.__name__ in _BY_CLASS), None
    )


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def kernel_route_available(kind: LayerKind) -> bool:
    """Whether ``kind``'s kernel packages are installed (the route then runs on CUDA tensors)."""
    return bool(kind.kernels) and all(_installed(k) for k in kind.kernels)


def segment_offsets(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The ``(N+1,)`` int32 offsets of the sequences of ``position_ids`` ``(B, T)`` laid end to
    end (Hugging Face's packed form: a sequence starts where a position is not its
    predecessor plus one, and at every row's start); ``None`` when no row restarts."""
    if position_ids.dim() != 2:
        return None
    b, t = position_ids.shape
    step = torch.ones(b, t, dtype=torch.bool, device=position_ids.device)
    step[:, 1:] = torch.diff(position_ids, dim=-1) != 1
    if b * t == 0 or int(step.sum()) == b:  # every row is one sequence
        return None
    starts = torch.nonzero(step.reshape(-1)).flatten()
    end = torch.tensor([b * t], device=position_ids.device)
    return torch.cat([starts, end]).to(torch.int32)


def _offsets(hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        cu = kwargs.get(_RESTARTS)
    if cu is None:
        return None
    slots = hidden.shape[0] * hidden.shape[1]
    if int(cu[-1]) != slots or int(cu[0]) != 0:
        raise ValueError(
            f"cu_seq_lens_q covers {int(cu[-1])} slots but the hidden states hold {slots} "
            f"({tuple(hidden.shape[:2])}): pass the boundaries of these tokens"
        )
    return cu if cu.numel() > 2 else None


def _seq_idx(cu: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    lengths = (cu[1:] - cu[:-1]).to(torch.long)
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device, dtype=torch.int32), lengths)
    return ids.reshape(shape[0], shape[1])


def _apart_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """The covered layer's forward: its own class's forward, with the row's boundaries kept."""
    own = type(self).forward
    cu = _offsets(hidden_states, kwargs)
    if cu is not None and cache is not None:
        raise ValueError(
            f"{type(self).__name__}: a packed row ({cu.numel() - 1} sequences) with a cache, which holds one "
            "sequence's state: call the model with use_cache=False (or set model.config.use_cache = False)"
        )
    rest = {k: v for k, v in kwargs.items() if k not in _BOUNDARY_KEYS}
    route = getattr(self, _ROUTE, "auto")
    if cu is None or route == _LEAK:
        # one sequence, a cache, or the negative control: the layer as Hugging Face runs it on
        # one sequence, without the boundary arguments (its PyTorch code refuses any)
        return own(self, hidden_states, cache=cache, attention_mask=attention_mask, **rest)
    kind = layer_kind(self)
    assert kind is not None
    if route == "kernels" or (route == "auto" and hidden_states.is_cuda and kernel_route_available(kind)):
        if not kind.kernels:
            raise ValueError(f"{type(self).__name__} has no kernel route: use route='torch' or 'auto'")
        extra: dict[str, Any] = {}
        if "seq_idx" in kind.kernel_args:
            extra["seq_idx"] = _seq_idx(cu, hidden_states.shape)
        if "cu_seq_lens_q" in kind.kernel_args:
            extra["cu_seq_lens_q"] = cu
        return own(self, hidden_states, cache=None, attention_mask=attention_mask, **rest, **extra)
    return _through_padded_batch(self, own, hidden_states, attention_mask, cu, rest)


#: the torch route's padding budget: segments of similar length share a padded batch while its
#: slots stay within this factor of their tokens (a long segment and a short one run apart)
PADDING_BUDGET = 1.125


def length_groups(lengths: list[int], budget: float = PADDING_BUDGET) -> list[list[int]]:
    """The segments (indices into ``lengths``) that share one call of the torch route: longest
    first, each group as many as fit ``len(group) * longest <= budget * sum(group)``.

    >>> length_groups([30, 4, 29, 5, 28])
    [[0, 2, 4], [3, 1]]
    """
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    groups: list[list[int]] = []
    total = 0
    for k in order:
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * lengths[group[0]] <= budget * (total + lengths[k]):
            group.append(k)
            total += lengths[k]
        else:
            groups.append([k])
            total = lengths[k]
    return groups


def _through_padded_batch(
    layer: nn.Module,
    own: Any,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu: torch.Tensor,
    rest: dict[str, Any],
) -> torch.Tensor:
    """The torch route: the row's segments, grouped by length (:func:`length_groups`), each
    group the rows of one right-padded batch through the layer's own forward, the real slots
    put back in the row's order."""
    b, t = hidden.shape[0], hidden.shape[1]
    flat = hidden.reshape(b * t, *hidden.shape[2:])
    mask_flat = attention_mask.reshape(-1) if attention_mask is not None and attention_mask.dim() == 2 else None
    bounds = cu.tolist()
    lengths = [e - a for a, e in zip(bounds[:-1], bounds[1:])]
    outs: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    for group in length_groups(lengths):
        if len(group) == 1:  # one segment: the slice itself, no gather
            a, e = bounds[group[0]], bounds[group[0] + 1]
            mask = None if mask_flat is None else mask_flat[a:e][None]
            outs.append(own(layer, flat[a:e][None], cache=None, attention_mask=mask, **rest)[0])
            slots.append(torch.arange(a, e, device=hidden.device))
            continue
        starts = torch.tensor([bounds[k] for k in group], device=hidden.device)
        lens = torch.tensor([lengths[k] for k in group], device=hidden.device)
        col = torch.arange(lengths[group[0]], device=hidden.device)
        valid = col[None, :] < lens[:, None]  # (group, longest)
        index = torch.where(valid, starts[:, None] + col[None, :], torch.zeros_like(col)[None, :])
        shape = valid.shape + (1,) * (hidden.dim() - 2)
        zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
        batch = torch.where(valid.reshape(shape), flat[index], zero)
        mask = None if mask_flat is None else mask_flat[index] * valid.to(mask_flat.dtype)
        outs.append(own(layer, batch, cache=None, attention_mask=mask, **rest)[valid])
        slots.append(index[valid])
    out = torch.cat(outs)
    order = torch.argsort(torch.cat(slots))  # the slots are a permutation of the row's
    return out[order].reshape(b, t, *out.shape[1:])


def _position_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Hugging Face's other packed form (positions restarting, no mask, no offsets): the
    offsets of the restarts, for the covered layers only (the attention reads the positions
    its own way)."""
    pos = kwargs.get("position_ids")
    if (
        kwargs.get("cu_seq_lens_q") is None
        and kwargs.get("attention_mask") is None
        and isinstance(pos, torch.Tensor)
        and pos.dim() == 2
    ):
        cu = segment_offsets(pos)
        if cu is not None:
            kwargs = dict(kwargs, **{_RESTARTS: cu})
    return args, kwargs


def keep_apart(model: nn.Module, route: str = "auto") -> tuple[CoveredLayer, ...]:
    """Make every layer of ``model`` that carries state along the sequence (:data:`LAYER_KINDS`)
    keep a packed row's sequences apart; returns the layers covered (empty for a model with
    none, which is left as it is). Idempotent (on a covered layer ``"auto"`` keeps the route it
    has); parameters, state-dict keys and the saved folder are unchanged (the layer's forward is
    set on the instance, its class is kept).

    ``route``: ``"auto"`` (the kernels' boundary arguments on CUDA where the layer's kernel
    packages are installed, else the exact PyTorch route), ``"torch"`` or ``"kernels"``.
    """
    if route not in ROUTES:
        raise ValueError(f"keep_apart: route must be one of {', '.join(ROUTES)}, got {route!r}")
    covered = []
    for name, mod in model.named_modules():
        kind = layer_kind(mod)
        if kind is None:
            continue
        if route == "kernels" and not kernel_route_available(kind):
            needs = " and ".join(kind.kernels) if kind.kernels else "none: it has no kernel route"
            raise ValueError(
                f"keep_apart: route='kernels' needs the kernel packages of {kind.name} layers ({name}: "
                f"{type(mod).__name__}): {needs}{' installed (and CUDA tensors)' if kind.kernels else ''}; "
                "use route='auto' (the kernels where they run, else the exact PyTorch route)"
            )
        if not (route == "auto" and _is_covered(mod)):  # covered already: "auto" keeps its route
            object.__setattr__(mod, _ROUTE, route)
        mod.forward = types.MethodType(_apart_forward, mod)
        covered.append(CoveredLayer(name, kind.name, type(mod).__name__))
    if covered and not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_position_hook, with_kwargs=True)
        object.__setattr__(model, _HOOKED, True)
    return tuple(covered)


def _is_covered(mod: nn.Module) -> bool:
    forward = mod.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _apart_forward


def covered_layers(model: nn.Module) -> tuple[CoveredLayer, ...]:
    """The layers of ``model`` that :func:`keep_apart` covers now."""
    return tuple(
        CoveredLayer(name, kind.name, type(mod).__name__)
        for name, mod in model.named_modules()
        if (kind := layer_kind(mod)) is not None and _is_covered(mod)
    )


def rounding_dtype(model: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The precision a model with covered layers computes in when run in ``dtype``: float32
    where its own PyTorch code rounds to float32 whatever the model's dtype (the reference
    Mamba2 scan and gated delta rule do, and an RMSNorm that upcasts to float32, unless
    :func:`sftpack.exactness.norms_in_model_dtype` made it compute in the model's dtype), else
    ``dtype``. The tolerance of a float64 comparison of such a model is then float32's. A model
    without covered layers: ``dtype``."""
    kinds = [k for m in model.modules() if (k := layer_kind(m)) is not None]
    if not kinds or dtype.itemsize <= 4:
        return dtype
    if any(k.rounds_to is not None and k.rounds_to.itemsize < dtype.itemsize for k in kinds):
        return torch.float32
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and "forward" not in m.__dict__]
    return torch.float32 if norms else dtype


@contextmanager
def leaking(model: nn.Module) -> Iterator[None]:
    """The negative control: inside, every covered layer of ``model`` runs a packed row as one
    sequence (its state crosses every boundary), as Hugging Face runs it on CPU without
    boundaries. Checks that a leak is caught; never for training."""
    saved = [(m, getattr(m, _ROUTE)) for m in model.modules() if hasattr(m, _ROUTE)]
    if not saved:
        raise ValueError("leaking: no layer of this model is covered by keep_apart")
    for m, _ in saved:
        object.__setattr__(m, _ROUTE, _LEAK)
    try:
        yield
    finally:
        for m, r in saved:
            object.__setattr__(m, _ROUTE, r)


def state_layers_of_config(config: Mapping[str, Any]) -> str | None:
    """The kind of layer that carries state in the family of a ``config.json`` (its
    ``model_type``, or its ``text_config``'s), ``None`` for another family."""
    text = config.get("text_config")
    types_ = [config.get("model_type"), text.get("model_type") if isinstance(text, Mapping) else None]
    return next((MODEL_TYPES[t] for t in types_ if isinstance(t, str) and t in MODEL_TYPES), None)


def refuse_context_parallel(kind: str | None, cp_size: int, what: str) -> None:
    """Context parallelism cuts each sequence into chunks on other ranks; a layer that carries
    state would need each chunk's final state handed to the rank of the next chunk, which
    sftpack does not do. Raises ``ValueError`` (one line) when ``cp_size > 1`` and ``kind`` (the
    layers ``what`` has, :func:`state_layers_of_config`) is one."""
    if kind is not None and cp_size > 1:
        raise ValueError(
            f"context parallelism ({cp_size}) over {what}'s {kind} layers needs each chunk's state handed from "
            "rank to rank, which sftpack does not do: use a context-parallel size of 1 for this model "
            "(docs/hybrid.md)"
        )
