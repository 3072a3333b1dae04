"""The tokenized sample: the unit that all three packing paths consume.

A sample is one conversation rendered to tokens::

    input_ids  [5, 9, 2, 7, 1]          int64, one id per token
    loss_mask  [F, F, T, T, T]          True where the model is trained to produce the token
    conversation_id  "chat.jsonl:17"    where it came from (file and line, corpus index, ...)
    weights    [1, 1, .5, .5, 2]        optional float per token (None: 1 on every trained token)

``loss_mask[t]`` refers to the token ``input_ids[t]`` itself: the row builder
turns it into shifted labels (the target of slot ``t`` is ``input_ids[t+1]``,
trainable only if ``loss_mask[t+1]``). ``weights[t]``, like ``loss_mask[t]``, belongs
to the token ``input_ids[t]``: the row builder gives slot ``t`` the weight
``weights[t+1]`` of its target (:attr:`sftpack.PackedBatch.weights`), and the loss
reads it (:mod:`sftpack.loss`).

A sample longer than a row meets the one over-long policy, :class:`Overlong`,
whichever layer applies it (tokenizing, the offline path, the loader, Energon);
:func:`overlong_spans` is where it cuts. The default everywhere is
``Overlong.SPLIT`` (:data:`DEFAULT_OVERLONG`): nothing is lost unless the user
asks for it. A layer that turns one conversation into exactly one sample
(:func:`sftpack.chat.tokenize_conversation`, Energon's ``encode_sample``) cannot
split: under the default, a conversation that needs two pieces raises
:class:`OverlongError` there rather than being cut short silently.

What a sample is made from, :class:`Conversation` (an id and its messages, as
read), lives here too, below both its reader (:mod:`sftpack.chat`) and the
embedded corpus (:mod:`sftpack.data`); it is public as ``sftpack.chat.Conversation``.

This module needs numpy only, never torch: the tokenizer (:mod:`sftpack.chat`,
and every Ray tokenize actor) builds samples without loading torch. It is the
home of :class:`Sample` and :class:`Overlong`; ``sftpack.Sample`` and
``sftpack.handoff.Sample``, ``sftpack.chat.Overlong`` and ``sftpack.loader.Overlong``
are the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._base import StrEnum

__all__ = [
    "DEFAULT_OVERLONG",
    "IGNORE_INDEX",
    "Overlong",
    "OverlongError",
    "Sample",
    "WeightNormalisation",
    "as_sample",
    "check_sft_sample",
    "check_unweighted",
    "overlong_spans",
    "pair_meta",
    "pair_sequence_id",
    "sft_group",
]

#: Label value that every consumer (PyTorch cross-entropy, Megatron, Hugging Face) skips.
IGNORE_INDEX = -100


class WeightNormalisation(StrEnum):
    """How a step's weighted losses share one unit of loss: one rule, three choices
    (:func:`sftpack.loss.normalise_weights`; every mean divides ``sum w * loss`` by ``sum |w|``
    over the same targets, a sequence or group whose ``sum |w|`` is 0 drops out)."""

    #: the token mean over the step: ``sum w * loss / sum |w|`` over every target of the step (the default)
    TOKEN = "token"
    #: each sequence's weighted token mean, then the mean over the step's sequences
    SEQUENCE = "sequence"
    #: each group's mean over its sequences (``Sample.meta["group"]``; a sequence without one is its own
    #: group), then the mean over the step's groups
    GROUP = "group"


@dataclass(eq=False)
class Sample:
    """One tokenized conversation.

    Attributes:
        input_ids: ``(L,)`` int64 token ids, ``L >= 1``.
        loss_mask: ``(L,)`` bool, True on tokens the model is trained to produce.
        conversation_id: identifies the source conversation (any hashable; a
            string such as ``"file.jsonl:12"`` or an integer index).
        meta: free-form extras (e.g. ``{"piece": 1}`` for a split conversation).
        media: ``None``, or the sample's media (images): one payload object
            (:class:`sftpack.handoff.payload.Media`) holding its items in order, each with
            its run of placeholder tokens in ``input_ids``. The paths carry it as an opaque
            per-sample extra; the row builder lays it with the tokens. Checked against the
            tokens here (no placeholder trainable).
        weights: ``None`` (weight 1 on every trained token: plain SFT), or each token's
            weight (or advantage) in the loss: ``(L,)`` finite floats, any sign, kept as
            float32 or float64 (other real dtypes become float64), or one number, given to
            every token (float64). Like ``loss_mask``, ``weights[t]`` belongs to token ``t``;
            it is read only where ``loss_mask`` is True. Without weights a sample is what it
            was before weights existed (its ``__dict__``, pickle and ``repr`` unchanged).

    Supports mapping-style access too (``sample["input_ids"]``), so code written
    against dict samples keeps working.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    conversation_id: Any = None
    meta: dict = field(default_factory=dict)
    media: Any = None
    weights: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.input_ids = _token_ids(self.input_ids, self.conversation_id)
        self.loss_mask = _mask(self.loss_mask, self.conversation_id)
        if self.loss_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"Sample.loss_mask has shape {tuple(self.loss_mask.shape)} but input_ids has "
                f"shape {tuple(self.input_ids.shape)}: give one mask entry per token"
            )
        if self.input_ids.size == 0:
            raise ValueError(f"Sample {self.conversation_id!r} has no tokens: drop empty conversations before packing")
        if self.media is not None:
            self.media.check(
                self.input_ids,
                loss_mask=self.loss_mask,
                name=f"Sample {self.conversation_id!r}: media",
                error=ValueError,
            )
        if self.weights is None:
            # the class attribute (None) answers: a sample without weights keeps today's
            # __dict__, so it pickles, caches and compares exactly as before weights existed
            del self.__dict__["weights"]
        else:
            self.weights = check_weights(
                self.weights, self.input_ids.shape[0], f"Sample {self.conversation_id!r}: weights"
            )

    @property
    def num_patches(self) -> int:
        """What the row planner's second budget counts (vision patches; 0 without media)."""
        return 0 if self.media is None else int(self.media.num_patches)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, key: str) -> Any:
        if key in ("input_ids", "loss_mask", "conversation_id", "meta", "weights"):
            return getattr(self, key)
        raise KeyError(key)

    def keys(self) -> tuple[str, ...]:
        return ("input_ids", "loss_mask", "conversation_id", "meta")

    @property
    def num_trainable(self) -> int:
        """Number of tokens with ``loss_mask`` True."""
        return int(self.loss_mask.sum())


