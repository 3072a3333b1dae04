"""The tiny setup shared by the training tests: random conversations over a 97-id
vocabulary and a two-block Llama of width 16, small enough for many 20-step runs
per test file."""

from __future__ import annotations

import numpy as np
import torch

from sftpack import Sample
from sftpack.loop import TrainConfig, build_model

VOCAB = 97
MODEL = {"dim": 16, "layers": 2, "heads": 2, "kv_heads": 1}


def tiny_config(**kw) -> TrainConfig:
    base = dict(
        steps=20,
        batch_size=4,
        max_seq_len=128,
        lr=1e-2,
        warmup_steps=2,
        seed=0,
        **MODEL,
    )
    base.update(kw)
    return TrainConfig(**base)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32):
    return build_model(VOCAB, seed=seed, dtype=dtype, **MODEL)


def tiny_samples(n: int = 72, seed: int = 3) -> list[Sample]:
    """``n`` learnable conversations of 3-60 tokens with ids ``"c0"``, ``"c1"``, ...:
    an arithmetic progression mod 97 (random start, stride 1-3), the first third
    a prompt (not trained on)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n_tok in enumerate(rng.integers(3, 61, size=n)):
        ids = (int(rng.integers(VOCAB)) + int(rng.integers(1, 4)) * np.arange(n_tok)) % VOCAB
        out.append(Sample(ids, np.arange(n_tok) >= n_tok // 3, f"c{i}"))
    return out


def max_param_diff(a, b) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def max_loss_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))
