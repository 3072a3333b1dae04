"""The offline path's public names, pinned: a change to them is a decision made here."""

from __future__ import annotations

import sftpack.offline
import sftpack.offline.engine


def test_the_package_exports_the_user_facing_names():
    assert sorted(sftpack.offline.__all__) == [
        "PrepackError",
        "PrepackOptions",
        "PrepackResult",
        "PrepackedDataset",
        "describe",
        "export_megatron_bridge",
        "export_packed_jsonl",
        "import_megatron_bridge",
        "import_packed_jsonl",
        "prepack",
        "prepack_ray",
        "prepack_samples",
        "read_manifest",
    ]
    assert all(getattr(sftpack.offline, name) is not None for name in sftpack.offline.__all__)


def test_the_extension_module_exports_the_engine_parts():
    engine = sftpack.offline.engine
    assert sorted(engine.__all__) == [
        "Conversations",
        "LocalEngine",
        "MediaLayout",
        "PrepackEngine",
        "RayEngine",
        "RayPrepackResult",
        "RowPlan",
        "Samples",
        "Staged",
        "StagedSamples",
        "StagingSource",
        "TokenSource",
        "allocate",
        "plan_from_membership",
        "plan_rows",
        "progress_bar",
        "ray_session",
        "stage_samples",
        "write_index",
        "write_rows",
    ]
    assert issubclass(engine.LocalEngine, engine.PrepackEngine) and issubclass(engine.RayEngine, engine.PrepackEngine)
    # no engine part is also a package name
    assert not set(engine.__all__) & set(sftpack.offline.__all__)
