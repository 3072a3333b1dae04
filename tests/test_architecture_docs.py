"""docs/architecture.md tells the truth: the same import-linter contracts as pyproject.toml, every package.

The doc lists each contract in its "The import rules" section as::

    - **<name, exactly as in pyproject.toml>** (<type>)
      - modules: `a`, `b`            (independence)
      - from: `a`, `b`               (forbidden: source_modules)
      - forbids: `c`, `d`            (forbidden: forbidden_modules)
      - why: ...

A field may wrap onto lines indented four spaces. Every top-level bullet of that
section must be a contract in this form, so a contract cannot hide in prose.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10: tomli where installed
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "sftpack"
DOC = ROOT / "docs" / "architecture.md"
PYPROJECT = ROOT / "pyproject.toml"

SECTION = "## The import rules"
_HEADER = re.compile(r"^- \*\*(?P<name>[^*]+)\*\* \((?P<type>[\w-]+)\)\s*$")
_FIELD = re.compile(r"^  - (?P<key>[\w ]+): ?(?P<text>.*)$")
_CODE = re.compile(r"`([^`]+)`")
#: the doc's field names for each contract type's module lists in pyproject.toml
FIELDS = {
    "independence": {"modules": "modules"},
    "forbidden": {"from": "source_modules", "forbids": "forbidden_modules"},
    "private_modules": {"modules": "packages_with_private_modules"},
}


def pyproject_contracts(text: str) -> dict[str, dict]:
    contracts = tomllib.loads(text)["tool"]["importlinter"]["contracts"]
    out: dict[str, dict] = {}
    for c in contracts:
        assert c["name"] not in out, f"two contracts named {c['name']!r} in pyproject.toml"
        out[c["name"]] = c
    return out


def _section(text: str) -> list[str]:
    lines = text.splitlines()
    try:
        start = lines.index(SECTION)
    except ValueError:
        raise AssertionError(f"docs/architecture.md has no {SECTION!r} heading") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def doc_contracts(text: str) -> dict[str, dict]:
    """``{name: {"type": ..., field: [code spans], ...}}`` from the doc's contract list."""
    out: dict[str, dict] = {}
    current: dict | None = None
    field: str | None = None
    for line in _section(text):
        if line.startswith("- "):
            m = _HEADER.match(line)
            assert m, f"a bullet of {SECTION!r} that is not a contract '- **name** (type)': {line!r}"
            name = m["name"]
            assert name not in out, f"docs/architecture.md lists {name!r} twice"
            current = out[name] = {"type": m["type"], "_text": {}}
            field = None
        elif current is not None and line.startswith("  - "):
            m = _FIELD.match(line)
            assert m, f"a contract field that is not '  - key: ...': {line!r}"
            field = m["key"]
            assert field not in current["_text"], f"{field!r} given twice for one contract: {line!r}"
            current["_text"][field] = m["text"]
        elif current is not None and field is not None and line.startswith("    ") and line.strip():
            current["_text"][field] += " " + line.strip()
        else:  # a blank line or prose ends the list
            current, field = None, None
    for c in out.values():
        for key, value in c.pop("_text").items():
            c[key] = _CODE.findall(value)
    return out


def disagreements(pyproject_text: str, doc_text: str) -> list[str]:
    """Every way the doc and the contracts differ, in words (empty when they agree)."""
    want, have = pyproject_contracts(pyproject_text), doc_contracts(doc_text)
    problems = [f"pyproject.toml's contract {n!r} is not in docs/architecture.md" for n in want if n not in have]
    problems += [f"docs/architecture.md lists {n!r}, which pyproject.toml lacks" for n in have if n not in want]
    for name in want.keys() & have.keys():
        c, d = want[name], have[name]
        fields = FIELDS.get(c["type"])
        if fields is None:
            problems.append(f"{name!r}: contract type {c['type']!r} unknown to this test: teach FIELDS its fields")
            continue
        if d["type"] != c["type"]:
            problems.append(f"{name!r}: the doc says ({d['type']}), pyproject.toml says {c['type']}")
        for key, toml_key in fields.items():
            listed, wanted = d.get(key), c.get(toml_key, [])
            if listed is None:
                problems.append(f"{name!r}: the doc gives no {key!r} (pyproject.toml: {wanted})")
            elif sorted(listed) != sorted(wanted) or len(set(listed)) != len(listed):
                problems.append(
                    f"{name!r}: {key!r} differs: only in pyproject.toml {sorted(set(wanted) - set(listed))}, "
                    f"only in the doc {sorted(set(listed) - set(wanted))}"
                    + (", a module listed twice in the doc" if len(set(listed)) != len(listed) else "")
                )
        if "why" not in d:
            problems.append(f"{name!r}: the doc does not say why (a 'why:' field)")
    return problems


