"""What a prepack is asked to do, checked once: :class:`PrepackOptions`.

Every option of :func:`~sftpack.offline.prepack` (and of the CLI, which builds
the same object) is validated in ``__post_init__``, one message per problem,
before any input is read. The object is frozen, so the engine and the driver
see the same values the check saw; it produces its own part of the manifest's
fingerprint (:meth:`PrepackOptions.fingerprint`) and its own planner
(:meth:`PrepackOptions.packing`).

>>> o = PrepackOptions(max_seq_len=1024, pad_multiple=4, overlong="truncate")
>>> o.fingerprint()["overlong"], o.packing().max_seq_len
('truncate', 1024)
>>> PrepackOptions(max_seq_len=1000, pad_multiple=16)
Traceback (most recent call last):
...
ValueError: max_seq_len=1000 is not a multiple of pad_multiple=16: the last sequence of a row absorbs the row's tail and would lose its alignment; use max_seq_len=1008 or 992
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .._base import LazyChoices, StrEnum, choose, positive_int
from ..binpack import Algorithm
from ..chat import (
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_ON_BAD_ROW,
    NO_PROGRESS_HELP,
    ON_BAD_ROW_HELP,
    OVERLONG_HELP,
    OnBadRow,
    TrainOn,
)
from ..sample import Overlong
from ._plan import BinPack


def _family_names() -> tuple[str, ...]:
    """The registry's family names (:func:`sftpack.multimodal.family_names`)."""
    from ..multimodal import family_names  # start-up: multimodal loads torch, which building the parser must not

    return family_names()


#: the family setting's choices: the registry's names, read when first asked for
FAMILY_NAMES: Sequence[str] = LazyChoices(_family_names)

__all__ = ["Engine", "PrepackOptions"]

#: Conversations per Ray unit when the input is not files (the embedded corpus, an iterable, ``limit``).
UNIT_CONVERSATIONS = 1024


class Engine(StrEnum):
    """Where stages 1 and 3 run (the files are the same either way)."""

    LOCAL = "local"  #: this process (and ``num_proc`` tokenizer workers)
    RAY = "ray"  #: Ray Data actors tokenize, Ray actors write (:func:`~sftpack.offline.prepack_ray`)


