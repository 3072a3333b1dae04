"""Preference pairs packed: per-sequence log-probabilities and the DPO loss are exact (issue 42, items 3, 4, 6).

Three pairs (a prompt, then a chosen and a rejected answer, the prompt untrained) packed into
rows with padding between the sequences (``pad_multiple=4``), partners apart in the row. The
policy and the frozen reference are two tiny float64 Hugging Face Llamas (different seeds).
Packed: one forward per micro-batch of each model, each sequence's summed log-probability read
from the packed boundaries (``sequence_logprob_sums``), the pairs matched by their group and
role (``pairs_of``), ``dpo_loss``, each micro-batch's share over the global pair count
(``count_pairs``, ``pair_mean``). Alone: every sequence through the same models as its own
``(1, L)`` batch, its log-probability gathered from ``log_softmax`` at the independently built
labels (``reference_labels``), and the DPO loss written out as ``log1p(exp(-z))``. Three
consumer forms (Hugging Face kwargs under Hugging Face's own sdpa, which finds the segments
from the restarting positions: the padded boundary mode; sftpack's varlen training attention
in both boundary modes), and two groupings (one row; two micro-batches of whole pairs). The
``PackedSeqParams`` form (sftpack's plain-PyTorch ``TinyCausalLM``, both modes) is checked for
the per-sequence sums; flash-attn's kwargs need CUDA and are not run here.

Tolerance, fixed: 1e-9 in float64. Derivation: per logit, each side is within
n*u*20 = 2e3 * 1.1e-16 * 20 = 4.4e-12 of the exact value (tests/consumers/test_exactness.py:
the same model, the same function in other summation orders, n <= 2e3 roundings on values
below 20), so two sides differ by <= 8.8e-12. A token's log-probability is the target logit
minus the log-sum-exp over 97 ids; the log-sum-exp moves by at most the largest logit
difference and adds its own 97 roundings (97 * 1.1e-16 * 20 = 2e-13): <= 1.8e-11 per token.
A sequence sum over <= 16 targets (asserted): <= 2.9e-10, under 1e-9. The DPO loss of a pair
is 1-Lipschitz in its argument ``beta * (4 sums)``, beta = 0.1: <= 0.4 * 2.9e-10 = 1.2e-10
per pair and for their mean. Gradients: sigmoid weights (<= 1) times beta times sums of
<= 16 per-token gradients per sequence, four sequences a pair, over 3 pairs: the same 2e3-term
chains on gradient entries below 1 (asserted < 1): well under 1e-9 by the same count.
Measured differences are ~1e-14 (printed).

Negative controls, each moving the loss by more than BUG = 1e-5 (1e4 x TOL): the row run as
one causal sequence (boundaries dropped: an all-ones attention mask, so the sequences attend to
each other), and the pairs matched to the wrong partner (each chosen answer against the next
group's rejected one).

Here the loss is checked against its written-out formula; the cross-check against TRL's own
DPO loss (``trl.DPOTrainer.compute_loss``) is ``tests/consumers/test_trl_dpo.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from sftpack import IGNORE_INDEX, PackedBatch, Sample
from sftpack.attention import TRAIN_ATTENTION, register_train_attention
from sftpack.exactness import TinyCausalLM, alone_text_logits, packed_text_logits, reference_labels, tiny_llama
from sftpack.handoff import shard_for_cp
from sftpack.loss import sequence_logprob_means, sequence_logprob_sums, sequence_loss_sums
from sftpack.objectives import (
    CHOSEN,
    REJECTED,
    Pairs,
    count_pairs,
    dpo_loss,
    pair_mean,
    pair_sequences,
    pairs_of,
    simpo_loss,
)

pytest.importorskip("transformers")

VOCAB = 97
F64 = torch.float64
BETA = 0.1
TOL = 1e-9  # float64; see the docstring
BUG = 1e-5  # measured: boundaries dropped 2.6e-3, wrong partner 1.9e-4
PAD_MULTIPLE = 4
# (prompt, chosen answer, rejected answer) lengths of the three pairs
LENGTHS = ((5, 6, 3), (8, 4, 7), (3, 9, 5))
# the row's order: partners apart
ORDER = ("p0-chosen", "p1-rejected", "p2-chosen", "p0-rejected", "p1-chosen", "p2-rejected")
SPLITS = {"one row": [ORDER], "two micro-batches": [ORDER[:1] + ORDER[2:4] + ORDER[5:], ORDER[1:2] + ORDER[4:5]]}
ROUTES = ("hf_kwargs", "varlen_real", "varlen_padded")


def preference_samples() -> dict[str, Sample]:
    """Each pair's two sequences share their prompt; ids in 1..96 (0 is the pad id)."""
    rng = np.random.default_rng(42)
    out = {}
    for k, (lp, lc, lr) in enumerate(LENGTHS):
        prompt = rng.integers(1, VOCAB, lp)
        for role, la in ((CHOSEN, lc), (REJECTED, lr)):
            answer = rng.integers(1, VOCAB, la)
            sid = f"p{k}-{role}"
            out[sid] = Sample(
                np.concatenate([prompt, answer]),
                np.r_[np.zeros(lp, bool), np.ones(la, bool)],
                conversation_id=sid,
                meta={"group": f"p{k}", "role": role},
            )
    return out