def _layout(text: str) -> str:
    m = re.search(r"^## Layout\n(.*?)^## ", text, re.S | re.M)
    assert m, "docs/architecture.md has no '## Layout' section"
    return m[1]


def test_the_doc_lists_exactly_the_import_linter_contracts():
    assert disagreements(PYPROJECT.read_text(), DOC.read_text()) == []


def test_the_contracts_are_found_at_all():
    """The parser sees something: as many contracts in the doc as in pyproject.toml, none empty."""
    contracts = doc_contracts(DOC.read_text())
    assert len(contracts) == len(pyproject_contracts(PYPROJECT.read_text())) > 0
    assert all(c.get("modules") or (c.get("from") and c.get("forbids")) for c in contracts.values())


def test_every_package_and_module_is_in_the_layout():
    """Each package (a folder with __init__.py) and top-level module of src/sftpack is named in the layout."""
    layout = _layout(DOC.read_text())
    names = [p.name for p in sorted(SRC.iterdir()) if (p / "__init__.py").is_file()]
    names += [p.stem for p in sorted(SRC.glob("*.py"))]
    assert {"multimodal", "cli", "report", "handoff"} <= set(names)
    # a package may become a module or the other way round: either spelling names it
    missing = [n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}(/|\.py)(?!\w)", layout)]
    assert missing == [], f"not in docs/architecture.md's layout: {missing}"


def test_every_layout_entry_exists():
    """The other way: each ``name/`` or ``name.py`` the layout lists under src/sftpack/ is there."""
    block = re.search(r"^src/sftpack/\n(.*?)^```", _layout(DOC.read_text()), re.S | re.M)
    assert block, "the layout has no src/sftpack/ tree"
    entries = []
    for line in block[1].splitlines():
        if not re.match(r"^  \S", line):
            continue
        for word in line.split():
            if not re.fullmatch(r"\w+(/|\.py)", word):
                break
            entries.append(word)
    assert len(entries) > 10
    gone = [e for e in entries if not (SRC / e.rstrip("/")).exists()]
    assert gone == [], f"docs/architecture.md's layout names what src/sftpack lacks: {gone}"


_SAMPLE_TOML = """
[[tool.importlinter.contracts]]
name = "A apart from B"
type = "independence"
modules = ["p.a", "p.b"]

[[tool.importlinter.contracts]]
name = "C needs no D"
type = "forbidden"
source_modules = ["p.c"]
forbidden_modules = ["p.d", "torch"]
"""

_SAMPLE_DOC = """## The import rules

Prose first.

- **A apart from B** (independence)
  - modules: `p.a`, `p.b`
  - why: because.
- **C needs no D** (forbidden)
  - from: `p.c`
  - forbids: `p.d`,
    `torch`
  - why: because.

## Next
"""


def test_the_sample_agrees():
    assert disagreements(_SAMPLE_TOML, _SAMPLE_DOC) == []


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.replace("- **C needs no D** (forbidden)", "- **C needs no E** (forbidden)"), "lacks"),
        (lambda d: d.replace("`p.d`,\n", "`p.d`, `p.e`,\n"), "only in the doc ['p.e']"),
        (lambda d: d.replace(", `p.b`", ""), "only in pyproject.toml ['p.b']"),
        (lambda d: d.replace("(independence)", "(forbidden)"), "the doc says (forbidden)"),
        (lambda d: d.replace("  - why: because.\n- **C", "- **C"), "does not say why"),
        (lambda d: d.replace("- **C needs no D** (forbidden)", "- C needs no D"), "not a contract"),
    ],
)
def test_a_disagreement_fails(edit, expected):
    doc = edit(_SAMPLE_DOC)
    assert doc != _SAMPLE_DOC
    try:
        problems = disagreements(_SAMPLE_TOML, doc)
    except AssertionError as e:
        problems = [str(e)]
    assert any(expected in p for p in problems), problems


def test_a_dropped_contract_fails():
    toml = _SAMPLE_TOML.replace('"p.d", "torch"', '"p.d", "torch", "p.e"')
    assert any("only in pyproject.toml ['p.e']" in p for p in disagreements(toml, _SAMPLE_DOC))
    doc = _SAMPLE_DOC.split("- **C needs no D**")[0] + "\n## Next\n"
    assert disagreements(_SAMPLE_TOML, doc) == [
        "pyproject.toml's contract 'C needs no D' is not in docs/architecture.md"
    ]
