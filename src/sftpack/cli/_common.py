"""Shared by the commands: option types that refuse bad values up front, the options
of a dataclass's settings (:func:`add_settings`, :func:`given_settings`), the
usage error, SIGTERM handled like Ctrl-C, the tokenizer loader, and whether
input files hold conversations with images (:func:`has_images`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import itertools
import json
import os
import signal
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..chat import ReadStats, TokenizeStats
    from ..multimodal import Family

__all__ = [
    "INPUTS_HELP",
    "Terminated",
    "UsageError",
    "FAMILY_HELP",
    "add_family",
    "add_settings",
    "given_settings",
    "has_images",
    "load_tokenizer",
    "non_negative",
    "positive",
    "read_chat_template",
    "render_read_stats",
    "render_tokenize_stats",
    "sigterm_deferred",
    "sigterm_handled",
    "tokenizer_folder",
    "vlm_family",
    "vlm_setup",
]


#: what every command that reads conversations takes as INPUT (its --help says it in these words)
INPUTS_HELP = (
    "JSONL (.jsonl/.json/.ndjson, .gz too) or JSON-array files, Parquet files, globs, folders or saved datasets"
)


class UsageError(ValueError):
    """Options that cannot work (exit status 2)."""


class Terminated(KeyboardInterrupt):
    """The process was sent SIGTERM (what a scheduler sends before it kills a job): raised
    where Ctrl-C raises ``KeyboardInterrupt``, so the same clean-up runs; exit status 143.
    The message is the line the command prints."""

    def __init__(self, message: str = "stopped by SIGTERM") -> None:
        super().__init__(message)


class _Sigterm:
    """What SIGTERM does in this process: raise :class:`Terminated` (once), or, while
    :func:`sigterm_deferred`, only record it. A process forked from this one gets the
    default back (:func:`_default_in_child`; else, should it still run there, it ends
    that process as the default would)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.received = False
        self.deferred = False

    def __call__(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        first, self.received = not self.received, True
        if first and not self.deferred:  # a second SIGTERM does not cut the clean-up of the first short
            raise Terminated()


_HANDLER: _Sigterm | None = None


def _default_in_child() -> None:
    """A forked process (the tokenizer's, its workers) ends on SIGTERM as by default, at
    once, not when its Python next runs: ``Pool.terminate()`` waits for its workers to end."""
    if isinstance(signal.getsignal(signal.SIGTERM), _Sigterm):
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # forked from another thread: the handler's own check ends it
            pass


os.register_at_fork(after_in_child=_default_in_child)


@contextlib.contextmanager
def sigterm_handled() -> Iterator[None]:
    """Inside: SIGTERM raises :class:`Terminated` in the main thread (a no-op elsewhere: only
    the main thread may set signal handlers)."""
    global _HANDLER
    try:
        before = signal.signal(signal.SIGTERM, handler := _Sigterm())
    except ValueError:  # not the main thread
        yield
        return
    outer, _HANDLER = _HANDLER, handler
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        _HANDLER = outer


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[Callable[[], bool]]:
    """Inside: SIGTERM is only recorded (the training loop stops at the end of the step, saving a
    checkpoint first); yields whether it came. After it (or outside :func:`sigterm_handled`)
    SIGTERM raises again."""
    handler = _HANDLER
    if handler is None:
        yield lambda: False
        return
    handler.deferred = True
    try:
        yield lambda: handler.received
    finally:
        handler.deferred = False


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, ">= 0")


