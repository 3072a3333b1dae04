"""``sftpack train``: train a causal LM on rows from any packing path, or on padded batches.

sftpack train --packing trainer --steps 50 --batch-size 8 --max-seq-len 1024 --log run.jsonl --plot run.png
torchrun --nproc-per-node 2 -m sftpack.cli train --packing loader ...      # data parallel (gloo on CPU)
sftpack train my_images.jsonl --steps 20 --log vlm.jsonl     # conversations with image parts: a tiny Qwen2-VL
sftpack train --corpus vqa --packing none --steps 20         # the embedded easy-vqa conversations with images

Data with images (INPUT files whose conversations hold image parts, found by reading
their first records, or ``--corpus vqa``) takes the same command and the same loop:
its samples carry their images (``sample.media``), the model is the vision-language
family's tiny model built from a config (Qwen2-VL; ``--dim``/``--layers``/``--heads``/
``--kv-heads``, over the tokenizer's ids or, with ``--vocab data``, the data's), every
packing path, checkpoints and ``--resume``, ``torchrun``, and ``--max-patches-per-row``
(the vision-patch budget of a packed row or micro-batch). The JSONL log adds ``images``
per step.

The command runs :mod:`sftpack.loop` (the training loop). The loop, the chat
and the offline path load torch, so they are imported in one place,
:func:`run`, when the command runs: ``sftpack --help`` and the other commands
build this parser without paying for them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from ._common import (
    Terminated,
    UsageError,
    given_settings,
    has_images,
    load_tokenizer,
    read_chat_template,
    render_read_stats,
    sigterm_deferred,
    vlm_setup,
)
from ._train_end import eval_samples_of, report, save, stopped_line
from ._train_options import IMAGE_SIDES, VQA_LIMIT, add_arguments, check_options

#: ``(phase, time.perf_counter())`` at the end of each start-up phase of the last
#: :func:`run` (``benchmarks/bench_startup.py`` reads it; nothing is printed)
MARKS: list[tuple[str, float]] = []


def _mark(phase: str) -> None:
    MARKS.append((phase, time.perf_counter()))


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train",
        arguments=add_arguments,
        help="train a causal LM on packed rows (offline, loader, trainer) or padded batches (none)",
        description="A small training loop (AdamW, LR schedule, gradient accumulation, clipping, the global "
        "token-mean loss, DDP under torchrun, checkpoints with exact resume). Data: the embedded corpus by default, "
        "chat files, or a prepacked directory. Model: a small Llama built from a config (nothing downloaded) or "
        "--model DIR.",
    )
    t.set_defaults(func=run, exit_at_once=True)  # as the command: no interpreter teardown (sftpack.cli.main)


def _train_until_stopped(
    train: Any,
    args: argparse.Namespace,
    cfg: Any,
    source: Any,
    model: Any,
    resume: Any,
    rank: int,
    on_step: Any = None,
    eval_samples: Any = None,
    save_model: Callable[[Any], None] | None = None,
) -> Any:
    """The loop (``train``, :func:`sftpack.loop.train`, imported by the caller) under the command's
    options, SIGTERM stopping it at the end of a step: then :class:`Terminated` says what was saved.
    ``save_model(result)`` writes ``--save-model`` at such a stop when nothing else keeps the
    training (no ``--checkpoint-dir``), or when the run was complete."""
    with sigterm_deferred() as sigterm:
        result = train(
            cfg,
            source=source,
            model=model,
            log=args.log,
            checkpoint_dir=args.checkpoint_dir,
            resume=resume,
            overwrite=args.overwrite_checkpoints,
            stop=sigterm,
            progress=rank == 0 and args.progress,
            on_step=on_step,
            eval_samples=eval_samples,
            tensorboard=args.tensorboard,
        )
    if sigterm():
        saved = None
        complete = not result.stopped  # it came in the last step
        if save_model is not None and args.save_model is not None and (complete or not args.checkpoint_dir):
            save_model(result)
            saved = args.save_model if result.logs else None
        raise Terminated(stopped_line(result, saved))
    return result


def _ranks(args: argparse.Namespace, resume: bool | Literal["auto"]) -> tuple[int, int, Callable[..., None]]:
    """A fresh run's --checkpoint-dir checked (another run's checkpoints: refused before the data is
    waited for), then ``torch.distributed`` joined: ``(rank, world, say)``, ``say`` printing on rank 0 only."""
    from ..loop._checkpoint import check_new_run
    from ..loop._loop import init_distributed

    if args.checkpoint_dir and not resume and not args.overwrite_checkpoints:
        check_new_run(args.checkpoint_dir)
    rank, world = init_distributed()
    return rank, world, print if rank == 0 else (lambda *a, **k: None)


def _layout(args: argparse.Namespace, manifest: dict | None) -> None:
    """With ``--prepacked`` (its ``manifest``): ``--max-seq-len`` / ``--pad-multiple``
    taken from it (an explicit different value is refused, naming both); else
    :class:`~sftpack.loop.TrainConfig`'s defaults."""
    from ..loop._options import TrainConfig  # loaded with the options (add_arguments)

    if manifest is not None:
        for key in ("max_seq_len", "pad_multiple"):
            have = manifest.get(key)
            if not isinstance(have, int):
                raise ValueError(
                    f"{Path(args.prepacked) / 'manifest.json'} has no integer {key}: the prepack is damaged"
                )
            given = getattr(args, key)
            flag = "--" + key.replace("_", "-")
            if given is not None and given != have:
                raise UsageError(
                    f"{flag} {given} but {args.prepacked} was prepacked with {key}={have}: leave {flag} out "
                    f"(--prepacked takes it from the prepack) or prepack again with {flag} {given}"
                )
            setattr(args, key, have)
    else:
        for key in ("max_seq_len", "pad_multiple"):
            if getattr(args, key) is None:
                setattr(args, key, getattr(TrainConfig, key))


