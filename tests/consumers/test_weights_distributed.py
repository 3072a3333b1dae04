"""Two real processes (gloo on CPU): a weighted step over 2 data-parallel ranks, each
accumulating gradients over micro-batches, equals the same step on one process, every
conversation alone with its weights (sftpack.loss's one rule: sum(w * loss) / sum(|w|) over the
whole step's targets, the denominator all-reduced by count_label_tokens).

Rank 1 holds a micro-batch built from samples without weights (its row has weights None): every
rank passes weighted=True, so all ranks all-reduce a float64 weighted count.

float64, to a fixed 1e-10: the derivation is tests/consumers/test_weights.py's (the all-reduces
add one rounding per value). Negative control: each rank normalising by its own sum |w| (then
the ranks averaged) moves the loss by more than 1e-3.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sftpack import IGNORE_INDEX, PackedBatch, Sample
from sftpack.exactness import TinyCausalLM, random_samples, reference_labels
from sftpack.loss import count_label_tokens, token_losses, token_mean_loss
from tests.loop.conftest import run_ranks

VOCAB = 97
WORLD = 2
TOL = 1e-10  # float64; see the docstring
BUG = 1e-3
F64 = torch.float64
LENGTHS = [23, 5, 17, 9, 31, 2, 12, 7, 19, 4]
# rank -> micro-batches -> sample indices; rank 1's last micro-batch holds samples without weights
PLAN = {0: [[0, 1], [2, 3, 4]], 1: [[5, 6], [7, 9]]}
UNWEIGHTED = {7, 9, 8}


def _samples() -> list[Sample]:
    rng = np.random.default_rng(11)
    out = []
    for i, s in enumerate(random_samples(LENGTHS, VOCAB, seed=7)):
        w = None if i in UNWEIGHTED else rng.uniform(-1.5, 2.0, len(s))
        out.append(Sample(s.input_ids, s.loss_mask, s.conversation_id, weights=w))
    return out


def _target_weights(s: Sample) -> torch.Tensor:
    lab = reference_labels(s)
    w = torch.ones(len(s), dtype=F64) if s.weights is None else torch.as_tensor(s.weights, dtype=F64)
    out = torch.zeros(len(s), dtype=F64)
    out[:-1] = w[1:]
    return torch.where(lab != IGNORE_INDEX, out, torch.zeros_like(out))


def _step(rank: int) -> dict[str, float]:
    samples = _samples()
    model = TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=F64)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # averages gradients over the ranks
    mine = [PackedBatch.from_samples([samples[i] for i in mb], pad_multiple=4).validate() for mb in PLAN[rank]]
    assert (mine[-1].weights is None) == (rank == 1)
    n = count_label_tokens(mine, weighted=True)  # all-reduced over the world group
    step_loss = torch.zeros((), dtype=F64)
    own = torch.zeros((), dtype=F64)  # the negative control: this rank's own weighted mean
    for i, b in enumerate(mine):
        with ddp.no_sync() if i < len(mine) - 1 else _null():
            logits = ddp(b.input_ids, b.position_ids, b.to_packed_seq_params())
            loss = token_mean_loss(logits, b, n, average_over_ranks=WORLD)
            loss.backward()
        step_loss += loss.detach() / WORLD
        own += token_losses(logits.detach(), b).sum()
    dist.all_reduce(step_loss)
    per_rank = own / count_label_tokens(mine, weighted=True, group=False) / WORLD
    dist.all_reduce(per_rank)

    # the same step on one process, every conversation alone, over the samples the plan used
    ref = TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=F64)
    used = [i for r in PLAN.values() for mb in r for i in mb]
    sums, mass = [], []
    for i in used:
        s = samples[i]
        logits = ref(torch.as_tensor(s.input_ids), torch.arange(len(s)), None)
        ce = F.cross_entropy(logits, reference_labels(s), ignore_index=IGNORE_INDEX, reduction="none")
        w = _target_weights(s)
        sums.append((w * ce).sum())
        mass.append(w.abs().sum())
    ref_loss = torch.stack(sums).sum() / torch.stack(mass).sum()
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    return {
        "loss_diff": abs(float(step_loss) - float(ref_loss)),
        "count_diff": abs(float(n) - float(torch.stack(mass).sum())),
        "grad_diff": max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters())),
        "per_rank_mean_diff": abs(float(per_rank) - float(ref_loss)),
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _worker(rank: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        result = _step(rank)
        if rank == 0:
            Path(out_file).write_text(json.dumps(result))
        dist.barrier()  # both ranks done before either tears gloo down
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_ranks_weighted_equal_one(tmp_path):
    out = tmp_path / "result.json"
    run_ranks(_worker, (str(tmp_path / "init"), str(out)), WORLD)  # forked; a hang fails after 600 s
    r = json.loads(out.read_text())
    print("2-rank weighted differences:", r)
    for key in ("loss_diff", "count_diff", "grad_diff"):
        assert r[key] <= TOL, r
    assert r["per_rank_mean_diff"] > BUG, r
