"""``sftpack verify``: is packing exact on *your* model and *your* data?

The first thing to run on a new model: a sample of the conversations goes through every
packing path (trainer, loader, offline) in both boundary modes, exactly as ``sftpack train``
builds its micro-batches, and each packed micro-batch runs through the model's own Hugging
Face class against each of its samples alone (logits, loss, gradients; float64 by default,
with tolerances derived from the model's shape: :mod:`sftpack.report.verify`). Exit 0 when
every path agrees, 1 naming the first sample that differs and by how much.
"""

from __future__ import annotations

import argparse

from ..chat._options import DEFAULT_MAX_SEQ_LEN, InputOptions
from ._common import INPUTS_HELP, UsageError, add_settings, has_images, positive, render_read_stats


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser(
        "verify",
        help="check that packed rows equal each sample alone through your model (run this first on a new model)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    v.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help=f"chat files: {INPUTS_HELP}, with or without image parts (default: the embedded corpus)",
    )
    v.add_argument(
        "--model",
        metavar="DIR",
        help="a local model folder (save_pretrained: config, weights, tokenizer; for a vision-language model its "
        "preprocessor_config.json); default: a tiny model built from a config over the data's ids",
    )
    v.add_argument(
        "--family",
        help="data with images and no --model: the tiny vision-language model's family (default qwen2_vl)",
    )
    v.add_argument("--limit", type=positive, default=8, help="conversations to check (default 8)")
    v.add_argument(
        "--max-seq-len",
        type=positive,
        default=256,
        help=f"row width of the check; longer conversations are split (default 256: the check runs every path in "
        f"float64, so narrow rows keep it quick and split the longer conversations, which it then checks too; "
        f"the commands that build rows for training default to {DEFAULT_MAX_SEQ_LEN})",
    )
    v.add_argument("--pad-multiple", type=positive, default=1, help="pad each sequence to a multiple (2*CP)")
    v.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="the model's dtype for the check (default float64: the tolerances are then about 1e-10)",
    )
    v.add_argument(
        "--paths",
        nargs="+",
        choices=["trainer", "loader", "offline"],
        default=["trainer", "loader", "offline"],
        help="which paths to check (default all three)",
    )
    v.add_argument("--seed", type=int, default=0)
    add_settings(v, InputOptions, "on_bad_row", "split", "allow_outside_images")
    v.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..chat import read_conversations
    from ..data import default_corpus
    from ..multimodal import UnsupportedModelError
    from ..report.verify import verify

    images = bool(args.inputs) and has_images(args.inputs, split=args.split)
    if args.family is not None and not images:
        raise UsageError("--family names the tiny vision-language model of data with images: these inputs have none")
    if args.family is not None and args.model is not None:
        raise UsageError("--family: the family of a --model folder is its config.model_type; drop --family")
    if args.max_seq_len % args.pad_multiple:
        raise UsageError(f"--max-seq-len {args.max_seq_len} is not a multiple of --pad-multiple {args.pad_multiple}")
    if args.split is not None and not args.inputs:
        raise UsageError("--split picks the split of a saved DatasetDict among the INPUT files: give INPUT files")
    reader = None
    if args.inputs:
        reader = read_conversations(
            args.inputs, on_bad_row=args.on_bad_row, split=args.split, allow_outside_images=args.allow_outside_images
        )
    data = reader if reader is not None else default_corpus()
    dtype = getattr(torch, args.dtype)
    try:
        r = verify(
            data,
            model=args.model,
            family=args.family,
            images=images,
            limit=args.limit,
            max_seq_len=args.max_seq_len,
            pad_multiple=args.pad_multiple,
            dtype=dtype,
            paths=args.paths,
            seed=args.seed,
        )
    except UnsupportedModelError as e:
        raise UsageError(str(e)) from None
    print(f"model: {r.model} ({r.kind}, {r.dtype})")
    print(f"data: {r.conversations} conversations -> {r.samples} samples; rounding chain n = {r.chain:,}")
    if reader is not None and (reader.stats.dropped or reader.stats.files_skipped):
        print(render_read_stats(reader.stats))  # the rows skipped (--on-bad-row skip) on the way to --limit
    head = f"{'path':<8} {'boundaries':<10} {'micro-batches':>13} {'seqs':>5} {'logits':>9} {'loss':>9} {'grads':>9}"
    print(f"\n{head} {'tolerance':>9}  result")
    for c in r.checks:
        if c.refused is not None:
            print(f"{c.path:<8} {c.boundaries:<10} {'not offered: ' + c.refused}")
            continue
        tol = max(c.tolerance.values())
        print(
            f"{c.path:<8} {c.boundaries:<10} {c.rows:>13} {c.sequences:>5} {c.logits:>9.1e} {c.loss:>9.1e} "
            f"{c.grads:>9.1e} {tol:>9.1e}  {'exact' if c.ok else 'DIFFERS'}"
        )
    print("\nlogits, loss, grads: the largest |packed - alone| difference; tolerance: 2 n u of the values' magnitude")
    bad = r.first_failure
    if bad is not None:
        print(f"\nsftpack verify: {bad.path} ({bad.boundaries} boundaries): {bad.first}")
        return 1
    print("\nevery path agrees with each sample alone: packing is exact on this model")
    return 0
