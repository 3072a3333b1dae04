"""The shape of the code: lines, flags, coupling, `Any`, long functions, public names, families.

What issues 27 and 40 ask the closing notes to give, measured rather than counted by hand:

- lines of ``src/sftpack`` per package, and every module over 700 lines;
- the flags of each command (the options ``sftpack <command> --help`` lists, ``-h/--help``
  left out, a flag with aliases counted once), from the parser ``sftpack.cli.build_parser``
  builds: imported in a subprocess with ``PYTHONPATH`` set to the measured tree's ``src``;
- the imports into other packages' private modules: a private module is a ``_``-prefixed
  module inside a subpackage of ``sftpack`` (``chat``, ``loop``, ...) other than the importer's,
  reached as ``from ..pkg._mod import x`` (or ``import sftpack.pkg._mod``), one per statement,
  or as ``from ..pkg import _mod``, one per module named; by importer → provider package;
- the import statements inside functions (anywhere below a ``def``);
- ``Any`` in ``src/``: the ``Name``/``Attribute`` nodes ``Any`` of the syntax trees (an
  annotation, a ``cast``, ``typing.Any``; not the ``import`` of it, not a quoted annotation),
  and the plain text count (the word ``Any`` anywhere, docstrings and comments included);
- the longest functions (``def`` line to last line; a method as ``Class.method``, a nested
  function on its own and inside its parent), the longest in ``loop/`` and ``cli/``, and the
  functions over 150 lines;
- public names (``__all__``) per package; modules outside ``multimodal/`` named like a media
  twin of a path (``*media.py``); the model families (``sftpack.multimodal._family.FAMILIES``);
- the pairs of places in ``src/`` sharing six or more lines, when the ``duplicates`` command
  is on the PATH (a tool of the development machine; skipped elsewhere).

Run: ``python benchmarks/bench_structure.py`` (``--no-results`` to leave RESULTS.md alone);
``--src PATH`` measures another checkout's ``src/sftpack`` (printed only); ``--compare PATH``
prints the closing note's numbers before (PATH's tree) and after (this one, or ``--src``)
side by side (printed only). Only a run on this repository's own tree rewrites RESULTS.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from _results import add_flag, markdown_table, write_section

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "sftpack"
LIMIT = 700  # lines of a module
LONG = 150  # lines of a function
TOP = 10  # longest functions listed

#: run in a subprocess with PYTHONPATH set to the measured tree's ``src``: what needs importing
PROBE = r"""
import argparse, importlib, json, sys
from pathlib import Path
import sftpack
src = Path(sys.argv[1]).resolve()
if Path(sftpack.__file__).resolve().parent != src:
    sys.exit(f"imported {sftpack.__file__}, not the tree at {src}")
from sftpack.cli import build_parser
parser = build_parser()
sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
flags, seen = {}, set()
for name, command in sub.choices.items():
    if id(command) in seen:  # a command's alias: the same parser
        continue
    seen.add(id(command))
    command.format_help()  # a command may add its options the first time it shows its help
    flags[name] = sum(1 for a in command._actions if a.option_strings and not isinstance(a, argparse._HelpAction))
names = {}
for pkg in sys.argv[2:]:
    names[pkg] = len(importlib.import_module(pkg).__all__)
try:
    families = dict(importlib.import_module("sftpack.multimodal._family").FAMILIES)
except (ImportError, AttributeError):
    families = None
