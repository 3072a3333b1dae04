"""Benchmark: DPO training steps on packed pairs against padded pairs (TRL's concatenated batch).

Issue 42, item 7. Preference pairs with real lengths: the first ``--limit`` conversations of
the embedded corpus (chitchat, ChatML, the Qwen tokenizer), each one pair in TRL's explicit
message-list format: the prompt is the conversation up to its last assistant turn, ``chosen``
that turn, ``rejected`` the last assistant turn of the next conversation (another real answer,
of another length), tokenized by :func:`sftpack.chat.tokenize_pair`, each member cut after its
answer's ``<|im_end|>`` (the template's newline after it, which sftpack leaves untrained and
TRL's completion would train, goes: both sides train the same tokens). A pair whose longer member
is over ``--max-len`` (TRL's default ``max_length``, 1024) is dropped whole (its share is
printed); the model's vocabulary is the ids the pairs use (:func:`sftpack.loop.compact_vocabulary`).

Each step trains ``--pairs`` pairs (the same pairs on both sides) with DPO (sigmoid, beta 0.1):
the policy forward and backward, the frozen reference forward, AdamW. Two copies of one seeded
Hugging Face Llama (``sftpack.loop.build_model``, float32, CPU):

- **packed** (sftpack, as ``sftpack train --objective dpo --packing trainer`` does it): the
  step's 2 x pairs sequences laid end to end in one row (``PackedBatch.from_samples``), one
  forward of each model under sftpack's training attention (the row's boundaries),
  ``sequence_logprob_sums``, ``pairs_of``, ``dpo_loss``, ``pair_mean``;
- **padded** (TRL's way): TRL's own collator (``trl.trainer.dpo_trainer.DataCollatorForPreference``:
  chosen and rejected right-padded to the longest, concatenated into one ``[2B, S]`` batch) and
  one forward of each model with its ``attention_mask`` under Hugging Face's ``sdpa``, each row's
  completion log-probabilities summed, the same ``dpo_loss``. Without TRL installed the script
  builds that batch itself (said in the output and the results).

Both sides run the head over every slot (TRL's fused LM head also scores every position off
CUDA). The reference has another seed than the policy, so the first step's loss is not ln 2; that
first step (the same weights, the same pairs, untimed) must give both sides the same loss
(checked: the two are the same DPO). Then ``--steps`` timed steps per side, interleaved (each
step's pairs on both sides, the order alternating), so a busy machine slows both alike. The
table: real tokens/s (the sequences' tokens, a pair's prompt counted in both members, as both
sides compute it), the ratio, and two bounds. The slot bound, padded slots / real tokens, is
what packing saves on the work done per slot (embeddings, projections, MLP, head); the packed
row has no padding (``pad_multiple`` 1). Attention's scores grow with the square of a row's
width, so the padded batch's attention costs ``2B * S**2`` against the packed row's sum of
``L**2`` over its sequences: the attention bound. The measured ratio lands between the two, by
attention's share of the step.

    python benchmarks/bench_dpo.py [--limit 300] [--pairs 4] [--steps 12] [--max-len 1024]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section
from sftpack import IGNORE_INDEX, PackedBatch, Sample
from sftpack.loss import sequence_logprob_sums
from sftpack.objectives import dpo_loss, pair_mean, pairs_of
from sftpack.sample import pair_meta, pair_sequence_id

BETA = 0.1
Pair = tuple[Sample, Sample]

COLUMNS = [
    ("side", "side", "{}"),
    ("steps", "timed steps", "{}"),
    ("real", "real tokens", "{:,}"),
    ("slots", "slots", "{:,}"),
    ("collate_ms", "batch build ms / step", "{:.1f}"),
    ("step_ms", "step ms (median)", "{:.0f}"),
    ("tokens_per_s", "real tokens/s", "{:,.0f}"),
    ("ratio", "vs padded", "{:.2f}x"),
    ("bound", "slot bound", "{:.2f}x"),
    ("attention_bound", "attention bound", "{:.2f}x"),
]


def machine() -> str:
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__} with {torch.get_num_threads()} "
        f"thread(s), Python {platform.python_version()}, CPU; 1-min load average at start {load_average():.2f}"
    )


def preference_pairs(limit: int, max_len: int) -> tuple[list[Pair], int, Any]:
    """``(pairs, dropped, tokenizer)``: one pair per conversation of the embedded corpus, the pairs
    with a member over ``max_len`` dropped whole."""
    from sftpack.chat import tokenize_pair
    from sftpack.data import default_corpus, default_tokenizer

    tok = default_tokenizer()
    convs = [c.messages for c in default_corpus(limit=limit)]
    pairs, dropped = [], 0
    for k, messages in enumerate(convs):
        last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
        other = [m for m in convs[(k + 1) % len(convs)] if m["role"] == "assistant"][-1]
        row = {"prompt": messages[:last], "chosen": [messages[last]], "rejected": [other]}
        chosen, rejected = (answer_tail(s) for s in tokenize_pair(row, tok, conversation_id=k))
        if max(len(chosen), len(rejected)) > max_len:
            dropped += 1
            continue
        pairs.append((chosen, rejected))
    return pairs, dropped, tok


def answer_tail(s: Sample) -> Sample:
    """``s`` up to its last trained token: ChatML's newline after the answer's ``<|im_end|>`` goes
    (sftpack leaves it untrained, TRL's completion would train it), so both sides train the same
    tokens; the trained answer is then the sequence's tail (checked), TRL's completion."""
    end = len(s) - int(np.argmax(s.loss_mask[::-1]))
    return Sample(s.input_ids[:end], s.loss_mask[:end], s.conversation_id, s.meta)


def completion_start(s: Sample) -> int:
    """Where the trained answer starts; it runs to the end (asserted), as TRL's completion does."""
    first = int(np.argmax(s.loss_mask))
    if not s.loss_mask[first:].all():
        raise AssertionError(f"pair {s.conversation_id}: the trained tokens are not one tail; TRL's layout differs")
    return first


def padded_batch(pairs: list[Pair], pad_id: int, use_trl: bool) -> dict[str, torch.Tensor]:
    """TRL's concatenated batch: ``input_ids``, ``attention_mask``, ``completion_mask`` ``[2B, S]``,
    the chosen answers' rows first."""
    examples = []
    for chosen, rejected in pairs:
        n = completion_start(chosen)
        assert n == completion_start(rejected) and np.array_equal(chosen.input_ids[:n], rejected.input_ids[:n])
        examples.append(
            {
                "prompt_ids": chosen.input_ids[:n].tolist(),
                "chosen_ids": chosen.input_ids[n:].tolist(),
                "rejected_ids": rejected.input_ids[n:].tolist(),
            }
        )
    if use_trl:
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        out: dict[str, torch.Tensor] = DataCollatorForPreference(pad_token_id=pad_id)(examples)
        return out
    seqs = [e["prompt_ids"] + e[k] for k in ("chosen_ids", "rejected_ids") for e in examples]
    comp = [[0] * len(e["prompt_ids"]) + [1] * len(e[k]) for k in ("chosen_ids", "rejected_ids") for e in examples]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    completion = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, c) in enumerate(zip(seqs, comp)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        completion[i, : len(s)] = torch.tensor(c)
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}


