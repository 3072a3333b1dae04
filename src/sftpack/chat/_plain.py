"""Rows rendered without a chat template: TRL's plain ``text`` and standard prompt/completion.

As TRL's ``SFTTrainer`` builds them: the tokenizer's BOS where ``tokenizer(text)``
adds one (Llama's do, Qwen's do not), the contents joined (``text``; or
``prompt`` then ``completion``, nothing between them), then the tokenizer's EOS,
unless the last content already ends with the EOS string (TRL adds no second one).
Trainable: every token of a ``text`` row (its BOS too, though a row's first
token is never a target); of a prompt/completion row the completion and the EOS,
not the BOS or the prompt. A token that straddles the
seam (a merge across the prompt's end) starts in the prompt and is not trained,
as with every span edge. ``train_on='everything'`` trains the prompt too.

Special-token text typed in a content stays text (``special_tokens_in_content``
``"text"``, the default): such a row, or one whose BOS / EOS string does not
encode to its one id, is encoded in pieces around the BOS and EOS (``_tokenize``'s
``encode_pieces``); the others take the one ``encode_batch`` call.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._types import Tokenizer
from ._bad_row import RowProblem
from ._options import BadRowReason, TrainOn
from ._rows import FormattedMessages

__all__ = ["Ends", "ends_of", "plain_text"]

Span = tuple[int, int]


@dataclass(frozen=True)
class Ends:
    """What a plain row takes of its tokenizer."""

    bos: str  #: the BOS string where the tokenizer adds one (``tokenizer(text)`` would), else ""
    eos: str | None  #: the EOS string; None if the tokenizer has none
    atomic: bool  #: whether the BOS / EOS strings encode to their one id each
    specials: re.Pattern[str] | None  #: the special-token strings, longest first


_ENDS: weakref.WeakKeyDictionary[Any, Ends] = weakref.WeakKeyDictionary()


def ends_of(tokenizer: Tokenizer, backend: Any) -> Ends:
    """The tokenizer's :class:`Ends` (cached per tokenizer); ``backend``: its fast tokenizer."""
    try:
        cached = _ENDS.get(tokenizer)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    eos = getattr(tokenizer, "eos_token", None)
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    with_ids = backend.encode("a", add_special_tokens=True).ids
    plain_ids = backend.encode("a", add_special_tokens=False).ids
    adds_bos = isinstance(bos, str) and bos_id is not None and with_ids == [bos_id, *plain_ids]
    ids = [(t, getattr(tokenizer, f"{n}_token_id", None)) for t, n in ((bos, "bos"), (eos, "eos")) if t]
    atomic = all(backend.encode(t, add_special_tokens=False).ids == [i] for t, i in ids)
    strings = {v for v in (getattr(tokenizer, "special_tokens_map", None) or {}).values() if isinstance(v, str) and v}
    strings |= {t.content for t in backend.get_added_tokens_decoder().values() if t.special and t.content}
    pattern = "|".join(re.escape(t) for t in sorted(strings, key=len, reverse=True))
    ends = Ends(
        str(bos) if adds_bos else "",
        eos if isinstance(eos, str) and eos else None,
        atomic,
        re.compile(pattern) if pattern else None,
    )
    try:
        _ENDS[tokenizer] = ends
    except TypeError:  # not weak-referenceable: no cache
        pass
    return ends


def plain_text(
    messages: FormattedMessages, ends: Ends, train_on: TrainOn, keep_special_text: bool
) -> tuple[str, list[Span], list[Span] | None, int]:
    """``(text, spans, specials, n_special)`` of a plain row (module docstring): its text, the
    trainable span, where BOS / EOS lie when it must be encoded in pieces (else None), and the
    special-token strings in its contents. Raises ``RowProblem`` when the tokenizer has no EOS."""
    contents: Sequence[str] = [m["content"] for m in messages]
    if ends.eos is None:
        raise RowProblem(
            BadRowReason.TEMPLATE_ERROR,
            f"a {messages.format.value} row ends with the tokenizer's EOS, and this tokenizer has none",
            "use a tokenizer with an eos_token (tokenizer.eos_token = '...')",
        )
    n_special = sum(len(ends.specials.findall(c)) for c in contents) if ends.specials else 0
    body = "".join(contents)
    if contents[-1].endswith(ends.eos):  # TRL appends EOS only where the text does not end with it
        body = body[: -len(ends.eos)]
        n_special -= 1
    text = ends.bos + body + ends.eos
    k = 0 if train_on is TrainOn.EVERYTHING else messages.prompt_messages  # a text row: no prompt
    start = min(len(ends.bos) + sum(len(c) for c in contents[:k]), len(text) - len(ends.eos)) if k else 0
    specials = None
    if not ends.atomic or (n_special and keep_special_text):
        specials = [(0, len(ends.bos))] if ends.bos else []
        specials.append((len(text) - len(ends.eos), len(text)))
    return text, [(start, len(text))], specials, n_special
