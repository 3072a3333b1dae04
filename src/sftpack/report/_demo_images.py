"""The demo's image section (:func:`media_section`, section 5 of :func:`sftpack.report.demo.run_demo`).

easy-vqa conversations with images on a tiny Qwen2-VL: rows under a token and a
vision-patch budget drawn to scale with their image runs marked, every image and patch
accounted for, the packed loss, logits and gradients equal to each sample alone in
float64, and real tokens/s of packed rows against padded batches (:func:`step_times`,
which ``benchmarks/bench_media.py`` measures at length). Its numbers go to a
:class:`MediaSummary`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..binpack import pack
from ..handoff import PackedBatch
from ..handoff.payload import PatchMedia
from ..loop import compact_vocabulary, media_token_ids, padded_micro_batch
from ..loss import token_mean_loss
from ..multimodal import check_packed, family_for, plan_rows, tokenize_media_conversations, vqa_corpus
from ..sample import IGNORE_INDEX
from .layout import draw_row_to_scale

__all__ = ["EXACT_MM_64", "PAD_ID", "MediaSummary", "media_section", "step_times"]


#: Loss, logits and gradients packed vs alone, float64. The derivation is that of
#: tests/multimodal/test_exactness.py for the same model and image sizes (56-112 px a side, so
#: <= 64 patches an image, segments <= 90 tokens): the longest rounding chain of a forward and
#: backward pass is n <= 4,000 (the patch embedding's 1,176-term dot products, then width 32
#: over 2 vision and 2 text layers), so each run is off by <= n*u = 4.4e-13 relative (Higham,
#: section 3.1), the two by <= 8.9e-13, on values of magnitude <= 10 (checked as a premise):
#: <= 8.9e-12; 1e-10 is 11x that. A boundary bug moves logits by 1e-3 or more.
EXACT_MM_64 = 1e-10
#: Qwen2-VL's pad (``<|endoftext|>``): the rows' padding over the tokenizer's ids
PAD_ID = 151643


@dataclass
class MediaSummary:
    """What the multimodal section found (``sftpack_demo.json``'s ``multimodal``)."""

    conversations: int = 0
    samples: int = 0
    images: int = 0
    tokens: int = 0
    vision_tokens: int = 0
    patches: int = 0
    max_seq_len: int = 0
    max_patches: int = 0
    rows: int = 0  #: rows under both budgets
    rows_tokens_only: int = 0  #: rows under the token budget alone
    fill: float = 0.0  #: real tokens / row slots, both budgets
    fill_tokens_only: float = 0.0
    patches_max: int = 0  #: the heaviest row's patches, both budgets
    patches_max_tokens_only: int = 0
    exact: dict[str, dict[str, float]] = field(default_factory=dict)  #: boundary mode -> largest differences
    packed_tokens_per_s: float = 0.0
    padded_tokens_per_s: float = 0.0
    speedup: float = 0.0  #: median of per-step ratios, packed over padded
    first_rows: list[Any] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "first_rows"}
        out["tolerance"] = EXACT_MM_64
        return out


class _Compact:
    """Samples over the ids they use (:func:`~sftpack.loop.compact_vocabulary`, keeping the pad
    and the ids the model's config names: renumbered in sorted order, so the special tokens keep
    their roles), and a tiny Qwen2-VL for that vocabulary (plus one unused last id, what the
    config's video placeholder defaults to): a 151,657-row output head would cost more than
    everything packing changes. The pixels stay float32 (what the processor makes): a float64
    model's tower casts them exactly."""

    def __init__(self, samples: list[Any]) -> None:
        self.family = family_for()
        tok = self.family.tokenizer()
        named = media_token_ids(self.family, tok)
        self.samples, self.vocab = compact_vocabulary(samples, keep=[PAD_ID, *named.values()])
        self.ids = {"pad_id": self.id(PAD_ID), **{k: self.id(v) for k, v in named.items()}}

    def id(self, token_id: int) -> int:
        return int(np.searchsorted(self.vocab, token_id))

    def model(self, *, dtype: torch.dtype, seed: int, text_attention: str | None = None, **kw: Any) -> Any:
        media = {k: v for k, v in self.ids.items() if k != "pad_id"}
        return self.family.tiny_model(
            vocab_size=len(self.vocab) + 1, token_ids=media, seed=seed, dtype=dtype, text_attention=text_attention, **kw
        )


def _settings(quick: bool) -> dict[str, int]:
    return {
        "conversations": 48 if quick else 96,  # for the rows and the speed comparison
        "max_seq_len": 1024,
        "max_patches": 2048,
        "batch": 8,  # samples per training step
        "steps": 2 if quick else 4,  # timed steps per mode
    }


