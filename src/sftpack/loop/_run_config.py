"""A whole training run as one object: :class:`RunConfig`, composed of its parts' settings.

``sftpack train`` is this object read from flags: each setting of its parts
(:mod:`._run_parts`) with ``"help"`` in its field's metadata is a flag, declared there once,
as :class:`~sftpack.loop.TrainConfig`'s are. :meth:`RunConfig.check` holds every rule
between settings (``prepacked`` only with ``packing="offline"``, ...): a broken one is a
:class:`ConfigError` naming the settings, which the command shows in its flags' spelling.
:meth:`RunConfig.build` checks and returns the runnable :class:`~sftpack.loop._run.Run`.

Nothing here loads torch until the run is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._model_dir import check_model_dir
from ._options import CLI_STEPS, ConfigError, Packing, TrainConfig
from ._run import Run
from ._run_parts import (
    IMAGE_SIDES,
    PARTS,
    DataSettings,
    InputSettings,
    ModelSettings,
    OutputSettings,
    prepack_manifest,
)
from .inputs import has_images, read_chat_template

__all__ = ["RunConfig"]


def _given(options: type, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``options`` (a part's class) among ``settings``, those not ``None``."""
    names = {f.name for f in dataclasses.fields(options)}
    return {k: v for k, v in settings.items() if k in names and v is not None}


