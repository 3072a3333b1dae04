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
- :func:`export_packed_jsonl` writes a prepack's packing (rows from sftpack's
  BFD) as such a file, so that pipeline can train on it. It needs the
  conversations' text: it re-reads the prepack's inputs (checking their SHA-256
  against the fingerprint) or takes them as an argument. A conversation without
  a system message gets ``system_prompt`` (the format splits at system
  messages), and turns after a conversation's last assistant message (never
  trained on) are left out, as the format ends conversations with the assistant.
  Conversations split into pieces by ``overlong="split"`` cannot be
  written as text: export a prepack made with ``truncate`` or ``drop``.
  The rows fit the upstream ``max_seq_length`` when it tokenizes with the same
  tokenizer and template; its other prompt formats produce other token counts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..chat import read_conversations, tokenize_conversation
from ..handoff import Sample
from ._fingerprint import input_fingerprints
from ._format import PrepackError
from ._prepack import PrepackResult, prepack_samples

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
    tokenizer: Any = None,
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
        from ..data import default_tokenizer

        tokenizer = default_tokenizer()
    path = Path(path)
    sizes: list[int] = []

    def samples() -> Iterator[Sample]:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e}); each line is one packed row") from None
                if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
                    raise ValueError(f"{path}:{lineno}: expected {{\"messages\": [...]}} with at least one message")
                convs = split_packed_messages(row["messages"])
                for k, conv in enumerate(convs):
                    cid = f"{path.name}:{lineno}#{k}"
                    try:
                        yield tokenize_conversation(conv, tokenizer, train_on=train_on, conversation_id=cid)
                    except ValueError as e:
                        raise ValueError(f"{path}:{lineno}, conversation {k}: {e}") from None
                sizes.append(len(convs))

    return prepack_samples(
        samples(),
        out,
        max_seq_len=max_seq_len,
        pad_multiple=pad_multiple,
        row_sizes=sizes,
        tokenizer=tokenizer,
        fingerprint={"inputs": input_fingerprints([path]), "train_on": train_on},
        source_kind="packed_jsonl",
        overwrite=overwrite,
        progress=progress,
    )


def _source_conversations(ds: Any) -> Iterable[Any]:
    fp = ds.manifest["fingerprint"]
    inputs = fp.get("inputs") or []
    if len(inputs) == 1 and str(inputs[0]["name"]).startswith("sftpack.data.default_corpus"):
        from ..data import default_corpus

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


def export_packed_jsonl(
    dataset: Any,
    path: str | os.PathLike[str],
    *,
    conversations: Iterable[Any] | None = None,
    system_prompt: str = "You are a helpful assistant.",
) -> dict[str, int]:
    """Write a prepack's rows as a packed JSONL file; returns counts (rows, conversations,
    system prompts added, trailing non-assistant turns left out, truncated conversations
    written whole).

    Args:
        dataset: a :class:`~sftpack.offline.PrepackedDataset` or its directory.
        path: the ``*.jsonl.packed`` file to write.
        conversations: the source conversations (objects with ``id`` and ``messages``);
            default: re-read the prepack's inputs.
        system_prompt: the system message given to conversations that have none.
    """
    from ._dataset import PrepackedDataset

    ds = dataset if isinstance(dataset, PrepackedDataset) else PrepackedDataset(dataset)
    pieces = ds.sequences["piece"]
    if pieces.shape[0] and int(pieces.max()) > 0:
        raise PrepackError(
            f"{ds.path} holds conversations split into pieces (overlong='split'), which text cannot express: "
            "prepack with --overlong truncate or drop to export packed JSONL"
        )
    wanted = {ds.conversation_id(c) for c in range(ds._arrays["conversation_offsets"].shape[0] - 1)}
    source = conversations if conversations is not None else _source_conversations(ds)
    messages: dict[Any, list[dict[str, Any]]] = {}
    for item in source:
        cid = getattr(item, "id", None) if not isinstance(item, dict) else item.get("id")
        if cid in wanted:
            messages[cid] = list(item.messages if not isinstance(item, dict) else item["messages"])
    missing = wanted - set(messages)
    if missing:
        raise PrepackError(f"{len(missing)} conversations of the prepack are not in the source, e.g. {sorted(map(str, missing))[:3]}")
    added = trimmed = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in range(ds.num_rows):
            row: list[dict[str, Any]] = []
            for c in ds.row_sequences(r)["conversation"]:
                conv = messages[ds.conversation_id(int(c))]
                end = len(conv)
                while end and conv[end - 1].get("role") != "assistant":  # untrained trailing turns
                    end -= 1
                trimmed += len(conv) - end
                if conv[0].get("role") != "system":
                    row.append({"role": "system", "content": system_prompt})
                    added += 1
                row.extend({"role": m["role"], "content": m["content"]} for m in conv[:end])
            f.write(json.dumps({"messages": row}, ensure_ascii=False) + "\n")
    oc = ds.manifest["counts"].get("overlong") or {}
    return {"rows": ds.num_rows, "conversations": len(wanted), "system_prompts_added": added,
            "trailing_turns_dropped": trimmed, "truncated_written_whole": int(oc.get("truncated", 0))}
