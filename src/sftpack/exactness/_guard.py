"""The guard every packed training run passes first: is packing exact on this model? A few short
synthetic sequences through the user's own model, packed against each alone
(:func:`probe_packing`), and :func:`require_exact_packing` refusing a model whose layers carry
state across sequence boundaries (:class:`InexactPackingError`, naming them and the fix)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..attention import TRAIN_ATTENTION
from ..handoff import PackedBatch
from ..hybrid import layer_kind, rounding_dtype
from ..sample import Sample
from ._models import _PROVEN, RMS_NORMS, norms_in_model_dtype
from ._tolerance import UNIT_ROUNDOFF, rounding_chain, tolerance

#: the attribute caching a model's probe (one probe per model, however many entry points ask)
_PROBED = "_sftpack_packing_probe"
#: substrings of the class names of layers that carry state along the sequence (recurrences,
#: causal convolutions): where a leak across packed boundaries comes from
_STATEFUL = ("Mamba", "Mixer", "Conv", "DeltaNet", "Recurrent", "Rwkv", "RWKV", "Ssm", "SSM", "LinearAttention")
#: the synthetic sequences of the probe: short, more than one (a leak shows in the later ones),
#: longer than the usual causal-conv kernel (3 or 4), of other lengths (no alignment by chance)
PROBE_LENGTHS = (9, 6, 7)


class InexactPackingError(ValueError):
    """Packing is not exact on this model: a packed row's logits differ from each sequence
    alone (:func:`require_exact_packing`); the message names the layers that carry state and
    the fix."""


@dataclass(frozen=True)
class PackingProbe:
    """What :func:`probe_packing` found: the largest ``|packed - alone|`` logit of the
    synthetic sequences, its tolerance, and the layers that carry state along a sequence."""

    model: str  #: the model's class
    difference: float
    tolerance: float
    carriers: tuple[str, ...]  #: e.g. ``("Mamba2 mixer (NemotronHMamba2Mixer)",)``; may be empty
    dtype: str = "float64"  #: what the probe computed in

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance

    def describe(self) -> str:
        """One line: what differs and why."""
        where = (
            f"its {', '.join(self.carriers)} layers carry state from one sequence of a row into the next"
            if self.carriers
            else "a layer of it sees across the sequence boundaries of a packed row"
        )
        return (
            f"packing is not exact on {self.model}: a packed row's logits differ from each sequence alone by "
            f"{self.difference:.2g} (tolerance {self.tolerance:.2g}); {where}"
        )


def state_carrying_layers(model: Any) -> tuple[str, ...]:
    """The kinds of ``model``'s layers that carry state along the sequence (a recurrence, a
    causal convolution: Mamba and Mamba2 mixers, short convolutions, gated delta nets...), as
    ``"kind (Class)"``, in the order they first occur: the kinds :mod:`sftpack.hybrid` covers
    by their names (:data:`sftpack.hybrid.LAYER_KINDS`), any other by its class name (a
    recurrent layer, or one that owns a 1-D convolution: a Mamba (v1) mixer). torch's own
    modules are not named (a convolution inside such a layer is named by the layer, and GPT-2's
    ``Conv1D``, a linear map, not at all)."""
    found: dict[str, None] = {}
    for mod in model.modules():
        cls = type(mod)
        if cls.__module__.startswith("torch."):
            continue
        name = cls.__name__
        covered = layer_kind(mod)
        if covered is not None:
            found[f"{covered.name} ({name})"] = None
            continue
        if not any(k in name for k in _STATEFUL) or name == "Conv1D" or "Vision" in name or "Patch" in name:
            continue
        recurrent = any(k in name for k in ("Recurrent", "Rwkv", "RWKV"))
        if not recurrent and not any(isinstance(c, nn.Conv1d) for c in mod.children()):
            continue  # a model, a block or a norm named after its family: the layer below it is named
        kind = (
            "Mamba2 mixer"
            if "Mamba2" in name or ("Mixer" in name and "Mamba" not in name)
            else "Mamba mixer"
            if "Mamba" in name
            else "short conv"
            if "Conv" in name
            else "gated delta net"
            if "DeltaNet" in name
            else "recurrent"
        )
        found[f"{kind} ({name})"] = None
    return tuple(found)


def packed_text_logits(model: Any, batch: PackedBatch, *, pad_between_seqs: bool) -> torch.Tensor:
    """``(T, vocab)`` logits of a Hugging Face causal LM over one packed row, fed as
    ``sftpack train`` feeds it (:meth:`PackedBatch.to_hf_kwargs`, and under sftpack's training
    attention with ``pad_between_seqs`` the real boundaries too)."""
    kw = batch.to_hf_kwargs()
    kw.pop("labels")
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if pad_between_seqs and getattr(text, "_attn_implementation", None) == TRAIN_ATTENTION:
        kw["sftpack_cu_seqlens_real"] = batch.cu_seqlens
    return cast(torch.Tensor, model(**kw).logits[0])


def alone_text_logits(model: Any, sample: Sample) -> torch.Tensor:
    """``(L, vocab)`` logits of one sample alone, as one ordinary ``(1, L)`` sequence."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long, device=device)[None]
    return cast(torch.Tensor, model(input_ids=ids, use_cache=False).logits[0])


