"""Reading prepacked rows with images: what storing resized uint8 pixels costs and saves.

A prepack of ``--conversations`` easy-vqa conversations (:func:`sftpack.offline.prepack` with ``images=True``,
rows of ``--max-seq-len``, seeded image sizes 56-448 px a side) is read three ways, in
one interleaved run (the three alternate row by row, every round; medians over
``--rounds``), page cache warm (the files are read once before timing):

- **text only**: the same rows (the same tokens, the same row membership) written as a
  text prepack (:func:`sftpack.offline.prepack_samples` with the rows kept) and read with
  ``PrepackedDataset.row``: the row without its images;
- **uint8 pixels (stored)**: ``PrepackedDataset.row`` on the prepack with images: the row
  plus its images patchified from the stored resized pixels, MRoPE positions recomputed
  per sample (what the offline path reads);
- **float32 patches**: the same rows built from float32 patches stored in row order in a
  plain ``.npy`` (the alternative format: the row's memory-mapped slice copied once into its
  ``pixel_values``), through the same row builder.

Reported: rows/s, MB/s of stored bytes read (tokens, mask and the media the row needs),
and the ratio to text only. Then bytes on disk per image for each format, the share of a
row read spent recomputing the MRoPE positions (``mrope_positions`` per sample, against the
whole read), and image work against tokenizing per conversation (decode, the processor's
resize, patchify from pixels (the read side), the whole processor call, and tokenizing
the ChatML text; alternating conversation by conversation).

Usage::

    python benchmarks/bench_media_read.py                    # writes its RESULTS.md section
    python benchmarks/bench_media_read.py --conversations 40 --rounds 2 --no-results
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section


def machine() -> str:
    import torch
    import transformers

    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}; "
        f"load average {load_average():.1f} at start"
    )


def build(convs: list[dict], root: Path, max_seq_len: int) -> tuple[Any, Any, np.memmap, np.ndarray]:
    """The prepack with images, the text-only prepack of the same rows, and the float32 patches
    of every image in row order (a memmap) with each image's offset (in patches)."""
    from sftpack import Sample
    from sftpack.multimodal._images import patchify_pixels
    from sftpack.offline import PrepackedDataset, prepack, prepack_samples

    mm = prepack(convs, root / "media", images=True, max_seq_len=max_seq_len)
    ds = PrepackedDataset(mm.path)
    text: list[list[Sample]] = []
    for r in range(ds.num_rows):
        ids, mask, seqs = ds.row_arrays(r)
        o, row = 0, []
        for rec in seqs:
            n = int(rec["length"])
            row.append(Sample(np.asarray(ids[o : o + n], np.int64), np.asarray(mask[o : o + n]), "x"))
            o += n
        text.append(row)
    tx = prepack_samples(
        [s for row in text for s in row],
        root / "text",
        max_seq_len=max_seq_len,
        row_sizes=[len(r) for r in text],
        pad_id=ds.pad_id,
        vocab_size=ds.manifest["vocab_size"],
    )
    media = ds.media
    assert media is not None
    im = media.images
    per = (im["grid_h"].astype(np.int64) * im["grid_w"]).tolist()
    off = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    f32 = np.lib.format.open_memmap(root / "patches_f32.npy", "w+", np.float32, (int(off[-1]), media.patch_dim))
    for k, rec in enumerate(im):
        a, h, w = int(rec["pixels"]), int(rec["height"]), int(rec["width"])
        patchify_pixels(media.pixels[a : a + h * w * 3].reshape(h, w, 3), media.processor, out=f32[off[k] : off[k + 1]])
    f32.flush()
    return ds, PrepackedDataset(tx.path), np.load(root / "patches_f32.npy", mmap_mode="r"), off


