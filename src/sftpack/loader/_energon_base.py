"""What the Energon task encoder builds on: reading a crude sample's JSON, and the check that an
Energon state is restored over the data it was saved over.

:class:`CheckedTaskEncoder` (the base of :class:`~sftpack.loader.PackingTaskEncoder`) puts one
more level into Energon's pipeline, right after the
batcher: :class:`StateCheck`, a pass-through that remembers the restore key of the last batch it
emitted and a fingerprint of that batch (its ids, real lengths and tokens). Energon saves that
with the rest of ``loader.save_state_rank()``; after ``loader.restore_state_rank(state)`` the
first ``next()`` re-reads that batch from its key (Energon's ``restore_sample``, the samples only)
and compares: over other data of the same length (the samples reversed or replaced, a shard
changed), Energon would re-read other samples and resume silently; here it is a
:class:`~sftpack.loader.StateError` naming the field that differs. Energon stores restore keys,
not samples, so data not yet read when the state was saved cannot be checked.

It also puts :class:`EndOfData` right above the reader (each crude dataset's cooker; for a dataset
that needs no cooker, right below the packer): a pass-through that saves whether its source has been
read to its end. Energon 7.4.1's reader (``WebdatasetSampleLoaderDataset``, JSONL included) rolls its
own state over to the start of the next epoch as soon as it runs out, and with ``repeat=False``
nothing else remembers that it ran out. A level that reads ahead (the packer filling its buffer, a
shuffle buffer) hits that end while it still holds samples to emit; a state saved then restored the
held samples *and* a reader at the start of another epoch, so the restored loader emitted the whole
epoch again (10 samples, buffer 8, saved after the first buffer's last row: three rows where one
was left, the 8 samples emitted before the save again and the 2 held ones twice). Restored from such
a state, :class:`EndOfData` yields nothing, and the levels above emit only what they held.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from megatron.energon import TaskEncoder
from megatron.energon.wrappers.base import BaseWrapperDataset

from ._state import StateError, digest

__all__ = ["CheckedTaskEncoder", "EndOfData", "StateCheck", "crude_json", "sample_where"]

#: the version of the state below :class:`StateCheck` (its fields and sftpack's levels): 2 added
#: :class:`EndOfData`, which a version-1 state lacks (Energon would fail on it with a bare assert)
CHECK_VERSION = 2


def sample_where(key: Any, sources: Any) -> str:
    """``Energon sample KEY of SHARD`` (the shard when Energon names it)."""
    shard = ""
    for src in sources or ():
        shard = f" of {getattr(src, 'shard_name', src)}"
        break
    return f"Energon sample {key!r}{shard}"


def crude_json(sample: dict) -> tuple[dict | None, str | None]:
    """``(the sample's JSON object, None)``, or ``(None, what is wrong)``: no ``.json`` file, JSON that
    does not parse (where, and why), or an object without ``messages``."""
    raw = sample.get("json")
    if raw is None:
        files = sorted(k for k in sample if not (k.startswith("__") and k.endswith("__")))
        return None, f'it has no .json file (its files: {files}); each sample needs KEY.json with {{"messages": [...]}}'
    data = raw
    if isinstance(raw, (bytes, str)):
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            return None, f"its .json is not valid JSON ({e}; it starts {text[:60]!r})"
    if not isinstance(data, dict) or "messages" not in data:
        return None, f"its .json has no 'messages' field: {str(data)[:80]}"
    return data, None


def _mark(batch: Any) -> dict[str, Any]:
    """What a batch is made of: its samples' ids and real lengths, and a fingerprint of its tokens."""
    row = getattr(batch, "row", batch)  # a packed row sample (no batch_size) or a batch
    ids = [repr(x) for x in row.sequence_ids]
    lengths = row.cu_seqlens.diff().tolist()
    dropped = repr(tuple(getattr(batch, "dropped", ())))
    return {"ids": ids, "lengths": lengths, "tokens": digest(row.input_ids.numpy(), dropped)}


class _PassThrough(BaseWrapperDataset):
    """An Energon level that yields its dataset's samples unchanged (the sizes and config are its
    dataset's); what it saves is its subclass's."""

    def __init__(self, dataset: Any, *, worker_config: Any) -> None:
        super().__init__(dataset, worker_config=worker_config)
        self.reset_state_own()

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def config(self) -> dict[str, Any]:
        return self.dataset.config()  # transparent: it changes no sample

    def __str__(self) -> str:
        return f"{type(self).__name__}(dataset={self.dataset})"


class StateCheck(_PassThrough):
    """A pass-through level after Energon's batcher whose saved state lets a restore check its data
    (see the module docstring)."""

    _savable_fields = ("_version", "_count", "_last_key", "_last_mark")

    def reset_state_own(self) -> None:
        self._version = CHECK_VERSION
        self._count = 0
        self._last_key: Any = None
        self._last_mark: dict[str, Any] | None = None
        self._verify = False

    def restore_state(self, state: Any) -> None:
        name = type(self).__name__
        if not isinstance(state, dict) or state.get("__class__") != name:
            got = state.get("__class__") if isinstance(state, dict) else type(state).__name__
            raise StateError(
                f"this Energon state has no sftpack {name} level where this loader has one (found {got!r}): it was "
                "saved by an older sftpack (or another task encoder), which did not record what its data was; "
                "resume with the sftpack that saved it, or start the run over"
            )
        if state.get("_version") != CHECK_VERSION:
            raise StateError(
                f"the Energon state's sftpack {name} is version {state.get('_version')!r}; this sftpack reads "
                f"version {CHECK_VERSION}: resume with the sftpack that saved it, or start the run over"
            )
        super().restore_state(state)
        self._verify = self._last_key is not None

    def _check(self) -> None:
        self._verify = False
        saved = self._last_mark or {}
        head = f"the Energon state does not match this data: its sftpack {type(self).__name__} field '_last_mark'"
        tail = (
            ": the state was saved over other data (the samples reversed or replaced, a shard changed); restore it "
            "into a loader over the same dataset, or start the run over"
        )
        try:
            again = _mark(self.dataset.restore_sample(self._last_key))
        except Exception as e:  # other samples behind the same keys may not even pack as they did
            raise StateError(
                f"{head}: batch {self._count} (the last one before the save) cannot be rebuilt from its restore key "
                f"here ({type(e).__name__}: {e}){tail}"
            ) from e
        for field in ("ids", "lengths", "tokens"):
            if again[field] != saved.get(field):
                raise StateError(
                    f"{head} ({field}): batch {self._count} (the last one before the save), re-read from its "
                    f"restore key, holds ids {again['ids']} of {again['lengths']} tokens here but held ids "
                    f"{saved.get('ids')} of {saved.get('lengths')} tokens when the state was saved"
                    + (" (other tokens)" if field == "tokens" else "")
                    + tail
                )

    def __iter__(self) -> Iterator[Any]:
        if self._verify:
            self._check()
        for batch in self.dataset:
            self._count += 1
            self._last_key = batch.__restore_key__
            self._last_mark = _mark(batch)
            yield batch


class EndOfData(_PassThrough):
    """A pass-through level whose saved state says whether its source was read to its end in this pass
    (see the module docstring): restored from a state where it was, it yields nothing, instead of
    letting Energon's reader, already rolled over to its next epoch, emit that epoch again."""

    _savable_fields = ("_ended",)

    def reset_state_own(self) -> None:
        self._ended = False
        self._restored = False

    def restore_state(self, state: Any) -> None:
        super().restore_state(state)
        self._restored = True

    def __iter__(self) -> Iterator[Any]:
        restored, self._restored = self._restored, False
        if restored and self._ended:
            return  # the state was saved after this pass read its source to the end: nothing is left of it
        self._ended = False  # a new pass (a RepeatDataset's next one, or the loader iterated again)
        yield from self.dataset
        self._ended = True


class CheckedTaskEncoder(TaskEncoder):
    """A ``TaskEncoder`` whose pipeline ends in :class:`StateCheck` (the batcher's output, checked on
    restore) and whose reader's end is saved by :class:`EndOfData`."""

    def build_cook_crude_sample(self, dataset: Any, *, worker_config: Any, **kw: Any) -> Any:
        """Energon's cooker level over the reader, under an :class:`EndOfData` (below any shuffle buffer,
        repeat or blend, so each of them restores over a reader whose end is known)."""
        cooked = super().build_cook_crude_sample(dataset, worker_config=worker_config, **kw)
        return EndOfData(cooked, worker_config=worker_config)

    def build_batch(self, dataset: Any, *, worker_config: Any, **kw: Any) -> Any:
        if _find(dataset, EndOfData) is None:  # a dataset that needs no cooker: below the packer, then
            dataset = EndOfData(dataset, worker_config=worker_config)
        return StateCheck(super().build_batch(dataset, worker_config=worker_config, **kw), worker_config=worker_config)


def _find(dataset: Any, cls: type) -> Any:
    """``dataset`` itself if it is a ``cls``, else the outermost ``cls`` level it wraps (or None)."""
    if isinstance(dataset, cls):
        return dataset
    return dataset._find_wrapped_dataset(cls) if isinstance(dataset, BaseWrapperDataset) else None
