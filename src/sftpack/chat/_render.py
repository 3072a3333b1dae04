"""Rendering a conversation with a chat template, and finding its trainable characters.

The output of this module is ``(text, spans)``: the conversation rendered by
the tokenizer's Jinja chat template (exactly what ``apply_chat_template(...,
tokenize=False)`` gives), and the character spans ``[start, end)`` that are
trainable. The tokenizer later maps the spans to tokens through its offsets.

What is trainable, for each assistant message ``i`` (the *reference* definition)::

    head_i = render(messages[:i], add_generation_prompt=True)   # ... <|im_start|>assistant\\n
    turn_i = render(messages[:i + 1])                           # ... <|im_start|>assistant\\nHi!<|im_end|>\\n
    span_i = [common_prefix(head_i, turn_i), len(turn_i) - separator)

``turn_i`` must be a prefix of the full rendering (else the template rewrites
history, and only ``{% generation %}`` markers can say what is trainable). The
*separator* is the whitespace after the turn's closing special token: in ChatML
``Hi!<|im_end|>`` is trainable and the ``\\n`` that follows is not. A turn with no
special token at its end keeps its trailing text (it is the end-of-turn marker).

Three ways to compute the spans, all equal to the reference where they apply:

* ``{% generation %}`` markers in the template: one render; the marked blocks
  are the spans (the template author's word wins).
* **skeleton** (fast path, used when the template passes its probes): the
  conversation's role sequence is rendered once with placeholder contents
  (cached per role sequence), which splits the template's text into pieces
  around each content. The real rendering is checked to equal those pieces
  joined with the real contents; the assistant header and closing learned from
  probe conversations are checked around each trainable content. One render per
  conversation, plus string compares.
* **prefix diff** (the reference itself): two renders per assistant turn, so
  O(turns x length) per conversation, about 20x slower on the default corpus;
  used when a check of the fast path fails (e.g. a template that trims
  contents, given a content with leading spaces) and in tests as the oracle.
"""

from __future__ import annotations

import bisect
import json
import re
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from .. import _optional
from .._types import Tokenizer
from ._options import TrainOn

__all__ = ["ChatRenderer", "TemplateError", "renderer_for"]

Span = tuple[int, int]

#: stands for the k-th special-token string of the data: as written, or JSON-escaped (``tojson(ensure_ascii=True)``)
_MARKER = re.compile("\ue002([0-9]+)\ue003|\\\\[uU][eE]002([0-9]+)\\\\[uU][eE]003")
#: what is left of a marker a template cut (or a private-use character of the data)
_MARKER_PART = re.compile("[\ue002\ue003]|\\\\[uU][eE]00[23]")


class TemplateError(ValueError):
    """The chat template cannot say which tokens are trainable (or failed to render)."""


# ---------------------------------------------------------------------------- Jinja environment

_TRACK: ContextVar[_Track | None] = ContextVar("sftpack_generation_track", default=None)
#: the tool schemas of the conversation being rendered (its messages' ``tools``), for every render of it
_TOOLS: ContextVar[Any] = ContextVar("sftpack_tools", default=None)


@contextmanager
def _tools_of(messages: Any, tools: Any = None) -> Iterator[None]:
    """While rendering ``messages``: their ``tools`` (a list attribute of the messages, as the reader
    gives a row's ``tools`` column; or ``tools`` when given) handed to every render of them and of
    their prefixes."""
    if tools is None:
        tools = getattr(messages, "tools", None)
    if tools is None:
        yield
        return
    token = _TOOLS.set(tools)
    try:
        yield
    finally:
        _TOOLS.reset(token)


def _calls_tools(messages: Sequence[Mapping[str, Any]]) -> bool:
    return _TOOLS.get() is not None or any(isinstance(m, Mapping) and m.get("tool_calls") for m in messages)


