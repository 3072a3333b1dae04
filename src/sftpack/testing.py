"""Offline, deterministic helpers for tests and examples (no downloads).

:class:`CharTokenizer` maps each character to its Unicode code point, so a
token id reads back as the text it came from: ``"hi"`` -> ``[104, 105]``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .sample import Sample

__all__ = ["CharTokenizer", "samples_from_lengths"]


class CharTokenizer:
    """Characters to code points and back.

    >>> tok = CharTokenizer()
    >>> tok.encode("hi!")
    [104, 105, 33]
    >>> tok.decode([104, 105, 33])
    'hi!'
    """

    pad_token_id = 0
    vocab_size = 0x110000

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(chr(int(i)) for i in ids if int(i) > 0)

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [self.encode(t) for t in texts]}


def samples_from_lengths(lengths: Iterable[int], *, trainable_from: int = 0) -> list[Sample]:
    """Self-describing samples: sample ``i`` of length ``L`` holds ids
    ``1000*(i+1) + [0, 1, ..., L-1]``, so any slot of a packed row tells which
    sample and which position it came from. Tokens at positions ``>= trainable_from``
    are trainable.

    >>> s = samples_from_lengths([3])[0]
    >>> s.input_ids.tolist(), s.loss_mask.tolist()
    ([1000, 1001, 1002], [True, True, True])
    """
    out = []
    for i, n in enumerate(lengths):
        ids = 1000 * (i + 1) + np.arange(int(n), dtype=np.int64)
        mask = np.arange(int(n)) >= trainable_from
        out.append(Sample(ids, mask, i))
    return out
