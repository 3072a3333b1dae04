"""Image prepack at the image processor's pace: ``sftpack prepack`` with images end to end against
the Hugging Face image processor alone on the same images.

The corpus is :func:`sftpack.multimodal.vqa_corpus` (``--conversations``, seeded image sizes
56-448 px a side, PNG files). Contenders, each in its own long-lived process (corpus read,
images decoded where the contender starts from decoded images, one warm-up run done before
the first timed round), as ``bench_prepack_pace.py`` runs them::

    processor  the family's image processor (Qwen2-VL's ``Qwen2VLImageProcessorPil``, the one a
               prepack uses) called as ``processor(images=batch, return_tensors="np")`` in batches
               of 32 over every image of the corpus, already decoded and in memory (PIL, with
               the corpus's seeded resize applied): the strict yardstick, like the plain
               tokenizer on already-rendered text
    user       what a user writes without sftpack: each image read from its file
               (``load_image``: decode, the seeded resize) then the same processor calls
    prepack N  sftpack.offline.prepack(convs, out, images=True, max_seq_len=2048, num_proc=N):
               every conversation rendered, its images read and resized by the processor (what
               is stored: no patches are made), tokenized, masked, its images stored as resized
               uint8 pixels, staged, bin-packed, written, fsynced, checksummed and published
    base N     the same prepack from another source tree (``--baseline-src``), for before/after
               in one run

Rounds are interleaved (every contender once per round, the order rotated each round); each
ratio is the median over rounds of the per-round ``processor wall / prepack wall`` with its
range, beside the CPU ratio (each contender's CPU seconds, its reaped workers included) and the
load average. The prepacks of every contender must be byte-identical (checked). Absolute times
on a shared machine are under load; the ratios are the point.

    python benchmarks/bench_image_pace.py [--rounds 3] [--procs 1,2] [--conversations 300]
        [--baseline-src /tmp/base/src]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from _results import add_flag, formatted_table, write_section
from bench_prepack_pace import compared_row, machine, run_rounds, serve

BATCH = 32
MAX_SEQ_LEN = 2048


def _image_parts(convs: list[dict]) -> list[dict]:
    """Every image content part of the conversations, in order."""
    return [
        part
        for c in convs
        for m in c["messages"]
        if isinstance(m["content"], list)
        for part in m["content"]
        if part.get("type") == "image"
    ]


def _child(kind: str, procs: int, conversations: int, seed: int, workdir: Path) -> None:
    from sftpack.multimodal import family_for, load_image, vqa_corpus

    family = family_for()
    proc = family.image_processor()
    convs = list(vqa_corpus(seed=seed, limit=conversations))
    parts = _image_parts(convs)

    def patches(images: list[Any]) -> int:
        n = 0
        for i in range(0, len(images), BATCH):
            n += int(proc(images=images[i : i + BATCH], return_tensors="np")["pixel_values"].shape[0])
        return n

    if kind == "processor":
        decoded = [load_image(p) for p in parts]

        def run(k: int | None = None) -> dict[str, Any]:
            return {"images": len(decoded[:k]), "patches": patches(decoded[:k])}

    elif kind == "user":

        def run(k: int | None = None) -> dict[str, Any]:
            return {"images": len(parts[:k]), "patches": patches([load_image(p) for p in parts[:k]])}

    else:
        from sftpack.offline import prepack

        family.tokenizer()  # loaded before the workers fork, as `sftpack prepack` loads it
        out = workdir / f"{kind}_{procs}"

        def digest() -> dict[str, str]:
            h = hashlib.sha256()
            for p in sorted(out.iterdir()):
                h.update(p.name.encode() + b"\0" + p.read_bytes())
            return {"digest": h.hexdigest()}

        def run(k: int | None = None) -> dict[str, Any]:
            r = prepack(convs[:k], out, images=True, max_seq_len=MAX_SEQ_LEN, num_proc=procs, overwrite=True)
            media = r.manifest["media"]
            # the files' digest (the contenders' prepacks must be byte-identical) after the clock stops
            return {"images": int(media["images"]), "patches": int(media["patches"]), "after": digest}

    serve(run, 16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--procs", default="1,2", help="prepack process counts, comma-separated")
    ap.add_argument("--conversations", type=int, default=300, help="easy-vqa conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-src", default=None, help="a source tree (its src/ folder) to prepack with as 'base'")
    ap.add_argument("--no-user", action="store_true", help="leave out the decode + processor contender")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-procs", type=int, default=1, help=argparse.SUPPRESS)
    add_flag(ap)
    args = ap.parse_args(argv)
    if args.child is not None:
        _child(args.child, args.child_procs, args.conversations, args.seed, args.workdir)
        return 0

    tmp = tempfile.TemporaryDirectory(prefix="bench_image_pace_") if args.workdir is None else None
    args.workdir = Path(tmp.name) if tmp is not None else args.workdir
    where = machine()
    print(f"machine: {where}")
    procs = [int(p) for p in args.procs.split(",")]
    spec: list[tuple[str, str, int, str | None]] = [("processor", "processor", 1, None)]
    if not args.no_user:
        spec.append(("user", "user", 1, None))
    spec += [(f"prepack {p}", "prepack", p, None) for p in procs]
    if args.baseline_src:
        spec += [(f"base {p}", "base", p, args.baseline_src) for p in procs]
    extra = ("--conversations", str(args.conversations), "--seed", str(args.seed))
    try:
        contenders, loads = run_rounds(spec, args, script=__file__, extra=extra)
    finally:
        if tmp is not None:
            tmp.cleanup()

    by = {c.name: c for c in contenders}
    yard, user = by["processor"], by.get("user")
    counts = {c.name: {(r["images"], r["patches"]) for r in c.results} for c in contenders}
    assert all(v == counts["processor"] and len(v) == 1 for v in counts.values()), f"images differ: {counts}"
    digests = {c.name: {r["digest"] for r in c.results} for c in contenders if "digest" in c.results[0]}
    identical = len(set().union(*digests.values())) == 1
    n_img, n_patch = next(iter(counts["processor"]))

    rows = []
    for c in contenders:
        if c is yard or c is user:
            continue
        row = compared_row(c, yard, user, "yard_wall")
        row["per_image_ms"] = row["wall"] / n_img * 1e3
        rows.append(row)
    load_txt = f"load average {min(loads):.1f}-{max(loads):.1f} during the rounds"
    columns = [
        ("contender", "contender", "{}"),
        ("wall", "prepack wall s", "{:.2f}"),
        ("per_image_ms", "ms per image", "{:.2f}"),
        ("yard_wall", "processor alone wall s", "{:.2f}"),
        ("ratio", "ratio (processor / prepack)", "{:.2f}x"),
        ("ratio_min", "min", "{:.2f}x"),
        ("ratio_max", "max", "{:.2f}x"),
        ("cpu_ratio", "CPU ratio", "{:.2f}x"),
    ]
    if user is not None:
        columns += [("user_wall", "decode + processor wall s", "{:.2f}"), ("user_ratio", "ratio", "{:.2f}x")]
    table = formatted_table(rows, columns)
    met = all(r["ratio"] >= 0.8 for r in rows if r["contender"] == "prepack 1")
    summary = (
        f"{args.conversations} easy-vqa conversations (seed {args.seed}), {n_img} images, {n_patch:,} patches; "
        f"median of {args.rounds} interleaved rounds (range beside it); {load_txt}; prepacks byte-identical "
        f"across contenders: {identical}; goal ratio >= 0.80 with 1 process: {'met' if met else 'MISSED'}"
    )
    print(f"\n{table}\n\n{summary}")
    if not args.no_results:
        title = (
            "`sftpack prepack` with images (the easy-vqa corpus, rows of "
            f"{MAX_SEQ_LEN:,} tokens) end to end against the Hugging Face image processor alone "
            f"(`Qwen2VLImageProcessorPil`, the one the prepack uses, batches of {BATCH}) on the same images already "
            "decoded in memory (ratio), and against reading each image from its file and then the processor, as a "
            "user would (last column). The prepack does all of its work: decode (with the corpus's seeded resize, "
            "which the processor alone is spared), the processor's resize (the stored pixels: it makes no patches), "
            "tokenizing, packing, writing, fsync, checksums, the tokenizer's fingerprint. Each contender runs warm in "
            "its own "
            f"process. {summary}. Absolute times are under the load given (the machine is shared); the ratios, "
            "measured side by side, are the point."
        )
        write_section(__file__, table, f"{where}; {load_txt}", title=title)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