class _Track:
    """Characters yielded so far, and the generation blocks seen."""

    __slots__ = ("pos", "spans")

    def __init__(self) -> None:
        self.pos = 0
        self.spans: list[Span] = []


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    """Compile like transformers' ``apply_chat_template``: sandboxed, trim_blocks,
    lstrip_blocks, loop controls, ``tojson``, ``raise_exception``, ``strftime_now``,
    plus a ``{% generation %}`` tag that records where its block lands."""
    jinja2 = _optional.jinja2()
    nodes = jinja2.nodes

    extension: Any = jinja2.ext.Extension  # jinja2 is imported lazily (an optional dependency)

    class GenerationTag(extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            track = _TRACK.get()
            if track is not None:  # the consumer has advanced ``pos`` past every earlier chunk
                track.spans.append((track.pos, track.pos + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def has_generation_markers(template: str) -> bool:
    """Whether the template marks assistant text with ``{% generation %}``."""
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


# ---------------------------------------------------------------------------- the renderer


@dataclass(frozen=True)
class _Skeleton:
    pieces: tuple[str, ...] | None  # template text around the contents; None: no fast path


@dataclass(frozen=True)
class _Profile:
    header: str  # text just before an assistant content (the generation prompt)
    closing: str  # trainable text just after an assistant content (e.g. "<|im_end|>")


_PROBES: tuple[tuple[str, ...], ...] = (
    ("user", "assistant"),
    ("user", "assistant", "user", "assistant"),
    ("system", "user", "assistant", "user", "assistant"),
    ("user", "assistant", "user"),
)


def _sentinel(i: int) -> str:
    # Private-use characters: no template filter changes them, no real text contains them.
    return f"\ue000{i}\ue001"


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality: O(n log n) worst case, tiny in practice
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChatRenderer:
    """Renders with one chat template and finds the trainable character spans.

    Args:
        template: the Jinja chat template.
        template_kwargs: extra variables (``bos_token``, ``eos_token``, ... as
            transformers passes them).
        special_tokens: strings of the tokenizer's special tokens (they end a turn).

    >>> r = ChatRenderer("{% for m in messages %}<{{ m.role }}>{{ m.content }}<end>\\n{% endfor %}"
    ...                  "{% if add_generation_prompt %}<assistant>{% endif %}", special_tokens=["<end>"])
    >>> text, spans = r.spans([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    >>> text, [text[a:b] for a, b in spans]
    ('<user>hi<end>\\n<assistant>yo<end>\\n', ['yo<end>'])
    """

    def __init__(
        self,
        template: str,
        template_kwargs: Mapping[str, Any] | None = None,
        special_tokens: Sequence[str] = (),
        *,
        cache_size: int = 4096,
    ):
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        self.special_tokens = tuple(sorted({t for t in special_tokens if t}, key=len, reverse=True))
        self.has_generation_markers = has_generation_markers(template)
        self._compiled = _compile(template)
        self._skeletons: OrderedDict[tuple[Any, ...], _Skeleton] = OrderedDict()
        self._cache_size = cache_size
        self._profile_done = False
        self._profile: _Profile | None = None
        self.fast_renders = 0  # conversations served by the skeleton fast path
        self.slow_renders = 0  # conversations that needed the prefix diff
        # longest first, so "<|im_end|>" is not found as a shorter token inside it
        self._special_re = (
            re.compile("|".join(re.escape(t) for t in self.special_tokens)) if self.special_tokens else None
        )

    # -- special-token text in what the template writes

    def count_special_text(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """How many special-token strings (``"<|im_end|>"``...) the strings the template may write
        hold: each message's content (a string, or a list of parts whose ``text`` parts count,
        joined), every other string of a message (tool calls' names and arguments, ``name``...,
        keys included) and the messages' ``tools`` schemas."""
        pattern = self._special_re
        if pattern is None:
            return 0
        find = pattern.findall
        n = sum(len(find(s)) for s in _strings(getattr(messages, "tools", None)))
        for m in messages:
            for k, v in m.items():
                n += len(find(k)) if isinstance(k, str) else 0
                n += len(find(_joined(v))) if k == "content" else sum(len(find(s)) for s in _strings(v))
        return n

    def spans_special_text(
        self, messages: Sequence[Mapping[str, Any]], train_on: TrainOn | str = TrainOn.ALL_ASSISTANT
    ) -> tuple[str, list[Span], list[Span]]:
        """:meth:`spans` with every special-token string the data holds kept as text, plus where
        the *template's own* special tokens are: ``(text, spans, template_specials)``.

        Each special-token string in any string the template may write (contents, tool calls'
        names and arguments, a message's ``name`` and other keys, the ``tools`` schemas; keys
        included) is swapped for a private-use marker before rendering, so the template's
        special tokens are the only ones left in its output; the markers are then put back
        (written as the template wrote them: as they are, or JSON-escaped by ``tojson``) and
        every offset shifted. The tokenizer can then split the text at the template's specials
        only, and the data's ones stay text. A content is a string or a list of parts
        (``{"type": "text", "text": ...}``, and media parts such as ``{"type": "image"}`` that
        the template writes as its own tokens, which are then among ``template_specials``).
        """
        pattern = self._special_re
        if pattern is None:
            return (*self.spans(messages, train_on), [])
        originals: list[str] = []

        def mark(original: str) -> str:
            originals.append(original)
            return f"\ue002{len(originals) - 1}\ue003"

        if any("\ue002" in t or "\ue003" in t for t in _strings([getattr(messages, "tools", None), *messages])):
            raise TemplateError(
                "the conversation holds U+E002/U+E003 (private-use characters sftpack marks special-token text "
                "with), so its special-token text cannot be kept as text: remove those characters or pass "
                "special_tokens_in_content='control'"
            )
        tools = _mark_strings(getattr(messages, "tools", None), pattern, mark)
        marked = [
            {
                _mark_strings(k, pattern, mark): _mark_content(v, pattern, mark)
                if k == "content"
                else _mark_strings(v, pattern, mark)
                for k, v in m.items()
            }
            for m in messages
        ]
        with _tools_of(marked, tools):
            text_m, spans_m = self.spans(marked, train_on)
        found = list(_MARKER.finditer(text_m))
        if any(int(f.group(1) or f.group(2)) >= len(originals) for f in found) or _MARKER_PART.search(
            _MARKER.sub("", text_m)
        ):
            raise TemplateError(
                "the chat template cuts or changes the text it writes, so special-token text in it cannot be "
                "kept as text: pass special_tokens_in_content='control' or remove that text"
            )
        ends, shifts, parts, pos, shift = [], [], [], 0, 0
        for f in found:
            original = originals[int(f.group(1) or f.group(2))]
            written = original if f.group(1) else json.dumps(original)[1:-1]  # tojson(ensure_ascii=True)
            parts.append(text_m[pos : f.start()])
            parts.append(written)
            pos = f.end()
            shift += len(written) - (f.end() - f.start())
            ends.append(f.end())
            shifts.append(shift)
        parts.append(text_m[pos:])
        text = "".join(parts)

        def moved(p: int) -> int:
            k = bisect.bisect_right(ends, p)
            return p + (shifts[k - 1] if k else 0)

        spans = [(moved(a), moved(b)) for a, b in spans_m]
        template_specials = [(moved(m.start()), moved(m.end())) for m in pattern.finditer(text_m)]
        return text, spans, template_specials

    # -- rendering

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (as ``apply_chat_template(tokenize=False)``, with
        the messages' ``tools`` attribute, if any, as ``tools``)."""
        tools = getattr(messages, "tools", None)
        try:
            return self._compiled.render(
                messages=messages,
                tools=tools if tools is not None else _TOOLS.get(),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as e:  # jinja2 errors, raise_exception(...) of the template
            raise TemplateError(f"the chat template failed to render {len(messages)} messages: {e}") from e

    def _render_tracked(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[Span]]:
        track = _Track()
        token = _TRACK.set(track)
        parts: list[str] = []
        try:
            for chunk in self._compiled.generate(
                messages=messages,
                tools=_TOOLS.get(),
                documents=None,
                add_generation_prompt=False,
                **self.template_kwargs,
            ):
                parts.append(chunk)
                track.pos += len(chunk)
        except Exception as e:
            raise TemplateError(f"the chat template failed to render {len(messages)} messages: {e}") from e
        finally:
            _TRACK.reset(token)
        return "".join(parts), track.spans

    # -- spans

    def spans(
        self, messages: Sequence[Mapping[str, Any]], train_on: TrainOn | str = TrainOn.ALL_ASSISTANT
    ) -> tuple[str, list[Span]]:
        """``(text, spans)``: the rendering and its trainable ``[start, end)`` character spans.
        A conversation with tools or tool calls takes the reference method (the prefix diff)."""
        with _tools_of(messages):
            return self._spans(messages, TrainOn(train_on))

    def _spans(self, messages: Sequence[Mapping[str, Any]], train_on: TrainOn) -> tuple[str, list[Span]]:
        if train_on is TrainOn.EVERYTHING:
            text = self.render(messages)
            return text, [(0, len(text))]
        if self.has_generation_markers:
            text, spans = self._render_tracked(messages)
            spans = [s for s in spans if s[1] > s[0]]
            if train_on is TrainOn.LAST_ASSISTANT:
                spans = spans[-1:]
            return text, spans
        if _calls_tools(messages):
            self.slow_renders += 1
            return self.prefix_diff_spans(messages, train_on)
        picked = _assistant_indices(messages, train_on)
        fast = self._skeleton_spans(messages, picked)
        if fast is not None:
            self.fast_renders += 1
            return fast
        self.slow_renders += 1
        return self.prefix_diff_spans(messages, train_on)

    def prefix_diff_spans(
        self, messages: Sequence[Mapping[str, Any]], train_on: TrainOn | str = TrainOn.ALL_ASSISTANT
    ) -> tuple[str, list[Span]]:
        """The reference method (module docstring): two renders per trainable turn."""
        with _tools_of(messages):
            return self._prefix_diff_spans(messages, TrainOn(train_on))

    def _prefix_diff_spans(self, messages: Sequence[Mapping[str, Any]], train_on: TrainOn) -> tuple[str, list[Span]]:
        text = self.render(messages)
        if train_on is TrainOn.EVERYTHING:
            return text, [(0, len(text))]
        spans = []
        for i in _assistant_indices(messages, train_on):
            try:
                head = self.render(messages[:i], add_generation_prompt=True)
            except TemplateError:  # e.g. a template that refuses an empty conversation
                head = ""
            turn = self.render(messages[: i + 1])
            if not text.startswith(turn):
                raise TemplateError(
                    f"the chat template renders messages[:{i + 1}] differently inside the whole conversation "
                    "(it rewrites earlier turns), so the assistant's tokens cannot be found by rendering prefixes: "
                    "use a template with {% generation %} ... {% endgeneration %} around each assistant turn, "
                    "or train_on='everything'"
                )
            start = _common_prefix(head, turn)
            spans.append((start, start + self._trainable_len(turn[start:])))
        return text, spans

    def _trainable_len(self, turn: str) -> int:
        stripped = turn.rstrip()
        if len(stripped) < len(turn) and stripped.endswith(self.special_tokens or ("\0",)):
            return len(stripped)  # whitespace after the closing special token separates turns
        return len(turn)

    # -- the fast path

    def _learn_profile(self) -> _Profile | None:
        """Header and closing of an assistant turn, and a check on probe conversations
        that the skeleton method agrees with the prefix diff; None disables the fast path."""
        self._profile_done = True
        try:
            user = [{"role": "user", "content": _sentinel(0)}]
            convo = user + [{"role": "assistant", "content": _sentinel(1)}]
            rendered_user = self.render(user)
            prompt = self.render(user, add_generation_prompt=True)
            full = self.render(convo)
            at = full.find(_sentinel(1))
            if at < 0 or not prompt.startswith(rendered_user) or _common_prefix(prompt, full) != at:
                return None
            header = prompt[len(rendered_user) :]
            start = at
            end = start + self._trainable_len(full[start:])
            closing = full[at + len(_sentinel(1)) : end]
            profile = _Profile(header, closing)
            self._profile = profile
            for roles in _PROBES:
                msgs = [{"role": r, "content": _sentinel(i)} for i, r in enumerate(roles)]
                for train_on in (TrainOn.ALL_ASSISTANT, TrainOn.LAST_ASSISTANT):
                    try:
                        expected = self.prefix_diff_spans(msgs, train_on)
                    except TemplateError:  # a role order this template refuses: nothing to compare
                        continue
                    got = self._skeleton_spans(msgs, _assistant_indices(msgs, train_on))
                    if got != expected:
                        self._profile = None
                        return None
            self._skeletons.clear()
            return profile
        except TemplateError:
            self._profile = None
            return None

    def _skeleton(self, messages: Sequence[Mapping[str, Any]]) -> _Skeleton:
        key = tuple([m.get("role") for m in messages])
        sk = self._skeletons.get(key)
        if sk is not None:
            self._skeletons.move_to_end(key)
            return sk
        sk = _Skeleton(None)
        try:
            marked = [{**m, "content": _sentinel(i)} for i, m in enumerate(messages)]
            rendered = self.render(marked)
            pieces, pos = [], 0
            for i in range(len(messages)):
                s = _sentinel(i)
                at = rendered.find(s, pos)
                if at < 0 or rendered.find(s, at + len(s)) >= 0:
                    break
                pieces.append(rendered[pos:at])
                pos = at + len(s)
            else:
                pieces.append(rendered[pos:])
                sk = _Skeleton(tuple(pieces))
        except TemplateError:
            pass
        self._skeletons[key] = sk
        if len(self._skeletons) > self._cache_size:
            self._skeletons.popitem(last=False)
        return sk

    def _skeleton_spans(
        self, messages: Sequence[Mapping[str, Any]], picked: list[int]
    ) -> tuple[str, list[Span]] | None:
        if not self._profile_done:
            self._learn_profile()
        profile = self._profile
        if profile is None:
            return None
        pieces = self._skeleton(messages).pieces
        if pieces is None:
            return None
        text = self.render(messages)
        parts: list[str] = []
        starts: list[int] = []
        pos = 0
        for piece, m in zip(pieces, messages):
            content = m.get("content")
            if not isinstance(content, str):
                return None
            pos += len(piece)
            starts.append(pos)
            pos += len(content)
            parts.append(piece)
            parts.append(content)
        parts.append(pieces[-1])
        if pos + len(pieces[-1]) != len(text) or "".join(parts) != text:
            return None  # the template changed a content (trim, escaping...): not transparent
        spans = []
        for i in picked:
            if not pieces[i].endswith(profile.header) or not pieces[i + 1].startswith(profile.closing):
                return None
            start = starts[i]
            spans.append((start, start + len(messages[i]["content"]) + len(profile.closing)))
        return text, spans


def _joined(content: Any) -> str:
    """The text of a content: itself (a string), or its text parts' ``text`` joined (a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value (dict keys included), depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _mark_strings(value: Any, pattern: re.Pattern[str], mark: Any) -> Any:
    """``value`` (a JSON-like value: strings, dicts, lists) with each special-token string of each
    of its strings (dict keys included) swapped for ``mark(original)``; other values as they are."""
    if isinstance(value, str):
        return pattern.sub(lambda m: mark(m.group(0)), value)
    if isinstance(value, Mapping):
        return {_mark_strings(k, pattern, mark): _mark_strings(v, pattern, mark) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark_strings(v, pattern, mark) for v in value]
    return value


def _mark_content(content: Any, pattern: re.Pattern[str], mark: Any) -> Any:
    """``content`` with each special-token string swapped for ``mark(original)``. In a list of
    parts the strings are found in the message's text parts joined (a template may write them
    one after another), and one split over parts (``"Blue.<|im"`` + ``"_end|>"``) is swapped
    piece by piece, each part's piece for its own mark, so no part holds a piece of one."""
    if isinstance(content, str):
        return pattern.sub(lambda m: mark(m.group(0)), content)
    if not isinstance(content, list):
        return content
    at = [i for i, p in enumerate(content) if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
    joined = "".join(content[i]["text"] for i in at)
    found = [(m.start(), m.end()) for m in pattern.finditer(joined)]
    if not found:
        return content
    out = list(content)
    start = 0
    for i in at:
        text = content[i]["text"]
        end = start + len(text)
        pieces, pos = [], start
        for a, b in found:
            a, b = max(a, start), min(b, end)
            if a < b:
                pieces += [joined[pos:a], mark(joined[a:b])]
                pos = b
        out[i] = {**content[i], "text": "".join(pieces) + joined[pos:end]}
        start = end
    return out


def _assistant_indices(messages: Sequence[Mapping[str, Any]], train_on: TrainOn) -> list[int]:
    idx = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    return idx[-1:] if train_on is TrainOn.LAST_ASSISTANT else idx


# ---------------------------------------------------------------------------- per tokenizer

_RENDERERS: weakref.WeakKeyDictionary[Any, dict[str, ChatRenderer]] = weakref.WeakKeyDictionary()


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's chat template (the ``default`` one of several), or ``None``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


def _folder_of(tokenizer: Any) -> str:
    """`` in FOLDER`` where the tokenizer was loaded from a folder, else nothing (for messages)."""
    where = getattr(tokenizer, "name_or_path", None)
    return f" in {where}" if isinstance(where, str) and where else ""


def renderer_for(tokenizer: Tokenizer, template: str | None = None) -> ChatRenderer:
    """The :class:`ChatRenderer` of a Hugging Face tokenizer's chat template (or of ``template``
    with the tokenizer's special tokens, e.g. a vision-language family's default), cached
    per tokenizer and template (changing ``tokenizer.chat_template`` takes effect)."""
    if template is None:
        template = chat_template_of(tokenizer)
    if not isinstance(template, str) or not template:
        raise TemplateError(
            f"the tokenizer{_folder_of(tokenizer)} has no chat template: give one as a Jinja file (--chat-template "
            "FILE; tokenizer.chat_template = its text in Python; for ChatML: sftpack.data.CHATML_TEMPLATE)"
        )
    try:
        per_template = _RENDERERS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        per_template = {}
    renderer = per_template.get(template)
    if renderer is None:
        kwargs = {k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items() if isinstance(v, str)}
        specials = set(kwargs.values())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            specials |= {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        renderer = per_template[template] = ChatRenderer(template, kwargs, sorted(specials))
    return renderer
