"""The loop's public names, and the deprecated ``sftpack.train`` alias."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import sftpack.loop
from sftpack.loop._optional import MissingDependency, _need

#: the loop's public names: what a user imports (the rest lives in its private modules)
PUBLIC = [
    "CheckpointError",
    "NonFiniteError",
    "PackingCollator",
    "PaddedCollator",
    "ReplaySource",
    "RowsCollator",
    "TrainConfig",
    "build_model",
    "compact_vocabulary",
    "default_attention",
    "load_model",
    "make_source",
    "plot_training",
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


def test_the_public_names_are_pinned_and_the_namespace_holds_no_others():
    assert sftpack.loop.__all__ == PUBLIC
    objects = {k for k, v in vars(sftpack.loop).items() if not k.startswith("_") and not isinstance(v, type(sftpack))}
    assert objects - {"annotations"} == set(PUBLIC)  # no second path to an internal part


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
    assert set(sftpack.loop.__all__) <= OLD_TRAIN_NAMES
    for name in sftpack.loop.__all__:
        assert getattr(module, name) is getattr(sftpack.loop, name), name


def test_a_fresh_interpreter_warns_once_at_the_importing_line():
    code = "import warnings; warnings.simplefilter('always'); import sftpack.train; import sftpack.train"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    warned = [ln for ln in proc.stderr.splitlines() if "DeprecationWarning" in ln]
    assert len(warned) == 1, proc.stderr
    # stacklevel=2: the warning names the line that imported the alias, not the alias itself
    assert warned[0].startswith("<string>:1: DeprecationWarning: sftpack.train is deprecated"), warned
    assert "import the training loop from sftpack.loop" in warned[0]