SAMPLES = preference_samples()
META = {sid: s.meta for sid, s in SAMPLES.items()}


def row_of(ids: tuple[str, ...] | list[str], pad_multiple: int = PAD_MULTIPLE) -> PackedBatch:
    return PackedBatch.from_samples([SAMPLES[i] for i in ids], pad_multiple=pad_multiple).validate()


@functools.cache
def _model(seed: int):
    register_train_attention()
    return tiny_llama(VOCAB, attn_implementation="sdpa", seed=seed, dtype=F64)


def policy():
    return _model(0)


def reference():
    return _model(1)


def packed_logits(model, row: PackedBatch, route: str) -> torch.Tensor:
    """The row's ``(T, V)`` logits through one consumer form."""
    model.config._attn_implementation = "sdpa" if route == "hf_kwargs" else TRAIN_ATTENTION
    try:
        return packed_text_logits(model, row, pad_between_seqs=route == "varlen_real")
    finally:
        model.config._attn_implementation = "sdpa"


def boundaries_dropped(model, row: PackedBatch) -> torch.Tensor:
    """Negative control: an all-ones mask turns off Hugging Face's packed detection; one causal run."""
    ones = torch.ones(1, row.num_tokens, dtype=torch.long)
    return model(
        input_ids=row.input_ids[None], position_ids=row.position_ids[None], attention_mask=ones, use_cache=False
    ).logits[0]


def alone_logps(model, sid: str) -> torch.Tensor:
    """One sequence's summed log-probability of its trained tokens, run alone; no sftpack reduction."""
    s = SAMPLES[sid]
    lab = reference_labels(s)
    assert int((lab != IGNORE_INDEX).sum()) <= 16  # the premise of TOL
    logp = torch.log_softmax(alone_text_logits(model, s), dim=-1)
    keep = lab != IGNORE_INDEX
    return logp[keep].gather(1, lab[keep][:, None]).sum()


def grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def run_alone() -> dict:
    """The DPO loss of the three pairs, every sequence alone, the formula written out."""
    pol, ref = policy(), reference()
    pol.zero_grad(set_to_none=True)
    with torch.no_grad():
        r = {sid: alone_logps(ref, sid) for sid in SAMPLES}
    p = {sid: alone_logps(pol, sid) for sid in SAMPLES}
    z = torch.stack(
        [
            BETA * ((p[f"p{k}-chosen"] - r[f"p{k}-chosen"]) - (p[f"p{k}-rejected"] - r[f"p{k}-rejected"]))
            for k in range(len(LENGTHS))
        ]
    )
    loss = torch.log1p(torch.exp(-z)).mean()
    loss.backward()
    chosen = torch.stack([BETA * (p[f"p{k}-chosen"] - r[f"p{k}-chosen"]) for k in range(len(LENGTHS))])
    return {
        "loss": loss.detach(),
        "grads": grads(pol),
        "logps": {k: v.detach() for k, v in p.items()},
        "chosen_rewards": chosen.detach(),
        "margins": z.detach(),
    }


