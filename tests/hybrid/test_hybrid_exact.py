"""Hybrid models packed exactly (issue 39, items 1 and 2): the layers that carry state along the
sequence (Mamba2 mixers, gated delta nets, short convolutions) keep a packed row's sequences
apart, through each family's own Hugging Face class (:mod:`sftpack.hybrid`).

Each family is a user's folder written by ``save_pretrained`` from a tiny config (one layer that
carries state, one attention layer; nothing downloaded). ``sftpack verify --dtype float64`` runs
every path (trainer, loader, offline) in both boundary modes against each sample alone: logits,
loss and gradients within the tolerance derived from the model's shape (float32's where the
family's own PyTorch code rounds to float32: the Mamba2 scan, the gated delta rule). The negative
control, the same folder with the layer's state crossing the boundaries
(:func:`sftpack.hybrid.leaking`), fails every row. Each folder trains with ``sftpack train --model``.
"""

from __future__ import annotations

import json

import pytest
import torch

from sftpack import PackedBatch
from sftpack.cli import main
from sftpack.exactness import alone_text_logits, probe_packing, random_samples, rounding_chain, tolerance
from sftpack.hybrid import LAYER_KINDS, covered_layers, keep_apart, leaking, length_groups, rounding_dtype
from sftpack.loop import load_model
from sftpack.testing import HYBRID_FAMILIES, save_hybrid_folder
from tests.helpers import load_models_leaking
from tests.report.test_verify import CONVERSATIONS

#: the families checked through every command (the others by the probe below, a second each)
VERIFIED = ("nemotron_h", "bamba", "qwen3_5", "qwen3_next", "lfm2")
LAYER = {
    "nemotron_h": "Mamba2 mixer (NemotronHMamba2Mixer)",
    "bamba": "Mamba2 mixer (BambaMixer)",
    "falcon_h1": "Mamba2 mixer (FalconH1Mixer)",
    "granitemoehybrid": "Mamba2 mixer (GraniteMoeHybridMambaLayer)",
    "zamba2": "Mamba2 mixer (Zamba2MambaMixer)",
    "qwen3_5": "gated delta net (Qwen3_5GatedDeltaNet)",
    "qwen3_5_moe": "gated delta net (Qwen3_5MoeGatedDeltaNet)",
    "qwen3_next": "gated delta net (Qwen3NextGatedDeltaNet)",
    "lfm2": "short conv (Lfm2ShortConv)",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {k: save_hybrid_folder(k, str(tmp_path_factory.mktemp(k))) for k in HYBRID_FAMILIES}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return str(path)


def _verify(data, folder, capsys, *more):
    rc = main(["verify", data, "--model", folder, "--dtype", "float64", "--limit", "2", "--max-seq-len", "64", *more])
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["trainer"], ["loader"], ["offline"])]
    return rc, out, rows


@pytest.mark.parametrize("kind", VERIFIED)
def test_verify_float64_is_exact_on_all_six_rows_and_the_control_differs(kind, folders, data, capsys, monkeypatch):
    rc, out, rows = _verify(data, folders[kind], capsys)
    assert rc == 0, out
    assert len(rows) == 6 and all(r[-1] == "exact" for r in rows), out
    assert {(r[0], r[1]) for r in rows} == {
        (p, m) for p in ("trainer", "loader", "offline") for m in ("real", "padded")
    }
    assert f"keep the row's sequences apart: {LAYER[kind]}" in out, out
    if kind != "lfm2":  # their own code rounds to float32 inside: the tolerances say so
        assert "rounds to float32 inside" in out, out

    # the negative control: the state crosses every boundary (the trainer path's rows, both
    # modes: the paths' rows hold the same sequences; benchmarks/bench_hybrid_exactness.py runs all six)
    load_models_leaking(monkeypatch)
    rc, out, rows = _verify(data, folders[kind], capsys, "--paths", "trainer")
    assert rc == 1, out
    assert len(rows) == 2 and all(r[-1] == "DIFFERS" for r in rows), out
    for r in rows:  # far outside: logits differ by more than 10x their tolerance
        assert float(r[-6]) > 10 * float(r[-2]), r