def _token_ids(values: Any, who: object) -> np.ndarray:
    """1-D int64 token ids, refusing what would silently change them (fractions,
    strings, values beyond int64, extra dimensions)."""
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"Sample {who!r}: input_ids cannot be read as an array of ids ({e})") from None
    if arr.ndim != 1:
        raise ValueError(
            f"Sample {who!r}: input_ids must be 1-D (one id per token), got shape {tuple(arr.shape)}; "
            "give one sample per sequence"
        )
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"Sample {who!r}: token id {int(arr.max())} does not fit in int64")
    if arr.dtype.kind == "O":
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in arr.tolist()):
            bad = next(v for v in arr.tolist() if not isinstance(v, (int, np.integer)) or isinstance(v, bool))
            raise ValueError(f"Sample {who!r}: input_ids must be integers, found {bad!r}")
        big = [v for v in arr.tolist() if not -(2**63) <= v < 2**63]
        if big:
            raise ValueError(f"Sample {who!r}: token id {big[0]} does not fit in int64")
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"Sample {who!r}: input_ids must be integers, got dtype {arr.dtype}; token ids are never "
            "fractional or text (tokenize first, or cast whole-number floats with .astype(np.int64))"
        )
    return arr.astype(np.int64, copy=False)


def _mask(values: Any, who: object) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "biu":
        raise ValueError(f"Sample {who!r}: loss_mask must be bool (or 0/1), got dtype {arr.dtype}")
    if arr.dtype.kind in "iu" and arr.size and (int(arr.min()) < 0 or int(arr.max()) > 1):
        raise ValueError(f"Sample {who!r}: loss_mask must hold only 0/1 or bools, found {int(arr.max())}")
    return arr.astype(bool, copy=False)


def check_weights(values: Any, length: int, where: str) -> np.ndarray:
    """``values`` as ``(length,)`` finite float weights: float32 / float64 kept, other real
    dtypes (and one number, broadcast to every token) as float64; else ``ValueError``
    starting with ``where`` (e.g. ``"Sample 'c7': weights"``).

    >>> check_weights(0.5, 3, "weights").tolist(), check_weights([1, 0, -2], 3, "weights").dtype
    ([0.5, 0.5, 0.5], dtype('float64'))
    """
    if isinstance(values, (bool, np.bool_)):
        raise ValueError(f"{where} must be numbers (a weight per token, or one for the sample), got {values!r}")
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where} cannot be read as an array of floats ({e})") from None
    if arr.dtype.kind not in "iuf":
        raise ValueError(
            f"{where} must be real numbers (float32 or float64), got dtype {arr.dtype}; give one float per token, "
            "or one number for the whole sample"
        )
    if arr.ndim == 0:
        arr = np.full(length, float(arr), dtype=np.float64)
    elif arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(
            f"{where} has shape {tuple(arr.shape)} but the sample has {length} tokens: give one weight per token "
            f"(shape ({length},)), or one number for the whole sample"
        )
    elif arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        t = int(bad[0])
        raise ValueError(
            f"{where}[{t}] is {arr[t]}: every weight must be finite (a weight of 0 leaves the token out of the loss)"
        )
    return arr


