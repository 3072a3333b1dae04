"""The loop's public names, and the contract that keeps the loop off the faces."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sftpack.loop
from sftpack._optional import MissingDependency, _need

#: the loop's public names: what a user imports (the rest lives in its private modules)
PUBLIC = [
    "CheckpointError",
    "ConfigError",
    "DataSettings",
    "InputSettings",
    "LoopState",
    "ModelSettings",
    "NonFiniteError",
    "OutputSettings",
    "PackingCollator",
    "PaddedCollator",
    "Part",
    "ReplaySource",
    "RowsCollator",
    "RunConfig",
    "StepLog",
    "TrainConfig",
    "build_media_model",
    "build_model",
    "check_model_dir",
    "compact_vocabulary",
    "default_attention",
    "load_model",
    "make_source",
    "media_samples",
    "media_token_ids",
    "model_cost",
    "padded_micro_batch",
    "plot_training",
    "require_exact",
    "resolve_device",
    "tokenized_samples",
    "train",
]


def test_the_public_names_are_pinned_and_the_namespace_holds_no_others():
    assert sftpack.loop.__all__ == PUBLIC
    objects = {k for k, v in vars(sftpack.loop).items() if not k.startswith("_") and not isinstance(v, type(sftpack))}
    assert objects - {"annotations"} <= set(PUBLIC)  # no second path to an internal part (names load lazily)
    assert {k for k in dir(sftpack.loop) if not k.startswith("_")} == set(PUBLIC)
    assert all(getattr(sftpack.loop, k) is not None for k in PUBLIC)


def test_a_missing_optional_dependency_names_its_extra():
    with pytest.raises(MissingDependency, match=r"drawing needs no_such_module_x: pip install 'sftpack\[plot\]'") as e:
        _need("no_such_module_x", "plot", "drawing")
    assert isinstance(e.value, ImportError) and isinstance(e.value, RuntimeError)  # the CLI prints it as one line


def test_the_old_sftpack_train_alias_is_gone():
    """``sftpack.train`` was the loop's old name, kept one release with a DeprecationWarning; that
    release has passed: the import fails, and ``sftpack.loop`` is the one path."""
    sys.modules.pop("sftpack.train", None)
    with pytest.raises(ModuleNotFoundError, match="sftpack.train"):
        importlib.import_module("sftpack.train")


def test_the_loop_contracts_can_fail(tmp_path):
    """pyproject.toml's loop contract, broken on purpose in a copy of the tree: the loop importing
    a face."""
    root = Path(__file__).resolve().parents[2]
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint is not None, "lint-imports is not installed: install sftpack with the 'test' extra"
    shutil.copytree(root / "src" / "sftpack", tmp_path / "sftpack", ignore=shutil.ignore_patterns("__pycache__"))
    for module, line in (("_options.py", "from ..report import layout"),):
        path = tmp_path / "sftpack" / "loop" / module
        path.write_text(path.read_text() + f"\n{line}  # a deliberate violation\n")
    proc = subprocess.run(
        [lint, "--config", str(root / "pyproject.toml"), "--no-cache"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
        timeout=300,
    )
    assert proc.returncode != 0
    assert "The training loop takes the paths and the handoff, never a face BROKEN" in proc.stdout
    assert "sftpack.loop._options -> sftpack.report.layout" in proc.stdout