@pytest.mark.parametrize("kind", VERIFIED)
def test_each_folder_trains_packed_with_sftpack_train(kind, folders, data, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    args = ["train", data, "--model", folders[kind], "--steps", "2"]  # the folder brings its tokenizer
    rc = main([*args, "--batch-size", "2", "--max-seq-len", "64", "--device", "cpu", "--log", str(log)])
    out, err = capsys.readouterr()
    assert rc == 0, (out, err)
    assert "packing is not exact" not in err
    assert f"hybrid: 1 layer(s) keep each packed row's sequences apart: {LAYER[kind]}" in out, out
    steps = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)


@pytest.mark.parametrize("kind", HYBRID_FAMILIES)
def test_every_family_passes_the_probe_and_its_control_fails_it(kind, folders):
    """All nine families, both boundary modes: exact kept apart, far outside the tolerance leaking."""
    model = load_model(folders[kind], dtype=torch.float64)
    assert [f"{c.kind} ({c.cls})" for c in covered_layers(model)][:1] == [LAYER[kind]]
    for pad_between_seqs in (True, False):
        for pad_multiple in (1, 4):
            kept = probe_packing(model, pad_between_seqs=pad_between_seqs, pad_multiple=pad_multiple)
            assert kept.ok, (pad_multiple, kept)
        # no padding between the sequences (padding slots, zeros after the embedding, would fill
        # a short convolution's window of 2 and hide its leak)
        with leaking(model):
            leak = probe_packing(model, pad_between_seqs=pad_between_seqs)
        assert not leak.ok and leak.difference > 5 * leak.tolerance, leak


def _row_and_alone(model, lengths=(19, 7, 12)):
    samples = random_samples(list(lengths), int(model.config.vocab_size), seed=1)
    return samples, PackedBatch.from_samples(samples)


def _limit(model, batch, logits):
    """The tolerance of this row (:func:`tolerance` of its rounding chain, in the precision the
    model's own code computes in, at the logits' magnitude)."""
    chain = rounding_chain(model, int(batch.input_ids.numel()))
    return tolerance(chain, rounding_dtype(model, torch.float64), float(logits.abs().max()))


def _differences(model, samples, batch, logits):
    cu, cup = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    return [
        float((logits[cup[i] : cup[i] + cu[i + 1] - cu[i]] - alone_text_logits(model, s)).abs().max())
        for i, s in enumerate(samples)
    ]


def test_hugging_faces_other_packed_form_positions_restarting_is_kept_apart_too(folders):
    """Hugging Face's documented padding-free form (no offsets: positions restart per sequence,
    no mask) gets the offsets from the restarts; the first sequence was never at risk, the later
    ones leak without them."""
    model = load_model(folders["nemotron_h"], dtype=torch.float64).eval()
    samples, batch = _row_and_alone(model)
    ids, pos = batch.input_ids[None], batch.position_ids[None]
    with torch.no_grad():
        kept = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        limit = _limit(model, batch, kept)
        assert max(_differences(model, samples, batch, kept)) <= limit
        with leaking(model):
            leak = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        diffs = _differences(model, samples, batch, leak)
    assert diffs[0] <= limit and min(diffs[1:]) > 10 * limit, (diffs, limit)


def test_keep_apart_changes_no_parameter_key_or_class_and_is_idempotent(folders):
    from transformers import AutoModelForCausalLM

    from sftpack.attention import register_train_attention

    model = AutoModelForCausalLM.from_pretrained(folders["qwen3_5"], attn_implementation=register_train_attention())
    keys, classes = list(model.state_dict()), [type(m) for m in model.modules()]
    first = keep_apart(model)
    assert keep_apart(model) == first == covered_layers(model)
    assert [c.name for c in first] == ["model.layers.0.linear_attn"] and first[0].kind == "gated delta net"
    assert list(model.state_dict()) == keys and [type(m) for m in model.modules()] == classes
    assert keep_apart(torch.nn.Linear(2, 2)) == ()  # nothing to cover: left as it is