def _config(args: argparse.Namespace) -> Any:
    """The run's :class:`~sftpack.loop.TrainConfig`: the settings the flags give (``--clip-norm 0``:
    off); a bad value, or a device this machine does not have, is a usage error."""
    from ..loop import TrainConfig, resolve_device

    try:
        cfg = TrainConfig(**{**given_settings(args, TrainConfig), "clip_norm": args.clip_norm or None})
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        resolve_device(cfg.device)
    except ValueError as e:
        raise UsageError(f"--device {e}") from None
    return cfg


def _model_settings(cfg: Any) -> dict[str, Any]:
    """What the default model (text or vision-language) is built with from the run's config:
    its shape and the seed of its weights."""
    return {name: getattr(cfg, name) for name in ("dim", "layers", "heads", "kv_heads", "seed")}


def _default_num_proc() -> int:
    """The CPUs this process may use, at most 4: the tokenizer's workers run beside
    torch loading in the main process, so a first run uses every core."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus))


class _Tokenizer:
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


def _start_tokenizing(args: argparse.Namespace, tok: _Tokenizer) -> tuple[Any, Any]:
    """Tokenize the data through the cache while torch loads and the model is built,
    in the order the trainer and padded paths train on the conversations
    (``--seed``), so that training can start as soon as the first step's
    conversations are there. On a cache hit nothing is tokenized and the tokenizer
    is not loaded. On a miss one producer process is forked here, before torch
    loads (a fork is safe only from a process that is not busy importing and has
    no other thread), at a lower priority than this one (training first,
    tokenizing with what is left): it loads the tokenizer, reads the input, orders
    it and tokenizes it (``--num-proc`` > 1: with its own worker processes); a
    background thread here collects its samples and writes the cache entry.
    Returns ``(job, pending)``."""
    from ..chat import read_conversations
    from ..chat._cache_entry import DEFAULT_MAX_SIZE, default_cache_dir
    from ..chat._cache_key import default_tokenizer_files, source_identity
    from ..chat._training_samples import Pending, start_training_samples

    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        tok.get()  # not a folder: the loader's own error, naming the path and the fix
    conversations: Iterable[Any] | None = None  # None: the embedded corpus
    source = read_stats = None
    cache_dir = None if args.no_cache else Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.inputs:
        read = read_conversations(args.inputs, on_bad_row=args.on_bad_row, split=args.split)
        read_stats = read.stats  # filled as the producer reads; its counts come back with the samples
        conversations = itertools.islice(read, args.limit) if args.limit else read
        if cache_dir is not None:
            options = {"on_bad_row": args.on_bad_row, **({"split": args.split} if args.split is not None else {})}
            source = source_identity(paths=args.inputs, limit=args.limit, options=options)
            if source is None:
                cache_dir = None  # a glob or a dataset name: nothing to key the cache by
    elif cache_dir is not None:
        source = source_identity(None, limit=args.limit)

    job = start_training_samples(
        None,
        conversations,
        max_seq_len=args.max_seq_len,
        limit=args.limit,
        num_proc=args.num_proc,
        progress=False,  # a bar from a background thread would cut through the other lines
        cache_dir=cache_dir,
        source=source,
        # the embedded tokenizer is named by the files it is built from (no serialising, no loading),
        # and a --chat-template file by its bytes beside them
        tokenizer_files=[
            *([args.tokenizer] if args.tokenizer else default_tokenizer_files()),
            *([args.chat_template] if args.chat_template else []),
        ],
        load_tokenizer=("sftpack.data.default_tokenizer" if args.tokenizer is None else "AutoTokenizer", tok.get),
        in_child=True,
        seed=args.seed,
        cache_max_size=DEFAULT_MAX_SIZE if args.cache_max_size is None else args.cache_max_size,
        read_stats=read_stats,
        on_bad_row=args.on_bad_row,
    )
    if job.done is None:
        _lower_priority_of_children()  # before it forks its own workers, which inherit it
    return job, Pending(job.finish)


def _lower_priority_of_children(niceness: int = 5) -> None:
    """The tokenizer's process yields the CPU to this one (imports, the model, the steps)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.pid is None:
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, child.pid, niceness)
        except (AttributeError, OSError):  # not on this platform, or not allowed: no matter
            pass


