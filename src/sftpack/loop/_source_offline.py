"""The offline path's source: each step's rows of a prepacked directory (see :mod:`._sources`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..offline import PrepackedDataset
from ._micro_batch import MicroBatch
from ._sources import Source, _hash, rows_per_rank

__all__ = ["OfflineSource"]


class OfflineSource(Source):
    """Rows of a prepacked directory (:class:`sftpack.offline.PrepackedDataset`, opened with this
    rank's ``rank`` / ``world_size``) as one global stream.

    Each epoch has one seeded order of all the prepack's rows, whatever the world size; step
    ``s`` trains on its positions ``[s * batch_size, (s + 1) * batch_size)``, dealt to the
    ranks by cost (:meth:`PrepackedDataset.step_rows`: ``batch_size / world`` rows each, each
    rank's heaviest first, so its ``i``-th row runs beside the other ranks' ``i``-th rows in
    the same micro-batch slot). When fewer than ``batch_size`` rows are left the next epoch
    starts (a fresh seeded order; the leftover rows wait for it).

    The position, ``(epoch, rows consumed in the epoch)``, counts rows over all ranks, so a
    state saved at ``N`` ranks continues at ``M`` ranks with the very rows the run would have
    read next (:attr:`elastic`; ``batch_size`` must be a multiple of ``M``).

    A prepack with per-token weights gives rows with :attr:`~sftpack.PackedBatch.weights`, and every
    step is then weighted (:attr:`step_weighted`, the same on every rank: the loss divides by
    ``sum |w|``). A prepack of preference pairs gives rows whose ids are ``(group, role)``, each pair
    whole in one row (so in one micro-batch of one rank); ``batch_size`` still counts rows.
    """

    elastic = True  #: the state is the same on every rank and for any world size

    def __init__(self, dataset: PrepackedDataset, *, batch_size: int, world: int = 1, grad_accum: int = 1) -> None:
        self.ds = dataset
        self.batch_size = batch_size
        self.per_rank = rows_per_rank(batch_size, world, grad_accum)
        if dataset.world_size != world:
            raise ValueError(
                f"the prepacked dataset was opened for world_size={dataset.world_size}, the run has {world} "
                "rank(s): open it with the run's rank and world size"
            )
        if dataset.num_rows < batch_size:
            raise ValueError(
                f"the prepacked dataset has {dataset.num_rows} rows, fewer than the batch_size={batch_size} rows a "
                "step trains on: lower --batch-size"
            )
        self.grad_accum = grad_accum
        self.epoch, self.rows = 0, 0
        # a weighted prepack's every row carries weights (1 on an unweighted sample's targets)
        self.step_weighted = getattr(dataset, "weights", None) is not None

    def next_step(self) -> list[MicroBatch]:
        if self.rows + self.batch_size > self.ds.num_rows:
            self.epoch, self.rows = self.epoch + 1, 0
        if self.ds.epoch != self.epoch:
            self.ds.set_epoch(self.epoch)
        mine = self.ds.step_rows(self.rows, self.batch_size)[self.ds.rank]
        self.rows += self.batch_size
        # each micro-batch's rows in one compiled pass (PrepackedDataset.read_rows): field for field
        # what _rows_to_micro_batches makes of the rows read one by one
        return [self.ds.read_rows(p) for p in np.array_split(mine, self.grad_accum) if len(p)]

    def epoch_steps(self) -> int:
        return self.ds.num_rows // self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "rows": self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "rows" not in state:
            raise ValueError(
                f"offline data position {state}: written by an sftpack whose offline path read each rank's own "
                "shard, not one global stream of rows; it cannot be continued exactly: finish the run with the "
                "sftpack that started it, or start a fresh --checkpoint-dir"
            )
        epoch, rows = int(state["epoch"]), int(state["rows"])
        if rows < 0 or rows > self.ds.num_rows or rows % self.batch_size:
            raise ValueError(
                f"offline data position {state}: {rows} rows read in epoch {epoch} is not a whole number of steps "
                f"of batch_size={self.batch_size} within the prepack's {self.ds.num_rows} rows: the checkpoint "
                "belongs to another run"
            )
        self.epoch, self.rows = epoch, rows
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
