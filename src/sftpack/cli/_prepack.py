"""``sftpack prepack``: conversations to a packed, checksummed, memory-mapped directory."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

from .. import _optional
from ..chat import InputOptions, read_conversations
from ..loop.inputs import load_tokenizer, tokenizer_folder, vlm_setup
from ._common import (
    INPUTS_HELP,
    UsageError,
    add_family,
    add_settings,
    given_settings,
    has_images,
    positive,
    render_read_stats,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..offline import PrepackResult


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepack",
        arguments=_add_arguments,
        help="tokenize and bin-pack conversations once, write the rows to a directory (the offline path)",
        description="Read + tokenize, bin-pack, and write rows of --max-seq-len tokens to --out, with a manifest "
        "(fingerprint, counts, checksums). The directory appears complete or not at all.",
    )
    p.set_defaults(func=run)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sftpack prepack``: :class:`~sftpack.offline.PrepackOptions`' fields, each
    declared there once (:func:`~._common.add_settings`), and the command's own."""
    from ..offline import PrepackOptions  # loads torch: added when the command is used

    p.add_argument(
        "inputs",
        nargs="*",
        help=f"{INPUTS_HELP} (default: the embedded chitchat corpus)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the directory to write (must not exist, unless --overwrite; never inside an input folder)",
    )
    add_settings(p, PrepackOptions, "max_seq_len")
    p.add_argument("--tokenizer", metavar="DIR", help="a local Hugging Face tokenizer folder (default: embedded Qwen)")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face model folder: its tokenizer and chat template; for data with images its family "
        "(config.model_type), tokenizer and image processor (preprocessor_config.json)",
    )
    add_settings(p, PrepackOptions, "algorithm", "pad_multiple")
    p.add_argument("--cp", type=positive, default=1, help="context-parallel size: sequences padded to 2*CP")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel size (matters with --sequence-parallel)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (pad x TP)")
    p.add_argument(
        "--fp8",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
        help="FP8 recipe: --max-seq-len must then be a multiple of the row multiple it needs",
    )
    add_settings(p, PrepackOptions, "overlong", "on_bad_row")
    add_settings(p, InputOptions, "split", "chat_template", "allow_outside_images")
    add_settings(p, PrepackOptions, *("train_on", "seed", "num_proc", "engine", "workers", "ray_address"))
    p.add_argument(
        "--corpus",
        default="chat",
        choices=["chat", "vqa"],
        help="chat (default): the inputs (or the embedded chitchat corpus); vqa: the embedded easy-vqa "
        "conversations with images (no inputs)",
    )
    img = p.add_argument_group(
        "images",
        'Inputs whose conversations hold image parts ({"type": "image", "path": ...}, paths relative to '
        "the data file's folder; found in their first records), or --corpus vqa: tokenized with the family's "
        "tokenizer and image processor and stored with their resized pixels. Not with --tokenizer, --train-on "
        "(assistant turns are trained) or --overlong truncate (never a cut inside an image).",
    )
    add_family(img)
    add_settings(img, PrepackOptions, "max_patches_per_row")
    add_settings(p, PrepackOptions, "limit", "overwrite", "progress")


def _fmt(n: float) -> str:
    return f"{n:,}" if isinstance(n, int) else f"{n:,.2f}"


def _lost(tokens: int, trainable: int) -> str:
    """What over-long handling cut, after the token count: nothing when nothing was cut.

    >>> _lost(0, 0), _lost(12, 5)
    ('', ' (12 lost to over-long handling, 5 of them trainable)')
    """
    return f" ({tokens:,} lost to over-long handling, {trainable:,} of them trainable)" if tokens else ""


