"""One conversation to :class:`~sftpack.Sample`: render, tokenize, loss mask, over-long policy.

The pipeline per conversation is *render once, tokenize once*::

    text, spans = renderer.spans(messages)            # _render: trainable [start, end) chars
    encoding    = fast_tokenizer.encode_batch(texts)  # Rust, a batch at a time
    loss_mask   = tokens whose first character lies in a span
    samples     = over-long policy (fit / truncate / drop / split)

The mask comes from the encoding's character alignment: two edge look-ups per
trainable span (``char_to_token``, or a binary search over token offsets in
encodings above 8k tokens, where ``char_to_token``'s linear scan gets slow),
rather than materialising every token's offsets (which alone costs about a fifth
of the tokenizer's time on the default corpus).
A token that straddles a span edge (e.g. ``"\\n\\n"`` merging the header's newline
with a content's leading newline) belongs to the side where it *starts*.

Speed on the default corpus (``benchmarks/bench_tokenize.py``, 2 cores): the
whole path costs 5-15% more CPU than a plain ``tokenizer(texts)`` on the
already rendered texts (rendering about 3%, masking and the samples the rest);
in wall-clock time it keeps up with it (0.8-1.3x measured), because the Python
work on one batch runs while a helper thread encodes the previous one in Rust.

Batches of many conversations, stats and worker processes: ``_batch``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._options import Outcome, Overlong, TrainOn, choose
from ._render import renderer_for
from ._rows import Conversation
from ..handoff.sample import Sample

__all__ = ["Encoded", "OverlongError", "encode_conversation", "mask_from_offsets", "tokenize_conversation"]


class OverlongError(ValueError):
    """A conversation longer than ``max_seq_len`` under ``overlong='error'``."""

    def __init__(self, message: str, conversation_id: Any = None, length: int = 0, max_seq_len: int = 0):
        super().__init__(message)
        self.conversation_id, self.length, self.max_seq_len = conversation_id, length, max_seq_len

    def __reduce__(self) -> Any:  # picklable across worker processes
        return (type(self), (str(self), self.conversation_id, self.length, self.max_seq_len))


@dataclass
class Encoded:
    """One conversation's result: its samples (none if dropped, several if split) and what happened.

    Attributes:
        samples: the samples to train on, in order.
        outcome: :class:`~sftpack.chat.Outcome` (fit, truncated, dropped, split).
        num_tokens: tokens of the whole rendered conversation, before the policy.
        tokens_lost: tokens cut off (truncate) or left out (drop).
        trainable_lost: how many of those were trainable.
    """

    samples: list[Sample]
    outcome: Outcome
    num_tokens: int
    tokens_lost: int = 0
    trainable_lost: int = 0


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class _Options:
    train_on: TrainOn = TrainOn.ALL_ASSISTANT
    max_seq_len: int | None = None
    overlong: Overlong = Overlong.TRUNCATE


def _options(train_on: Any, max_seq_len: Any, overlong: Any) -> _Options:
    t = choose(TrainOn, train_on, "train_on")
    o = choose(Overlong, overlong, "overlong")
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) or max_seq_len < 1
    ):
        raise ValueError(f"max_seq_len must be a positive integer or None, got {max_seq_len!r}")
    return _Options(t, None if max_seq_len is None else int(max_seq_len), o)


def _backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        raise TypeError(
            f"{type(tokenizer).__name__} is not a Hugging Face *fast* tokenizer: sftpack maps trainable "
            "characters to tokens through the fast tokenizer's offsets; load it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True) or use sftpack.data.default_tokenizer()"
        )
    return backend


def _as_item(obj: Any, index: int) -> tuple[Any, Sequence[Mapping[str, Any]]]:
    if isinstance(obj, Conversation):
        return obj.id, obj.messages
    if isinstance(obj, Mapping):
        if "messages" not in obj:
            raise ValueError(f"conversation {index} has no 'messages' (keys: {sorted(obj)[:8]})")
        cid = obj.get("id", obj.get("conversation_id", index))
        return cid, obj["messages"]
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        return index, obj
    raise TypeError(
        f"conversation {index} is a {type(obj).__name__}: give a list of messages, a dict with 'messages', "
        "or a sftpack.chat.Conversation"
    )


# ---------------------------------------------------------------------------- masks


#: Above this many tokens, find span edges by binary search over token offsets instead
#: of ``char_to_token``, which scans the encoding linearly (26 us a call at 40k tokens,
#: under 1 us below 1k): keeps long conversations O(spans x log tokens).
_SCAN_LIMIT = 8192


def _first_token_from(enc: Any, pos: int, lo: int, n: int, text_len: int) -> int:
    """Index of the first token at or after ``lo`` whose first character is at or after
    ``pos`` (``n`` if none). Token start offsets never decrease along the encoding."""
    if pos >= text_len:
        return n
    if n <= _SCAN_LIMIT:
        t = enc.char_to_token(pos)
        if t is not None:
            while t > lo and enc.token_to_chars(t - 1)[0] >= pos:  # several tokens can share one character
                t -= 1
            while t < n and enc.token_to_chars(t)[0] < pos:  # a token straddling pos belongs to the left
                t += 1
            return max(t, lo)
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        if enc.token_to_chars(mid)[0] < pos:
            lo = mid + 1
        else:
            hi = mid
    return lo


def mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``(L,)`` bool: True for each token whose start offset lies in one of the ``spans``.

    The straightforward reference for the look-up in :func:`_mask_from_encoding`.

    >>> mask_from_offsets([(0, 2), (2, 3), (3, 5), (5, 6)], [(2, 5)]).tolist()
    [False, True, True, False]
    """
    starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
    mask = np.zeros(starts.shape, dtype=bool)
    for s, e in spans:
        mask |= (starts >= s) & (starts < e)
    return mask


