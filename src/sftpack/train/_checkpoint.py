"""Checkpoints that are whole or absent, and refuse other data.

Layout of ``DIR``::

    DIR/step_000010/state.pt        model, optimizer, scheduler, step, config, data fingerprint
    DIR/step_000010/rank_0.pt       this rank's RNG states and data position (loader state_dict, ...)
    DIR/latest                      "step_000010"

Atomicity: every rank writes into ``step_000010.tmp``; after a barrier rank 0
renames the folder (one ``os.replace``) and then rewrites ``latest`` through a
temporary file and ``os.replace``. A run killed at any moment leaves either the
previous checkpoint as ``latest`` or the new one, never half of one; stale
``*.tmp`` folders are ignored and overwritten.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here (the message says why and what to do)."""


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    *,
    shared: dict[str, Any] | None,
    per_rank: dict[str, Any],
    rank: int = 0,
) -> Path:
    """Write the checkpoint of ``step`` (``shared``: from rank 0 only; ``per_rank``: every rank's own)."""
    root = Path(directory)
    name = f"step_{step:06d}"
    tmp = root / f"{name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    torch.save(per_rank, tmp / f"rank_{rank}.pt")
    if rank == 0:
        assert shared is not None
        torch.save(shared, tmp / "state.pt")
    _barrier()
    final = root / name
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / "latest")
    _barrier()
    return final


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The folder ``latest`` names, or ``None`` when there is no checkpoint yet."""
    pointer = Path(directory) / "latest"
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    if not (path / "state.pt").is_file():
        raise CheckpointError(
            f"{pointer} names {path.name}, which has no state.pt: the checkpoint is damaged"
        )
    return path


def load_checkpoint(
    path: str | os.PathLike[str], *, rank: int, world: int, fingerprint: str
) -> tuple[dict, dict]:
    """``(shared, per_rank)`` of the checkpoint folder ``path``, checked against this run."""
    path = Path(path)
    shared = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    if shared.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path}: this checkpoint was written for other data or data options (fingerprint "
            f"{str(shared.get('fingerprint'))[:12]}..., this run {fingerprint[:12]}...): resume with the same "
            "data, packing, --max-seq-len, --batch-size and --seed, or start a fresh --checkpoint-dir"
        )
    if shared.get("world") != world:
        raise CheckpointError(
            f"{path}: written by {shared.get('world')} rank(s), resumed on {world}: each rank's data position is "
            "saved separately; resume with the same number of processes"
        )
    mine = path / f"rank_{rank}.pt"
    if not mine.is_file():
        raise CheckpointError(
            f"{path}: {mine.name} is missing: the checkpoint is damaged"
        )
    return shared, torch.load(mine, map_location="cpu", weights_only=False)
