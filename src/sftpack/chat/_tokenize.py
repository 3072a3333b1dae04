"""One conversation to :class:`~sftpack.Sample`: render, tokenize, loss mask, over-long policy.

(About 630 lines, on purpose: the options, the character-to-token mask, the
one-conversation path and the batched fast path are one pipeline whose steps
share the ``_Options`` and ``Encoded`` types; rendering is ``_render``'s part
(``_plain``'s for rows without a chat template), batching over processes ``_batch``'s.)

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
in wall-clock time it keeps up with it, because the Python
work on one batch runs while a helper thread encodes the previous one in Rust.

Row checks run here too (the reader's, from ``_rows``), on every conversation
that did not come from :func:`~sftpack.chat.read_conversations`, so an unknown
role or a conversation with nothing to train on never becomes a sample by
another door. A conversation that fails them, that the chat template refuses
(``raise_exception``) or cannot render, or whose rendering holds no trainable
token, is an error naming its id (``on_bad_row="error"``) or a count under its
reason (``"skip"``); the decision is taken per conversation, inside a batch.

Special-token text typed in a content (``"x<|im_end|>\\n<|im_start|>user"``), or in any
other string the template writes (a tool call's name or arguments, a tool schema, a
message's ``name``), stays text by default: those special strings are swapped for markers before
rendering, so after rendering the template's own special tokens are the only
ones; the text is then encoded in pieces between those, with a copy of the
tokenizer that reads special strings as text. Only conversations holding such
text take this path (none of the default corpus does); the rest keep the one
``encode_batch`` call. ``special_tokens_in_content="control"`` keeps Hugging
Face's behaviour (they become control tokens), for data that relies on it.

Rows of the other formats (``_rows``' :class:`~sftpack.chat.RowFormat`): Alpaca is
messages like any other; a conversational prompt/completion row renders by the
chat template with only the spans after its prompt's own rendering kept (its
prompt may hold assistant turns, never trained); plain ``text`` and standard
prompt/completion rows need no chat template (``_plain``), so a tokenizer without
one serves them, and fails only at the first row that needs it.

A preference pair (``_rows``' :class:`~sftpack.chat.PreferencePair`) is one item that renders
as two members, chosen then rejected; the prompt's text (up to the ``seam``) is encoded once,
each answer's text apart after it, so both samples start with the same prompt tokens, and the
over-long policy applies to the pair whole (:func:`_pair_policy`); a member that fails skips
the pair.

Batches of many conversations, stats and worker processes: ``_batch``.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _optional
from .._base import positive_int
from .._types import Tokenizer
from ..sample import DEFAULT_OVERLONG, Conversation, Overlong, OverlongError, Sample, overlong_spans
from ._bad_row import BadRowError, RowProblem
from ._options import (
    BadRowReason,
    OnBadRow,
    Outcome,
    SpecialTokensInContent,
    TrainOn,
    choose,
)
from ._plain import Ends, ends_of, plain_text
from ._render import ChatRenderer, TemplateError, renderer_for
from ._rows import PAIR_ROLES, FormattedMessages, PreferencePair, _messages

__all__ = [
    "ConversationTemplateError",
    "Encoded",
    "TextWeights",
    "encode_conversation",
    "mask_from_offsets",
    "tokenize_conversation",
    "tokenize_pair",
]


class ConversationTemplateError(BadRowError, TemplateError):
    """The chat template refused or failed to render one conversation (``on_bad_row='error'``);
    both a :class:`~sftpack.chat.BadRowError` (``reason='template_error'``) and a
    :class:`~sftpack.chat.TemplateError`."""


@dataclass
class Encoded:
    """One conversation's result: its samples (none if dropped, several if split) and what happened.

    Attributes:
        samples: the samples to train on, in order (a preference pair's: chosen, rejected).
        outcome: :class:`~sftpack.chat.Outcome` (fit, truncated, dropped, split, skipped).
        num_tokens: tokens of the whole rendered conversation, before the policy.
        tokens_lost: tokens cut off (truncate) or left out (drop).
        trainable_lost: how many of those were trainable.
        labels: supervised labels of the whole conversation, ``loss_mask[1:].sum()``
            (the first token is never a target).
        labels_lost: those no sample gives: the cut tail (truncate), all (drop),
            the first token of every piece after the first (split: a piece's first
            token has no earlier token in its row to be the target of).
        special_text: special-token strings found in what the template writes (contents, tool
            calls' names and arguments, tools schemas, other message keys).
        skip: ``(reason, detail, fix)`` when ``outcome`` is ``skipped``.
        conversation_id: the conversation's id (set when skipped).
    """

    samples: list[Sample]
    outcome: Outcome
    num_tokens: int
    tokens_lost: int = 0
    trainable_lost: int = 0
    labels: int = 0
    labels_lost: int = 0
    special_text: int = 0
    skip: tuple[BadRowReason, str, str] | None = None
    conversation_id: Any = None


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class _Options:
    train_on: TrainOn = TrainOn.ALL_ASSISTANT
    max_seq_len: int | None = None
    overlong: Overlong = DEFAULT_OVERLONG
    on_bad_row: OnBadRow = OnBadRow.ERROR
    special_tokens: SpecialTokensInContent = SpecialTokensInContent.TEXT


def _options(
    train_on: str | TrainOn,
    max_seq_len: int | None,
    overlong: str | Overlong,
    on_bad_row: str | OnBadRow = "error",
    special_tokens_in_content: str | SpecialTokensInContent = "text",
) -> _Options:
    t = choose(TrainOn, train_on, "train_on")
    o = choose(Overlong, overlong, "overlong")
    b = choose(OnBadRow, on_bad_row, "on_bad_row")
    sp = choose(SpecialTokensInContent, special_tokens_in_content, "special_tokens_in_content")
    limit = positive_int("max_seq_len (or None)", max_seq_len, allow_none=True)
    return _Options(t, limit, o, b, sp)


def fast_backend(tokenizer: Tokenizer) -> Any:
    """The ``tokenizers`` backend of a Hugging Face *fast* tokenizer (its ``backend_tokenizer``:
    offsets, added tokens, ``encode_batch``); raises ``TypeError`` naming the fix for any other
    tokenizer (sftpack maps trainable characters to tokens through the offsets)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        raise TypeError(
            f"{type(tokenizer).__name__} is not a Hugging Face *fast* tokenizer: sftpack maps trainable "
            "characters to tokens through the fast tokenizer's offsets; load it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True) or use sftpack.data.default_tokenizer()"
        )
    return backend


#: One conversation on its way in: (id, messages or the raw row, whether the row checks already passed).
Item = tuple[Any, Any, bool]


def as_item(obj: Any, index: int) -> Item:
    """One input (a :class:`Conversation`, a row mapping, or a list of messages) as ``(id, payload,
    checked)``, the id the row's or ``index``; the row checks run later, in the worker."""
    if isinstance(obj, Conversation):
        return obj.id, obj.messages, obj.checked
    if isinstance(obj, Mapping):
        cid = obj.get("id", obj.get("conversation_id", index))
        return cid, dict(obj), False
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        return index, obj if isinstance(obj, FormattedMessages) else list(obj), False
    return index, obj, False  # not a row at all: the checks say so (not_an_object)


def _checked(item: Item) -> Sequence[Mapping[str, Any]]:
    """The item's messages, through the reader's row checks (raises ``RowProblem``)."""
    _, payload, checked = item
    if checked:
        return payload
    try:
        return _messages(payload, None, allow_list=True)
    except RowProblem:
        raise
    except (TypeError, ValueError, RecursionError) as e:  # a value no check foresaw: still one bad row
        raise RowProblem(
            BadRowReason.MALFORMED_MESSAGE,
            f"unusable row ({type(e).__name__}: {e})",
            "write messages as {'role': str, 'content': str} objects",
        ) from None


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


def mask_from_offsets(offsets: Sequence[tuple[int, int]] | np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
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


def _skipped(cid: Any, reason: BadRowReason, detail: str, fix: str, special_text: int = 0) -> Encoded:
    return Encoded([], Outcome.SKIPPED, 0, special_text=special_text, skip=(reason, detail, fix), conversation_id=cid)


def _apply_policy(
    ids: np.ndarray,
    mask: np.ndarray,
    cid: Any,
    opts: _Options,
    special_text: int = 0,
    weights: np.ndarray | None = None,
    group: str | int | None = None,
) -> Encoded:
    """The over-long policy on one conversation's tokens (``weights``: its tokens' weights, or
    ``None``: a sample without weights, as before weights existed; ``group``: the row's
    ``group``, in each sample's ``meta["group"]``, ``None``: no such key, as before groups existed)."""

    def w(a: int, b: int) -> np.ndarray | None:
        return None if weights is None else weights[a:b]

    def meta(**more: Any) -> dict[str, Any]:
        return more if group is None else {"group": group, **more}

    n = int(ids.shape[0])
    labels = int(mask[1:].sum())
    limit = opts.max_seq_len
    spans = overlong_spans(n, limit, opts.overlong, f"conversation {cid!r}", cid)
    if limit is None or n <= limit:
        return Encoded(
            [Sample(ids, mask, cid, meta(), weights=w(0, n))], Outcome.FIT, n, labels=labels, special_text=special_text
        )
    if opts.overlong is Overlong.DROP:
        return Encoded([], Outcome.DROPPED, n, n, int(mask.sum()), labels, labels, special_text)
    if opts.overlong is Overlong.TRUNCATE:
        sample = Sample(ids[:limit], mask[:limit], cid, meta(truncated_from=n), weights=w(0, limit))
        lost = int(mask[limit:].sum())  # the targets at limit..n-1 (mask[limit] was the last kept token's)
        return Encoded([sample], Outcome.TRUNCATED, n, n - limit, lost, labels, lost, special_text)
    samples = [
        Sample(ids[a:b], mask[a:b], cid, meta(piece=k, pieces=len(spans)), weights=w(a, b))
        for k, (a, b) in enumerate(spans)
    ]
    # The first token of each later piece was the target of the token before it, now in another row.
    boundary = int(mask[limit::limit].sum())
    return Encoded(samples, Outcome.SPLIT, n, labels=labels, labels_lost=boundary, special_text=special_text)


@dataclass(frozen=True)
class TextWeights:
    """A weighted row's weights over its rendered text: ``base`` on every token (the row's
    ``weight`` / ``advantage``, else 1), times ``w`` on the tokens that start in a turn's
    ``[start, end)`` characters (an assistant message's own ``weight``)."""

    base: float = 1.0
    turns: tuple[tuple[int, int, float], ...] = ()

    def of_tokens(self, offsets: Any, n: int) -> np.ndarray:
        """``(n,)`` float64 weights of the tokens whose ``(start, end)`` character offsets are ``offsets``."""
        out = np.full(n, self.base, dtype=np.float64)
        if self.turns:
            starts = np.asarray([o[0] for o in offsets], dtype=np.int64).reshape(-1)[:n]
            for a, b, w in self.turns:
                out[(starts >= a) & (starts < b)] *= w
        return out


def text_weights(messages: Sequence[Mapping[str, Any]], text: str, render: Any) -> TextWeights | None:
    """The :class:`TextWeights` of a row's messages rendered as ``text`` (``None``: no weight at
    all, the row as before weights existed). ``render(prefix)`` renders the first messages the
    way ``text`` was rendered; a turn's characters run from the rendering of the messages before
    it to that of the messages through it, so the template must render earlier turns unchanged
    (raises :class:`TemplateError` where it does not)."""
    base = getattr(messages, "weight", None)
    weighted = [i for i, m in enumerate(messages) if m.get("weight") is not None]
    if base is None and not weighted:
        return None
    turns = []
    for i in weighted:
        head, through = render(messages[:i]) if i else "", render(messages[: i + 1])
        if not (text.startswith(through) and through.startswith(head)):
            raise TemplateError(
                f"the chat template renders message {i} differently inside the whole conversation, so which "
                "tokens its 'weight' covers is unknown: use a template that renders earlier turns unchanged, or "
                "weigh the whole row ('weight' beside 'messages')"
            )
        turns.append((len(head), len(through), float(messages[i]["weight"])))
    return TextWeights(1.0 if base is None else float(base), tuple(turns))


@dataclass
class _Rendered:
    """One conversation between rendering and tokenizing."""

    cid: Any
    text: str = ""
    spans: list[tuple[int, int]] | None = None
    template_specials: list[tuple[int, int]] | None = None  # set: encode in pieces (special text kept as text)
    special_text: int = 0
    skip: Encoded | None = None
    seam: int | None = None  # a pair member's: where its prompt's text ends (prompt and answer encoded apart)
    role: str | None = None  # a pair member's role (``PAIR_ROLES``)
    weights: TextWeights | None = None  # a weighted row's: its weight, and its weighted turns' characters
    group: str | int | None = None  # a row's ``group`` (an RL prompt's completions): each sample's meta["group"]


_TEMPLATE_FIX = (
    "make the conversation fit the template (e.g. roles alternating user/assistant, as many templates "
    "require), or use a template that accepts it"
)


def _render_one(item: Item, ctx: _Context, opts: _Options) -> list[_Rendered]:
    """One item rendered: one conversation, or a preference pair's two members (or its one skip)."""
    cid = item[0]
    try:
        messages = _checked(item)
    except RowProblem as bad:
        return [_Rendered(cid, skip=_skipped(cid, bad.reason, bad.detail, bad.fix))]
    if isinstance(messages, PreferencePair):
        return _render_pair(cid, messages, ctx, opts)
    rendered = _render_messages(cid, messages, ctx, opts)
    rendered.group = getattr(messages, "group", None)
    return [rendered]


def _render_messages(cid: Any, messages: Sequence[Mapping[str, Any]], ctx: _Context, opts: _Options) -> _Rendered:
    if isinstance(messages, FormattedMessages) and not messages.template:
        return _render_plain(cid, messages, ctx, opts)
    renderer = ctx.renderer  # a tokenizer without a chat template fails here, for every row alike
    n_special = renderer.count_special_text(messages)
    keep = bool(n_special) and opts.special_tokens is SpecialTokensInContent.TEXT
    try:
        text, spans, specials = render_spans(renderer, messages, opts.train_on, ctx.tokenizer, keep_special_text=keep)
        weights = text_weights(
            messages,
            text,
            lambda prefix: render_spans(
                renderer, prefix, TrainOn.EVERYTHING, ctx.tokenizer, keep_special_text=keep, check_tools=False
            )[0],
        )
    except Exception as e:  # noqa: BLE001 - TemplateError (raise_exception...) or any failure inside Jinja
        detail = str(e) if isinstance(e, TemplateError) else f"the chat template failed: {type(e).__name__}: {e}"
        return _Rendered(cid, skip=_skipped(cid, BadRowReason.TEMPLATE_ERROR, detail, _TEMPLATE_FIX, n_special))
    return _Rendered(cid, text, spans, specials, n_special, weights=weights)


def render_spans(
    renderer: ChatRenderer,
    messages: Any,
    train_on: TrainOn,
    tokenizer: Any,
    *,
    keep_special_text: bool,
    check_tools: bool = True,
) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]] | None]:
    """One conversation through its chat template: ``(text, spans, template_specials)``, the
    trainable spans of the rows' rule (a prompt/completion row: its completion's only), the
    template's own special tokens where ``keep_special_text`` (:meth:`ChatRenderer.spans_special_text`:
    the data's special-token text stays text), else ``None``; raises :class:`TemplateError` when
    the template fails or does not write the tools and tool calls. The rendering of every path
    (text, and with media :mod:`sftpack.multimodal`'s, whose contents are lists of parts)."""
    if keep_special_text:
        text, spans, specials = renderer.spans_special_text(messages, train_on)
    else:
        (text, spans), specials = renderer.spans(messages, train_on), None
    if isinstance(messages, FormattedMessages) and train_on is not TrainOn.EVERYTHING:
        spans = _completion_spans(renderer, messages, text, spans)
    if check_tools:
        _check_tools_written(messages, text, tokenizer)
    return text, spans, specials


