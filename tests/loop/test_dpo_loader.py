"""Preference pairs and per-token weights on the loader path (issue 42): ``--objective dpo --packing
loader`` and weighted SFT through ``--packing loader``.

DPO: ``sftpack train prefs.jsonl --objective dpo --packing loader`` (the CLI, float64 models saved to
folders: the policy ``--model`` seed 0, the ``--reference-model`` seed 1, the ChatML test tokenizer)
on the five pairs of tests/loop/test_dpo_train.py. The loader packs each pair whole in one row
(``groups=True``) of 2 x ``--max-seq-len`` slots; ``--batch-size 2`` rows of 128 slots hold all five pairs (asserted from the log:
``pairs`` 5, ``sequences`` 10), dealt to ``--grad-accum 2`` micro-batches. Step 1's logged loss must
equal the DPO loss of the five pairs computed one sequence at a time through the two saved models
(``_alone_loss`` of test_dpo_train.py), for both boundary modes (``--boundaries real`` and ``padded``).

Tolerance, fixed: 1e-9 in float64, test_dpo_train.py's derivation with this vocabulary: per logit each
side is within n*u*20 = 2e3 * 1.1e-16 * 20 = 4.4e-12 of the exact value (same model, another summation
order, n <= 2e3 roundings on values below 20), so the two sides differ by <= 8.8e-12; a token's
log-probability (target logit minus the log-sum-exp over V = 284 ids, asserted <= 300): <= 8.8e-12 +
8.8e-12 + 300 * 1.1e-16 * 20 < 1.9e-11; a sequence's sum over <= 32 targets (asserted): < 6.1e-10; the
pair loss is 1-Lipschitz in beta * (four sums), beta = 0.1: <= 0.4 * 6.1e-10 = 2.4e-10 per pair and
for their mean, under 1e-9. Measured: printed (about 1e-16).

Negative controls: partners mismatched (every chosen answer against the first pair's rejected one)
moves the loss by more than BUG = 1e-5; a pair split over two rows (one member moved to the other
row) is refused by the loss module, naming the missing answer; the loader without ``groups`` refuses
a pair's member.

Weighted SFT: the loader path with weighted samples (weights 0, 2.5, a negative advantage, per token,
none) equals each conversation run alone under the rule sum(w * loss) / sum(|w|) step by step, and
under ``weight_normalisation="sequence"`` (test_weighted_train.py's reference and tolerance, 1e-10,
derived there); step 1 equals the rule by hand; dropping the weights (or, for the sequence mean,
taking the token mean) moves step 1 by more than 1e-3.

Ranks: both runs at 2 gloo ranks give the 1-rank losses and parameters (the pair count and the
weighted count reduced over the ranks), and the loop's loader source over pairs resumes mid-stream to
the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sftpack import PackedBatch
from sftpack.chat import read_conversations, tokenize_conversations
from sftpack.loader import PackingDataset
from sftpack.loop import TrainConfig, build_model, load_model, make_source, train
from sftpack.loop._preference import PreferenceLossModule
from sftpack.sample import Sample, pair_sequence_id
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import max_loss_diff, max_param_diff, tiny_config, tiny_model, tiny_samples
from tests.loop.test_dpo_train import BETA, BUG, F64, MODEL, PAIRS, TOL, _alone_loss
from tests.loop.test_weighted_train import BUG as WEIGHT_BUG
from tests.loop.test_weighted_train import TOL as WEIGHT_TOL
from tests.loop.test_weighted_train import Alone, rule_by_hand, weighted

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """prefs.jsonl, the ChatML tokenizer, the policy (seed 0) and the reference (seed 1), float64."""
    root = tmp_path_factory.mktemp("dpo_loader")
    tok = tiny_chat_tokenizer("chatml")
    tok.save_pretrained(root / "tok")
    (root / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS), encoding="utf-8")
    assert len(tok) <= 300  # the tolerance's derivation
    build_model(len(tok), **MODEL, seed=0, dtype=F64).save_pretrained(root / "policy")
    build_model(len(tok), **MODEL, seed=1, dtype=F64).save_pretrained(root / "ref")
    return root


def _pairs(root: Path) -> list[tuple[Sample, Sample]]:
    """The file's pairs, tokenized as ``sftpack train`` tokenizes them."""
    rows = list(read_conversations([str(root / "prefs.jsonl")]))
    samples = tokenize_conversations(rows, tiny_chat_tokenizer("chatml")).to_list()
    assert max(int(s.loss_mask[1:].sum()) for s in samples) <= 32  # the tolerance's derivation
    return list(zip(samples[0::2], samples[1::2]))