def run_packed(split: list, route: str, *, wrong_partner: bool = False, leak: bool = False) -> dict:
    """One step: each micro-batch packed, both models run packed, the loss shares summed."""
    pol, ref = policy(), reference()
    pol.zero_grad(set_to_none=True)
    rows = [row_of(ids) for ids in split]
    pairs = [pairs_of(row, META) for row in rows]
    if wrong_partner:
        pairs = [Pairs(p.chosen, p.rejected.roll(1), p.groups) for p in pairs]
    n = count_pairs(pairs, group=False)
    total = torch.zeros((), dtype=F64)
    logps, chosen_rewards, margins = {}, {}, {}
    for row, pr in zip(rows, pairs):
        forward = (lambda m, b: boundaries_dropped(m, b)) if leak else (lambda m, b: packed_logits(m, b, route))
        lp, counts = sequence_logprob_sums(forward(pol, row), row)
        with torch.no_grad():
            rp, _ = sequence_logprob_sums(forward(ref, row), row)
        out = dpo_loss(lp[pr.chosen], lp[pr.rejected], rp[pr.chosen], rp[pr.rejected], beta=BETA)
        loss = pair_mean(out.losses, n)
        loss.backward()
        total = total + loss.detach()
        logps.update(zip(row.sequence_ids, lp.detach()))
        chosen_rewards.update(zip(pr.groups, out.chosen_rewards))
        margins.update(zip(pr.groups, out.margins))
    order = [f"p{k}" for k in range(len(LENGTHS))]
    return {
        "loss": total,
        "grads": grads(pol),
        "logps": logps,
        "chosen_rewards": torch.stack([chosen_rewards[g] for g in order]),
        "margins": torch.stack([margins[g] for g in order]),
    }


@functools.cache
def alone() -> dict:
    return run_alone()


def _diffs(packed: dict, ref: dict) -> dict[str, float]:
    return {
        "loss": abs(float(packed["loss"] - ref["loss"])),
        "grads": max(float((a - b).abs().max()) for a, b in zip(packed["grads"], ref["grads"])),
        "logps": max(abs(float(packed["logps"][k] - ref["logps"][k])) for k in SAMPLES),
        "rewards": float((packed["chosen_rewards"] - ref["chosen_rewards"]).abs().max()),
        "margins": float((packed["margins"] - ref["margins"]).abs().max()),
    }


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("route", ROUTES)
def test_packed_dpo_equals_each_sequence_alone(route, split):
    ref = alone()
    assert max(float(g.abs().max()) for g in ref["grads"]) < 1  # the premise of TOL
    assert float(ref["grads"][0].abs().max()) > 0  # the loss reaches the weights
    d = _diffs(run_packed(SPLITS[split], route), ref)
    print(f"{route}, {split}: {d}")
    assert all(v <= TOL for v in d.values()), d  # written so that a NaN fails


@pytest.mark.parametrize("control", ["boundaries dropped", "wrong partner"])
def test_negative_controls_move_the_loss(control):
    ref = alone()
    bad = run_packed(
        SPLITS["one row"], "varlen_real", leak=control == "boundaries dropped", wrong_partner=control == "wrong partner"
    )
    moved = abs(float(bad["loss"] - ref["loss"]))
    print(f"negative control {control}: the loss moves by {moved:.2e} = {moved / TOL:.1e} x TOL")
    assert moved > BUG


def test_hf_kwargs_and_varlen_attention_give_the_same_sums():
    """The consumer form changes how the model is called, not what the reduction reads: the
    per-sequence sums from Hugging Face's kwargs (its sdpa) and from sftpack's varlen attention
    agree, in both boundary modes, on a row whose segments carry padding."""
    row = row_of(ORDER)
    assert int((row.padded_seqlens - row.seqlens).max()) > 0
    with torch.no_grad():
        sums = {route: sequence_logprob_sums(packed_logits(policy(), row, route), row) for route in ROUTES}
    for route in ROUTES[1:]:
        assert torch.equal(sums[route][1], sums["hf_kwargs"][1])
        assert float((sums[route][0] - sums["hf_kwargs"][0]).abs().max()) <= TOL, route
    # the counts are each sequence's trained tokens: its answer's length (the prompt is untrained)
    assert sums["hf_kwargs"][1].tolist() == [SAMPLES[i].loss_mask.sum() for i in ORDER]


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
def test_packed_seq_params_form_gives_each_sequence_alone(pad_between_seqs):
    """Megatron's form: ``PackedSeqParams`` into sftpack's plain-PyTorch causal LM (its attention
    takes the boundaries as Transformer Engine does); the sums equal each sequence alone."""
    model = TinyCausalLM(vocab_size=VOCAB, seed=0, dtype=F64)
    row = row_of(ORDER)
    with torch.no_grad():
        logits = model(row.input_ids, row.position_ids, row.to_packed_seq_params(pad_between_seqs=pad_between_seqs))
        lp, _ = sequence_logprob_sums(logits, row)
        for j, sid in enumerate(ORDER):
            s = SAMPLES[sid]
            lab = reference_labels(s)
            keep = lab != IGNORE_INDEX
            alone_logits = model(torch.as_tensor(s.input_ids), torch.arange(len(s)), None)
            want = torch.log_softmax(alone_logits, -1)[keep].gather(1, lab[keep][:, None]).sum()
            assert abs(float(lp[j] - want)) <= TOL, sid