def run(args: argparse.Namespace) -> int:
    if args.corpus == "vqa" and args.inputs:
        raise UsageError("--corpus picks the embedded data used when no INPUT is given: not with INPUT files")
    images = args.corpus == "vqa" or bool(args.inputs and has_images(args.inputs, split=args.split))
    if args.model_impl is not None and (args.model or images):
        raise UsageError(
            "--model-impl picks the code of the default text model: not with "
            + (
                "--model (a model folder always loads with transformers)"
                if args.model
                else "--corpus vqa"
                if args.corpus == "vqa"
                else "data with images (it trains a vision-language model)"
            )
        )
    args.model_impl = args.model_impl or "torch"
    if not images and args.image_sides is not None:
        raise UsageError("--image-sides sizes the images of --corpus vqa: give --corpus vqa")
    if not images and args.max_patches_per_row is not None:
        raise UsageError(
            "--max-patches-per-row is the vision-patch budget of data with images (INPUT files with image parts, "
            "or --corpus vqa); this data has none"
        )
    if args.resume and args.resume_if_any:
        raise UsageError("give --resume or --resume-if-any, not both")
    resume: bool | Literal["auto"] = True if args.resume else ("auto" if args.resume_if_any else False)
    if resume and not args.checkpoint_dir:
        raise UsageError(f"--resume{'-if-any' if args.resume_if_any else ''} needs --checkpoint-dir")
    if args.overwrite_checkpoints and (resume or not args.checkpoint_dir):
        raise UsageError(
            "--overwrite-checkpoints starts a fresh run in --checkpoint-dir over another run's checkpoints: "
            + ("not with --resume or --resume-if-any, which continue that run" if resume else "give --checkpoint-dir")
        )
    if args.checkpoint_every and not args.checkpoint_dir:
        raise UsageError("--checkpoint-every needs --checkpoint-dir")
    check_options(args)
    if args.prepacked and args.packing != "offline":
        raise UsageError("--prepacked is for --packing offline")
    if args.vocab == "data" and (args.model or args.prepacked):
        raise UsageError(
            "--vocab data renumbers the ids of INPUT files or the corpus for the default model: "
            "not with --model or --prepacked"
        )
    if args.prepacked and args.inputs:
        raise UsageError("give either INPUT files or --prepacked, not both")
    if args.no_cache and (args.cache_dir or args.cache_max_size is not None):
        given = "--cache-dir" if args.cache_dir else "--cache-max-size"
        raise UsageError(f"give {given} or --no-cache, not both")
    if images:
        if args.fsdp:
            raise UsageError(
                "--fsdp trains text models only for now (a vision-language model's tower is not sharded): "
                "train data with images without --fsdp"
            )
        if args.prepacked:
            raise UsageError("--prepacked is a text prepack's folder: data with images is prepacked by the run itself")
        if args.chat_template is not None:
            raise UsageError(
                "--chat-template: data with images is rendered with the model family's own template; drop it"
            )
        return _run_images(args, resume)
    if args.num_proc is None:
        args.num_proc = _default_num_proc()
    MARKS.clear()
    _mark("start")
    manifest = None
    if args.prepacked:
        from ..offline import read_manifest  # loads torch: only when there is a prepack to read

        manifest = read_manifest(Path(args.prepacked))
    _layout(args, manifest)
    if args.chat_template is not None:
        read_chat_template(args.chat_template)  # a missing or empty file: one line, before any work
    if args.tokenizer is None and args.model is not None and (Path(args.model) / "tokenizer_config.json").is_file():
        args.tokenizer = args.model  # the --model folder's own tokenizer, as the other commands take it
    tokenizer = _Tokenizer(args.tokenizer, args.chat_template)
    job = pending = None
    if args.prepacked is None:
        # The data is tokenized (or read from the cache) while torch and the model load.
        job, pending = _start_tokenizing(args, tokenizer)
    _mark("tokenizer")
    try:
        return _run_training(args, resume, manifest, tokenizer, job, pending)
    except BaseException as e:
        if job is not None and pending is not None:  # an error, Ctrl-C, SIGTERM: the tokenizer's process goes too
            job.close()
            try:
                pending.result()  # it ends at once, its cache entry's temporary folder removed
            except BaseException:  # what killing the producer makes of it: not the error to report
                pass
        if isinstance(e, Terminated) and all(phase != "train" for phase, _ in MARKS):
            raise Terminated("stopped by SIGTERM before the first step; nothing was saved") from None
        raise


