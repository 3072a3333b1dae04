"""Reading prepacked rows with images: what storing resized uint8 pixels costs and saves.

A prepack of ``--conversations`` easy-vqa conversations (:func:`sftpack.offline.prepack` with ``images=True``,
rows of ``--max-seq-len``, seeded image sizes 56-448 px a side) is read in batches of ``--batch``
rows (a seeded shuffle of the rows, cut in batches) four ways, in one interleaved run (the
readers alternate batch by batch, every round, who goes first rotating; medians over
``--rounds``), page cache warm and every reader run once over every batch before timing:

- **text only**: the same rows (the same tokens, the same row membership) written as a
  text prepack (:func:`sftpack.offline.prepack_samples` with the rows kept) and read with
  ``PrepackedDataset.read_rows``: the rows without their images;
- **uint8 pixels (stored), read_rows**: ``PrepackedDataset.read_rows`` on the prepack with
  images: the rows plus their media (each sequence's by the family, MRoPE positions
  included), every image of the batch patchified from its stored resized pixels into the
  batch's one buffer (what the offline path reads);
- **float32 patches, same reader**: the same batch reader with the patches copied from
  float32 patches stored in row order in a plain ``.npy`` (the alternative format: each
  image's memory-mapped slice copied once into the batch's ``pixel_values``) instead of
  patchified; its batches are checked byte-identical to the stored format's;
- **uint8 pixels, one row at a time**: ``PrepackedDataset.row`` per row, then
  ``PackedBatch.concat`` (what a reader without the batched path pays).

Reported: rows/s, MB/s of stored bytes read (tokens, mask and the media the rows need),
the time against text only and the speed against float32 patches (goal: the stored format
at >= 0.5x). Then bytes on disk per image for each format, the share of a batch read spent
laying the media without its pixels (each sequence's media by the family, MRoPE positions
included), and image work against tokenizing per conversation (decode, the processor's
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
            row.append(
                Sample(
                    np.asarray(ids[o : o + n], np.int64),
                    np.asarray(mask[o : o + n]),
                    ds.conversation_id(int(rec["conversation"])),
                )
            )
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


def read_f32_batch(ds: Any, tx: Any, rows: np.ndarray, f32: np.ndarray, off: np.ndarray) -> Any:
    """Global ``rows`` read by the same batch reader, the patches copied from stored float32 patches
    (the alternative format) instead of patchified: the text fields from the text prepack of the same
    rows (the same compiled pass), the media laid by the same ``MediaReader.lay_rows``."""
    batch = tx.read_rows(rows)
    media = ds.media
    idx = media.image_range(rows)
    n = off[idx + 1] - off[idx]
    pixels = np.empty((int(n.sum()), media.patch_dim), np.float32)
    o = 0
    for a, k in zip(off[idx].tolist(), n.tolist()):  # the one copy a reader makes of the mapped patches
        pixels[o : o + k] = f32[a : a + k]
        o += k
    laid = media.lay_rows(
        rows,
        ds.rows["sequence"],
        batch.input_ids.numpy(),
        batch.cu_seqlens.numpy(),
        batch.cu_seqlens_padded.numpy(),
        pixel_values=pixels,
    )
    return dataclasses.replace(batch, media=laid)


def _same(a: Any, b: Any) -> bool:
    """Two batches equal field for field (their media's too), byte for byte."""
    import torch

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and bool(torch.equal(x, y))
        return x == y

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "media":
            if not all(same(getattr(x, g.name), getattr(y, g.name)) for g in dataclasses.fields(x)):
                return False
        elif not same(x, y):
            return False
    return True


READERS = (
    "text only, read_rows",
    "uint8 pixels (stored), read_rows",
    "float32 patches, same reader",
    "uint8 pixels, one row at a time",
)


def read_table(
    ds: Any, tx: Any, f32: np.ndarray, off: np.ndarray, rounds: int, batch: int, seed: int
) -> tuple[list[dict], dict]:
    from sftpack import PackedBatch

    order = np.random.default_rng(seed).permutation(ds.num_rows)
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]
    media = ds.media
    tok_bytes = (np.diff(ds.rows["token"]) * (ds.tokens.itemsize + 1)).astype(np.int64)
    img_per_row = [(int(media.row_images[r]), int(media.row_images[r + 1])) for r in range(ds.num_rows)]
    px_bytes = np.array([int((media.images[a:b]["height"].astype(np.int64) * media.images[a:b]["width"] * 3).sum())
                         for a, b in img_per_row])  # fmt: skip
    f32_bytes = np.array([int(off[b] - off[a]) * media.patch_dim * 4 for a, b in img_per_row])
    stored = {
        READERS[0]: tok_bytes,
        READERS[1]: tok_bytes + px_bytes,
        READERS[2]: tok_bytes + f32_bytes,
        READERS[3]: tok_bytes + px_bytes,
    }
    readers = {
        READERS[0]: lambda rows: tx.read_rows(rows),
        READERS[1]: lambda rows: ds.read_rows(rows),
        READERS[2]: lambda rows: read_f32_batch(ds, tx, rows, f32, off),
        READERS[3]: lambda rows: PackedBatch.concat([ds.row(int(r)) for r in rows]),
    }
    for rows in batches:  # warm: page cache, compiled paths, the processor's table; and the sanity
        got = {name: f(rows) for name, f in readers.items()}
        assert _same(got[READERS[1]], got[READERS[2]]) and _same(got[READERS[1]], got[READERS[3]])
    per_round: dict[str, list[float]] = {k: [] for k in readers}
    lay_share: list[float] = []
    loads = []
    names = list(readers)
    for k in range(rounds):
        tot = dict.fromkeys(readers, 0.0)
        lay_t = 0.0
        for j, rows in enumerate(batches):
            turn = (k + j) % len(names)
            for name in names[turn:] + names[:turn]:  # who goes first rotates
                t0 = time.perf_counter()
                readers[name](rows)
                tot[name] += time.perf_counter() - t0
            b = tx.read_rows(rows)
            no_pixels = np.empty((0, 0), np.float32)
            t0 = time.perf_counter()  # the media laid without its pixels: each sequence's by the family
            media.lay_rows(rows, ds.rows["sequence"], b.input_ids.numpy(), b.cu_seqlens.numpy(),
                           b.cu_seqlens_padded.numpy(), pixel_values=no_pixels)  # fmt: skip
            lay_t += time.perf_counter() - t0
        for name, v in tot.items():
            per_round[name].append(v)
        lay_share.append(lay_t / tot[READERS[1]])
        loads.append(load_average())
    med = {k: statistics.median(v) for k, v in per_round.items()}
    out = []
    for name in readers:
        out.append(
            {
                "reader": name,
                "rows_s": ds.num_rows / med[name],
                "mb_s": stored[name].sum() / med[name] / 1e6,
                "kb_row": stored[name].mean() / 1e3,
                "vs_text": med[name] / med[READERS[0]],
                "vs_f32": statistics.median(f / t for f, t in zip(per_round[READERS[2]], per_round[name])),
                "load": statistics.median(loads),
            }
        )
    return out, {"lay_share": statistics.median(lay_share), "load": statistics.median(loads)}


