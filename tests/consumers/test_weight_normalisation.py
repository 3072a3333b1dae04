"""The one weighted-loss rule and its three choices (sftpack.loss.normalise_weights): token,
sequence and group means, each equal to its definition computed sequence by sequence, whatever
micro-batches the sequences were split into and in whatever order.

Each sequence gets its own fixed logits, so a packed micro-batch's slots hold exactly the
logits the sequence has alone: the only thing that differs between a split and the definition
is the order of the sums and the coefficients' roundings.

Tolerance, float64: 1e-12. Per target, the coefficient ``w / (S_i * n_g)`` is two roundings and
``c * loss`` one more; the micro-batch sums and the sum over micro-batches chain at most
T + 4 <= 300 additions (<= 240 targets here): a relative error of at most 300 * 1.1e-16 =
3.3e-14 on sum |c * loss| <= n * max(loss) (|c| sums to 1 per sequence or group, the losses are
below 10 with these logits), so below 3.3e-13 after the division by n (one more rounding); 1e-12
is 3x that. The definition's own sums add as much again, inside the same margin.

Negative control: normalising each micro-batch on its own (the mean of micro-batch means, the
bug prime-rl #1961 and Megatron-LM #7207 fixed) moves every rule by more than 1e-3 on a split.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sftpack import PackedBatch, Sample
from sftpack.exactness import random_samples, reference_labels
from sftpack.handoff import shard_for_cp
from sftpack.loss import normalise_weights, token_mean_loss
from sftpack.sample import WeightNormalisation

F64 = torch.float64
VOCAB = 31
TOL = 1e-12  # float64; see the docstring
BUG = 1e-3
LENGTHS = [23, 5, 17, 9, 31, 2, 12, 7, 19, 4, 26, 11]
# GRPO-style groups (a prompt's completions); None: a sequence of its own group
GROUPS = ["a", "a", "a", "b", "b", None, "c", "c", "c", "c", None, "d"]
RULES = [str(r) for r in WeightNormalisation]


def _samples() -> list[Sample]:
    """Weights of every kind: signed per token, one per sample, none at all, zero everywhere
    (sequence 6: its group c keeps 3 trained sequences), and a whole group at 0 (group d)."""
    rng = np.random.default_rng(5)
    out = []
    for i, s in enumerate(random_samples(LENGTHS, VOCAB, seed=3)):
        w: object = rng.uniform(-2.0, 2.5, len(s))
        if i in (2, 8):
            w = None
        elif i == 3:
            w = 1.5
        elif i in (6, 11):
            w = 0.0
        meta = {} if GROUPS[i] is None else {"group": GROUPS[i]}
        out.append(Sample(s.input_ids, s.loss_mask, i, meta, weights=w))
    return out


def _logits(samples: list[Sample]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randn(len(s), VOCAB, dtype=F64, generator=g) * 2 for s in samples]


def _group_numbers(samples: list[Sample]) -> list[int]:
    """Each sample's group, numbered in order of first appearance; no group: a number of its own."""
    numbered: dict[object, int] = {}
    return [numbered.setdefault(s.meta.get("group", ("own", i)), len(numbered)) for i, s in enumerate(samples)]


def definition(rule: str, samples: list[Sample], logits: list[torch.Tensor]) -> float:
    """The rule, sequence by sequence: each sequence's sum(w * loss) and sum |w| alone."""
    sums, masses = [], []
    for s, x in zip(samples, logits):
        lab = reference_labels(s)
        w = torch.ones(len(s), dtype=F64) if s.weights is None else torch.as_tensor(s.weights, dtype=F64)
        wt = torch.zeros(len(s), dtype=F64)
        wt[:-1] = w[1:]  # a slot's weight is its target's (the next token's)
        wt = torch.where(lab != -100, wt, torch.zeros_like(wt))
        loss = F.cross_entropy(x, lab.clamp_min(0), reduction="none")
        sums.append(float((wt * loss).sum()))
        masses.append(float(wt.abs().sum()))
    if rule == "token":
        return sum(sums) / sum(masses)
    means = {i: sums[i] / masses[i] for i in range(len(samples)) if masses[i] > 0}
    if rule == "sequence":
        return sum(means.values()) / len(means)
    groups: dict[int, list[float]] = {}
    for i, g in enumerate(_group_numbers(samples)):
        if i in means:
            groups.setdefault(g, []).append(means[i])
    return sum(sum(v) / len(v) for v in groups.values()) / len(groups)