@pytest.mark.parametrize("boundaries", ["real", "padded"])
def test_cli_dpo_loader_step_one_is_the_dpo_loss_of_each_sequence_alone(folders, tmp_path, boundaries) -> None:
    from sftpack.cli import main

    log = tmp_path / "log.jsonl"
    argv = ["train", str(folders / "prefs.jsonl"), "--objective", "dpo", "--packing", "loader"]
    argv += ["--model", str(folders / "policy"), "--reference-model", str(folders / "ref")]
    argv += ["--tokenizer", str(folders / "tok"), "--dtype", "float64", "--boundaries", boundaries]
    argv += ["--steps", "1", "--batch-size", "2", "--grad-accum", "2", "--max-seq-len", "64"]
    argv += ["--buffer-size", "16", "--no-cache", "--no-progress", "--log", str(log)]
    assert main(argv) == 0
    (rec,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert rec["pairs"] == 5 and rec["sequences"] == 10 and rec["micro_batches"] == 2  # every pair, 2 rows
    pairs = _pairs(folders)
    policy, reference = load_model(str(folders / "policy"), dtype=F64), load_model(str(folders / "ref"), dtype=F64)
    expected = _alone_loss(policy, reference, pairs)
    diff = abs(rec["loss"] - expected)
    mismatched = [(c, pairs[0][1]) for c, _ in pairs]
    control = abs(rec["loss"] - _alone_loss(policy, reference, mismatched))
    print(f"{boundaries}: step 1 loss {rec['loss']!r}, alone {expected!r}: |diff| {diff:.1e}; mismatched {control:.1e}")
    assert diff <= TOL
    assert control > BUG


def test_a_pair_split_over_rows_is_refused(folders) -> None:
    """Negative control: the loader's rows hold whole pairs; moving one member to the other row
    gives rows the loss module refuses (and the loader without groups refuses a pair's member)."""
    samples = [s for pair in _pairs(folders) for s in pair]
    ds = PackingDataset(samples, max_seq_len=128, buffer_size=16, shuffle=True, groups=True)
    rows = list(ds)
    assert len(rows) == 2
    by_id = {pair_sequence_id(s): s for s in samples}
    model = load_model(str(folders / "policy"), dtype=F64)
    module = PreferenceLossModule(model, pad_between_seqs=True, beta=BETA)
    module(PackedBatch.concat(rows), torch.tensor(5))  # whole pairs: accepted
    first, second = ([by_id[i] for i in r.sequence_ids] for r in rows)
    moved = [first[:-1], [first[-1], *second]]  # the first row's last member moved to the second row
    for part in moved:
        row = PackedBatch.from_samples(part, max_seq_len=256)
        row.sequence_ids = tuple(pair_sequence_id(s) for s in part)
        with pytest.raises(ValueError, match="no '(chosen|rejected)' one in this batch"):
            module(row, torch.tensor(5))
    with pytest.raises(ValueError, match="groups=True"):
        list(PackingDataset(samples, max_seq_len=128, buffer_size=16))


@pytest.mark.parametrize(("rule", "grad_accum"), [("token", 1), ("token", 2), ("sequence", 2)])
def test_weighted_loader_path_equals_each_conversation_alone(samples, rule, grad_accum) -> None:
    data = weighted(samples)
    cfg = tiny_config(
        packing="loader", pad_multiple=4, grad_accum=grad_accum, buffer_size=16, steps=8, weight_normalisation=rule
    )
    src = make_source(cfg, samples=data)
    run = train(cfg, source=src, model=tiny_model(dtype=F64))
    by_id = {s.conversation_id: s for s in data}
    steps = [[by_id[c] for c in step] for step in run.conversations]
    assert all(len(step) > 1 for step in steps)
    assert any(s.weights is not None and s.weights[0] < 0 for step in steps for s in step)

    ref_cfg = tiny_config(packing="trainer", steps=8, weight_normalisation=rule)
    ref = train(ref_cfg, source=Alone(steps), model=tiny_model(dtype=F64))
    dl, dp = max_loss_diff(run.losses, ref.losses), max_param_diff(run.model, ref.model)
    print(f"loader weighted {rule} float64: max |dloss| {dl:.2e}, max |dparam| {dp:.2e} (tolerance {WEIGHT_TOL:.0e})")
    assert dl <= WEIGHT_TOL and dp <= WEIGHT_TOL, (dl, dp)
    assert abs(run.losses[0] - rule_by_hand(tiny_model(dtype=F64), steps[0], rule)) <= WEIGHT_TOL

    # negative controls: the weights dropped (token), the token mean of the same step (sequence)
    plain = [Sample(s.input_ids, s.loss_mask, s.conversation_id) for s in steps[0]]
    other = rule_by_hand(tiny_model(dtype=F64), plain if rule == "token" else steps[0], "token")
    assert abs(run.losses[0] - other) > WEIGHT_BUG


def test_unweighted_loader_steps_keep_their_int_count(samples) -> None:
    cfg = tiny_config(packing="loader", pad_multiple=4, steps=1, buffer_size=16)
    src = make_source(cfg, samples=samples)
    mbs = src.next_step()
    assert not src.step_weighted and all(mb.weights is None for mb in mbs)
    src = make_source(cfg, samples=weighted(samples))
    mbs = src.next_step()
    assert src.step_weighted and all(isinstance(mb.weights, torch.Tensor) for mb in mbs)
    assert np.isfinite(sum(float(mb.weights.sum()) for mb in mbs))


def test_dpo_loader_config_and_a_non_pair_refused(samples) -> None:
    cfg = TrainConfig(packing="loader", objective="dpo", batch_size=2, max_seq_len=128, buffer_size=16, **MODEL)
    with pytest.raises(ValueError, match=r"sample 0 \(conversation 'c0'\) is not a member of a preference pair"):
        make_source(cfg, samples=samples)


def test_dpo_loader_source_resumes_mid_stream_to_the_same_rows(folders) -> None:
    """The loop's loader source over pairs: a position taken after step 2 resumes to the very rows
    (and pairs) the uninterrupted source gives at steps 3 to 6 (several epochs of 2-row steps)."""
    samples = [s for pair in _pairs(folders) for s in pair]
    cfg = TrainConfig(packing="loader", objective="dpo", batch_size=1, max_seq_len=32, buffer_size=4, **MODEL)
    full = make_source(cfg, samples=samples)
    steps = [full.next_step() for _ in range(6)]
    for step in steps:
        for mb in step:
            assert {r for _, r in mb.sequence_ids} == {"chosen", "rejected"}
            assert len({g for g, _ in mb.sequence_ids}) * 2 == len(mb.sequence_ids)  # whole pairs only
    again = make_source(cfg, samples=samples)
    for _ in range(2):
        again.next_step()
    state = again.state_dict()
    resumed = make_source(cfg, samples=samples)
    resumed.load_state_dict(state)
    assert resumed.fingerprint() == full.fingerprint()
    for want in steps[2:]:
        got = resumed.next_step()
        assert [mb.sequence_ids for mb in got] == [mb.sequence_ids for mb in want]
        assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(got, want))


