"""One source item to the loader's buffer items: the over-long policy, media and conversations.

:class:`Cutter` turns item ``index`` of a source (a text sample, a sample with media, or a
conversation to tokenize in the worker) into the :class:`~sftpack.loader._source.Item` s the
buffer holds, the tokens it loses and the reason it is left out:

- a text sample: :func:`~sftpack.loader._source.cut_overlong` (split, truncate, drop or error);
- a sample with media: the multimodal split rule (at text boundaries, never inside an image
  block), then the patch budget;
- a conversation: tokenized for the model family (its tokenizer and image processor, built on
  first use), a bad image or record counted under its reason or raised (``on_bad_row``), then
  the patch budget.

The same cut serves reading and restoring (a restored state re-reads its samples through it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._types import Tokenizer

# The multimodal core's modules (the package's own names would also load its exactness harness)
from ..multimodal import Family, check_patch_budget, family_for, split_sample, tokenize_record
from ..sample import Overlong, OverlongError, Sample, check_unweighted, pair_sequence_id
from ._settings import LoaderSettings
from ._source import Item, cut_overlong, group_of, is_conversation
from ._stats import OVERLONG

__all__ = ["Cut", "Cutter"]


class Cut(NamedTuple):
    """What one source item becomes: its ``items`` (none: left out), the tokens it ``lost``
    (truncated or dropped) and the ``reason`` it is left out (``None``: kept)."""

    items: list[Item]
    lost: int
    reason: str | None


class Cutter:
    """Source items to buffer items under one dataset's settings and model family."""

    def __init__(self, settings: LoaderSettings, family: object, tokenizer: Tokenizer | None, processor: Any) -> None:
        """``family``: anything :func:`~sftpack.multimodal.family_for` takes (resolved now), or
        ``None`` (Qwen2-VL, resolved on first use)."""
        self.settings = settings
        self._family: Family | None = None if family is None else family_for(family)
        self.named_family = family is not None
        self._tokenizer = tokenizer
        self._processor = processor  # the family's image processor (a transformers object: untyped)

    @property
    def family(self) -> Family:
        """The model family of the samples with media (Qwen2-VL unless given; resolved on first use)."""
        if self._family is None:
            self._family = family_for(None)
        return self._family

    def cut(self, index: int, obj: object) -> Cut:
        """The items of source item ``index`` (``obj``) under the over-long policy; a group's member
        (``groups=True``) gets its group and, in a preference pair, its
        :func:`~sftpack.sample.pair_sequence_id` as the row's sequence id."""
        if is_conversation(obj) or (isinstance(obj, Sample) and obj.media is not None):
            if isinstance(obj, Sample):
                check_unweighted(obj, "the loader's samples with media")
            cut = self._cut_media(index, obj)
        else:
            items, lost = cut_overlong(index, obj, self.settings.max_seq_len, self.settings.overlong)
            cut = Cut(items, lost, None if items else OVERLONG)
        group = group_of(obj)
        if group is not None and isinstance(obj, Sample):
            paired = "role" in obj.meta
            if not self.settings.groups:
                if paired:
                    raise ValueError(
                        f"PackingDataset: sample {index} (conversation {obj.conversation_id!r}) is the "
                        f"{obj.meta['role']} answer of a preference pair, and this dataset packs each sample on its "
                        "own (the pair could be split over rows, its answers trained as SFT): build it with "
                        "groups=True (each pair whole in one row; sftpack train --objective dpo --packing loader)"
                    )
                return cut
            sid = pair_sequence_id(obj) if paired else None
            for it in cut.items:
                it.group = group
                if sid is not None:
                    it.sequence_id = sid
        return cut

    def _cut_media(self, index: int, obj: object) -> Cut:
        """:meth:`cut` of a sample with media or a conversation (tokenized here, accounted as
        ``tokenize_media_conversations`` accounts it)."""
        s = self.settings
        if s.overlong is Overlong.TRUNCATE:
            raise ValueError(
                f"PackingDataset: item {index} is a sample with media or a conversation, and overlong='truncate' is "
                "not offered for those (it would cut a turn and possibly an image): use 'split', 'drop' or 'error'"
            )
        if isinstance(obj, Sample):
            cid = obj.conversation_id
            try:
                pieces = split_sample(obj, s.max_seq_len, s.overlong, self.family, who=_who(index, cid))
            except OverlongError:  # under split: an image block alone is longer than a row
                if s.overlong is Overlong.ERROR:
                    raise
                pieces = []
            if not pieces:
                return Cut([], len(obj), OVERLONG)
        else:
            pieces, reason = self._tokenize(index, obj)
            if reason is not None:
                return Cut([], 0, reason)
            cid = pieces[0].conversation_id
        reason = check_patch_budget(pieces, s.max_patches_per_row, s.overlong, who=_who(index, cid))
        if reason is not None:
            return Cut([], sum(len(p) for p in pieces), reason)
        sid = index if cid is None else cid
        starts = np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()
        items = [
            Item((index, k), p.input_ids, p.loss_mask, sid, len(p), start, p.media)
            for k, (p, start) in enumerate(zip(pieces, starts))
        ]
        return Cut(items, 0, None)

    def _tokenize(self, index: int, conversation: object) -> tuple[list[Sample], str | None]:
        """A conversation's samples for the family (or none, and why), tokenizer and processor built on first use."""
        if self._tokenizer is None:
            self._tokenizer = self.family.tokenizer()
        if self._processor is None:
            self._processor = self.family.image_processor()
        s = self.settings
        return tokenize_record(
            conversation,
            index,
            tokenizer=self._tokenizer,
            processor=self._processor,
            family=self.family,
            max_seq_len=s.max_seq_len,
            overlong=s.overlong,
            on_bad_row=s.on_bad_row,
        )


def _who(index: int, cid: object) -> str:
    return f"item {index} (conversation {cid!r})"