print(json.dumps({"flags": flags, "names": names, "families": families}))
"""


@dataclass
class Tree:
    """The measurements of one ``src/sftpack``."""

    src: Path
    lines: dict[str, int] = field(default_factory=dict)  # module (relative path) -> lines
    functions: list[tuple[str, int]] = field(default_factory=list)  # "module:qualname", lines; longest first
    private: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (importer, provider, form) -> n
    inner_imports: int = 0
    any_ast: int = 0
    any_text: int = 0
    flags: dict[str, int] = field(default_factory=dict)
    names: dict[str, int] = field(default_factory=dict)
    families: dict[str, str] | None = None

    def per_package(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for rel, n in self.lines.items():
            out[package_of(rel)] += n
        return dict(sorted(out.items()))

    def big_modules(self) -> dict[str, int]:
        return {rel: n for rel, n in self.lines.items() if n > LIMIT}

    def long_functions(self) -> list[tuple[str, int]]:
        return [(f, n) for f, n in self.functions if n > LONG]

    def longest_in(self, package: str) -> tuple[str, int] | None:
        return next(((f, n) for f, n in self.functions if package_of(f.split(":")[0]) == package), None)

    def private_by_pair(self) -> dict[str, Counter[str]]:
        out: dict[str, Counter[str]] = {}
        for (importer, provider, form), n in sorted(self.private.items()):
            out.setdefault(f"{importer} → {provider}", Counter())[form] += n
        return out

    def private_total(self, form: str | None = None) -> int:
        return sum(n for (_, _, f), n in self.private.items() if form is None or f == form)


def package_of(rel: str) -> str:
    parts = Path(rel).parts
    return parts[0] if len(parts) > 1 else "(top level)"


def module_name(rel: Path) -> tuple[str, str]:
    """The dotted name of module ``rel`` (relative to ``src/sftpack``) and of its package."""
    parts = ["sftpack", *rel.with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def is_module(src: Path, dotted: str) -> bool:
    """Whether ``dotted`` (``sftpack.x.y``) is a module or package of the tree at ``src``."""
    path = src.joinpath(*dotted.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_provider(src: Path, dotted: str) -> str | None:
    """The subpackage whose private module ``dotted`` is, else None."""
    parts = dotted.split(".")
    if len(parts) < 3 or parts[0] != "sftpack" or not (src / parts[1] / "__init__.py").is_file():
        return None
    return parts[1] if any(p.startswith("_") for p in parts[2:]) else None


def scan(tree: Tree, rel: Path, text: str) -> None:
    """Functions, imports and ``Any`` of one module."""
    module = ast.parse(text, filename=str(rel))
    package = module_name(rel)[1]
    importer = package_of(str(rel))

    def target(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def private(dotted: str, form: str) -> None:
        provider = private_provider(tree.src, dotted)
        if provider is not None and provider != importer:
            tree.private[(importer, provider, form)] += 1

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = [*scope, node.name]
            tree.functions.append((f"{rel}:{'.'.join(qual)}", (node.end_lineno or node.lineno) - node.lineno + 1))
            scope, in_function = qual, True
        elif isinstance(node, ast.ClassDef):
            scope = [*scope, node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            tree.inner_imports += in_function
            if isinstance(node, ast.Import):
                for alias in node.names:
                    private(alias.name, "module")
            else:
                where = target(node)
                if private_provider(tree.src, where) is not None:
                    private(where, "module")
                else:
                    for alias in node.names:
                        if alias.name.startswith("_") and is_module(tree.src, f"{where}.{alias.name}"):
                            private(f"{where}.{alias.name}", "package")
        elif isinstance(node, ast.Name) and node.id == "Any":
            tree.any_ast += 1
        elif isinstance(node, ast.Attribute) and node.attr == "Any":
            tree.any_ast += 1
        for child in ast.iter_child_nodes(node):
            visit(child, scope, in_function)

    visit(module, [], False)


def probe(src: Path, computed: list[str]) -> dict:
    """Flags per command, computed ``__all__`` lengths and the families, from the tree imported."""
    env = {**os.environ, "PYTHONPATH": str(src.parent), "PYTHONDONTWRITEBYTECODE": "1"}  # the tree stays as it is
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(src), *computed],
        cwd=src.parent,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench_structure: importing {src} failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(src: Path) -> Tree:
    tree = Tree(src=src)
    computed = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        text = path.read_text(encoding="utf-8")
        tree.lines[str(rel)] = len(text.splitlines())
        tree.any_text += len(re.findall(r"\bAny\b", text))
        scan(tree, rel, text)
        if path.name == "__init__.py":
            pkg = module_name(rel)[0]
            node = next(
                (
                    node.value
                    for node in ast.parse(text).body
                    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
                ),
                None,
            )
            if isinstance(node, (ast.List, ast.Tuple)):
                tree.names[pkg] = len(ast.literal_eval(node))
            elif node is not None:  # a computed one (e.g. sftpack.loop's lazily loaded names): imported
                computed.append(pkg)
    tree.functions.sort(key=lambda f: (-f[1], f[0]))
    found = probe(src, computed)
    tree.flags = found["flags"]
    tree.names = dict(sorted({**tree.names, **found["names"]}.items()))
    tree.families = found["families"]
    return tree


def shared_line_pairs(src: Path) -> int | None:
    tool = shutil.which("duplicates")
    if tool is None:
        return None
    out = subprocess.run(
        [tool, "--most", "200", "--seconds", "120"], cwd=src.parent, capture_output=True, text=True, check=False
    ).stdout
    return len(re.findall(r"^D\d+ ", out, flags=re.M))


def function_cell(entry: tuple[str, int] | None) -> str:
    return "none" if entry is None else f"`{entry[0]}` ({entry[1]})"


def modules_line(big: dict[str, int]) -> str:
    return ", ".join(f"`{k}` ({v})" for k, v in big.items()) or "none"


def report(tree: Tree) -> str:
    """The Markdown of one tree."""
    lines = tree.lines
    twins = [rel for rel in lines if re.search(r"(^|/)_?[a-z_]*media\.py$", rel) and not rel.startswith("multimodal/")]
    per_pkg = tree.per_package()
    pkg_rows = [{"package": k, "lines": v} for k, v in per_pkg.items()]
    pkg_rows.append({"package": "total", "lines": sum(per_pkg.values())})
    flag_rows = [{"command": k, "flags": v} for k, v in tree.flags.items()]
    flag_rows.append({"command": "total", "flags": sum(tree.flags.values())})
    private_rows = [
        {"importer → provider": k, "from ..pkg._mod import": c["module"], "from ..pkg import _mod": c["package"]}
        for k, c in tree.private_by_pair().items()
    ]
    private_rows.append(
        {
            "importer → provider": "total",
            "from ..pkg._mod import": tree.private_total("module"),
            "from ..pkg import _mod": tree.private_total("package"),
        }
    )
    long_rows = [{"function": f"`{f}`", "lines": n} for f, n in tree.functions[:TOP]]
    name_rows = [{"package": k, "public names": v} for k, v in tree.names.items()]
    parts = [
        "Lines per package of `src/sftpack`:\n\n" + markdown_table(pkg_rows, ["package", "lines"]),
        f"Modules over {LIMIT} lines: {modules_line(tree.big_modules())}.",
        "Flags per command (the options of `sftpack <command> --help`, `-h` left out, aliases once):\n\n"
        + markdown_table(flag_rows, ["command", "flags"]),
        "Imports into another package's private modules (a `_` module of another subpackage), "
        f"{tree.private_total():,} in all:\n\n"
        + markdown_table(private_rows, ["importer → provider", "from ..pkg._mod import", "from ..pkg import _mod"]),
        f"Import statements inside functions: {tree.inner_imports:,}.",
        f"`Any` in `src/`: {tree.any_ast:,} in the code (names and attributes of the syntax trees); "
        f"{tree.any_text:,} as text (the word anywhere, docstrings and comments included).",
        f"The {TOP} longest functions (`def` line to last line):\n\n"
        + markdown_table(long_rows, ["function", "lines"]),
        f"The longest function in `loop/`: {function_cell(tree.longest_in('loop'))}; "
        f"in `cli/`: {function_cell(tree.longest_in('cli'))}.",
        f"Functions over {LONG} lines: {len(tree.long_functions())}"
        + (": " + ", ".join(f"`{f}` ({n})" for f, n in tree.long_functions()) if tree.long_functions() else "")
        + ".",
        "Media twins of a path (`*media.py` outside `multimodal/`): "
        + (", ".join(f"`{t}`" for t in twins) or "none")
        + ".",
        "Public names (`__all__`) per package:\n\n" + markdown_table(name_rows, ["package", "public names"]),
    ]
    if tree.families is None:
        parts.append("Model families: `sftpack.multimodal._family.FAMILIES` is not in this tree.")
    else:
        fam_rows = []
        for name, where in tree.families.items():
            module = where.split(":")[0].replace(".", "/") + ".py"
            fam_rows.append({"family": name, "module": module, "lines": lines.get(module.partition("/")[2], 0)})
        parts.append(
            "Model families (each is one module plus its line in `FAMILIES`):\n\n"
            + markdown_table(fam_rows, ["family", "module", "lines"])
        )
    pairs = shared_line_pairs(tree.src)
    parts.append(
        "Pairs of places in `src/` sharing six or more lines (`duplicates`): "
        + ("not measured (the tool is not on this machine's PATH)" if pairs is None else str(pairs))
        + "."
    )
    return "\n\n".join(parts)


def before_after(rows: list[tuple[str, int, int]], title: str) -> str:
    """A table of ``(label, before, after)`` rows with the change."""
    table = [[label, b, a, f"{a - b:+,}"] for label, b, a in rows]
    return markdown_table(table, headers=[title, "before", "after", "change"])


def side_by_side(keys: list[str], before: dict[str, int], after: dict[str, int], title: str) -> str:
    rows = [(k, before.get(k, 0), after.get(k, 0)) for k in keys]
    return before_after([*rows, ("total", sum(before.values()), sum(after.values()))], title)


def union(*dicts: dict[str, int]) -> list[str]:
    """The keys of the dicts, each once, in first-seen order."""
    return list(dict.fromkeys(k for d in dicts for k in d))


def compare(before: Tree, after: Tree) -> str:
    """The closing note's numbers, before and after, side by side."""
    b_pairs = {k: sum(c.values()) for k, c in before.private_by_pair().items()}
    a_pairs = {k: sum(c.values()) for k, c in after.private_by_pair().items()}
    counts = [
        ("imports into private modules, `from ..pkg._mod import`", "module"),
        ("imports into private modules, `from ..pkg import _mod`", "package"),
        ("imports into private modules, both forms", None),
    ]
    count_rows = [(t, before.private_total(f), after.private_total(f)) for t, f in counts]
    count_rows += [
        ("import statements inside functions", before.inner_imports, after.inner_imports),
        ("`Any` in `src/`, in the code (AST names)", before.any_ast, after.any_ast),
        ("`Any` in `src/`, as text", before.any_text, after.any_text),
        (f"modules over {LIMIT} lines", len(before.big_modules()), len(after.big_modules())),
        (f"functions over {LONG} lines", len(before.long_functions()), len(after.long_functions())),
    ]
    top_rows = []
    for i in range(TOP):
        b = before.functions[i] if i < len(before.functions) else None
        a = after.functions[i] if i < len(after.functions) else None
        top_rows.append([i + 1, function_cell(b), function_cell(a)])
    for package in ("loop", "cli"):
        top_rows.append(
            [
                f"longest in `{package}/`",
                function_cell(before.longest_in(package)),
                function_cell(after.longest_in(package)),
            ]
        )
    parts = [
        f"Before: `{before.src}`; after: `{after.src}`.",
        "Counts:\n\n" + before_after(count_rows, "count"),
        "Lines per package of `src/sftpack`:\n\n"
        + side_by_side(
            union(before.per_package(), after.per_package()), before.per_package(), after.per_package(), "package"
        ),
        "Flags per command (the options of `sftpack <command> --help`, `-h` left out, aliases once):\n\n"
        + side_by_side(union(before.flags, after.flags), before.flags, after.flags, "command"),
        "Imports into another package's private modules, by importer → provider (both forms):\n\n"
        + side_by_side(sorted(union(b_pairs, a_pairs)), b_pairs, a_pairs, "importer → provider"),
        f"The {TOP} longest functions (`def` line to last line):\n\n"
        + markdown_table(top_rows, headers=["rank", "before", "after"]),
        f"Modules over {LIMIT} lines: before {modules_line(before.big_modules())}; "
        f"after {modules_line(after.big_modules())}.",
    ]
    return "\n\n".join(parts)


def package_dir(path: str) -> Path:
    """``src/sftpack`` of a checkout given as its root, its ``src`` or ``src/sftpack``."""
    p = Path(path).resolve()
    for candidate in (p / "src" / "sftpack", p / "sftpack", p):
        if (candidate / "__init__.py").is_file() and candidate.name == "sftpack":
            return candidate
    raise SystemExit(f"bench_structure: no sftpack package at {path} (give a checkout, its src/ or src/sftpack)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flag(parser)
    parser.add_argument("--src", default=str(SRC), help="the src/sftpack to measure (default: this repository's)")
    parser.add_argument(
        "--compare",
        metavar="PATH",
        help="print the closing note's numbers before (PATH's src/sftpack) and after (--src) side by side",
    )
    args = parser.parse_args(argv)
    src = package_dir(args.src)
    tree = measure(src)
    if args.compare is not None:
        print(compare(measure(package_dir(args.compare)), tree))
        return 0
    body = report(tree)
    print(body)
    if not args.no_results and src == SRC:
        where = f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"
        write_section(__file__, body, where, title="The shape of `src/sftpack` (static; no timing).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