def padded_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(2B,)``: each row's summed log-probability of its completion, from one forward (the
    same fused cross-entropy over every slot as sftpack's side)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    labels = batch["input_ids"][:, 1:].masked_fill(batch["completion_mask"][:, 1:] == 0, IGNORE_INDEX)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    nll = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view(labels.shape).sum(dim=1)


def padded_step(policy: Any, reference: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    pc, pr = padded_logps(policy, batch).chunk(2)
    with torch.no_grad():
        rc, rr = padded_logps(reference, batch).chunk(2)
    return dpo_loss(pc, pr, rc, rr, beta=BETA).losses.mean()


def packed_row(pairs: list[Pair]) -> PackedBatch:
    members = [s for pair in pairs for s in pair]
    return PackedBatch.from_samples([Sample(s.input_ids, s.loss_mask, pair_sequence_id(s), s.meta) for s in members])


def packed_step(policy: Any, reference: Any, row: PackedBatch) -> torch.Tensor:
    kw = row.to_hf_kwargs()
    kw.pop("labels")
    pairs = pairs_of(row, pair_meta(row.sequence_ids or ()))
    lp, _ = sequence_logprob_sums(policy(**kw).logits[0], row)
    with torch.no_grad():
        rp, _ = sequence_logprob_sums(reference(**kw).logits[0], row)
    out = dpo_loss(lp[pairs.chosen], lp[pairs.rejected], rp[pairs.chosen], rp[pairs.rejected], beta=BETA)
    return pair_mean(out.losses, len(pairs))


class Side:
    """One side's policy, frozen reference and optimizer, and its timings."""

    def __init__(self, name: str, vocab: int, attention: str, args: argparse.Namespace, build: Callable) -> None:
        from sftpack.loop import build_model

        def model(seed: int) -> Any:
            return build_model(
                vocab, dim=args.dim, layers=args.layers, heads=4, kv_heads=2, seed=seed, attn_implementation=attention
            )

        self.name, self.build = name, build
        # the reference of another seed: the step-1 losses then differ from ln 2 and their match means something
        self.policy, self.reference = model(args.seed).train(), model(args.seed + 1).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=1e-4)
        self.collate_s: list[float] = []
        self.step_s: list[float] = []

    def step(self, pairs: list[Pair], timed: bool = True) -> float:
        t0 = time.perf_counter()
        batch = self.build(pairs)
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = (packed_step if self.name == "packed" else padded_step)(self.policy, self.reference, batch)
        loss.backward()
        self.opt.step()
        t2 = time.perf_counter()
        if timed:
            self.collate_s.append(t1 - t0)
            self.step_s.append(t2 - t0)
        return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=300, help="conversations of the embedded corpus, one pair each")
    ap.add_argument("--max-len", type=int, default=1024, help="drop a pair with a member over this (TRL's max_length)")
    ap.add_argument("--pairs", type=int, default=4, help="pairs per step")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per side")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)")
    ap.add_argument("--seed", type=int, default=0)
    add_flag(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    where = machine()
    print(f"machine: {where}")
    try:
        import trl

        use_trl, padder = True, f"TRL {trl.__version__}'s DataCollatorForPreference"
    except ImportError:
        use_trl, padder = False, "this script's own padding (TRL is not installed)"
    from sftpack.attention import register_train_attention
    from sftpack.loop import compact_vocabulary

    t = time.perf_counter()
    raw, dropped, tok = preference_pairs(args.limit, args.max_len)
    flat, ids = compact_vocabulary([s for pair in raw for s in pair], keep=[tok.pad_token_id])
    pairs = [(flat[2 * i], flat[2 * i + 1]) for i in range(len(raw))]
    vocab, pad_id = len(ids), int(np.searchsorted(ids, tok.pad_token_id))
    lengths = np.array([len(s) for s in flat])
    print(
        f"pairs: {len(pairs)} of {args.limit} conversations ({dropped} over {args.max_len} tokens dropped), "
        f"sequence lengths median {int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, "
        f"max {int(lengths.max())}; vocabulary {vocab:,} ids ({time.perf_counter() - t:.1f} s)"
    )
    print(f"padded batches: {padder}")
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(pairs))
    need = (args.steps + 1) * args.pairs
    if need > len(pairs):
        ap.error(f"{args.steps + 1} steps of {args.pairs} pairs need {need} pairs; raise --limit")
    steps = [[pairs[i] for i in order[s * args.pairs : (s + 1) * args.pairs]] for s in range(args.steps + 1)]

    sides = {
        "packed": Side("packed", vocab, register_train_attention(), args, packed_row),
        "padded": Side("padded", vocab, "sdpa", args, lambda p: padded_batch(p, pad_id, use_trl)),
    }
    first = {name: side.step(steps[0], timed=False) for name, side in sides.items()}  # warm-up, same weights
    gap = abs(first["packed"] - first["padded"])
    print(
        f"step 1 (untimed, the same weights and pairs): loss packed {first['packed']:.6f}, padded {first['padded']:.6f}"
    )
    if not gap <= 1e-4:
        raise SystemExit(f"the two sides disagree on the first step's DPO loss by {gap:.2e}: not the same objective")
    real = slots_padded = scores_packed = scores_padded = 0
    for s, batch in enumerate(steps[1:]):
        names = ["packed", "padded"] if s % 2 == 0 else ["padded", "packed"]
        for name in names:
            sides[name].step(batch)
        real += sum(len(x) for pair in batch for x in pair)
        longest = max(len(x) for pair in batch for x in pair)
        slots_padded += 2 * len(batch) * longest
        scores_packed += sum(len(x) ** 2 for pair in batch for x in pair)
        scores_padded += 2 * len(batch) * longest**2
    rows = []
    for name, side in sides.items():
        total = float(np.sum(side.step_s))
        rows.append(
            {
                "side": name,
                "steps": len(side.step_s),
                "real": real,
                "slots": real if name == "packed" else slots_padded,
                "collate_ms": 1e3 * float(np.mean(side.collate_s)),
                "step_ms": 1e3 * float(np.median(side.step_s)),
                "tokens_per_s": real / total,
            }
        )
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / rows[1]["tokens_per_s"]
        r["bound"] = slots_padded / r["slots"]
        r["attention_bound"] = scores_padded / (scores_packed if r["side"] == "packed" else scores_padded)
    body = formatted_table(rows, COLUMNS)
    print()
    print(body)
    print(f"\n1-min load average at the end {load_average():.2f}")
    if not args.no_results:
        title = (
            f"Issue 42, item 7: DPO steps (sigmoid, beta {BETA}; policy forward + backward, frozen reference forward, "
            f"AdamW) on {args.pairs} preference pairs a step, packed into one row (sftpack) against padded and "
            f"concatenated into one [2B, S] batch ({padder}), on two copies of one seeded Llama (dim {args.dim}, "
            f"{args.layers} layers, float32, CPU, {args.threads} torch thread(s); packed under sftpack's training "
            f"attention, padded under Hugging Face's sdpa with the attention mask). Pairs: the first {args.limit} "
            f"conversations of the embedded corpus, each its last assistant turn (chosen) against the next "
            f"conversation's (rejected) after its history (the prompt), Qwen tokenizer, ChatML; {dropped} pairs over "
            f"{args.max_len} tokens dropped; sequence lengths median {int(np.median(lengths))}, p90 "
            f"{int(np.percentile(lengths, 90))}. The step-1 losses agree (packed {first['packed']:.6f}, padded "
            f"{first['padded']:.6f}; reference of another seed). Real tokens/s over {args.steps} timed steps per side, "
            "interleaved. Slot bound: padded slots / real tokens (what packing saves on per-slot work); attention "
            "bound: the padded batch's attention scores (2B x S^2) / the packed row's (sum of L^2), what it saves on "
            "attention. The ratio lands between them by attention's share of the step."
        )
        write_section(__file__, body, where, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
