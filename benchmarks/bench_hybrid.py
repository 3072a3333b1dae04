"""Benchmark: hybrid models (Mamba2, gated delta net, short convolution) trained on packed rows
through the pure-PyTorch route of :func:`sftpack.hybrid.keep_apart`, against the same model run
one sample at a time and on right-padded batches.

Each family (``--families``, :data:`sftpack.testing.HYBRID_FAMILIES`) in each size
(``--sizes``: ``tiny`` is :func:`sftpack.testing.hybrid_config`'s default, the suite's test
models; ``small`` is hidden 256 with 4 layers, mixers and attention in the family's usual
mix, see :data:`SMALL`) is built from its config with a fixed seed, saved with
``save_pretrained`` and loaded the way ``sftpack train --model DIR`` loads it
(:func:`sftpack.loop.load_model`: sftpack's training attention, ``keep_apart`` applied), then
forced to ``route="torch"``. Round ``r`` draws ``--conversations`` samples (seed ``+ r``) of
the embedded corpus (ChatML, the Qwen tokenizer, conversations longer than ``--max-seq-len``
split, the vocabulary compacted to the ids of the data) and times one forward + backward of
the model's own loss (no optimizer) on the same samples laid out four ways, in a rotated
order:

- ``alone``: one sample at a time (its loss weighted by its share of the label tokens, so the
  gradients add up to the batch's); what training without packing at batch size 1 costs;
- ``padded``: one right-padded ``[B, S]`` batch through the model's own forward, no
  boundaries (exact for causal layers: the padding trails every real token);
- ``packed``: the samples packed into one row by sftpack's trainer path
  (:func:`sftpack.trainer.pack_step` on that padded batch) and fed with ``to_hf_kwargs()``:
  every covered layer runs the row's segments, those of similar length together as the rows
  of a right-padded batch (the torch route), everything else runs on the packed slots;
- ``leaking``: the same packed row inside :func:`sftpack.hybrid.leaking` (the negative
  control: each mixer runs the row as one sequence, its state crossing every boundary). It
  is not exact; it is what the packed step would cost if keeping the boundaries were free
  (as with the kernels' boundary arguments, which cost a scan no more than one sequence), so
  ``packed / leaking`` time is the torch route's overhead.

The table gives the median over rounds of real tokens/s of each layout, the speed-ups of the
packed row over ``alone`` and over ``padded`` (medians over rounds of each round's ratio),
and beside the latter the **slot bound**: padded slots / packed slots of the same samples
(the speed-up if time were proportional to slots). The gradients of every layout are
checked against the packed row's (the same token-weighted mean loss; ``leaking`` differs,
which shows the control leaks). Hooks on the covered layers time their forward in each
layout (the mixers' share of the step, and the torch route's overhead inside them), and
:class:`bench_train.BodyHeadClock` times the model's body (``base_model``: embeddings,
layers, final norm; forward and backward), where the covered layers sit, apart from the head
and the loss, which cost the same per real token in every layout but ``padded`` (the head
runs on every slot).

    python benchmarks/bench_hybrid.py [--families nemotron_h,qwen3_5,lfm2] [--sizes tiny,small]
        [--conversations 8] [--rounds 3] [--threads 1]

Writes ``benchmarks/out/bench_hybrid.csv`` (one line per family and size).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import platform
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section
from bench_train import BodyHeadClock

OUT = Path(__file__).resolve().parent / "out"
LAYOUTS = ("alone", "padded", "packed", "leaking")
SIZES = ("tiny", "small")
FAMILIES = ("nemotron_h", "qwen3_5", "lfm2")

#: the ``small`` size: hidden 256, 4 layers, each family's usual mix of mixers and attention
#: (attention 8 heads of 32, 2 kv heads; Mamba2: 16 heads of 32 (expand 2), state 32, chunks
#: of 64; gated delta net: 4 key / 8 value heads of 32)
SMALL: dict[str, dict[str, Any]] = {
    "nemotron_h": dict(
        hybrid_override_pattern="M-M*",  # Mamba2, MLP, Mamba2, attention (Nemotron-H's M-M-...*)
        head_dim=32,
        mamba_num_heads=16,
        mamba_head_dim=32,
        ssm_state_size=32,
        chunk_size=64,
    ),
    "bamba": dict(
        attn_layer_indices=[3], mamba_n_heads=16, mamba_d_head=32, mamba_d_state=32, mamba_expand=2, mamba_chunk_size=64
    ),
    "qwen3_5": dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"],  # Qwen3.5's 3 : 1
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
    "lfm2": dict(layer_types=["conv", "conv", "full_attention", "conv"], head_dim=32),  # LFM2: mostly convolutions
}
SMALL_ATTENTION = dict(num_attention_heads=8, num_key_value_heads=2)


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__} with {torch.get_num_threads()} "
        f"thread(s), Python {platform.python_version()}, CPU only"
    )


def build(kind: str, size: str, vocab: int, seed: int, folder: str) -> tuple[Any, int]:
    """The family's model as ``sftpack train --model DIR`` loads it (saved, then
    :func:`sftpack.loop.load_model`), forced to the torch route; ``(model, covered layers)``."""
    from transformers import AutoModelForCausalLM

    from sftpack.hybrid import keep_apart
    from sftpack.loop import load_model
    from sftpack.testing import hybrid_config

    if size == "tiny":
        cfg = hybrid_config(kind, vocab)
    else:
        cfg = hybrid_config(kind, vocab, hidden=256, layers=4, **SMALL_ATTENTION, **SMALL.get(kind, {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    model = load_model(folder)
    covered = keep_apart(model, route="torch")
    if not covered:
        raise SystemExit(f"bench_hybrid: {kind} has no layer keep_apart covers")
    return model, len(covered)


class MixerClock:
    """Seconds spent in the forward of the covered layers (pre-hook to hook), summed."""

    def __init__(self, model: Any) -> None:
        from sftpack.hybrid import layer_kind

        self.seconds = 0.0
        self._start = 0.0
        self._handles = []
        for m in model.modules():
            if layer_kind(m) is not None:
                self._handles.append(m.register_forward_pre_hook(self._begin))
                self._handles.append(m.register_forward_hook(self._end))

    def _begin(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _end(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def hf_labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unshifted Hugging Face labels of a right-padded batch: the token where it is trained on."""
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    labels[:, 0] = -100
    return labels


