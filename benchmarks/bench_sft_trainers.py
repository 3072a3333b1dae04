"""Benchmark: ``sftpack train --packing trainer`` against TRL's ``SFTTrainer`` with
``padding_free=True`` and Hugging Face's ``Trainer`` with ``DataCollatorWithFlattening``,
on the same model and the same tokenized conversations, on CPU.

The first ``--limit`` conversations of the embedded corpus (chitchat, ChatML, the Qwen
tokenizer, longer ones split at ``--max-seq-len``) are tokenized once by sftpack (input
ids and the loss mask: the assistant turns). Each trainer then trains the same seeded
``LlamaForCausalLM`` (transformers' class, built from a config by
:func:`sftpack.loop.build_model`: ``--dim``, ``--layers``, the tokenizer's 151,646 ids)
for ``--steps`` optimizer steps of ``--batch-size`` conversations, AdamW at the same
learning rate:

- **sftpack**: ``sftpack train`` itself (``--packing trainer --model-impl transformers``),
  its own step times from its ``--log``;
- **TRL**: ``SFTTrainer(args=SFTConfig(padding_free=True))`` on a pre-tokenized
  ``datasets.Dataset`` of ``input_ids`` and ``labels`` (-100 where the mask is False);
- **HF flattening**: ``transformers.Trainer`` with ``DataCollatorWithFlattening`` on the
  same dataset.

TRL and Hugging Face's ``Trainer`` are timed per optimizer step by a ``TrainerCallback``
(``on_step_begin`` to ``on_step_end``). The table gives each trainer's median step time
over the steps after the first (the first pays for warm-up), its first-step loss (all
start from the same weights, so it is about ``ln(151,646)``: a check that each trains
the same model, not that they see the same first batch: each trainer shuffles on its own),
and its median step time over sftpack's. Every trainer sees the same pool of samples, but each
draws its batches in its own order, so a step's conversations differ between trainers: read
the ratios as their size, not to the last digit. The default run is short (3 timed steps
each; minutes on 2 cores, most of them TRL's); ``--steps``, ``--limit`` and ``--batch-size``
make it longer.

TRL is not a dependency of sftpack: ``pip install 'sftpack[bench]'`` (or ``make bench``)
installs it; without it the TRL row is left out and said so.

    python benchmarks/bench_sft_trainers.py [--limit 16] [--batch-size 4] [--steps 4] [--max-seq-len 1024]

Writes ``benchmarks/out/bench_sft_trainers.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section

OUT = Path(__file__).resolve().parent / "out"


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, Python {platform.python_version()}; 1-min load average at start {load_average():.2f}"
    )


def conversations_file(limit: int, folder: Path) -> Path:
    """The first ``limit`` embedded conversations as OpenAI-messages JSONL (what ``sftpack train`` reads)."""
    from sftpack.data import default_corpus

    path = folder / "chats.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for c in default_corpus(limit=limit):
            f.write(json.dumps({"messages": c.messages}) + "\n")
    return path


def hf_dataset(path: Path, max_seq_len: int) -> Any:
    """The conversations of ``path`` tokenized by sftpack (split at ``max_seq_len``, as ``sftpack train``
    does) as a ``datasets.Dataset`` of ``input_ids`` and ``labels`` (unshifted, -100 off the loss mask)."""
    import datasets

    from sftpack.chat import read_conversations
    from sftpack.data import default_tokenizer
    from sftpack.loop import tokenized_samples

    samples, _ = tokenized_samples(default_tokenizer(), read_conversations(str(path)), max_seq_len=max_seq_len)
    rows = []
    for s in samples:
        ids = [int(t) for t in s.input_ids]
        rows.append({"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, s.loss_mask)]})
    return datasets.Dataset.from_list(rows)


class StepClock:
    """A ``TrainerCallback`` (duck-typed: Trainer calls the hooks it has) that times each optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def model(args: argparse.Namespace, vocab: int) -> Any:
    from sftpack.loop import build_model

    return build_model(vocab, dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, seed=0)


