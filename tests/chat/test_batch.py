"""sftpack.chat._batch: many conversations, batches, worker processes, stats."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sftpack import Sample
from sftpack.chat import (
    BadRowError,
    Conversation,
    OverlongError,
    tokenize_conversation,
    tokenize_conversations,
)
from tests.helpers import (
    CONVO,
    HAND,
    A,
    U,
    many,
    tok_of,
)


def test_batch_stats_account_for_every_outcome(full: Sample) -> None:
    tok, n = tok_of("chatml"), len(full)
    short = [U("a"), A("b")]
    n_short = len(tokenize_conversation(short, tok))
    convs = [CONVO, short, CONVO, short]
    for policy, samples, outcome in [
        ("truncate", 4, "truncated"),
        ("drop", 2, "dropped"),
        ("split", 6, "split"),
    ]:
        out = tokenize_conversations(convs, tok, max_seq_len=n - 1, overlong=policy, progress=False)
        got = out.to_list()
        st_ = out.stats
        assert len(got) == st_.samples == samples
        assert st_.conversations == 4 == st_.fit + st_.truncated + st_.dropped + st_.split
        assert (st_.fit, getattr(st_, outcome)) == (2, 2)
        assert st_.tokens + st_.tokens_lost == 2 * n + 2 * n_short
        assert st_.tokens == sum(len(s) for s in got)
    with pytest.raises(OverlongError):
        list(tokenize_conversations(convs, tok, max_seq_len=n - 1, overlong="error", progress=False))


# ---------------------------------------------------------------------------- batches


def test_batch_equals_one_by_one_and_keeps_ids() -> None:
    tok = tok_of("llama3")
    convs = many()
    batch = tokenize_conversations(convs, tok, batch_size=7, progress=False).to_list()
    assert [s.conversation_id for s in batch] == [c.id if isinstance(c, Conversation) else c["id"] for c in convs]
    for s, c in zip(batch, convs):
        one = tokenize_conversation(c, tok)
        assert np.array_equal(s.input_ids, one.input_ids) and np.array_equal(s.loss_mask, one.loss_mask)
    plain = tokenize_conversations([c["messages"] for c in convs], tok, progress=False).to_list()
    assert [s.conversation_id for s in plain] == list(range(len(convs)))


def test_two_processes_give_the_same_output_in_the_same_order() -> None:
    tok = tok_of("chatml")
    convs = many()
    one = tokenize_conversations(convs, tok, batch_size=3, max_seq_len=12, overlong="split", progress=False)
    two = tokenize_conversations(
        convs,
        tok,
        batch_size=3,
        max_seq_len=12,
        overlong="split",
        num_proc=2,
        progress=False,
    )
    a, b = one.to_list(), two.to_list()
    assert [s.conversation_id for s in a] == [s.conversation_id for s in b]
    assert all(
        np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask) for x, y in zip(a, b)
    )
    assert one.stats == two.stats and one.stats.split > 0


def test_worker_errors_reach_the_caller() -> None:
    convs = many()
    with pytest.raises(OverlongError, match="max_seq_len=5"):
        list(
            tokenize_conversations(
                convs,
                tok_of("chatml"),
                max_seq_len=5,
                overlong="error",
                num_proc=2,
                progress=False,
            )
        )


def test_batch_options_validated_up_front() -> None:
    with pytest.raises(ValueError, match="'split', 'truncate', 'drop', 'error'"):
        tokenize_conversations([], tok_of("chatml"), overlong="cut")
    with pytest.raises(ValueError, match="num_proc"):
        tokenize_conversations([], tok_of("chatml"), num_proc=0)


def test_pipelined_batches_and_binary_search_give_the_same_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many small batches (encoded in the helper thread while the next renders) and the
    binary search used for long encodings agree with one plain batch."""
    import sftpack.chat._tokenize as impl

    tok = tok_of("chatml")
    convs = [c for c, _ in HAND.values()] * 5 + [c["messages"] if isinstance(c, dict) else c.messages for c in many()]
    items = [(i, c, False) for i, c in enumerate(convs)]
    base = impl._encode_many(items, tok, impl._options("all_assistant", None, "truncate"))
    monkeypatch.setattr(impl, "_SCAN_LIMIT", 0)
    other = tokenize_conversations(convs, tok, batch_size=3, progress=False).to_list()
    assert len(base) == len(other) == len(convs)
    for a, b in zip(base, other):
        (s,) = a.samples
        assert s.conversation_id == b.conversation_id
        assert np.array_equal(s.input_ids, b.input_ids) and np.array_equal(s.loss_mask, b.loss_mask)


def test_progress_option_and_stats_reset_per_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import sftpack.chat._batch as batch_module

    bars: list[Any] = []
    asked: list[bool] = []
    real_tqdm = batch_module.Bar

    def recording_tqdm(*args: Any, **kwargs: Any) -> Any:  # the real bar, kept for inspection
        asked.append(not kwargs.get("disable", False))
        bars.append(real_tqdm(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(batch_module, "Bar", recording_tqdm)
    tok = tok_of("chatml")
    for progress, shown in ((True, True), (False, False)):
        out = tokenize_conversations([[U("a"), A("b")]] * 3, tok, progress=progress)
        assert len(out.to_list()) == 3 and out.stats.conversations == 3
        assert asked[-1] is shown and bars[-1].total == 3 and bars[-1].n == (3 if shown else 0)
        # a second pass starts its counts anew (3, not 6), with a bar of its own
        assert len(out.to_list()) == 3 and out.stats.conversations == 3 and len(asked) % 2 == 0


def test_progress_is_off_by_default_in_library_calls(capsys: pytest.CaptureFixture[str]) -> None:
    tok = tok_of("chatml")
    out = tokenize_conversations([[U("a"), A("b")]] * 3, tok)
    assert out.progress is False and len(out.to_list()) == 3
    assert capsys.readouterr().err == ""


def test_skip_mode_stats_add_up_with_bad_inputs_of_every_kind() -> None:
    tok = tok_of("chatml")
    convs: list[Any] = [
        [U("q"), A("a")],
        {"id": "no-msgs", "body": "x"},
        [U("q"), {"role": ["assistant"], "content": "a"}],
        "not a conversation",
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        [U("q"), A("a\ud800")],
    ]
    out = tokenize_conversations(convs, tok, on_bad_row="skip")
    got = out.to_list()
    s = out.stats
    assert [x.conversation_id for x in got] == [0, 4]
    assert s.skipped == {"missing_messages": 1, "unknown_role": 1, "not_an_object": 1, "invalid_text": 1}
    assert s.conversations == 6 == s.fit + s.num_skipped
    with pytest.raises(BadRowError, match=r"conversation 'no-msgs': no 'messages' field"):
        list(tokenize_conversations(convs, tok))
