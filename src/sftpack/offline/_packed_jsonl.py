"""The upstream offline path's packed JSONL (``*.jsonl.packed``): import and export.

Each line is one packed row, ``{"messages": [...]}``: the row's conversations
concatenated, each starting with a ``system`` message (that is how the reader
splits them) and the last one ending with an ``assistant`` message. The file is
text: the upstream loader re-tokenizes every row at every fetch with its own
prompt format and rebuilds the boundaries (each conversation padded to 2·CP,
the row built to ``max_seq_length + 1`` and shifted, overflow truncated
silently). Its converter packs next-fit in input order.

- :func:`import_packed_jsonl` keeps the pack membership exactly (one prepack row
  per line, conversations in line order), tokenizing each conversation with the
  given tokenizer's chat template. A row that does not fit ``max_seq_len`` is an
  error naming the line, never a silent truncation.
- :func:`export_packed_jsonl` writes a prepack's conversations as such a file,
  so that pipeline can train on them. It needs the conversations' text: it
  re-reads the prepack's inputs (checking their SHA-256 against the
  fingerprint) or takes them as an argument. A conversation without a system
  message gets ``system_prompt`` (the format splits at system messages), and
  turns after a conversation's last assistant message (never trained on) are
  left out, as the format ends conversations with the assistant. The rows are
  packed (the prepack's algorithm and width) on each conversation's length *as
  written*, system prompt included, counted as the upstream loader counts it
  (``apply_chat_template`` with the given tokenizer and template, each
  conversation rounded up to the pad multiple, 2·CP): no row overflows under
  that loader, so they need not be the prepack's own rows. Conversations split
  into pieces by ``overlong="split"`` cannot be written as text: export a
  prepack made with ``truncate`` or ``drop``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._base import positive_int
from .._types import Tokenizer
from ..binpack import Algorithm
from ..chat import read_conversations, tokenize_conversation
from ..data import default_corpus, default_tokenizer
from ..sample import Sample
from ._bridge import _prepack_tokenizer
from ._dataset import PrepackedDataset
from ._fingerprint import input_fingerprints
from ._format import PrepackError
from ._plan import KeepRows, plan_rows
from ._prepack import prepack_rows
from ._result import PrepackResult

__all__ = ["export_packed_jsonl", "import_packed_jsonl", "split_packed_messages"]


def split_packed_messages(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Cut a packed row's messages into conversations, one starting at each ``system`` message.

    >>> m = [{"role": "system", "content": "a"}, {"role": "user", "content": "q"},
    ...      {"role": "assistant", "content": "r"}, {"role": "system", "content": "b"},
    ...      {"role": "user", "content": "q2"}, {"role": "assistant", "content": "r2"}]
    >>> [len(c) for c in split_packed_messages(m)]
    [3, 3]
    """
    out: list[list[dict[str, Any]]] = []
    for msg in messages:
        if not out or msg.get("role") == "system":
            out.append([])
        out[-1].append(msg)
    return out


def import_packed_jsonl(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    max_seq_len: int | None = None,
    pad_multiple: int = 1,
    train_on: str = "all_assistant",
    overwrite: bool = False,
    progress: bool = False,
) -> PrepackResult:
    """One prepack row per line of a packed JSONL file, membership kept exactly.

    Conversation ids are ``"{file}:{line}#{k}"`` (line 1-based, ``k``-th conversation
    of the line). ``max_seq_len=None``: as wide as the widest row needs.

    Raises:
        ValueError: a line that is not JSON, has no ``messages`` list, or holds a
            conversation the tokenizer refuses (naming file, line and conversation).
    """
    if tokenizer is None:
        tokenizer = default_tokenizer()
    path = Path(path)

    def rows() -> Iterator[list[Sample]]:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e}); each line is one packed row") from None
                if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
                    raise ValueError(f'{path}:{lineno}: expected {{"messages": [...]}} with at least one message')
                samples = []
                for k, conv in enumerate(split_packed_messages(row["messages"])):
                    cid = f"{path.name}:{lineno}#{k}"
                    try:
                        samples.append(tokenize_conversation(conv, tokenizer, train_on=train_on, conversation_id=cid))
                    except ValueError as e:
                        raise ValueError(f"{path}:{lineno}, conversation {k}: {e}") from None
                yield samples

    planner = KeepRows(None, max_seq_len, pad_multiple)
    return prepack_rows(
        rows(),
        out,
        planner,
        tokenizer=tokenizer,
        source=path,
        source_kind="packed_jsonl",
        fingerprint={"train_on": train_on},
        overwrite=overwrite,
        progress=progress,
    )


