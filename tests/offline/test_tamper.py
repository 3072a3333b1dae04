"""A prepack directory damaged in every way we could think of: each case is refused with a
:class:`PrepackError` whose message names the damaged file, by the weakest check that can
see it, and by ``sftpack inspect`` in one line (exit 1); nothing is deleted.

The checks, weakest first (see ``PrepackedDataset``):

- ``verify=None``: the manifest (JSON, format, its own checksum, every entry's type and
  range, the layout against the fingerprint), every file's presence and size, every
  ``.npy`` header (dtype and length against the manifest);
- ``"size"`` (the default, and ``sftpack inspect``): also the index files' SHA-256 and
  structure;
- ``"full"`` (``inspect --verify``): also the SHA-256 of tokens.npy and loss_mask.npy.

Two families of manifest damage: raw edits (the seal ``manifest_sha256`` no longer
matches) and *resealed* edits, as a tool that rewrites the manifest consistently would
leave them; the latter reach the entry-by-entry checks. Index damage is also written with
its checksum updated, so that the structural checks, not the SHA-256, must catch it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from sftpack.cli import main
from sftpack.offline import PrepackedDataset, PrepackError
from sftpack.offline._format import FILES, INDEX_FILES, digest, seal_manifest

MODES = (None, "size", "full")


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d: Path, m: dict, *, reseal: bool) -> None:
    (d / "manifest.json").write_text(json.dumps(seal_manifest(m) if reseal else m, indent=2, sort_keys=True))


def _edit(path: str, value, *, reseal: bool) -> Callable[[Path], None]:
    """Set (or with ``value is DELETE`` remove) the manifest entry at dotted ``path``."""

    def damage(d: Path) -> None:
        m = _manifest(d)
        *parents, last = path.split("|")
        obj = m
        for key in parents:
            obj = obj[key]
        if value is DELETE:
            del obj[last]
        else:
            obj[last] = value(obj[last]) if callable(value) else value
        _write_manifest(d, m, reseal=reseal)

    return damage


DELETE = object()


def _header_len(path: Path) -> int:
    data = path.read_bytes()
    return 10 + int.from_bytes(data[8:10], "little")


def _flip(name: str, where: Callable[[int, int], int], bit: int = 0) -> Callable[[Path], None]:
    """Flip one bit of file ``name`` at ``where(header_len, size)``."""

    def damage(d: Path) -> None:
        p = d / name
        data = bytearray(p.read_bytes())
        data[where(_header_len(p), len(data))] ^= 1 << bit
        p.write_bytes(bytes(data))

    return damage


def _rewrite_index(name: str, change: Callable[[np.ndarray], None]) -> Callable[[Path], None]:
    """Change the array in index file ``name`` and update its size and SHA-256 in the manifest
    (resealed): only the structural checks can catch what is left."""

    def damage(d: Path) -> None:
        p = d / name
        arr = np.load(p).copy()
        change(arr)
        np.save(p, arr)
        m = _manifest(d)
        m["files"][name] = {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        _write_manifest(d, m, reseal=True)

    return damage


def _forge_width(width: int) -> Callable[[Path], None]:
    """max_seq_len changed everywhere it is recorded (fingerprint re-digested, manifest resealed):
    only the index can tell that the rows were written for another width."""

    def damage(d: Path) -> None:
        m = _manifest(d)
        m["max_seq_len"] = width
        m["counts"]["max_seq_len"] = width
        m["counts"]["slots"] = m["counts"]["rows"] * width
        fp = m["fingerprint"]
        fp["max_seq_len"] = width
        fp["sha256"] = digest({k: v for k, v in fp.items() if k != "sha256"})
        _write_manifest(d, m, reseal=True)

    return damage


def _swap_rows(arr: np.ndarray) -> None:
    arr[[1, 2]] = arr[[2, 1]]


def _set(field: str | None, index: int, value) -> Callable[[np.ndarray], None]:
    def change(arr: np.ndarray) -> None:
        if field is None:
            arr[index] = value(arr) if callable(value) else value
        else:
            arr[field][index] = value(arr[field]) if callable(value) else value

    return change


CASES: dict[str, tuple[Callable[[Path], None], str, str | None]] = {}
"""id -> (damage, the file the message must name, the weakest verify mode that must refuse it)"""

# --- the manifest, edited without its seal: caught by verify=None
for key, value in [
    ("max_seq_len", 2048),
    ("max_seq_len", 512),
    ("pad_multiple", 8),
    ("pad_multiple", 1),
    ("pad_id", 0),
    ("pad_id", 7),
    ("counts|rows", lambda v: v + 1),
    ("counts|fill", 1.0),
    ("files|tokens.npy|sha256", "0" * 64),
    ("fingerprint|max_seq_len", 2048),
    ("token_dtype", "uint32"),
]:
    CASES[f"manifest-edited-{key}={value if not callable(value) else '+1'}"] = (
        _edit(key, value, reseal=False),
        "manifest.json",
        None,
    )
for pos in (0, 1, 37, 200, 777, 1500, -300, -70, -3):
    CASES[f"manifest-bitflip@{pos}"] = (
        lambda d, pos=pos: _flip("manifest.json", lambda h, n: pos % n)(d),
        "manifest.json",
        None,
    )
CASES["manifest-truncated"] = (
    lambda d: (d / "manifest.json").write_bytes((d / "manifest.json").read_bytes()[:500]),
    "manifest.json",
    None,
)
CASES["manifest-empty"] = (lambda d: (d / "manifest.json").write_bytes(b""), "manifest.json", None)
CASES["manifest-a-list"] = (lambda d: (d / "manifest.json").write_text("[]"), "manifest.json", None)
CASES["manifest-not-utf8"] = (lambda d: (d / "manifest.json").write_bytes(b"\xff\xfe{}"), "manifest.json", None)
CASES["manifest-deleted"] = (lambda d: (d / "manifest.json").unlink(), "manifest.json", None)
CASES["manifest-format-version-a-string"] = (_edit("format_version", "2", reseal=True), "manifest.json", None)

# --- the manifest, rewritten consistently (resealed) with a missing or mistyped entry
for key in (
    "max_seq_len",
    "pad_multiple",
    "pad_id",
    "token_dtype",
    "vocab_size",
    "files",
    "counts",
    "fingerprint",
    "source",
    "sftpack_version",
    "pad_between_seqs",
    "files|tokens.npy",
    "files|rows.npy|sha256",
    "files|sequences.npy|bytes",
    "counts|rows",
    "counts|tokens",
    "counts|fill",
    "counts|dropped",
    "counts|packed_conversations",
    "counts|overlong|split",
    "fingerprint|sha256",
    "fingerprint|pad_id",
):
    CASES[f"resealed-missing-{key}"] = (_edit(key, DELETE, reseal=True), "manifest.json", None)
for key, value in [
    ("max_seq_len", "1024"),
    ("max_seq_len", 1024.0),
    ("max_seq_len", None),
    ("max_seq_len", True),
    ("max_seq_len", -1),
    ("max_seq_len", 0),
    ("max_seq_len", 2_000_000_000),
    ("pad_multiple", 0),
    ("pad_multiple", 3),
    ("pad_multiple", "4"),
    ("pad_id", -1),
    ("pad_id", "x"),
    ("pad_id", 2**40),
    ("token_dtype", "float32"),
    ("token_dtype", "int64"),
    ("vocab_size", 0),
    ("files", []),
    ("files|tokens.npy", "abc"),
    ("files|tokens.npy|bytes", "12"),
    ("files|rows.npy|sha256", "zz"),
    ("counts", []),
    ("counts|rows", "3"),
    ("counts|rows", -1),
    ("counts|fill", "x"),
    ("counts|dropped", {"x": "1"}),
    ("counts|overlong", []),
    ("fingerprint", "x"),
    ("fingerprint|tokenizer", "x"),
    ("fingerprint|inputs", {}),
    ("pad_between_seqs", "yes"),
]:
    CASES[f"resealed-type-{key}={value!r}"] = (_edit(key, value, reseal=True), "manifest.json", None)
# the layout changed where the rows are read from, not in the fingerprint they were written with
for key, value in [("max_seq_len", 2048), ("pad_multiple", 8), ("pad_id", 7)]:
    CASES[f"resealed-layout-{key}={value}"] = (_edit(key, value, reseal=True), "manifest.json", None)
CASES["resealed-fingerprint-edited"] = (_edit("fingerprint|pad_multiple", 8, reseal=True), "manifest.json", None)
CASES["resealed-counts-slots"] = (_edit("counts|slots", lambda v: v + 1, reseal=True), "manifest.json", None)
CASES["resealed-counts-tokens"] = (_edit("counts|tokens", lambda v: v + 1, reseal=True), "tokens.npy", None)
CASES["resealed-counts-sequences"] = (_edit("counts|sequences", lambda v: v - 1, reseal=True), "sequences.npy", None)
CASES["resealed-file-size"] = (_edit("files|loss_mask.npy|bytes", lambda v: v + 1, reseal=True), "loss_mask.npy", None)
CASES["resealed-index-sha256"] = (_edit("files|rows.npy|sha256", "a" * 64, reseal=True), "rows.npy", "size")
CASES["resealed-tokens-sha256"] = (_edit("files|tokens.npy|sha256", "a" * 64, reseal=True), "tokens.npy", "full")
CASES["forged-narrower-rows"] = (_forge_width(512), "sequences.npy", "size")
CASES["resealed-max-sequences-per-row"] = (
    _edit("counts|max_sequences_per_row", lambda v: v + 1, reseal=True),
    "rows.npy",
    "size",
)

# --- the .npy files
for name in FILES:
    CASES[f"{name}-truncated"] = (lambda d, n=name: (d / n).write_bytes((d / n).read_bytes()[:-1]), name, None)
    CASES[f"{name}-appended"] = (lambda d, n=name: (d / n).write_bytes((d / n).read_bytes() + b"\0"), name, None)
    CASES[f"{name}-emptied"] = (lambda d, n=name: (d / n).write_bytes(b""), name, None)
    CASES[f"{name}-deleted"] = (lambda d, n=name: (d / n).unlink(), name, None)
    data_mode = "size" if name in INDEX_FILES else "full"
    for label, where in [
        ("first", lambda h, n: h),
        ("middle", lambda h, n: (h + n) // 2),
        ("last", lambda h, n: n - 1),
    ]:
        CASES[f"{name}-data-bitflip-{label}"] = (_flip(name, where, bit=3), name, data_mode)
CASES["rows.npy-replaced-by-conversation_offsets.npy"] = (
    lambda d: shutil.copy(d / "conversation_offsets.npy", d / "rows.npy"),
    "rows.npy",
    None,
)

# --- index files structurally wrong, with their checksums updated
CASES["rows-out-of-order"] = (_rewrite_index("rows.npy", _swap_rows), "rows.npy", "size")
CASES["rows-last-entry"] = (_rewrite_index("rows.npy", _set("sequence", -1, lambda a: a[-1] - 1)), "rows.npy", "size")
CASES["rows-token-offset"] = (_rewrite_index("rows.npy", _set("token", 1, lambda a: a[1] + 1)), "rows.npy", "size")
CASES["rows-first-entry"] = (_rewrite_index("rows.npy", _set("sequence", 0, 1)), "rows.npy", "size")
CASES["sequences-zero-length"] = (_rewrite_index("sequences.npy", _set("length", 3, 0)), "sequences.npy", "size")
CASES["sequences-length-moved"] = (
    _rewrite_index("sequences.npy", _set("length", 3, lambda a: a[3] + 1)),
    "sequences.npy",
    "size",
)
CASES["sequences-start-moved"] = (
    _rewrite_index("sequences.npy", _set("start", 2, lambda a: a[2] + 1)),
    "sequences.npy",
    "size",
)
CASES["sequences-conversation-out-of-range"] = (
    _rewrite_index("sequences.npy", _set("conversation", 4, 10**6)),
    "sequences.npy",
    "size",
)
CASES["sequences-conversation-negative"] = (
    _rewrite_index("sequences.npy", _set("conversation", 4, -1)),
    "sequences.npy",
    "size",
)
CASES["sequences-piece-negative"] = (_rewrite_index("sequences.npy", _set("piece", 0, -1)), "sequences.npy", "size")
CASES["offsets-not-increasing"] = (
    _rewrite_index("conversation_offsets.npy", _set(None, 5, lambda a: a[4])),
    "conversation_offsets.npy",
    "size",
)
CASES["offsets-wrong-end"] = (
    _rewrite_index("conversation_offsets.npy", _set(None, -1, lambda a: a[-1] - 1)),
    "conversation_offsets.npy",
    "size",
)
CASES["offsets-first-entry"] = (
    _rewrite_index("conversation_offsets.npy", _set(None, 0, 1)),
    "conversation_offsets.npy",
    "size",
)


@pytest.fixture(scope="module")
def pristine(built, tmp_path_factory):
    d = tmp_path_factory.mktemp("tamper") / "pristine"
    shutil.copytree(built[1], d)
    return d


def _damaged(pristine: Path, tmp_path: Path, damage: Callable[[Path], None]) -> tuple[Path, set[str]]:
    d = tmp_path / "p"
    shutil.copytree(pristine, d)
    damage(d)
    return d, {p.name for p in d.iterdir()}


def _read_everything(ds: PrepackedDataset) -> None:
    for r in range(ds.num_rows):
        ds.row(r)


@pytest.mark.parametrize("case", sorted(CASES))
def test_damage_is_refused_naming_the_file(case, pristine, tmp_path, capsys):
    damage, named, weakest = CASES[case]
    d, files = _damaged(pristine, tmp_path, damage)
    strict = MODES[MODES.index(weakest) :]
    for mode in strict:
        with pytest.raises(PrepackError) as err:
            _read_everything(PrepackedDataset(d, verify=mode))
        assert named in str(err.value), (mode, str(err.value))
    for mode in MODES[: MODES.index(weakest)]:
        # a weaker check may open it; reading every row then gives rows or a PrepackError, no other error
        try:
            _read_everything(PrepackedDataset(d, verify=mode))
        except PrepackError as e:
            assert "damaged" in str(e) or "inconsistent" in str(e), str(e)
    # the CLI: one line naming the file, exit 1 (inspect checks like "size"; --verify like "full")
    args = ["inspect", str(d), "--row", "0"] + (["--verify"] if weakest == "full" else [])
    assert main(args) == 1
    captured = capsys.readouterr()
    err_lines = captured.err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("sftpack inspect: ") and named in err_lines[0], captured.err
    assert {p.name for p in d.iterdir()} == files  # nothing deleted, nothing added


def test_every_header_byte_of_every_file_flipped_is_refused_or_harmless_unverified(pristine, tmp_path):
    """One flipped bit anywhere in a ``.npy`` header (magic, length, the dict numpy parses with
    its own tokenizer, the padding) is a PrepackError naming the file under verify=None, unless
    the header still says the same thing (``','`` to ``' '`` before ``}``, ``'<'`` to ``'='`` on
    this little-endian machine): then every array reads exactly as before. Either way the file's
    SHA-256 refuses it under verify="full"."""
    clean = PrepackedDataset(pristine)
    seen, harmless = 0, []
    for name in FILES:
        size = _header_len(pristine / name)
        for pos in range(size):
            d = tmp_path / f"{name}-{pos}"
            shutil.copytree(pristine, d)
            _flip(name, lambda h, n, pos=pos: pos, bit=pos % 8)(d)
            try:
                ds = PrepackedDataset(d, verify=None)
            except PrepackError as e:
                assert name in str(e), (pos, str(e))
            else:
                harmless.append((name, pos))
                for key, arr in clean._arrays.items():
                    assert ds._arrays[key].dtype == arr.dtype and np.array_equal(ds._arrays[key], arr), (name, pos)
                with pytest.raises(PrepackError, match=f"{name} does not match its checksum"):
                    PrepackedDataset(d, verify="full")
            shutil.rmtree(d)
            seen += 1
    assert seen >= 6 * 64 and len(harmless) < 10, harmless


def test_an_id_that_is_not_json_is_a_prepack_error_when_read(pristine, tmp_path):
    """conversation_ids.npy holds free-form JSON; its bytes are checked by SHA-256 on every
    default open, but a file rewritten with its checksum (or opened with verify=None) can hold
    bytes that do not parse: reading that row names the file."""

    def garble(arr: np.ndarray) -> None:
        arr[1] = 0xFF  # inside the first id (after its opening quote)

    d, _ = _damaged(pristine, tmp_path, _rewrite_index("conversation_ids.npy", garble))
    ds = PrepackedDataset(d)
    with pytest.raises(PrepackError, match=r"conversation_ids.npy: the id of conversation 0 is not valid JSON"):
        _read_everything(ds)


def test_free_form_fingerprint_details_rewritten_consistently_still_inspect(pristine, tmp_path, capsys):
    """The fingerprint's details (tokenizer facts, inputs) are free-form records: rewritten with
    odd types (and re-digested, resealed), ``sftpack inspect`` prints them rather than failing."""

    def odd(d: Path) -> None:
        m = _manifest(d)
        fp = m["fingerprint"]
        fp["tokenizer"] = {"sha256": 5, "name_or_path": 7}
        fp["inputs"] = [{}]
        fp["sha256"] = digest({k: v for k, v in fp.items() if k != "sha256"})
        _write_manifest(d, m, reseal=True)

    d, _ = _damaged(pristine, tmp_path, odd)
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "tokenizer 5 (? ids, 7)" in out and "input ?  ?  sha256 None" in out