def media_section(checks: dict[str, bool], summary: MediaSummary, *, seed: int, quick: bool) -> Iterator[str]:
    """The section's lines; records its checks in ``checks`` and its numbers in ``summary``."""

    cfg = _settings(quick)
    t0 = time.perf_counter()
    family = family_for()
    tok, proc = family.tokenizer(), family.image_processor()
    yield (
        f"  Qwen2-VL's tokenizer (the embedded Qwen BPE + its special tokens) and image processor "
        f"(PIL/numpy) ({time.perf_counter() - t0:.1f} s)"
    )
    t0 = time.perf_counter()
    convs = list(vqa_corpus(seed=seed, limit=cfg["conversations"]))
    samples = list(tokenize_media_conversations(convs, tokenizer=tok, processor=proc, max_seq_len=cfg["max_seq_len"]))
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    patches = np.array([s.num_patches for s in samples], dtype=np.int64)
    vision = np.array([0 if s.media is None else s.media.num_placeholders for s in samples], dtype=np.int64)
    m = summary
    m.conversations, m.samples = len(convs), len(samples)
    m.images = sum(0 if s.media is None else s.media.num_items for s in samples)
    m.tokens, m.vision_tokens, m.patches = int(lengths.sum()), int(vision.sum()), int(patches.sum())
    m.max_seq_len, m.max_patches = cfg["max_seq_len"], cfg["max_patches"]
    yield (
        f"  corpus: {len(convs)} easy-vqa conversations (one or two images, each resized to a seeded 56-448 px a "
        f"side) -> {len(samples)} samples, {m.images} images, {m.tokens:,} tokens of which {m.vision_tokens:,} "
        f"vision placeholders, {m.patches:,} vision patches ({time.perf_counter() - t0:.1f} s)"
    )

    # Rows under two budgets: tokens (what the language model attends over) and patches
    # (what the vision tower runs on).
    width, budget = cfg["max_seq_len"], cfg["max_patches"]
    free = pack(lengths, width, "ffd")
    rows = plan_rows(lengths, patches, max_seq_len=width, max_patches_per_row=budget)
    built = [
        PackedBatch.from_samples([samples[i] for i in r], max_seq_len=width, pad_id=PAD_ID).validate() for r in rows
    ]
    row_patches = [0 if b.media is None else b.media.num_patches for b in built]
    free_patches = [int(patches[np.asarray(r)].sum()) for r in free]
    m.rows, m.rows_tokens_only = len(built), len(free)
    m.fill, m.fill_tokens_only = m.tokens / (len(built) * width), m.tokens / (len(free) * width)
    m.patches_max, m.patches_max_tokens_only = max(row_patches), max(free_patches)
    accounted = (
        sum(b.num_sequences for b in built) == len(samples)
        and sum(b.num_real_tokens for b in built) == m.tokens
        and sum(b.num_media_items for b in built) == m.images
        and sum(row_patches) == m.patches
        and sum(b.num_label_tokens for b in built) == sum(int(s.loss_mask[1:].sum()) for s in samples)
    )
    checks["multimodal: accounted"] = accounted
    checks["multimodal: patch budget held"] = m.patches_max <= budget
    yield (
        f"  rows of {width} tokens: {len(free)} rows ({m.fill_tokens_only:.1%} fill) on tokens alone, the heaviest "
        f"with {m.patches_max_tokens_only:,} patches; with a budget of {budget:,} patches per row "
        f"(sftpack.binpack's second budget): {len(built)} rows ({m.fill:.1%} fill), the heaviest with "
        f"{m.patches_max:,}"
    )
    yield f"  every sample, token, label, image and patch accounted for: {accounted}"
    scale = -(-width // 64)
    yield f"  the first rows to scale (one character = {scale} slots; a letter: a sample's text, #: its image):"
    for i, b in enumerate(built[:3]):
        yield f"    row {i}  {draw_row_to_scale(b, width=64)}  ({b.num_sequences} samples, {b.num_media_items} images)"
    m.first_rows = built[:3]

    # Exactness: a packed row against each sample alone, float64.
    yield from _exactness(checks, m, seed=seed)

    # Speed: packed rows against padded batches on the same tiny model.
    yield from _speed(samples, m, seed=seed, batch=cfg["batch"], steps=cfg["steps"])


def _exactness(checks: dict[str, bool], m: MediaSummary, *, seed: int) -> Iterator[str]:
    family = family_for()
    convs = list(vqa_corpus(seed=seed, limit=6, min_side=56, max_side=112))
    small = list(tokenize_media_conversations(convs, tokenizer=family.tokenizer(), processor=family.image_processor()))
    c = _Compact(small)
    t0 = time.perf_counter()
    model = c.model(dtype=torch.float64, seed=seed)
    for real, name in ((True, "real+padded"), (False, "padded-for-both")):
        r = check_packed(model, c.samples, pad_between_seqs=real, pad_multiple=4, pad_id=c.ids["pad_id"])
        premise = r.max_abs_logit < 10 and r.max_abs_grad < 10  # the tolerance's premise
        good = checks[f"multimodal: exact {name}"] = bool(premise and r.within(EXACT_MM_64))
        m.exact[name] = {
            "logits": r.logits,
            "loss": r.loss,
            "grads_language": r.grads["language"],
            "grads_vision": r.grads["vision"],
        }
        yield (
            f"  {len(small)} samples packed vs each alone (tiny Qwen2-VL, float64, {name}): max|dlogit| "
            f"{r.logits:.1e}, |dloss| {r.loss:.1e}, max|dgrad| language {r.grads['language']:.1e}, vision "
            f"{r.grads['vision']:.1e} -> {'equal' if good else 'NOT EQUAL'} (<= {EXACT_MM_64:.0e})"
        )
    yield (f"  ({time.perf_counter() - t0:.1f} s; the vision tower attends within each image: media.vision_cu_seqlens)")


def step_times(
    packed_model: Any,
    padded_model: Any,
    warm_up: list[Any],
    groups: list[list[Any]],
    *,
    pad_id: int,
    image_token_id: int,
) -> tuple[list[float], list[float]]:
    """Seconds of one training step (forward, backward, SGD at 1e-3) on each group of
    multimodal samples, packed in one row through ``packed_model`` (sftpack's varlen
    attention) and as a right-padded ``[B, S]`` batch through ``padded_model`` (Hugging
    Face sdpa and a mask), the two alternating step by step after one untimed step of each
    on ``warm_up``. Batch building is not timed."""
    family = family_for(packed_model)

    opt_a = torch.optim.SGD(packed_model.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(padded_model.parameters(), lr=1e-3)

    def packed_step(group: list[Any]) -> float:
        row = PackedBatch.from_samples(group, pad_id=pad_id)
        n = int(row.loss_mask.sum())
        t0 = time.perf_counter()
        opt_a.zero_grad()
        token_mean_loss(family.packed_logits(packed_model, row), row.labels, n).backward()
        opt_a.step()
        return time.perf_counter() - t0

    def padded_step(group: list[Any]) -> float:
        b = padded_micro_batch(group, pad_id=pad_id)  # labels: next-token targets within each row
        lab = b.labels
        n = int((lab != IGNORE_INDEX).sum())
        mask = (torch.arange(b.input_ids.shape[1])[None, :] < b.lengths[:, None]).long()
        assert isinstance(b.media, PatchMedia)  # a patch-sequence family's (Qwen2-VL's) media
        t0 = time.perf_counter()
        opt_b.zero_grad()
        out = padded_model(
            input_ids=b.input_ids,
            attention_mask=mask,
            pixel_values=b.media.pixel_values,
            image_grid_thw=b.media.grid_thw,
            mm_token_type_ids=(b.input_ids == image_token_id).to(torch.int32),
            use_cache=False,
        )
        token_mean_loss(out.logits.reshape(-1, out.logits.shape[-1]), lab.reshape(-1), n).backward()
        opt_b.step()
        return time.perf_counter() - t0

    packed_step(warm_up)
    padded_step(warm_up)
    t_a, t_b = [], []
    for g in groups:
        t_a.append(packed_step(g))
        t_b.append(padded_step(g))
    return t_a, t_b


def _speed(samples: list[Any], m: MediaSummary, *, seed: int, batch: int, steps: int) -> Iterator[str]:
    c = _Compact(samples)
    pad = c.ids["pad_id"]
    packed_model = c.model(dtype=torch.float32, seed=seed, dim=64, vision_dim=64)
    padded_model = c.model(dtype=torch.float32, seed=seed, dim=64, vision_dim=64, text_attention="sdpa")
    padded_model.load_state_dict(packed_model.state_dict())
    groups = [c.samples[i : i + batch] for i in range(0, batch * (steps + 1), batch)]
    groups = [g for g in groups if g]
    timed = groups[1:] or groups
    t_a, t_b = step_times(
        packed_model, padded_model, groups[0], timed, pad_id=pad, image_token_id=c.ids["image_token_id"]
    )
    real = [sum(len(s) for s in g) for g in timed]
    slots = [len(g) * max(len(s) for s in g) for g in timed]
    m.packed_tokens_per_s = statistics.median(r / t for r, t in zip(real, t_a))
    m.padded_tokens_per_s = statistics.median(r / t for r, t in zip(real, t_b))
    m.speedup = statistics.median(b / a for a, b in zip(t_a, t_b))
    yield (
        f"  training, {batch} samples a step (tiny Qwen2-VL, float32, fwd+bwd+SGD, {len(t_a)} steps each, "
        f"alternating): packed in one row (varlen attention, boundaries from cu_seqlens) "
        f"{m.packed_tokens_per_s:,.0f} real tokens/s, padded [B, S] (Hugging Face sdpa + mask; "
        f"{sum(real) / sum(slots):.0%} of its slots real) {m.padded_tokens_per_s:,.0f}: "
        f"{m.speedup:.2f}x (benchmarks/bench_media.py measures it at length)"
    )
