"""``sftpack train --corpus vqa``: train a tiny Qwen2-VL on the embedded easy-vqa conversations.

sftpack train --corpus vqa --packing trainer --steps 20 --log packed.jsonl
sftpack train --corpus vqa --packing none --steps 20 --log padded.jsonl     # same samples and images per step
sftpack train --corpus vqa --packing loader        # or offline (a temporary prepack with images)

The data: the first ``--limit`` (default 64) easy-vqa conversations
(:func:`sftpack.multimodal.vqa_corpus`, seeded by ``--seed``, each image resized to a
seeded size within ``--image-sides``), tokenized with Qwen2-VL's tokenizer and image
processor. The model: a tiny Qwen2-VL from a config (``--dim``/``--layers``/``--heads``/
``--kv-heads``; nothing downloaded), over Qwen2-VL's 151,657 ids or, with ``--vocab data``,
the ids the data uses. The paths: ``trainer`` and ``none`` take the same conversations every
step (so the same images); ``loader`` packs rows while streaming
(:class:`sftpack.loader.MultimodalPackingDataset`), ``offline`` prepacks the same
conversations with their images into a temporary directory first
(:func:`sftpack.offline.prepack_multimodal`); ``--batch-size`` then counts rows. The loop:
:func:`sftpack.loop._media.train_media` (the text loop's optimisation options; one process, no
checkpoints yet). The JSONL log is the text loop's plus ``images`` per step.

:func:`add_vqa_arguments` adds ``--corpus`` and the multimodal options to the ``train``
parser; :func:`run_vqa` runs the command from the parsed arguments.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._common import UsageError, positive

#: conversations of the default run (``--limit``): a 20-step CPU run takes seconds
VQA_LIMIT = 64
#: the default seeded image sizes, px a side (up to 256 patches an image: the vision tower's attention
#: grows with the square of an image's patches, so 448 px images cost 16x as much per image on CPU)
IMAGE_SIDES = (56, 224)


def add_vqa_arguments(parser: argparse.ArgumentParser) -> None:
    """``--corpus {chat,vqa}`` and the options of ``--corpus vqa`` on the ``train`` parser (its
    ``--dtype`` is the ``train`` parser's own: the tiny Qwen2-VL's dtype here)."""
    parser.add_argument(
        "--corpus",
        choices=["chat", "vqa"],
        default="chat",
        help="the embedded data when no INPUT is given: chat conversations (default) or easy-vqa conversations "
        "with images, which trains a tiny Qwen2-VL",
    )
    g = parser.add_argument_group("multimodal (--corpus vqa)")
    g.add_argument(
        "--image-sides",
        nargs=2,
        type=positive,
        metavar=("MIN", "MAX"),
        help=f"each image is resized to a seeded size within MIN..MAX px a side (default {IMAGE_SIDES[0]} "
        f"{IMAGE_SIDES[1]}); --limit caps the conversations (default {VQA_LIMIT})",
    )


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        packing=args.packing,
        steps=args.steps,
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len or 1024,
        grad_accum=args.grad_accum,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        schedule=args.schedule,
        min_lr_ratio=args.min_lr_ratio,
        clip_norm=args.clip_norm or None,
        pad_multiple=args.pad_multiple or 1,
        boundaries=args.boundaries,
        seed=args.seed,
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        device=args.device,
        on_nonfinite=args.on_nonfinite,
    )


def _refuse(args: argparse.Namespace) -> None:
    """Options ``--corpus vqa`` does not take (yet), each named with what to do instead."""
    not_yet = [
        (getattr(args, "inputs", None), "INPUT files (it trains on the embedded easy-vqa conversations)"),
        (getattr(args, "prepacked", None), "--prepacked"),
        (getattr(args, "model", None), "--model (it builds a tiny Qwen2-VL from a config)"),
        (getattr(args, "tokenizer", None), "--tokenizer (it uses Qwen2-VL's)"),
        (getattr(args, "checkpoint_dir", None), "--checkpoint-dir"),
        (getattr(args, "resume", False) or getattr(args, "resume_if_any", False), "--resume"),
        (getattr(args, "overwrite_checkpoints", False), "--overwrite-checkpoints"),
    ]
    given = [what for value, what in not_yet if value]
    if given:
        raise UsageError(f"--corpus vqa does not take {', '.join(given)} yet: leave it out")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--corpus vqa trains on one process for now: run it without torchrun")


def run_vqa(args: argparse.Namespace) -> int:
    """Run ``sftpack train --corpus vqa`` from the ``train`` parser's arguments."""
    _refuse(args)
    import torch

    from ..loop import TrainConfig, plot_training
    from ..loop._loop import resolve_device
    from ..loop._media import (
        compact_media_vocabulary,
        make_media_source,
        media_ids,
        tiny_vqa_model,
        train_media,
        vqa_samples,
    )

    try:
        cfg = TrainConfig(**_config(args))
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        resolve_device(cfg.device)
    except ValueError as e:
        raise UsageError(f"--device {e}") from None
    lo, hi = getattr(args, "image_sides", None) or IMAGE_SIDES
    if lo > hi:
        raise UsageError(f"--image-sides {lo} {hi}: MIN must not exceed MAX")
    dtype = torch.float64 if getattr(args, "dtype", None) == "float64" else torch.float32
    limit = args.limit or VQA_LIMIT

    samples, stats = vqa_samples(limit=limit, seed=cfg.seed, max_seq_len=cfg.max_seq_len, min_side=lo, max_side=hi)
    images = sum(s.num_images for s in samples)
    tokens = sum(len(s) for s in samples)
    vision = sum(int(s.image_runs[:, 1].sum()) for s in samples)
    print(
        f"data: {stats.read:,} easy-vqa conversations -> {len(samples):,} samples with {images:,} images "
        f"({lo}-{hi} px a side), {tokens:,} tokens of which {vision:,} image placeholders"
    )
    vocab = None
    if args.vocab == "data":
        samples, vocab = compact_media_vocabulary(samples)
        print(f"vocabulary: the {len(vocab):,} ids that occur in the data, renumbered (of 151,657)")
    if len(samples) < cfg.batch_size:
        raise UsageError(
            f"--batch-size {cfg.batch_size} is more than the {len(samples)} samples: raise --limit or lower it"
        )
    model = tiny_vqa_model(
        vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.kv_heads, seed=cfg.seed, dtype=dtype
    )
    workdir = None
    prepacked = None
    if cfg.packing == "offline":  # a temporary prepack with images of the same conversations
        import tempfile
        from pathlib import Path

        from ..multimodal import vqa_corpus
        from ..offline import prepack_multimodal

        workdir = tempfile.TemporaryDirectory(prefix="sftpack-train-vqa-")
        convs = vqa_corpus(seed=cfg.seed, limit=limit, min_side=lo, max_side=hi)
        prepacked = prepack_multimodal(
            convs, Path(workdir.name) / "rows", max_seq_len=cfg.max_seq_len, pad_multiple=cfg.pad_multiple
        ).path
        print(f"prepacked into {prepacked} (temporary)")
    try:
        source = make_media_source(cfg, samples, pad_id=media_ids(vocab)["pad_id"], prepacked=prepacked, vocab=vocab)
    except ValueError as e:
        raise UsageError(str(e)) from None
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: tiny Qwen2-VL, {n_params / 1e6:.2f} M parameters, vocabulary {model.config.text_config.vocab_size:,}, "
        f"{str(dtype).removeprefix('torch.')}; packing {cfg.packing} ({cfg.boundaries} boundaries)"
    )
    try:
        result = train_media(cfg, source=source, model=model, log=args.log, progress=True)
    finally:
        if workdir is not None:
            workdir.cleanup()
    logs = result.logs
    for why in sorted(result.skipped_steps):
        steps = result.skipped_steps[why]
        print(f"skipped {len(steps):,} of {len(logs):,} step(s) ({why}): step {', '.join(map(str, steps[:10]))}")
    applied = [r for r in logs if not r.skipped]
    if applied:
        real = sum(r.real_tokens for r in logs)
        slots = sum(r.slots for r in logs)
        secs = sum(r.step_time for r in logs)
        print(
            f"loss {applied[0].loss:.4f} (step {applied[0].step}) -> {applied[-1].loss:.4f} (step {applied[-1].step}); "
            f"{real / secs:,.0f} real tokens/s, {1 - real / max(slots, 1):.1%} padding, "
            f"{sum(getattr(r, 'images', 0) for r in logs):,} images over {len(logs)} steps"
        )
    if args.log:
        print(f"wrote {args.log}")
    if getattr(args, "plot", None):
        print(f"wrote {plot_training({str(cfg.packing): [r.as_dict() for r in logs]}, args.plot)}")
    if logs and not applied:
        raise ValueError(
            f"not one of the {len(logs):,} steps was applied (all skipped, see above): nothing was learned"
        )
    return 0
