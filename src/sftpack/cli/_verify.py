"""``sftpack verify``: is packing exact on *your* model and *your* data?

The first thing to run on a new model: a sample of the conversations goes through every
packing path (trainer, loader, offline) in both boundary modes, exactly as ``sftpack train``
builds its micro-batches, and each packed micro-batch runs through the model's own Hugging
Face class against each of its samples alone (logits, loss, gradients; float64 by default,
with tolerances derived from the model's shape: :mod:`sftpack.report.verify`). Exit 0 when
every path agrees, 1 naming the first sample that differs and by how much.

exit status: 0 every path agrees with each sample alone (packing is exact on this model); 1 a
path differs (the first sample that differs is named), or with --dtype float32 the float64 leak
probe does; 2 a usage error (a bad option); 3 the model could not be checked: it asks for
something sftpack's attention does not compute (a softcap, attention sinks, a sliding window
narrower than the rows), no path takes this data, or the model or the data cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..chat import DEFAULT_MAX_SEQ_LEN, InputOptions, read_conversations
from ..data import default_corpus
from ._common import INPUTS_HELP, UsageError, add_family, add_settings, has_images, positive, render_read_stats

#: conversations checked by default (text; data with images)
TEXT_LIMIT, IMAGE_LIMIT = 8, 2
#: the exit status of a model that could not be checked (the others: 0 exact, 1 differs, 2 usage)
NOT_CHECKED = 3


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser(
        "verify",
        help="check that packed rows equal each sample alone through your model (run this first on a new model)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog=__doc__.split("\n\n")[2] if __doc__ else None,
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
    add_family(v)
    v.add_argument(
        "--limit",
        type=positive,
        help=f"conversations to check (default {TEXT_LIMIT}; {IMAGE_LIMIT} for data with images, whose vision "
        "tower runs in float64 for every sample alone and every packed row: about a minute on 2 cores)",
    )
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
        help="the model's dtype for the check (default float64: the tolerances are then about 1e-10); float32 "
        "adds a float64 leak probe of the model (a few synthetic sequences), since a small leak hides below "
        "float32's tolerance",
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


def _not_checked(e: BaseException) -> int:
    """The one line of a model that could not be checked, with what the user can do; exit 3."""
    from ..attention import UnsupportedAttentionError  # start-up: attention loads torch

    text = " ".join(str(e).split())
    if isinstance(e, UnsupportedAttentionError):
        if e.option == "sliding_window":
            text = (
                f"{e.module} uses a sliding window of {e.window} tokens and a sequence here has {e.longest}: "
                f"verify runs sftpack's attention (full attention within each sequence), as sftpack train does; "
                f"check with --max-seq-len {e.window} or less"
            )
        else:
            text = (
                f"{e.module} asks for {e.option}, which sftpack's attention does not compute, and verify runs "
                "sftpack's attention whatever the folder was saved with (as sftpack train does): this model cannot "
                "be checked here nor trained by sftpack train; in your own loop, load it with an attn_implementation "
                f"that computes {e.option} and feed it sftpack's rows (PackedBatch.to_hf_kwargs)"
            )
    print(f"sftpack verify: not checked: {text}", file=sys.stderr)
    return NOT_CHECKED


def run(args: argparse.Namespace) -> int:
    import torch  # start-up: not for `sftpack --help`

    from ..multimodal import UnsupportedModelError  # start-up: multimodal loads torch
    from ..report.verify import verify  # start-up: the check loads torch and the paths

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
    limit = args.limit or (IMAGE_LIMIT if images else TEXT_LIMIT)
    print(
        f"checking up to {limit} conversations{' with images' if images else ''} on {len(args.paths)} path(s) x 2 "
        f"boundary modes, each packed micro-batch against its samples alone ({args.dtype}); a bar per path "
        "shows the time left",
        flush=True,
    )

    def bar(label: str, total: int) -> Any:
        from .._progress import Bar  # start-up: tqdm loads with the first bar

        return Bar(total=total, desc=label, unit="micro-batch", leave=False)

    try:
        r = verify(
            data,
            model=args.model,
            family=args.family,
            images=images,
            limit=limit,
            max_seq_len=args.max_seq_len,
            pad_multiple=args.pad_multiple,
            dtype=dtype,
            paths=args.paths,
            seed=args.seed,
            progress=bar,
            on_bad_row=args.on_bad_row,
        )
    except UnsupportedModelError as e:
        raise UsageError(str(e)) from None
    except (ValueError, OSError, RuntimeError) as e:
        if args.debug:
            raise
        return _not_checked(e)
    print(f"model: {r.model} ({r.kind}, {r.dtype})")
    print(f"data: {r.conversations} conversations -> {r.samples} samples; rounding chain n = {r.chain:,}")
    if r.hybrid:  # the layers that carry state, kept apart by sftpack.hybrid
        kinds = sorted({f"{c.kind} ({c.cls})" for c in r.hybrid})
        print(f"hybrid: {len(r.hybrid)} layer(s) keep the row's sequences apart: {', '.join(kinds)}")
        if r.rounds_in != r.dtype:
            print(f"the model's own code rounds to {r.rounds_in} inside: the tolerances are {r.rounds_in}'s")
    if reader is not None and (reader.stats.dropped or reader.stats.files_skipped):
        print(render_read_stats(reader.stats))  # the rows skipped (--on-bad-row skip) on the way to --limit
    if r.skipped:  # --on-bad-row skip: left out of every path alike
        said = ", ".join(f"{k} {v}" for k, v in sorted(r.skipped.items()))
        print(f"left out by the tokenizer (--on-bad-row skip): {said}")
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
    bound = "2 n u" if (r.rounds_in or r.dtype) == "float64" else "20 sqrt(n) u"  # sftpack.exactness.tolerance
    print(
        f"\nlogits, loss, grads: the largest |packed - alone| difference; tolerance: {bound} of the values' magnitude"
    )
    if r.leak is not None:
        print(
            f"leak probe ({r.leak.dtype}, synthetic sequences): logits {r.leak.difference:.1e}, tolerance "
            f"{r.leak.tolerance:.1e}  {'exact' if r.leak.ok else 'DIFFERS'}"
        )
    bad = r.first_failure
    leaks = r.leak is not None and not r.leak.ok
    if bad is not None:
        print(f"\nsftpack verify: {bad.path} ({bad.boundaries} boundaries): {bad.first}")
    if leaks and r.leak is not None:  # last: it names the layers that leak
        if bad is None:
            print()
        print(f"sftpack verify: the {r.leak.dtype} leak probe: {r.leak.describe()}")
    if bad is not None or leaks:
        return 1
    if not r.checked:
        refused = next((c for c in r.checks if c.refused is not None), None)
        why = f"{refused.path}: {refused.refused}" if refused is not None else "no path was asked for"
        return _not_checked(ValueError(f"no path could be checked ({why}); add another path to --paths"))
    print("\nevery path agrees with each sample alone: packing is exact on this model")
    return 0
