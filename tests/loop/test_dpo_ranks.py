"""Preference objectives (DPO, SimPO) through the training loop: two gloo ranks train like one
(trainer path), and step 1's gradients are those of the objective computed one sequence at a time
(every packed path: trainer, offline, loader).

Data: 16 synthetic preference pairs (ids an arithmetic progression mod 97, as
``tests.helpers.tiny_samples``): a prompt of 2-12 untrained tokens shared by the pair's two
answers of 1-24 trained tokens each, every sample ``meta={"group", "role", "group_size"}`` as
:func:`sftpack.chat.tokenize_pair` writes it. ``pad_multiple=4``, so rows hold padding slots
between sequences and the two boundary modes differ. Policy: the tiny float64 Llama (seed 0); DPO's
reference another one (seed 1, a saved folder: were it the starting weights, every log-ratio of
step 1 would be 0).

(a) Two ranks (forked, gloo, DDP) against one, DPO, 3 steps of 4 pairs (batch_size counts pairs):
the per-step losses and the parameters after the run agree within 1e-10. Derivation: as
tests/loop/test_distributed.py's (tests/loop/test_equality.py's bound: the same function in another
summation order, plus DDP's all-reduce and division by the world size, exact or one rounding
each); the pair count is an int64 all-reduce (exact), and each pair's loss is 1-Lipschitz in
beta * (four sums), beta = 0.1 < 1, so DPO moves no bound up. Measured: printed. Negative control:
both ranks train rank 0's share: the losses move by more than 1e-3.

(b), (c) Step 1's gradients, read by a part of the loop (``train(parts=)``; clipping off), equal the
gradients of the objective computed by hand one sequence at a time, each sequence its own
unpacked ``(1, L)`` forward (``log_softmax`` at its next tokens where the mask trains them; DPO:
``log1p(exp(-z))``, ``z = beta * ((pc - rc) - (pr - rr))``; SimPO: ``z = beta * (mc - mr) - gamma``
on the mean log-probabilities), the mean over the step's pairs, for both boundary modes; the step's
logged loss equals that loss. Tolerance 1e-9 (STEP_TOL) on both. Derivation, from
tests/loop/test_dpo_train.py's per-token bound: each side is the same float64 function in another
summation order (packed row vs alone); with this model's two layers (that file's has one) the chain
is at most twice as long, so a token's log-probability differs by <= 2 x 1.8e-11 = 3.6e-11. DPO: a
sum over <= 24 targets (asserted) is within 8.6e-10, and the pair loss is 1-Lipschitz in
beta * (four sums), beta = 0.1: <= 3.5e-10; SimPO: a mean is within the per-token bound, 3.6e-11,
and the loss is 1-Lipschitz in beta * (two means), beta = 2: <= 1.4e-10. Each gradient entry is the
same chain run backward (as many roundings again, factors <= 1 from the log-sigmoid and the
softmax): twice the bound, <= 6.9e-10, under 1e-9. Measured: 1e-16 (printed). Negative control:
the same loss by hand with the boundaries dropped (each micro-batch's row run as one sequence, the
same per-sequence sums read from it, as a packed row without boundaries gives: open-instruct
#1448) has gradients farther than 1e-5 from the loop's (measured 8.5e-3 DPO, 3.4e-2 SimPO).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sftpack import Sample
from sftpack.loop import TrainConfig, build_model, load_model, make_source, train
from sftpack.loop._model import _body_and_head
from sftpack.loop._parts import LoopState, Part, StepLog
from sftpack.loss import sequence_logprob_sums
from tests.helpers import TINY_MODEL, TINY_VOCAB, max_loss_diff, max_param_diff
from tests.loop.conftest import run_ranks

pytest.importorskip("transformers")

F64 = torch.float64
WORLD = 2
TOL = 1e-10  # float64, 2 ranks against 1; see the docstring
STEP_TOL = 1e-9  # float64, the packed step against each sequence alone; see the docstring
BUG = 1e-5
BUG_RANKS = 1e-3


def pair_samples(n: int = 16, seed: int = 5) -> list[Sample]:
    """``n`` preference pairs, each two samples of one conversation id (``p0``, ``p1``, ...)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = (int(rng.integers(TINY_VOCAB)) + np.arange(int(rng.integers(2, 13)))) % TINY_VOCAB
        for role in ("chosen", "rejected"):
            answer = int(rng.integers(TINY_VOCAB)) + int(rng.integers(1, 4)) * np.arange(int(rng.integers(1, 25)))
            ids = np.concatenate([prompt, answer % TINY_VOCAB]).astype(np.int64)
            mask = np.arange(len(ids)) >= len(prompt)
            out.append(Sample(ids, mask, f"p{i}", {"group": f"p{i}", "role": role, "group_size": 2}))
    return out