# ------------------------------------------------------------------ 2 gloo ranks against 1


def _dpo_config(folders: Path) -> TrainConfig:
    return TrainConfig(
        packing="loader",
        objective="dpo",
        beta=BETA,
        reference_model=str(folders / "ref"),
        steps=2,
        batch_size=2,
        max_seq_len=64,
        buffer_size=16,
        lr=1e-2,
        **MODEL,
    )


def _weighted_config() -> TrainConfig:
    return tiny_config(packing="loader", pad_multiple=4, buffer_size=16, steps=3)


def _runs(folders: Path, rank: int = 0, world: int = 1) -> list:
    """A DPO run and a weighted SFT run on the loader path, at ``world`` ranks."""
    samples = [s for pair in _pairs(folders) for s in pair]
    dpo, sft = _dpo_config(folders), _weighted_config()
    return [
        train(
            dpo,
            source=make_source(dpo, samples=samples, rank=rank, world=world),
            model=load_model(str(folders / "policy"), dtype=F64),
        ),
        train(
            sft,
            source=make_source(sft, samples=weighted(tiny_samples()), rank=rank, world=world),
            model=tiny_model(dtype=F64),
        ),
    ]


def _worker(rank: int, init_file: str, folders: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        runs = _runs(Path(folders), rank, 2)
        torch.save(
            [{"losses": r.losses, "params": [p.detach() for p in r.model.parameters()]} for r in runs],
            f"{out_file}.{rank}",
        )
        dist.barrier()  # both ranks done before either tears gloo down
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_train_like_one(folders, tmp_path) -> None:
    """DPO (each rank a row, the loss the mean over the step's pairs of both ranks) and weighted SFT
    (the denominator sum |w| over both ranks) on the loader path: 2 gloo ranks give the 1-rank losses
    and parameters (float64; 1e-10, test_weighted_train.py's bound, covers both: the DPO chain is
    shorter than its 1e-9 derivation's)."""
    import torch.distributed as dist

    from tests.loop.conftest import run_ranks

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    one = _runs(folders)  # first: the ranks inherit its imports
    out = str(tmp_path / "rank")
    run_ranks(_worker, (str(tmp_path / "init"), str(folders), out), 2)
    got = torch.load(out + ".0")
    for name, mine, ref in zip(("dpo", "weighted sft"), got, one):
        dl = max_loss_diff(mine["losses"], ref.losses)
        dp = max(float((p - q.detach()).abs().max()) for p, q in zip(mine["params"], ref.model.parameters()))
        print(f"loader path {name}, float64, 2 ranks vs 1: max |dloss| {dl:.1e}, max |dparam| {dp:.1e}")
        assert dl <= WEIGHT_TOL and dp <= WEIGHT_TOL, (name, dl, dp)
    assert one[0].logs[0].pairs == 5 and one[0].losses[1] != one[0].losses[0]  # every pair at step 1; it trained


def test_a_pair_longer_than_max_seq_len_fits_a_row_of_twice_its_width(folders) -> None:
    """Each member at most ``max_seq_len`` (the tokenizer's rule), the pair longer: the loader path's
    rows are ``2 x max_seq_len`` wide, so every pair trains, whole, none refused mid-stream."""
    samples = [s for pair in _pairs(folders) for s in pair]
    limit = max(len(s) for s in samples)
    assert max(len(a) + len(b) for a, b in zip(samples[0::2], samples[1::2])) > limit
    cfg = TrainConfig(packing="loader", objective="dpo", batch_size=1, max_seq_len=limit, buffer_size=4, **MODEL)
    src = make_source(cfg, samples=samples)
    seen = []
    for _ in range(src.epoch_steps()):
        for mb in src.next_step():
            assert mb.input_ids.shape[-1] == 2 * limit
            seen += mb.sequence_ids
    assert sorted(seen) == sorted(pair_sequence_id(s) for s in samples)