def test_the_torch_route_is_the_layers_own_forward_on_each_segment(folders):
    """The route's one batched call equals the layer run on each segment alone, in float64, the
    gradients too, within the tolerance of the model's chain in float32 (the mixer's own scan
    rounds to float32); leaking, the later segments are far outside it."""
    model = load_model(folders["bamba"], dtype=torch.float64)
    mixer = next(m for m in model.modules() if type(m).__name__ == "BambaMixer")
    gen = torch.Generator().manual_seed(0)
    lengths = [11, 3, 12, 10]  # 12, 11 and 10 share a padded batch, 3 runs apart (length_groups)
    assert length_groups(lengths) == [[2, 0, 3], [1]]
    x = torch.randn(1, sum(lengths), 32, dtype=torch.float64, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 11, 14, 26, 36], dtype=torch.int32)
    packed = mixer(x, cu_seq_lens_q=cu)
    packed.square().sum().backward()
    grad, x.grad = x.grad.clone(), None
    parts = [type(mixer).forward(mixer, x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    alone = torch.cat(parts, dim=1)
    alone.square().sum().backward()
    limit = tolerance(rounding_chain(model, 36), torch.float32, 1.0)  # values and gradients are below 1
    packed, alone = packed.detach(), alone.detach()
    assert float(alone.abs().max()) < 1 and float(x.grad.abs().max()) < 1
    assert float((packed - alone).abs().max()) <= limit and float((grad - x.grad).abs().max()) <= limit
    with torch.no_grad(), leaking(model):
        leak = mixer(x, cu_seq_lens_q=cu)
    assert float((leak - alone)[:, 11:].abs().max()) > 10 * limit


def test_the_kernel_route_without_its_kernels_is_refused_naming_them(folders):
    model = load_model(folders["nemotron_h"])
    with pytest.raises(ValueError, match=r"route='kernels' needs .*mamba_ssm and causal_conv1d installed"):
        keep_apart(model, route="kernels")
    lfm2 = load_model(folders["lfm2"])
    with pytest.raises(ValueError, match="has no kernel route"):
        keep_apart(lfm2, route="kernels")


def test_the_tolerance_is_float32s_where_the_family_rounds_to_float32(folders):
    kinds = {k.name: k.rounds_to for k in LAYER_KINDS}
    assert kinds == {"Mamba2 mixer": torch.float32, "gated delta net": torch.float32, "short conv": None}
    assert rounding_dtype(load_model(folders["nemotron_h"], dtype=torch.float64), torch.float64) == torch.float32
    assert rounding_dtype(load_model(folders["lfm2"], dtype=torch.float64), torch.float64) == torch.float64
    # an LFM2 loaded in float32 keeps its RMSNorms' float32 upcast: float32's tolerance
    assert rounding_dtype(load_model(folders["lfm2"]), torch.float64) == torch.float32


def test_context_parallelism_over_a_state_layer_is_refused_in_one_line(folders, data, tmp_path, capsys):
    """``--cp`` cuts each sequence into chunks on other ranks; a layer carrying state would need
    each chunk's state handed on, which sftpack does not do: refused before any work."""
    args = ["prepack", data, "--model", folders["nemotron_h"], "--max-seq-len", "64", "--out"]
    rc = main([*args, str(tmp_path / "cp2"), "--cp", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "--cp 2: context parallelism (2) over" in err[0] and "Mamba2 mixer layers" in err[0], err
    assert "use a context-parallel size of 1" in err[0] and not (tmp_path / "cp2").exists()
    assert main([*args, str(tmp_path / "cp1"), "--cp", "1"]) == 0  # the same folder without context parallelism


def test_restarting_positions_in_a_batch_of_rows_are_kept_apart_row_by_row(folders):
    """Two packed rows in one ``(2, T)`` batch, positions restarting (no offsets, no mask):
    each row's sequences apart, and no sequence spans two rows."""
    model = load_model(folders["lfm2"], dtype=torch.float64).eval()
    samples = random_samples([9, 7, 10, 6], int(model.config.vocab_size), seed=2)
    rows = [PackedBatch.from_samples(samples[:2]), PackedBatch.from_samples(samples[2:])]
    ids = torch.stack([r.input_ids for r in rows])
    pos = torch.stack([r.position_ids for r in rows])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        for b, row in enumerate(rows):
            diffs = _differences(model, samples[2 * b : 2 * b + 2], row, logits[b])
            assert max(diffs) <= _limit(model, row, logits[b]), (b, diffs)


def test_a_packed_row_with_a_cache_is_refused_not_leaked(folders):
    """Hugging Face builds a cache when ``use_cache`` is on (its configs' default): a cache holds
    one sequence's state, so a packed row with one is refused, naming the fix."""
    model = load_model(folders["nemotron_h"], dtype=torch.float64).eval()
    _, batch = _row_and_alone(model)
    with torch.no_grad(), pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=True)
    with torch.no_grad():  # one sequence with a cache (generation's prefill) runs as it is
        model(input_ids=batch.input_ids[None, :19], use_cache=True)