def config(objective: str = "dpo", reference: Any = None, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        packing="trainer",
        objective=objective,
        steps=3,
        batch_size=4,
        max_seq_len=64,
        pad_multiple=4,
        lr=1e-2,
        seed=0,
        **TINY_MODEL,
    )
    if reference is not None:
        base["reference_model"] = str(reference)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Any:
    folder = tmp_path_factory.mktemp("dpo-ranks") / "reference"
    build_model(TINY_VOCAB, seed=1, dtype=F64, **TINY_MODEL).save_pretrained(folder)
    return folder


def policy() -> Any:
    return build_model(TINY_VOCAB, seed=0, dtype=F64, **TINY_MODEL)


# ---------------------------------------------------------------------------------------- (a) ranks


def _worker(rank: int, init_file: str, out_file: str, reference: str, unsharded: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        cfg = config(reference=reference)
        source = make_source(cfg, samples=pair_samples(), rank=0 if unsharded else rank, world=WORLD)
        result = train(cfg, source=source, model=policy())
        torch.save(
            {
                "params": [p.detach() for p in result.model.parameters()],
                "losses": result.losses,
                "pairs": [r.pairs for r in result.logs],
                "conversations": result.conversations,
            },
            f"{out_file}.{rank}",
        )
        dist.barrier()  # both ranks done before either tears gloo down
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank(reference) -> Any:
    cfg = config(reference=reference)  # first: loads transformers before the ranks fork
    return train(cfg, source=make_source(cfg, samples=pair_samples()), model=policy())


def _two_ranks(tmp_path, reference, unsharded=False) -> tuple[dict[str, Any], dict[str, Any]]:
    out = str(tmp_path / "rank")
    run_ranks(_worker, (str(tmp_path / "init"), out, str(reference), unsharded), WORLD)
    return torch.load(f"{out}.0"), torch.load(f"{out}.1")


needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


@needs_gloo
def test_dpo_on_two_ranks_trains_like_one(tmp_path, reference, one_rank) -> None:
    r0, r1 = _two_ranks(tmp_path, reference)
    for step, (a, b, both) in enumerate(zip(r0["conversations"], r1["conversations"], one_rank.conversations)):
        assert a and b, f"step {step}: a rank got no pair"
        assert sorted(a + b) == sorted(both), f"step {step}: the ranks together did not see the global batch"
        groups_a, groups_b = {g for g, _ in a}, {g for g, _ in b}
        assert not groups_a & groups_b, f"step {step}: a pair was split over the ranks"
    assert r0["pairs"] == r1["pairs"] == [4, 4, 4] == [r.pairs for r in one_rank.logs]

    class Params:  # max_param_diff reads .parameters()
        def __init__(self, ps: list[torch.Tensor]) -> None:
            self.ps = ps

        def parameters(self) -> list[torch.Tensor]:
            return self.ps

    dl = max_loss_diff(r0["losses"], one_rank.losses)
    dp = max_param_diff(Params(r0["params"]), one_rank.model)
    print(f"dpo float64, 2 ranks vs 1: max |dloss| {dl:.1e}, max |dparam| {dp:.1e} (tolerance {TOL:.0e})")
    assert dl <= TOL and dp <= TOL, (dl, dp)
    assert r0["losses"] == r1["losses"]  # every rank logs the step's global loss
    assert not math.isclose(one_rank.losses[0], math.log(2), abs_tol=1e-6)  # the reference is not the policy


@needs_gloo
def test_negative_control_ranks_on_one_share(tmp_path, reference, one_rank) -> None:
    r0, _ = _two_ranks(tmp_path, reference, unsharded=True)
    dl = max_loss_diff(r0["losses"], one_rank.losses)
    print(f"dpo, both ranks on rank 0's share: max |dloss| {dl:.1e}")
    assert dl > BUG_RANKS, dl


# -------------------------------------------------------------------------- (b), (c) gradients, alone


class StepOneGrads(Part):
    """The loop's synchronised gradients of step 1 (clipping off: as the backward passes left them)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def on_step(self, state: LoopState, record: StepLog) -> None:
        if record.step == 1:
            self.grads = [p.grad.detach().clone() for p in state.model.parameters()]


def _logps(model: Any, s: Sample, *, grad: bool) -> tuple[torch.Tensor, int]:
    """One sequence's summed log-probability of its trained tokens, run alone; and its target count."""
    ids = torch.as_tensor(s.input_ids, dtype=torch.int64)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
        trained = torch.as_tensor(s.loss_mask[1:])
        return logp[trained].sum(), int(trained.sum())


def _objective(cfg: TrainConfig, scores: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The mean over pairs of DPO (``(pc, pr, rc, rr)`` sums) or SimPO (``(mc, mr)`` means), by hand."""
    losses = []
    for sc in scores:
        if cfg.objective == "dpo":
            pc, pr, rc, rr = sc
            z = cfg.beta * ((pc - rc) - (pr - rr))
        else:
            mc, mr = sc
            z = cfg.beta * (mc - mr) - cfg.gamma
        losses.append(torch.log1p(torch.exp(-z)))
    return torch.stack(losses).mean()


def _alone(cfg: TrainConfig, model: Any, ref: Any, pairs: list[tuple[Sample, Sample]]) -> torch.Tensor:
    scores: list[tuple[torch.Tensor, ...]] = []
    for chosen, rejected in pairs:
        (pc, nc), (pr, nr) = _logps(model, chosen, grad=True), _logps(model, rejected, grad=True)
        if cfg.objective == "dpo":
            scores.append((pc, pr, _logps(ref, chosen, grad=False)[0], _logps(ref, rejected, grad=False)[0]))
        else:
            scores.append((pc / nc, pr / nr))
    return _objective(cfg, scores)


def _no_boundaries(cfg: TrainConfig, model: Any, ref: Any, mbs: list[Any]) -> torch.Tensor:
    """The negative control: each micro-batch's row run as one sequence (no boundaries, positions
    0..T-1), each sequence's sums read from it at the row's boundaries, the same objective."""
    from sftpack.loop._preference import pairs_in

    def sums(m: Any, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        body, head = _body_and_head(m)
        logits = head(body(input_ids=mb.input_ids.reshape(1, -1), use_cache=False).last_hidden_state[0])
        return sequence_logprob_sums(logits, mb)

    scores: list[tuple[torch.Tensor, ...]] = []
    for mb in mbs:
        pairs = pairs_in(mb)
        logp, counts = sums(model, mb)
        with torch.no_grad():
            rlogp = sums(ref, mb)[0] if ref is not None else None
        for c, r in zip(pairs.chosen.tolist(), pairs.rejected.tolist()):
            if rlogp is not None:
                scores.append((logp[c], logp[r], rlogp[c], rlogp[r]))
            else:
                scores.append((logp[c] / counts[c], logp[r] / counts[r]))
    return _objective(cfg, scores)


def _grads(loss: torch.Tensor, model: Any) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(model.parameters())))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _source(cfg: TrainConfig, prepack: Any) -> Any:
    """The run's source: the pairs (trainer, loader), or their prepack (offline: rows of 2 x 64 slots)."""
    if cfg.packing == "offline":
        return make_source(cfg, prepacked=prepack)
    return make_source(cfg, samples=pair_samples())


@pytest.fixture(scope="module")
def prepack(tmp_path_factory) -> Any:
    from sftpack.offline import prepack_samples

    root = tmp_path_factory.mktemp("dpo-ranks-prepack")
    return prepack_samples(pair_samples(), root / "rows", max_seq_len=128, pad_multiple=4, seed=0).path


@pytest.mark.parametrize("packing", ["trainer", "offline", "loader"])
@pytest.mark.parametrize("boundaries", ["real", "padded"])
@pytest.mark.parametrize("objective", ["dpo", "simpo"])
def test_step_one_gradients_equal_the_objective_of_each_sequence_alone(
    reference, prepack, objective, boundaries, packing
) -> None:
    # trainer: batch_size counts pairs (4); offline and loader: rows (2, one a micro-batch)
    cfg = config(
        objective,
        reference=reference if objective == "dpo" else None,
        steps=1,
        grad_accum=2,
        clip_norm=None,
        boundaries=boundaries,
        packing=packing,
        batch_size=4 if packing == "trainer" else 2,
    )
    grads = StepOneGrads()
    out = train(cfg, source=_source(cfg, prepack), model=policy(), parts=[grads])
    rec = out.logs[0]
    if packing == "trainer":
        assert rec.pairs == 4 and rec.micro_batches >= 2 and rec.sequences == 8
    else:  # two rows of whole pairs
        assert rec.micro_batches == 2 and rec.pairs >= 2 and rec.sequences == 2 * rec.pairs
    by_id = {(s.meta["group"], s.meta["role"]): s for s in pair_samples()}
    groups = list(dict.fromkeys(g for g, _ in out.conversations[0]))
    pairs = [(by_id[(g, "chosen")], by_id[(g, "rejected")]) for g in groups]
    assert max(int(s.loss_mask[1:].sum()) for s in by_id.values()) <= 24  # the tolerance's derivation

    model = policy()  # the starting weights
    ref = load_model(str(reference), dtype=F64) if objective == "dpo" else None
    alone = _alone(cfg, model, ref, pairs)
    want = _grads(alone, model)
    dg, dl = _max_diff(grads.grads, want), abs(rec.loss - float(alone.detach()))
    # the control: the same micro-batches, their rows run without boundaries
    mbs = _source(cfg, prepack).next_step()
    control = _max_diff(_grads(_no_boundaries(cfg, model, ref, mbs), model), want)
    print(
        f"{packing}, {objective}, boundaries {boundaries}: max |dgrad| {dg:.1e}, |dloss| {dl:.1e} (tolerance {STEP_TOL:.0e}); "
        f"boundaries dropped: max |dgrad| {control:.1e}; max |grad| {max(float(g.abs().max()) for g in want):.1e}"
    )
    assert dg <= STEP_TOL and dl <= STEP_TOL, (dg, dl)
    assert control > BUG, control
    assert not math.isclose(rec.loss, math.log(2), abs_tol=1e-6)  # not a trivial step


def test_simpo_refuses_a_reference_and_dpo_a_margin(reference) -> None:
    with pytest.raises(ValueError, match="objective simpo is reference-free: leave reference_model out"):
        config("simpo", reference=reference)
    with pytest.raises(ValueError, match="gamma is SimPO's margin: leave it out with objective dpo"):
        config("dpo", gamma=0.5)
    assert (config("simpo").beta, config("simpo").gamma) == (2.0, 1.0)
    assert config("dpo").beta == 0.1 and config("dpo", beta=0.25).beta == 0.25
    assert "gamma" not in config("dpo").as_dict() and config("simpo", gamma=0.3).as_dict()["gamma"] == 0.3
