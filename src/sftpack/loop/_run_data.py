"""The data side of a :class:`~sftpack.loop._run.Run`, one class per kind of data behind one
interface: :class:`TextData` (tokenized in a background process through the cache, or a
prepack) and :class:`MediaData` (conversations with images, tokenized with the family's
processor). The run calls, in order: ``begin`` (before torch loads), ``load`` (the tokenizer's
facts, or the samples), ``early_model``, ``samples``, ``model``, ``prepack``, ``source_settings``,
``model_lines``, and at the end ``finish`` (or ``abort``); ``tokenize`` makes eval samples."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import multiprocessing
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..chat import (
    DEFAULT_MAX_SIZE,
    Pending,
    default_cache_dir,
    default_tokenizer_files,
    read_conversations,
    source_identity,
    start_training_samples,
    tokenizer_info,
)
from ..sample import DEFAULT_OVERLONG
from ._options import ConfigError, Packing
from ._run_parts import IMAGE_SIDES, VQA_LIMIT, RunState, prepack_manifest
from .inputs import load_tokenizer, render_read_stats, vlm_setup

__all__ = ["MediaData", "TextData"]


def _model_settings(run: RunState) -> dict[str, Any]:
    """What the default model (text or vision-language) is built with: its shape and the seed of its weights."""
    return {name: getattr(run.config.train, name) for name in ("dim", "layers", "heads", "kv_heads", "seed")}


def _dtype(run: RunState) -> Any:
    import torch  # start-up: loads torch, after begin() forks the tokenizer's process

    return getattr(torch, run.config.model.dtype or "float32")


def _default_num_proc() -> int:
    """The CPUs this process may use, at most 4: the tokenizer's workers run beside
    torch loading in the main process, so a first run uses every core."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus))


class Tokenizer:
    """The run's tokenizer, loaded the first time it is asked for: a run that finds its
    samples in the cache (and trains on the trainer, loader or padded path) never loads it."""

    def __init__(self, path: str | None, chat_template: str | None = None) -> None:
        self.path, self.chat_template = path, chat_template
        self._tok: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._tok is None:
                self._tok = load_tokenizer(self.path, self.chat_template)
            return self._tok


