"""The loop's public names, and the deprecated ``sftpack.train`` alias."""

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
    "ModelSettings",
    "NonFiniteError",
    "OutputSettings",
    "PackingCollator",
    "PaddedCollator",
    "ReplaySource",
    "RowsCollator",
    "RunConfig",
    "TrainConfig",
    "build_model",
    "check_model_dir",
    "compact_vocabulary",
    "default_attention",
    "load_model",
    "make_source",
    "plot_training",
    "require_exact",
    "resolve_device",
    "tokenized_samples",
    "train",
]

#: every name ``sftpack.train`` exported before it became an alias of ``sftpack.loop``
OLD_TRAIN_NAMES = {
    "TRAIN_ATTENTION", "Boundaries", "CheckpointError", "LoaderSource", "LossModule", "NonFinite",
    "NonFiniteError", "OfflineSource", "Packing", "PackingCollator", "PaddedCollator", "PaddedMicroBatch",
    "PaddedSource", "ReplaySource", "RowsCollator", "SampleOrder", "Schedule", "Source", "StepLog",
    "TrainConfig", "TrainResult", "TrainerSource", "build_model", "check_targets", "compact_vocabulary",
    "default_attention", "dist_info", "hf_row_kwargs", "init_distributed", "latest_checkpoint", "load_model",
    "make_source", "model_vocab_size", "padded_micro_batch", "plot_training", "read_log",
    "register_train_attention", "resolve_device", "samples_fingerprint", "supervised_targets",
    "tokenized_samples", "train", "verify_checkpoint",
}  # fmt: skip
#: public names of the loop that came after the alias (the alias keeps its old names only)
NEWER_THAN_THE_ALIAS = {
    "ConfigError", "DataSettings", "InputSettings", "ModelSettings", "OutputSettings", "RunConfig", "check_model_dir",
    "require_exact",
}  # fmt: skip


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


def _import_alias():
    sys.modules.pop("sftpack.train", None)  # imported before by another test: import it afresh
    with pytest.warns(DeprecationWarning, match=r"sftpack\.train is deprecated.*sftpack\.loop") as record:
        module = importlib.import_module("sftpack.train")
    return module, record


def test_the_old_module_warns_naming_the_new_one():
    module, record = _import_alias()
    assert [str(w.message) for w in record if w.category is DeprecationWarning][0].count("sftpack.loop") == 1


def test_the_old_module_still_gives_every_old_name_as_the_same_object():
    module, _ = _import_alias()
    assert set(module.__all__) == OLD_TRAIN_NAMES
    assert set(sftpack.loop.__all__) - OLD_TRAIN_NAMES == NEWER_THAN_THE_ALIAS
    for name in set(sftpack.loop.__all__) - NEWER_THAN_THE_ALIAS:
        assert getattr(module, name) is getattr(sftpack.loop, name), name


def test_a_fresh_interpreter_warns_once_at_the_importing_line():
    code = "import warnings; warnings.simplefilter('always'); import sftpack.train; import sftpack.train"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    warned = [ln for ln in proc.stderr.splitlines() if "DeprecationWarning" in ln]
    assert len(warned) == 1, proc.stderr
    # stacklevel=2: the warning names the line that imported the alias, not the alias itself
    assert warned[0].startswith("<string>:1: DeprecationWarning: sftpack.train is deprecated"), warned
    assert "import the training loop from sftpack.loop" in warned[0]


def test_the_loop_contracts_can_fail(tmp_path):
    """pyproject.toml's two loop contracts, broken on purpose in a copy of the tree: the
    loop importing a face, and a module of the package importing the deprecated alias."""
    root = Path(__file__).resolve().parents[2]
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint is not None, "lint-imports is not installed: install sftpack with the 'test' extra"
    shutil.copytree(root / "src" / "sftpack", tmp_path / "sftpack", ignore=shutil.ignore_patterns("__pycache__"))
    for module, line in (("_plot.py", "from .. import train"), ("_options.py", "from ..report import layout")):
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
    assert "Nothing in the package imports the deprecated sftpack.train alias BROKEN" in proc.stdout
    assert "sftpack.loop._options -> sftpack.report.layout" in proc.stdout
    assert "sftpack.loop._plot -> sftpack.train" in proc.stdout