def add_settings(parser: Any, options: type, *names: str) -> None:
    """An option of ``parser`` (or of an argument group) for each of the settings ``names``,
    fields of the dataclass ``options``, as the field declares it: a setting's default and
    its flag are declared once, on its field. A field with ``"help"`` in its metadata is a
    flag; the metadata may also give ``"flag"`` (else ``--`` and the name with dashes),
    ``"cli_default"`` (where the command's default differs from the field's; ``None``: unset,
    the field's default or one the command derives), ``"min"`` (an ``int`` of at least 1 or
    0: :func:`positive` / :func:`non_negative`), ``"choices"`` (an enum field's are its
    values) and ``"metavar"``. ``{default}`` in the help is the default a run gets (the
    command's, else the field's); a ``bool`` is a switch away from the command's default.
    """
    fields = {f.name: f for f in dataclasses.fields(options)}
    hints = typing.get_type_hints(options)
    for name in names:
        f = fields[name]
        meta = f.metadata
        default = meta.get("cli_default", f.default)
        shown = f.default if default is None else default
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": default.value if isinstance(default, enum.Enum) else default,
            "help": meta["help"].format(default=shown.value if isinstance(shown, enum.Enum) else shown),
        }
        kinds = typing.get_args(hints[name]) or (hints[name],)
        enums = [k for k in kinds if isinstance(k, type) and issubclass(k, enum.Enum)]
        if enums:
            kwargs["choices"] = [m.value for m in enums[0]]
        elif "choices" in meta:
            kwargs["choices"] = list(meta["choices"])
        elif bool in kinds:
            kwargs["action"] = "store_false" if default else "store_true"
        elif int in kinds:
            kwargs["type"] = {1: positive, 0: non_negative, None: int}[meta.get("min")]
        elif float in kinds:
            kwargs["type"] = float
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        parser.add_argument(meta.get("flag", "--" + name.replace("_", "-")), **kwargs)


def given_settings(args: argparse.Namespace, options: type) -> dict[str, Any]:
    """The settings of the dataclass ``options`` that its flags (:func:`add_settings`) give,
    by field name; a flag left unset (``None``) leaves the field's default."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(options) if "help" in f.metadata}
    return {name: value for name, value in values.items() if value is not None}


def load_tokenizer(path: str | None, chat_template: str | None = None) -> Any:
    """The tokenizer in a local folder, or the embedded Qwen one; with ``chat_template`` (a Jinja
    file, ``--chat-template``) a copy of it rendering conversations with that template."""
    from ..data import default_tokenizer

    if path is None:
        tok = default_tokenizer()
    else:
        from .._optional import CustomCodeError, from_pretrained

        try:
            tok = from_pretrained("AutoTokenizer", path, local_files_only=True)
        except CustomCodeError:
            raise
        except (OSError, ValueError) as e:
            raise UsageError(
                f"cannot load a tokenizer from {path!r} ({' '.join(str(e).split())[:200]}); give a local folder "
                "written by tokenizer.save_pretrained(), or leave --tokenizer out for the embedded Qwen tokenizer"
            ) from None
    if chat_template is None:
        return tok
    import copy

    tok = copy.deepcopy(tok) if path is None else tok  # the embedded one is shared within the process
    tok.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(path: str) -> str:
    """The text of the ``--chat-template`` file ``path``; a missing or empty file is a usage error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(
            f"--chat-template {path}: cannot read it ({e.__class__.__name__}); give a Jinja file"
        ) from None
    if not text.strip():
        raise UsageError(f"--chat-template {path}: the file is empty; give a Jinja chat template")
    return text


def tokenizer_folder(model: str | None, tokenizer: str | None) -> str | None:
    """The folder a command's tokenizer is loaded from: the ``--model`` folder's own, else
    ``--tokenizer``'s (``None``: the embedded one); both given is a usage error."""
    if model is not None and tokenizer is not None:
        raise UsageError("--tokenizer: a --model folder brings its own tokenizer; drop --tokenizer")
    return model or tokenizer


#: What ``--family`` means, on every command that takes it (:func:`add_family`); ``%(choices)s``:
#: the registry's names (:func:`sftpack.multimodal.family_names`)
FAMILY_HELP = (
    "the vision-language model family of the data with images and of its model: %(choices)s "
    "(default: the --model folder's, its config.model_type; else qwen2_vl)"
)


class _FamilyNames(Sequence[str]):
    """The registry's family names (:func:`sftpack.multimodal.family_names`), read the first time
    argparse asks for them: when ``--family`` is given or a command's help is shown (start-up:
    multimodal loads torch, which building the parser must not)."""

    def _names(self) -> tuple[str, ...]:
        from ..multimodal import family_names  # start-up: multimodal loads torch

        return family_names()

    @typing.overload
    def __getitem__(self, i: int) -> str: ...
    @typing.overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())