READ_COLUMNS = [
    ("reader", "reader", "{}"),
    ("rows_s", "rows/s", "{:,.0f}"),
    ("mb_s", "MB/s of stored bytes", "{:,.1f}"),
    ("kb_row", "stored KB a row", "{:,.1f}"),
    ("vs_text", "time x text only", "{:.2f}"),
    ("vs_f32", "speed x float32 patches", "{:.2f}x"),
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


def _chatml(messages: list[dict], tok: Any, block: str) -> tuple[str, list[dict]]:
    """The conversation's ChatML text, each image part written as the family's image block (one
    placeholder, as before the processor expands it), and its image parts in order."""
    plain, parts = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts += [p for p in content if p.get("type") == "image"]
            content = "".join(block if p.get("type") == "image" else p.get("text", "") for p in content)
        plain.append({"role": m["role"], "content": content})
    return tok.apply_chat_template(plain, tokenize=False), parts


def cost_table(convs: list[dict], rounds: int) -> list[dict]:
    from sftpack.multimodal import family_for, load_image
    from sftpack.multimodal._images import patchify_pixels, resize_image

    family = family_for()
    tok, proc = family.tokenizer(), family.image_processor()
    rendered = [_chatml(c["messages"], tok, "".join(family.image_block)) for c in convs]
    n_img = sum(len(parts) for _, parts in rendered)
    stages = ("decode", "resize", "patchify", "processor", "tokenize")
    per_round: dict[str, list[float]] = {k: [] for k in stages}
    loads = []
    for _ in range(rounds):
        tot = dict.fromkeys(stages, 0.0)
        for text, parts in rendered:
            t0 = time.perf_counter()
            imgs = [load_image(p) for p in parts]
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
    ap.add_argument("--batch", type=int, default=4, help="rows per read_rows call in (a)")
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
        reads, extra = read_table(ds, tx, f32, off, args.rounds, args.batch, args.seed)
        t_read = formatted_table(reads, READ_COLUMNS)
        print(
            f"\n(a) reading rows in batches of {args.batch}, interleaved, medians over {args.rounds} rounds\n{t_read}"
        )
        t_disk = formatted_table(disk_table(ds), DISK_COLUMNS)
        print(f"\n(b) bytes on disk per image\n{t_disk}")
        del ds, tx, f32
    goal = next(r["vs_f32"] for r in reads if r["reader"] == READERS[1])
    rope = (
        f"Media laid without their pixels (each sequence's by the family, MRoPE positions included): "
        f"{extra['lay_share']:.1%} of a batch read (load {extra['load']:.1f}). Goal: the stored format at >= 0.5x "
        f"the speed of float32 patches in batches: {goal:.2f}x, {'met' if goal >= 0.5 else 'MISSED'}"
    )
    print(f"\n{rope}")
    costs = cost_table(convs[: min(len(convs), 100)], args.rounds)
    t_cost = formatted_table(costs, COST_COLUMNS)
    print(f"\n(c) image work vs tokenizing, interleaved per conversation, medians over {args.rounds} rounds\n{t_cost}")
    if not args.no_results:
        body = (
            f"{corpus}; page cache warm, one torch thread.\n\n"
            f"(a) Reading rows in batches of {args.batch} (a seeded shuffle of the rows), the four readers "
            "alternating batch by batch every round, who goes first rotating (medians): text only (the same rows "
            "without images, `read_rows`), the stored format (`read_rows`: resized uint8 pixels patchified into "
            "the batch's buffer), float32 patches stored in row order read by the same batch reader (each image's "
            "mapped slice copied once; its batches checked byte-identical to the stored format's), and the "
            "stored format one row at a time (`row`, then `PackedBatch.concat`). MB/s counts the stored bytes the "
            "rows need (tokens, mask, media); speed x float32 is the median of per-round ratios. Absolute times are "
            "under the load given (a shared machine); the ratios, measured side by side, are the point.\n\n"
            f"{t_read}\n\n{rope}.\n\n(b) Bytes on disk per image (the stored format includes its index records).\n\n"
            f"{t_disk}\n\n(c) Image work against tokenizing the text, per conversation (stages alternate "
            f"conversation by conversation; medians over {args.rounds} rounds).\n\n{t_cost}\n"
        )
        write_section(__file__, body, where, title="bench_media_read.py: reading prepacked rows with images")


if __name__ == "__main__":
    main()