class TextData:
    """Text conversations (INPUT files or the embedded corpus) tokenized through the cache in a
    background process while torch loads, or a ``prepacked`` folder."""

    def __init__(self, run: RunState) -> None:
        self.run = run
        cfg = run.config
        path = cfg.model.tokenizer
        if path is None and cfg.model.model is not None and (Path(cfg.model.model) / "tokenizer_config.json").is_file():
            path = cfg.model.model  # the model folder's own tokenizer, as the other commands take it
        self.tokenizer = Tokenizer(path, cfg.input.chat_template)
        self.manifest = prepack_manifest(cfg.data.prepacked) if cfg.data.prepacked else None
        if self.manifest is not None and cfg.input.overlong is not DEFAULT_OVERLONG:
            raise ConfigError(
                f"{{overlong}} {cfg.input.overlong}: a {{prepacked}} folder's conversations were tokenized by sftpack "
                "prepack: give {overlong} to sftpack prepack, or train on the INPUT files"
            )
        self.job: Any = None
        self.pending: Any = None
        self.streaming = False  # training starts before the last conversation is tokenized
        self.pad_id = self.vocab_size = 0
        self.check_tokenizer: Any = None

    def begin(self) -> None:
        """The data tokenized (or read from the cache) while torch and the model load, in the order
        the trainer and padded paths train on the conversations (the seed), so that training can
        start as soon as the first step's conversations are there. On a cache hit nothing is
        tokenized and the tokenizer is not loaded. On a miss one producer process is forked here,
        before torch loads (a fork is safe only from a process that is not busy importing and has
        no other thread), at a lower priority than this one: it loads the tokenizer, reads the
        input, orders it and tokenizes it (``num_proc`` > 1: with its own worker processes); a
        background thread here collects its samples and writes the cache entry."""
        cfg = self.run.config
        inp, data, tok_path = cfg.input, cfg.data, self.tokenizer.path  # the model folder's own, when it has one
        if data.prepacked:
            return
        if tok_path is not None and not Path(tok_path).is_dir():
            self.tokenizer.get()  # not a folder: the loader's own error, naming the path and the fix
        conversations: Iterable[Any] | None = None  # None: the embedded corpus
        source = read_stats = None
        cache_dir = None if data.no_cache else Path(data.cache_dir) if data.cache_dir else default_cache_dir()
        if inp.inputs:
            read = read_conversations(inp.inputs, on_bad_row=inp.on_bad_row, split=inp.split)
            read_stats = read.stats  # filled as the producer reads; its counts come back with the samples
            conversations = itertools.islice(read, inp.limit) if inp.limit else read
            if cache_dir is not None:
                options = {"on_bad_row": str(inp.on_bad_row), **({"split": inp.split} if inp.split is not None else {})}
                source = source_identity(paths=inp.inputs, limit=inp.limit, options=options)
                if source is None:
                    cache_dir = None  # a glob or a dataset name: nothing to key the cache by
        elif cache_dir is not None:
            source = source_identity(None, limit=inp.limit)
        self.job = start_training_samples(
            None,
            conversations,
            max_seq_len=cfg.train.max_seq_len,
            limit=inp.limit,
            num_proc=data.num_proc or _default_num_proc(),
            progress=False,  # a bar from a background thread would cut through the other lines
            cache_dir=cache_dir,
            source=source,
            # the embedded tokenizer is named by the files it is built from (no serialising, no loading),
            # and a chat template file by its bytes beside them
            tokenizer_files=[
                *([tok_path] if tok_path else default_tokenizer_files()),
                *([inp.chat_template] if inp.chat_template else []),
            ],
            load_tokenizer=(
                "sftpack.data.default_tokenizer" if tok_path is None else "AutoTokenizer",
                self.tokenizer.get,
            ),
            in_child=True,
            seed=cfg.train.seed,
            cache_max_size=DEFAULT_MAX_SIZE if data.cache_max_size is None else data.cache_max_size,
            read_stats=read_stats,
            on_bad_row=inp.on_bad_row,
            overlong=inp.overlong,
        )
        if self.job.done is None:
            _lower_priority_of_children()  # before it forks its own workers, which inherit it
        self.pending = Pending(self.job.finish)

    def load(self) -> None:
        """What training needs of the tokenizer (from the cache entry, else the tokenizer's process),
        checked against a model folder's vocabulary and a prepack's."""
        from ._setup import model_vocab_size  # start-up: loads torch, after begin() forks the tokenizer's process

        run = self.run
        if run.config.train.packing in (Packing.TRAINER, Packing.NONE):
            # Building the optimizer imports torch._dynamo (torch.optim's dynamo-disabling wrappers),
            # over a second of a 2-core CPU: begun here, in a thread, it goes on while the model is
            # built, the first step's data arrives and its first passes compute. Only on these paths:
            # no process is forked after this point (a fork while another thread imports could copy
            # a held import lock into the child).
            threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()
        info = self.job.info() if self.job is not None else {}
        if not {"vocab_size", "pad_id"} <= info.keys():
            info = tokenizer_info(self.tokenizer.get())
        self.pad_id, self.vocab_size = int(info["pad_id"]), int(info["vocab_size"])
        self.tokenizer_vocab = self.vocab_size
        data_vocab = int((self.manifest or {}).get("vocab_size") or 0)
        folder = run.config.model.model
        if folder:  # before training: a model too small for the tokenizer cannot train on its ids
            model_vocab = model_vocab_size(folder)
            for size, whose in ((self.vocab_size, "the tokenizer's"), (data_vocab, "the prepack's (its manifest)")):
                if size > model_vocab:
                    raise ConfigError(
                        f"{{model}} {folder} has a vocabulary of {model_vocab:,} ids, smaller than {whose} "
                        f"{size:,}: ids >= {model_vocab:,} have no embedding; give the tokenizer the model was "
                        "trained with ({tokenizer} DIR) or a model whose vocabulary covers it"
                    )
        elif data_vocab > self.vocab_size:
            self.vocab_size = data_vocab  # a prepack of ids beyond this tokenizer (it records none)
        if self.manifest is not None:
            recorded = (self.manifest.get("fingerprint") or {}).get("tokenizer") or {}
            if recorded.get("sha256"):
                self.check_tokenizer = self.tokenizer.get()  # PrepackedDataset(expect=) refuses another one
            else:
                run.say(
                    f"note: {run.config.data.prepacked} records no tokenizer: its ids are taken to be this tokenizer's"
                )

    def early_model(self) -> Any:
        """The model when it needs no data: a model folder, or the tokenizer's vocabulary."""
        if self.run.config.model.model:
            return self.model()
        return self.model() if self.run.config.data.vocab == "tokenizer" else None

    def model(self) -> Any:
        from ._loop import resolve_device  # start-up: loads torch, after begin() forks the tokenizer's process
        from ._model import build_model, load_model, require_exact  # start-up: loads torch

        cfg = self.run.config
        if cfg.model.model:
            model = load_model(cfg.model.model, dtype=_dtype(self.run)).to(resolve_device(cfg.train.device))
            require_exact(model, cfg.train)  # before any work: a model whose packing is not exact is refused here
            return model
        impl = cfg.model.model_impl or "torch"
        return build_model(self.vocab_size, **_model_settings(self.run), impl=impl, dtype=_dtype(self.run))

    def samples(self) -> Any:
        """The training samples: the streaming sink (trainer and padded paths read conversations as
        they come), the tokenized list, or ``None`` (a prepack)."""
        from ._setup import check_targets, checked_samples, compact_vocabulary  # start-up: loads torch, after begin()

        if self.pending is None:
            return None
        cfg = self.run.config
        sink = self.job.sink
        if (
            sink is not None
            and cfg.train.packing in (Packing.TRAINER, Packing.NONE)
            and cfg.data.vocab == "tokenizer"
            and not cfg.train.eval_fraction  # held out from all of them
        ):
            # conversations in seeded order, each step waiting only for its own
            samples = sink
            self.streaming = not sink.done
            if self.streaming:
                self.run.say(
                    f"data: tokenizing {sink.n:,} conversations in the background, in the order the steps read "
                    "them (training starts with the first step's)"
                )
            else:
                got = self.pending.result()
                checked_samples(got.samples)
                self._say_data(got)
                check_targets(got.samples, cfg.train.max_seq_len)  # no target at all: refused before any training
        else:
            got = self.pending.result()
            samples = checked_samples(got.samples)
            self._say_data(got)
            check_targets(samples, cfg.train.max_seq_len)  # no target at all: refused before any training
            if cfg.data.vocab == "data":
                samples, kept_ids = compact_vocabulary(samples)
                self.vocab_size, self.pad_id = len(kept_ids), 0
                self.run.say(
                    f"vocabulary: the {self.vocab_size:,} ids that occur in the data, renumbered (of "
                    f"{self.tokenizer_vocab:,})"
                )
        self.run.mark("data")
        return samples

    def _say_data(self, got: Any) -> None:
        from ._setup import supervised_targets  # start-up: loads torch, after begin() forks

        where = (
            f"read from the cache ({got.entry})"
            if got.hit
            else (f"cached in {got.entry}" if got.entry is not None else "not cached")
        )
        stats = got.stats
        truncated = f"{stats.truncated:,} truncated, " if stats.truncated else ""  # --overlong truncate
        skipped = getattr(stats, "skipped", None) or {}
        skips = (
            f", {sum(skipped.values()):,} skipped ({', '.join(f'{k} {v:,}' for k, v in sorted(skipped.items()))}; "
            "--on-bad-row error stops at the first)"
            if skipped
            else ""
        )
        self.run.say(
            f"data: {stats.conversations:,} conversations -> {len(got.samples):,} samples ({stats.split:,} split, "
            f"{truncated}{stats.dropped:,} dropped{skips}), {stats.tokens:,} tokens, {stats.trainable_tokens:,} trainable, "
            f"{supervised_targets(got.samples):,} supervised targets; {where}"
        )
        read = getattr(got, "read", None)
        if read is not None and (read.dropped or read.files_skipped):  # rows the reader left out, by reason
            self.run.say(render_read_stats(read))

    def tokenize(self, conversations: Any) -> list[Any]:
        """Eval samples: ``conversations`` tokenized as the training data."""
        from ._setup import tokenized_samples  # start-up: loads torch, after begin() forks

        cfg = self.run.config
        return tokenized_samples(
            self.tokenizer.get(),
            conversations,
            max_seq_len=cfg.train.max_seq_len,
            on_bad_row=cfg.input.on_bad_row,
            overlong=cfg.input.overlong,
        )[0]

    def prepack(self, samples: Any) -> tuple[Any, dict[str, Any]]:
        """What a temporary prepack (``packing="offline"`` without ``prepacked``) is written from:
        ``(samples, prepack_samples' settings)``."""
        tokenizer = self.tokenizer.get() if self.run.config.data.vocab == "tokenizer" else None
        return samples, {"pad_id": self.pad_id, "tokenizer": tokenizer}

    def source_settings(self) -> dict[str, Any]:
        return {"pad_id": self.pad_id, "tokenizer": self.check_tokenizer}

    def model_lines(self, model: Any) -> list[str]:
        from ..hybrid import covered_layers  # start-up: loads torch, after begin() forks

        run, cfg = self.run, self.run.config.train
        n_params = sum(p.numel() for p in model.parameters())
        lines = [
            f"model: {type(model).__name__}, {n_params / 1e6:.2f} M parameters, vocabulary {model.config.vocab_size:,}; "
            f"packing {cfg.packing} ({cfg.boundaries} boundaries), {run.world} rank(s)"
            + (", the model sharded over them (FSDP)" if cfg.fsdp else "")
        ]
        kept = covered_layers(model)
        if kept and cfg.packing != "none":  # the layers that carry state: kept apart on each packed row
            kinds = ", ".join(sorted({f"{c.kind} ({c.cls})" for c in kept}))
            lines.append(f"hybrid: {len(kept)} layer(s) keep each packed row's sequences apart: {kinds}")
        return lines

    def saving(self) -> dict[str, Any]:
        """What ``save_model`` writes beside the model: the tokenizer (loaded here only for it)."""
        return {"tokenizer": self.tokenizer.get()}

    def finish(self) -> None:
        """After training: the rest of the streamed data said, its cache entry written for the next run."""
        if self.streaming:
            self._say_data(self.pending.result())
            self.run.mark("cache")

    def abort(self, error: BaseException | None) -> None:
        """The run failed (``error``) or stopped: the tokenizer's process goes too."""
        if self.streaming and isinstance(error, Exception) and self.job.sink.done:
            self._say_data(self.pending.result())  # e.g. no target at all: the data line says so
            self.streaming = False
        if self.job is not None and self.pending is not None:
            self.job.close()
            try:
                self.pending.result()  # it ends at once, its cache entry's temporary folder removed
            except BaseException:  # what killing the producer makes of it: not the error to report
                pass


