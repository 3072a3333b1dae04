"""The parts of a training run's settings (:class:`~sftpack.loop.RunConfig` is made of them):
:class:`InputSettings`, :class:`DataSettings`, :class:`ModelSettings`, :class:`OutputSettings`
(and :class:`~sftpack.loop.TrainConfig`). Each field with ``"help"`` in its metadata is a flag
of ``sftpack train``, declared here once (:func:`sftpack.cli._common.add_settings` reads it).

:class:`RunSettings` and :class:`RunState` are what a run's modules read of the config and of
the run (protocols, so that they need not import the modules that build them). Nothing here
loads torch: the command builds its parser from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from .._base import choose
from ..chat import NO_PROGRESS_HELP, OVERLONG_HELP, InputOptions, parse_size
from ..sample import DEFAULT_OVERLONG, Overlong
from ._options import TrainConfig
from .inputs import FAMILY_HELP, FAMILY_NAMES

__all__ = [
    "IMAGE_SIDES",
    "PARTS",
    "VQA_LIMIT",
    "DataSettings",
    "InputSettings",
    "ModelSettings",
    "OutputSettings",
    "RunSettings",
    "RunState",
    "prepack_manifest",
]

#: conversations of a default ``corpus="vqa"`` run (``limit``): a 20-step CPU run takes seconds
VQA_LIMIT = 64
#: the default seeded image sizes of ``corpus="vqa"``, px a side (up to 256 patches an image: the vision
#: tower's attention grows with the square of an image's patches, so 448 px images cost 16x as much on CPU)
IMAGE_SIDES = (56, 224)


def _size(text: str) -> int:
    """A size in bytes from ``10G``, ``500M`` (binary units), or a ``ValueError`` saying what is taken."""
    return parse_size(text)


@dataclass(frozen=True)
class InputSettings(InputOptions):
    """The conversations: INPUT files or the embedded corpus, how they are read and what an
    over-long one becomes (``overlong``: the tokenizer's rule, :class:`~sftpack.sample.Overlong`;
    a preference pair follows it whole, ``split`` refusing it), the eval file."""

    #: chat files, folders, globs or saved datasets (``sftpack train``'s INPUT arguments); none: the embedded corpus
    inputs: list[str] = field(default_factory=list)
    corpus: str = field(
        default="chat",
        metadata={
            "help": "the embedded data when no INPUT is given: chat conversations (default) or easy-vqa "
            "conversations with images, which trains a tiny Qwen2-VL",
            "choices": ("chat", "vqa"),
        },
    )
    limit: int | None = field(default=None, metadata={"help": "use the first N conversations only", "min": 1})
    #: the ``--overlong`` of ``sftpack prepack`` (:attr:`~sftpack.offline.PrepackOptions.overlong`): its choices
    #: the enum's, its help the one text of every command (:data:`~sftpack.chat.OVERLONG_HELP`)
    overlong: Overlong = field(default=DEFAULT_OVERLONG, metadata={"help": OVERLONG_HELP})
    eval_file: str | None = field(
        default=None,
        metadata={
            "help": "evaluate on the conversations of this chat file (tokenized as the training data) instead of "
            "holding out --eval-fraction of them",
            "metavar": "PATH",
        },
    )
    image_sides: tuple[int, int] | None = field(
        default=None,
        metadata={
            "help": f"--corpus vqa: each image is resized to a seeded size within MIN..MAX px a side (default "
            f"{IMAGE_SIDES[0]} {IMAGE_SIDES[1]}); --limit caps the conversations (default {VQA_LIMIT})",
            "nargs": 2,
            "min": 1,
            "metavar": ("MIN", "MAX"),
        },
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "overlong", choose(Overlong, self.overlong, "overlong"))


@dataclass
class DataSettings:
    """How the conversations become training data: a prepack, or tokenized through the cache."""

    prepacked: str | None = field(
        default=None,
        metadata={
            "help": "--packing offline: a directory from sftpack prepack (default: prepack the data into a "
            "temporary directory first); its row width, pad multiple and tokenizer come from its manifest",
            "metavar": "DIR",
        },
    )
    vocab: str = field(
        default="tokenizer",
        metadata={
            "help": "the default model's vocabulary: the tokenizer's (151,646 ids for the embedded one) or only the "
            "ids that occur in the data, renumbered (a much cheaper head on CPU; a different model)",
            "choices": ("tokenizer", "data"),
        },
    )
    num_proc: int | None = field(
        default=None,
        metadata={
            "help": "tokenizer worker processes (default: the CPUs this process may use, at most 4; the samples do "
            "not depend on it)",
            "min": 1,
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "where tokenized samples are kept between runs, keyed by the tokenizer, options, input bytes "
            "and sftpack's code (default: $SFTPACK_CACHE_DIR, else $XDG_CACHE_HOME/sftpack, else ~/.cache/sftpack)",
            "metavar": "DIR",
        },
    )
    no_cache: bool = field(default=False, metadata={"help": "tokenize again and write nothing to the cache"})
    cache_max_size: int | None = field(
        default=None,
        metadata={
            "help": "the cache's size limit, e.g. 10G, 500M (binary units; 0: no limit; default: 10G, the entry of a "
            "2-billion-token data set at 5 bytes a token): the entries used least recently make room for a new one",
            "metavar": "SIZE",
            "parse": _size,
        },
    )


@dataclass
class ModelSettings:
    """The model trained: a local folder, or the default one built from ``TrainConfig``'s shape."""

    model: str | None = field(
        default=None, metadata={"help": "a local model folder (default: a small Llama from a config)", "metavar": "DIR"}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "a local tokenizer folder (default: the --model folder's own when it has one, else the embedded "
            "Qwen BPE)",
            "metavar": "DIR",
        },
    )
    model_impl: str | None = field(
        default=None,
        metadata={
            "help": "the default model's code: torch (SmallLlama: transformers' LlamaForCausalLM op for op in plain "
            "torch, the same weights for the same seed, about 4 s quicker to start; the default) or transformers "
            "(LlamaForCausalLM itself); not with --model, which always loads with transformers",
            "choices": ("torch", "transformers"),
        },
    )
    family: str | None = field(
        default=None, metadata={"help": FAMILY_HELP, "choices": FAMILY_NAMES, "metavar": "FAMILY"}
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "the model's dtype (default float32; float64 makes packed and padded runs agree to 1e-10); a "
            "checkpoint resumes only in the dtype it was written in",
            "choices": ("float32", "float64"),
        },
    )


