"""What one optimizer step trains on, for each packing path, with a resumable position.

A *source* hands each rank, step after step, its micro-batches: packed rows
(:class:`~sftpack.PackedBatch`) for the three paths, right-padded ``[b, S]``
batches (:class:`PaddedMicroBatch`) for the baseline. Every source can say where
it is (:meth:`state_dict`) and go back there (:meth:`load_state_dict`), and
fingerprints its data so that a checkpoint of other data is refused.

How a step is chosen, and sharded over ``world`` data-parallel ranks:

- ``trainer`` / ``none``: the step's ``batch_size`` conversations are the next
  slice of a seeded permutation of the samples (one permutation per epoch, the
  last incomplete batch dropped), the *same* conversations for both. Given a
  :class:`~sftpack.chat._training_samples.ConversationSamples` (what ``sftpack train``
  passes), the permutation is of the *conversations* (:class:`ConversationOrder`):
  each conversation's samples (the pieces of a split one) follow each other, and
  the first step waits only for its own conversations to be tokenized. The
  trainer path bins them into token-budget micro-batches dealt evenly to the
  ranks (:func:`sftpack.trainer.plan_microbatches`) and packs each at the step
  (:func:`sftpack.trainer.pack_step`); the baseline deals them round-robin and
  pads each micro-batch to its longest conversation. SFT groups (``Sample.meta["group"]``
  without a role: a prompt's RL completions) are drawn whole instead
  (:class:`GroupOrder`: a seeded order of the groups, a step as many whole groups as
  ``batch_size`` conversations hold), and the trainer path plans each into one
  micro-batch of one rank (``plan_microbatches(groups=)``), so ``weight_normalisation="group"``
  sees every member; ``groups=False`` draws them as any conversations (a group then spans
  steps, micro-batches and ranks, the normaliser exact either way). Whether data given as
  :class:`~sftpack.chat._training_samples.ConversationSamples` has groups is read from its first
  conversation at the first draw (a grouped run waits for every conversation).
- ``offline`` (:mod:`._source_offline`): one seeded order of the prepack's rows per
  epoch, whatever the world size; each step's ``batch_size`` rows dealt to the ranks by
  cost (:func:`sftpack.balance.deal`).
- ``loader`` (:mod:`._source_loader`): one global stream of rows, what one process's
  :class:`sftpack.loader.PackingDataset` packs; each step's ``batch_size`` rows dealt to
  the ranks by cost, each rank building only its own.

Every path's position is global (the same on every rank, for any world size:
:attr:`Source.elastic`), so a run checkpointed at ``N`` ranks resumes at ``M``.
- ``replay``: given conversations per step (the unpacked reference of a packed run).

Samples with images (``sample.media``) go through the same sources: the trainer
path hands each micro-batch's media to :func:`~sftpack.trainer.pack_step` (and, with
``max_patches_per_row``, plans under a vision-patch budget too), the baseline's padded
micro-batch carries its rows' media laid over the ``[b, S]`` slots
(:attr:`PaddedMicroBatch.media`), and the loader and offline paths hand rows whose
``media`` their own builders laid. :class:`RenumberedSource` maps a prepack's ids
into a model's smaller vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .._base import positive_int, renamed
from ..balance import SequenceCost, sequence_cost
from ..chat import ConversationSamples, conversation_order
from ..handoff import PackedBatch
from ..sample import IGNORE_INDEX, Sample, check_sft_sample, check_unweighted, pair_sequence_id, sft_group
from ..trainer import pack_step, padded_batch, plan_microbatches
from ._micro_batch import MicroBatch, PaddedMicroBatch, media_of, padded_micro_batch

__all__ = [
    "ConversationOrder",
    "MicroBatch",
    "PaddedMicroBatch",
    "PaddedSource",
    "RenumberedSource",
    "ReplaySource",
    "SampleOrder",
    "Source",
    "TrainerSource",
    "padded_micro_batch",
    "rows_per_rank",
    "rows_to_micro_batches",
    "samples_fingerprint",
]


def samples_fingerprint(samples: Sequence[Sample]) -> str:
    """sha256 over every sample's ids and loss mask, in order, the media of a sample
    with media (its runs, its grids where it has them, its pixels) and the weights of a
    sample with weights."""
    h = hashlib.sha256()
    for s in samples:
        h.update(np.int64(len(s)).tobytes())
        h.update(s.input_ids.tobytes())
        h.update(np.packbits(s.loss_mask).tobytes())
        if s.media is not None:
            for t in (s.media.slots, getattr(s.media, "grid_thw", None), s.media.pixel_values):
                if t is not None:
                    h.update(_tensor_bytes(t))
        if s.weights is not None:  # a sample without weights hashes as it always did
            h.update(b"weights")
            h.update(np.asarray(s.weights, dtype=np.float64).tobytes())
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def supervised_targets(samples: Sequence[Sample]) -> int:
    """The number of supervised targets in ``samples``: trained tokens that follow
    another token of the same sample (a sample's first token is never predicted).

    >>> from sftpack.testing import samples_from_lengths
    >>> supervised_targets(samples_from_lengths([1, 1, 4]))
    3
    """
    return sum(int(s.loss_mask[1:].sum()) for s in samples)


def check_targets(samples: Sequence[Sample], max_seq_len: int) -> int:
    """``supervised_targets(samples)``, or a ``ValueError`` saying why there is none."""
    n = supervised_targets(samples)
    if samples and not n:
        raise _no_targets(f"the {len(samples):,} samples", max(len(s) for s in samples), max_seq_len)
    return n


def _no_targets(what: str, longest: int, max_seq_len: int) -> ValueError:
    why = (
        f"every sample is at most {longest} token(s) long (max_seq_len={max_seq_len} splits the conversations "
        "into pieces whose first token has nothing before it to be predicted from): raise --max-seq-len"
        if longest <= 1
        else "no trained token follows another token of its sample: check the loss mask (train_on, the "
        "chat template's assistant markers)"
    )
    return ValueError(f"{what} hold(s) no supervised target, so training would learn nothing: {why}")


class Source(ABC):
    """What :func:`~sftpack.loop.train` reads: this rank's micro-batches, step after step."""

    #: the position (:meth:`state_dict`) is the same on every rank and for any world size, so a
    #: checkpoint written at ``N`` ranks resumes at ``M`` (every rank reads rank 0's position)
    elastic: bool = False

    #: whether the step :meth:`next_step` last gave carries weights on any rank (the same on
    #: every rank): :func:`~sftpack.loop.train` then divides by the weighted count ``sum |w|``
    #: (:func:`sftpack.loss.count_label_tokens` ``weighted=True``), the rule of :mod:`sftpack.loss`
    step_weighted: bool = False

    #: the group number of each sequence of each micro-batch :meth:`next_step` last gave, numbered
    #: over the whole step alike on every rank (``Sample.meta["group"]``; a sample without one is
    #: a group of its own), and the step's number of groups: what ``weight_normalisation="group"``
    #: reads (:func:`sftpack.loss.normalise_weights`); ``None``: this source does not know them
    step_groups: tuple[list[list[int]], int] | None = None

    @abstractmethod
    def next_step(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next optimizer step."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Where the source is (saved in each rank's checkpoint file)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to a position :meth:`state_dict` returned."""

    @abstractmethod
    def fingerprint(self) -> str:
        """A hash of the data and the batching: a checkpoint of another fingerprint is refused."""

    def epoch_steps(self) -> int:
        """The optimizer steps of one pass over this rank's data (what ``TrainConfig.epochs``
        counts in); the position is left where it was."""
        raise ValueError(f"{type(self).__name__} does not know how many steps an epoch holds: give steps, not epochs")


class _EpochPosition:
    """A read position ``(epoch, items read in the epoch)``, saved and restored as a dict."""

    epoch: int
    position: int

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class SampleOrder(_EpochPosition):
    """A seeded permutation of ``n`` items per epoch, read ``batch_size`` at a time.

    >>> o = SampleOrder(5, batch_size=2, seed=0)
    >>> [o.take().tolist() for _ in range(3)]  # 2 batches per epoch, the 5th item dropped
    [[2, 4], [3, 0], [1, 4]]
    """

    def __init__(self, n: int, *, batch_size: int, seed: int) -> None:
        if batch_size > n:
            raise ValueError(
                f"batch_size={batch_size} is more than the {n} conversations available: lower --batch-size or "
                "give more data"
            )
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.position = 0, 0

    def _perm(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def take(self) -> np.ndarray:
        if self.position + self.batch_size > self.n:
            self.epoch, self.position = self.epoch + 1, 0
        out = self._perm()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return out


class ConversationOrder(_EpochPosition):
    """A seeded permutation of the conversations of ``data`` per epoch
    (:func:`~sftpack.chat._training_samples.conversation_order`), their samples laid end to end
    in that order (a split conversation's pieces one after the other, a dropped one
    none) and read ``batch_size`` samples at a time, the last incomplete batch of an
    epoch dropped. :meth:`take` waits only for the conversations it reads, so a run
    can start while the later ones are still being tokenized (in this order).
    The position is ``(epoch, samples read in the epoch)``, as :class:`SampleOrder`'s.
    """

    def __init__(
        self,
        data: ConversationSamples,
        *,
        batch_size: int,
        seed: int,
        check: Callable[[Sample], None] | None = None,
    ) -> None:
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.check = check  # each sample as its conversation is laid (raises to refuse it)
        self.epoch, self.position = 0, 0
        self._built = -1  # the epoch _stream belongs to
        self._perm: list[int] = []
        self._stream: list[Sample] = []
        self._next = 0  # conversations of _perm laid into _stream
        if data.done and len(data.samples()) < batch_size:
            if check is not None:  # a refused sample says so before the count does
                for sample in data.samples():
                    check(sample)
            raise _too_few(batch_size, len(data.samples()))

    def _fill(self, upto: int) -> bool:
        """Lay conversations into this epoch's stream until it holds ``upto`` samples
        (``False``: the epoch has fewer)."""
        if self._built != self.epoch:
            self._perm = conversation_order(self.data.n, seed=self.seed, epoch=self.epoch).tolist()
            self._stream, self._next, self._built = [], 0, self.epoch
        while len(self._stream) < upto and self._next < len(self._perm):
            group = self.data.group(self._perm[self._next])
            if self.check is not None:
                for sample in group:
                    self.check(sample)
            self._stream.extend(group)
            self._next += 1
        return len(self._stream) >= upto

    def take(self) -> list[Sample]:
        if not self._fill(self.position + self.batch_size):
            self.epoch, self.position = self.epoch + 1, 0
            if not self._fill(self.batch_size):
                raise _too_few(self.batch_size, len(self._stream))
        out = self._stream[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return out


def _too_few(batch_size: int, n: int) -> ValueError:
    return ValueError(
        f"batch_size={batch_size} is more than the {n} conversations available: lower --batch-size or give more data"
    )


class GroupOrder(_EpochPosition):
    """A seeded permutation of whole groups per epoch (``sizes[u]``: the samples of group ``u``),
    read a step at a time: the next groups in the order while the step's samples stay within
    ``batch_size`` (a step stops at the first group that would overflow it, so it may hold fewer
    samples when the groups' sizes differ), the rest of an epoch dropped once it holds fewer than
    ``batch_size`` samples. The position is ``(epoch, groups read in the epoch)``.

    >>> o = GroupOrder([2, 2, 2, 1, 2], batch_size=4, seed=0)
    >>> [o.take().tolist() for _ in range(3)]  # steps of 4 and 3 samples (group 1 would overflow), group 1 dropped
    [[2, 4], [3, 0], [1, 4]]
    """

    def __init__(self, sizes: Sequence[int], *, batch_size: int, seed: int, name: Callable[[int], str] = str) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.batch_size, self.seed = batch_size, seed
        big = np.flatnonzero(self.sizes > batch_size)
        if big.size:
            u = int(big[0])
            raise ValueError(
                f"group {name(u)} has {int(self.sizes[u])} conversations, more than --batch-size {batch_size}: a step "
                f"trains whole groups (a prompt's completions, Sample.meta['group']): raise --batch-size to at least "
                f"{int(self.sizes[u])} (a multiple of the group size fills each step)"
            )
        if int(self.sizes.sum()) < batch_size:
            raise _too_few(batch_size, int(self.sizes.sum()))
        self.epoch, self.position = 0, 0

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.sizes))

    def _end(self, perm: np.ndarray, start: int) -> int | None:
        """Where the step starting at group ``start`` of ``perm`` ends (``None``: the epoch's rest is too few)."""
        held = np.cumsum(self.sizes[perm[start:]])
        if not held.size or int(held[-1]) < self.batch_size:
            return None
        return start + int(np.searchsorted(held, self.batch_size, side="right"))

    def take(self) -> np.ndarray:
        perm = self._perm(self.epoch)
        end = self._end(perm, self.position)
        if end is None:
            self.epoch, self.position = self.epoch + 1, 0
            perm = self._perm(self.epoch)
            end = self._end(perm, 0)
            assert end is not None  # __init__: the groups hold at least batch_size samples
        out = perm[self.position : end]
        self.position = end
        return out

    def epoch_steps(self) -> int:
        """The steps of epoch 0 (another epoch's may differ by a step when the groups' sizes differ)."""
        perm, start, steps = self._perm(0), 0, 0
        while (end := self._end(perm, start)) is not None:
            start, steps = end, steps + 1
        return steps


def _group_units(keys: Sequence[Any]) -> list[list[int]]:
    """The indices of each group's samples (by key), groups in order of first appearance."""
    units: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        units.setdefault(key, []).append(i)
    return list(units.values())


def _pair_units(samples: Sequence[Sample]) -> list[list[int]]:
    """The indices of each preference pair's samples (``meta["group"]``), pairs in order of first appearance."""
    units: dict[Any, list[int]] = {}
    for i, s in enumerate(samples):
        group = s.meta.get("group") if s.meta else None
        if group is None or s.meta.get("role") is None:
            raise ValueError(
                f"sample {i} (conversation {s.conversation_id!r}) is not a member of a preference pair (no "
                "meta['group'] / meta['role']): a preference objective (dpo, simpo) trains pairs "
                "(sftpack.chat.tokenize_pair; prompt/chosen/rejected rows)"
            )
        units.setdefault(group, []).append(i)
    return list(units.values())


class _SampleSource(Source):
    """The step's ``batch_size`` conversations drawn in a seeded order, for ``world`` ranks of
    ``grad_accum`` micro-batches each (the trainer path and the baseline). ``pairs``: preference
    pairs, ``batch_size`` of them a step. ``groups``: draw SFT groups whole (:class:`GroupOrder`);
    ``None`` (default): when the samples have any (a list: any sample; ``ConversationSamples``: its
    first conversation), ``False``: never."""

    def __init__(
        self,
        samples: Sequence[Sample] | ConversationSamples,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        grad_accum: int = 1,
        pad_id: int = 0,
        pairs: bool = False,
        groups: bool | None = None,
    ) -> None:
        if batch_size < world * grad_accum:
            raise ValueError(
                f"batch_size={batch_size} {'pairs' if pairs else 'conversations'} cannot give {world} rank(s) "
                f"{grad_accum} micro-batch(es) each: raise --batch-size to at least {world * grad_accum}"
            )
        self.samples = samples
        self.pairs = pairs
        self.order: SampleOrder | ConversationOrder | GroupOrder
        self._units: list[list[int]] | None = None  # pairs or whole groups: each one's sample indices
        self._group_samples: Sequence[Sample] | None = None  # whole groups: the samples _units index
        self._seed, self._batch_size = seed, batch_size
        #: ConversationSamples, ``groups=None``: whether the data has SFT groups is decided at the first draw
        self._undecided = False
        self.whole_groups = False  # each SFT group drawn whole into one step, planned into one micro-batch
        if pairs and groups:
            raise ValueError("groups=True is for SFT groups (a prompt's completions); pairs are always kept whole")
        if isinstance(samples, ConversationSamples):
            # a pair is one conversation of two samples, laid whole: 2 * batch_size samples are batch_size pairs
            # SFT: a preference pair is refused as its conversation is read (make_source checks a list whole)
            self._undecided = not pairs and groups is not False
            self.order = ConversationOrder(
                samples,
                batch_size=2 * batch_size if pairs else batch_size,
                seed=seed,
                check=None if pairs else self._check_sft if self._undecided else check_sft_sample,
            )
            if groups and self._undecided:
                self._decide()
        elif not pairs and (groups or (groups is None and any(sft_group(s) is not None for s in samples))):
            self._whole_groups(samples, [(_OWN_GROUP, i) for i in range(len(samples))])
        elif pairs:
            self._units = _pair_units(samples)
            self.order = SampleOrder(len(self._units), batch_size=batch_size, seed=seed)
        else:
            self.order = SampleOrder(len(samples), batch_size=batch_size, seed=seed)
        self.rank, self.world, self.grad_accum, self.pad_id = rank, world, grad_accum, pad_id
        self._fp: str | None = None
        self._checked = False
        self._ahead: list[Sample] | None = None  # drawn by wait_first, handed over by the next step
        self.max_seq_len = 0  # for the message when no sample has a target (make_source sets it)

    def _whole_groups(self, samples: Sequence[Sample], own: Sequence[Any]) -> None:
        """Draw ``samples`` as whole SFT groups (``own[i]``: the group of sample ``i`` when it has none)."""
        keys = [g if (g := sft_group(s)) is not None else own[i] for i, s in enumerate(samples)]
        self._units, self._group_samples, self.whole_groups = _group_units(keys), samples, True

        def name(u: int) -> str:
            first = self._units[u][0]  # type: ignore[index]
            key = keys[first]
            return f"of conversation {samples[first].conversation_id!r}" if isinstance(key, tuple) else repr(key)

        sizes = [len(u) for u in self._units]
        self.order = GroupOrder(sizes, batch_size=self._batch_size, seed=self._seed, name=name)

    def _check_sft(self, sample: Sample) -> None:
        """An SFT sample laid by a run that found no groups at its first draw: a grouped one is refused."""
        check_sft_sample(sample)
        if sft_group(sample) is not None:
            raise ValueError(
                f"conversation {sample.conversation_id!r} has a 'group' ({sft_group(sample)!r}), but the data's first "
                "conversation has none, so the run draws conversations, not whole groups: give every row a 'group' "
                "(a lone conversation: a group of its own) or none"
            )

    def _decide(self) -> None:
        """ConversationSamples: does the data hold SFT groups? Read from its first conversation (in file
        order); if so, wait for every conversation and draw whole groups (a conversation without a group
        is one of its own)."""
        if not self._undecided:
            return
        self._undecided = False
        data = self.samples
        assert isinstance(data, ConversationSamples)
        first = next((g for pos in range(data.n) if (g := data.group(pos))), [])
        if not first or sft_group(first[0]) is None:
            return
        got = data.wait()
        assert got.positions is not None
        for sample in got.samples:
            check_sft_sample(sample)
        check_targets(got.samples, self.max_seq_len)
        self._whole_groups(got.samples, [(_OWN_GROUP, p) for p in got.positions.tolist()])

    #: the position is in the global stream (the seeded order of the step's conversations, the
    #: same on every rank), so a checkpoint of ``N`` ranks resumes on ``M`` (``load_checkpoint``)
    elastic = True

    def wait_first(self) -> None:
        """Draw the next step's samples now (waiting for their conversations, and
        refusing data with no target at all), so that :meth:`next_step` hands them
        over without waiting. :meth:`load_state_dict` forgets them."""
        if self._ahead is None:
            self._ahead = self._draw()

    def _take(self) -> list[Sample]:
        """The step's samples (over all ranks)."""
        if self._ahead is not None:
            out, self._ahead = self._ahead, None
            return out
        return self._draw()

    def _draw(self) -> list[Sample]:
        self._decide()
        if self._group_samples is not None:
            assert self._units is not None and isinstance(self.order, GroupOrder)
            return [self._group_samples[j] for u in self.order.take().tolist() for j in self._units[u]]
        if isinstance(self.order, ConversationOrder):
            chosen = self.order.take()
            if not self._checked:  # data with no target at all is refused, as make_source does for a list
                self._checked = True
                if not any(s.loss_mask[1:].any() for s in chosen):
                    check_targets(self.order.data.samples(), self.max_seq_len)
            return chosen
        samples = self.samples
        assert not isinstance(samples, ConversationSamples)
        if self._units is not None:
            return [samples[j] for i in self.order.take() for j in self._units[int(i)]]
        return [samples[int(i)] for i in self.order.take()]

    def epoch_steps(self) -> int:
        """The batches of an epoch of the seeded order (the last incomplete one dropped)."""
        self._decide()
        if isinstance(self.order, GroupOrder):
            return self.order.epoch_steps()
        if isinstance(self.samples, ConversationSamples):
            return len(self.samples.wait().samples) // self.order.batch_size
        if self._units is not None:
            return len(self._units) // self.order.batch_size
        return len(self.samples) // self.order.batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.order.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ahead = None
        self._decide()
        self.order.load_state_dict(state["order"])

    def fingerprint(self) -> str:
        self._decide()
        if self._fp is None:  # computed when first asked (a checkpoint): it needs every sample
            if isinstance(self.samples, ConversationSamples):
                got = self.samples.wait()
                assert got.positions is not None
                self._fp = _hash(
                    {
                        "samples": samples_fingerprint(got.samples),
                        "conversations": got.conversations,
                        "positions": hashlib.sha256(got.positions.tobytes()).hexdigest(),
                    }
                )
            else:
                self._fp = samples_fingerprint(self.samples)
        key: dict[str, Any] = {"samples": self._fp, "kind": "samples", "batch_size": self.order.batch_size}
        if self.pairs:  # an SFT run's fingerprint stays what it was
            key["pairs"] = True
        if self.whole_groups:  # so does a run without groups
            key["groups"] = True
        return _hash(key)


class PaddedSource(_SampleSource):
    """The baseline: the step's conversations dealt round-robin to the ranks, each
    rank's share cut into ``grad_accum`` right-padded micro-batches (in order)."""

    def next_step(self) -> list[MicroBatch]:
        chosen = self._take()
        refuse_weights(chosen, "--packing none (the padded baseline)")
        mine = np.arange(len(chosen))[self.rank :: self.world]
        parts = np.array_split(mine, self.grad_accum)
        return [padded_micro_batch([chosen[i] for i in p], pad_id=self.pad_id) for p in parts]


class TrainerSource(_SampleSource):
    """The trainer path: the step's conversations binned into micro-batches of at
    most ``micro_batch_tokens`` padded tokens (their row width: ``TrainConfig``'s
    ``micro_batch_tokens or max_seq_len``, the ``max_seq_len`` of
    :func:`~sftpack.trainer.plan_microbatches`), the same number per rank
    (:func:`~sftpack.trainer.plan_microbatches`; with ``max_patches_per_row``, at most that
    many vision patches each too), each packed at the step from its right-padded
    batch and its samples' media (:func:`~sftpack.trainer.pack_step`). ``draw``: how the
    step's conversations are drawn and dealt, as for :class:`PaddedSource` (``batch_size``,
    ``seed``, ``rank``, ``world``, ``grad_accum``, ``pad_id``). ``cost``: what a conversation costs
    when the step's conversations are dealt to the ranks (``plan_microbatches(cost=)``, any
    :func:`~sftpack.balance.sequence_cost` spelling; default ``"tokens"``). ``token_budget`` and ``max_patches``:
    the deprecated spellings of ``micro_batch_tokens`` and ``max_patches_per_row`` (with a ``DeprecationWarning``, until the next
    release)."""

    def __init__(
        self,
        samples: Sequence[Sample] | ConversationSamples,
        *,
        micro_batch_tokens: int | None = None,
        pad_multiple: int = 1,
        max_patches_per_row: int | None = None,
        cost: SequenceCost | str = "tokens",
        token_budget: int | None = None,
        max_patches: int | None = None,
        **draw: Any,
    ) -> None:
        super().__init__(samples, **draw)
        self.cost = sequence_cost(cost)
        width = renamed("TrainerSource", "micro_batch_tokens", micro_batch_tokens, "token_budget", token_budget)
        self.micro_batch_tokens = positive_int("micro_batch_tokens", width, who="TrainerSource")
        self.pad_multiple = pad_multiple
        self.max_patches_per_row = renamed(
            "TrainerSource", "max_patches_per_row", max_patches_per_row, "max_patches", max_patches
        )

    def next_step(self) -> list[MicroBatch]:
        chosen = self._take()
        # the step's conversations are the same on every rank: so is whether it is weighted
        self.step_weighted = any(s.weights is not None for s in chosen)
        lengths = np.fromiter((len(s) for s in chosen), dtype=np.int64, count=len(chosen))
        patches: dict[str, Any] = {}
        if self.max_patches_per_row is not None:
            patches = {
                "patches": np.fromiter((s.num_patches for s in chosen), dtype=np.int64, count=len(chosen)),
                "max_patches_per_row": self.max_patches_per_row,
            }
        groups = _group_numbers(chosen)  # the step's, so the same on every rank
        if self.pairs or self.whole_groups:  # each pair (group) whole in one micro-batch of one rank
            patches["groups"] = groups
        plan = plan_microbatches(
            lengths,
            self.micro_batch_tokens,
            dp_size=self.world,
            pad_multiple=self.pad_multiple,
            min_microbatches=self.grad_accum,
            cost=self.cost,
            **patches,
        )
        out: list[MicroBatch] = []
        self.step_groups = ([groups[sorted(mb.tolist())].tolist() for mb in plan[self.rank]], int(groups.max()) + 1)
        for mb in plan[self.rank]:
            picked = [chosen[i] for i in sorted(mb.tolist())]
            ids, lens, mask = padded_batch(picked, pad_id=self.pad_id)
            out.append(
                pack_step(
                    ids,
                    lens,
                    mask,
                    pad_multiple=self.pad_multiple,
                    pad_id=self.pad_id,
                    sequence_ids=[pair_sequence_id(s) if self.pairs else s.conversation_id for s in picked],
                    media=media_of(picked),
                    weights=_padded_weights(picked, ids.shape[1]),
                )
            )
        return out

    def fingerprint(self) -> str:
        key: dict[str, Any] = {
            "base": super().fingerprint(),
            "budget": self.micro_batch_tokens,  # the key the fingerprint has always had: checkpoints still match
            "pad_multiple": self.pad_multiple,
        }
        if self.max_patches_per_row is not None:  # a text run's fingerprint stays what it was
            key["max_patches"] = self.max_patches_per_row  # the key it has always had: checkpoints still match
        # no cost: it decides which rank and micro-batch a conversation lands in, never what a step
        # trains on, so a checkpoint resumes under another cost (another model's, another world size's)
        return _hash(key)


def _group_numbers(samples: Sequence[Sample]) -> np.ndarray:
    """``(n,)`` int64: each sample's group (``meta["group"]``: a preference pair, a prompt's
    completions), numbered in order of first appearance; a sample without one gets a number of its own."""
    numbered: dict[Any, int] = {}
    return np.array(
        [
            numbered.setdefault((s.meta or {}).get("group", (_OWN_GROUP, i)), len(numbered))
            for i, s in enumerate(samples)
        ],
        dtype=np.int64,
    )


#: the key of a sample without a group: a group of its own, never equal to a user's group
_OWN_GROUP = object()


def _padded_weights(picked: Sequence[Sample], width: int) -> torch.Tensor | None:
    """``(B, width)`` float64 token weights of a micro-batch's samples, right-padded like
    :func:`~sftpack.trainer.padded_batch` (1 on the tokens of a sample without weights);
    ``None`` when none of them has weights (the row is what it was before weights existed)."""
    if all(s.weights is None for s in picked):
        return None
    out = torch.zeros((len(picked), width), dtype=torch.float64)
    for b, s in enumerate(picked):
        out[b, : len(s)] = 1.0 if s.weights is None else torch.from_numpy(np.asarray(s.weights, dtype=np.float64))
    return out


def refuse_weights(samples: Iterable[Sample], path: str) -> None:
    """Raise ``ValueError`` when a sample carries weights on a path that would drop them."""
    for s in samples:
        check_unweighted(s, path)


class ReplaySource(Source):
    """Given conversations per step (over all ranks), as padded micro-batches: the
    unpacked reference of a packed run. Rank ``r`` takes conversations ``r::world``."""

    def __init__(
        self,
        steps: Sequence[Sequence[Sample]],
        *,
        rank: int = 0,
        world: int = 1,
        grad_accum: int = 1,
        pad_id: int = 0,
    ) -> None:
        self.steps = [list(s) for s in steps]
        self.rank, self.world, self.grad_accum, self.pad_id = (
            rank,
            world,
            grad_accum,
            pad_id,
        )
        self.position = 0

    def next_step(self) -> list[MicroBatch]:
        if self.position >= len(self.steps):
            raise ValueError(f"ReplaySource: only {len(self.steps)} steps were given")
        mine = self.steps[self.position][self.rank :: self.world]
        self.position += 1
        parts = [p for p in np.array_split(np.arange(len(mine)), self.grad_accum) if len(p)]
        return [padded_micro_batch([mine[i] for i in p], pad_id=self.pad_id) for p in parts]

    def epoch_steps(self) -> int:
        return len(self.steps)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])

    def fingerprint(self) -> str:
        return _hash({"replay": samples_fingerprint([s for step in self.steps for s in step])})


