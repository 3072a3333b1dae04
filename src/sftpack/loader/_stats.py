"""What a loader did: samples in, rows out, fill, and every sample's fate, counted.

Each (rank, worker) keeps its own :class:`LoaderStats` inside its state, so
the counts survive a resume and add up over workers:
``LoaderStats.from_state(loader.state_dict())`` sums the workers of a torchdata
``StatefulDataLoader`` (or reads one :class:`~sftpack.loader.PackingDataset`
state). Nothing is silently lost::

    samples_in == samples_packed + dropped        (per completed epoch)
    sequences_out == samples_packed + extra pieces of split samples

and in any state, every sequence read is emitted, still buffered or pending, or abandoned::

    samples_in - dropped + extra_pieces == sequences_out + buffered + pending + abandoned
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["LoaderStats"]


@dataclass
class LoaderStats:
    """Counts of one loader (or the sum over several workers).

    Attributes:
        samples_in: source samples read.
        rows_out: rows emitted (each ``max_seq_len`` slots).
        sequences_out: sequences (samples, or pieces of split samples) in those rows.
        real_tokens: real tokens in those rows.
        slots: token slots in those rows (``rows_out * max_seq_len``).
        split: samples longer than a row that were cut into pieces.
        extra_pieces: pieces beyond the first, over all split samples.
        truncated: samples cut to ``max_seq_len``; ``tokens_truncated`` tokens lost.
        dropped: over-long samples left out (``overlong="drop"``); ``tokens_dropped`` tokens.
        rounds: buffers packed.
        held_rows: under-filled rows kept back for the next round.
        max_waited: the most rounds any emitted sequence waited in the buffer.
        epochs: epochs completed.
        abandoned: sequences read but never emitted because ``set_epoch`` dropped a partial epoch.
    """

    samples_in: int = 0
    rows_out: int = 0
    sequences_out: int = 0
    real_tokens: int = 0
    slots: int = 0
    split: int = 0
    extra_pieces: int = 0
    truncated: int = 0
    tokens_truncated: int = 0
    dropped: int = 0
    tokens_dropped: int = 0
    rounds: int = 0
    held_rows: int = 0
    max_waited: int = 0
    epochs: int = 0
    abandoned: int = 0

    @property
    def dropped_total(self) -> int:
        """Samples left out (``dropped``; as ``MultimodalLoaderStats.dropped_total``)."""
        return self.dropped

    @property
    def fill(self) -> float:
        """Real tokens per slot of the emitted rows (1.0 = no padding)."""
        return self.real_tokens / self.slots if self.slots else 0.0

    @property
    def samples_packed(self) -> int:
        """Source samples whose tokens went into rows (whole, truncated or as pieces)."""
        return self.sequences_out - self.extra_pieces

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"fill": self.fill}

    def __add__(self, other: LoaderStats) -> LoaderStats:
        out = LoaderStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})
        out.max_waited = max(self.max_waited, other.max_waited)
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LoaderStats:
        """The counts held by a :class:`~sftpack.loader.PackingDataset` state, or summed over the
        workers of a torchdata ``StatefulDataLoader`` state.

        >>> LoaderStats.from_state({"stats": {"rows_out": 2, "real_tokens": 30, "slots": 72}}).fill
        0.4166666666666667
        """
        found = list(_dataset_states(state))
        if not found:
            raise ValueError("no sftpack.loader.PackingDataset state found in this state dict")
        total = cls()
        for s in found:
            total = total + cls.from_dict(s["stats"])
        return total

    @classmethod
    def from_dict(cls, counts: dict[str, Any]) -> LoaderStats:
        """Inverse of :meth:`as_dict` (derived entries such as ``fill`` are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in counts.items() if k in names})


def _dataset_states(state: Any):
    """Every PackingDataset state (a dict with a 'stats' entry) nested in ``state``."""
    if isinstance(state, dict):
        if "stats" in state and isinstance(state["stats"], dict):
            yield state
            return
        for v in state.values():
            yield from _dataset_states(v)