class _Upcast:
    """Every floating parameter and buffer of a model in ``dtype`` (float64 or float32) for a
    while, then each back in its own dtype: lossless (every lower-precision value is a value of
    the wider dtype), and the same parameter objects throughout. In float64 its RMSNorms that
    upcast to float32 (:data:`RMS_NORMS`) compute in float64 meanwhile, and routed experts run
    transformers' own per-expert loop (``eager``: the grouped-matmul kernel takes no float64)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.saved: list[tuple[torch.Tensor, torch.dtype]] = []
        self.norms: list[nn.Module] = []
        self.experts: list[tuple[Any, str]] = []

    def __enter__(self) -> None:
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.is_floating_point() and t.element_size() < self.dtype.itemsize:
                self.saved.append((t, t.dtype))
                t.data = t.data.to(self.dtype)
        if self.dtype == torch.float64:  # RMSNorms that upcast to float32 compute in float64 meanwhile
            self.norms = [
                m for m in self.model.modules() if type(m).__name__ in RMS_NORMS and "forward" not in m.__dict__
            ]
            norms_in_model_dtype(self.model)
            # routed experts: their grouped-matmul kernel takes no float64, their own loop does
            configs: dict[int, Any] = {
                id(m.config): m.config for m in self.model.modules() if hasattr(m, "_is_expert_parallel")
            }
            for cfg in configs.values():
                impl = getattr(cfg, "_experts_implementation", None)
                if impl not in (None, "eager"):
                    self.experts.append((cfg, str(impl)))
                    cfg._experts_implementation = "eager"

    def __exit__(self, *exc: object) -> None:
        for t, dtype in self.saved:
            t.data = t.data.to(dtype)
        self.saved.clear()
        for m in self.norms:
            del m.forward
        self.norms = []
        for cfg, impl in self.experts:
            cfg._experts_implementation = impl
        self.experts = []


def _probe_dtype(model: nn.Module) -> torch.dtype:
    """float64, unless the model is on a CUDA device whose free memory cannot hold its weights in
    float64 beside their own copy (a model loaded whole before FSDP shards it): then float32."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return torch.float64
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    extra = sum(t.numel() * max(8 - t.element_size(), 0) for t in tensors)
    free, _ = torch.cuda.mem_get_info(device)
    return torch.float64 if extra < 0.8 * free else torch.float32


