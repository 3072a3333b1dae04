"""Two real processes (gloo on CPU): data parallelism over 2 ranks gives the 1-rank
gradients, and context parallelism 2 reassembles the unsharded row exactly.

Each rank is a spawned process; a failed assertion in a rank fails the test with
that rank's traceback. The measured differences are written to a JSON file and
checked here, so the numbers are visible in a failure message.

Everything runs in float64, to a fixed 1e-10: the derivation is
tests/consumers/test_exactness.py's (the same function in other summation
orders; the all-reduces add one rounding per value). A negative control: the
per-rank mean (each rank normalising by its own count of targets, then the
ranks averaged) moves the loss by more than 1e-3.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from sftpack import IGNORE_INDEX, Sample
from sftpack.attention import varlen_attention
from sftpack.exactness import TinyCausalLM, random_samples, reference_labels
from sftpack.handoff import pad_multiple_for, segment_ids, shard_for_cp, unshard_cp
from sftpack.loss import count_label_tokens, token_losses, token_mean_loss
from sftpack.trainer import pack_step, plan_microbatches

VOCAB = 97
WORLD = 2
TOL = 1e-10  # float64; see the docstring
BUG = 1e-3
F64 = torch.float64


def _padded(samples: list[Sample]):
    S = max(len(s) for s in samples)
    ids = torch.zeros((len(samples), S), dtype=torch.long)
    mask = torch.zeros((len(samples), S), dtype=torch.bool)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.from_numpy(s.input_ids)
        mask[i, : len(s)] = torch.from_numpy(s.loss_mask)
    return ids, torch.tensor([len(s) for s in samples]), mask


def _max_grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p.grad - q.grad).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


# ---------------------------------------------------------------- data parallel
def _data_parallel(rank: int) -> dict[str, float]:
    lengths = [23, 5, 17, 9, 31, 2, 12, 7, 19, 4, 26, 11]
    samples = random_samples(lengths, VOCAB, seed=7)
    m = 4
    # balanced by attention cost: the ranks then hold unequal numbers of targets, which is when a
    # per-rank mean (the negative control) differs from the global one; a plan that evens the
    # tokens out would shrink the control's effect, not the exactness checked here
    plan = plan_microbatches(lengths, max_seq_len=48, dp_size=WORLD, pad_multiple=m, cost="attention")
    model = TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=F64)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # averages gradients over the ranks
    mine = [pack_step(*_padded([samples[i] for i in mb]), pad_multiple=m) for mb in plan[rank]]
    n = count_label_tokens(mine)  # all-reduced over the world group
    step_loss = torch.zeros((), dtype=F64)
    own_sum = torch.zeros((), dtype=F64)  # the negative control: this rank's own mean
    for i, b in enumerate(mine):
        last = i == len(mine) - 1
        ctx = ddp.no_sync() if not last else _null()
        with ctx:
            logits = ddp(b.input_ids, b.position_ids, b)
            loss = token_mean_loss(logits, b, n, average_over_ranks=WORLD)
            loss.backward()
        step_loss += loss.detach() / WORLD
        own_sum += token_losses(logits.detach(), b).sum()
    dist.all_reduce(step_loss)
    per_rank_mean = own_sum / sum(b.num_label_tokens for b in mine) / WORLD
    dist.all_reduce(per_rank_mean)

    # The same step on one rank, every conversation unpacked.
    ref = TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=F64)
    sums, count = [], 0
    for s in samples:
        lab = reference_labels(s)
        logits = ref(torch.as_tensor(s.input_ids), torch.arange(len(s)), None)
        sums.append(F.cross_entropy(logits, lab, ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((lab != IGNORE_INDEX).sum())
    ref_loss = torch.stack(sums).sum() / count
    ref_loss.backward()
    assert int(n) == count
    return {
        "dp_loss_diff": abs(float(step_loss) - float(ref_loss)),
        "dp_per_rank_mean_diff": abs(float(per_rank_mean) - float(ref_loss)),
        "dp_grad_diff": _max_grad_diff(model, ref),
        "dp_microbatches_per_rank": float(plan.num_microbatches),
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------- context parallel
class _AllGather(torch.autograd.Function):
    """All-gather along a new leading axis whose backward sums the gradient back
    to its owner (gloo has no reduce-scatter, so all-reduce and take our slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.stack(out)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g = g.contiguous()
        dist.all_reduce(g)
        return g[dist.get_rank()]


class _OneLayer(torch.nn.Module):
    """Embedding + learned positions + one attention layer + head."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.hd = heads, dim // heads
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Embedding(128, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)

    def qkv_of(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.emb(ids) + self.pos(pos)
        return self.qkv(x).view(ids.shape[0], 3, self.heads, self.hd).unbind(1)


def _context_parallel(rank: int) -> dict[str, float]:
    samples = random_samples([5, 10, 1, 22, 7], VOCAB, seed=11)
    a = pad_multiple_for(cp_size=WORLD)
    row = pack_step(*_padded(samples), pad_multiple=a.seq_multiple, max_seq_len=64)
    shard = shard_for_cp(row, WORLD, rank).validate()

    # The shard put back together from every rank's pieces is the row.
    pieces = {name: _AllGather.apply(getattr(shard, name)) for name in ("input_ids", "labels", "position_ids")}
    for name, stacked in pieces.items():
        assert torch.equal(unshard_cp(stacked, row, WORLD), getattr(row, name)), name

    # Ring-free context-parallel attention: local queries, all-gathered keys/values.
    model = _OneLayer().to(F64)
    q, k, v = model.qkv_of(shard.input_ids, shard.position_ids)
    k_full = unshard_cp(_AllGather.apply(k), row, WORLD)
    v_full = unshard_cp(_AllGather.apply(v), row, WORLD)
    seg = segment_ids(row)
    real = row.real_token_mask
    q_seg, q_pos = seg[shard.slot_index], shard.position_ids
    allowed = (seg[None, :] == q_seg[:, None]) & (row.position_ids[None, :] <= q_pos[:, None]) & real[None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k_full.transpose(0, 1), v_full.transpose(0, 1), attn_mask=allowed
    ).transpose(0, 1)
    logits = model.head(out.reshape(out.shape[0], -1))
    n = count_label_tokens(shard)  # summed over the CP group: the row's count
    loss = token_mean_loss(logits, shard, n)
    loss.backward()
    step_loss = loss.detach().clone()
    dist.all_reduce(step_loss)
    for p in model.parameters():  # each rank holds its chunks' share of the gradient
        dist.all_reduce(p.grad)
    out_full = unshard_cp(_AllGather.apply(out.detach()), row, WORLD)

    # The unsharded row on one rank.
    ref = _OneLayer().to(F64)
    rq, rk, rv = ref.qkv_of(row.input_ids, row.position_ids)
    r_out = varlen_attention(rq, rk, rv, row)
    r_logits = ref.head(r_out.reshape(r_out.shape[0], -1))
    r_loss = token_losses(r_logits, row).sum() / row.num_label_tokens
    r_loss.backward()
    assert int(n) == row.num_label_tokens
    return {
        "cp_out_diff": float((out_full[real] - r_out.detach()[real]).abs().max()),
        "cp_loss_diff": abs(float(step_loss) - float(r_loss)),
        "cp_grad_diff": _max_grad_diff(model, ref),
    }


# ---------------------------------------------------------------- harness
def _worker(rank: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        result = _data_parallel(rank)
        result.update(_context_parallel(rank))
        if rank == 0:
            Path(out_file).write_text(json.dumps(result))
        # both ranks done before either tears gloo down: a rank that left first once aborted its peer's
        # teardown under load (SIGABRT, "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_ranks_gloo(tmp_path):
    out = tmp_path / "result.json"
    ctx = mp.spawn(_worker, args=(str(tmp_path / "init"), str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 600  # a hang guard, not a speed check: a collective that waits forever must fail
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    os.kill(p.pid, 9)
            pytest.fail("the 2-rank run did not finish in 180 s")
    r = json.loads(out.read_text())
    print("2-rank differences:", r)
    assert r["dp_microbatches_per_rank"] >= 1
    for key in ("dp_loss_diff", "dp_grad_diff", "cp_out_diff", "cp_loss_diff", "cp_grad_diff"):
        assert r[key] <= TOL, r
    print(f"per-rank mean: {r['dp_per_rank_mean_diff']:.2e} = {r['dp_per_rank_mean_diff'] / TOL:.1e} x TOL")
    assert r["dp_per_rank_mean_diff"] > BUG, r