def packed(rule: str, samples, logits, split: list[list[int]], *, per_batch: bool = False) -> float:
    """The rule's value from packed micro-batches ``split`` (lists of sample indices), each
    micro-batch's token_mean_loss over the one global n; ``per_batch``: the negative control,
    every micro-batch normalised on its own and the micro-batch values averaged."""
    numbers = _group_numbers(samples)
    batches, xs, groups = [], [], []
    for mb in split:
        b = PackedBatch.from_samples([samples[i] for i in mb], pad_multiple=4)
        x = torch.randn(b.num_tokens, VOCAB, dtype=F64) * 5  # padding slots: anything
        for k, i in enumerate(mb):
            start = int(b.cu_seqlens_padded[k])
            x[start : start + len(samples[i])] = logits[i]
        batches.append(b)
        xs.append(x)
        groups.append([numbers[i] for i in mb])
    kw = {"sequence_groups": groups, "num_groups": max(numbers) + 1} if rule == "group" else {}
    if per_batch:
        vals = []
        for b, x, g in zip(batches, xs, groups):
            one = {"sequence_groups": [g], "num_groups": kw["num_groups"]} if kw else {}
            [c], n = normalise_weights([b], rule, group=False, **one)
            vals.append(float(token_mean_loss(x, c, n)))
        return sum(vals) / len(vals)
    coefs, n = normalise_weights(batches, rule, group=False, **kw)
    assert n.dtype == F64 and (rule == "token" or float(n) == int(n))  # a counted denominator
    return float(sum(token_mean_loss(x, c, n) for x, c in zip(xs, coefs)))


def _splits() -> list[list[list[int]]]:
    n = len(LENGTHS)
    rng = np.random.default_rng(1)
    out = [[list(range(n))], [[i] for i in range(n)]]  # one row; every sequence alone
    for k in (2, 3, 5):
        order = rng.permutation(n)
        cuts = sorted(rng.choice(np.arange(1, n), size=k - 1, replace=False))
        out.append([p.tolist() for p in np.split(order, cuts)])
    return out


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_is_its_definition_however_split(rule):
    samples = _samples()
    logits = _logits(samples)
    want = definition(rule, samples, logits)
    torch.manual_seed(0)
    diffs = [abs(packed(rule, samples, logits, split) - want) for split in _splits()]
    print(f"{rule}: definition {want:.6f}, max |packed - definition| {max(diffs):.1e} (tolerance {TOL:.0e})")
    assert max(diffs) <= TOL, diffs
    # the negative control: each micro-batch its own mean, on the splits into several
    bug = [abs(packed(rule, samples, logits, split, per_batch=True) - want) for split in _splits()[2:]]
    assert min(bug) > BUG, bug


def test_the_rules_differ_and_token_is_today():
    """The three choices are three numbers here; "token" returns the batches untouched and the
    weighted count sum |w| (what the loop divided by before the choice existed)."""
    samples = _samples()
    logits = _logits(samples)
    values = [definition(r, samples, logits) for r in RULES]
    assert all(abs(a - b) > BUG for a, b in itertools.combinations(values, 2)), values
    b = PackedBatch.from_samples(samples)
    [same], n = normalise_weights([b], "token", group=False)
    assert same is b and float(n) == float(b.weights.abs().sum())


def test_groups_span_micro_batches():
    """A group's n_g counts its trained sequences in every micro-batch of the step (group a's three
    members in three micro-batches: each coefficient divides by 3, not by 1)."""
    samples = _samples()[:3]
    [b0, b1, b2], n = normalise_weights(
        [PackedBatch.from_samples([s]) for s in samples],
        "group",
        sequence_groups=[[0], [0], [0]],
        num_groups=1,
        group=False,
    )
    assert float(n) == 1.0
    for c in (b0, b1, b2):
        assert abs(float(c.weights.abs().sum()) - 1 / 3) <= 1e-15  # |c| of each sequence sums to 1 / n_g


def test_refusals():
    b = PackedBatch.from_samples(_samples()[:4], pad_multiple=4)
    with pytest.raises(ValueError, match="normalise='mean' is not valid: choose one of 'token', 'sequence', 'group'"):
        normalise_weights([b], "mean", group=False)
    with pytest.raises(ValueError, match="give sequence_groups"):
        normalise_weights([b], "group", group=False)
    with pytest.raises(ValueError, match=r"sequence_groups\[0\] has 3 numbers but batch 0 holds 4 sequences"):
        normalise_weights([b], "group", sequence_groups=[[0, 1, 2]], num_groups=3, group=False)
    with pytest.raises(ValueError, match=r"outside \[0, num_groups=2\)"):
        normalise_weights([b], "group", sequence_groups=[[0, 1, 2, 1]], num_groups=2, group=False)
    shard = shard_for_cp(b, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="context-parallel shard"):
        normalise_weights([shard], "sequence", group=False)