def _lower_priority_of_children(niceness: int = 5) -> None:
    """The tokenizer's process yields the CPU to this one (imports, the model, the steps)."""
    for child in multiprocessing.active_children():
        if child.pid is None:
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, child.pid, niceness)
        except (AttributeError, OSError):  # not on this platform, or not allowed: no matter
            pass


class MediaData:
    """Conversations with images (INPUT files with image parts, or ``corpus="vqa"``: the embedded
    easy-vqa conversations, images resized to seeded sizes within ``image_sides``), tokenized with
    the vision-language family's processor: samples that carry their images (``sample.media``); the
    model is the family's tiny model built from a config (Qwen2-VL), or a model folder of a family."""

    def __init__(self, run: RunState) -> None:
        if run.config.input.overlong is not DEFAULT_OVERLONG:  # media_samples splits at text boundaries
            raise ConfigError(
                f"{{overlong}} {run.config.input.overlong}: data with images is split at text boundaries "
                "(never inside an image) for now; leave {overlong} out"
            )
        self.run = run
        self.vocab: Any = None  # with vocab="data": the original id of each of the model's ids
        self.pad_id = 0
        self.streaming = False

    def begin(self) -> None:
        """Nothing before torch loads: the family's processor is loaded with it."""

    def load(self) -> None:
        """The run's one tokenization (images processed with it): every path trains on these
        samples, the offline one on a prepack of them."""
        from ..multimodal import vqa_corpus  # start-up: multimodal loads torch; only for data with images
        from ._model import media_token_ids  # start-up: loads torch
        from ._setup import check_targets, compact_vocabulary  # start-up: loads torch

        run, cfg = self.run, self.run.config
        inp = cfg.input
        self.family, self.tok, self.processor = vlm_setup(cfg.model.model, cfg.model.tokenizer, cfg.model.family)
        vqa = inp.corpus == "vqa"
        lo, hi = inp.image_sides or IMAGE_SIDES
        limit = inp.limit or (VQA_LIMIT if vqa else None)
        conversations: Iterable[Any]
        if vqa:
            conversations = vqa_corpus(seed=cfg.train.seed, limit=limit, min_side=lo, max_side=hi)
        else:
            read = read_conversations(
                inp.inputs, on_bad_row=inp.on_bad_row, split=inp.split, allow_outside_images=inp.allow_outside_images
            )
            conversations = itertools.islice(read, limit) if limit else read
        samples, stats = self._tokenize(conversations)
        images = sum(s.media.num_items for s in samples if s.media is not None)
        vision = sum(s.media.num_placeholders for s in samples if s.media is not None)
        dropped = sum(stats.dropped.values())
        run.say(
            f"data: {stats.read:,} {'easy-vqa ' if vqa else ''}conversations -> {len(samples):,} samples with "
            f"{images:,} images" + (f" ({lo}-{hi} px a side)" if vqa else "") + f", {sum(len(s) for s in samples):,} "
            f"tokens of which {vision:,} image placeholders" + (f"; {dropped:,} dropped" if dropped else "")
        )
        check_targets(samples, cfg.train.max_seq_len)  # no target at all: refused before any training
        self.pad_id = tokenizer_info(self.tok)["pad_id"]
        self.tokenized = samples  # in the tokenizer's ids: what a temporary prepack stores
        if cfg.data.vocab == "data":
            keep = [self.pad_id, *media_token_ids(self.family, self.tok).values()]
            samples, self.vocab = compact_vocabulary(samples, keep=keep)
            self.pad_id = int(self.vocab.searchsorted(self.pad_id))
            run.say(
                f"vocabulary: the {len(self.vocab):,} ids that occur in the data, renumbered (of {len(self.tok):,})"
            )
        self._samples = samples

    def _tokenize(self, conversations: Any) -> tuple[list[Any], Any]:
        from ._setup import media_samples  # start-up: loads torch

        cfg = self.run.config
        return media_samples(
            conversations,
            max_seq_len=cfg.train.max_seq_len,
            family=self.family,
            tokenizer=self.tok,
            processor=self.processor,
            on_bad_row=cfg.input.on_bad_row,
        )

    def tokenize(self, conversations: Any) -> list[Any]:
        return self._tokenize(conversations)[0]

    def early_model(self) -> Any:
        return None  # built once the eval set is held out, as a text run with its data's vocabulary

    def samples(self) -> Any:
        return self._samples

    def model(self) -> Any:
        from ._loop import resolve_device  # start-up: loads torch
        from ._model import build_media_model, require_exact  # start-up: loads torch

        cfg, dtype = self.run.config, _dtype(self.run)
        if cfg.model.model:
            model = self.family.pretrained(cfg.model.model, dtype=dtype)
            model.to(resolve_device(cfg.train.device))  # where the loop runs it
            require_exact(model, cfg.train)  # the loop asks the same before its first step: now, before any work
            self.what = f"{cfg.model.model} ({self.family.name})"
            return model
        self.what = f"tiny {self.family.name}"
        return build_media_model(self.family, self.tok, vocab=self.vocab, **_model_settings(self.run), dtype=dtype)

    def prepack(self, samples: Any) -> tuple[Any, dict[str, Any]]:
        """The samples with their images, not tokenized again (in the tokenizer's ids)."""
        settings = {"tokenizer": self.tok, "images": True, "family": self.family, "processor": self.processor}
        return self.tokenized, {**settings, "max_patches_per_row": self.run.config.train.max_patches_per_row}

    def source_settings(self) -> dict[str, Any]:
        return {"pad_id": self.pad_id, "vocab": self.vocab}

    def model_lines(self, model: Any) -> list[str]:
        run, cfg = self.run, self.run.config.train
        n_params = sum(p.numel() for p in model.parameters())
        return [
            f"model: {self.what} ({type(model).__name__}), {n_params / 1e6:.2f} M parameters, vocabulary "
            f"{model.config.get_text_config().vocab_size:,}, {str(_dtype(run)).removeprefix('torch.')}; packing "
            f"{cfg.packing} ({cfg.boundaries} boundaries), {run.world} rank(s)"
        ]

    def saving(self) -> dict[str, Any]:
        """Saved with the template the run rendered with (the family's: it writes image parts)."""
        fam = self.family
        saving = {"tokenizer": self.tok, "processor": self.processor, "chat_template": fam.chat_template_for(self.tok)}
        if fam.video_block and importlib.util.find_spec("torchvision") is None:
            saving["note"] = (
                "note: AutoProcessor.from_pretrained on that folder also needs torchvision (transformers builds "
                f"{fam.name}'s video processor with it): pip install the torchvision of your torch; "
                "AutoTokenizer and AutoImageProcessor load it without"
            )
        return saving

    def finish(self) -> None:
        pass

    def abort(self, error: BaseException | None) -> None:
        pass