def _mask_from_encoding(enc: Any, spans: Sequence[tuple[int, int]], n: int, text_len: int) -> np.ndarray:
    """Spans (sorted, disjoint) to a token mask with two edge look-ups per span."""
    mask = np.zeros(n, dtype=bool)
    t = 0
    try:
        for s, e in spans:
            if e <= s:
                continue
            t0 = _first_token_from(enc, s, t, n, text_len)
            t = _first_token_from(enc, e, t0, n, text_len)
            mask[t0:t] = True
    except TypeError:  # a token without offsets (None): use the plain reference
        return mask_from_offsets(enc.offsets, spans)
    return mask


# ---------------------------------------------------------------------------- one conversation


def _apply_policy(ids: np.ndarray, mask: np.ndarray, cid: Any, opts: _Options) -> Encoded:
    n = int(ids.shape[0])
    limit = opts.max_seq_len
    if limit is None or n <= limit:
        return Encoded([Sample(ids, mask, cid)], Outcome.FIT, n)
    if opts.overlong is Overlong.ERROR:
        raise OverlongError(
            f"conversation {cid!r} has {n} tokens > max_seq_len={limit}: raise max_seq_len, or choose "
            "overlong='truncate' (keep the head), 'drop' or 'split' (pieces of at most max_seq_len)",
            cid,
            n,
            limit,
        )
    if opts.overlong is Overlong.DROP:
        return Encoded([], Outcome.DROPPED, n, n, int(mask.sum()))
    if opts.overlong is Overlong.TRUNCATE:
        sample = Sample(ids[:limit], mask[:limit], cid, {"truncated_from": n})
        return Encoded([sample], Outcome.TRUNCATED, n, n - limit, int(mask[limit:].sum()))
    pieces = -(-n // limit)
    samples = [
        Sample(ids[k * limit : (k + 1) * limit], mask[k * limit : (k + 1) * limit], cid, {"piece": k, "pieces": pieces})
        for k in range(pieces)
    ]
    return Encoded(samples, Outcome.SPLIT, n)


def _render(
    items: Sequence[tuple[Any, Sequence[Mapping[str, Any]]]], renderer: Any, opts: _Options
) -> list[tuple[str, list[tuple[int, int]]]]:
    return [renderer.spans(messages, opts.train_on) for _, messages in items]


def _finish(
    items: Sequence[tuple[Any, Sequence[Mapping[str, Any]]]],
    rendered: list[tuple[str, list[tuple[int, int]]]],
    encodings: list[Any],
    opts: _Options,
) -> list[Encoded]:
    out = []
    for (cid, _), (text, spans), enc in zip(items, rendered, encodings):
        ids = np.array(enc.ids, dtype=np.int64)
        n = int(ids.shape[0])
        if n == 0:
            raise ValueError(f"conversation {cid!r} renders to no tokens: check its messages and the chat template")
        if len(spans) == 1 and spans[0] == (0, len(text)):
            mask = np.ones(n, dtype=bool)
        else:
            mask = _mask_from_encoding(enc, spans, n, len(text))
        out.append(_apply_policy(ids, mask, cid, opts))
    return out


def _encode_many(
    items: Sequence[tuple[Any, Sequence[Mapping[str, Any]]]], tokenizer: Any, opts: _Options
) -> list[Encoded]:
    """Render, tokenize (one ``encode_batch`` call) and mask a batch of conversations, in order."""
    backend = _backend(tokenizer)
    rendered = _render(items, renderer_for(tokenizer), opts)
    encodings = backend.encode_batch([t for t, _ in rendered], add_special_tokens=False)
    return _finish(items, rendered, encodings, opts)


def _encode_stream(
    batches: Iterable[Sequence[tuple[Any, Sequence[Mapping[str, Any]]]]], tokenizer: Any, opts: _Options
) -> Iterator[list[Encoded]]:
    """:func:`_encode_many` over batches, pipelined: while a helper thread encodes
    batch ``k`` (Rust, the GIL released), this thread renders batch ``k + 1`` and
    then masks batch ``k``, so the Python work overlaps the encoding."""
    backend = _backend(tokenizer)
    renderer = renderer_for(tokenizer)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sftpack-encode") as pool:
        pending = None
        for items in batches:
            rendered = _render(items, renderer, opts)
            future = pool.submit(backend.encode_batch, [t for t, _ in rendered], add_special_tokens=False)
            if pending is not None:
                yield _finish(pending[0], pending[1], pending[2].result(), opts)
            pending = (items, rendered, future)
        if pending is not None:
            yield _finish(pending[0], pending[1], pending[2].result(), opts)


def encode_conversation(
    messages: Any,
    tokenizer: Any,
    *,
    train_on: str | TrainOn = "all_assistant",
    max_seq_len: int | None = None,
    overlong: str | Overlong = "truncate",
    conversation_id: Any = None,
) -> Encoded:
    """Tokenize one conversation under any over-long policy; see :func:`tokenize_conversation`.

    Returns:
        :class:`Encoded`: zero samples (dropped), one (fit, truncated) or
        several (split), with the outcome and the tokens lost.
    """
    opts = _options(train_on, max_seq_len, overlong)
    cid, msgs = _as_item(messages, 0)
    return _encode_many([(cid if conversation_id is None else conversation_id, msgs)], tokenizer, opts)[0]


def tokenize_conversation(
    messages: Any,
    tokenizer: Any,
    *,
    train_on: str | TrainOn = "all_assistant",
    max_seq_len: int | None = None,
    overlong: str | Overlong = "truncate",
    conversation_id: Any = None,
) -> Sample:
    """Render one conversation with ``tokenizer``'s chat template into a :class:`~sftpack.Sample`.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]`` (or a
            :class:`Conversation`, or a dict with ``messages``).
        tokenizer: a Hugging Face fast tokenizer with a ``chat_template``.
        train_on: ``"all_assistant"`` (each assistant content and its end-of-turn
            token), ``"last_assistant"`` or ``"everything"``.
        max_seq_len: the longest sample allowed (``None``: no limit).
        overlong: ``"truncate"`` (keep the first ``max_seq_len`` tokens) or
            ``"error"`` (:class:`OverlongError`). ``"drop"`` and ``"split"`` give
            zero or several samples: use :func:`encode_conversation`.
        conversation_id: stored in the sample (default: the ``Conversation``'s id).

    Returns:
        A :class:`~sftpack.Sample`: ``input_ids`` ``(L,)`` int64 and ``loss_mask``
        ``(L,)`` bool, True on the assistant's tokens.

    >>> from sftpack.testing import tiny_chat_tokenizer
    >>> tok = tiny_chat_tokenizer("chatml")
    >>> s = tokenize_conversation([{"role": "user", "content": "hi"},
    ...                            {"role": "assistant", "content": "yo"}], tok)
    >>> tok.decode(s.input_ids[s.loss_mask])
    'yo<|im_end|>'
    """
    opts = _options(train_on, max_seq_len, overlong)
    if opts.overlong in (Overlong.DROP, Overlong.SPLIT):
        raise ValueError(
            f"tokenize_conversation returns one sample, so overlong={opts.overlong.value!r} is not valid here: "
            "choose 'truncate' or 'error', or call encode_conversation (zero or several samples) "
            "or tokenize_conversations"
        )
    return encode_conversation(
        messages,
        tokenizer,
        train_on=opts.train_on,
        max_seq_len=opts.max_seq_len,
        overlong=opts.overlong,
        conversation_id=conversation_id,
    ).samples[0]