def _source_conversations(ds: PrepackedDataset) -> Iterable[Any]:
    fp = ds.manifest["fingerprint"]
    inputs = fp.get("inputs") or []
    if len(inputs) == 1 and str(inputs[0]["name"]).startswith("sftpack.data.default_corpus"):
        return default_corpus(inputs[0].get("limit"))
    if not inputs or any(i.get("size") is None or not Path(str(i["name"])).exists() for i in inputs):
        raise PrepackError(
            f"{ds.path}: the prepack's inputs {[i.get('name') for i in inputs]} cannot be re-read here; pass "
            "conversations= (the conversations it was made from)"
        )
    now = input_fingerprints([Path(str(i["name"])) for i in inputs])
    for old, new in zip(inputs, now):
        if old["sha256"] != new["sha256"]:
            raise PrepackError(
                f"{new['name']} changed since the prepack was written (SHA-256 differs): its conversations "
                "no longer match the rows; pass conversations= or prepack again"
            )
    return read_conversations([i["name"] for i in inputs], on_bad_row="skip")


def _chat_lengths(
    convs: list[tuple[Any, list[dict[str, Any]]]], tokenizer: Tokenizer, chat_template: str | None
) -> np.ndarray:
    """Token count of every (id, messages) as the upstream loader renders it: the whole
    conversation through ``apply_chat_template`` (no generation prompt), special tokens as
    control tokens."""

    def render(batch: list[list[dict[str, Any]]]) -> list[int]:
        out = tokenizer.apply_chat_template(
            batch, tokenize=True, add_generation_prompt=False, chat_template=chat_template
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out  # a BatchEncoding in transformers 5
        return [len(x) for x in ids]

    lengths: list[int] = []
    for a in range(0, len(convs), 256):
        batch = convs[a : a + 256]
        try:
            lengths += render([m for _, m in batch])
        except Exception:  # find the conversation the template refuses, and name it
            for cid, msgs in batch:
                try:
                    lengths += render([msgs])
                except Exception as e:
                    raise ValueError(
                        f"conversation {cid!r}: the chat template cannot render it as written to packed JSONL "
                        f"({type(e).__name__}: {e}); pass chat_template= (the template the upstream loader uses)"
                    ) from None
    return np.asarray(lengths, dtype=np.int64)


def export_packed_jsonl(
    dataset: PrepackedDataset | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    conversations: Iterable[Any] | None = None,
    system_prompt: str = "You are a helpful assistant.",
    tokenizer: Tokenizer | None = None,
    chat_template: str | None = None,
    pad_multiple: int | None = None,
    overlong: str | None = None,
) -> dict[str, int]:
    """Write a prepack's conversations as a packed JSONL file, packed by sftpack's packer on
    their lengths *as written*; returns counts (rows, conversations, system prompts added,
    trailing non-assistant turns left out, truncated conversations written whole, conversations
    longer than a row as written dropped or written whole, tokens counted).

    Each conversation is written as the upstream loader will read it (``system_prompt`` added
    when it has no system message, trailing non-assistant turns left out) and counted the way
    that loader counts it: ``tokenizer.apply_chat_template`` of the conversation as written,
    rounded up to ``pad_multiple`` (the loader pads each conversation to ``2 * CP``). The rows
    are then planned on those counts with the prepack's packing algorithm and row width, so no
    row exceeds ``max_seq_len`` under that loader with that tokenizer and template. The rows
    therefore need not match the prepack's (which were packed without the added text).

    Args:
        dataset: a :class:`~sftpack.offline.PrepackedDataset` or its directory.
        path: the ``*.jsonl.packed`` file to write.
        conversations: the source conversations (objects with ``id`` and ``messages``);
            default: re-read the prepack's inputs.
        system_prompt: the system message given to conversations that have none.
        tokenizer: the tokenizer the upstream loader uses (default: the prepack's, when it
            is sftpack's default tokenizer).
        chat_template: the template the upstream loader renders with (its prompt format's);
            default: the tokenizer's own.
        pad_multiple: ``2 * context_parallel_size`` of the upstream run (default: the
            prepack's pad multiple).
        overlong: a conversation longer than a row *as written* (a ``truncate`` prepack's, or
            one the system prompt pushes over): ``"drop"`` leaves it out (counted in
            ``over_length_dropped``), ``"truncate"`` writes it whole alone in its row (counted
            in ``over_length_written_whole``; the upstream loader cuts it there), ``"error"``
            raises naming it. Default: the prepack's ``overlong``.
    """
    ds = dataset if isinstance(dataset, PrepackedDataset) else PrepackedDataset(dataset)
    pieces = ds.sequences["piece"]
    if pieces.shape[0] and int(pieces.max()) > 0:
        raise PrepackError(
            f"{ds.path} holds conversations split into pieces (overlong='split'), which text cannot express: "
            "prepack with --overlong truncate or drop to export packed JSONL"
        )
    width = ds.max_seq_len
    m = ds.pad_multiple if pad_multiple is None else positive_int("pad_multiple", pad_multiple)
    if width % m:
        raise ValueError(
            f"pad_multiple={m} does not divide the row width {width}: the upstream loader needs "
            "max_seq_length to be a multiple of 2 * context_parallel_size"
        )
    tokenizer = _prepack_tokenizer(
        ds, tokenizer, "counting the rows as the upstream loader tokenizes them", check=False
    )
    order = [int(c) for c in np.unique(ds.sequences["conversation"])]  # input order
    wanted = {ds.conversation_id(c): c for c in order}
    source = conversations if conversations is not None else _source_conversations(ds)
    messages: dict[Any, list[dict[str, Any]]] = {}
    for item in source:
        cid = getattr(item, "id", None) if not isinstance(item, dict) else item.get("id")
        if cid in wanted:
            messages[cid] = list(item.messages if not isinstance(item, dict) else item["messages"])
    missing = set(wanted) - set(messages)
    if missing:
        raise PrepackError(
            f"{len(missing)} conversations of the prepack are not in the source, e.g. {sorted(map(str, missing))[:3]}"
        )
    written: list[tuple[Any, list[dict[str, Any]]]] = []
    edits = np.zeros((len(wanted), 2), np.int64)  # per conversation: system prompt added, trailing turns left out
    for k, cid in enumerate(wanted):
        conv = messages[cid]
        end = len(conv)
        while end and conv[end - 1].get("role") != "assistant":  # untrained trailing turns
            end -= 1
        out: list[dict[str, Any]] = []
        if conv[0].get("role") != "system":  # the format splits at system messages
            out.append({"role": "system", "content": system_prompt})
        out.extend({"role": m_["role"], "content": m_["content"]} for m_ in conv[:end])
        edits[k] = (conv[0].get("role") != "system", len(conv) - end)
        written.append((cid, out))
    lengths = _chat_lengths(written, tokenizer, chat_template)
    policy = overlong if overlong is not None else str(ds.manifest["fingerprint"].get("overlong") or "truncate")
    if policy not in ("truncate", "drop", "error"):
        raise ValueError(f"overlong={policy!r} is not valid here: choose 'truncate', 'drop' or 'error'")
    over = np.flatnonzero(lengths > width)
    if over.shape[0] and policy == "error":
        cid, n = written[int(over[0])][0], int(lengths[over[0]])
        raise ValueError(
            f"conversation {cid!r} is {n} tokens as written to packed JSONL (system prompt included), more than "
            f"the row width {width}: {over.shape[0]} such; pass overlong='drop' or 'truncate', or prepack wider rows"
        )
    if over.shape[0] and policy == "drop":
        keep = lengths <= width
        written = [w for w, k in zip(written, keep) if k]
        lengths, edits = lengths[keep], edits[keep]
        if not written:
            raise ValueError(
                f"every conversation of {ds.path} is longer than the row width {width} as written to "
                "packed JSONL: nothing to write; prepack wider rows"
            )
    fp = ds.manifest["fingerprint"]
    algorithm = fp.get("algorithm") if fp.get("algorithm") in {a.value for a in Algorithm} else "bfd"
    plan = plan_rows(
        np.minimum(lengths, width),
        max_seq_len=width,
        pad_multiple=m,
        algorithm=algorithm,
        seed=int(fp.get("seed") or 0),
    )
    with open(path, "w", encoding="utf-8") as f:
        for r in range(plan.num_rows):
            row: list[dict[str, Any]] = []
            for i in plan.order[plan.row_offsets[r] : plan.row_offsets[r + 1]]:
                row.extend(written[int(i)][1])
            f.write(json.dumps({"messages": row}, ensure_ascii=False) + "\n")
    oc = ds.manifest["counts"].get("overlong") or {}
    return {
        "rows": plan.num_rows,
        "conversations": len(written),
        "system_prompts_added": int(edits[:, 0].sum()),
        "trailing_turns_dropped": int(edits[:, 1].sum()),
        "truncated_written_whole": int(oc.get("truncated", 0)),
        "over_length_dropped": int(over.shape[0]) if policy == "drop" else 0,
        "over_length_written_whole": int(over.shape[0]) if policy == "truncate" else 0,
        "tokens": int(lengths.sum()),
    }
