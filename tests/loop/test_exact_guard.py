"""No model trains packed unless packing is exact on it (issue 38, item 1).

A user's model folder whose layers carry state along the sequence (Nemotron-H's Mamba2
mixers, LFM2's short convolutions) leaks one conversation into the next on a packed row.
``sftpack train --model DIR`` and the library's :func:`sftpack.loop.train` probe the model
first (:func:`sftpack.exactness.require_exact_packing`: a few short synthetic sequences,
packed against each alone, in float64) and refuse it in one line, before step 1, naming the
layers and the fixes; ``--allow-inexact-packing`` (``TrainConfig(allow_inexact_packing=True)``)
trains it anyway with a one-line warning; padded training (``--packing none``) needs no
probe. A Llama folder trains as before. The tiny models are built from configs (nothing
downloaded) and saved as a user's folder."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from sftpack.cli import main
from sftpack.exactness import (
    InexactPackingError,
    probe_packing,
    require_exact_packing,
    tiny_llama,
)
from sftpack.loop import TrainConfig, build_model, load_model, make_source, train
from sftpack.testing import tiny_chat_tokenizer


def _config(kind: str, vocab: int):
    from transformers import Lfm2Config, NemotronHConfig

    if kind == "nemotron_h":  # one Mamba2 layer, one attention layer
        return NemotronHConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=1,
            hybrid_override_pattern="M*",
        )
    return Lfm2Config(  # one short-conv layer, one attention layer
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
    )


@functools.cache
def folder(kind: str, root: str) -> str:
    """A user's model folder of ``kind`` (``llama``, ``nemotron_h``, ``lfm2``) with its tokenizer."""
    from transformers import AutoModelForCausalLM

    tok = tiny_chat_tokenizer("chatml")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = (
            tiny_llama(len(tok), seed=3)
            if kind == "llama"
            else AutoModelForCausalLM.from_config(_config(kind, len(tok)))
        )
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {k: folder(k, str(tmp_path_factory.mktemp(k))) for k in ("llama", "nemotron_h", "lfm2")}


LAYER = {"nemotron_h": "Mamba2 mixer (NemotronHMamba2Mixer)", "lfm2": "short conv (Lfm2ShortConv)"}


def _train(chat, folder, log, *extra):
    return main(
        [
            "train",
            str(chat / "chat.jsonl"),
            "--model",
            folder,
            "--tokenizer",
            folder,
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--max-seq-len",
            "128",
            "--device",
            "cpu",
            "--log",
            str(log),
            *extra,
        ]
    )


@pytest.mark.parametrize("kind", ["nemotron_h", "lfm2"])
def test_train_refuses_a_leaking_model_folder_in_one_line_before_step_1(chat, folders, kind, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    rc = _train(chat, folders[kind], log)
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("sftpack")]  # (transformers' loading bar aside)
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("sftpack train: packing is not exact on "), line
    assert LAYER[kind] in line and "carry state" in line
    assert "--packing none" in line and "--allow-inexact-packing" in line
    assert not log.exists() and "step" not in out  # nothing trained


def test_the_flag_trains_it_packed_with_a_one_line_warning(chat, folders, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    rc = _train(chat, folders["nemotron_h"], log, "--allow-inexact-packing")
    out, err = capsys.readouterr()
    assert rc == 0, (out, err)
    warned = [ln for ln in err.splitlines() if "packing is not exact" in ln]
    assert len(warned) == 1 and warned[0].startswith("sftpack: warning: ") and "training packed anyway" in warned[0]
    assert [json.loads(ln)["step"] for ln in log.read_text().splitlines()] == [1, 2]


def test_padded_training_needs_no_check(chat, folders, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    rc = _train(chat, folders["lfm2"], log, "--packing", "none")
    out, err = capsys.readouterr()
    assert rc == 0, (out, err)
    assert "packing is not exact" not in err
    assert len(log.read_text().splitlines()) == 2


def test_a_llama_folder_trains_packed_as_before(chat, folders, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    rc = _train(chat, folders["llama"], log, "--packing", "trainer")
    out, err = capsys.readouterr()
    assert rc == 0, (out, err)
    assert "packing is not exact" not in err and "warning" not in err
    assert len(log.read_text().splitlines()) == 2


def _source(cfg, folder):
    from sftpack.chat import tokenize_conversations

    tok = tiny_chat_tokenizer("chatml")
    convs = [
        {"messages": [{"role": "user", "content": "hi " * (i + 2)}, {"role": "assistant", "content": "yo " * (i + 3)}]}
        for i in range(4)
    ]
    samples = list(tokenize_conversations(convs, tok, max_seq_len=cfg.max_seq_len))
    return make_source(cfg, samples=samples, pad_id=0)


def test_the_library_train_raises_the_same_and_the_config_flag_allows_it(folders):
    cfg = TrainConfig(packing="loader", steps=1, batch_size=1, max_seq_len=64, device="cpu")
    model = load_model(folders["lfm2"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InexactPackingError, match=r"short conv \(Lfm2ShortConv\) layers carry state.*--packing none"):
        train(cfg, source=_source(cfg, folders["lfm2"]), model=model)
    after = model.state_dict()  # the probe turned it to float64 and back: nothing changed
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())

    allowed = TrainConfig(
        packing="loader", steps=1, batch_size=1, max_seq_len=64, device="cpu", allow_inexact_packing=True
    )
    with pytest.warns(UserWarning, match="training packed anyway"):
        result = train(allowed, source=_source(allowed, folders["lfm2"]), model=load_model(folders["lfm2"]))
    assert len(result.logs) == 1


def test_the_probe_passes_an_exact_model_and_fails_a_leaking_one(folders):
    """The negative control: the same probe on a Llama folder (exact) and on the two leaking
    families; the leak is far outside the float64 tolerance, the Llama far inside it."""
    exact = probe_packing(load_model(folders["llama"]))
    assert exact.ok and exact.carriers == () and exact.tolerance < 1e-9
    for kind in ("nemotron_h", "lfm2"):
        for pad_between_seqs in (True, False):
            leak = probe_packing(load_model(folders[kind]), pad_between_seqs=pad_between_seqs)
            assert not leak.ok and leak.difference > 1e3 * leak.tolerance, (kind, leak)
            assert leak.carriers == (LAYER[kind],)


def test_models_sftpack_builds_are_proven_and_skip_the_probe():
    assert require_exact_packing(build_model(50, dim=16, layers=1, heads=2, kv_heads=1)) is None
    assert require_exact_packing(build_model(50, dim=16, layers=1, heads=2, kv_heads=1, impl="torch")) is None
    assert require_exact_packing(tiny_llama(50)) is None


def test_the_float32_fallback_still_fails_a_mamba2_leak(folders):
    """Where float64 does not fit (a CUDA device short of memory), the probe runs in float32 with
    float32's tolerance: a Mamba2 mixer's leak (0.24 here) is still far above it."""
    leak = probe_packing(load_model(folders["nemotron_h"]), dtype=torch.float32)
    assert leak.dtype == "float32" and not leak.ok and leak.difference > 100 * leak.tolerance
    assert probe_packing(load_model(folders["llama"]), dtype=torch.float32).ok
