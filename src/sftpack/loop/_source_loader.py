"""The loader path's source: one global stream of rows, each step's rows dealt to the ranks by cost
(see :mod:`._sources`).

Every rank holds all the samples (``sftpack train`` reads them into memory), so every rank runs
the same :class:`~sftpack.loader.PackingDataset` over the same seeded global order (``rank=0``,
``world_size=1``): the rows one process packs, whatever the world size. Running the packer's
decisions needs only the samples' lengths (:meth:`~sftpack.loader.PackingDataset.decided_rows`);
each step takes the next ``batch_size`` decided rows, deals them to the ranks by cost
(:func:`sftpack.balance.deal`: ``batch_size / world`` each, heaviest first), and each rank lays
only its own. No rank reads another's data twice, and a step trains on the same rows at any
world size, so its state (the global dataset's, the rows consumed) is the same on every rank and
resumes on another number of ranks (``elastic``).

Preference pairs (``--objective dpo`` / ``simpo``): the dataset is built with ``groups=True`` and rows
of ``2 * max_seq_len`` slots (the trainer path's preference micro-batch width: a pair's two members,
each at most ``max_seq_len``, always fit one row), so each pair is one row's (``batch_size`` still
counts rows) and a row is dealt whole. Weighted samples: a row carries
its ``weights`` and :attr:`~._sources.Source.step_weighted` says whether any row of the step (on any
rank: every rank decides the same global rows) does, so the loop divides by ``sum |w|``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..balance import SequenceCost, deal, sequence_cost
from ..loader import DecidedRow, PackingDataset
from ._micro_batch import MicroBatch
from ._sources import Source, _hash, rows_per_rank, rows_to_micro_batches

__all__ = ["LoaderSource"]


class LoaderSource(Source):
    """The rows of one global :class:`sftpack.loader.PackingDataset` (built with ``rank=0``,
    ``world_size=1``, ``num_epochs=None``): each step its next ``batch_size`` rows, dealt to the
    ``world`` ranks by ``cost`` (a :class:`~sftpack.balance.SequenceCost` over each row's sequence
    lengths, or any :func:`~sftpack.balance.sequence_cost` spelling; default ``"tokens"``), this
    rank laying its ``batch_size / world``. The position is the global dataset's state and the
    rows consumed, the same on every rank: a checkpoint of ``N`` ranks resumes on ``M``."""

    #: the position is the same on every rank and for any world size (the checkpoint may resume it on another)
    elastic = True

    def __init__(
        self,
        dataset: PackingDataset,
        *,
        batch_size: int,
        samples_fp: str,
        rank: int = 0,
        world: int = 1,
        grad_accum: int = 1,
        cost: str | Path | SequenceCost | None = None,
        group_of: Mapping[Any, Any] | None = None,
    ) -> None:
        if (dataset.rank, dataset.world_size) != (0, 1):
            raise ValueError(
                f"LoaderSource deals one global stream to the ranks, but the dataset packs the share of rank "
                f"{dataset.rank} of world_size={dataset.world_size}: build it with rank=0, world_size=1 on every rank"
            )
        self.ds = dataset
        self.batch_size = batch_size
        self.per_rank = rows_per_rank(batch_size, world, grad_accum)
        self.rank, self.world = rank, world
        self.grad_accum = grad_accum
        self.cost = sequence_cost(cost)
        self.rows = 0  # global rows consumed
        self._fp = samples_fp
        self._it: Any = None
        #: each grouped SFT sequence's group by its id (the dataset built with ``groups=True`` keeps a
        #: group whole in one row): what :attr:`step_groups` numbers; ``None``: the groups are not known
        self.group_of = group_of

    def _take(self) -> list[DecidedRow]:
        """The next step's ``batch_size`` rows of the global stream (decided, not laid)."""
        if self._it is None:
            self._check_ranks()
            self._it = self.ds.decided_rows()
        rows = []
        for _ in range(self.batch_size):
            try:
                rows.append(next(self._it))
            except StopIteration:
                raise ValueError("the loader ran out of rows: build it with num_epochs=None") from None
        self.rows += self.batch_size
        return rows

    def _check_ranks(self) -> None:
        """Refuse fewer samples than ranks: every step would train some sample on two ranks at once."""
        n = self.ds.num_samples
        if n is not None and n < self.world:
            raise ValueError(
                f"PackingDataset (rank {self.rank} of world_size={self.world}): the source holds {n} samples but "
                f"they are dealt to {self.world} shares (each rank's rows of a step), so every step would train "
                f"some sample on two ranks at once: use at most {n} ranks, or more samples"
            )

    def step_rows(self) -> list[list[DecidedRow]]:
        """The next step's rows dealt to the ranks: ``[rank][i]``, each rank's heaviest first (it moves
        the position, as :meth:`next_step` does, without laying a row)."""
        rows = self._take()
        offsets = np.cumsum([0] + [len(r.lengths) for r in rows])
        lengths = np.concatenate([r.lengths for r in rows])
        dealt = deal(self.cost.of_groups(lengths, offsets), self.world, self.per_rank)
        return [[rows[i] for i in mine.tolist()] for mine in dealt]

    def next_step(self) -> list[MicroBatch]:
        dealt = self.step_rows()
        # every rank decides the same global rows: so whether the step carries weights is the same on every rank
        self.step_weighted = any(r.weighted for rows in dealt for r in rows)
        mbs = rows_to_micro_batches([r.build() for r in dealt[self.rank]], self.grad_accum)
        if self.group_of is not None:
            self.step_groups = self._step_groups(dealt, mbs)
        return mbs

    def _step_groups(self, dealt: list[list[DecidedRow]], mbs: list[MicroBatch]) -> tuple[list[list[int]], int]:
        """:attr:`step_groups`: the step's groups numbered over every rank's rows (the same decisions on
        every rank), in this rank's micro-batches' sequence order; a sequence of no group is its own."""
        assert self.group_of is not None
        numbers: dict[Any, int] = {}
        mine: list[int] = []
        for r, rows in enumerate(dealt):
            for i, row in enumerate(rows):
                for j, sid in enumerate(row.sequence_ids):
                    group = self.group_of.get(sid)
                    key = ("own", r, i, j) if group is None else ("group", group)
                    number = numbers.setdefault(key, len(numbers))
                    if r == self.rank:
                        mine.append(number)
        out, at = [], 0
        for mb in mbs:
            n = len(mb.sequence_ids or ())
            out.append(mine[at : at + n])
            at += n
        return out, len(numbers)

    def epoch_steps(self) -> int:
        """The steps of the first epoch's rows (counted by deciding it once, then back to the
        start: the loader packs as it streams, so later epochs may hold a row more or less)."""
        if self._it is not None:
            raise ValueError("LoaderSource.epoch_steps: ask before the first step")
        start = self.ds.state_dict()
        first, rows = self.ds.epoch, 0
        for _ in self.ds.decided_rows():
            rows += 1
            if self.ds.epoch != first:
                break
        self.ds.load_state_dict(start)
        return rows // self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.ds.state_dict(), "rows": self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = state.get("rows")
        if not isinstance(rows, int) or rows < 0 or rows % self.batch_size:
            raise ValueError(
                f"the loader source's state holds rows={rows!r}, not a whole number of steps of batch_size="
                f"{self.batch_size} global rows: it was saved by an older sftpack (each rank its own share) or "
                "damaged; resume with the sftpack that saved it, or start a fresh --checkpoint-dir"
            )
        self.ds.load_state_dict(state["loader"])
        self.rows = rows
        self._it = None

    def fingerprint(self) -> str:
        cfg = {k: getattr(self.ds, k, None) for k in ("max_seq_len", "buffer_size", "pad_multiple", "seed")}
        key: dict[str, Any] = {
            "loader": self._fp,
            "config": cfg,
            "batch_size": self.batch_size,
            "stream": "global",  # each step the same global rows at any world size, dealt by cost
        }
        if self.ds.groups:  # an SFT run's fingerprint stays what it was
            key["groups"] = True
        return _hash(key)
