"""Checkpoints that are whole or absent, checked before use, and refuse other data.

Layout of ``DIR``::

    DIR/step_000010/state.pt          model, optimizer, scheduler, step, config, data fingerprint, dtype
    DIR/step_000010/rank_0.pt         this rank's RNG states and data position (loader state_dict, ...)
    DIR/step_000010/checkpoint.json   bytes and SHA-256 of every file above (written last)
    DIR/latest                        "step_000010"

Atomicity: every rank writes into ``step_000010.tmp``; after a barrier rank 0
hashes every file, writes ``checkpoint.json`` (through a temporary file and a
rename), renames the folder (one rename) and then rewrites ``latest`` the same
way (all three with :class:`sftpack._publish.Publish`, which fsyncs before and
after each rename). A run killed at any moment leaves either the previous
checkpoint as ``latest`` or the new one, never half of one; stale ``*.tmp``
folders are ignored and overwritten. A save that fails (a full disk, a quota: any
``OSError`` or torch's ``RuntimeError`` while writing) removes its ``.tmp`` folder
and raises :class:`CheckpointError` naming it and the cause; ``latest`` still
names the previous checkpoint.

One run per folder: :func:`check_new_run` refuses to start a fresh run in a folder
that holds another run's checkpoints (its ``latest`` would be repointed, its
steps rewritten: two runs mixed); :func:`remove_other_checkpoints` clears them
when the user asked to replace them.

Integrity: before anything is unpickled, :func:`load_checkpoint` checks the size
and SHA-256 of ``state.pt`` and of this rank's file against ``checkpoint.json``
(once per save and once per resume), so a truncated, emptied or bit-flipped file is
refused with its name instead of failing inside ``torch.load`` or, worse, loading.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._publish import Publish

__all__ = [
    "CHECKPOINT_MANIFEST",
    "CheckpointError",
    "check_new_run",
    "latest_checkpoint",
    "load_checkpoint",
    "model_dtype",
    "remove_other_checkpoints",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]

#: the checksum manifest of a checkpoint folder, written last
CHECKPOINT_MANIFEST = "checkpoint.json"
_FORMAT = "sftpack-checkpoint"
_FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here (the message says why and what to do)."""


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    with Publish(path, folder=False, tmp=path.with_name(path.name + ".tmp")) as tmp:
        tmp.write_text(text)


def _torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file: a failed ``write()`` (``ENOSPC``, ``EFBIG``,
    ``EDQUOT``) then keeps its ``OSError`` as the cause of torch's error."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the folder is renamed in and latest names it


def _cause(e: BaseException) -> str:
    """The reason of a failed write in words: the ``OSError`` behind torch's error if any."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return f"[Errno {seen.errno}] {seen.strerror}" if seen.errno and seen.strerror else str(seen)
        seen = seen.__cause__ or seen.__context__
    return " ".join(str(e).split())[:160] or type(e).__name__


def _all_ranks_ok(ok: bool) -> bool:
    """Whether every rank's ``ok`` is true (one all-reduce; ``ok`` itself on one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ok
    on_gpu = torch.distributed.get_backend() == "nccl"
    flag = torch.tensor([0 if ok else 1], device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else None)
    torch.distributed.all_reduce(flag)
    return int(flag.item()) == 0


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    *,
    shared: dict[str, Any] | None,
    per_rank: dict[str, Any],
    rank: int = 0,
) -> Path:
    """Write the checkpoint of ``step`` (``shared``: from rank 0 only; ``per_rank``: every rank's own).

    Raises:
        CheckpointError: a file could not be written (a full disk, a quota, ...): the
            message names the folder and the cause; the ``.tmp`` folder is removed and
            ``latest`` still names the previous checkpoint.
    """
    root = Path(directory)
    name = f"step_{step:06d}"
    tmp = root / f"{name}.tmp"
    final = root / name
    error: BaseException | None = None
    folder: Publish | None = None  # rank 0's: every rank writes into its tmp, rank 0 publishes it
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            folder = Publish(final, tmp=tmp)
    except OSError as e:
        error = e
    _barrier()
    try:
        if error is None:
            _torch_save(per_rank, tmp / f"rank_{rank}.pt")
            if rank == 0:
                assert shared is not None
                _torch_save(shared, tmp / "state.pt")
    except (OSError, RuntimeError) as e:
        error = e
    if not _all_ranks_ok(error is None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        raise _write_failed(root, step, tmp, error)
    moved = False
    if rank == 0:
        try:
            names = ["state.pt"] + [f"rank_{r}.pt" for r in range(_world())]
            files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in names}
            manifest = {"format": _FORMAT, "format_version": _FORMAT_VERSION, "step": step, "files": files}
            _write_atomic(tmp / CHECKPOINT_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            if final.exists():  # a step saved again (after a resume from an earlier one): this save replaces it
                shutil.rmtree(final)
            assert folder is not None
            folder.publish()
            moved = True
            _write_atomic(root / "latest", name)
        except OSError as e:
            error = e
    if not _all_ranks_ok(error is None):
        if rank == 0:  # ``latest`` was not repointed: nothing of this save stays
            shutil.rmtree(final if moved else tmp, ignore_errors=True)
            (root / "latest.tmp").unlink(missing_ok=True)
        raise _write_failed(root, step, tmp, error)
    return final


def _write_failed(root: Path, step: int, tmp: Path, error: BaseException | None) -> CheckpointError:
    """The error of a save that failed on this rank (``error``) or on another one."""
    try:
        before = latest_checkpoint(root)
    except CheckpointError:
        before = None
    cause = _cause(error) if error is not None else "another rank could not write its part (see its error)"
    if before is not None:
        kept = f"{root / 'latest'} still names {before.name}"
        fix = f"fix that (free space on a full disk) and rerun with --resume to continue from {before.name}, "
        fix += "or give another --checkpoint-dir to start over"
    else:  # nothing to resume: --resume would be refused
        kept = "there is no earlier checkpoint"
        fix = "fix that (free space on a full disk) or give another --checkpoint-dir, and rerun the same command"
    return CheckpointError(
        f"cannot write the checkpoint of step {step} into {tmp}: {cause}; the partial folder was removed and "
        f"{kept}; {fix}"
    )


def check_new_run(directory: str | os.PathLike[str]) -> None:
    """Refuse to start a fresh run in ``directory`` when it holds another run's checkpoints
    (a ``latest`` pointer or a ``step_NNNNNN`` folder): the new run would rewrite them and
    repoint ``latest``, two runs mixed in one folder.

    Raises:
        CheckpointError: naming the folder, its latest checkpoint and the ways forward.
    """
    root = Path(directory)
    if not root.is_dir():
        return
    steps = sorted(p.name for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name))
    pointer = root / "latest"
    if not steps and not pointer.exists():
        return
    named = pointer.read_text(errors="replace").strip()[:40] if pointer.is_file() else ""
    latest = named if _STEP_DIR.fullmatch(named) else (f"{steps[-1]}, no 'latest' pointer" if steps else named)
    raise CheckpointError(
        f"{root} holds the checkpoints of another run (latest: {latest}): a fresh run there would rewrite them; "
        "continue that run with --resume (or --resume-if-any), replace its checkpoints with --overwrite-checkpoints "
        "(overwrite=True), or give another --checkpoint-dir"
    )


