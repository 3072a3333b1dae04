"""``TrainConfig.cost`` / ``sftpack train --cost``: what the trainer path prices a conversation at
when it deals each step's conversations to the ranks (``plan_microbatches(cost=)``). The source
plans with it (the run's model's cost by default, ``model_cost``), a checkpoint does not depend on
it (it never changes what a step trains on), and a spelling that names no cost model is refused
before any work."""

from __future__ import annotations

import numpy as np
import pytest

from sftpack.balance import SequenceCost
from sftpack.cli import main
from sftpack.loop import TrainConfig, make_source, train
from sftpack.loop._sources import SampleOrder, TrainerSource, _hash, _SampleSource
from sftpack.trainer import plan_microbatches
from tests.helpers import tiny_config, tiny_model

BATCH, WIDTH, PAD = 8, 128, 2


def _rank_ids(samples, cost, rank):
    src = TrainerSource(
        samples, micro_batch_tokens=WIDTH, pad_multiple=PAD, cost=cost, batch_size=BATCH, seed=0, rank=rank, world=2
    )
    return [[list(mb.sequence_ids) for mb in src.next_step()] for _ in range(len(samples) // BATCH)]


def test_the_source_deals_the_ranks_by_its_cost(samples):
    order = SampleOrder(len(samples), batch_size=BATCH, seed=0)  # the source's own draw of each step
    steps = [order.take() for _ in range(len(samples) // BATCH)]

    def planned(cost):
        out = []
        for idx in steps:
            lengths = np.array([len(samples[i]) for i in idx])
            plan = plan_microbatches(lengths, WIDTH, dp_size=2, pad_multiple=PAD, cost=cost)
            out.append([[[samples[idx[j]].conversation_id for j in sorted(mb)] for mb in rank] for rank in plan])
        return out

    for cost in ("tokens", "attention"):
        want = planned(cost)
        got = [_rank_ids(samples, cost, r) for r in range(2)]
        assert [[got[r][s] for r in range(2)] for s in range(len(steps))] == want, cost
    # the two costs deal some step differently: the comparison above can tell them apart
    assert planned("tokens") != planned("attention")


def test_the_fingerprint_holds_no_cost(samples):
    """The cost decides which rank and micro-batch a conversation lands in, never what a step trains
    on: a checkpoint's fingerprint is the one a trainer-path checkpoint has always had, whatever the
    cost, so a run resumes under another cost (its model's, another world size's)."""

    def fp(cost):
        return TrainerSource(samples, micro_batch_tokens=WIDTH, cost=cost, batch_size=BATCH, seed=0).fingerprint()

    default = TrainerSource(samples, micro_batch_tokens=WIDTH, batch_size=BATCH, seed=0)
    before = _hash({"base": _SampleSource.fingerprint(default), "budget": WIDTH, "pad_multiple": 1})
    assert {default.fingerprint(), fp("tokens"), fp("attention"), fp("7b"), fp(SequenceCost(2.0, 1.0))} == {before}


def test_a_checkpoint_resumes_under_another_cost(samples, tmp_path):
    """Saved under tokens, resumed under attention (on one rank the plan's bins are the same
    conversations; only which rank and micro-batch a conversation lands in could change)."""
    cfg = tiny_config(packing="trainer", steps=4, batch_size=4, checkpoint_every=2)
    train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(), checkpoint_dir=tmp_path, stop_after=2)
    other = tiny_config(packing="trainer", steps=4, batch_size=4, checkpoint_every=2, cost="attention")
    resumed = train(
        other, source=make_source(other, samples=samples), model=tiny_model(), checkpoint_dir=tmp_path, resume=True
    )
    assert resumed.resumed_from == 2


def test_a_run_prices_by_its_model_unless_told(samples):
    """``model_cost``: a Hugging Face model's config gives the cost the run deals by where
    ``TrainConfig.cost`` is None; a given cost wins."""
    import transformers

    from sftpack.loop import model_cost

    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
        )
    )
    cost = model_cost(hf)
    assert cost is not None and cost.per_token_squared == 6 * 2 * 16
    assert model_cost(object()) is None
    from sftpack.loop._llama import SmallLlama, SmallLlamaConfig  # sftpack train's default model: a dataclass config

    small = SmallLlama(SmallLlamaConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1))
    assert model_cost(small) is not None and model_cost(small).per_token_squared == 6 * 2 * 16
    cfg = tiny_config(packing="trainer", batch_size=BATCH)
    assert make_source(cfg, samples=samples, model_cost=cost).cost == cost
    given = tiny_config(packing="trainer", batch_size=BATCH, cost="attention")
    assert make_source(given, samples=samples, model_cost=cost).cost == SequenceCost.attention()
    assert make_source(cfg, samples=samples).cost == SequenceCost.tokens()


def test_the_config_and_the_flag(chat, tmp_path, capsys):
    assert "cost" not in TrainConfig().as_dict()  # the default: a saved config stays what it was
    assert TrainConfig(cost="7b").as_dict()["cost"] == "7b"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}'
    )
    assert TrainConfig(cost=model).cost == str(model)
    with pytest.raises(ValueError, match="cost 'big': not 'tokens', 'attention', a model size"):
        TrainConfig(cost="big")
    base = ["train", str(chat / "chat.jsonl"), "--tokenizer", str(chat / "tok"), "--steps", "1"]
    assert main([*base, "--cost", "huge"]) == 2
    assert "cost 'huge'" in capsys.readouterr().err
    assert main([*base, "--cost", str(tmp_path)]) == 2  # a folder without a config.json
    assert "no config.json there" in capsys.readouterr().err
