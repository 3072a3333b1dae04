"""FSDP2 (``TrainConfig.fsdp``, ``sftpack train --fsdp``): two real processes (gloo on
CPU) whose model, gradients and AdamW moments are sharded train like one process
without FSDP, on the trainer path (the same global batches) and on the loader path
(against one process training unpacked on the conversations the two ranks saw);
a checkpoint under FSDP is today's format, and a run stopped and resumed equals the
straight run bit for bit; one process runs FSDP too (a one-rank group), and its
checkpoint resumes without FSDP and a plain checkpoint with it.

Tolerance: float64, a fixed 1e-10, derived in tests/loop/test_equality.py (the same
function in another summation order: one step's loss moves by at most 1.5e-11, and
AdamW's amplified rounding after the steps stays near 4.5e-14). FSDP adds, to DDP's
gradient all-reduce (tests/loop/test_distributed.py), only operations of the same
kinds: the all-gather of a parameter is a copy (exact), the reduce-scatter sums the
two ranks' gradients (one rounding per element) and divides by 2 (exact), and the
clipping norm sums each rank's squares and then the two sums (the same terms in
another order): the count of roundings behind a number does not grow, so the same
bound holds. A sharding bug (both ranks training on rank 0's share) moves the loss by
more than 1e-3, 1e7x the tolerance (the negative control).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from sftpack.loop import CheckpointError, ReplaySource, build_model, make_source, train
from sftpack.loop._fsdp import full_state
from tests.helpers import TINY_VOCAB, tiny_config, tiny_model, tiny_samples, train_args
from tests.loop.conftest import run_ranks

WORLD = 2
STEPS = 8
TOL = 1e-10  # float64: test_equality.py's bound; FSDP adds no longer rounding chain (see the docstring)
BUG = 1e-3  # what the negative control must move the loss by, at least
F64 = torch.float64


def _config(packing="trainer", **kw):
    extra = dict(batch_size=2, buffer_size=16) if packing == "loader" else dict(batch_size=8)
    return tiny_config(packing=packing, steps=STEPS, pad_multiple=2, eval_every=4, **extra, **kw)


def _held_out():
    """Every run evaluates these after steps 4 and 8 (through the sharded root under FSDP)."""
    return tiny_samples(6, seed=5)


def _run(cfg, rank, world, model=None, **kw):
    source = make_source(cfg, samples=tiny_samples(), rank=rank, world=world)
    model = tiny_model(dtype=F64) if model is None else model
    return train(cfg, source=source, model=model, eval_samples=_held_out(), **kw)


def _two_rank_worker(rank: int, init_file: str, root: str) -> None:
    """The runs of two FSDP ranks: straight (checkpoints every 3 steps), stopped after 5
    and resumed, the loader path, and the negative control; rank 0 saves what it saw."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        out: dict = {}
        cfg = _config(fsdp=True, checkpoint_every=3)
        straight = _run(cfg, rank, WORLD, checkpoint_dir=f"{root}/straight")
        _run(cfg, rank, WORLD, checkpoint_dir=f"{root}/stopped", stop_after=5)
        resumed = _run(cfg, rank, WORLD, checkpoint_dir=f"{root}/stopped", resume=True)
        loader = _run(_config("loader", fsdp=True), rank, WORLD)
        control = _run(_config(fsdp=True), 0, WORLD)  # a sharding bug: both ranks train on rank 0's share
        for name, r in (("straight", straight), ("resumed", resumed), ("loader", loader), ("control", control)):
            out[name] = {
                "losses": r.losses,
                "evals": [x.eval_loss for x in r.logs],
                "micro_batches": [x.micro_batches for x in r.logs],
                "resumed_from": r.resumed_from,
                "conversations": r.conversations,
                "params": full_state(r.model),  # every rank takes part; rank 0 gets the tensors
            }
        emb = straight.model.get_input_embeddings().weight  # sharded: this rank holds half of its rows
        out["sharded"] = (type(emb).__name__, tuple(emb.to_local().shape), tuple(emb.shape))
        torch.save(out, f"{root}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_process_worker(rank: int, root: str) -> None:
    """One process, no group: ``train`` starts a one-rank group for FSDP. A straight FSDP
    run; an FSDP run stopped after 5 whose step-3 checkpoint resumes without FSDP, and the reverse."""
    torch.set_num_threads(1)
    cfg = _config(fsdp=True, checkpoint_every=3)
    straight = _run(cfg, 0, 1)
    _run(cfg, 0, 1, checkpoint_dir=f"{root}/one", stop_after=5)
    plain = _run(_config(checkpoint_every=3), 0, 1, checkpoint_dir=f"{root}/one", resume=True)
    _run(_config(checkpoint_every=3), 0, 1, checkpoint_dir=f"{root}/other", stop_after=5)
    sharded = _run(cfg, 0, 1, checkpoint_dir=f"{root}/other", resume=True)  # a plain checkpoint, resumed sharded
    wider = build_model(TINY_VOCAB, dim=32, layers=2, heads=2, kv_heads=1, dtype=F64)
    try:  # another model's checkpoint, refused as without FSDP
        _run(cfg, 0, 1, model=wider, checkpoint_dir=f"{root}/other", resume=True)
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    torch.save(
        {
            "straight": {"losses": straight.losses, "params": full_state(straight.model)},
            "plain": {"losses": plain.losses, "resumed_from": plain.resumed_from, "params": plain.model.state_dict()},
            "sharded": {"losses": sharded.losses, "resumed_from": sharded.resumed_from},
            "sharded_params": full_state(sharded.model),
            "group": dist.is_initialized() and dist.get_world_size(),
            "refused": refused,
        },
        f"{root}/one.pt",
    )


@pytest.fixture(scope="module")
def one_rank():
    """One process without FSDP (the reference). Run first: the forked ranks inherit its imports."""
    cfg = _config()
    return train(
        cfg, source=make_source(cfg, samples=tiny_samples()), model=tiny_model(dtype=F64), eval_samples=_held_out()
    )


@pytest.fixture(scope="module")
def two(tmp_path_factory, one_rank):
    root = tmp_path_factory.mktemp("fsdp2")
    run_ranks(_two_rank_worker, (str(root / "init"), str(root)), WORLD)
    return torch.load(root / "rank0.pt", weights_only=False), torch.load(root / "rank1.pt", weights_only=False), root


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, one_rank):
    root = tmp_path_factory.mktemp("fsdp1")
    run_ranks(_one_process_worker, (str(root),), 1)
    return torch.load(root / "one.pt", weights_only=False)