def as_sample(obj: Any, index: int | None = None) -> Sample:
    """Accept a :class:`Sample`, a mapping with ``input_ids`` (and optionally
    ``loss_mask`` and ``weights``), or a bare sequence of ids (all tokens trainable)."""
    if isinstance(obj, Sample):
        return obj
    if isinstance(obj, dict) or hasattr(obj, "keys"):
        if "input_ids" not in obj:
            raise KeyError(f"sample {index if index is not None else ''} has no 'input_ids' field")
        cid = obj["conversation_id"] if "conversation_id" in obj else index
        ids = _token_ids(obj["input_ids"], cid)
        mask = obj["loss_mask"] if "loss_mask" in obj else np.ones(ids.shape, dtype=bool)
        weights = obj["weights"] if "weights" in obj else None
        return Sample(ids, mask, cid, weights=weights)
    ids = _token_ids(obj, index)
    return Sample(ids, np.ones(ids.shape, dtype=bool), index)


class Overlong(StrEnum):
    """What happens to a sample longer than ``max_seq_len`` tokens (every layer: default ``split``)."""

    SPLIT = "split"  #: cut into pieces of at most ``max_seq_len`` tokens, each its own sequence (every token kept; each split point costs at most one supervised label, counted as split_labels_lost)
    TRUNCATE = "truncate"  #: keep the first ``max_seq_len`` tokens; the tail is lost (counted)
    DROP = "drop"  #: leave the sample out (counted, with its tokens)
    ERROR = "error"  #: raise :class:`OverlongError` naming the sample, its length and the fixes


#: The one default of every layer's ``overlong`` option: split, so no token is lost unasked.
DEFAULT_OVERLONG = Overlong.SPLIT


class OverlongError(ValueError):
    """A sample longer than ``max_seq_len`` that the policy (or the layer) will not cut."""

    def __init__(self, message: str, conversation_id: Any = None, length: int = 0, max_seq_len: int = 0):
        super().__init__(message)
        self.conversation_id, self.length, self.max_seq_len = conversation_id, length, max_seq_len

    def __reduce__(self) -> tuple[Any, ...]:  # keeps the fields across worker processes
        return (type(self), (str(self), self.conversation_id, self.length, self.max_seq_len))


def overlong_spans(
    length: int, max_seq_len: int | None, overlong: Overlong, who: str, conversation_id: Any = None
) -> list[tuple[int, int]]:
    """The ``(start, stop)`` token spans a sample of ``length`` tokens keeps under ``overlong``.

    One span ``(0, length)`` when it fits (or ``max_seq_len`` is ``None``); else
    ``split``: consecutive pieces of ``max_seq_len`` (the last shorter),
    ``truncate``: the head, ``drop``: none, ``error``: :class:`OverlongError`
    naming ``who`` (e.g. ``"conversation 'c7'"``).

    >>> overlong_spans(10, 4, Overlong.SPLIT, "sample 0")
    [(0, 4), (4, 8), (8, 10)]
    >>> overlong_spans(10, 4, Overlong.TRUNCATE, "sample 0"), overlong_spans(10, 4, Overlong.DROP, "sample 0")
    ([(0, 4)], [])
    """
    if max_seq_len is None or length <= max_seq_len:
        return [(0, length)]
    if overlong is Overlong.SPLIT:
        return [(a, min(a + max_seq_len, length)) for a in range(0, length, max_seq_len)]
    if overlong is Overlong.TRUNCATE:
        return [(0, max_seq_len)]
    if overlong is Overlong.DROP:
        return []
    raise OverlongError(
        f"{who} has {length} tokens, more than max_seq_len={max_seq_len}: raise max_seq_len, or pass "
        "overlong='split' (pieces of at most max_seq_len), 'truncate' (keep the head) or 'drop'",
        conversation_id,
        length,
        max_seq_len,
    )


