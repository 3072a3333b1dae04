"""What a run reads before it tokenizes: whether its data holds images (:func:`has_images`), its
tokenizer (:func:`load_tokenizer`, :func:`read_chat_template`) and, for data with images, its
model family (:func:`vlm_setup`). Each refusal is a :class:`~._options.ConfigError` naming the
setting (``sftpack`` commands show it as their flag)."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._base import LazyChoices
from .._optional import CustomCodeError, from_pretrained
from ..chat import ConversationReader, read_conversations
from ..data import default_tokenizer
from ._options import ConfigError

if TYPE_CHECKING:
    from ..chat import ReadStats

__all__ = [
    "FAMILY_HELP",
    "FAMILY_NAMES",
    "counts_text",
    "has_images",
    "load_tokenizer",
    "read_chat_template",
    "render_read_stats",
    "tokenizer_folder",
    "vlm_family",
    "vlm_setup",
]


def load_tokenizer(path: str | None, chat_template: str | None = None) -> Any:
    """The tokenizer in a local folder, or the embedded Qwen one; with ``chat_template`` (a Jinja
    file) a copy of it rendering conversations with that template."""
    if path is None:
        tok = default_tokenizer()
    else:
        try:
            tok = from_pretrained("AutoTokenizer", path, local_files_only=True)
        except CustomCodeError:
            raise
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"cannot load a tokenizer from {path!r} ({' '.join(str(e).split())[:200]}); give a local folder "
                "written by tokenizer.save_pretrained(), or leave {tokenizer} out for the embedded Qwen tokenizer"
            ) from None
    if chat_template is None:
        return tok
    tok = copy.deepcopy(tok) if path is None else tok  # the embedded one is shared within the process
    tok.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(path: str) -> str:
    """The text of the chat template file ``path``; a missing or empty file is refused."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{{chat_template}} {path}: cannot read it ({e.__class__.__name__}); give a Jinja file"
        ) from None
    if not text.strip():
        raise ConfigError(f"{{chat_template}} {path}: the file is empty; give a Jinja chat template")
    return text


def tokenizer_folder(model: str | None, tokenizer: str | None) -> str | None:
    """The folder a tokenizer is loaded from: the ``model`` folder's own, else ``tokenizer``'s
    (``None``: the embedded one); both given is refused."""
    if model is not None and tokenizer is not None:
        raise ConfigError("{tokenizer}: a {model} folder brings its own tokenizer; drop {tokenizer}")
    return model or tokenizer


#: What a run's ``family`` (``--family``) means, on every command that takes it; ``%(choices)s``:
#: the registry's names (:data:`FAMILY_NAMES`)
FAMILY_HELP = (
    "the vision-language model family of the data with images and of its model: %(choices)s "
    "(default: the --model folder's, its config.model_type; else qwen2_vl)"
)


def _family_names() -> Sequence[str]:
    from ..multimodal import family_names  # start-up: multimodal loads torch, which building a parser must not

    return family_names()


#: the registry's family names (:func:`sftpack.multimodal.family_names`), read when first asked for
FAMILY_NAMES: Sequence[str] = LazyChoices(_family_names)


def vlm_family(model: str | None, family: str | None = None) -> Any:
    """The model family of a run with images: the vision-language model folder ``model``'s (from
    its ``config.model_type``, configured by its config), else ``family``'s (default Qwen2-VL).
    A folder of another model type is refused in one line, before any work; nothing else is
    loaded (:func:`vlm_setup` loads the tokenizer and image processor too)."""
    from ..multimodal import UnsupportedModelError, family_for  # start-up: multimodal loads torch; only for images

    if model is not None and family is not None:
        raise ConfigError("{family}: the family of a {model} folder is its config.model_type; drop {family}")
    try:
        return family_for(model if model is not None else family)
    except UnsupportedModelError as e:
        raise ConfigError(str(e)) from None


def vlm_setup(model: str | None, tokenizer: str | None = None, family: str | None = None) -> tuple[Any, Any, Any]:
    """``(family, tokenizer, image processor)`` of a run with images: those of the vision-language
    model folder ``model`` (:func:`vlm_family`), else of ``family``'s tiny model (default Qwen2-VL;
    its tokenizer from ``tokenizer`` when given). A folder of another model type is refused in one
    line, before any work."""
    from ..multimodal import UnsupportedModelError  # start-up: multimodal loads torch; only for images

    folder = tokenizer_folder(model, tokenizer)
    fam = vlm_family(model, family)
    try:
        return fam, fam.tokenizer(folder), fam.image_processor(model)
    except UnsupportedModelError as e:
        raise ConfigError(str(e)) from None