def step(model: Any, layout: str, samples: Sequence[Any]) -> tuple[float, torch.Tensor]:
    """One forward + backward of ``layout`` on the model's device: ``(seconds, the gradients
    flattened)``."""
    from sftpack.hybrid import leaking
    from sftpack.trainer import pack_step, padded_batch

    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    ids, lengths, mask = padded_batch(samples)
    labels = hf_labels(ids, mask)
    n = int((labels[:, 1:] != -100).sum())
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if layout == "alone":
        for i, s in enumerate(samples):
            lab = labels[i : i + 1, : len(s)]
            k = int((lab[:, 1:] != -100).sum())
            if k == 0:
                continue
            loss = model(input_ids=ids[i : i + 1, : len(s)], labels=lab, use_cache=False).loss * (k / n)
            loss.backward()
    elif layout == "padded":
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
    else:
        kw = pack_step(ids, lengths, mask).to_hf_kwargs()
        with leaking(model) if layout == "leaking" else contextlib.nullcontext():
            loss = model(**kw).loss
            loss.backward()
    if cuda:
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    return secs, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def batches(samples: Sequence[Any], count: int, rounds: int, seed: int) -> Iterator[list[Any]]:
    for r in range(rounds):
        pick = np.random.default_rng(seed + r).choice(len(samples), size=count, replace=False)
        yield [samples[i] for i in sorted(pick)]


