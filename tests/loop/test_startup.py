"""``sftpack train`` starts early: conversations are tokenized in the seeded order
the trainer and padded paths read them in, a step waits only for its own
conversations, the order is the same whether the samples came from the cache or
not, tokenized in this process or in a producer process (``tests/loop/test_producer.py``
tests that one further), and a cache hit does not load the tokenizer."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from sftpack.chat._training_samples import (
    ConversationSamples,
    Pending,
    conversation_order,
    start_training_samples,
)
from sftpack.loop import TrainConfig, make_source
from sftpack.loop._sources import ConversationOrder
from sftpack.sample import Sample
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import counting_conversations


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer("chatml")


def _job(tok, convs, tmp_path, *, seed=3, cache=True, in_child=False, **kw):
    return start_training_samples(
        tok,
        convs,
        max_seq_len=24,
        cache_dir=tmp_path if cache else None,
        seed=seed,
        ready=not in_child,
        in_child=in_child,
        **kw,
    )


def _steps(sink, packing, n=4):
    cfg = TrainConfig(packing=packing, steps=n, batch_size=4, max_seq_len=24, seed=3)
    src = make_source(cfg, samples=sink)
    return [src.next_step() for _ in range(n)]


def _same_steps(a, b):
    for x, y in zip(a, b, strict=True):
        for mx, my in zip(x, y, strict=True):
            assert mx.sequence_ids == my.sequence_ids
            for name in ("input_ids", "labels"):
                assert torch.equal(getattr(mx, name), getattr(my, name))


@pytest.mark.parametrize("in_child", [False, True], ids=["in-process", "producer"])
@pytest.mark.parametrize("packing", ["trainer", "none"])
def test_same_seed_same_batches_streamed_cached_or_not(tok, tmp_path, packing, in_child):
    convs = counting_conversations()
    miss = _job(tok, convs, tmp_path, in_child=in_child)
    assert miss.done is None and miss.sink is not None and not miss.sink.done
    pending = Pending(miss.finish)  # tokenizing in the background while the steps are read
    streamed = _steps(miss.sink, packing)
    got = pending.result()
    assert not got.hit and got.entry is not None
    hit = _job(tok, convs, tmp_path)
    assert hit.done is not None and hit.done.hit and hit.sink is not None and hit.sink.done
    _same_steps(streamed, _steps(hit.sink, packing))
    uncached = _job(tok, convs, tmp_path, cache=False)
    uncached.finish()
    _same_steps(streamed, _steps(uncached.sink, packing))
    # the samples returned and cached are in input order whatever order they were tokenized in
    eager = _job(tok, convs, tmp_path, seed=None, cache=False).finish()
    for a, b in zip(eager.samples, hit.done.samples, strict=True):
        assert a.conversation_id == b.conversation_id and a.input_ids.tobytes() == b.input_ids.tobytes()
        assert a.meta == b.meta


def test_steps_read_whole_conversations_in_seeded_order(tok, tmp_path):
    convs = counting_conversations()
    job = _job(tok, convs, tmp_path, cache=False)
    got = job.finish()
    assert any(s.meta.get("piece") for s in got.samples)  # some conversations were split
    assert got.positions is not None and got.conversations == len(convs)
    perm = conversation_order(len(convs), seed=3, epoch=0).tolist()
    laid = [s for p in perm for s in got.samples if got.positions[got.samples.index(s)] == p]
    order = ConversationOrder(job.sink, batch_size=4, seed=3)
    taken = [s for _ in range(len(laid) // 4) for s in order.take()]
    assert [id(s) for s in taken] == [id(s) for s in laid[: len(taken)]]
    ids = [s.conversation_id for s in taken]
    for cid in set(ids):  # a split conversation's pieces follow each other
        at = [i for i, c in enumerate(ids) if c == cid]
        assert at == list(range(at[0], at[0] + len(at)))
    before = order.state_dict()
    nxt = order.take()  # the next epoch: a new permutation
    assert order.epoch == 1 and before["epoch"] == 0
    assert [s.conversation_id for s in nxt] != ids[:4]


def _sample(cid, n=3):
    return Sample(np.arange(1, n + 1), np.array([False] + [True] * (n - 1)), cid)


def test_a_step_waits_only_for_its_own_conversations():
    data = ConversationSamples(10)
    perm = conversation_order(10, seed=0, epoch=0).tolist()
    for p in perm[:2]:  # the first two conversations of the order: two pieces each
        data._put(p, [_sample(f"c{p}"), _sample(f"c{p}")])
    order = ConversationOrder(data, batch_size=4, seed=0)
    out: list = []
    t = threading.Thread(target=lambda: out.append(order.take()), daemon=True)
    t.start()
    t.join(timeout=120)  # a liveness guard, not a timing: take() must not wait for the 8 others
    assert not t.is_alive()
    assert [s.conversation_id for s in out[0]] == [f"c{perm[0]}"] * 2 + [f"c{perm[1]}"] * 2


def test_a_tokenizer_error_reaches_the_waiting_step():
    data = ConversationSamples(3)
    order = ConversationOrder(data, batch_size=1, seed=0)
    data._fail(ValueError("bad row chat.jsonl:2"))
    with pytest.raises(ValueError, match="chat.jsonl:2"):
        order.take()


def test_a_cache_hit_does_not_load_the_tokenizer(tok, tmp_path):
    files = tmp_path / "tok"
    tok.save_pretrained(files)
    convs = counting_conversations(12)
    loads = []

    def load():
        loads.append(1)
        return tok

    first = _job(None, convs, tmp_path, tokenizer_files=files, load_tokenizer=("test", load)).finish()
    assert not first.hit and loads == [1]
    assert first.tokenizer == {"vocab_size": len(tok), "pad_id": tok.pad_token_id or 0}

    def refuse():
        raise AssertionError("the tokenizer was loaded on a cache hit")

    second = _job(None, convs, tmp_path, tokenizer_files=files, load_tokenizer=("test", refuse))
    assert second.done is not None and second.done.hit
    assert second.done.tokenizer == first.tokenizer
    (files / "tokenizer_config.json").write_text((files / "tokenizer_config.json").read_text() + " ")
    third = _job(None, convs, tmp_path, tokenizer_files=files, load_tokenizer=("test", load))
    assert third.done is None  # another byte in the tokenizer's files: another key, tokenized again