@dataclass
class RunConfig:
    """Everything a training run is, as ``sftpack train`` runs it, in five parts: ``input`` (the
    conversations), ``data`` (prepack, cache, vocabulary), ``model``, ``train``
    (:class:`~sftpack.loop.TrainConfig`) and ``output``.

    >>> from sftpack.loop import DataSettings, RunConfig, TrainConfig
    >>> RunConfig(train=TrainConfig(packing="trainer"), data=DataSettings(prepacked="rows")).check()
    Traceback (most recent call last):
    ...
    sftpack.loop._options.ConfigError: prepacked is for packing offline
    """

    input: InputSettings = field(default_factory=InputSettings)
    data: DataSettings = field(default_factory=DataSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputSettings = field(default_factory=OutputSettings)

    @staticmethod
    def parts() -> dict[str, type]:
        """Each part of a run by its attribute (``input``, ``data``, ``model``, ``train``,
        ``output``), with its settings' class: the fields the flags of ``sftpack train`` come from."""
        return dict(PARTS)

    @classmethod
    def from_flags(cls, settings: Mapping[str, Any]) -> RunConfig:
        """:meth:`from_settings` as ``sftpack train`` reads its flags: neither ``steps`` nor
        ``epochs`` gives the command's default (``CLI_STEPS``, more than the library's)."""
        return cls.from_settings(settings, default_steps=CLI_STEPS)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], *, default_steps: int | None = None) -> RunConfig:
        """The run of flat ``settings`` (each part's fields by name, as ``sftpack train``'s flags
        give them; ``None``: the default; ``clip_norm`` 0: off). Left unset with ``prepacked``:
        ``max_seq_len`` and ``pad_multiple`` are the prepack's; neither ``steps`` nor ``epochs``:
        ``default_steps``. Each part's fields are its own: no two parts share a name."""
        given = dict(settings)
        if given.get("steps") is not None and given.get("epochs") is not None:
            raise ConfigError(
                f"give {{steps}} or {{epochs}}, not both ({{steps}} {given['steps']}, {{epochs}} {given['epochs']})"
            )
        if given.get("steps") is None and given.get("epochs") is None:
            given["steps"] = default_steps
        if given.get("prepacked") and str(given.get("packing")) == Packing.OFFLINE:
            try:
                manifest = prepack_manifest(given["prepacked"])
            except ValueError:  # no prepack there, or a damaged one: check() says so, after the other rules
                manifest = {}
            for key in ("max_seq_len", "pad_multiple"):
                if given.get(key) is None:
                    given[key] = manifest.get(key)
        if given.get("image_sides") is not None:
            given["image_sides"] = tuple(given["image_sides"])
        parts: dict[str, Any] = {}
        for name, options in PARTS.items():
            kwargs = _given(options, given)
            if options is TrainConfig and given.get("clip_norm") == 0:
                kwargs["clip_norm"] = None  # 0: off
            try:
                parts[name] = options(**kwargs)
            except ConfigError:
                raise  # it names its settings: the command spells them as flags
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return cls(**parts)

    @property
    def images(self) -> bool:
        """Whether the data holds images: ``corpus="vqa"``, or INPUT files with image parts."""
        inp = self.input
        return inp.corpus == "vqa" or bool(inp.inputs and has_images(inp.inputs, split=inp.split))

    @property
    def resume(self) -> bool | Literal["auto"]:
        """The loop's ``resume``: ``True``, ``"auto"`` (``resume_if_any``) or ``False``."""
        return True if self.output.resume else ("auto" if self.output.resume_if_any else False)

    def check(self) -> bool:
        """Every rule between settings, checked before any work (:class:`ConfigError`, naming the
        settings); returns :attr:`images` (the data's kind decides some rules)."""
        inp, model, cfg = self.input, self.model, self.train
        if inp.corpus == "vqa" and inp.inputs:
            raise ConfigError("{corpus} picks the embedded data used when no INPUT is given: not with INPUT files")
        images = self.images
        if model.model_impl is not None and (model.model or images):
            raise ConfigError(
                "{model_impl} picks the code of the default text model: not with "
                + (
                    "{model} (a model folder always loads with transformers)"
                    if model.model
                    else "{corpus} vqa"
                    if inp.corpus == "vqa"
                    else "data with images (it trains a vision-language model)"
                )
            )
        if not images and model.family is not None:
            raise ConfigError(
                f"{{family}} {model.family} names the model of data with images: these inputs have no image parts"
            )
        if not images and inp.image_sides is not None:
            raise ConfigError("{image_sides} sizes the images of {corpus} vqa: give {corpus} vqa")
        if not images and cfg.max_patches_per_row is not None:
            raise ConfigError(
                "{max_patches_per_row} is the vision-patch budget of data with images (INPUT files with image parts, "
                "or {corpus} vqa); this data has none"
            )
        self._check_outputs()
        self._check_eval_and_inputs()
        self._check_data(images)
        return images

    def _check_outputs(self) -> None:
        out, resume = self.output, self.resume
        if out.resume and out.resume_if_any:
            raise ConfigError("give {resume} or {resume_if_any}, not both")
        if resume and not out.checkpoint_dir:
            raise ConfigError(("{resume_if_any}" if out.resume_if_any else "{resume}") + " needs {checkpoint_dir}")
        if out.overwrite_checkpoints and (resume or not out.checkpoint_dir):
            raise ConfigError(
                "{overwrite_checkpoints} starts a fresh run in {checkpoint_dir} over another run's checkpoints: "
                + (
                    "not with {resume} or {resume_if_any}, which continue that run"
                    if resume
                    else "give {checkpoint_dir}"
                )
            )
        if self.train.checkpoint_every and not out.checkpoint_dir:
            raise ConfigError("{checkpoint_every} needs {checkpoint_dir}")

    def _check_eval_and_inputs(self) -> None:
        inp, data, cfg, out = self.input, self.data, self.train, self.output
        if cfg.eval_fraction and inp.eval_file is not None:
            raise ConfigError("give {eval_fraction} or {eval_file}, not both")
        if cfg.eval_every is not None and not cfg.eval_fraction and inp.eval_file is None:
            raise ConfigError("{eval_every} needs an eval set: give {eval_fraction} F or {eval_file} PATH")
        if cfg.eval_fraction and data.prepacked:
            raise ConfigError(
                "{eval_fraction} holds out conversations before packing, but a {prepacked} folder's rows are already "
                "packed: give {eval_file} PATH, or prepack only the training conversations"
            )
        if inp.eval_file is not None and not Path(inp.eval_file).exists():
            raise ConfigError(f"{{eval_file}} {inp.eval_file}: no such file")
        if inp.eval_file is not None and data.vocab == "data":
            raise ConfigError(
                "{eval_file} with {vocab} data: the eval file's ids are not the data's; use {eval_fraction}"
            )
        for name in ("split", "chat_template"):
            if getattr(inp, name) is not None and data.prepacked:
                raise ConfigError(
                    f"{{{name}}}: a {{prepacked}} folder's conversations were read and tokenized by sftpack prepack: "
                    f"give {{{name}}} to sftpack prepack, or train on the INPUT files"
                )
        if inp.split is not None and not inp.inputs:
            raise ConfigError("{split} picks the split of a saved DatasetDict among the INPUT files: give INPUT files")
        if out.save_model is not None and data.vocab == "data":
            raise ConfigError(
                "{save_model} with {vocab} data: that model's ids are the data's, renumbered, not the tokenizer's, so "
                "the saved folder could not be used with its tokenizer; train with {vocab} tokenizer (the default)"
            )
        if out.overwrite_model and out.save_model is None:
            raise ConfigError("{overwrite_model} replaces the folder of {save_model} DIR: give {save_model}")
        if out.save_model is not None:  # a path that cannot take the model costs no training
            try:
                check_model_dir(out.save_model, overwrite=out.overwrite_model)
            except ValueError as e:
                raise ConfigError(f"{{save_model}} {e}") from None

    def _check_data(self, images: bool) -> None:
        inp, data, model, cfg = self.input, self.data, self.model, self.train
        if data.prepacked and cfg.packing is not Packing.OFFLINE:
            raise ConfigError("{prepacked} is for {packing} offline")
        if data.vocab == "data" and (model.model or data.prepacked):
            raise ConfigError(
                "{vocab} data renumbers the ids of INPUT files or the corpus for the default model: "
                "not with {model} or {prepacked}"
            )
        if data.prepacked and inp.inputs:
            raise ConfigError("give either INPUT files or {prepacked}, not both")
        if data.no_cache and (data.cache_dir or data.cache_max_size is not None):
            raise ConfigError(
                "give " + ("{cache_dir}" if data.cache_dir else "{cache_max_size}") + " or {no_cache}, not both"
            )
        if images:
            if cfg.fsdp:
                raise ConfigError(
                    "{fsdp} trains text models only for now (a vision-language model's tower is not sharded): "
                    "train data with images without {fsdp}"
                )
            if data.prepacked:
                raise ConfigError(
                    "{prepacked} is a text prepack's folder: data with images is prepacked by the run itself"
                )
            if inp.chat_template is not None:
                raise ConfigError(
                    "{chat_template}: data with images is rendered with the model family's own template; drop it"
                )
            if data.cache_dir or data.cache_max_size is not None:
                raise ConfigError(
                    ("{cache_dir}" if data.cache_dir else "{cache_max_size}")
                    + ": data with images is tokenized by each run, not cached; drop it"
                )
            lo, hi = inp.image_sides or IMAGE_SIDES
            if lo > hi:
                raise ConfigError(f"{{image_sides}} {lo} {hi}: MIN must not exceed MAX")
            if cfg.eval_fraction and cfg.packing is Packing.OFFLINE:
                raise ConfigError(
                    "{eval_fraction} with {packing} offline on data with images: the run prepacks the conversations "
                    "themselves, held-out ones too; give {eval_file} PATH, or another {packing}"
                )
        if data.prepacked:
            manifest = prepack_manifest(data.prepacked)
            for key in ("max_seq_len", "pad_multiple"):
                have, given = manifest[key], getattr(cfg, key)
                if given != have:
                    raise ConfigError(
                        f"{{{key}}} {given} but {data.prepacked} was prepacked with {key}={have}: leave {{{key}}} out "
                        f"({{prepacked}} takes it from the prepack) or prepack again with {{{key}}} {given}"
                    )
        elif inp.chat_template is not None:
            read_chat_template(inp.chat_template)  # a missing or empty file: one line, before any work

    def build(self, say: Callable[[str], None] | None = None, mark: Callable[[str], None] | None = None) -> Run:
        """The run, checked (:meth:`check`): :meth:`Run.run` trains it and returns the
        :class:`~sftpack.loop._loop.TrainResult`. ``say``: each line the run says (on rank 0;
        default: nothing); ``mark``: called with the name of each start-up phase as it ends."""
        return Run(self, images=self.check(), say=say, mark=mark)
