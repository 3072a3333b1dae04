"""The loader path's source: each step's rows streamed from a :class:`~sftpack.loader.PackingDataset`
(see :mod:`._sources`)."""

from __future__ import annotations

from typing import Any

from ..loader import PackingDataset
from ._micro_batch import MicroBatch
from ._sources import Source, _hash, rows_per_rank, rows_to_micro_batches

__all__ = ["LoaderSource"]


class LoaderSource(Source):
    """Rows streamed from a :class:`sftpack.loader.PackingDataset` (built with this
    rank's ``rank`` / ``world_size`` and ``num_epochs=None``); ``B/W`` rows per rank
    per step. The position is the dataset's own ``state_dict``."""

    def __init__(
        self,
        dataset: PackingDataset,
        *,
        batch_size: int,
        samples_fp: str,
        rank: int = 0,
        world: int = 1,
        grad_accum: int = 1,
    ) -> None:
        self.ds = dataset
        self.batch_size = batch_size
        self.per_rank = rows_per_rank(batch_size, world, grad_accum)
        self.grad_accum = grad_accum
        self._fp = samples_fp
        self._it: Any = None

    def next_step(self) -> list[MicroBatch]:
        if self._it is None:
            self._it = iter(self.ds)
        rows = []
        for _ in range(self.per_rank):
            try:
                rows.append(next(self._it))
            except StopIteration:
                raise ValueError("the loader ran out of rows: build it with num_epochs=None") from None
        return rows_to_micro_batches(rows, self.grad_accum)

    def epoch_steps(self) -> int:
        """The steps of the first epoch's rows (counted by packing it once, then back to the
        start: the loader packs as it streams, so later epochs may hold a row more or less)."""
        if self._it is not None:
            raise ValueError("LoaderSource.epoch_steps: ask before the first step")
        start = self.ds.state_dict()
        first, rows = self.ds.epoch, 0
        for _ in self.ds:
            rows += 1
            if self.ds.epoch != first:
                break
        self.ds.load_state_dict(start)
        return rows // self.per_rank

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.ds.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ds.load_state_dict(state["loader"])
        self._it = None

    def fingerprint(self) -> str:
        cfg = {k: getattr(self.ds, k, None) for k in ("max_seq_len", "buffer_size", "pad_multiple", "seed")}
        return _hash({"loader": self._fp, "config": cfg, "batch_size": self.batch_size})