def _check_tools_written(messages: Any, text: str, tokenizer: Any) -> None:
    """Raise :class:`TemplateError` when the rendering lacks a tool call's or a tool's name: the
    chat template ignores ``tool_calls`` / ``tools``, and training on it would teach answers to
    calls the text never shows."""
    names = [("tool call", c["function"]["name"]) for m in messages for c in (m.get("tool_calls") or ())]
    for tool in getattr(messages, "tools", None) or ():
        name = (tool.get("function") if isinstance(tool.get("function"), dict) else tool).get("name")
        if isinstance(name, str):
            names.append(("tool", name))
    for what, name in names:
        # as written, or JSON-escaped as ``tojson`` writes it (a name with '"' or a newline)
        if not any(form in text for form in (name, json.dumps(name, ensure_ascii=False)[1:-1], json.dumps(name)[1:-1])):
            template = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise TemplateError(
                f"the chat template of {template!r} does not write the {what} {name!r} (it ignores "
                "tools / tool_calls): use a tokenizer whose template renders them (sftpack's embedded ChatML does)"
            )


def _completion_spans(
    renderer: ChatRenderer, messages: FormattedMessages, text: str, spans: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The spans of a conversational prompt/completion row that lie in the completion:
    those starting at or after the end of the prompt's own rendering (which must be
    where the whole rendering begins). Only a prompt with assistant turns has any other."""
    prompt = messages[: messages.prompt_messages]
    if not any(m.get("role") == "assistant" for m in prompt):
        return spans
    head = renderer.render(prompt)
    if not text.startswith(head):
        raise TemplateError(
            "the chat template renders the prompt differently inside the whole conversation, so where the "
            "completion starts is unknown: use a template that renders earlier turns unchanged"
        )
    return [s for s in spans if s[0] >= len(head)]


class _Context:
    """What rendering needs of the tokenizer, found on first need: the chat template's
    renderer (a tokenizer without one serves plain-text rows all the same) and the
    plain-text rows' BOS, EOS and special-token strings."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._renderer: ChatRenderer | None = None
        self._ends: Ends | None = None

    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            self._renderer = renderer_for(self.tokenizer)
        return self._renderer

    @property
    def ends(self) -> Ends:
        if self._ends is None:
            self._ends = ends_of(self.tokenizer, fast_backend(self.tokenizer))
        return self._ends