def add_family(parser: Any) -> None:
    """``--family`` on ``parser`` (or an argument group), one meaning on every command
    (:data:`FAMILY_HELP`), its choices the registry's (:func:`sftpack.multimodal.family_names`).
    Unset, it is ``None``: :func:`vlm_family` then takes the ``--model`` folder's family, else
    the default."""
    parser.add_argument("--family", choices=_FamilyNames(), metavar="FAMILY", help=FAMILY_HELP)


def vlm_family(model: str | None, family: str | None = None) -> Family:
    """The model family of a run with images (what ``--family`` means, :data:`FAMILY_HELP`): the
    vision-language model folder ``model``'s (from its ``config.model_type``, configured by its
    config), else ``family``'s (default :data:`sftpack.multimodal.DEFAULT_FAMILY`, Qwen2-VL).
    Both given is a usage error (the folder names its family), as is a folder of another model
    type, in one line, before any work; nothing else is loaded (:func:`vlm_setup` loads the
    tokenizer and image processor too)."""
    from ..multimodal import UnsupportedModelError, family_for

    if model is not None and family is not None:
        raise UsageError("--family: the family of a --model folder is its config.model_type; drop --family")
    try:
        return family_for(model if model is not None else family)
    except UnsupportedModelError as e:
        raise UsageError(str(e)) from None


def vlm_setup(model: str | None, tokenizer: str | None = None, family: str | None = None) -> tuple[Any, Any, Any]:
    """``(family, tokenizer, image processor)`` of a run with images: those of the vision-language
    model folder ``model`` (:func:`vlm_family`), else of ``family``'s tiny model (default Qwen2-VL;
    its tokenizer from ``tokenizer`` when given). A folder of another model type is a usage error
    in one line, before any work."""
    from ..multimodal import UnsupportedModelError

    folder = tokenizer_folder(model, tokenizer)
    fam = vlm_family(model, family)
    try:
        return fam, fam.tokenizer(folder), fam.image_processor(model)
    except UnsupportedModelError as e:
        raise UsageError(str(e)) from None


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
    from ..chat import ConversationReader, read_conversations

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


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "none"


def render_read_stats(rs: ReadStats, *, max_files: int = 10) -> str:
    """The reader's accounting in words: rows read/kept/dropped by reason, the rows kept of
    each format, and every file that was not read (or only partly), with its reason."""
    formats = getattr(rs, "formats", None) or {}
    lines = [f"  read {rs.read:,} rows: {rs.kept:,} kept, dropped: {_reasons(rs.dropped)}"]
    if rs.dropped:
        lines.append(
            "  (left out by --on-bad-row skip; --on-bad-row error stops at the first, naming its file and line)"
        )
    if formats:
        lines.append(f"  formats: {_reasons(formats)} (rows kept)")
    skipped = getattr(rs, "files_skipped", {}) or {}
    problems = list(getattr(rs, "file_problems", []) or [])
    media = getattr(rs, "media_files", 0)
    if skipped or problems:
        lines.append(f"  files: {getattr(rs, 'files_read', 0):,} read, not read: {_reasons(skipped)}")
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


def render_tokenize_stats(st: TokenizeStats, samples: int, seconds: float) -> str:
    """The tokenizer's accounting in words: outcomes, skips by reason, tokens and labels lost."""
    skipped = getattr(st, "skipped", {}) or {}
    lines = [
        f"  {st.conversations:,} conversations -> {samples:,} samples ({st.fit:,} fit, {st.split:,} split, "
        f"{st.truncated:,} truncated, {st.dropped:,} dropped, {sum(skipped.values()):,} skipped) in {seconds:.1f} s"
    ]
    if skipped:
        lines.append(f"  skipped: {_reasons(skipped)}")
    lost = [f"{st.tokens_lost:,} tokens lost"]
    if hasattr(st, "labels_lost"):
        lost.append(
            f"{st.labels_lost:,} of {st.labels:,} supervised labels lost ({st.split_labels_lost:,} at split points: split_labels_lost)"
        )
    if getattr(st, "special_text", 0):
        lost.append(f"{st.special_text:,} special-token strings in the data (special_text), kept as text")
    lines.append("  " + "; ".join(lost))
    return "\n".join(lines)
