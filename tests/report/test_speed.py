"""The demo's speed logic (not its timings): the FLOP bound computed from the micro-batches
as the kernels run them, the note a path's line gets when its ratio breaks the bound or falls
below padded batches, and the rotation that times the paths' training steps in turn."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from sftpack.handoff import PackedBatch
from sftpack.loop._micro_batch import padded_micro_batch
from sftpack.report._speed import Turns, speed_note
from sftpack.report.flops import Decoder, flop_bound, step_flops
from sftpack.testing import samples_from_lengths

# hidden 8, 1 layer, MLP 16, 2 heads of 4 with 1 kv head (K = 4), vocabulary 10
M = Decoder("tiny", hidden=8, layers=1, intermediate=16, heads=2, kv_heads=1, vocab=10)
PER_SLOT = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8) + 2 * 3 * 8 * 16  # q, k, v, o + gated MLP = 1,024
HEAD = 2 * 8 * 10  # per scored token


def attn(n: int) -> float:
    """Causal attention of one sequence of n tokens: n tokens see (n + 1) / 2 keys, 2 products of 2*H FLOPs."""
    return 2 * 2 * 8 * n * (n + 1) / 2


def test_step_flops_prices_slots_attention_and_head_by_hand():
    assert M.projections() + M.mlp() == PER_SLOT
    # integers and halves below 2**53: float64 holds them exactly, so equality is exact
    assert step_flops(M, 12, [3, 9], 5) == 12 * PER_SLOT + attn(3) + attn(9) + 5 * HEAD


def test_flop_bound_from_a_padded_batch_and_its_packed_row():
    samples = samples_from_lengths([30, 200, 40], trainable_from=1)
    padded = padded_micro_batch(samples)  # [3, 200]: 600 slots, each row attends over all 200
    packed = PackedBatch.from_samples(samples)  # 270 slots, each conversation attends over itself
    labels = padded.num_label_tokens
    assert labels == packed.num_label_tokens == 29 + 199 + 39
    want = (600 * PER_SLOT + 3 * attn(200) + labels * HEAD) / (
        270 * PER_SLOT + attn(30) + attn(200) + attn(40) + labels * HEAD
    )
    bound = flop_bound(M, [padded], [packed])
    # the same real tokens divide both sides; a handful of float64 roundings (u = 1.1e-16 each) on a
    # ratio near 2.6: 1e-14 is 30x that. A bound priced on slots alone (600 / 270) misses by 0.3.
    assert bound == pytest.approx(want, rel=1e-14, abs=0)
    assert bound > 600 / 270 + 0.3  # attention saved quadratically: well above the slot ratio
    # negative control: a row that saves nothing (the padded batch of one sample) is bound 1
    one = samples[1:2]
    assert flop_bound(M, [padded_micro_batch(one)], [PackedBatch.from_samples(one)]) == pytest.approx(1.0, abs=1e-15)


def test_flop_bound_refuses_micro_batches_without_real_tokens():
    with pytest.raises(ValueError, match="no real token"):
        flop_bound(M, [], [PackedBatch.from_samples(samples_from_lengths([3]))])


def test_speed_note_says_why_a_ratio_breaks_its_bound_or_falls_below_padded():
    assert speed_note(1.8, 2.5, [1.7, 1.9], (40, 2)) == ""  # holds: no note
    assert speed_note(2.5, 2.5, [2.5], (40, 2)) == ""  # at the bound still holds
    assert speed_note(1.0, 2.5, [0.9, 1.1], (40, 2)) == ""  # as fast as padded holds
    assert speed_note(2.7, 2.5, [2.2, 3.1], (40, 2)) == "above bound by timing noise: steps 2.20-3.10x"
    assert speed_note(2.9, 2.5, [2.7, 3.1], (40, 2)).startswith("above bound on every step (steps 2.70-3.10x)")
    assert speed_note(0.9, 2.5, [0.85, 0.95], (40, 2)) == "slower: 40 attention calls a step vs 2"
    assert speed_note(0.95, 2.5, [0.9, 1.05], (2, 2)) == "slower by timing noise: steps 0.90-1.05x"
    assert "not explained" in speed_note(0.9, 2.5, [0.85, 0.95], (2, 2))


def _run(turns: Turns, name: str, steps: int, log: list, fail_at: int | None = None) -> None:
    """What ``train`` does with ``source`` and ``on_step``: the step between them is timed."""
    src = turns.source(name, SimpleNamespace(next_step=lambda: [name]))
    done = turns.on_step(name, steps)
    try:
        for k in range(steps):
            src.next_step()
            if k == fail_at:
                return  # a run that fails mid-step: train raises, and the demo's thread leaves the rotation
            log.append((name, k))
            done(SimpleNamespace(step=k + 1))
    finally:
        turns.leave(name)


def _threads(turns: Turns, runs: list[tuple]) -> list:
    log: list = []
    threads = [threading.Thread(target=_run, args=(turns, *r[:2], log, *r[2:]), daemon=True) for r in runs]
    for t in reversed(threads):  # started in the other order: the rotation, not the start, decides
        t.start()
    for t in threads:
        t.join(timeout=20)
        assert not t.is_alive(), "the rotation deadlocked"
    return log


def test_turns_run_one_step_at_a_time_in_rotation():
    turns = Turns(["a", "b", "c"])
    log = _threads(turns, [("a", 3), ("b", 3), ("c", 1)])
    assert log == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert turns.batches == {"a": [["a"]] * 3, "b": [["b"]] * 3, "c": [["c"]]}


def test_turns_go_on_without_a_run_that_fails():
    log = _threads(Turns(["a", "b", "c"]), [("a", 3), ("b", 3, 1), ("c", 3)])
    assert log == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2), ("c", 2)]