def _render_plain(cid: Any, messages: FormattedMessages, ctx: _Context, opts: _Options) -> _Rendered:
    """A row of plain text, no chat template (``_plain`` has the rule)."""
    try:
        text, spans, specials, n_special = plain_text(
            messages, ctx.ends, opts.train_on, opts.special_tokens is SpecialTokensInContent.TEXT
        )
    except RowProblem as bad:
        return _Rendered(cid, skip=_skipped(cid, bad.reason, bad.detail, bad.fix))
    base = messages.weight
    return _Rendered(cid, text, spans, specials, n_special, weights=None if base is None else TextWeights(base))


def _render_pair(cid: Any, pair: PreferencePair, ctx: _Context, opts: _Options) -> list[_Rendered]:
    """A preference pair's two members (chosen, rejected), each with the ``seam`` where the
    prompt's text ends; or the pair's one skip, whichever member failed."""
    members = [_render_messages(cid, m, ctx, opts) for m in pair.members()]
    for r in members:
        if r.skip is not None:
            return [r]
    if pair.template:
        try:
            head = ctx.renderer.render(FormattedMessages(pair.prompt, pair.format, tools=pair.tools))
        except TemplateError as e:
            return [_Rendered(cid, skip=_skipped(cid, BadRowReason.TEMPLATE_ERROR, str(e), _TEMPLATE_FIX))]
    else:
        head = ctx.ends.bos + pair[0]["content"]
    for role, r in zip(PAIR_ROLES, members):
        if not r.text.startswith(head) or any(a < len(head) < b for a, b in r.template_specials or ()):
            detail = (
                f"the chat template renders the pair's prompt differently inside the {role} conversation, so "
                "where the answer starts is unknown"
            )
            fix = "use a template that renders earlier turns unchanged"
            return [_Rendered(cid, skip=_skipped(cid, BadRowReason.TEMPLATE_ERROR, detail, fix))]
        r.seam, r.role = len(head), role
    return members