def _run_training(
    args: argparse.Namespace,
    resume: bool | Literal["auto"],
    manifest: dict | None,
    tokenizer: _Tokenizer,
    job: Any,
    pending: Any,
) -> int:
    """:func:`run` once the data is on its way."""
    import torch

    from ..chat._cache_key import tokenizer_info
    from ..loop import (
        build_model,
        compact_vocabulary,
        load_model,
        make_source,
        require_exact,
        resolve_device,
        tokenized_samples,
        train,
    )
    from ..loop._options import Packing
    from ..loop._setup import check_targets, checked_samples, model_vocab_size, supervised_targets

    _mark("imports")
    cfg = _config(args)  # before anything slow: a device this machine does not have is a usage error
    rank, world, say = _ranks(args, resume)
    if cfg.packing in (Packing.TRAINER, Packing.NONE):
        # Building the optimizer imports torch._dynamo (torch.optim's dynamo-disabling wrappers),
        # over a second of a 2-core CPU: begun here, in a thread, it goes on while the model is
        # built, the first step's data arrives and its first passes compute. Only on these paths:
        # no process is forked after this point (a fork while another thread imports could copy
        # a held import lock into the child).
        threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()

    # what training needs of the tokenizer: from the cache entry, else from the tokenizer's process
    info = job.info() if job is not None else {}
    if not {"vocab_size", "pad_id"} <= info.keys():
        info = tokenizer_info(tokenizer.get())
    pad_id, vocab_size = int(info["pad_id"]), int(info["vocab_size"])
    tokenizer_vocab = vocab_size
    data_vocab = int((manifest or {}).get("vocab_size") or 0)
    if args.model:  # before training: a model too small for the tokenizer cannot train on its ids
        model_vocab = model_vocab_size(args.model)
        for size, whose in ((vocab_size, "the tokenizer's"), (data_vocab, "the prepack's (its manifest)")):
            if size > model_vocab:
                raise UsageError(
                    f"--model {args.model} has a vocabulary of {model_vocab:,} ids, smaller than {whose} "
                    f"{size:,}: ids >= {model_vocab:,} have no embedding; give the tokenizer the model was "
                    "trained with (--tokenizer DIR) or a model whose vocabulary covers it"
                )
    elif data_vocab > vocab_size:
        vocab_size = data_vocab  # a prepack of ids beyond this tokenizer (it records none)
    check_tokenizer = None
    if manifest is not None:
        recorded = (manifest.get("fingerprint") or {}).get("tokenizer") or {}
        if recorded.get("sha256"):
            check_tokenizer = tokenizer.get()  # PrepackedDataset(expect={"tokenizer": ...}) refuses another one
        else:
            say(f"note: {args.prepacked} records no tokenizer: its ids are taken to be this tokenizer's")

    def default_model(vocab: int) -> Any:
        return build_model(vocab, **_model_settings(cfg), impl=args.model_impl, dtype=dtype)

    dtype = getattr(torch, args.dtype or "float32")
    model = None
    if args.model:
        model = load_model(args.model, dtype=dtype).to(resolve_device(cfg.device))  # where the loop runs it
        require_exact(model, cfg)  # before any work: a model whose packing is not exact is refused here
    elif args.vocab == "tokenizer":  # the data vocabulary is known only after tokenizing
        model = default_model(vocab_size)
    _mark("model")
    samples: Any = None
    workdir = None
    prepacked = args.prepacked

    def say_data(got: Any) -> None:
        where = (
            f"read from the cache ({got.entry})"
            if got.hit
            else (f"cached in {got.entry}" if got.entry is not None else "not cached")
        )
        stats = got.stats
        skipped = getattr(stats, "skipped", None) or {}
        skips = (
            f", {sum(skipped.values()):,} skipped ({', '.join(f'{k} {v:,}' for k, v in sorted(skipped.items()))}; "
            "--on-bad-row error stops at the first)"
            if skipped
            else ""
        )
        say(
            f"data: {stats.conversations:,} conversations -> {len(got.samples):,} samples ({stats.split:,} split, "
            f"{stats.dropped:,} dropped{skips}), {stats.tokens:,} tokens, {stats.trainable_tokens:,} trainable, "
            f"{supervised_targets(got.samples):,} supervised targets; {where}"
        )
        read = getattr(got, "read", None)
        if read is not None and (read.dropped or read.files_skipped):  # rows the reader left out, by reason
            say(render_read_stats(read))

    eval_samples = None

    def tokenize_eval(conversations: Any) -> list[Any]:
        return tokenized_samples(
            tokenizer.get(), conversations, max_seq_len=cfg.max_seq_len, on_bad_row=args.on_bad_row
        )[0]

    streaming = False  # training starts before the last conversation is tokenized
    if job is not None and pending is not None:
        sink = job.sink
        if (
            sink is not None
            and cfg.packing in (Packing.TRAINER, Packing.NONE)
            and args.vocab == "tokenizer"
            and not cfg.eval_fraction  # held out from all of them
        ):
            # conversations in seeded order, each step waiting only for its own
            samples = sink
            streaming = not sink.done
            if streaming:
                say(
                    f"data: tokenizing {sink.n:,} conversations in the background, in the order the steps read "
                    "them (training starts with the first step's)"
                )
            else:
                got = pending.result()
                checked_samples(got.samples)
                say_data(got)
                check_targets(got.samples, cfg.max_seq_len)  # no target at all: refused before any training
        else:
            got = pending.result()
            samples = checked_samples(got.samples)
            say_data(got)
            check_targets(samples, cfg.max_seq_len)  # no target at all: refused before any training
            if args.vocab == "data":
                samples, kept_ids = compact_vocabulary(samples)
                vocab_size, pad_id = len(kept_ids), 0
                say(f"vocabulary: the {vocab_size:,} ids that occur in the data, renumbered (of {tokenizer_vocab:,})")
        _mark("data")
    # the held-out share of the conversations (all tokenized: no streaming with it), or the eval file's
    samples, eval_samples = eval_samples_of(args, cfg, samples, tokenize_eval, say)
    if model is None:
        model = default_model(vocab_size)
        _mark("model")
    try:
        if prepacked is None and args.packing == "offline":
            assert samples is not None  # tokenized above: no --prepacked
            workdir, prepacked = _temporary_prepack(
                samples, cfg, say, pad_id=pad_id, tokenizer=tokenizer.get() if args.vocab == "tokenizer" else None
            )
        source = make_source(
            cfg,
            samples=samples,
            prepacked=prepacked,
            rank=rank,
            world=world,
            pad_id=pad_id,
            tokenizer=check_tokenizer,
        )
        if streaming:  # the first step's conversations (data with no target at all is refused here)
            source.wait_first()  # type: ignore[attr-defined]
        _mark("source")
        n_params = sum(p.numel() for p in model.parameters())
        say(
            f"model: {type(model).__name__}, {n_params / 1e6:.2f} M parameters, vocabulary {model.config.vocab_size:,}; "
            f"packing {cfg.packing} ({cfg.boundaries} boundaries), {world} rank(s)"
            + (", the model sharded over them (FSDP)" if cfg.fsdp else "")
        )
        from ..hybrid import covered_layers

        kept = covered_layers(model)
        if kept and cfg.packing != "none":  # the layers that carry state: kept apart on each packed row
            kinds = ", ".join(sorted({f"{c.kind} ({c.cls})" for c in kept}))
            say(f"hybrid: {len(kept)} layer(s) keep each packed row's sequences apart: {kinds}")
        _mark("train")  # start-up is over: from here SIGTERM stops the loop at the end of a step
        result = _train_until_stopped(
            train,
            args,
            cfg,
            source,
            model,
            resume,
            rank,
            on_step=lambda rec: _mark(f"step {rec.step}") if rec.step == 1 else None,
            eval_samples=eval_samples,
            save_model=lambda result: save(args, result, rank, say, tokenizer=tokenizer.get()),
        )
    except Exception:
        if streaming and pending is not None and samples.done:  # e.g. no target at all: the data line says so
            say_data(pending.result())
            streaming = False
        raise
    finally:
        if workdir is not None:
            workdir.cleanup()
    if streaming and pending is not None:  # the rest of the data, and its cache entry for the next run
        say_data(pending.result())
        _mark("cache")
    report(args, cfg, result, resume, rank, say)
    if args.save_model is not None:  # the tokenizer is loaded here only for it
        save(args, result, rank, say, tokenizer=tokenizer.get())
    return 0


