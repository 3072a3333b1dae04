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

A loader of samples with media counts their images and vision patches too, and each
sample left out under its reason (:attr:`LoaderStats.dropped_by`). The counts of a
loader that never saw media are exactly a text loader's (:meth:`LoaderStats.as_dict`
writes a media count or reason only once it is non-zero).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ._source import Item

__all__ = ["OVERLONG", "LoaderStats"]

#: the reason of a sample left out for its length (``overlong="drop"``)
OVERLONG = "overlong"
#: the counts that are not plain integers of the text loader (written only when non-zero)
_MEDIA = ("images_out", "patches_out")


@dataclass
class LoaderStats:
    """Counts of one loader (or the sum over several workers).

    Attributes:
        samples_in: source samples read.
        rows_out: rows emitted (each ``max_seq_len`` slots).
        sequences_out: sequences (samples, or pieces of split samples) in those rows.
        real_tokens: real tokens (vision placeholders included) in those rows.
        slots: token slots in those rows (``rows_out * max_seq_len``).
        split: samples longer than a row that were cut into pieces.
        extra_pieces: pieces beyond the first, over all split samples.
        truncated: samples cut to ``max_seq_len``; ``tokens_truncated`` tokens lost.
        dropped: samples left out, for any reason (:attr:`dropped_by`); ``tokens_dropped``
            their tokens (where known: a record that could not be read has none).
        rounds: buffers packed.
        held_rows: under-filled rows kept back for the next round.
        max_waited: the most rounds any emitted sequence waited in the buffer.
        epochs: epochs completed.
        abandoned: sequences read but never emitted because ``set_epoch`` dropped a partial epoch.
        images_out, patches_out: media items (images) and vision patches in the emitted rows.
        reasons: samples left out for a reason other than their length, by reason (a bad image
            under its :class:`~sftpack.multimodal.BadImageReason` value, ``bad_record``,
            ``over_patch_budget``); :attr:`dropped_by` adds the over-long ones.
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
    images_out: int = 0
    patches_out: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def dropped_total(self) -> int:
        """Samples left out (``dropped``, every reason)."""
        return self.dropped

    @property
    def dropped_by(self) -> dict[str, int]:
        """Samples left out by reason: ``overlong`` (longer than a row under ``overlong="drop"``, or
        an image block longer than a row) and :attr:`reasons`; the values sum to ``dropped``."""
        out = dict(self.reasons)
        length = self.dropped - sum(out.values())
        if length:
            out[OVERLONG] = length
        return dict(sorted(out.items()))

    @property
    def fill(self) -> float:
        """Real tokens per slot of the emitted rows (1.0 = no padding)."""
        return self.real_tokens / self.slots if self.slots else 0.0

    @property
    def samples_packed(self) -> int:
        """Source samples whose tokens went into rows (whole, truncated or as pieces)."""
        return self.sequences_out - self.extra_pieces

    def drop(self, reason: str, tokens: int = 0) -> None:
        """Count one sample left out under ``reason`` (with ``tokens`` tokens)."""
        self.dropped += 1
        self.tokens_dropped += tokens
        if reason != OVERLONG:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def count_row(self, row: Sequence[Item], max_seq_len: int) -> None:
        """Count one emitted row of ``max_seq_len`` slots holding ``row``'s items (and their media)."""
        self.rows_out += 1
        self.sequences_out += len(row)
        self.real_tokens += sum([it.length for it in row])
        self.slots += max_seq_len
        for it in row:
            if it.media is not None:
                self.images_out += it.media.num_items
                self.patches_out += it.media.num_patches

    def as_dict(self) -> dict[str, Any]:
        """The counts as flat numbers (what a state stores): every count, a media count only when
        non-zero, each reason ``r`` of :attr:`reasons` as ``dropped:r``, and ``fill``."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "reasons"}
        for k in _MEDIA:
            if not out[k]:
                del out[k]
        out |= {f"dropped:{k}": v for k, v in sorted(self.reasons.items())}
        return out | {"fill": self.fill}

    def __add__(self, other: LoaderStats) -> LoaderStats:
        out = LoaderStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "reasons"}
        )
        out.max_waited = max(self.max_waited, other.max_waited)
        out.reasons = {k: self.reasons.get(k, 0) + other.reasons.get(k, 0) for k in self.reasons.keys() | other.reasons}
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
    def from_dict(cls, counts: Mapping[str, Any]) -> LoaderStats:
        """Inverse of :meth:`as_dict` (derived entries such as ``fill`` are ignored)."""
        names = {f.name for f in fields(cls)} - {"reasons"}
        known: dict[str, Any] = {k: int(v) for k, v in counts.items() if k in names}
        out = cls(**known)
        out.reasons = {k[len("dropped:") :]: int(v) for k, v in counts.items() if k.startswith("dropped:")}
        return out


def _dataset_states(state: Any) -> Iterator[dict[str, Any]]:
    """Every PackingDataset state (a dict with a 'stats' entry) nested in ``state``."""
    if isinstance(state, dict):
        if "stats" in state and isinstance(state["stats"], dict):
            yield state
            return
        for v in state.values():
            yield from _dataset_states(v)