def _render(items: Sequence[Item], ctx: _Context, opts: _Options) -> list[_Rendered]:
    return [r for item in items for r in _render_one(item, ctx, opts)]


def _plain_texts(rendered: Sequence[_Rendered]) -> list[str]:
    """The texts that go through the one ``encode_batch`` call, in order (a pair member's: its
    answer's text, after the chosen member's prompt text, which both members share)."""
    texts = []
    for r in rendered:
        if r.skip is not None or r.template_specials is not None:
            continue
        if r.seam is None:
            texts.append(r.text)
            continue
        if r.role == PAIR_ROLES[0]:
            texts.append(r.text[: r.seam])
        texts.append(r.text[r.seam :])
    return texts


def _encode_texts(backend: Any, texts: list[str]) -> list[Any]:
    """``encode_batch``; if it fails, one text at a time, a failure as the exception itself."""
    try:
        return list(backend.encode_batch(texts, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - whatever the Rust side raises: find the text that caused it
        out: list[Any] = []
        for t in texts:
            try:
                out.append(backend.encode(t, add_special_tokens=False))
            except Exception as e:  # noqa: BLE001 - e.g. a surrogate from a template variable
                out.append(e)
        return out


_TEXT_BACKENDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _text_backend(tokenizer: Tokenizer) -> Any:
    """A copy of the fast tokenizer that reads special-token strings as plain text
    (built on first need, then cached per tokenizer)."""
    try:
        cached = _TEXT_BACKENDS.get(tokenizer)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    copy = _optional.tokenizers().Tokenizer.from_str(fast_backend(tokenizer).to_str())
    copy.encode_special_tokens = True
    try:
        _TEXT_BACKENDS[tokenizer] = copy
    except TypeError:  # not weak-referenceable: no cache
        pass
    return copy


def warm_tokenizer(tokenizer: Tokenizer) -> None:
    """Build the per-tokenizer caches a rendering with special-token text needs (the plain-text
    copy of the backend, :func:`_text_backend`: 0.7 s for Qwen's vocabulary) in this process, so
    tokenizer workers forked after it inherit them instead of each building its own."""
    _text_backend(tokenizer)


def encode_pieces(
    text: str, template_specials: Sequence[tuple[int, int]] | None, tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """Ids and ``(L, 2)`` character offsets of a rendered ``text``, special tokens only at the
    ``template_specials`` spans (the chat template's): the rest is plain text, special-token text
    in the data too (the text path's encoding and :mod:`sftpack.multimodal`'s)."""
    backend, plain = fast_backend(tokenizer), _text_backend(tokenizer)
    order: list[tuple[bool, int, int]] = []  # (is_special, start, end): text pieces between the template's specials
    pos = 0
    for a, b in template_specials or []:
        if a > pos:
            order.append((False, pos, a))
        order.append((True, a, b))
        pos = b
    if pos < len(text):
        order.append((False, pos, len(text)))
    texts = [text[a:b] for special, a, b in order if not special]
    encs = iter(plain.encode_batch(texts, add_special_tokens=False) if texts else [])
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for special, a, b in order:
        if special:
            ids.append(backend.token_to_id(text[a:b]))
            offsets.append((a, b))
        else:
            enc = next(encs)
            ids.extend(enc.ids)
            offsets.extend((a + o0, a + o1) for o0, o1 in enc.offsets)
    return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


def _finish(rendered: Sequence[_Rendered], encodings: list[Any], tokenizer: Tokenizer, opts: _Options) -> list[Encoded]:
    out: list[Encoded] = []
    plain = iter(encodings)
    members = iter(rendered)
    for r in members:
        if r.skip is not None:
            out.append(r.skip)
            continue
        if r.seam is not None:  # a pair: its chosen member here, its rejected one next
            out.append(_finish_pair((r, next(members)), plain, tokenizer, opts))
            continue
        assert r.spans is not None
        offsets: Any = None
        if r.template_specials is not None:
            ids, offsets = encode_pieces(r.text, r.template_specials, tokenizer)
            mask = mask_from_offsets(offsets, r.spans)
        else:
            enc = next(plain)
            if isinstance(enc, Exception):
                out.append(
                    _skipped(
                        r.cid,
                        BadRowReason.INVALID_TEXT,
                        f"the tokenizer refused the rendered text ({type(enc).__name__}: {enc})",
                        "remove lone surrogates and other non-characters from the row",
                        r.special_text,
                    )
                )
                continue
            ids = np.array(enc.ids, dtype=np.int64)
            offsets = enc.offsets if r.weights is not None and r.weights.turns else None
            n = int(ids.shape[0])
            if len(r.spans) == 1 and r.spans[0] == (0, len(r.text)):
                mask = np.ones(n, dtype=bool)
            else:
                mask = _mask_from_encoding(enc, r.spans, n, len(r.text))
        if not mask[1:].any():  # also catches a rendering with no tokens at all
            out.append(
                _skipped(
                    r.cid,
                    BadRowReason.NO_TRAINABLE_TOKENS,
                    f"the rendering ({len(ids)} tokens) holds no trainable token for train_on={opts.train_on.value!r}"
                    " (does the chat template drop or hide the assistant turns?)",
                    "use a template that renders the assistant turns, or --train-on everything "
                    "(train_on='everything' in Python)",
                    r.special_text,
                )
            )
            continue
        weights = None if r.weights is None else r.weights.of_tokens(offsets, int(ids.shape[0]))
        out.append(_apply_policy(ids, mask, r.cid, opts, r.special_text, weights, r.group))
    return out


_REFUSED_FIX = "remove lone surrogates and other non-characters from the row"


def _finish_pair(
    pair: tuple[_Rendered, _Rendered], plain: Iterator[Any], tokenizer: Tokenizer, opts: _Options
) -> Encoded:
    """A pair's two members to tokens: the prompt's text encoded once (the chosen member's), each
    answer's text apart after it, so both samples start with the very same prompt tokens; then
    the pair's over-long policy (:func:`_pair_policy`)."""
    pieces: list[list[Any]] = []  # per member: [prefix?, answer] as (ids, offsets) or an exception
    for r in pair:
        assert r.seam is not None
        parts = [(0, r.seam), (r.seam, len(r.text))] if r.role == PAIR_ROLES[0] else [(r.seam, len(r.text))]
        got: list[Any] = []
        for a, b in parts:
            if r.template_specials is None:  # from the batch's encode_batch call, in _plain_texts' order
                enc = next(plain)
                got.append(enc if isinstance(enc, Exception) else (enc.ids, enc.offsets))
            else:
                inside = [(x - a, y - a) for x, y in r.template_specials if a <= x and y <= b]
                got.append(encode_pieces(r.text[a:b], inside, tokenizer))
        pieces.append(got)
    cid, special = pair[0].cid, pair[0].special_text + pair[1].special_text
    for got in pieces:
        for p in got:
            if isinstance(p, Exception):
                detail = f"the tokenizer refused the rendered text ({type(p).__name__}: {p})"
                return _skipped(cid, BadRowReason.INVALID_TEXT, detail, _REFUSED_FIX, special)
    prefix_ids, prefix_offsets = pieces[0][0]
    tokens = []
    for r, got in zip(pair, pieces):
        assert r.seam is not None and r.spans is not None
        answer_ids, answer_offsets = got[-1]
        ids = np.concatenate([np.asarray(prefix_ids, dtype=np.int64), np.asarray(answer_ids, dtype=np.int64)])
        offsets = np.concatenate(
            [
                np.asarray(prefix_offsets, dtype=np.int64).reshape(-1, 2),
                np.asarray(answer_offsets, dtype=np.int64).reshape(-1, 2) + r.seam,
            ]
        )
        mask = mask_from_offsets(offsets, r.spans)
        if not mask[1:].any():
            return _skipped(
                cid,
                BadRowReason.NO_TRAINABLE_TOKENS,
                f"the {r.role} answer's rendering holds no trainable token for train_on={opts.train_on.value!r}",
                "use a template that renders the assistant turns, or remove the pair",
                special,
            )
        tokens.append((ids, mask))
    return _pair_policy(tokens, cid, opts, special)


def _pair_policy(tokens: list[tuple[np.ndarray, np.ndarray]], cid: Any, opts: _Options, special_text: int) -> Encoded:
    """The over-long policy on a pair, whole: kept (both fit), dropped (``drop``: both), truncated
    (``truncate``: each member over ``max_seq_len`` keeps its head; a member left without an
    answer label drops the pair), or refused (``error``, and ``split``: a pair is never split)."""
    n = sum(int(ids.shape[0]) for ids, _ in tokens)
    labels = sum(int(mask[1:].sum()) for _, mask in tokens)
    metas = [{"group": cid, "role": role, "group_size": len(tokens)} for role in PAIR_ROLES]
    limit = opts.max_seq_len
    longest = max(int(ids.shape[0]) for ids, _ in tokens)
    if limit is None or longest <= limit:
        samples = [Sample(ids, mask, cid, meta) for (ids, mask), meta in zip(tokens, metas)]
        return Encoded(samples, Outcome.FIT, n, labels=labels, special_text=special_text)
    dropped = Encoded([], Outcome.DROPPED, n, n, sum(int(m.sum()) for _, m in tokens), labels, labels, special_text)
    if opts.overlong is Overlong.DROP:
        return dropped
    if opts.overlong is Overlong.TRUNCATE:
        if any(not mask[1:limit].any() for _, mask in tokens):  # a member would keep no answer: no pair left
            return dropped
        samples, lost, trainable_lost = [], 0, 0
        for (ids, mask), meta in zip(tokens, metas):
            if ids.shape[0] > limit:
                meta = {**meta, "truncated_from": int(ids.shape[0])}
                lost += int(ids.shape[0]) - limit
                trainable_lost += int(mask[limit:].sum())
            samples.append(Sample(ids[:limit], mask[:limit], cid, meta))
        return Encoded(samples, Outcome.TRUNCATED, n, lost, trainable_lost, labels, trainable_lost, special_text)
    role = PAIR_ROLES[[int(ids.shape[0]) for ids, _ in tokens].index(longest)]
    raise OverlongError(
        f"preference pair {cid!r}: its {role} sequence has {longest} tokens, more than max_seq_len={limit}, and a "
        "pair is kept or cut whole, never split: raise max_seq_len, or pass overlong='truncate' / --overlong "
        "truncate (each member keeps its first max_seq_len tokens) or overlong='drop' / --overlong drop (the pair "
        "left out, counted)",
        cid,
        longest,
        limit,
    )


def _encode_many(items: Sequence[Item], tokenizer: Tokenizer, opts: _Options) -> list[Encoded]:
    """Check, render, tokenize (one ``encode_batch`` call) and mask a batch of conversations, in order."""
    backend = fast_backend(tokenizer)
    rendered = _render(items, _Context(tokenizer), opts)
    return _finish(rendered, _encode_texts(backend, _plain_texts(rendered)), tokenizer, opts)


def _encode_stream(batches: Iterable[Sequence[Item]], tokenizer: Tokenizer, opts: _Options) -> Iterator[list[Encoded]]:
    """:func:`_encode_many` over batches, pipelined: while a helper thread encodes
    batch ``k`` (Rust, the GIL released), this thread renders batch ``k + 1`` and
    then masks batch ``k``, so the Python work overlaps the encoding."""
    backend = fast_backend(tokenizer)
    ctx = _Context(tokenizer)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sftpack-encode") as pool:
        pending = None
        for items in batches:
            rendered = _render(items, ctx, opts)
            future = pool.submit(_encode_texts, backend, _plain_texts(rendered))
            if pending is not None:
                yield _finish(pending[0], pending[1].result(), tokenizer, opts)
            pending = (rendered, future)
        if pending is not None:
            yield _finish(pending[0], pending[1].result(), tokenizer, opts)


def _raise_for(enc: Encoded) -> None:
    """``on_bad_row='error'``: the skipped conversation as an exception naming it."""
    assert enc.skip is not None
    cid = enc.conversation_id
    reason, detail, fix = enc.skip
    cls = ConversationTemplateError if reason is BadRowReason.TEMPLATE_ERROR else BadRowError
    raise cls(f"conversation {cid!r}", "", reason, detail, fix)


def encode_conversation(
    messages: Any,
    tokenizer: Tokenizer,
    *,
    train_on: str | TrainOn = "all_assistant",
    max_seq_len: int | None = None,
    overlong: str | Overlong = DEFAULT_OVERLONG,
    conversation_id: Any = None,
    on_bad_row: str | OnBadRow = "error",
    special_tokens_in_content: str | SpecialTokensInContent = "text",
) -> Encoded:
    """Tokenize one conversation under any over-long policy; see :func:`tokenize_conversation`.

    ``on_bad_row="skip"`` returns a conversation that fails the row checks, that the
    template refuses or that has no trainable token as an :class:`Encoded` with
    outcome ``skipped`` and ``skip=(reason, detail, fix)``, instead of raising.

    Returns:
        :class:`Encoded`: zero samples (dropped, skipped), one (fit, truncated) or
        several (split), with the outcome and the tokens and labels lost.
    """
    opts = _options(train_on, max_seq_len, overlong, on_bad_row, special_tokens_in_content)
    return _encode_one(messages, tokenizer, opts, conversation_id)


def _encode_one(messages: Any, tokenizer: Tokenizer, opts: _Options, conversation_id: Any) -> Encoded:
    """One conversation under ``opts``, named ``conversation_id`` (default: its own id or 0);
    a skipped one raised under ``on_bad_row='error'``."""
    cid, payload, checked = as_item(messages, 0)
    cid = cid if conversation_id is None else conversation_id
    enc = _encode_many([(cid, payload, checked)], tokenizer, opts)[0]
    if enc.skip is not None and opts.on_bad_row is OnBadRow.ERROR:
        _raise_for(enc)
    return enc


def tokenize_conversation(
    messages: Any,
    tokenizer: Tokenizer,
    *,
    train_on: str | TrainOn = "all_assistant",
    max_seq_len: int | None = None,
    overlong: str | Overlong = DEFAULT_OVERLONG,
    conversation_id: Any = None,
    special_tokens_in_content: str | SpecialTokensInContent = "text",
) -> Sample:
    """Render one conversation with ``tokenizer``'s chat template into a :class:`~sftpack.Sample`.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]`` (or a
            :class:`Conversation`, or a row: a dict with ``messages``, ShareGPT
            ``conversations``, Alpaca ``instruction`` / ``output``, ``prompt`` /
            ``completion`` or ``text``; see :class:`~sftpack.chat.RowFormat`).
        tokenizer: a Hugging Face fast tokenizer with a ``chat_template``.
        train_on: ``"all_assistant"`` (each assistant content and its end-of-turn
            token), ``"last_assistant"`` or ``"everything"``.
        max_seq_len: the longest sample allowed (``None``: no limit).
        overlong: what an over-long conversation becomes (:class:`~sftpack.sample.Overlong`).
            One sample comes back, so ``"split"`` (the default of every layer) works
            only while one piece suffices: a conversation over ``max_seq_len`` raises
            :class:`OverlongError` rather than losing its tail unasked. ``"truncate"``
            keeps the first ``max_seq_len`` tokens; ``"error"`` always raises. For
            ``"drop"`` and real splits (zero or several samples) use
            :func:`encode_conversation` or :func:`tokenize_conversations`.
        conversation_id: stored in the sample (default: the ``Conversation``'s id).
        special_tokens_in_content: ``"text"`` (special-token strings inside a
            content are tokenized as plain text) or ``"control"`` (they become the
            control tokens, as in ``apply_chat_template``).

    Returns:
        A :class:`~sftpack.Sample`: ``input_ids`` ``(L,)`` int64 and ``loss_mask``
        ``(L,)`` bool, True on the assistant's tokens.

    Raises:
        BadRowError: the messages fail the reader's row checks (unknown role,
            no assistant turn...), or the rendering holds no trainable token; the
            message names the conversation and the fix.
        ConversationTemplateError: the chat template refuses or fails to render it.
        OverlongError: over ``max_seq_len`` with ``overlong="error"`` or ``"split"``.

    >>> from sftpack.testing import tiny_chat_tokenizer
    >>> tok = tiny_chat_tokenizer("chatml")
    >>> s = tokenize_conversation([{"role": "user", "content": "hi"},
    ...                            {"role": "assistant", "content": "yo"}], tok)
    >>> tok.decode(s.input_ids[s.loss_mask])
    'yo<|im_end|>'
    >>> s = tokenize_conversation({"instruction": "Add 2 and 3.", "input": "", "output": "5"}, tok)  # Alpaca
    >>> tok.decode(s.input_ids[s.loss_mask])
    '5<|im_end|>'
    >>> s = tokenize_conversation({"prompt": "2 + 3 =", "completion": " 5"}, tok)  # plain text, no template
    >>> tok.decode(s.input_ids), tok.decode(s.input_ids[s.loss_mask])
    ('2 + 3 = 5<|im_end|>', ' 5<|im_end|>')
    """
    opts = _options(train_on, max_seq_len, overlong, "error", special_tokens_in_content)
    if opts.overlong is Overlong.DROP:
        raise ValueError(
            "tokenize_conversation returns one sample, so overlong='drop' is not valid here: choose 'split' "
            "(the default: one piece, or an error), 'truncate' or 'error', or call encode_conversation "
            "(zero or several samples) or tokenize_conversations"
        )
    enc = _encode_one(messages, tokenizer, opts, conversation_id)
    if enc.samples and "role" in enc.samples[0].meta:
        raise ValueError(
            "tokenize_conversation returns one sample, and a preference row gives two (chosen, rejected): "
            "call tokenize_pair (or encode_conversation, tokenize_conversations)"
        )
    if len(enc.samples) > 1:
        cid = enc.samples[0].conversation_id
        raise OverlongError(
            f"conversation {cid!r} has {enc.num_tokens} tokens, more than max_seq_len="
            f"{opts.max_seq_len}, and tokenize_conversation returns one sample, so it cannot split it: call "
            "encode_conversation or tokenize_conversations (which split), pass overlong='truncate' (keep the "
            "head) or raise max_seq_len",
            cid,
            enc.num_tokens,
            opts.max_seq_len or 0,
        )
    return enc.samples[0]


def tokenize_pair(
    row: Any,
    tokenizer: Tokenizer,
    *,
    train_on: str | TrainOn = "all_assistant",
    max_seq_len: int | None = None,
    overlong: str | Overlong = DEFAULT_OVERLONG,
    conversation_id: Any = None,
    special_tokens_in_content: str | SpecialTokensInContent = "text",
) -> tuple[Sample, Sample]:
    """Tokenize one preference row (TRL's ``prompt`` / ``chosen`` / ``rejected``) into its two samples.

    ``(chosen, rejected)``: both start with the very same prompt tokens (the prompt's text is
    encoded once, each answer's after it), then the answer's; ``loss_mask`` True on the answer only
    (strings: its tokens and EOS; lists of messages: the answer's assistant turns, as the chat
    template renders them). Each sample's ``meta`` holds ``group`` (the pair's id, its
    ``conversation_id``), ``role`` (``"chosen"`` / ``"rejected"``) and ``group_size`` (2).

    ``overlong`` applies to the pair whole: ``"truncate"`` cuts each member over ``max_seq_len``
    to its head; ``"split"`` (the default) and ``"error"`` raise :class:`OverlongError` for a pair
    over it (a pair is never split); ``"drop"`` is for :func:`tokenize_conversations`, which may give
    no sample. Raises :class:`BadRowError` for a malformed pair (naming the field and the fix) and
    ``ValueError`` for a row of another format.

    >>> from sftpack.testing import tiny_chat_tokenizer
    >>> tok = tiny_chat_tokenizer("chatml")
    >>> chosen, rejected = tokenize_pair({"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6"}, tok)
    >>> tok.decode(chosen.input_ids[chosen.loss_mask]), tok.decode(rejected.input_ids[rejected.loss_mask])
    (' 5<|im_end|>', ' 6<|im_end|>')
    >>> rejected.meta
    {'group': 0, 'role': 'rejected', 'group_size': 2}
    """
    opts = _options(train_on, max_seq_len, overlong, "error", special_tokens_in_content)
    if opts.overlong is Overlong.DROP:
        raise ValueError(
            "tokenize_pair returns both samples, so overlong='drop' is not valid here: choose 'truncate' or "
            "'error', or call tokenize_conversations (which drops pairs whole, counted)"
        )
    enc = _encode_one(row, tokenizer, opts, conversation_id)
    if len(enc.samples) != 2 or "role" not in enc.samples[0].meta:
        raise ValueError(
            "tokenize_pair takes a preference row ('prompt', 'chosen', 'rejected'), and this row is of another "
            "format: call tokenize_conversation"
        )
    return enc.samples[0], enc.samples[1]