def probe_packing(
    model: Any,
    *,
    pad_between_seqs: bool = True,
    pad_multiple: int = 1,
    lengths: Sequence[int] = PROBE_LENGTHS,
    seed: int = 0,
    family: Any = None,
    dtype: torch.dtype | None = None,
) -> PackingProbe:
    """Run a few short synthetic sequences (seeded random ids of ``model``'s vocabulary) through
    ``model`` packed into one row (as ``sftpack train`` feeds it) and each alone, and compare
    the logits of every real token: a layer that carries state across the row's sequence
    boundaries (a Mamba mixer, a short convolution) makes the later sequences differ. A
    vision-language model runs its ``family``'s packed and alone forwards
    (:func:`sftpack.multimodal.family_for`; text-only sequences).

    The comparison runs in float64 whatever the model's dtype (``dtype=None``): its parameters
    are turned to float64 for the probe and back afterwards, losslessly (every lower-precision
    value is a float64 value). In its own dtype a small leak can hide below that dtype's
    rounding (a tiny LFM2's convolution leaks 4.5e-5 against a float32 tolerance of 9.3e-5); in
    float64 the tolerance (:func:`tolerance` of :func:`rounding_chain`, the magnitude of the
    logits) is about 1e-12. The weights held in float64 take 8 bytes a parameter for that
    moment: what AdamW's step holds for a bfloat16 model anyway. On a CUDA device without the
    free memory for that (a big model loaded whole before FSDP shards it) the probe runs in
    float32 and its tolerance: a leak as large as a Mamba2 mixer's is still far above it, one
    as small as that LFM2's is not. Dropout is off during the probe (eval mode, then the
    model's mode again); no gradient is formed.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.get_input_embeddings().num_embeddings)
    samples = [
        Sample(torch.randint(1, max(vocab, 2), (n,), generator=gen).numpy(), np.ones(n, dtype=bool), i)
        for i, n in enumerate(lengths)
    ]
    batch = PackedBatch.from_samples(samples, pad_multiple=pad_multiple)
    device = next(model.parameters()).device
    batch = batch.to(device)
    dtype = dtype or _probe_dtype(model)
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"probe_packing: dtype must be torch.float64 or torch.float32, got {dtype}")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _Upcast(model, dtype):
            rounds = rounding_dtype(model, dtype)  # a hybrid layer's own code may round to float32
            if family is not None:
                packed = family.packed_logits(model, batch, pad_between_seqs=pad_between_seqs)
                alone = [family.alone_logits(model, s) for s in samples]
            else:
                packed = packed_text_logits(model, batch, pad_between_seqs=pad_between_seqs)
                alone = [alone_text_logits(model, s) for s in samples]
    finally:
        model.train(was_training)
    cu, cup = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    diff = max(
        float((packed[cup[i] : cup[i] + cu[i + 1] - cu[i]].double() - a.double()).abs().max())
        for i, a in enumerate(alone)
    )
    magnitude = max(float(a.abs().max()) for a in alone)
    tol = tolerance(rounding_chain(model, int(batch.input_ids.numel())), rounds, magnitude)
    return PackingProbe(
        type(model).__name__, diff, tol, state_carrying_layers(model), str(dtype).removeprefix("torch.")
    )


def require_exact_packing(
    model: Any, *, pad_between_seqs: bool = True, pad_multiple: int = 1, allow: bool = False, family: Any = None
) -> PackingProbe | None:
    """The guard of every packed training run (:func:`sftpack.loop.train` calls it before its
    first step): :func:`probe_packing` on ``model`` (a vision-language model through its
    ``family``), once per model (the result is kept on it);
    ``None`` for a model sftpack built itself (:func:`mark_exact`: proven by the test suite).

    Raises:
        InexactPackingError: the probe differs, and ``allow`` is false: one line naming the
            layers that carry state and the fixes (train padded, ``packing="none"``; a model
            whose layers are attention and MLPs; or ``allow_inexact_packing``). With ``allow``
            the same line is a warning (once per model), and the run goes on.
    """
    if getattr(model, _PROVEN, False):
        return None
    probe: PackingProbe | None = getattr(model, _PROBED, None)
    if probe is None:
        probe = probe_packing(model, pad_between_seqs=pad_between_seqs, pad_multiple=pad_multiple, family=family)
        object.__setattr__(model, _PROBED, probe)
        if not probe.ok and allow:
            warnings.warn(
                f"{probe.describe()}; training packed anyway (--allow-inexact-packing): its sequences see each "
                "other's state",
                stacklevel=2,
            )
    if not probe.ok and not allow:
        raise InexactPackingError(
            f"{probe.describe()}: train it padded (--packing none), or a model whose layers are attention and MLPs "
            "(Llama, Qwen2, Qwen3...) or ones sftpack.hybrid keeps apart (Mamba2 mixers, gated delta nets, short "
            "convolutions: docs/hybrid.md), or pass --allow-inexact-packing (TrainConfig(allow_inexact_packing=True)) "
            "to train packed anyway"
        )
    return probe