def test_logprob_sums_are_minus_the_loss_sums_and_the_means_divide():
    row = row_of(ORDER)
    logits = torch.randn(row.num_tokens, VOCAB, dtype=F64, generator=torch.Generator().manual_seed(3))
    lp, n = sequence_logprob_sums(logits, row)
    ls, n2 = sequence_loss_sums(logits, row)
    assert torch.equal(lp, -ls) and torch.equal(n, n2)
    assert torch.equal(sequence_logprob_means(logits, row), lp / n.to(F64))


def test_simpo_packed_equals_alone():
    """The reference-free variant on length-normalised log-probs, packed vs alone (same TOL:
    a mean divides the sum's error by its count)."""
    pol = policy()
    pol.zero_grad(set_to_none=True)
    row = row_of(ORDER)
    pr = pairs_of(row, META)
    means = sequence_logprob_means(packed_logits(pol, row, "varlen_real"), row)
    out = simpo_loss(means[pr.chosen], means[pr.rejected], beta=2.0, gamma=1.0)
    pair_mean(out.losses, count_pairs(pr, group=False)).backward()
    packed = grads(pol)
    pol.zero_grad(set_to_none=True)
    m = {sid: alone_logps(pol, sid) / int(SAMPLES[sid].loss_mask.sum()) for sid in SAMPLES}
    z = torch.stack([2.0 * (m[f"p{k}-chosen"] - m[f"p{k}-rejected"]) - 1.0 for k in range(len(LENGTHS))])
    loss = torch.log1p(torch.exp(-z)).mean()
    loss.backward()
    assert abs(float(out.losses.detach().mean() - loss.detach())) <= TOL
    assert max(float((a - b).abs().max()) for a, b in zip(packed, grads(pol))) <= TOL


def test_dpo_loss_by_hand():
    """Two pairs worked by hand: z = beta * ((pc - rc) - (pr - rr))."""
    pc, pr_, rc, rr = (torch.tensor(v, dtype=F64) for v in ([-3.0, -2.0], [-5.0, -1.0], [-4.0, -2.0], [-4.0, -2.0]))
    out = dpo_loss(pc, pr_, rc, rr, beta=0.5)
    # pair 0: z = 0.5 * (1 - (-1)) = 1; pair 1: z = 0.5 * (0 - 1) = -0.5
    assert torch.allclose(out.losses, torch.tensor([np.log1p(np.exp(-1.0)), np.log1p(np.exp(0.5))], dtype=F64))
    assert out.chosen_rewards.tolist() == [0.5, 0.0] and out.rejected_rewards.tolist() == [-0.5, 0.5]
    assert out.reward_accuracies.tolist() == [1.0, 0.0] and out.margins.tolist() == [1.0, -0.5]
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(pc, pr_, rc, rr, beta=0)
    with pytest.raises(ValueError, match="one \\(P,\\) tensor per role"):
        dpo_loss(pc, pr_[:1], rc, rr)


def test_the_pair_shares_sum_to_the_mean_over_micro_batches():
    """count_pairs over the micro-batches: the shares of any per-pair value sum to its mean."""
    rows = [row_of(ids) for ids in SPLITS["two micro-batches"]]
    pairs = [pairs_of(r, META) for r in rows]
    assert [len(p) for p in pairs] == [2, 1]
    n = count_pairs(pairs, group=False)
    assert int(n) == 3
    values = [torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([6.0], dtype=F64)]
    assert float(sum(pair_mean(v, n) for v in values)) == 3.0
    assert float(pair_mean(torch.zeros(0, dtype=F64), 0)) == 0.0  # no pairs: 0, not NaN