def rows_to_micro_batches(rows: list[PackedBatch], grad_accum: int) -> list[MicroBatch]:
    parts = np.array_split(np.arange(len(rows)), grad_accum)
    return [PackedBatch.concat([rows[i] for i in p]) for p in parts if len(p)]


def rows_per_rank(batch_size: int, world: int, grad_accum: int) -> int:
    if batch_size % world or batch_size // world < grad_accum:
        raise ValueError(
            f"batch_size={batch_size} rows must be a multiple of the {world} rank(s), with at least grad_accum="
            f"{grad_accum} rows per rank: use --batch-size {max(grad_accum, -(-batch_size // world)) * world}"
        )
    return batch_size // world


class RenumberedSource(Source):
    """Another source's packed rows with their token ids renumbered into ``vocab`` (the
    original id of each of the model's ids, sorted: :func:`~sftpack.loop.compact_vocabulary`):
    a prepack stores the tokenizer's ids, a model over the data's vocabulary reads them
    renumbered (the media's placeholder id too). An id outside ``vocab`` is an error."""

    def __init__(self, inner: Source, vocab: np.ndarray, *, pad_id: int) -> None:
        self.inner, self.pad_id = inner, pad_id
        self.lut = torch.full((int(vocab.max()) + 2,), -1, dtype=torch.int64)
        self.lut[torch.from_numpy(np.asarray(vocab, dtype=np.int64))] = torch.arange(len(vocab))
        self.elastic: bool = bool(getattr(inner, "elastic", False))  # its position is the inner source's

    def _map(self, ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        out = torch.where(where, self.lut[ids.clamp(0, len(self.lut) - 1)], self.pad_id)
        if bool((out < 0).any()):
            bad = int(ids[out < 0][0])
            raise ValueError(f"token id {bad} of the rows is not in the model's vocabulary (the data's ids)")
        return out

    def next_step(self) -> list[MicroBatch]:
        out: list[MicroBatch] = []
        step = self.inner.next_step()
        self.step_weighted = bool(getattr(self.inner, "step_weighted", False))  # the rows keep their weights
        for b in step:
            if not isinstance(b, PackedBatch):
                raise TypeError(f"RenumberedSource renumbers packed rows, not {type(b).__name__}")
            keep = b.labels != IGNORE_INDEX
            labels = torch.where(keep, self._map(b.labels, keep), IGNORE_INDEX)
            ids = self._map(b.input_ids, b.real_token_mask)  # padding slots: the model's pad id
            media = b.media
            if media is not None:
                media = media.renumbered(lambda i: int(self.lut[i]))
            out.append(dataclasses.replace(b, input_ids=ids, labels=labels, media=media))
        return out

    def epoch_steps(self) -> int:
        return self.inner.epoch_steps()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def fingerprint(self) -> str:
        return _hash(
            {"renumbered": self.inner.fingerprint(), "vocab": hashlib.sha256(self.lut.numpy().tobytes()).hexdigest()}
        )