def remove_other_checkpoints(directory: str | os.PathLike[str], keep: Path) -> None:
    """Remove every checkpoint folder of ``directory`` but ``keep`` (a run that replaces
    another's checkpoints, once its own first checkpoint is in place)."""
    for p in Path(directory).iterdir():
        if p != keep and p.is_dir() and _STEP_DIR.fullmatch(p.name.removesuffix(".tmp")):
            shutil.rmtree(p, ignore_errors=True)


def _floating_dtype(state: dict[str, Any], names: set[str]) -> str:
    """The dtype(s) of the floating-point entries ``names`` of a state dict (``"a+b"`` when mixed)."""
    kinds = {
        str(t.dtype).removeprefix("torch.")
        for k, t in state.items()
        if k in names and isinstance(t, torch.Tensor) and t.is_floating_point()
    }
    return "+".join(sorted(kinds))


def model_dtype(model: Any, state: dict[str, Any] | None = None) -> str:
    """The dtype of ``model``'s parameters (``"float32"``; ``"a+b"`` when mixed), or, given a
    saved ``state`` dict of it, the dtype of those parameters in ``state``."""
    params = {n for n, _ in model.named_parameters()}
    return _floating_dtype(model.state_dict() if state is None else state, params)


def _earlier(path: Path) -> str:
    """A hint naming the newest earlier checkpoint folder beside ``path``, if any."""
    m = _STEP_DIR.fullmatch(path.name)
    mine = int(m.group(1)) if m else None
    older = (
        sorted(
            (int(mm.group(1)), p.name)
            for p in path.parent.iterdir()
            if p.is_dir() and (mm := _STEP_DIR.fullmatch(p.name)) and (mine is None or int(mm.group(1)) < mine)
        )
        if path.parent.is_dir()
        else []
    )
    if not older:
        return "start a fresh --checkpoint-dir"
    prev = older[-1][1]
    return (
        f"write {prev} into {path.parent / 'latest'} to resume from the previous checkpoint, "
        "or start a fresh --checkpoint-dir"
    )


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The folder ``latest`` names, or ``None`` when there is no checkpoint yet."""
    pointer = Path(directory) / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text(errors="replace").strip()
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(
            f"{pointer} holds {name[:40]!r}, not the name of a checkpoint folder (step_NNNNNN): the pointer is "
            f"damaged; {_earlier(Path(directory) / 'step_999999999')}"
        )
    path = Path(directory) / name
    if not (path / "state.pt").is_file():
        raise CheckpointError(
            f"{pointer} names {path.name}, which has no state.pt: the checkpoint is damaged; {_earlier(path)}"
        )
    return path


def verify_checkpoint(path: str | os.PathLike[str], names: list[str] | None = None) -> dict[str, Any]:
    """Check ``names`` (default: every file listed) of the checkpoint folder ``path``
    against the sizes and SHA-256 in its ``checkpoint.json``; returns that manifest.

    Raises:
        CheckpointError: naming the file that is missing, truncated or damaged.
    """
    path = Path(path)
    mpath = path / CHECKPOINT_MANIFEST
    hint = _earlier(path)
    if not mpath.is_file():
        raise CheckpointError(
            f"{mpath} is missing: the checkpoint has no checksums (damaged, or written by an sftpack "
            f"without them) and cannot be checked; {hint}"
        )
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        if manifest.get("format") != _FORMAT or not isinstance(files, dict):
            raise ValueError("not a checkpoint manifest")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{mpath} cannot be read ({' '.join(str(e).split())[:80]}): the checkpoint is damaged; {hint}"
        ) from None
    if int(manifest.get("format_version", 0)) > _FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath}: checkpoint format {manifest.get('format_version')} is newer than this sftpack's "
            f"({_FORMAT_VERSION}): upgrade sftpack to resume it"
        )
    for name in files if names is None else names:
        p = path / name
        entry = files.get(name)
        if not isinstance(entry, dict) or "bytes" not in entry or "sha256" not in entry:
            raise CheckpointError(f"{mpath} lists no checksum for {name}: the checkpoint is damaged; {hint}")
        if not p.is_file():
            raise CheckpointError(f"{p} is missing: the checkpoint is damaged; {hint}")
        size = p.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{p} is {size:,} bytes, {CHECKPOINT_MANIFEST} says {entry['bytes']:,}: the file is truncated or "
                f"was replaced; {hint}"
            )
        if _sha256(p) != entry["sha256"]:
            raise CheckpointError(
                f"{p} does not match its SHA-256 in {CHECKPOINT_MANIFEST}: the file is damaged; {hint}"
            )
    return manifest


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged file here
        raise CheckpointError(
            f"{path} cannot be loaded ({type(e).__name__}: {' '.join(str(e).split())[:120]}): the file is "
            f"damaged or was written by an incompatible torch; {_earlier(path.parent)}"
        ) from None


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    rank: int,
    world: int,
    fingerprint: str,
    model: Any = None,
    elastic: bool = False,
) -> tuple[dict, dict]:
    """``(shared, per_rank)`` of the checkpoint folder ``path``, checked against this run
    (its data ``fingerprint``, its ``world`` size and, given this run's ``model``, its dtype).

    ``elastic``: the run's source keeps a position that does not depend on the number of
    ranks (``Source.elastic``: the trainer path's place in the seeded order of the global
    stream). Such a checkpoint written by ``N`` ranks resumes on any ``M``: ``state.pt``
    holds the whole model and optimizer state whatever wrote it (gathered to rank 0, with
    FSDP too), and every rank takes rank 0's file: its data position is every rank's (the
    source's ``load_state_dict`` reads it at this rank and world), and its RNG states stand
    for every rank's (every rank seeds the model alike, the data order has generators of its
    own, and a step draws no random number; a model with dropout draws its masks per rank,
    so its run depends on the number of ranks anyway). With the same number of ranks each
    rank takes its own file, as always.
    Without ``elastic``, another number of ranks is refused: each rank's position is its own.

    The files are verified against ``checkpoint.json`` before they are unpickled. A
    checkpoint written before the dtype was recorded is checked by its saved weights.
    """
    path = Path(path)
    manifest = verify_checkpoint(path, ["state.pt"])
    written = [n for n in manifest["files"] if n.startswith("rank_")]
    if len(written) != world and not elastic:
        raise _other_world(path, len(written), world)
    mine = f"rank_{rank}.pt" if len(written) == world else "rank_0.pt"
    verify_checkpoint(path, [mine])
    shared = _load(path / "state.pt")
    if not isinstance(shared, dict) or "model" not in shared:
        raise CheckpointError(f"{path / 'state.pt'} holds no model state: the file is damaged; {_earlier(path)}")
    if shared.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path}: this checkpoint was written for other data or data options (fingerprint "
            f"{str(shared.get('fingerprint'))[:12]}..., this run {fingerprint[:12]}...): resume with the same "
            "data, packing, --max-seq-len, --batch-size and --seed, or start a fresh --checkpoint-dir"
        )
    if shared.get("world") != world and not elastic:
        raise _other_world(path, shared.get("world"), world)
    if model is not None:
        now = model_dtype(model)
        saved = shared.get("dtype") or model_dtype(model, shared["model"])
        if saved != now:
            raise CheckpointError(
                f"{path}: the checkpoint's model is {saved}, this run's {now}: a resumed run must train in the "
                f"dtype it saved (its weights and optimizer state); resume with --dtype {saved}, or start a fresh "
                "--checkpoint-dir"
            )
    return shared, _load(path / mine)


def _other_world(path: Path, written: object, world: int) -> CheckpointError:
    return CheckpointError(
        f"{path}: written by {written} rank(s), resumed on {world}: each rank's data position is "
        "saved separately; resume with the same number of processes"
    )