def run_hf(args: argparse.Namespace, data: Any, vocab: int, work: Path, trl: bool) -> StepClock:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    clock = StepClock()
    callback = type(
        "Clock", (TrainerCallback,), {k: getattr(clock, k) for k in ("on_step_begin", "on_step_end", "on_log")}
    )
    common = dict(
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
    )
    if trl:
        from trl import SFTConfig, SFTTrainer

        from sftpack.data import default_tokenizer

        tok = default_tokenizer()
        if tok.pad_token is None:
            tok.pad_token = "<|endoftext|>"
        cfg = SFTConfig(str(work / "trl"), padding_free=True, max_length=None, **common)  # samples already split
        trainer: Any = SFTTrainer(model=model(args, vocab), args=cfg, train_dataset=data, processing_class=tok)
    else:
        from transformers import DataCollatorWithFlattening

        cfg = TrainingArguments(str(work / "hf"), **common)
        trainer = Trainer(
            model=model(args, vocab), args=cfg, train_dataset=data, data_collator=DataCollatorWithFlattening()
        )
    trainer.add_callback(callback())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return clock


def run_sftpack(args: argparse.Namespace, path: Path, work: Path) -> StepClock:
    from sftpack.cli import main

    log = work / "sftpack.jsonl"
    argv = [
        "train",
        str(path),
        *("--packing", "trainer", "--model-impl", "transformers", "--no-progress", "--no-cache"),
        *("--steps", str(args.steps), "--batch-size", str(args.batch_size), "--max-seq-len", str(args.max_seq_len)),
        *("--dim", str(args.dim), "--layers", str(args.layers), "--heads", str(args.heads)),
        *("--kv-heads", str(args.kv_heads), "--lr", str(args.lr), "--warmup-steps", "0", "--schedule", "constant"),
        *("--log", str(log)),
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"sftpack train exited {rc}: {' '.join(argv)}")
    clock = StepClock()
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        clock.times.append(float(rec["step_time"]))
        clock.losses.append(float(rec["loss"]))
    return clock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=16, help="conversations of the embedded corpus (default 16)")
    ap.add_argument("--batch-size", type=int, default=4, help="conversations per optimizer step (default 4)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per trainer (default 4)")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="longer conversations are split (default 1024)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    add_flag(ap)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is warm-up)")
    where = machine()
    print(where)
    try:
        import trl
    except ImportError:
        trl = None
        print("TRL is not installed (pip install 'sftpack[bench]'): its row is left out")
    from sftpack.data import default_tokenizer

    vocab = len(default_tokenizer())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        work = Path(tmp)
        path = conversations_file(args.limit, work)
        data = hf_dataset(path, args.max_seq_len)
        runs: list[tuple[str, Any]] = [("sftpack train --packing trainer", lambda: run_sftpack(args, path, work))]
        if trl is not None:
            runs.append(
                (f"TRL {trl.__version__} SFTTrainer, padding_free", lambda: run_hf(args, data, vocab, work, True))
            )
        runs.append(("HF Trainer, DataCollatorWithFlattening", lambda: run_hf(args, data, vocab, work, False)))
        for name, go in runs:
            print(f"== {name}", flush=True)
            clock = go()
            med = statistics.median(clock.times[1:])
            rows.append({"trainer": name, "step_s": med, "first_loss": clock.losses[0] if clock.losses else None})
            print(
                f"   median step {med:.3f} s over steps 2-{len(clock.times)}; first-step loss {rows[-1]['first_loss']}"
            )
    base = rows[0]["step_s"]
    for r in rows:
        r["x_sftpack"] = r["step_s"] / base
    columns = [
        ("trainer", "trainer", "{}"),
        ("step_s", "median step (s)", "{:.3f}"),
        ("x_sftpack", "x sftpack's step", "{:.2f}"),
        ("first_loss", "first-step loss", "{:.4f}"),
    ]
    table = formatted_table(rows, columns)
    print(table)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "bench_sft_trainers.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {OUT / 'bench_sft_trainers.csv'}")
    if not args.no_results:
        title = (
            f"One seeded `LlamaForCausalLM` (dim {args.dim}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
            f"{vocab:,} ids) trained for {args.steps} steps of {args.batch_size} conversations (the first "
            f"{args.limit} of the embedded corpus, split at {args.max_seq_len} tokens, tokenized once by sftpack) "
            "by each trainer on CPU; median step time over steps 2 on, and each trainer's against sftpack's."
        )
        write_section(__file__, table, where, title=title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
