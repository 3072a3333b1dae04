"""The offline path's source: each step's rows of a prepacked directory (see :mod:`._sources`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..offline import PrepackedDataset
from ._micro_batch import MicroBatch
from ._sources import Source, _hash, rows_per_rank

__all__ = ["OfflineSource"]


class OfflineSource(Source):
    """Rows of a prepacked directory (:class:`sftpack.offline.PrepackedDataset`,
    opened with this rank's ``rank`` / ``world_size``: the path's own shards,
    balanced by tokens, every row read once per epoch over all ranks).

    Each step takes the next ``batch_size / world`` rows of this rank's shard in
    the dataset's epoch order; when fewer are left the next epoch starts
    (``set_epoch``, a fresh seeded order) and the leftover rows wait for it.
    """

    def __init__(self, dataset: PrepackedDataset, *, batch_size: int, world: int = 1, grad_accum: int = 1) -> None:
        self.ds = dataset
        self.batch_size = batch_size
        self.per_rank = rows_per_rank(batch_size, world, grad_accum)
        if len(dataset) < self.per_rank:
            raise ValueError(
                f"this rank's share of the prepacked dataset has {len(dataset)} rows, fewer than the "
                f"{self.per_rank} a step needs (batch_size={batch_size} over {world} rank(s)): lower --batch-size"
            )
        self.grad_accum = grad_accum
        self.epoch, self.position = 0, 0

    def next_step(self) -> list[MicroBatch]:
        if self.position + self.per_rank > len(self.ds):
            self.epoch, self.position = self.epoch + 1, 0
            self.ds.set_epoch(self.epoch)
        positions = np.arange(self.position, self.position + self.per_rank)
        self.position += self.per_rank
        # each micro-batch's rows in one compiled pass (PrepackedDataset.batch): field for field
        # what _rows_to_micro_batches makes of the rows read one by one
        return [self.ds.batch(p) for p in np.array_split(positions, self.grad_accum) if len(p)]

    def epoch_steps(self) -> int:
        return len(self.ds) // self.per_rank

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.ds.set_epoch(self.epoch)

    def fingerprint(self) -> str:
        manifest = getattr(self.ds, "manifest", None) or {}
        key = manifest.get("fingerprint") or manifest
        return _hash(
            {
                "offline": key,
                "batch_size": self.batch_size,
                "seed": getattr(self.ds, "seed", None),
            }
        )