def _record_has_images(obj: Any) -> bool:
    """A conversation (a JSON object, or a read ``Conversation``) with an image or video part or a
    non-empty ``images`` list."""
    if isinstance(obj, dict):
        if obj.get("images"):
            return True
        messages = obj.get("messages") or obj.get("conversations") or ()
    else:
        messages = getattr(obj, "messages", None) or ()
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in ("image", "video") for p in content
        ):
            return True
    return False


def _json_array(path: Path) -> bool:
    """Whether the file's first non-blank byte is ``[`` (a JSON array of records, not JSON Lines)."""
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head[:1] == b"["


def has_images(paths: Sequence[str], records: int = 64, split: str | None = None) -> bool:
    """Whether the inputs hold conversations with images: image or video parts (``{"type": "image",
    ...}``) or an ``images`` list in the first ``records`` records of any of their data files (what
    ``sftpack train``, ``prepack``, ``bench`` and ``verify`` decide the data's kind by: a run has one
    model, so one such file makes it an image run, whose text-only conversations are text-only
    samples). The files are those the reader finds (:func:`sftpack.chat.read_conversations`:
    every data file of a folder or glob, not its images), each looked at. Plain JSONL is read here
    line by line; other sources (``.gz``, JSON arrays, Parquet, saved datasets) through the reader's
    first records. A path the reader refuses is left to the command's reader, which says why."""
    try:
        found = read_conversations(list(paths), on_bad_row="skip", split=split)
    except (OSError, ValueError):  # a missing path, an unknown kind: the command's reader says why
        return False
    for src in found.sources:
        f = src.target
        if src.kind == "jsonl" and not f.name.lower().endswith(".gz") and not _json_array(f):
            with open(f, encoding="utf-8", errors="replace") as fh:
                for line in itertools.islice(fh, records):
                    if '"image' not in line and '"video' not in line:  # most text lines stop here, unparsed
                        continue
                    try:
                        if _record_has_images(json.loads(line)):
                            return True
                    except ValueError:
                        continue
            continue
        one = ConversationReader([src], found.on_bad_row, None, found.batch_size, allow_outside_images=True)
        try:
            if any(_record_has_images(conv) for conv in itertools.islice(one, records)):
                return True
        except Exception:  # not readable as conversations: the command's reader will say why
            continue
    return False


def counts_text(counts: dict[str, int]) -> str:
    """``counts`` as ``key n, key n`` in key order (``none`` when empty)."""
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "none"


def render_read_stats(rs: ReadStats, *, max_files: int = 10) -> str:
    """The reader's accounting in words: rows read/kept/dropped by reason, the rows kept of
    each format, and every file that was not read (or only partly), with its reason."""
    formats = getattr(rs, "formats", None) or {}
    lines = [f"  read {rs.read:,} rows: {rs.kept:,} kept, dropped: {counts_text(rs.dropped)}"]
    if rs.dropped:
        lines.append(
            "  (left out by --on-bad-row skip; --on-bad-row error stops at the first, naming its file and line)"
        )
    if formats:
        lines.append(f"  formats: {counts_text(formats)} (rows kept)")
    skipped = getattr(rs, "files_skipped", {}) or {}
    problems = list(getattr(rs, "file_problems", []) or [])
    media = getattr(rs, "media_files", 0)
    if skipped or problems:
        lines.append(f"  files: {getattr(rs, 'files_read', 0):,} read, not read: {counts_text(skipped)}")
        for p in problems[:max_files]:
            lost = f", {p.rows_lost:,} rows lost" if getattr(p, "rows_lost", None) else ""
            lines.append(f"    {p.path}: {p.reason} ({p.detail}{lost})")
        if len(problems) > max_files:
            lines.append(f"    ... and {len(problems) - max_files:,} more")
    if media:
        lines.append(
            f"  {media:,} image/video files beside the data: media, read where image parts name them, not data files"
        )
    return "\n".join(lines)