def read_f32_row(ds: Any, r: int, f32: np.ndarray, off: np.ndarray) -> Any:
    """Row ``r`` built from stored float32 patches (the alternative format) with the same builder."""
    import torch

    from sftpack import PackedBatch, Sample
    from sftpack.handoff.payload import PatchMedia
    from sftpack.multimodal.families.qwen2_vl import mrope_positions

    media = ds.media
    ids, mask, seqs = ds.row_arrays(r)
    i = int(media.row_images[r])
    first = int(ds.rows[r]["sequence"])
    owner = media.images["sequence"]
    samples, t = [], 0
    for j, rec in enumerate(seqs):
        n = int(rec["length"])
        k = i
        while k < int(media.row_images[r + 1]) and int(owner[k]) == first + j:
            k += 1
        mine = media.images[i:k]
        grids = np.stack([mine["grid_t"], mine["grid_h"], mine["grid_w"]], axis=1).astype(np.int64).reshape(-1, 3)
        runs = np.stack([mine["start"].astype(np.int64), grids.prod(axis=1) // 4], axis=1).reshape(-1, 2)
        payload = PatchMedia(
            pixel_values=np.empty((int(grids.prod(axis=1).sum()), 0), np.float32),  # shapes only
            slots=runs,
            sequence=np.zeros(len(runs), np.int64),
            token_id=151655,
            grid_thw=grids,
            merge_size=2,
            positions=mrope_positions(n, runs, grids, 2),
        )
        samples.append(
            Sample(
                np.asarray(ids[t : t + n], np.int64),
                np.asarray(mask[t : t + n], bool),
                ds.conversation_id(int(rec["conversation"])),
                media=payload,
            )
        )
        t, i = t + n, k
    row = PackedBatch.from_samples(samples, row_width=ds.max_seq_len, pad_multiple=ds.pad_multiple, pad_id=ds.pad_id)
    a, b = int(media.row_images[r]), int(media.row_images[r + 1])
    # the one copy a reader makes of the mapped patches, as the stored format's reader patchifies once
    pixels = torch.from_numpy(np.array(f32[off[a] : off[b]]))
    return dataclasses.replace(row, media=dataclasses.replace(row.media, pixel_values=pixels))


def read_table(ds: Any, tx: Any, f32: np.ndarray, off: np.ndarray, rounds: int) -> tuple[list[dict], dict]:
    rows = list(range(ds.num_rows))
    media = ds.media
    tok_bytes = (np.diff(ds.rows["token"]) * (ds.tokens.itemsize + 1)).astype(np.int64)
    img_per_row = [(int(media.row_images[r]), int(media.row_images[r + 1])) for r in rows]
    px_bytes = np.array([int((media.images[a:b]["height"].astype(np.int64) * media.images[a:b]["width"] * 3).sum())
                         for a, b in img_per_row])  # fmt: skip
    f32_bytes = np.array([int(off[b] - off[a]) * media.patch_dim * 4 for a, b in img_per_row])
    stored = {
        "text only": tok_bytes,
        "uint8 pixels (stored)": tok_bytes + px_bytes,
        "float32 patches": tok_bytes + f32_bytes,
    }
    readers = {
        "text only": lambda r: tx.row(r),
        "uint8 pixels (stored)": lambda r: ds.row(r),
        "float32 patches": lambda r: read_f32_row(ds, r, f32, off),
    }
    for r in rows:  # warm: page cache, compiled paths, the processor's table
        for f in readers.values():
            f(r)
    per_round: dict[str, list[float]] = {k: [] for k in readers}
    rope_share: list[float] = []
    loads = []
    from sftpack.multimodal.families.qwen2_vl import mrope_positions

    for k in range(rounds):
        tot = dict.fromkeys(readers, 0.0)
        rope_t = 0.0
        names = list(readers)
        names = names[k % 3 :] + names[: k % 3]  # who goes first rotates
        for r in rows:
            for name in names:
                t0 = time.perf_counter()
                readers[name](r)
                tot[name] += time.perf_counter() - t0
            ids, mask, seqs = ds.row_arrays(r)
            samples = media.samples(r, int(ds.rows[r]["sequence"]), ids, mask, seqs, ["x"] * len(seqs))
            t0 = time.perf_counter()
            for s in samples:  # the multimodal positions, as the stored format's reader computes them
                m = s.media
                mrope_positions(len(s), m.slots.numpy(), m.grid_thw.numpy(), m.merge_size)
            rope_t += time.perf_counter() - t0
        for name, v in tot.items():
            per_round[name].append(v)
        rope_share.append(rope_t / tot["uint8 pixels (stored)"])
        loads.append(load_average())
    med = {k: statistics.median(v) for k, v in per_round.items()}
    out = []
    for name in readers:
        out.append(
            {
                "reader": name,
                "rows_s": len(rows) / med[name],
                "mb_s": stored[name].sum() / med[name] / 1e6,
                "kb_row": stored[name].mean() / 1e3,
                "vs_text": med[name] / med["text only"],
                "load": statistics.median(loads),
            }
        )
    return out, {"rope_share": statistics.median(rope_share), "load": statistics.median(loads)}


READ_COLUMNS = [
    ("reader", "reader", "{}"),
    ("rows_s", "rows/s", "{:,.0f}"),
    ("mb_s", "MB/s of stored bytes", "{:,.1f}"),
    ("kb_row", "stored KB a row", "{:,.1f}"),
    ("vs_text", "time x text only", "{:.2f}"),
    ("load", "load", "{:.1f}"),
]


def disk_table(ds: Any) -> list[dict]:
    m = ds.manifest["media"]
    n = m["images"]
    files = ds.manifest["files"]
    index = files["images.npy"]["bytes"] + files["row_images.npy"]["bytes"]
    f32 = m["patches"] * ds.media.patch_dim * 4
    return [
        {"format": "uint8 resized pixels + grid (stored)", "per_image": (m["pixel_bytes"] + index) / n, "total_mb": (m["pixel_bytes"] + index) / 1e6},
        {"format": "float32 patches (processor output)", "per_image": f32 / n, "total_mb": f32 / 1e6},
        {"format": "ratio float32 / uint8", "per_image": f32 / (m["pixel_bytes"] + index), "total_mb": float("nan")},
    ]  # fmt: skip


DISK_COLUMNS = [
    ("format", "format", "{}"),
    ("per_image", "bytes per image", "{:,.1f}"),
    ("total_mb", "total MB", "{:,.2f}"),
]


def cost_table(convs: list[dict], rounds: int) -> list[dict]:
    from sftpack.multimodal import family_for, load_image
    from sftpack.multimodal._images import patchify_pixels, resize_image
    from sftpack.multimodal._tokenize import _render

    family = family_for()
    tok, proc = family.tokenizer(), family.image_processor()
    rendered = [(r.text, r.images) for r in (_render(c["messages"], c["id"], family.image_block) for c in convs)]
    n_img = sum(len(parts) for _, parts in rendered)
    stages = ("decode", "resize", "patchify", "processor", "tokenize")
    per_round: dict[str, list[float]] = {k: [] for k in stages}
    loads = []
    for _ in range(rounds):
        tot = dict.fromkeys(stages, 0.0)
        for text, parts in rendered:
            t0 = time.perf_counter()
            imgs = [load_image(p) for p, _ in parts]
            t1 = time.perf_counter()
            pixels = [resize_image(im, proc) for im in imgs]
            t2 = time.perf_counter()
            for px in pixels:
                patchify_pixels(px, proc)
            t3 = time.perf_counter()
            if imgs:
                proc(images=imgs, return_tensors="np")
            t4 = time.perf_counter()
            tok(text, add_special_tokens=False, return_offsets_mapping=True)
            t5 = time.perf_counter()
            for k, (a, b) in zip(stages, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
                tot[k] += b - a
        for k, v in tot.items():
            per_round[k].append(v)
        loads.append(load_average())
    med = {k: statistics.median(v) for k, v in per_round.items()}
    names = {
        "decode": "decode + seeded resize (load_image, PIL)",
        "resize": "processor resize (smart_resize, bicubic): what is stored",
        "patchify": "patchify from stored pixels (the read side)",
        "processor": "the whole processor call (resize, normalise, patchify)",
        "tokenize": "tokenize the ChatML text",
    }
    return [
        {
            "stage": names[k],
            "per_image_us": med[k] / n_img * 1e6 if k != "tokenize" else float("nan"),
            "per_conv_us": med[k] / len(convs) * 1e6,
            "vs_tok": med[k] / med["tokenize"],
            "load": statistics.median(loads),
        }
        for k in stages
    ]


COST_COLUMNS = [
    ("stage", "stage", "{}"),
    ("per_image_us", "per image (us)", "{:,.0f}"),
    ("per_conv_us", "per conversation (us)", "{:,.0f}"),
    ("vs_tok", "x tokenizing", "{:.2f}"),
    ("load", "load", "{:.1f}"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    add_flag(ap)
    args = ap.parse_args()

    import torch

    from sftpack.multimodal import vqa_corpus

    torch.set_num_threads(1)
    where = machine()
    print(f"machine: {where}")
    convs = list(vqa_corpus(seed=args.seed, limit=args.conversations))
    with tempfile.TemporaryDirectory() as tmp:
        ds, tx, f32, off = build(convs, Path(tmp), args.max_seq_len)
        m = ds.manifest
        corpus = (
            f"{len(convs)} easy-vqa conversations (seed {args.seed}), {m['counts']['sequences']} samples, "
            f"{m['media']['images']} images, {m['media']['patches']:,} patches, {ds.num_rows} rows of {args.max_seq_len}"
        )
        print(corpus)
        reads, extra = read_table(ds, tx, f32, off, args.rounds)
        t_read = formatted_table(reads, READ_COLUMNS)
        print(f"\n(a) reading rows, interleaved, medians over {args.rounds} rounds\n{t_read}")
        t_disk = formatted_table(disk_table(ds), DISK_COLUMNS)
        print(f"\n(b) bytes on disk per image\n{t_disk}")
        del ds, tx, f32
    rope = f"MRoPE positions recomputed per sample on read: {extra['rope_share']:.1%} of a row read (load {extra['load']:.1f})"
    print(f"\n{rope}")
    costs = cost_table(convs[: min(len(convs), 100)], args.rounds)
    t_cost = formatted_table(costs, COST_COLUMNS)
    print(f"\n(c) image work vs tokenizing, interleaved per conversation, medians over {args.rounds} rounds\n{t_cost}")
    if not args.no_results:
        body = (
            f"{corpus}; page cache warm, one torch thread.\n\n"
            "(a) Reading rows (`PrepackedDataset.row`), the three readers alternating row by row every round "
            "(medians): text only (the same rows without images), the stored format (resized uint8 pixels "
            "patchified on read), and float32 patches stored in row order (the row's mapped slice copied once), "
            "all through the same row builder. MB/s counts the stored bytes a row needs (tokens, mask, media).\n\n"
            f"{t_read}\n\n{rope}.\n\n(b) Bytes on disk per image (the stored format includes its index records).\n\n"
            f"{t_disk}\n\n(c) Image work against tokenizing the text, per conversation (stages alternate "
            f"conversation by conversation; medians over {args.rounds} rounds).\n\n{t_cost}\n"
        )
        write_section(__file__, body, where, title="bench_media_read.py: reading prepacked rows with images")


if __name__ == "__main__":
    main()