def test_pairs_are_found_by_group_and_role_and_half_pairs_are_refused():
    row = row_of(ORDER)
    p = pairs_of(row, META)
    assert p.groups == ("p0", "p1", "p2")
    assert p.chosen.tolist() == [0, 4, 2] and p.rejected.tolist() == [3, 1, 5]
    with pytest.raises(ValueError, match="group 'p0' has its 'chosen' sequence \\(0\\) but no 'rejected' one"):
        pairs_of(row_of(ORDER[:3]), META)
    with pytest.raises(ValueError, match="two 'chosen' sequences"):
        pair_sequences(["g", "g"], [CHOSEN, CHOSEN])
    with pytest.raises(ValueError, match="role 'completion'"):
        pair_sequences(["g"], ["completion"])
    with pytest.raises(ValueError, match="no meta\\['role'\\]"):
        pairs_of(row, {**META, "p1-rejected": {"group": "p1"}})
    with pytest.raises(ValueError, match="id 'p2-chosen', which the meta mapping lacks"):
        pairs_of(row, {k: v for k, v in META.items() if k != "p2-chosen"})
    bare = PackedBatch(
        row.input_ids, row.labels, row.position_ids, row.cu_seqlens, row.cu_seqlens_padded, row.max_seqlen
    )
    with pytest.raises(ValueError, match="carries no sequence_ids"):
        pairs_of(bare, META)


def test_a_cp_shard_needs_its_group_and_a_row_refuses_one():
    row = row_of(ORDER)
    shard = shard_for_cp(row, 2, 0)
    logits = torch.zeros(shard.num_tokens, VOCAB, dtype=F64)
    with pytest.raises(ValueError, match="context-parallel shard \\(cp_size=2, cp_rank=0\\).*pass cp_group="):
        sequence_logprob_sums(logits, shard)
    with pytest.raises(ValueError, match="cp_group given but packed is a whole row"):
        sequence_logprob_sums(torch.zeros(row.num_tokens, VOCAB), row, cp_group=object())  # type: ignore[arg-type]
    assert pairs_of(shard, META).chosen.tolist() == pairs_of(row, META).chosen.tolist()  # the shard keeps the ids


# ---------------------------------------------------------------- context parallelism, 2 gloo ranks
CP = 2


def _cp_worker(rank: int, init_file: str, out_file: str) -> None:
    """One CP rank: its shard through both models (local queries against every rank's keys and
    values, tests/handoff/test_cp_media.py's reference CP attention, the ``real`` mode), the
    per-sequence sums reassembled over the CP group, the DPO loss over the pairs counted over the
    group (each pair once per rank), its share backpropagated, the gradients summed over the ranks."""
    from datetime import timedelta

    import torch.distributed as dist

    from tests.handoff.test_cp_media import CP_ATTENTION, _register

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=CP, timeout=timedelta(seconds=300)
    )
    try:
        _register()
        shard = shard_for_cp(row_of(ORDER), CP, rank).validate()
        group = dist.group.WORLD

        def logits(model) -> torch.Tensor:
            model.config._attn_implementation = CP_ATTENTION
            try:
                kw = {"sftpack_cp_shard": shard, "sftpack_cp_real": True}
                ids, pos = shard.input_ids[None], shard.position_ids[None]
                return model(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits[0]
            finally:
                model.config._attn_implementation = "sdpa"

        pol, ref = policy(), reference()
        pol.zero_grad(set_to_none=True)
        lp, counts = sequence_logprob_sums(logits(pol), shard, cp_group=group)
        with torch.no_grad():
            rp, _ = sequence_logprob_sums(logits(ref), shard, cp_group=group)
        pr = pairs_of(shard, META)
        n = count_pairs(pr)  # over the CP group: each rank holds (and counts) every pair
        out = dpo_loss(lp[pr.chosen], lp[pr.rejected], rp[pr.chosen], rp[pr.rejected], beta=BETA)
        loss = pair_mean(out.losses, n)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        gs = grads(pol)
        for g in gs:
            dist.all_reduce(g)
        if rank == 0:
            torch.save({"loss": total, "grads": gs, "logps": lp.detach(), "counts": counts, "n": int(n)}, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_cp2_sums_and_dpo_equal_each_sequence_alone(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from tests.loop.conftest import run_ranks

    out = tmp_path / "cp.pt"
    run_ranks(_cp_worker, (str(tmp_path / "init"), str(out)), CP)
    got = torch.load(out)
    ref = alone()
    assert got["n"] == CP * len(LENGTHS)
    assert got["counts"].tolist() == [int(SAMPLES[i].loss_mask.sum()) for i in ORDER]
    d = {
        "logps": max(abs(float(got["logps"][j] - ref["logps"][sid])) for j, sid in enumerate(ORDER)),
        "loss": abs(float(got["loss"] - ref["loss"])),
        "grads": max(float((a - b).abs().max()) for a, b in zip(got["grads"], ref["grads"])),
    }
    print("CP=2 vs alone:", d)
    assert all(v <= TOL for v in d.values()), d