def _param_diff(full: dict, model) -> float:
    ref = model.state_dict()
    assert full.keys() == ref.keys()
    return max(float((full[k] - ref[k].detach()).abs().max()) for k in ref)


def _loss_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_two_fsdp_ranks_train_like_one_rank(two, one_rank):
    r0, r1, _ = two
    a, b = r0["straight"], r1["straight"]
    for step, (x, y, both) in enumerate(zip(a["conversations"], b["conversations"], one_rank.conversations)):
        assert x and y and sorted(x + y) == sorted(both), f"step {step}: the ranks together did not see the batch"
    assert max(a["micro_batches"]) >= 2  # accumulation: no gradient sync but after a step's last micro-batch
    dl, dp = _loss_diff(a["losses"], one_rank.losses), _param_diff(a["params"], one_rank.model)
    print(f"FSDP 2 ranks vs 1 rank, float64: max |dloss| {dl:.1e}, max |dparam| {dp:.1e} (tolerance {TOL:.0e})")
    assert dl <= TOL and dp <= TOL, (dl, dp)
    evals = [x.eval_loss for x in one_rank.logs]
    assert evals[3] is not None and evals[7] is not None
    assert all((x is None) == (y is None) for x, y in zip(a["evals"], evals))
    assert _loss_diff([x for x in a["evals"] if x], [y for y in evals if y]) <= TOL  # the held-out token mean
    assert b["params"] == {}  # the full state is gathered to rank 0 only
    kind, mine, whole = r0["sharded"]
    assert kind == "DTensor" and mine[0] == -(-whole[0] // WORLD) and mine[1:] == whole[1:]  # rank 0's rows
    assert one_rank.losses[-1] < one_rank.losses[0]


def test_negative_control_unsharded_fsdp_ranks(two, one_rank):
    dl = _loss_diff(two[0]["control"]["losses"], one_rank.losses)
    print(f"unsharded FSDP ranks: max |dloss| {dl:.1e} = {dl / TOL:.1e} x the tolerance")
    assert dl > BUG, dl


def test_two_fsdp_ranks_loader_path_equals_unpacked(two):
    r0, r1, _ = two
    steps = [x + y for x, y in zip(r0["loader"]["conversations"], r1["loader"]["conversations"])]
    by_id = {s.conversation_id: s for s in tiny_samples()}
    cfg = _config("none")
    ref = train(
        cfg,
        source=ReplaySource([[by_id[c] for c in s] for s in steps]),
        model=tiny_model(dtype=F64),
        eval_samples=_held_out(),
    )
    dl, dp = _loss_diff(r0["loader"]["losses"], ref.losses), _param_diff(r0["loader"]["params"], ref.model)
    print(f"FSDP loader, 2 ranks vs unpacked: max |dloss| {dl:.1e}, max |dparam| {dp:.1e}")
    assert dl <= TOL and dp <= TOL, (dl, dp)


def test_fsdp_resume_is_exact_and_checkpoints_are_whole(two, one_rank):
    r0, _, root = two
    straight, resumed = r0["straight"], r0["resumed"]
    assert resumed["resumed_from"] == 3
    assert resumed["losses"] == straight["losses"][3:]  # bit for bit
    assert resumed["evals"] == straight["evals"][3:]
    assert all(torch.equal(resumed["params"][k], straight["params"][k]) for k in straight["params"])
    state = torch.load(root / "straight" / "step_000006" / "state.pt", weights_only=False)
    plain = one_rank.model.state_dict()
    assert state["model"].keys() == plain.keys()  # today's format: full tensors under the model's names
    assert all(state["model"][k].shape == plain[k].shape for k in plain)
    assert sorted(state["optimizer"]["state"]) == list(range(len(plain)))  # keyed by index, like opt.state_dict()
    assert state["optimizer"]["state"][0]["exp_avg"].shape == plain["model.embed_tokens.weight"].shape


def test_one_process_fsdp(one_process, one_rank):
    assert one_process["group"] == 1  # train() started a one-rank group
    assert "holds another model's weights" in one_process["refused"] and "--dim" in one_process["refused"]
    straight = one_process["straight"]
    dl, dp = _loss_diff(straight["losses"], one_rank.losses), _param_diff(straight["params"], one_rank.model)
    assert dl <= TOL and dp <= TOL, (dl, dp)
    plain = one_process["plain"]  # the FSDP checkpoint of step 3, resumed without FSDP
    assert plain["resumed_from"] == 3
    dl = _loss_diff(plain["losses"], one_rank.losses[3:])
    dp = _param_diff(plain["params"], one_rank.model)
    assert dl <= TOL and dp <= TOL, (dl, dp)
    sharded = one_process["sharded"]  # a checkpoint written without FSDP, resumed with it
    assert sharded["resumed_from"] == 3
    dl = _loss_diff(sharded["losses"], one_rank.losses[3:])
    dp = _param_diff(one_process["sharded_params"], one_rank.model)
    assert dl <= TOL and dp <= TOL, (dl, dp)


def test_fsdp_refuses_a_model_without_layers():
    from sftpack.loop._fsdp import decoder_layers

    with pytest.raises(ValueError, match="cannot find the decoder layers of Linear"):
        decoder_layers(torch.nn.Linear(2, 2))


def _cli_worker(rank: int, argv: list, rc_file: str) -> None:
    from sftpack.cli import main

    torch.set_num_threads(1)
    with open(rc_file, "w") as f:
        f.write(str(main(argv)))


def test_cli_fsdp_one_process_saves_the_whole_model(chat, tmp_path):
    """``sftpack train --fsdp`` on one process (the default SmallLlama): the step-3 checkpoint
    holds the full weights, and ``--save-model`` writes them (gathered from the shards)."""
    from transformers import AutoModelForCausalLM

    ckpt, out = tmp_path / "ckpt", tmp_path / "model"
    more = ["--fsdp", "--device", "cpu", "--num-proc", "1", "--save-model", str(out)]
    more += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    argv = train_args(chat / "chat.jsonl", *more, tokenizer=chat / "tok", steps=3, max_seq_len=256, layers=2)
    run_ranks(_cli_worker, (argv, str(tmp_path / "rc")), 1)  # its own process: the one-rank group dies with it
    assert (tmp_path / "rc").read_text() == "0"
    final = torch.load(ckpt / "step_000003" / "state.pt", weights_only=False)["model"]
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(loaded) == set(final) and len(final) == 2 * 9 + 3  # 9 tensors a layer; embedding, norm, head
    assert all(torch.equal(v, final[k]) for k, v in loaded.items())


def test_cli_fsdp_refuses_image_data(capsys):
    from sftpack.cli import main

    assert main(["train", "--corpus", "vqa", "--fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--fsdp trains text models only" in err
