"""A :class:`~sftpack.loader.PackingDataset`'s settings, checked once into a frozen object.

:meth:`LoaderSettings.check` takes the dataset's arguments as the user gave them and
either returns them validated and normalised (enums chosen, rank and world size
resolved from ``torch.distributed``) or raises naming the argument and the fix, in
the order the dataset always checked them. The parts of the loader (the round
planner, the row builder, the item cutter) read their knobs from this one object;
:meth:`LoaderSettings.config` is what a saved state records of it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, overload

from .._base import check_width, choose, non_negative_int, positive_int
from ..binpack import Algorithm
from ..handoff.layout import check_pad_id
from ..sample import Overlong
from ._shares import dist_rank_world
from ._source import media_options

__all__ = ["LoaderSettings", "Setting"]

_WHO = "PackingDataset"

T = TypeVar("T")


@dataclass(frozen=True)
class LoaderSettings:
    """Everything a :class:`~sftpack.loader.PackingDataset` was built with, but its samples and
    model family (see the dataset's arguments for each meaning)."""

    max_seq_len: int
    buffer_size: int
    pad_multiple: int
    algorithm: Algorithm
    overlong: Overlong
    pad_between_seqs: bool
    seed: int
    shuffle: bool
    max_wait: int
    min_fill: float
    num_epochs: int | None
    pad_id: int
    rank: int
    world_size: int
    max_patches_per_row: int | None
    on_bad_row: str
    groups: bool = False

    @classmethod
    def check(
        cls,
        *,
        max_seq_len: object,
        buffer_size: object,
        pad_multiple: object,
        algorithm: str | Algorithm,
        pad_between_seqs: bool,
        overlong: str | Overlong,
        seed: object,
        shuffle: bool,
        max_wait: object,
        min_fill: object,
        num_epochs: object,
        rank: int | None,
        world_size: int | None,
        pad_id: object,
        max_patches_per_row: object,
        on_bad_row: object,
        groups: object = False,
    ) -> LoaderSettings:
        """The arguments checked (each error names the argument, its value and the fix).

        >>> s = LoaderSettings.check(max_seq_len=36, buffer_size=8, pad_multiple=4, algorithm="bfd",
        ...     pad_between_seqs=False, overlong="split", seed=0, shuffle=False, max_wait=2, min_fill=0.99,
        ...     num_epochs=1, rank=None, world_size=None, pad_id=0, max_patches_per_row=None, on_bad_row="error")
        >>> s.algorithm, s.rank, s.world_size, sorted(s.config(None))[:3]
        (<Algorithm.BFD: 'bfd'>, 0, 1, ['algorithm', 'buffer_size', 'max_seq_len'])
        """
        width = positive_int("max_seq_len", max_seq_len, who=_WHO)
        buffer = positive_int("buffer_size", buffer_size, who=_WHO)
        multiple = positive_int("pad_multiple", pad_multiple, who=_WHO)
        check_width(width, multiple, who=_WHO)
        chosen_algorithm = choose(Algorithm, algorithm, "algorithm")
        chosen_overlong = choose(Overlong, overlong, "overlong")
        checked_seed = non_negative_int("seed", seed, who=_WHO)
        wait = non_negative_int("max_wait", max_wait, who=_WHO)
        if not isinstance(min_fill, numbers.Real) or not 0.0 <= float(min_fill) <= 1.0:
            raise ValueError(f"{_WHO}: min_fill must be a fraction in [0, 1], got {min_fill!r}")
        epochs = positive_int("num_epochs", num_epochs, allow_none=True, who=_WHO)
        if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral):
            raise TypeError(f"{_WHO}: pad_id must be an integer token id, got {pad_id!r}")
        checked_pad = check_pad_id(pad_id, _WHO, ValueError)
        dist_rank, dist_world = dist_rank_world()
        world = positive_int("world_size", world_size if world_size is not None else dist_world, who=_WHO)
        checked_rank = non_negative_int("rank", rank if rank is not None else dist_rank, who=_WHO)
        if checked_rank >= world:
            raise ValueError(f"{_WHO}: rank={checked_rank} must be below world_size={world}")
        budget, bad_rows = media_options(_WHO, max_patches_per_row, chosen_overlong, on_bad_row)
        if not isinstance(groups, bool):
            raise TypeError(f"{_WHO}: groups must be True or False, got {groups!r}")
        return cls(
            max_seq_len=width,
            buffer_size=buffer,
            pad_multiple=multiple,
            algorithm=chosen_algorithm,
            overlong=chosen_overlong,
            pad_between_seqs=bool(pad_between_seqs),
            seed=checked_seed,
            shuffle=bool(shuffle),
            max_wait=wait,
            min_fill=float(min_fill),
            num_epochs=epochs,
            pad_id=checked_pad,
            rank=checked_rank,
            world_size=world,
            max_patches_per_row=budget,
            on_bad_row=bad_rows,
            groups=groups,
        )

    def config(self, family_name: str | None) -> dict[str, object]:
        """What a state records of the settings (``config``); the media ones (and the family's
        name, ``None``: not named) and ``groups`` only when set, so a text dataset's config is the text one."""
        out: dict[str, object] = {
            "max_seq_len": self.max_seq_len,
            "buffer_size": self.buffer_size,
            "pad_multiple": self.pad_multiple,
            "algorithm": str(self.algorithm),
            "overlong": str(self.overlong),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "max_wait": self.max_wait,
            "min_fill": self.min_fill,
            "num_epochs": self.num_epochs,
        }
        if self.max_patches_per_row is not None:
            out["max_patches_per_row"] = self.max_patches_per_row
        if self.on_bad_row != "error":
            out["on_bad_row"] = self.on_bad_row
        if family_name is not None:
            out["family"] = family_name
        if self.groups:  # an SFT dataset's config stays what it was
            out["groups"] = True
        return out


class HasSettings(Protocol):
    settings: LoaderSettings


class Setting(Generic[T]):
    """A read-only attribute of an object with ``settings`` (a :class:`LoaderSettings`) that reads
    the setting of the same name: ``max_seq_len = Setting[int]()`` in the class body. It cannot be
    set: a setting is fixed when the object is built (and a saved state records it).

    >>> from sftpack.loader import PackingDataset
    >>> ds = PackingDataset([[1, 2, 3]], max_seq_len=8, buffer_size=4)
    >>> ds.max_seq_len, ds.max_seq_len is ds.settings.max_seq_len
    (8, True)
    >>> ds.max_wait = 0
    Traceback (most recent call last):
    AttributeError: PackingDataset.max_wait is a setting, fixed when the object is built (a saved state records it): build a new one with max_wait=0
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Setting[T]: ...
    @overload
    def __get__(self, obj: HasSettings, owner: type | None = None) -> T: ...
    def __get__(self, obj: HasSettings | None, owner: type | None = None) -> Setting[T] | T:
        if obj is None:
            return self
        value: T = getattr(obj.settings, self.name)
        return value

    def __set__(self, obj: HasSettings, value: object) -> None:
        raise AttributeError(
            f"{type(obj).__name__}.{self.name} is a setting, fixed when the object is built (a saved state "
            f"records it): build a new one with {self.name}={value!r}"
        )
