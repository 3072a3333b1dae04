"""The tokenized sample: the unit that all three packing paths consume.

A sample is one conversation rendered to tokens::

    input_ids  [5, 9, 2, 7, 1]          int64, one id per token
    loss_mask  [F, F, T, T, T]          True where the model is trained to produce the token
    conversation_id  "chat.jsonl:17"    where it came from (file and line, corpus index, ...)

``loss_mask[t]`` refers to the token ``input_ids[t]`` itself: the row builder
turns it into shifted labels (the target of slot ``t`` is ``input_ids[t+1]``,
trainable only if ``loss_mask[t+1]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["IGNORE_INDEX", "Sample", "as_sample"]

#: Label value that every consumer (PyTorch cross-entropy, Megatron, Hugging Face) skips.
IGNORE_INDEX = -100


@dataclass(eq=False)
class Sample:
    """One tokenized conversation.

    Attributes:
        input_ids: ``(L,)`` int64 token ids, ``L >= 1``.
        loss_mask: ``(L,)`` bool, True on tokens the model is trained to produce.
        conversation_id: identifies the source conversation (any hashable; a
            string such as ``"file.jsonl:12"`` or an integer index).
        meta: free-form extras (e.g. ``{"piece": 1}`` for a split conversation).

    Supports mapping-style access too (``sample["input_ids"]``), so code written
    against dict samples keeps working.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    conversation_id: Any = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int64)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
        if self.input_ids.ndim != 1:
            raise ValueError(f"Sample.input_ids must be 1-D, got shape {tuple(self.input_ids.shape)}")
        if self.loss_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"Sample.loss_mask has shape {tuple(self.loss_mask.shape)} but input_ids has "
                f"shape {tuple(self.input_ids.shape)}: give one mask entry per token"
            )
        if self.input_ids.size == 0:
            raise ValueError(
                f"Sample {self.conversation_id!r} has no tokens: drop empty conversations before packing"
            )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, key: str) -> Any:
        if key in ("input_ids", "loss_mask", "conversation_id", "meta"):
            return getattr(self, key)
        raise KeyError(key)

    def keys(self) -> tuple[str, ...]:
        return ("input_ids", "loss_mask", "conversation_id", "meta")

    @property
    def num_trainable(self) -> int:
        """Number of tokens with ``loss_mask`` True."""
        return int(self.loss_mask.sum())


def as_sample(obj: Any, index: int | None = None) -> Sample:
    """Accept a :class:`Sample`, a mapping with ``input_ids`` (and optionally
    ``loss_mask``), or a bare sequence of ids (all tokens trainable)."""
    if isinstance(obj, Sample):
        return obj
    if isinstance(obj, dict) or hasattr(obj, "keys"):
        if "input_ids" not in obj:
            raise KeyError(f"sample {index if index is not None else ''} has no 'input_ids' field")
        ids = np.asarray(obj["input_ids"], dtype=np.int64).reshape(-1)
        mask = obj["loss_mask"] if "loss_mask" in obj else np.ones(ids.shape, dtype=bool)
        cid = obj["conversation_id"] if "conversation_id" in obj else index
        return Sample(ids, np.asarray(mask, dtype=bool).reshape(-1), cid)
    ids = np.asarray(obj, dtype=np.int64).reshape(-1)
    return Sample(ids, np.ones(ids.shape, dtype=bool), index)