def patch_budget_note(manifest: dict[str, Any]) -> str | None:
    """The sentence saying that the patch budget, not the token budget, limits the fill, or None.

    The patch budget binds when the rows hold a larger share of their ``--max-patches-per-row``
    patches than of their ``--max-seq-len`` slots: they close on patches first.

    >>> m = {"max_seq_len": 100, "counts": {"rows": 10, "fill": 0.3, "l1": 3},
    ...      "fingerprint": {"max_patches_per_row": 50}, "media": {"patches": 450}}
    >>> patch_budget_note(m)[:40]
    'fill 30.0%: rows close on --max-patches-'
    >>> patch_budget_note({**m, "media": {"patches": 100}}) is None  # 20% of the patches, 30% of the slots
    True
    """
    budget = manifest.get("fingerprint", {}).get("max_patches_per_row")
    media, c = manifest.get("media"), manifest["counts"]
    if not budget or not media or not c["rows"]:
        return None
    patch_fill = media["patches"] / (c["rows"] * budget)
    if patch_fill <= c["fill"]:
        return None
    by_patches = -(-media["patches"] // budget)
    return (
        f"fill {c['fill']:.1%}: rows close on --max-patches-per-row ({budget:,} patches; {patch_fill:.1%} of it used "
        f"on average) before --max-seq-len ({manifest['max_seq_len']:,} tokens); the patches alone need "
        f"{by_patches:,} rows, the tokens {c['l1']:,}: raise --max-patches-per-row to fill rows"
    )


def summary_lines(result: PrepackResult) -> list[str]:
    """The end-of-run table (also used by the tests)."""
    m = result.manifest
    c = m["counts"]
    sec = result.seconds
    dropped = ", ".join(f"{k} {v:,}" for k, v in c["dropped"].items()) or "none"
    oc = c.get("overlong") or {}
    rows = [
        ("conversations read", _fmt(c["read"])),
        ("  kept", _fmt(c["kept"])),
        ("  dropped (by reason)", dropped),
    ]
    if c.get("formats"):  # the rows kept of each format (read from files; not for an iterable of conversations)
        rows.insert(2, ("  formats", ", ".join(f"{k} {v:,}" for k, v in c["formats"].items())))
    if c.get("special_text"):
        rows.append(("  special_text", f"{c['special_text']:,} special-token strings in the data, kept as text"))
    if oc:
        rows += [
            ("  fit / split / truncated", f"{oc['fit']:,} / {oc['split']:,} / {oc['truncated']:,}"),
            ("  dropped (over-long)", _fmt(oc["dropped"])),
        ]
    rows += [
        ("samples (sequences)", _fmt(c["sequences"])),
        ("tokens", _fmt(c["tokens"]) + _lost(c["tokens_lost"], c["trainable_tokens_lost"])),
        ("supervised labels", _fmt(c["labels"])),
        ("rows", f"{c['rows']:,} x {m['max_seq_len']:,} slots, pad multiple {m['pad_multiple']}"),
        ("fill", f"{c['fill']:.3%} of slots hold real tokens"),
        ("L1 bound", f"{c['l1']:,} rows (gap {c['gap_l1']:.3%})"),
        ("time", "  ".join(f"{k} {v:.2f}s" for k, v in sec.items())),
    ]
    media = m.get("media")
    if media:
        per = media["images"] / c["rows"] if c["rows"] else 0.0
        rows.insert(
            -1,
            (
                "images",
                f"{media['images']:,} media items ({per:.1f} a row), {media['patches']:,} vision patches; stored as "
                f"resized uint8 pixels: {media['pixel_bytes'] / 1e6:,.2f} MB (float32 values: "
                f"{float32_bytes(media) / 1e6:,.2f} MB)",
            ),
        )
        note = patch_budget_note(m)
        if note is not None:
            rows.insert(-1, ("patch budget", note))
    actors = getattr(result, "actors", None)
    if actors:
        rates = ", ".join(f"{a['tokens_per_s'] / 1e3:,.0f}k" for a in actors)
        nodes = len({a["node"] for a in actors})
        rows.append(("ray actors", f"{len(actors)} on {nodes} node(s); tokens/s each: {rates}"))
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def _refuse_cp_over_state_layers(model: str, cp: int) -> None:
    """``--cp`` over a hybrid family's layers that carry state: one line, before any work."""

    from ..hybrid import refuse_context_parallel, state_layers_of_config  # start-up: hybrid loads torch

    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # not a model folder with a config: the tokenizer's load says so
    try:
        refuse_context_parallel(state_layers_of_config(config) if isinstance(config, dict) else None, cp, model)
    except ValueError as e:
        raise UsageError(f"--cp {cp}: {e}") from None


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: the offline path loads torch, and `sftpack --help` should not
    from ..handoff import pad_multiple_for  # start-up: the handoff loads torch
    from ..offline import check_row_width, prepack  # start-up: the offline path loads torch

    try:
        check_row_width(args.max_seq_len, "--max-seq-len")
    except ValueError as e:
        raise UsageError(str(e)) from None
    align = pad_multiple_for(cp_size=args.cp, tp_size=args.tp, sequence_parallel=args.sequence_parallel, fp8=args.fp8)
    if args.max_seq_len % align.row_multiple:
        raise UsageError(
            f"--max-seq-len {args.max_seq_len} is not a multiple of {align.row_multiple}, which every row needs "
            f"with --cp {args.cp} --tp {args.tp}{' --sequence-parallel' if args.sequence_parallel else ''}"
            f"{' --fp8 ' + args.fp8 if args.fp8 else ''} (use "
            f"{args.max_seq_len // align.row_multiple * align.row_multiple or align.row_multiple})"
        )
    pad_multiple = args.pad_multiple if args.pad_multiple is not None else align.seq_multiple
    if args.pad_multiple is not None and args.pad_multiple % align.seq_multiple:
        raise UsageError(
            f"--pad-multiple {args.pad_multiple} is not a multiple of {align.seq_multiple}, which --cp/--tp need"
        )
    if args.model is not None and args.cp > 1:
        _refuse_cp_over_state_layers(args.model, args.cp)
    if args.corpus == "vqa" and args.inputs:
        raise UsageError("--corpus vqa reads the embedded easy-vqa corpus: give no inputs (or use --corpus chat)")
    if args.split is not None and not args.inputs:
        raise UsageError("--split picks the split of a saved DatasetDict among the inputs: give inputs")
    if args.engine == "ray":
        if args.num_proc != 1:
            raise UsageError("--num-proc is the local engine's; with --engine ray use --workers")
        for flag, given in (("--split", args.split), ("--chat-template", args.chat_template)):
            if given is not None:
                raise UsageError(f"{flag}: not offered with --engine ray yet; use the local engine")
    elif args.workers is not None or args.ray_address is not None:
        raise UsageError("--workers and --ray-address need --engine ray (the local engine uses --num-proc)")
    if args.corpus == "vqa" or (args.inputs and has_images(args.inputs, split=args.split)):
        return _run_images(args, pad_multiple)
    if args.max_patches_per_row is not None:
        raise UsageError(
            "--max-patches-per-row is a budget for images: use it with data with image parts or --corpus vqa"
        )
    if args.family is not None:
        raise UsageError(
            f"--family {args.family} names the model of data with images: these inputs have no image parts"
        )
    where = tokenizer_folder(args.model, args.tokenizer)
    options = _options(args, pad_multiple)  # every option checked once, before the tokenizer loads or an input is read
    # Ray: a path (or None: the embedded one) that each actor loads; the driver never does
    tok: Any = where if args.engine == "ray" else load_tokenizer(where, args.chat_template)
    inputs: Any = args.inputs or None
    extra = None
    if args.split is not None:  # the reader picks the split; the manifest records which
        from ..offline import check_out_outside_inputs  # start-up: the offline path loads torch

        check_out_outside_inputs(args.inputs, args.out)
        inputs = read_conversations(args.inputs, on_bad_row=args.on_bad_row, split=args.split)
        extra = {"split": args.split}
    result = prepack(inputs, args.out, tokenizer=tok, options=options, fingerprint=extra)
    print(f"wrote {result.path}")
    for line in summary_lines(result):
        print("  " + line)
    return 0


def _options(args: argparse.Namespace, pad_multiple: int, **more: Any) -> Any:
    """The run's :class:`~sftpack.offline.PrepackOptions`: the settings the flags give, ``pad_multiple``
    (from --pad-multiple or --cp/--tp) and ``more``; a bad value is a usage error."""
    from ..offline import PrepackOptions  # start-up: the offline path loads torch

    try:
        return PrepackOptions(**{**given_settings(args, PrepackOptions), "pad_multiple": pad_multiple, **more})
    except ValueError as e:
        raise UsageError(str(e)) from None


def _run_images(args: argparse.Namespace, pad_multiple: int) -> int:
    """Data with images through ``prepack(..., images=True)``: INPUT files whose conversations hold
    image parts (read by :func:`sftpack.chat.read_conversations`, image paths relative to each
    file), or ``--corpus vqa`` (the embedded easy-vqa conversations)."""
    vqa = args.corpus == "vqa"
    what = "--corpus vqa" if vqa else "data with images"
    unused = [
        flag
        for flag, given in (
            ("--tokenizer", args.tokenizer is not None),
            ("--chat-template", args.chat_template is not None),
            ("--train-on", args.train_on != "all_assistant"),
            ("--overlong truncate", args.overlong == "truncate"),
        )
        if given
    ]
    if unused:
        raise UsageError(
            f"{', '.join(unused)}: not offered with {what} (the family's tokenizer and image processor, "
            "--family; assistant turns trained; over-long conversations split at text boundaries, dropped or "
            "refused, never cut inside an image)"
        )

    try:
        if vqa:
            _optional._need("easy_vqa", "multimodal", "the easy-vqa corpus")
        _optional._need("PIL.Image", "multimodal", "reading images")
    except ImportError as e:
        raise UsageError(str(e)) from None
    from ..multimodal import OVER_PATCH_BUDGET, PatchBudgetError  # start-up: multimodal loads torch
    from ..offline import KnownLength, input_total, prepack  # start-up: the offline path loads torch

    # the family (a --model folder's), then the options, checked before an image is read; what fails
    # after that is the data's (exit 1)
    family, tok, processor = vlm_setup(args.model, None, args.family)
    options = _options(args, pad_multiple, images=True, limit=None if vqa else args.limit, family=family)
    reader = None
    if vqa:
        from ..multimodal import vqa_corpus  # start-up: multimodal loads torch

        # counted first (their image paths only, no pixels): the tokenize bar's total and ETA
        total = sum(1 for _ in vqa_corpus(seed=args.seed, limit=args.limit))
        conversations: Any = KnownLength(vqa_corpus(seed=args.seed, limit=args.limit), total)
        extra: dict[str, Any] = {
            "corpus": {"name": "easy-vqa", "split": "train", "seed": args.seed, "limit": args.limit}
        }
    else:
        from ..offline import check_out_outside_inputs, input_fingerprints  # start-up: the offline path loads torch

        check_out_outside_inputs(args.inputs, args.out)  # before a file is read, as for text
        reader = read_conversations(
            args.inputs, on_bad_row=args.on_bad_row, split=args.split, allow_outside_images=args.allow_outside_images
        )
        # an iterable of conversations, hashed as it streams (ids, messages); with its files' rows
        # as the tokenize bar's total
        rows = input_total(args.inputs, reader, args.limit)
        conversations = iter(reader) if rows is None else KnownLength(iter(reader), rows)
        extra = {"input_files": input_fingerprints(reader)}  # and the data files by their bytes
        if args.split is not None:
            extra["split"] = args.split
    try:
        mine = {"tokenizer": tok, "processor": processor} if args.model is not None else {}
        result = prepack(conversations, args.out, options=options, fingerprint=extra, **mine)
    except PatchBudgetError as e:  # the library names its arguments; say it in the command's flags
        raise ValueError(
            f"{e.who} has {e.patches:,} vision patches, more than --max-patches-per-row {e.max_patches_per_row:,}: no row "
            f"can hold it; raise --max-patches-per-row, or pass --overlong drop (or split) to drop it and count "
            f"it as {OVER_PATCH_BUDGET}"
        ) from None
    print(f"wrote {result.path}")
    if reader is not None and (reader.stats.dropped or reader.stats.files_skipped):
        print(render_read_stats(reader.stats))  # rows the reader dropped never reach the manifest's counts
    for line in summary_lines(result):
        print("  " + line)
    return 0


def float32_bytes(media: dict[str, Any]) -> int:
    """Bytes the float32 values of a prepack's media would take (what the stored uint8 pixels
    replace): a patch family's patches (``3 x temporal patch x patch**2`` values each), a
    fixed-size image family's ``(3, H, W)`` values (4 bytes per stored byte)."""
    proc = media["processor"]
    if "patch_size" in proc:
        return int(media["patches"]) * 3 * int(proc["temporal_patch_size"]) * int(proc["patch_size"]) ** 2 * 4
    return int(media["pixel_bytes"]) * 4
