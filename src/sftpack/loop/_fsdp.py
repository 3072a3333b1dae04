"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) for the loop.

With ``TrainConfig.fsdp`` each decoder layer of the language model is one FSDP unit
and the loss module (embedding, final norm, head) the root: every rank holds
``1/world`` of each parameter, of its gradient and of AdamW's moments; a layer's
parameters are gathered for its forward and backward and its gradients
reduce-scattered, averaged over the ranks as DDP averages them (the loss module's
``average_over_ranks`` undoes it, as for DDP). On one process the loop starts a
one-rank group (gloo; NCCL on CUDA) so the same code runs.

Checkpoints are the same files as without FSDP: the full model state dict and the
full optimizer state gathered to rank 0 (``torch.distributed.checkpoint.state_dict``),
the optimizer's keyed by parameter index as ``torch.optim.Optimizer.state_dict``
keys them; so a checkpoint resumes with or without ``--fsdp`` (same world size).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

__all__ = ["decoder_layers", "ensure_group", "full_state", "load_state", "local", "optimizer_state", "shard"]


def ensure_group(device: torch.device) -> bool:
    """A one-rank process group when none is initialised (FSDP needs one, even on one
    process); returns whether it started one. It stays for the sharded model's life."""
    dist = torch.distributed
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def decoder_layers(model: Any) -> list[nn.Module]:
    """The decoder layers of a causal LM: the modules of the classes its
    ``_no_split_modules`` names (transformers models), else the blocks of the
    ``layers`` (or ``h``, ``blocks``) ``ModuleList`` of its base model.

    Raises:
        ValueError: none found (the message names the model's class).
    """
    classes = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in classes]
    if found:
        return found
    body = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks"):
        blocks = getattr(body, name, None)
        if isinstance(blocks, nn.ModuleList) and len(blocks):
            return list(blocks)
    raise ValueError(
        f"--fsdp: cannot find the decoder layers of {type(model).__name__} (no _no_split_modules, no "
        "base_model.layers): train it without --fsdp"
    )


def shard(module: nn.Module, model: Any, device: torch.device) -> None:
    """Shard ``model``'s decoder layers and then ``module`` (the loss module holding
    ``model``: the root unit) over the default group's ranks, in place."""
    from torch.distributed.fsdp import fully_shard  # start-up: ~1 s (600 modules), only for --fsdp

    if getattr(module, "counts_images", False):
        raise ValueError(
            "--fsdp trains text models only for now (a vision-language model's tower is not sharded): "
            "train data with images without --fsdp"
        )
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def local(t: Any) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _options(rank0_only: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # start-up: loads FSDP (~1 s), only for --fsdp

    return StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)


def full_state(model: Any, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded ``model`` (every rank calls it): on rank 0 (and
    on CPU) with ``rank0_only``, else on every rank; other ranks get ``{}``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # start-up: loads FSDP (~1 s)

    state: dict[str, torch.Tensor] = dict(get_model_state_dict(model, options=_options(rank0_only)))  # type: ignore[arg-type]
    return state


def optimizer_state(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The full optimizer state of a sharded ``model`` on rank 0 (every rank calls it),
    keyed by parameter index like ``opt.state_dict()`` (``{}`` on other ranks)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # start-up: loads FSDP (~1 s)

    osd: dict[str, Any] = dict(get_optimizer_state_dict(model, opt, options=_options(True)))
    if not osd:
        return {}
    index = {n: i for i, n in enumerate(_trained_names(model))}
    return {
        "state": {index[k]: v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in osd["param_groups"]],
    }


def load_state(model: Any, opt: torch.optim.Optimizer | None, model_state: dict, opt_state: dict | None) -> None:
    """Load a full model state (and a full optimizer state keyed by index) into the
    sharded ``model`` and its optimizer: each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import (  # start-up: loads FSDP (~1 s), only for --fsdp
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = _options(False)
    set_model_state_dict(model, model_state, options=opts)
    if opt is None or opt_state is None:
        return
    names = _trained_names(model)
    osd: dict[str, Any] = {
        "state": {names[int(k)]: v for k, v in opt_state["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in opt_state["param_groups"]],
    }
    set_optimizer_state_dict(model, opt, osd, options=opts)


def _trained_names(model: Any) -> list[str]:
    """The names of the parameters the loop's optimizer holds, in its order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]
