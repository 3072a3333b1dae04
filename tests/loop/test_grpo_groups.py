"""GRPO-style groups (a prompt's N completions, ``Sample.meta["group"]``, each with its own
advantage) kept whole on the trainer path (issue 42 items 2 and 5): each step draws whole groups
(``--batch-size`` counts conversations; :class:`~sftpack.loop._sources.GroupOrder`), each group lands in
one micro-batch of one rank (``plan_microbatches(groups=)``), and the loss under every
``weight_normalisation`` equals each conversation run alone, over grad accumulation and 2 gloo ranks.

Tolerance, float64: 1e-10, tests/loop/test_weighted_train.py's derivation (one step's loss off by
at most 3.8e-11 with the weights and the rule's coefficients; 1e-10 is 2.6x that). Negative
control: "group" moves step 1's loss from the token mean and from "sequence" by more than 1e-3.
"""

from __future__ import annotations

import json
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sftpack import Sample
from sftpack.loop import make_source, train
from sftpack.loop._sources import GroupOrder
from tests.helpers import WeightedAlone as Alone
from tests.helpers import max_loss_diff, max_param_diff, tiny_config, tiny_model, tiny_samples, with_groups
from tests.helpers import weighted_cli_args as _cli
from tests.helpers import weighted_rule_by_hand as rule_by_hand
from tests.helpers import weighted_samples as weighted
from tests.loop.conftest import run_ranks

F64 = torch.float64
TOL = 1e-10  # float64; see the docstring
BUG = 1e-3
SIZE = 4  # completions per prompt


def grpo(samples: list[Sample]) -> list[Sample]:
    """Groups of SIZE consecutive conversations ("p0", "p1", ...), every 9th conversation alone (no group)."""
    return with_groups(samples, lambda i: None if i % 9 == 8 else f"p{i // SIZE}")


def config(**kw):
    # a group of SIZE conversations of <= 60 tokens fits one micro-batch of 256
    return tiny_config(packing="trainer", pad_multiple=4, batch_size=8, micro_batch_tokens=256, **kw)


