"""``sftpack verify``'s check (:func:`sftpack.report.verify.verify`) on text models: the default
tiny Llama and a user's own model folder (``save_pretrained``: config, weights, tokenizer with
its chat template), every path in both boundary modes; negative controls that must fail it and
name the first sample that differs; and the tolerance's derivation.

The tolerance is derived from the model's shape (``rounding_chain``), never measured: a
float64 run of these models must land far below it (observed about 1e-15 against about 3e-12),
and a row whose positions do not restart (the bug of several peers' packers) must land far
above it (observed about 4e-9)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from sftpack.chat import tokenize_conversations
from sftpack.exactness import tiny_llama
from sftpack.report.verify import PATHS, rounding_chain, tolerance, verify
from sftpack.testing import tiny_chat_tokenizer

CONVERSATIONS = [
    {
        "id": f"c{i}",
        "messages": [
            {"role": "user", "content": "word " * (3 + 5 * i)},
            {"role": "assistant", "content": "reply " * (2 + 3 * i)},
        ],
    }
    for i in range(6)
]


@functools.cache
def _folder(root: str) -> str:
    """A user's model folder: a tiny Llama over the tiny ChatML tokenizer, saved as HF saves it."""
    tok = tiny_chat_tokenizer("chatml")
    model = tiny_llama(len(tok), seed=3)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return _folder(str(tmp_path_factory.mktemp("my-llama")))


def test_a_users_model_folder_is_exact_on_every_path_and_mode(folder):
    r = verify(CONVERSATIONS, model=folder, max_seq_len=64)
    assert r.ok, r.checks
    assert r.model == folder and r.kind == "text" and r.dtype == "float64"
    assert [(c.path, c.boundaries) for c in r.checks] == [(p, m) for p in PATHS for m in ("real", "padded")]
    tok = tiny_chat_tokenizer("chatml")
    samples = list(tokenize_conversations(CONVERSATIONS, tok, max_seq_len=64))
    assert r.samples == len(samples) > len(CONVERSATIONS)  # over-long ones split
    for c in r.checks:
        assert c.covered == len({s.input_ids.tobytes() for s in samples})  # every sample ran on every path
        assert c.logits <= c.tolerance["logits"] and c.grads <= c.tolerance["grads"]
        assert c.tolerance["logits"] < 1e-9  # float64: tight (the derivation: module docstring)


def test_the_default_tiny_model_over_the_embedded_corpus_is_exact():
    from sftpack.data import default_corpus

    r = verify(default_corpus(), limit=2, max_seq_len=128, paths=("trainer", "offline"), modes=("real",))
    assert r.ok, r.checks
    assert "tiny Llama" in r.model and len(r.checks) == 2


def _positions_not_restarted(batch):
    return dataclasses.replace(batch, position_ids=torch.arange(len(batch.position_ids)))


@pytest.mark.parametrize("mode", ["real", "padded"])
def test_a_broken_row_fails_naming_the_first_sample_that_differs(folder, mode):
    r = verify(
        CONVERSATIONS, model=folder, max_seq_len=64, paths=("offline",), modes=(mode,), tamper=_positions_not_restarted
    )
    assert not r.ok
    bad = r.first_failure
    assert bad is not None and bad.path == "offline"
    assert "conversation 'c" in bad.first and "differ by" in bad.first
    assert bad.logits > 1e3 * bad.tolerance["logits"]  # far outside: not a rounding question


def test_the_tolerance_follows_the_models_shape_not_the_run():
    model = tiny_llama(97)
    n = rounding_chain(model, 64)
    cfg = model.config
    assert n == 2 * cfg.num_hidden_layers * (cfg.hidden_size + cfg.intermediate_size + 64) + 97 + 64
    assert tolerance(n, torch.float64, 0.5) == 2 * n * 2.0**-53  # magnitude floored at 1
    assert tolerance(n, torch.float64, 10.0) == 10 * tolerance(n, torch.float64, 1.0)
    assert tolerance(n, torch.float32, 1.0) > 1e3 * tolerance(n, torch.float64, 1.0)


def test_bad_options_are_refused_before_any_work(folder):
    with pytest.raises(ValueError, match="unknown path 'disk'"):
        verify(CONVERSATIONS, model=folder, paths=("disk",))
    with pytest.raises(ValueError, match="pass images=True"):
        verify(CONVERSATIONS, family="qwen2_vl")
    with pytest.raises(ValueError, match="float64 or torch.float32"):
        verify(CONVERSATIONS, dtype=torch.float16)
    with pytest.raises(ValueError, match="no conversations"):
        verify([])


def test_a_split_sample_is_named_with_its_piece():
    from sftpack.report.verify import _name
    from sftpack.sample import Sample

    whole = Sample([1, 2], [False, True], "chats.jsonl:3")
    piece = Sample([1, 2], [False, True], "chats.jsonl:3", {"piece": 2})
    assert (_name(whole), _name(piece)) == ("conversation 'chats.jsonl:3'", "conversation 'chats.jsonl:3' (piece 2)")
