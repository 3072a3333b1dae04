"""The cost model: its spellings, a model's config, hybrid layers, and a fit of times."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sftpack.balance import NAMED_SIZES, CostError, SequenceCost, sequence_cost


def test_spellings(tmp_path):
    assert sequence_cost("tokens") == SequenceCost.tokens()
    assert sequence_cost("ATTENTION") == SequenceCost.attention()
    assert sequence_cost("7b") == SequenceCost.named("7b")
    (tmp_path / "config.json").write_text(json.dumps(NAMED_SIZES["8b"]))
    assert sequence_cost(tmp_path).per_token == SequenceCost.named("8b").per_token
    with pytest.raises(CostError, match="cost 'flops': not 'tokens', 'attention', a model size"):
        sequence_cost("flops")
    with pytest.raises(CostError, match="config has no 'vocab_size'"):
        SequenceCost.from_config({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2})


def test_the_issue_flop_model():
    """7B: 6*N per token and 6*L*d per token squared (L=32, d=4096), N the weights a token meets."""
    c = SequenceCost.named("7b")
    assert c.per_token_squared == 6 * 32 * 4096
    assert 6.5e9 < c.per_token / 6 < 6.8e9
    # attention is about a quarter of a 16k sequence's work and most of a 128k one's
    assert 0.2 < c.attention_share(16_384) < 0.3 < 0.7 < c.attention_share(131_072)


def test_hybrid_layers_pay_attention_only_where_they_attend():
    base = {"hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 100}
    dense = SequenceCost.from_config(base)
    qwen35 = SequenceCost.from_config(
        base
        | {"layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]}
    )
    nemotron_h = SequenceCost.from_config(base | {"hybrid_override_pattern": "M-M*M-M-"})
    assert qwen35.per_token_squared == dense.per_token_squared / 4
    assert nemotron_h.per_token_squared == dense.per_token_squared / 8
    assert qwen35.per_token == dense.per_token  # every layer still multiplies each token through its weights
    vl = SequenceCost.from_config({"text_config": base, "vision_config": {"hidden_size": 1}})
    assert vl == dense


def test_fit_recovers_the_coefficients_of_exact_times():
    truth = SequenceCost(3e-6, 2e-9)
    rng = np.random.default_rng(0)
    groups = [rng.integers(1, 4_000, rng.integers(1, 8)) for _ in range(20)]
    seconds = [0.01 + float(truth(g).sum()) for g in groups]
    got = SequenceCost.fit(groups, seconds)
    # exact data: least squares on 20 points recovers both to float64 rounding (1e-6 relative is far above it)
    assert got.per_token == pytest.approx(truth.per_token, rel=1e-6)
    assert got.per_token_squared == pytest.approx(truth.per_token_squared, rel=1e-6)