def _temporary_prepack(samples: Any, cfg: Any, say: Callable[..., None], **settings: Any) -> tuple[Any, str]:
    """The tokenized ``samples`` written as the run's temporary prepack (``--packing offline``
    without ``--prepacked``; ``settings``: :func:`~sftpack.offline.prepack_samples`' others, the
    images' with them): ``(its temporary folder, the prepack's path)``. Nothing is tokenized here."""
    from ..offline import prepack_samples

    workdir = tempfile.TemporaryDirectory(prefix="sftpack-train-")
    try:
        path = prepack_samples(
            samples,
            Path(workdir.name) / "rows",
            max_seq_len=cfg.max_seq_len,
            pad_multiple=cfg.pad_multiple,
            seed=cfg.seed,
            **settings,
        ).path
    except BaseException:
        workdir.cleanup()
        raise
    say(f"prepacked into {path} (temporary; sftpack prepack writes a lasting one)")
    return workdir, str(path)


def _run_images(args: argparse.Namespace, resume: bool | Literal["auto"]) -> int:
    """:func:`run` for data with images: INPUT files whose conversations hold image parts, or
    ``--corpus vqa`` (the embedded easy-vqa conversations, images resized to seeded sizes
    within ``--image-sides``). The samples carry their images; the model is the family's tiny
    model built from a config (Qwen2-VL); then the text run's source, loop and report."""
    import torch

    from ..chat import read_conversations
    from ..chat._cache_key import tokenizer_info
    from ..loop import compact_vocabulary, make_source, require_exact, resolve_device, train
    from ..loop._model import build_media_model, media_token_ids
    from ..loop._options import Packing
    from ..loop._setup import check_targets, media_samples
    from ..multimodal import vqa_corpus

    _layout(args, None)
    cfg = _config(args)
    vqa = args.corpus == "vqa"
    lo, hi = args.image_sides or IMAGE_SIDES
    if lo > hi:
        raise UsageError(f"--image-sides {lo} {hi}: MIN must not exceed MAX")
    if cfg.eval_fraction and cfg.packing is Packing.OFFLINE:
        raise UsageError(
            "--eval-fraction with --packing offline on data with images: the run prepacks the conversations "
            "themselves, held-out ones too; give --eval-file PATH, or another --packing"
        )
    rank, world, say = _ranks(args, resume)
    family, tok, processor = vlm_setup(args.model, args.tokenizer)
    limit = args.limit or (VQA_LIMIT if vqa else None)

    conversations: Iterable[Any]
    if vqa:
        conversations = vqa_corpus(seed=cfg.seed, limit=limit, min_side=lo, max_side=hi)
    else:
        read = read_conversations(
            args.inputs, on_bad_row=args.on_bad_row, split=args.split, allow_outside_images=args.allow_outside_images
        )
        conversations = itertools.islice(read, limit) if limit else read

    def tokenize(conversations: Any) -> tuple[list[Any], Any]:
        return media_samples(
            conversations,
            max_seq_len=cfg.max_seq_len,
            family=family,
            tokenizer=tok,
            processor=processor,
            on_bad_row=args.on_bad_row,
        )

    # the run's one tokenization (images processed with it): every path trains on these samples,
    # the offline one on a prepack of them
    samples, stats = tokenize(conversations)
    images = sum(s.media.num_items for s in samples if s.media is not None)
    vision = sum(s.media.num_placeholders for s in samples if s.media is not None)
    dropped = sum(stats.dropped.values())
    say(
        f"data: {stats.read:,} {'easy-vqa ' if vqa else ''}conversations -> {len(samples):,} samples with "
        f"{images:,} images" + (f" ({lo}-{hi} px a side)" if vqa else "") + f", {sum(len(s) for s in samples):,} "
        f"tokens of which {vision:,} image placeholders" + (f"; {dropped:,} dropped" if dropped else "")
    )
    check_targets(samples, cfg.max_seq_len)  # no target at all: refused before any training

    def tokenize_eval(conversations: Any) -> list[Any]:
        return tokenize(conversations)[0]

    pad_id = tokenizer_info(tok)["pad_id"]
    tokenized = samples  # in the tokenizer's ids: what a temporary prepack stores (--vocab data: renumbered as read)
    vocab = None
    if args.vocab == "data":
        keep = [pad_id, *media_token_ids(family, tok).values()]
        samples, vocab = compact_vocabulary(samples, keep=keep)
        pad_id = int(vocab.searchsorted(pad_id))
        say(f"vocabulary: the {len(vocab):,} ids that occur in the data, renumbered (of {len(tok):,})")
    samples, eval_samples = eval_samples_of(args, cfg, samples, tokenize_eval, say)
    dtype = getattr(torch, args.dtype or "float32")
    if args.model:
        model, what = family.pretrained(args.model, dtype=dtype), f"{args.model} ({family.name})"
        model.to(resolve_device(cfg.device))  # where the loop runs it
        require_exact(model, cfg)  # the loop asks the same before its first step: now, before any work
    else:
        model = build_media_model(family, tok, vocab=vocab, **_model_settings(cfg), dtype=dtype)
        what = f"tiny {family.name}"
    workdir = None
    prepacked = None
    try:
        if cfg.packing is Packing.OFFLINE:  # the samples above with their images, not tokenized again
            workdir, prepacked = _temporary_prepack(
                tokenized,
                cfg,
                say,
                tokenizer=tok,
                images=True,
                family=family,
                processor=processor,
                max_patches_per_row=cfg.max_patches_per_row,
            )
        source = make_source(
            cfg,
            samples=samples,
            prepacked=prepacked,
            rank=rank,
            world=world,
            pad_id=pad_id,
            vocab=vocab,
        )
        n_params = sum(p.numel() for p in model.parameters())
        say(
            f"model: {what} ({type(model).__name__}), {n_params / 1e6:.2f} M parameters, vocabulary "
            f"{model.config.get_text_config().vocab_size:,}, {str(dtype).removeprefix('torch.')}; packing "
            f"{cfg.packing} ({cfg.boundaries} boundaries), {world} rank(s)"
        )
        # saved with the template the run rendered with (the family's: it writes image parts)
        saving = {"tokenizer": tok, "processor": processor, "chat_template": family.chat_template_for(tok)}
        if family.video_block and importlib.util.find_spec("torchvision") is None:
            saving["note"] = (
                "note: AutoProcessor.from_pretrained on that folder also needs torchvision (transformers builds "
                f"{family.name}'s video processor with it): pip install the torchvision of your torch; "
                "AutoTokenizer and AutoImageProcessor load it without"
            )
        result = _train_until_stopped(
            train,
            args,
            cfg,
            source,
            model,
            resume,
            rank,
            eval_samples=eval_samples,
            save_model=lambda result: save(args, result, rank, say, **saving),
        )
    finally:
        if workdir is not None:
            workdir.cleanup()
    report(args, cfg, result, resume, rank, say)
    save(args, result, rank, say, **saving)
    return 0