@dataclass
class Conversation:
    """One conversation as read: an id naming its source and its messages
    (public as ``sftpack.chat.Conversation``; its home is here, below both the
    reader and the embedded corpus that make it).

    >>> Conversation("chat.jsonl:1", [{"role": "user", "content": "hi"}]).messages[0]["role"]
    'user'
    """

    id: str
    messages: list[dict[str, Any]]
    #: True when the row checks already passed (the reader sets it); the tokenizer checks the others.
    checked: bool = field(default=False, repr=False, compare=False)

    # Read-only mapping access, so code written for dict rows keeps working.
    def __getitem__(self, key: str) -> Any:
        if key == "messages":
            return self.messages
        if key in ("id", "conversation_id"):
            return self.id
        raise KeyError(key)

    def keys(self) -> tuple[str, ...]:
        return ("id", "messages")

    def __contains__(self, key: object) -> bool:
        return key in ("id", "conversation_id", "messages")

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default


def check_sft_sample(sample: Sample) -> None:
    """Refuse one member of a preference pair (``meta["role"]``, what
    :func:`sftpack.chat.tokenize_pair` sets) where SFT conversations are packed: training on
    both answers as SFT targets would teach the rejected one, and the SFT packers do not keep
    a pair in one row.

    >>> check_sft_sample(Sample([1, 2], [False, True], "a", {"group": "a", "role": "chosen"}))
    Traceback (most recent call last):
    ...
    ValueError: conversation 'a' is the chosen answer of a preference pair (prompt/chosen/rejected): SFT packs conversations, and a pair trains with a preference objective that keeps it whole (sftpack.objectives); give SFT conversations here, or train pairs from Python with sftpack.objectives
    """
    role = sample.meta.get("role") if sample.meta else None
    if role is not None:
        raise ValueError(
            f"conversation {sample.conversation_id!r} is the {role} answer of a preference pair "
            "(prompt/chosen/rejected): SFT packs conversations, and a pair trains with a preference objective "
            "that keeps it whole (sftpack.objectives); give SFT conversations here, or train pairs from Python "
            "with sftpack.objectives"
        )


def pair_sequence_id(sample: Sample) -> tuple[Any, str]:
    """A preference sample's id in a packed row, on every path: ``(meta["group"], meta["role"])``
    (the two samples of a pair share their conversation id); :func:`pair_meta` reads the pair
    back from a row's ids.

    >>> pair_sequence_id(Sample([1, 2], [False, True], "q", {"group": "q", "role": "chosen"}))
    ('q', 'chosen')
    """
    return (sample.meta["group"], str(sample.meta["role"]))


def sft_group(sample: Sample) -> Any:
    """The group of an SFT sample (``meta["group"]`` without a ``role``: a prompt's RL completions,
    a chat row's ``group`` field), else ``None`` (a preference pair's member, or a sample of no group).

    >>> sft_group(Sample([1, 2], [False, True], "a", {"group": "q7"}))
    'q7'
    >>> sft_group(Sample([1, 2], [False, True], "a", {"group": "q7", "role": "chosen"})) is None
    True
    """
    meta = sample.meta or {}
    return meta.get("group") if meta.get("role") is None else None


def pair_meta(sequence_ids: Any) -> dict[Any, dict[str, Any]]:
    """What :func:`sftpack.objectives.pairs_of` reads, from a row's :func:`pair_sequence_id`\\ s.

    >>> pair_meta([("q", "chosen"), ("q", "rejected")])[("q", "rejected")]
    {'group': 'q', 'role': 'rejected'}
    """
    return {sid: {"group": sid[0], "role": sid[1]} for sid in sequence_ids}


def check_unweighted(sample: Sample, where: str) -> None:
    """Refuse a sample with per-token weights (:attr:`Sample.weights`) where ``where`` (a path, a
    format) would drop them: a weight is never lost unseen.

    >>> check_unweighted(Sample([1, 2], [False, True], "a", weights=2.0), "a prepack with images")
    Traceback (most recent call last):
    ...
    ValueError: conversation 'a' carries per-token weights (a 'weight' or 'advantage' field), which a prepack with images does not carry into its rows yet: train it with --packing trainer, offline or loader (text, no images), whose loss reads them, or remove the weights
    """
    if sample.weights is not None:
        raise ValueError(
            f"conversation {sample.conversation_id!r} carries per-token weights (a 'weight' or 'advantage' field), "
            f"which {where} does not carry into its rows yet: train it with --packing trainer, offline or loader "
            "(text, no images), whose loss reads them, or remove the weights"
        )
