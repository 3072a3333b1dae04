"""``--save-model DIR`` / :func:`sftpack.loop._export.save_model`: the trained model as a Hugging
Face folder that ``AutoModelForCausalLM.from_pretrained(DIR)`` loads, with the trained weights byte
for byte and the trained model's logits, and the tokenizer with its chat template beside it."""

from __future__ import annotations

import glob

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from sftpack.cli import main
from sftpack.loop import TrainConfig, build_model, make_source, train
from sftpack.loop._export import save_model
from sftpack.testing import samples_from_lengths, tiny_chat_tokenizer
from tests.helpers import train_args

SHAPE = {"dim": 16, "layers": 2, "heads": 2, "kv_heads": 1}
CHAT = [
    {"role": "user", "content": "count to three"},
    {"role": "assistant", "content": "one two three"},
]


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("impl", ["torch", "transformers"])
def test_saved_folder_loads_with_the_trained_weights_and_logits(impl, tmp_path):
    tok = tiny_chat_tokenizer("chatml")
    samples = samples_from_lengths([30, 12, 25, 7, 18, 9])
    for s in samples:
        s.input_ids %= len(tok)
    model = build_model(len(tok), **SHAPE, impl=impl)
    untrained = build_model(len(tok), **SHAPE, impl=impl)  # the same seed: the weights before training
    cfg = TrainConfig(steps=3, batch_size=4, max_seq_len=64, device="cpu", **SHAPE)
    train(cfg, source=make_source(cfg, samples=samples), model=model)

    save_model(model, tmp_path / "out", tokenizer=tok)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path / "out")

    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.dtype == torch.float32
    trained = model.state_dict()
    assert set(loaded.state_dict()) == set(trained)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    assert loaded.config.eos_token_id == tok.eos_token_id
    # the tokenizer and its chat template: the same ids for a conversation
    assert loaded_tok.chat_template == tok.chat_template
    ids = loaded_tok.apply_chat_template(CHAT, return_dict=True)["input_ids"]
    assert ids == tok.apply_chat_template(CHAT, return_dict=True)["input_ids"]
    ids = torch.tensor([ids])
    # Exactly equal in float32: the same weights (safetensors stores them bit for bit) through the same
    # ops in the same order (SmallLlama mirrors LlamaForCausalLM op for op, tests/loop/test_llama.py),
    # and on one unpadded conversation the training attention and transformers' SDPA attention make the
    # same causal SDPA call; no rounding differs, so no tolerance.
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    # negative control: the same comparison against the model before its 3 steps fails
    assert not torch.equal(_logits(loaded, ids), _logits(untrained, ids))


def _cli(chat, tmp_path, *extra):
    return train_args(chat / "chat.jsonl", *extra, tokenizer=chat / "tok", steps=3, max_seq_len=256)


def test_a_float64_model_is_saved_in_float64_bit_for_bit(tmp_path):
    """The default model is rewritten as a LlamaForCausalLM in its own dtype (not built in float32 and
    cast: a float64 weight would be rounded to float32 on the way)."""
    tok = tiny_chat_tokenizer("chatml")
    samples = samples_from_lengths([30, 12, 25, 7])
    for s in samples:
        s.input_ids %= len(tok)
    model = build_model(len(tok), **SHAPE, impl="torch", dtype=torch.float64)
    cfg = TrainConfig(steps=2, batch_size=4, max_seq_len=64, device="cpu", **SHAPE)
    train(cfg, source=make_source(cfg, samples=samples), model=model)  # float64 weights, not float32 ones
    save_model(model, tmp_path / "out", tokenizer=tok)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch.float64
    mine = model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())
    # negative control: the same weights through float32 are not equal (the check sees a rounding)
    assert not all(torch.equal(v.float().double(), mine[k]) for k, v in loaded.state_dict().items())


def test_cli_save_model_writes_the_weights_of_the_last_step(chat, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "model"
    args = ["--save-model", str(out), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    assert main(_cli(chat, tmp_path, *args)) == 0
    assert f"wrote {out} (a Hugging Face model folder)" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(out)
    # the checkpoint of step 3 holds the model the run ended with
    (state,) = glob.glob(str(ckpt / "step_*3" / "state.pt"))
    final = torch.load(state, weights_only=False)["model"]
    assert set(loaded.state_dict()) == set(final)
    assert all(torch.equal(v, final[k]) for k, v in loaded.state_dict().items())
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == AutoTokenizer.from_pretrained(chat / "tok").chat_template


def test_cli_save_model_refusals(chat, tmp_path, capsys):
    # the data's renumbered ids are not the tokenizer's: refused before any work, one line, exit 2
    assert main(_cli(chat, tmp_path, "--save-model", str(tmp_path / "m"), "--vocab", "data")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--save-model with --vocab data" in err
    assert not (tmp_path / "m").exists()


def test_vision_language_model_saves_as_its_own_class(tmp_path):
    """A vision-language run's model (a family's tiny Qwen2-VL; --corpus vqa trains one) loads with
    AutoModelForImageTextToText as its own class, weights byte for byte, the tokenizer beside it."""
    from sftpack.multimodal import family_for

    tok = tiny_chat_tokenizer("chatml")
    ids = dict(image_token_id=len(tok), video_token_id=len(tok) + 1, vision_start_token_id=1, vision_end_token_id=2)
    model = family_for("qwen2_vl").tiny_model(
        vocab_size=len(tok) + 2, token_ids=ids, dim=16, layers=1, heads=2, kv_heads=1, vision_dim=16, vision_heads=2
    )
    save_model(model, tmp_path / "vlm", tokenizer=tok)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm")
    assert type(loaded) is type(model)
    mine = model.state_dict()
    assert set(loaded.state_dict()) == set(mine)
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())
    assert AutoTokenizer.from_pretrained(tmp_path / "vlm").chat_template == tok.chat_template