def run_model(args: argparse.Namespace, kind: str, size: str, samples: list[Any], vocab: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        model, covered = build(kind, size, vocab, args.seed, folder)
    params = sum(p.numel() for p in model.parameters())
    rate: dict[str, list[float]] = {x: [] for x in LAYOUTS}
    mixer: dict[str, float] = dict.fromkeys(LAYOUTS, 0.0)
    body: dict[str, list[float]] = {x: [] for x in LAYOUTS}
    head: dict[str, list[float]] = {x: [] for x in LAYOUTS}
    seconds: dict[str, float] = dict.fromkeys(LAYOUTS, 0.0)
    dgrad: dict[str, float] = dict.fromkeys(LAYOUTS, 0.0)
    real = padded_slots = 0
    rounds = list(batches(samples, args.conversations, args.rounds, args.seed))
    for layout in LAYOUTS:  # untimed: first calls, allocator growth
        step(model, layout, rounds[0][:2])
    for r, batch in enumerate(rounds):
        order = LAYOUTS[r % len(LAYOUTS) :] + LAYOUTS[: r % len(LAYOUTS)]
        tokens = sum(len(s) for s in batch)
        real += tokens
        padded_slots += len(batch) * max(len(s) for s in batch)
        grads = {}
        for layout in order:
            clock, parts = MixerClock(model), BodyHeadClock(model)
            secs, grads[layout] = step(model, layout, batch)
            clock.remove()
            parts.remove()
            body_s, head_s = parts.read()
            body[layout].append(tokens / body_s)
            head[layout].append(tokens / head_s)
            rate[layout].append(tokens / secs)
            seconds[layout] += secs
            mixer[layout] += clock.seconds
        for layout in LAYOUTS:
            scale = float(grads["packed"].abs().max())
            dgrad[layout] = max(dgrad[layout], float((grads[layout] - grads["packed"]).abs().max()) / scale)
        print(
            f"  {kind} {size} round {r + 1}/{args.rounds} ({tokens:,} tokens, load {load_average():.2f}): "
            + ", ".join(f"{x} {rate[x][-1]:,.0f}" for x in LAYOUTS)
            + " real tokens/s",
            flush=True,
        )
    med = {x: float(np.median(rate[x])) for x in LAYOUTS}

    def paired(a: list[float], b: list[float]) -> float:
        """The median over rounds of ``a / b``: each round's layouts ran minutes apart at most, so a
        busy minute slows both sides of a ratio alike."""
        return float(np.median(np.asarray(a) / np.asarray(b)))

    return {
        "family": kind,
        "size": size,
        "params": params,
        "covered": covered,
        "layers": model.config.num_hidden_layers,
        "real_tokens": real,
        "bound": padded_slots / real,
        **{f"{x}_tokens_per_s": med[x] for x in LAYOUTS},
        "vs_alone": paired(rate["packed"], rate["alone"]),
        "vs_padded": paired(rate["packed"], rate["padded"]),
        "body_vs_alone": paired(body["packed"], body["alone"]),
        "body_vs_padded": paired(body["packed"], body["padded"]),
        "body_share": paired(rate["packed"], body["packed"]),
        "head_vs_alone": paired(head["packed"], head["alone"]),
        "route_overhead": paired(rate["leaking"], rate["packed"]),
        "mixer_share": mixer["packed"] / seconds["packed"],
        "mixer_overhead": mixer["packed"] / mixer["leaking"],
        "mixer_vs_padded": mixer["packed"] / mixer["padded"],
        "dgrad_alone": dgrad["alone"],
        "dgrad_padded": dgrad["padded"],
        "dgrad_leaking": dgrad["leaking"],
        "load": load_average(),
    }


COLUMNS = [
    ("family", "family", "{}"),
    ("size", "size", "{}"),
    ("malloc", "malloc", "{}"),
    ("params", "parameters", "{:,}"),
    ("covered", "covered / layers", "{}"),
    ("alone_tokens_per_s", "alone tok/s", "{:,.0f}"),
    ("padded_tokens_per_s", "padded tok/s", "{:,.0f}"),
    ("packed_tokens_per_s", "packed tok/s", "{:,.0f}"),
    ("vs_alone", "packed vs alone", "{:.2f}x"),
    ("vs_padded", "packed vs padded", "{:.2f}x"),
    ("bound", "slot bound", "{:.2f}x"),
    ("body_share", "body's share of the packed step", "{:.0%}"),
    ("body_vs_alone", "body: packed vs alone", "{:.2f}x"),
    ("body_vs_padded", "body: packed vs padded", "{:.2f}x"),
    ("head_vs_alone", "head + loss: packed vs alone", "{:.2f}x"),
    ("route_overhead", "torch route: step / leaking step", "{:.2f}x"),
    ("mixer_share", "mixers' forward: share of the packed step", "{:.0%}"),
    ("mixer_overhead", "mixer fwd: packed / leaking", "{:.2f}x"),
    ("mixer_vs_padded", "mixer fwd: packed / padded", "{:.2f}x"),
    ("dgrad_padded", "Δ grad: padded", "{:.1e}"),
    ("dgrad_alone", "Δ grad: alone", "{:.1e}"),
    ("dgrad_leaking", "Δ grad: leaking", "{:.1e}"),
]


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'family':10s} {'size':5s} | {'alone':>6s} {'padded':>6s} {'packed':>6s} {'leaking':>7s} | "
        f"{'vs alone':>8s} {'vs pad':>6s} {'bound':>5s} | {'share':>5s} {'alone':>6s} {'pad':>6s} {'head':>6s} | "
        f"{'route':>5s} {'mixer':>5s} {'m/leak':>6s} | {'pad':>7s} {'alone':>7s} {'leak':>7s}"
    )
    print(
        f"{'':17s}| {'real tokens/s (median)':^30s} | {'packed speed-up':^21s} | {'body (packed), head':^27s} | "
        f"{'torch route':^20s} | max rel. grad diff vs packed"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['family'][:6] + ' ' + r['malloc'][:3]:10s} {r['size']:5s} | {r['alone_tokens_per_s']:6,.0f} {r['padded_tokens_per_s']:6,.0f} "
            f"{r['packed_tokens_per_s']:6,.0f} {r['leaking_tokens_per_s']:7,.0f} | {r['vs_alone']:7.2f}x "
            f"{r['vs_padded']:5.2f}x {r['bound']:4.2f}x | {r['body_share']:5.0%} {r['body_vs_alone']:5.2f}x "
            f"{r['body_vs_padded']:5.2f}x {r['head_vs_alone']:5.2f}x | {r['route_overhead']:4.2f}x {r['mixer_share']:5.0%} "
            f"{r['mixer_overhead']:5.2f}x | {r['dgrad_padded']:7.1e} {r['dgrad_alone']:7.1e} {r['dgrad_leaking']:7.1e}"
        )