@dataclass
class OutputSettings:
    """What a run writes and says: the log, the plot, TensorBoard, checkpoints, the model folder."""

    log: str | None = field(default=None, metadata={"help": "write one JSON object per step", "metavar": "FILE.jsonl"})
    plot: str | None = field(
        default=None,
        metadata={"help": "draw the loss (and eval loss) and tokens/s curves", "metavar": "FILE.png"},
    )
    tensorboard: str | None = field(
        default=None,
        metadata={
            "help": "write the loss, learning rate, grad norm, real tokens/s, fill and eval loss of every step as "
            "TensorBoard scalars in DIR (needs: pip install 'sftpack[tensorboard]'); the --log file is unchanged",
            "metavar": "DIR",
        },
    )
    save_model: str | None = field(
        default=None,
        metadata={
            "help": "at the end (or at SIGTERM), write the trained model as a Hugging Face folder (config, "
            "safetensors weights, tokenizer with its chat template): AutoModelForCausalLM.from_pretrained(DIR) loads "
            "it; DIR is checked before training (a new or empty folder), written beside it and renamed into place",
            "metavar": "DIR",
        },
    )
    overwrite_model: bool = field(
        default=False,
        metadata={
            "help": "--save-model DIR may be a folder with files in it (a model saved before, or any other folder): "
            "it is replaced whole, nothing of it kept"
        },
    )
    progress: bool = field(default=True, metadata={"help": NO_PROGRESS_HELP, "flag": "--no-progress"})
    checkpoint_dir: str | None = field(
        default=None,
        metadata={
            "help": "where checkpoints go (one run per folder: a fresh run refuses a folder that holds another run's "
            "checkpoints); with it, SIGTERM saves one at the end of the current step before the run stops",
            "metavar": "DIR",
        },
    )
    resume: bool = field(
        default=False,
        metadata={
            "help": "continue from the latest checkpoint in --checkpoint-dir (there must be one; it is verified "
            "against its checksums, and the optimisation options must be the checkpoint's)"
        },
    )
    resume_if_any: bool = field(
        default=False,
        metadata={
            "help": "like --resume, but start at step 1 when --checkpoint-dir holds no checkpoint yet "
            "(re-running the same command after a preemption)"
        },
    )
    overwrite_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "start a fresh run (step 1) in a --checkpoint-dir that holds another run's checkpoints: they are "
            "deleted once this run has written its first checkpoint"
        },
    )


#: each part of a :class:`RunConfig` by its attribute, with its settings' class
#: each part of a run's settings by its attribute, with its settings' class (no two share a field name)
PARTS: dict[str, type] = {
    "input": InputSettings,
    "data": DataSettings,
    "model": ModelSettings,
    "train": TrainConfig,
    "output": OutputSettings,
}


class RunSettings(Protocol):
    """What a run reads of its config (:class:`~sftpack.loop.RunConfig`)."""

    input: InputSettings
    data: DataSettings
    model: ModelSettings
    train: TrainConfig
    output: OutputSettings

    @property
    def resume(self) -> bool | Literal["auto"]: ...


class RunState(Protocol):
    """What a run's parts read of the run (:class:`~sftpack.loop._run.Run`): its settings, where it
    is (rank, world), and where it says its lines and marks its phases."""

    config: RunSettings
    rank: int
    world: int

    def say(self, line: str) -> None: ...

    def mark(self, phase: str) -> None: ...


def prepack_manifest(prepacked: str) -> dict[str, Any]:
    """The manifest of the prepack ``prepacked``, its row width and pad multiple checked."""
    from ..offline import read_manifest  # loads torch: only when there is a prepack to read

    manifest = read_manifest(Path(prepacked))
    for key in ("max_seq_len", "pad_multiple"):
        if not isinstance(manifest.get(key), int):
            raise ValueError(f"{Path(prepacked) / 'manifest.json'} has no integer {key}: the prepack is damaged")
    return manifest
