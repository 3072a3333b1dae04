"""sftpack's Hugging Face attentions under what users hand them, not only ``to_hf_kwargs()``.

Issue 26, item 4: given Hugging Face's documented packed form (positions restarting
per sample, no mask, no ``cu_seq_lens_q``) the training attention ran one causal
sequence over the whole row (sample 2 attended to sample 1: logits off by 0.4), and
``attn_implementation="sftpack_varlen_train"`` as one string reached a VLM's vision
tower, which then attended causally inside each image (Qwen's tower is bidirectional).

Tolerance: every comparison is float64 between two computations of the same
function by different summation orders (a packed segment vs the sample alone, or
sftpack's per-segment SDPA vs Hugging Face's masked SDPA). Per logit, the
tiny models below chain n <= 2e3 roundings of values below ~20, so each side is
within n*u*20 = 2e3 * 1.1e-16 * 20 = 4.4e-12 of the exact value; 1e-10 is about
10x the sum of both. A leak across samples moves logits by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from sftpack.attention import HF_ATTENTION_NAME, TRAIN_ATTENTION, register_hf_attention, register_train_attention
from sftpack.loop import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-10  # derivation in the module docstring
LENS = (7, 11, 5)  # three samples in one row


def _llama(attn: str) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float64)
    model.config._attn_implementation = attn
    return model.eval()


def _samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=g) for n in LENS]


def _alone(model: torch.nn.Module, samples: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in samples])


def _packed_form(samples: list[torch.Tensor]) -> dict:
    """Hugging Face's documented packed form: one row, positions restarting, no mask."""
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    return {"input_ids": ids, "position_ids": pos, "use_cache": False}


@pytest.mark.parametrize("name", ["train", "reference"])
def test_restarting_positions_without_boundaries_keep_samples_apart(name):
    attn = register_train_attention() if name == "train" else register_hf_attention()
    model, samples = _llama(attn), _samples()
    with torch.no_grad():
        packed = model(**_packed_form(samples)).logits[0]
    alone = _alone(model, samples)
    assert (packed - alone).abs().max().item() < TOL
    # Hugging Face's own sdpa finds the same boundaries from the same restarts.
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        hf = model(**_packed_form(samples)).logits[0]
    assert (packed - hf).abs().max().item() < TOL


def test_restarts_in_each_row_of_a_batch():
    """Two rows of the packed form in one batch: each row's restarts are its own."""
    model, samples = _llama(register_train_attention()), _samples()
    a, b = _packed_form(samples), _packed_form(samples[::-1])
    kw = {
        "input_ids": torch.cat([a["input_ids"], b["input_ids"]]),
        "position_ids": torch.cat([a["position_ids"], b["position_ids"]]),
        "use_cache": False,
    }
    with torch.no_grad():
        out = model(**kw).logits
    assert (out[0] - _alone(model, samples)).abs().max().item() < TOL
    assert (out[1] - _alone(model, samples[::-1])).abs().max().item() < TOL


def test_small_llama_reads_the_packed_form_too():
    """sftpack train's default model takes the same packed form (its own forward)."""
    model = build_model(97, dim=32, layers=2, heads=4, kv_heads=2, impl="torch", dtype=torch.float64).eval()
    samples = _samples()
    with torch.no_grad():
        packed = model(**_packed_form(samples)).logits[0]
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in samples])
    assert (packed - alone).abs().max().item() < TOL


def test_a_sliding_window_shorter_than_a_sample_is_refused():
    """Full attention inside a sample is not what a windowed layer computes: refused, never ignored."""
    cfg = transformers.MistralConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=6,
    )
    model = transformers.MistralForCausalLM._from_config(cfg, attn_implementation=register_train_attention())
    samples = _samples()
    with pytest.raises(ValueError, match=r"sliding window of 6 tokens and a sequence here has 11"):
        model(**_packed_form(samples))
    model(**_packed_form([s[:6] for s in samples]))  # every sample within the window: exact, allowed


def _qwen2vl_tower(attn: str | dict) -> torch.nn.Module:
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14,
                           temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation=attn)
    return model.to(torch.float64).model.visual.eval()


@pytest.mark.parametrize("name", [TRAIN_ATTENTION, HF_ATTENTION_NAME])
def test_one_string_for_a_vlm_keeps_its_vision_tower_bidirectional(name):
    register_train_attention()
    register_hf_attention()
    grid = torch.tensor([[1, 4, 6], [1, 2, 4]])  # two images: 24 and 8 patches
    g = torch.Generator().manual_seed(2)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g, dtype=torch.float64)
    with torch.no_grad():
        ours = _qwen2vl_tower(name)(pixels, grid_thw=grid).last_hidden_state
        hf = _qwen2vl_tower("sdpa")(pixels, grid_thw=grid).last_hidden_state
    assert (ours - hf).abs().max().item() < TOL
