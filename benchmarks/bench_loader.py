"""Benchmark: the loader path (PackingDataset) against offline BFD and an unpacked loader.

1. Fill (real tokens / slots) against buffer size 16 ... 8192, on
   - the embedded corpus (chitchat, ChatML, Qwen tokenizer; tokenized once with
     ``sftpack.chat.tokenize_conversations``, over-long conversations split) at 4,096;
   - lengths drawn (seeded) from the Graphcore Wikipedia histogram
     (``benchmarks/data/wikipedia_512.csv``) at 512;
   each against offline BFD (``sftpack.binpack.pack``) on the whole set, for
   ``max_wait=0`` (each buffer packed whole: Energon's rule) and the default
   ``max_wait=2``. Curve: ``docs/loader_fill.png``.
2. Overhead per row: ``PackingDataset`` through a ``DataLoader`` against an
   unpacked ``DataLoader`` of the same samples (one sample per row, padded to
   ``max_seq_len`` by the same row builder, ``build_row``: the yardstick of the
   goal), and against a plain unpacked collate with no sftpack code (pad, shift
   the labels: the least any unpacked loader does), interleaved, medians. Like
   with like: the same ``Sample`` objects, ``batch_size=None``, ``num_workers=0``,
   each side yields a ``PackedBatch`` of the contract's layout and checks each
   token id once (the unpacked side in ``build_row``, the loader on its laid
   row); every variant runs once untimed first. Beside the wall-clock ratio
   (the goal's figure: median per-row times of the two sides) the median of the
   per-round ratios and the ratio of CPU time (``time.process_time``, less
   sensitive to other processes on a loaded machine) are given.
3. Resume cost: time from ``load_state_dict`` to the first row, mid-epoch.

    python benchmarks/bench_loader.py [--wiki-samples 100000] [--rounds 5]

Writes ``benchmarks/out/bench_loader.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, markdown_table, write_section
from sftpack.binpack import pack
from sftpack.handoff import Sample, build_row, padded_lengths
from sftpack.handoff.build import build_parts
from sftpack.loader import PackingDataset

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
BUFFERS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def corpus_lengths(max_seq_len: int = 4096) -> np.ndarray:
    """Token lengths of the embedded corpus, rendered and masked by sftpack.chat (cached)."""
    cache = OUT / f"loader_corpus_lengths_{max_seq_len}.npy"
    if cache.exists():
        return np.load(cache)
    from sftpack.chat import tokenize_conversations
    from sftpack.data import default_corpus, default_tokenizer

    out = tokenize_conversations(default_corpus(), default_tokenizer(), max_seq_len=None)
    lengths = np.array([len(s) for s in out], dtype=np.int64)
    OUT.mkdir(parents=True, exist_ok=True)
    np.save(cache, lengths)
    return lengths


def wikipedia_lengths(n: int, seed: int = 0) -> np.ndarray:
    data = np.loadtxt(HERE / "data" / "wikipedia_512.csv", delimiter=",", skiprows=1, dtype=np.int64)
    p = data[:, 1] / data[:, 1].sum()
    return np.random.default_rng(seed).choice(data[:, 0], size=n, p=p)


def samples_of(lengths: np.ndarray) -> list[Sample]:
    return [Sample(np.full(int(n), 7, dtype=np.int64), np.ones(int(n), dtype=bool), i) for i, n in enumerate(lengths)]


def offline_fill(lengths: np.ndarray, width: int) -> float:
    pieces = np.concatenate([np.full(n // width, width) for n in lengths] + [lengths % width])
    pieces = pieces[pieces > 0]
    return float(pieces.sum()) / (len(pack(padded_lengths(pieces, 1), width)) * width)


def fill_curve(name: str, lengths: np.ndarray, width: int) -> list[dict]:
    samples = samples_of(lengths)
    off = offline_fill(lengths, width)
    rows = []
    for b in BUFFERS:  # a buffer as large as the set packs it whole: offline BFD's rows
        row = {
            "dataset": name,
            "max_seq_len": width,
            "samples": len(samples),
            "buffer_size": b,
            "offline_bfd_fill": round(off, 6),
        }
        for w in (0, 2):
            ds = PackingDataset(samples, max_seq_len=width, buffer_size=b, max_wait=w)
            t0 = time.perf_counter()
            n = sum(1 for _ in ds)
            dt = time.perf_counter() - t0
            row[f"fill_wait{w}"] = round(ds.stats.fill, 6)
            row[f"gap_wait{w}_pct"] = round(100 * (off - ds.stats.fill) / off, 3)
            row[f"rows_wait{w}"] = n
            row[f"us_per_row_wait{w}"] = round(1e6 * dt / n, 1)
        rows.append(row)
        print(
            f"{name:10} {width:5} {b:6} {off * 100:8.3f} {row['fill_wait0'] * 100:9.3f} {row['fill_wait2'] * 100:9.3f} "
            f"{row['gap_wait2_pct']:8.3f} {row['us_per_row_wait2']:9.1f}"
        )
    return rows


def plain_unpacked_row(s: Sample, width: int) -> dict[str, torch.Tensor]:
    """An unpacked row with no sftpack code: the sample padded to ``width``, labels shifted
    within it, positions 0..width-1 (what a minimal padded collate computes)."""
    n = len(s)
    ids = np.zeros(width, dtype=np.int64)
    ids[:n] = s.input_ids
    labels = np.full(width, -100, dtype=np.int64)
    np.copyto(labels[: n - 1], ids[1:n], where=s.loss_mask[1:])
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.arange(width),
        "cu_seqlens": torch.tensor([0, n], dtype=torch.int32),
    }


def overhead(lengths: np.ndarray, width: int, rounds: int) -> dict:
    samples = samples_of(np.minimum(lengths, width))

    def unpacked(s: Sample):
        return build_row(s.input_ids, s.loss_mask, [len(s)], row_width=width)

    def run_packed() -> tuple[float, int]:
        t0 = time.perf_counter()
        n = sum(
            1
            for _ in DataLoader(
                PackingDataset(samples, max_seq_len=width, buffer_size=256), batch_size=None, num_workers=0
            )
        )
        return time.perf_counter() - t0, n

    def run_unpacked() -> tuple[float, int]:
        t0 = time.perf_counter()
        n = sum(1 for _ in DataLoader(samples, batch_size=None, num_workers=0, collate_fn=unpacked))
        return time.perf_counter() - t0, n

    def run_plain() -> tuple[float, int]:
        t0 = time.perf_counter()
        n = sum(
            1
            for _ in DataLoader(
                samples, batch_size=None, num_workers=0, collate_fn=lambda s: plain_unpacked_row(s, width)
            )
        )
        return time.perf_counter() - t0, n

    # The loader's row builder alone (build_parts, each sample's own arrays) on the packed
    # rows' sequences: the part of a packed row's cost that is laying the row.
    parts = []
    for r in PackingDataset(samples, max_seq_len=width, buffer_size=256):
        cu, cup, ids = r.cu_seqlens.tolist(), r.cu_seqlens_padded.tolist(), r.input_ids.numpy()
        seqs = [ids[cup[i] : cup[i] + cu[i + 1] - cu[i]].copy() for i in range(r.num_sequences)]
        parts.append((seqs, [np.ones(len(q), dtype=bool) for q in seqs], [len(q) for q in seqs], r.sequence_ids))

    def run_builder() -> tuple[float, int]:
        t0 = time.perf_counter()
        for seqs, masks, lens, sids in parts:
            build_parts(seqs, masks, lens, row_width=width, sequence_ids=sids)
        return time.perf_counter() - t0, len(parts)

    def cpu(run):  # the run's wall time per row, and the process's CPU time per row
        c0 = time.process_time()
        dt, n = run()
        return dt / n, (time.process_time() - c0) / n, n

    for run in (run_packed, run_unpacked, run_plain, run_builder):  # each warmed once, none timed cold
        run()
    tp, tu, tq, tb, cp, cu = [], [], [], [], [], []
    for _ in range(rounds):  # interleaved, so a busy machine slows all four alike
        (a, ca, np_), (b, cb, nu) = cpu(run_packed), cpu(run_unpacked)
        (q, nq), (c, nb) = run_plain(), run_builder()
        tp.append(a)
        tu.append(b)
        cp.append(ca)
        cu.append(cb)
        tq.append(q / nq)
        tb.append(c / nb)
    per_p, per_u, per_q, per_b = (float(np.median(t)) for t in (tp, tu, tq, tb))
    ratios = [a / b for a, b in zip(tp, tu)]
    cpu_ratios = [a / b for a, b in zip(cp, cu)]
    real = float(lengths.clip(max=width).sum())
    return {
        "packed_rows": np_,
        "unpacked_rows": nu,
        "us_per_packed_row": round(1e6 * per_p, 1),
        "us_per_unpacked_row": round(1e6 * per_u, 1),
        "ratio_per_row": round(per_p / per_u, 3),
        "ratio_per_row_min_max": f"{min(ratios):.3f}-{max(ratios):.3f}",
        "ratio_per_row_median_of_rounds": round(float(np.median(ratios)), 3),
        "ratio_per_row_cpu_time": round(float(np.median(cp)) / float(np.median(cu)), 3),
        "ratio_per_row_cpu_time_min_max": f"{min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}",
        "us_per_plain_unpacked_row": round(1e6 * per_q, 1),
        "ratio_per_row_vs_plain": round(per_p / per_q, 3),
        "us_build_parts_per_packed_row": round(1e6 * per_b, 1),
        "us_loader_own_per_row": round(1e6 * (per_p - per_b), 1),
        "ns_per_real_token_packed": round(1e9 * per_p * np_ / real, 2),
        "ns_per_real_token_unpacked": round(1e9 * per_u * nu / real, 2),
        "ratio_per_real_token": round((per_p * np_) / (per_u * nu), 3),
    }


def resume_cost(lengths: np.ndarray, width: int) -> dict:
    samples = samples_of(lengths)
    kw = {"max_seq_len": width, "buffer_size": 1024}
    out = {}
    for kind, src in (("map-style", samples), ("iterable", _Stream(samples))):
        ds = PackingDataset(src, **kw)
        it = iter(ds)
        for _ in range(ds_rows_half(samples, width)):
            next(it)
        state = ds.state_dict()
        t0 = time.perf_counter()
        fresh = PackingDataset(src, **kw)
        fresh.load_state_dict(state)
        next(iter(fresh))
        out[f"resume_ms_{kind}"] = round(1e3 * (time.perf_counter() - t0), 2)
        t0 = time.perf_counter()
        next(iter(PackingDataset(src, **kw)))
        out[f"first_row_ms_{kind}"] = round(1e3 * (time.perf_counter() - t0), 2)
        out["state_buffer_entries"] = len(state["buffer"])
        out["state_pending_rows"] = len(state["pending"])
    return out


def ds_rows_half(samples: list[Sample], width: int) -> int:
    return int(sum(len(s) for s in samples) / width / 2)


class _Stream:
    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {"corpus": "#4C72B0", "wikipedia": "#DD8452"}
    for name in dict.fromkeys(r["dataset"] for r in rows):
        rs = [r for r in rows if r["dataset"] == name]
        b = [r["buffer_size"] for r in rs]
        label = f"{name} @ {rs[0]['max_seq_len']}"
        ax.plot(b, [100 * r["fill_wait2"] for r in rs], "o-", color=colours.get(name), label=f"{label}, max_wait=2")
        ax.plot(
            b,
            [100 * r["fill_wait0"] for r in rs],
            "s--",
            color=colours.get(name),
            alpha=0.6,
            label=f"{label}, max_wait=0 (Energon rule)",
        )
        ax.axhline(
            100 * rs[0]["offline_bfd_fill"],
            color=colours.get(name),
            lw=0.8,
            ls=":",
            label=f"{label}, offline BFD on the whole set",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer size (samples per worker)")
    ax.set_ylabel("fill: real tokens / slots (%)")
    ax.set_title("sftpack loader path: fill against buffer size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wiki-samples", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--png", default=str(HERE.parent / "docs" / "loader_fill.png"))
    add_flag(ap)
    args = ap.parse_args(argv)
    machine = (
        f"{cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}; 1-min load average at start {load_average():.2f}"
    )
    print(f"machine: {machine}")
    corpus = corpus_lengths()
    wiki = wikipedia_lengths(args.wiki_samples)
    print(
        f"corpus: {len(corpus)} conversations, {int(corpus.sum()):,} tokens; wikipedia: {len(wiki):,} lengths "
        f"drawn from the histogram (seed 0)\n"
    )
    print(
        f"{'dataset':10} {'width':>5} {'buffer':>6} {'offline%':>8} {'wait0 %':>9} {'wait2 %':>9} "
        f"{'gap2 %':>8} {'us/row':>9}"
    )
    rows = fill_curve("corpus", corpus, 4096) + fill_curve("wikipedia", wiki, 512)
    plot(rows, Path(args.png))
    print(f"\nwrote {args.png}")
    for name in ("corpus", "wikipedia"):
        ok = [r["buffer_size"] for r in rows if r["dataset"] == name and r["gap_wait2_pct"] <= 0.5]
        print(f"{name}: within 0.5% of offline BFD from buffer_size={ok[0] if ok else 'none'} (max_wait=2)")
    ov = overhead(corpus, 4096, args.rounds)
    ov["load_average_1min_after_overhead"] = round(load_average(), 2)
    print(
        f"\noverhead (corpus @ 4096, DataLoader num_workers=0, medians of {args.rounds} interleaved rounds, "
        f"1-min load average now {load_average():.2f}): packed "
        f"{ov['us_per_packed_row']} us/row ({ov['packed_rows']} rows) vs unpacked {ov['us_per_unpacked_row']} "
        f"us/row ({ov['unpacked_rows']} rows, one sample a row laid by build_row): {ov['ratio_per_row']}x per row "
        f"(rounds {ov['ratio_per_row_min_max']}, median of rounds {ov['ratio_per_row_median_of_rounds']}; CPU time "
        f"{ov['ratio_per_row_cpu_time']}x, rounds {ov['ratio_per_row_cpu_time_min_max']}; goal <= 1.3x); per real token {ov['ns_per_real_token_packed']} vs "
        f"{ov['ns_per_real_token_unpacked']} ns ({ov['ratio_per_real_token']}x); against a plain unpacked collate "
        f"with no sftpack code {ov['us_per_plain_unpacked_row']} us/row: {ov['ratio_per_row_vs_plain']}x per row; "
        f"of a packed row, laying it (build_parts) takes {ov['us_build_parts_per_packed_row']} us, the loader's "
        f"own work (reading, planning, gathering, the DataLoader) {ov['us_loader_own_per_row']} us"
    )
    rc = resume_cost(corpus, 4096)
    print(
        f"resume (corpus @ 4096, buffer 1024, mid-epoch): load_state_dict to first row {rc['resume_ms_map-style']} ms "
        f"map-style, {rc['resume_ms_iterable']} ms iterable; first row of a fresh start "
        f"{rc['first_row_ms_map-style']} ms (state: {rc['state_buffer_entries']} buffered, "
        f"{rc['state_pending_rows']} decided rows)"
    )
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "bench_loader.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["section", "value"])
        w.writeheader()
        w.writerows(rows)
        for k, v in (ov | rc).items():
            w.writerow({"section": k, "value": v})
    print(f"wrote {OUT / 'bench_loader.csv'}")
    if not args.no_results:
        fill = formatted_table(
            [{**r, **{k: 100 * r[k] for k in ("offline_bfd_fill", "fill_wait0", "fill_wait2")}} for r in rows],
            [
                ("dataset", "dataset", "{}"),
                ("max_seq_len", "width", "{:,}"),
                ("buffer_size", "buffer", "{:,}"),
                ("offline_bfd_fill", "offline BFD fill %", "{:.2f}"),
                ("fill_wait0", "fill %, `max_wait=0`", "{:.2f}"),
                ("fill_wait2", "fill %, `max_wait=2` (default)", "{:.2f}"),
                ("gap_wait2_pct", "gap to offline %, `max_wait=2`", "{:.3f}"),
                ("us_per_row_wait2", "µs per row, `max_wait=2`", "{:.1f}"),
            ],
        )
        costs = markdown_table([{"measure": k, "value": v} for k, v in (ov | rc).items()])
        title = (
            f"Fill (real tokens / slots) against buffer size, against offline BFD on the whole set: the embedded "
            f"corpus at 4,096 and {args.wiki_samples:,} Wikipedia lengths at 512 (curve: "
            f"[docs/loader_fill.png](../docs/loader_fill.png)). Then the overhead per row through a `DataLoader` "
            f"against an unpacked loader of the same samples (medians of {args.rounds}), and the resume cost."
        )
        write_section(__file__, fill + "\n\nOverhead and resume (corpus at 4,096):\n\n" + costs, machine, title=title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
