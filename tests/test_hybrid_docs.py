"""The hybrid-model docs name what the code covers: README's families table and docs/hybrid.md
list every family sftpack.testing builds and every layer class of sftpack.hybrid.LAYER_KINDS,
with the kernel packages each kind's route needs; a kind without kernels is said to have none."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sftpack.hybrid import LAYER_KINDS
from sftpack.testing import HYBRID_FAMILIES

ROOT = Path(__file__).resolve().parents[1]

#: the name the docs give each family of :data:`sftpack.testing.HYBRID_FAMILIES`
FAMILY_NAMES = {
    "nemotron_h": "Nemotron-H",
    "bamba": "Bamba",
    "falcon_h1": "Falcon-H1",
    "granitemoehybrid": "Granite-4 hybrid",
    "zamba2": "Zamba2",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "qwen3_next": "Qwen3-Next",
    "lfm2": "LFM2",
}
#: the pip name of each kernel package (the import names of LayerKind.kernels)
PIP_NAMES = {"mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d", "fla": "flash-linear-attention"}
#: the README table's name of each kind (LayerKind.name)
README_KINDS = {"Mamba2 mixer": "Mamba2 mixer", "gated delta net": "gated delta net", "short conv": "short convolution"}


def _readme_table() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Hybrid models") :]
    section = section[: section.index("\n#")]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # after the header and rule
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_every_family_has_a_name_here():
    assert set(FAMILY_NAMES) == set(HYBRID_FAMILIES)


def test_the_readme_table_lists_every_family_with_its_kind_and_kernel_packages():
    table = _readme_table()
    kinds = {README_KINDS[k.name]: k for k in LAYER_KINDS}
    seen = []
    for families, kind_name, kernels, _torch in table:
        kind = kinds[kind_name]
        names = [f.strip() for f in families.split(",")]
        seen += names
        packages = re.findall(r"`([^`]+)`", kernels)
        assert packages == [PIP_NAMES[k] for k in kind.kernels], (kind_name, kernels)
        if not kind.kernels:
            assert kernels == "none", kernels
    assert sorted(seen) == sorted(FAMILY_NAMES.values())
    assert "(docs/hybrid.md)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("page", ["docs/hybrid.md"])
def test_the_hybrid_page_names_every_layer_class_and_family(page):
    text = (ROOT / page).read_text()
    for kind in LAYER_KINDS:
        for cls in kind.classes:
            assert f"`{cls}`" in text, cls
        for package in kind.kernels:
            assert PIP_NAMES[package] in text, package
    for name in FAMILY_NAMES.values():
        assert f"| {name} |" in text, name


def test_the_docs_indexes_list_the_page():
    assert "(hybrid.md)" in (ROOT / "docs" / "index.md").read_text()
    assert "(docs/hybrid.md)" in (ROOT / "README.md").read_text()