def keep_freed_memory() -> None:
    """glibc's ``malloc`` keeps what is freed instead of handing large blocks back to the OS
    (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, 2**40)``: what
    ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` set, or a caching allocator such as
    jemalloc or tcmalloc, or PyTorch's own on a GPU). By default a long row's activations,
    larger than the short samples', are mapped afresh and zero-filled by the kernel at every
    step: a cost of the row's size, not of packing."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-4, 0)  # M_MMAP_MAX: no allocation by mmap
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: do not hand the top of the heap back


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated (default {','.join(FAMILIES)})")
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: tiny, small (default both)")
    p.add_argument("--conversations", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each on other samples (default 3)")
    p.add_argument("--limit", type=int, default=400, help="first N conversations of the corpus (default 400)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="longer conversations are split (default 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)")
    p.add_argument("--csv", default=str(OUT / "bench_hybrid.csv"))
    p.add_argument(
        "--malloc",
        choices=["default", "keep", "both"],
        default="both",
        help="glibc malloc as it is, keeping freed memory (keep_freed_memory), or both in turn (default)",
    )
    add_flag(p)
    args = p.parse_args(argv)
    from sftpack.testing import HYBRID_FAMILIES

    families = [x for x in args.families.split(",") if x]
    sizes = [x for x in args.sizes.split(",") if x]
    if bad := sorted(set(families) - set(HYBRID_FAMILIES)):
        p.error(f"unknown families {bad}: choose from {', '.join(HYBRID_FAMILIES)}")
    if bad := sorted(set(sizes) - set(SIZES)):
        p.error(f"unknown sizes {bad}: choose from {', '.join(SIZES)}")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the saves and loads of every model
    where = machine()
    print(f"machine: {where}; 1-min load average {load_average():.2f}")

    from sftpack.data import default_tokenizer
    from sftpack.loop import compact_vocabulary, tokenized_samples

    t0 = time.perf_counter()
    samples, stats = tokenized_samples(default_tokenizer(), max_seq_len=args.max_seq_len, limit=args.limit)
    samples, ids = compact_vocabulary(samples)
    print(
        f"data: {stats.conversations:,} conversations -> {len(samples):,} samples, {stats.tokens:,} tokens, "
        f"{len(ids):,} ids ({time.perf_counter() - t0:.1f} s); {args.conversations} samples per step, "
        f"{args.rounds} rounds, float32, forward + backward"
    )
    t0 = time.perf_counter()
    rows = []
    for mode in ["default", "keep"] if args.malloc == "both" else [args.malloc]:
        if mode == "keep":
            keep_freed_memory()
        for size in sizes:
            for kind in families:
                rows.append({"malloc": mode, **run_model(args, kind, size, samples, len(ids))})
    loads = [r["load"] for r in rows]
    print(f"\n({time.perf_counter() - t0:.0f} s; 1-min load average {min(loads):.2f}-{max(loads):.2f})")
    print_table(rows)
    print(
        "\nvs alone / vs pad: packed real tokens/s over one sample at a time / over right-padded batches; bound: "
        "padded slots / packed slots. body: the model's body (base_model: embeddings, layers, final norm; forward + "
        "backward), its share of the packed step and its packed speed-ups; head: the head + loss, packed vs alone. route: packed step time / the same row leaking (mixers run the row as one "
        "sequence: what keeping boundaries would cost if free); mixer: the covered layers' share of the packed "
        "step (their forward); m/leak: their forward time packed / leaking. dgrad: max |grad - packed grad| / max |packed grad|."
    )
    for r in rows:
        r["covered"] = f"{r['covered']} / {r['layers']}"
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    if not args.no_results:
        verdicts = []
        for mode in dict.fromkeys(r["malloc"] for r in rows):
            mine = [r for r in rows if r["malloc"] == mode]
            slower = [f"{r['family']} {r['size']} {r['vs_alone']:.2f}x" for r in mine if r["vs_alone"] < 1]
            how = "glibc malloc as it is" if mode == "default" else "glibc malloc keeping freed memory"
            verdicts.append(
                f"**{how}: below the 1x goal against one sample at a time on {len(slower)} of {len(mine)} models** "
                f"({', '.join(slower)})."
                if slower
                else f"**{how}: the packed row meets the 1x goal against one sample at a time on all {len(mine)} "
                "models.**"
            )
        verdict = (
            " ".join(verdicts)
            + " With malloc as it is, a long row's activations are mapped afresh and zero-filled by the kernel at "
            "every step while the short samples' are reused (the *head + loss* column: the same tokens in both "
            "layouts); keeping freed memory (`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`, jemalloc or tcmalloc "
            "on CPU; PyTorch's caching allocator on a GPU) removes that cost of the row's size."
        )
        body = [
            formatted_table(rows, COLUMNS),
            "",
            verdict,
            "",
            "Real tokens/s are medians over rounds of one forward + backward (the model's own loss, no optimizer); "
            "the ratios are medians over rounds of each round's ratio. "
            "*packed vs alone*: the packed row against the same model run one sample at a time (training without "
            "packing at batch size 1; packing must never be slower). *packed vs padded*: against one right-padded "
            "batch of the same samples, beside the *slot bound* (padded slots / packed slots: the speed-up if time "
            "were proportional to slots). The torch route runs each covered layer on the row's segments, those of "
            "similar length together as the rows of a right-padded batch (`sftpack.hybrid.length_groups`: padding "
            "within 1.125x of the tokens), so inside the mixers the packed row costs about what the samples alone "
            "cost; the other layers (attention, MLP, head) gain the slots packing saves. *torch route: "
            "step / leaking step*: the packed step against the same row with the mixers' state leaking across "
            "boundaries (the negative control, not exact: what the step would cost if keeping boundaries were "
            "free, as with the kernels' `seq_idx` / `cu_seqlens` on a GPU; under 1x where one long row costs the "
            "layer's PyTorch code more than its segments do: Hugging Face's reference Mamba2 scan passes the state "
            "between chunks in a step quadratic in the number of chunks). *Δ grad*: max \\|grad - packed grad\\| / "
            "max \\|packed grad\\|, the largest over the rounds (float32 roundings for the exact layouts; leaking is "
            f"the control). 1-min load average "
            f"{min(loads):.2f}-{max(loads):.2f}.",
        ]
        title = (
            f'Hybrid models on packed rows through `keep_apart`\'s pure-PyTorch route (`route="torch"`), against '
            f"the same model one sample at a time and on right-padded batches; forward + backward in float32 on CPU "
            f"({args.threads} torch thread(s)), {args.conversations} samples per step drawn from the first "
            f"{args.limit} conversations of the embedded corpus (split at {args.max_seq_len}, vocabulary compacted "
            f"to the data's ids), {args.rounds} rounds (seed {args.seed}). Models built by "
            "`sftpack.testing.hybrid_config` (tiny: its default, hidden 32, one mixer and one attention layer; "
            "small: hidden 256, 4 layers, see `SMALL` in the script), saved and loaded by `sftpack.loop.load_model` "
            "(sftpack's training attention, `keep_apart` applied); packed rows by `sftpack.trainer.pack_step`, fed "
            "with `to_hf_kwargs()`."
        )
        write_section(__file__, "\n".join(body), where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
