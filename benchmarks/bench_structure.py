"""The shape of the code: lines per package and module, public names per package, media twins, families.

What issue 27 asks the closing note to give, measured rather than counted by hand:

- lines of ``src/sftpack`` per package, and every module over 700 lines;
- public names (``__all__``) per package;
- modules outside ``multimodal/`` named like a media twin of a path (``*media.py``);
- the model families (``sftpack.multimodal._family.FAMILIES``) and the files each one is
  (a family is one module under ``multimodal/families/`` plus its line in ``FAMILIES``);
- the pairs of places sharing six or more lines in ``src/``, when the ``duplicates``
  command is on the PATH (a tool of the development machine; skipped elsewhere).

Run: ``python benchmarks/bench_structure.py`` (``--no-results`` to leave RESULTS.md alone).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import platform
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from _results import add_flag, markdown_table, write_section

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "sftpack"
LIMIT = 700


def module_lines() -> dict[str, int]:
    return {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in sorted(SRC.rglob("*.py"))}


def package_of(rel: str) -> str:
    parts = Path(rel).parts
    return parts[0] if len(parts) > 1 else "(top level)"


def public_names() -> dict[str, int]:
    """``len(__all__)`` of every package (its ``__init__``): a literal list read from the source,
    else (a computed one, e.g. ``sftpack.loop``'s lazily loaded names) from the imported package."""
    out = {}
    for init in sorted(SRC.rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        node = next(
            (
                node.value
                for node in tree.body
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
            ),
            None,
        )
        names = None
        if isinstance(node, (ast.List, ast.Tuple)):
            names = ast.literal_eval(node)
        elif node is not None:
            names = importlib.import_module(".".join(("sftpack", *init.parent.relative_to(SRC).parts))).__all__
        pkg = ".".join(("sftpack", *init.parent.relative_to(SRC).parts))
        if names is not None:
            out[pkg] = len(names)
    return out


def shared_line_pairs() -> int | None:
    tool = shutil.which("duplicates")
    if tool is None:
        return None
    out = subprocess.run(
        [tool, "--most", "200", "--seconds", "120"], cwd=SRC.parent, capture_output=True, text=True, check=False
    ).stdout
    return len(re.findall(r"^D\d+ ", out, flags=re.M))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flag(parser)
    args = parser.parse_args(argv)
    lines = module_lines()
    per_pkg: Counter[str] = Counter()
    for rel, n in lines.items():
        per_pkg[package_of(rel)] += n
    big = {rel: n for rel, n in lines.items() if n > LIMIT}
    twins = [rel for rel in lines if re.search(r"(^|/)_?[a-z_]*media\.py$", rel) and not rel.startswith("multimodal/")]
    sys.path.insert(0, str(ROOT / "src"))
    families = importlib.import_module("sftpack.multimodal._family").FAMILIES
    fam_rows = [
        {"family": name, "module": target.split(":")[0].replace(".", "/") + ".py", "lines": 0}
        for name, target in families.items()
    ]
    for row in fam_rows:
        row["lines"] = lines.get(str(Path(row["module"]).relative_to("sftpack")), 0)
    pairs = shared_line_pairs()
    pkg_rows = [{"package": k, "lines": v} for k, v in sorted(per_pkg.items())] + [
        {"package": "total", "lines": sum(per_pkg.values())}
    ]
    names = public_names()
    name_rows = [{"package": k, "public names": v} for k, v in names.items()]
    body = "\n\n".join(
        [
            "Lines per package of `src/sftpack`:\n\n" + markdown_table(pkg_rows, ["package", "lines"]),
            f"Modules over {LIMIT} lines: " + (", ".join(f"`{k}` ({v})" for k, v in big.items()) or "none") + ".",
            "Media twins of a path (`*media.py` outside `multimodal/`): "
            + (", ".join(f"`{t}`" for t in twins) or "none")
            + ".",
            "Public names (`__all__`) per package:\n\n" + markdown_table(name_rows, ["package", "public names"]),
            "Model families (each is one module plus its line in `FAMILIES`):\n\n"
            + markdown_table(fam_rows, ["family", "module", "lines"]),
            "Pairs of places in `src/` sharing six or more lines (`duplicates`): "
            + ("not measured (the tool is not on this machine's PATH)" if pairs is None else str(pairs))
            + ".",
        ]
    )
    print(body)
    if not args.no_results:
        where = f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"
        write_section(__file__, body, where, title="The shape of `src/sftpack` (static; no timing).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