def members(data: list[Sample]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for s in data:
        if s.meta.get("group") is not None:
            out.setdefault(s.meta["group"], set()).add(s.conversation_id)
    return out


def test_steps_and_micro_batches_hold_whole_groups():
    data = grpo(weighted(tiny_samples(48)))
    groups = members(data)
    src = make_source(config(grad_accum=2), samples=data)
    assert src.whole_groups
    for _ in range(12):  # more than an epoch
        step = src.next_step()
        numbers, n = src.step_groups
        assert len(step) == 2 and sum(len(x) for x in numbers) <= 8
        for g in range(n):  # each group of the step in exactly one micro-batch
            assert sum(g in x for x in numbers) == 1
        ids = {c for mb in step for c in mb.sequence_ids}
        for name, convs in groups.items():  # a group drawn is drawn whole
            assert not (convs & ids) or convs <= ids, name
    # resumes where it was: the same next steps
    state = src.state_dict()
    after = [[c for mb in src.next_step() for c in mb.sequence_ids] for _ in range(3)]
    again = make_source(config(grad_accum=2), samples=data)
    again.load_state_dict(state)
    assert [[c for mb in again.next_step() for c in mb.sequence_ids] for _ in range(3)] == after
    # data without groups: drawn and fingerprinted as before groups existed
    plain = make_source(config(grad_accum=2), samples=weighted(tiny_samples(48)))
    assert not plain.whole_groups and plain.fingerprint() != src.fingerprint()


def test_group_order():
    o = GroupOrder([3, 1, 2, 2], batch_size=4, seed=1)
    seen = [o.take().tolist() for _ in range(6)]
    assert all(sum([3, 1, 2, 2][u] for u in step) <= 4 for step in seen)
    assert o.epoch_steps() >= 2
    with pytest.raises(ValueError, match=r"group 'g' has 5 conversations, more than --batch-size 4.*at least 5"):
        GroupOrder([5, 1], batch_size=4, seed=0, name=lambda u: "'g'")
    with pytest.raises(ValueError, match="batch_size=4 is more than the 3 conversations"):
        GroupOrder([2, 1], batch_size=4, seed=0)


def _equal_alone(make_config, data: list[Sample], rule: str, grad_accum: int, steps: int) -> None:
    """A run of ``data`` (whole groups) equals each conversation alone under ``rule``, step 1 equals
    the rule by hand, and (``group``) differs from the other rules on the same step."""
    cfg = make_config(grad_accum=grad_accum, weight_normalisation=rule, steps=steps)
    run = train(cfg, source=make_source(cfg, samples=data), model=tiny_model(dtype=F64))
    by_id = {s.conversation_id: s for s in data}
    steps_of = [[by_id[c] for c in step] for step in run.conversations]
    assert all(sum(s.meta.get("group") is not None for s in step) >= SIZE for step in steps_of)
    ref_cfg = make_config(weight_normalisation=rule, steps=steps)
    ref = train(ref_cfg, source=Alone(steps_of), model=tiny_model(dtype=F64))
    dl, dp = max_loss_diff(run.losses, ref.losses), max_param_diff(run.model, ref.model)
    print(f"{cfg.packing}, whole groups, {rule}, grad_accum {grad_accum}: max |dloss| {dl:.2e}, max |dparam| {dp:.2e}")
    assert dl <= TOL and dp <= TOL, (dl, dp)
    by_hand = rule_by_hand(tiny_model(dtype=F64), steps_of[0], rule)
    assert abs(run.losses[0] - by_hand) <= TOL, (run.losses[0], by_hand)
    if rule == "group":  # negative controls: the other rules on the same step
        for other in ("token", "sequence"):
            assert abs(run.losses[0] - rule_by_hand(tiny_model(dtype=F64), steps_of[0], other)) > BUG


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("rule", ["token", "sequence", "group"])
def test_whole_groups_equal_each_conversation_alone(rule, grad_accum):
    _equal_alone(config, grpo(weighted(tiny_samples(48))), rule, grad_accum, steps=5)


WORLD = 2


def _rank_worker(rank: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        cfg = config(weight_normalisation="group", steps=2)
        src = make_source(cfg, samples=grpo(weighted(tiny_samples(48))), rank=rank, world=WORLD)
        run = train(cfg, source=src, model=tiny_model(dtype=F64))
        out = {"losses": run.losses, "params": [p.detach() for p in run.model.parameters()]}
        out["conversations"] = run.conversations
        torch.save(out, f"{out_file}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_gloo_ranks_equal_one_with_whole_groups(tmp_path):
    data = grpo(weighted(tiny_samples(48)))
    cfg = config(weight_normalisation="group", steps=2)
    one = train(cfg, source=make_source(cfg, samples=data), model=tiny_model(dtype=F64))
    out = str(tmp_path / "rank")
    run_ranks(_rank_worker, (str(tmp_path / "init"), out), WORLD)
    two = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    groups = members(data)
    for a, b, z in zip(two[0]["conversations"], two[1]["conversations"], one.conversations):
        assert sorted(a + b) == sorted(z)
        for convs in groups.values():  # each group on one rank only
            assert not (convs & set(a) and convs & set(b))
    dl = max_loss_diff(two[0]["losses"], one.losses)
    dp = max(float((p - q.detach()).abs().max()) for p, q in zip(two[0]["params"], one.model.parameters()))
    print(f"whole groups, 2 ranks vs 1: max |dloss| {dl:.1e}, max |dparam| {dp:.1e} (tolerance {TOL:.0e})")
    assert dl <= TOL and dp <= TOL, (dl, dp)


def _grpo_jsonl(chat, path, *, group: bool) -> None:
    """The ``chat`` fixture's 40 conversations as 10 prompts' 4 completions, each with an advantage."""
    rows = [json.loads(line) for line in (chat / "chat.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["advantage"] = [1.5, -0.5, -1.0, 0.25][i % 4]
        if group:
            r["group"] = i // 4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_cli_trains_grpo_groups(chat, tmp_path, capsys):
    """``sftpack train`` of a JSONL with 'group' + 'advantage' under ``--weight-normalisation group``:
    step 1 trains two whole groups (its targets are theirs: GroupOrder's first two groups), a loss other
    than the same file without its groups; a group larger than --batch-size refused in one line."""
    from sftpack.chat import tokenize_conversation
    from sftpack.cli import main
    from sftpack.testing import tiny_chat_tokenizer

    (tmp_path / "tok").symlink_to(chat / "tok")
    run = tmp_path / "run"
    run.mkdir()
    for group in (True, False):
        _grpo_jsonl(chat, tmp_path / f"g{group}.jsonl", group=group)
        args = [*_cli(tmp_path / f"g{group}.jsonl", run, f"g{group}"), "--weight-normalisation", "group"]
        args[args.index("--batch-size") + 1] = "8"
        args[args.index("--max-seq-len") + 1] = "1024"  # a group of 4 in one micro-batch (its width)
        assert main(args) == 0
    g, s = ([json.loads(line) for line in (run / f"{n}.jsonl").read_text().splitlines()] for n in ("gTrue", "gFalse"))
    assert [r["step"] for r in g] == [1, 2] and all(np.isfinite(r["loss"]) for r in g)
    tok = tiny_chat_tokenizer("chatml")
    rows = [json.loads(line) for line in (tmp_path / "gTrue.jsonl").read_text().splitlines()]
    targets = [int(tokenize_conversation(r, tok).loss_mask[1:].sum()) for r in rows]
    first = GroupOrder([4] * 10, batch_size=8, seed=0).take()  # the run's seed: 0
    assert g[0]["label_tokens"] == sum(targets[4 * u + k] for u in first.tolist() for k in range(4))
    assert abs(g[0]["loss"] - s[0]["loss"]) > 1e-5  # other conversations, another mean
    capsys.readouterr()
    args = _cli(tmp_path / "gTrue.jsonl", run, "small")
    args[args.index("--batch-size") + 1] = "3"
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "group 0 has 4 conversations, more than --batch-size 3" in err and "at least 4" in err


def test_cli_refuses_a_group_after_a_first_row_without_one(chat, tmp_path, capsys):
    """Whether a file is drawn by whole groups is read from its first row: a later row with a
    'group' in a file whose first row has none is refused in one line, naming the fix."""
    from sftpack.cli import main

    (tmp_path / "tok").symlink_to(chat / "tok")
    run = tmp_path / "run"
    run.mkdir()
    rows = [json.loads(line) for line in (chat / "chat.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows[1:], start=1):
        r["group"] = i // 4
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(_cli(tmp_path / "mixed.jsonl", run, "mixed")) != 0
    err = capsys.readouterr().err
    assert "has a 'group'" in err and "the data's first conversation has none" in err


def loader_config(**kw):
    # rows of 256 slots: a group of SIZE conversations of <= 60 tokens fits one row whole
    return tiny_config(packing="loader", pad_multiple=4, batch_size=2, buffer_size=16, max_seq_len=256, **kw)


def consecutive(data: list[Sample]) -> list[Sample]:
    """``data`` with each group's members one after the other (the loader reads a group as a run of
    consecutive samples), in order of the group's first member; a conversation of no group stays."""
    first: dict[object, int] = {}
    keys = [first.setdefault(s.meta.get("group", ("own", i)), i) for i, s in enumerate(data)]
    return [data[i] for i in sorted(range(len(data)), key=lambda i: (keys[i], i))]


def test_loader_rows_hold_whole_groups():
    """The loader path (``groups=True`` from the samples' groups): every group lands whole in one
    row, and the source numbers the step's groups for ``weight_normalisation="group"``."""
    data = consecutive(grpo(weighted(tiny_samples(48))))
    groups = members(data)
    src = make_source(loader_config(grad_accum=2), samples=data)
    for _ in range(8):
        step = src.next_step()
        numbers, n = src.step_groups
        assert [len(x) for x in numbers] == [len(mb.sequence_ids) for mb in step]
        for g in range(n):  # each of the step's groups in exactly one micro-batch (a row)
            assert sum(g in x for x in numbers) == 1
        for mb in step:
            ids = set(mb.sequence_ids)
            for name, convs in groups.items():
                assert not (convs & ids) or convs <= ids, name


@pytest.mark.parametrize("rule", ["sequence", "group"])
def test_loader_groups_equal_each_conversation_alone(rule):
    _equal_alone(loader_config, consecutive(grpo(weighted(tiny_samples(48)))), rule, grad_accum=2, steps=4)