@dataclass(frozen=True)
class PrepackOptions:
    """The options of one prepack, validated once (see :func:`~sftpack.offline.prepack`
    for what each means). Strings are turned into their enums; a bad value is a
    ``ValueError`` naming the option and the fix.

    The Ray engine's settings (``workers``, ``ray_address``, ``unit_size``,
    ``write_tasks``, ``actor_cpus``) and the local one's (``num_proc``) are
    checked whatever the engine; only the chosen engine reads its own.

    ``images``: the conversations have images (Hugging Face's multimodal chat format),
    tokenized for the model ``family`` (a :func:`sftpack.multimodal.family_for` name;
    Qwen2-VL by default) and planned under ``max_patches_per_row`` vision patches per row
    too (``None``: tokens only); ``overlong`` is then ``split``, ``drop`` or ``error`` and
    the assistant turns are trained.

    A field with ``"help"`` in its metadata is a flag of ``sftpack prepack``, declared
    here once (:func:`sftpack.cli._common.add_settings` reads it).
    """

    max_seq_len: int = field(
        default=DEFAULT_MAX_SEQ_LEN,
        metadata={"help": "row width in tokens (default {default}, at most 16,777,216)", "min": 1},
    )
    pad_multiple: int = field(
        default=1,
        metadata={
            "help": "pad each sequence to a multiple of this (default: from --cp/--tp)",
            "cli_default": None,
            "min": 1,
        },
    )
    algorithm: Algorithm = field(default=Algorithm.BFD, metadata={"help": "bin packer (default {default})"})
    seed: int = field(default=0, metadata={"help": "the bin packer's seed (default {default})", "min": 0})
    overlong: Overlong = field(
        default=Overlong.SPLIT,
        metadata={"help": OVERLONG_HELP},
    )
    train_on: TrainOn = field(
        default=TrainOn.ALL_ASSISTANT, metadata={"help": "the tokens trained on (default {default})"}
    )
    on_bad_row: OnBadRow = field(default=DEFAULT_ON_BAD_ROW, metadata={"help": ON_BAD_ROW_HELP})
    limit: int | None = field(default=None, metadata={"help": "first N conversations only", "min": 1})
    engine: Engine = field(
        default=Engine.LOCAL,
        metadata={
            "help": "where tokenizing and writing run: local (this machine, --num-proc) or ray (Ray Data "
            "actors; the same files byte for byte)"
        },
    )
    num_proc: int = field(default=1, metadata={"help": "tokenizer processes (the files do not depend on it)", "min": 1})
    workers: int = field(
        default=2,
        metadata={"help": "--engine ray: tokenize actors (default {default})", "cli_default": None, "min": 1},
    )
    ray_address: str | None = field(
        default=None,
        metadata={
            "help": "--engine ray: join this running Ray cluster ('auto', 'HOST:6379'); default: a private local "
            "Ray, stopped after. --tokenizer, the inputs (and their images) and the parent of --out must be at "
            "the same paths on every node",
            "metavar": "ADDR",
        },
    )
    unit_size: int = UNIT_CONVERSATIONS
    write_tasks: int | None = None
    actor_cpus: float = 1.0
    overwrite: bool = field(default=False, metadata={"help": "replace --out if it is a prepack"})
    progress: bool = field(
        default=False, metadata={"help": NO_PROGRESS_HELP, "flag": "--no-progress", "cli_default": True}
    )
    images: bool = False
    #: a name of the registry (``sftpack.multimodal.family_names()``) or a configured ``Family``
    family: str = field(
        default="qwen2_vl",
        metadata={
            "help": "the vision-language model family the rows are for (the CLI's --family: sftpack.cli's add_family)",
            "cli_default": None,
            "choices": FAMILY_NAMES,
        },
    )
    max_patches_per_row: int | None = field(
        default=None,
        metadata={
            "help": "vision patches per row, a second budget beside --max-seq-len (default: none); a conversation "
            "over it alone is dropped and counted as over_patch_budget (--overlong error: refused, exit 1)",
            "min": 1,
            "metavar": "N",
        },
    )

    @classmethod
    def from_settings(cls, who: str, settings: dict[str, Any], names: Sequence[str] = ()) -> PrepackOptions:
        """``cls(**settings)``; a keyword that is not one of ``names`` (default: every field) is a
        ``TypeError`` naming it and them (``who``: the function or class that took them)."""
        names = names or [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise TypeError(f"{who} got {', '.join(unknown)}, not a setting: the settings are {', '.join(names)}")
        return cls(**settings)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("engine", choose(Engine, self.engine, "engine"))
        packing = BinPack(self.max_seq_len, self.pad_multiple, self.algorithm, self.seed, self.max_patches_per_row)
        for name in ("max_seq_len", "pad_multiple", "algorithm", "seed", "max_patches_per_row"):  # its checks
            put(name, getattr(packing, name))
        put("overlong", choose(Overlong, self.overlong, "overlong"))
        put("train_on", choose(TrainOn, self.train_on, "train_on"))
        put("on_bad_row", choose(OnBadRow, self.on_bad_row, "on_bad_row"))
        put("limit", positive_int("limit", self.limit, allow_none=True))
        put("num_proc", positive_int("num_proc", self.num_proc))
        put("workers", positive_int("workers", self.workers))
        put("unit_size", positive_int("unit_size", self.unit_size))
        put("write_tasks", positive_int("write_tasks", self.write_tasks, allow_none=True))
        cpus = self.actor_cpus
        if isinstance(cpus, bool) or not isinstance(cpus, numbers.Real) or not cpus > 0:
            raise ValueError(f"actor_cpus must be a positive number of CPUs, got {cpus!r}")
        put("actor_cpus", float(cpus))
        if self.ray_address is not None and not isinstance(self.ray_address, str):
            raise ValueError(f"ray_address must be a string such as 'auto' or 'host:6379', got {self.ray_address!r}")
        put("overwrite", bool(self.overwrite))
        put("progress", bool(self.progress))
        if not isinstance(self.images, bool):
            raise ValueError(f"images must be True or False, got {self.images!r}")
        if (not isinstance(self.family, str) or not self.family) and not _is_family(self.family):
            raise ValueError(
                f"family must be a model family's name such as 'qwen2_vl' (or a configured Family, "
                f"family_for(model_dir)), got {self.family!r}"
            )
        if not self.images:
            if self.max_patches_per_row is not None:
                raise ValueError("max_patches_per_row is a budget for images: prepack conversations with images=True")
            if self.family != "qwen2_vl":
                raise ValueError(
                    f"family={self.family!r} names the model of conversations with images: pass images=True"
                )
            return
        from ..multimodal import (  # multimodal loads only for media (~0.5 s over the offline path)
            UnsupportedModelError,
            family_for,
        )

        try:  # a name becomes its family with the class defaults; a configured family is kept as given
            put("family", family_for(self.family))
        except UnsupportedModelError as e:
            raise ValueError(str(e)) from None
        if self.overlong is Overlong.TRUNCATE:
            raise ValueError(
                "overlong='truncate' is not offered with images (it would cut a turn and possibly an image): use "
                "'split', 'drop' or 'error'"
            )
        if self.train_on is not TrainOn.ALL_ASSISTANT:
            raise ValueError(
                f"train_on={str(self.train_on)!r} is not offered with images: their assistant turns are trained "
                "(train_on='all_assistant')"
            )

    def packing(self) -> BinPack:
        """Stage 2 for these options."""
        return BinPack(self.max_seq_len, self.pad_multiple, self.algorithm, self.seed, self.max_patches_per_row)

    def fingerprint(self) -> dict[str, Any]:
        """The manifest fingerprint's entries for these options (the rows depend on each)."""
        return {
            "max_seq_len": self.max_seq_len,
            "pad_multiple": self.pad_multiple,
            **self.packing().fingerprint(),
            "overlong": str(self.overlong),
            "train_on": str(self.train_on),
            "on_bad_row": str(self.on_bad_row),
        }


def _is_family(obj: Any) -> bool:
    """Whether ``obj`` is a :class:`~sftpack.multimodal.Family` (multimodal imported only when it may be one)."""
    if isinstance(obj, (str, type(None), int, float)):
        return False
    from ..multimodal import Family  # multimodal loads only for media (~0.5 s over the offline path)

    return isinstance(obj, Family)
