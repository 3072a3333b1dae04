"""Keep ``benchmarks/RESULTS.md`` current: each benchmark rewrites its own section.

A script's section sits between two markers named after the script::

    <!-- bench_offline.py -->
    ## bench_offline.py
    ...what was measured, the machine, the date, the table...
    <!-- /bench_offline.py -->

:func:`write_section` replaces everything between (and including) the markers
with the new run, leaving every other section as it was; a script without a
section yet gets one appended at the end. The file is rewritten through a
temporary file and a rename, so an interrupted run leaves the old file whole.

Every ``bench_*.py`` calls :func:`add_flag` on its parser (``--no-results``
skips the rewrite, for trial runs with small arguments) and :func:`write_section`
at the end of its run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")

HEADER = """# Benchmark results

Every measured number of the project lives here, written by the scripts in
`benchmarks/`: each script replaces its own section (between its markers) at
the end of a run, with the machine and the date. Numbers from a shared or busy
machine are noisy; the ratios against the yardstick measured in the same run
are the point.
"""


def add_flag(parser: argparse.ArgumentParser) -> None:
    """Give a benchmark's parser ``--no-results`` (leave ``RESULTS.md`` untouched)."""
    parser.add_argument(
        "--no-results",
        action="store_true",
        help=f"do not rewrite this script's section of {RESULTS.name}",
    )


def cell(value: Any) -> str:
    """One table cell: integers with thousands separators, floats to 4 significant digits."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return ""
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e7):
            return f"{value:.2e}"
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(
    rows: Sequence[Mapping[str, Any]] | Sequence[Sequence[Any]],
    columns: Sequence[str] | None = None,
    headers: Sequence[str] | None = None,
) -> str:
    """A Markdown table of dicts (``columns`` picks and orders the keys) or of sequences.

    >>> print(markdown_table([{"a": 1, "b": 0.5}, {"a": 20000, "b": None}], headers=["A", "B"]))
    | A | B |
    |---|---|
    | 1 | 0.5 |
    | 20,000 |  |
    """
    if not rows:
        return "(no rows)"
    if isinstance(rows[0], Mapping):
        keys = list(columns or rows[0].keys())
        body = [[r.get(k) for k in keys] for r in rows]  # type: ignore[union-attr]
    else:
        keys = list(columns or [f"column {i + 1}" for i in range(len(rows[0]))])
        body = [list(r) for r in rows]
    head = list(headers or keys)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("" if v is None else cell(v) for v in r) + " |" for r in body]
    return "\n".join(lines)


def formatted_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table of dicts through ``(key, title, format)`` columns, as a script prints them;
    a missing or NaN value is an empty cell.

    >>> print(formatted_table([{"t": 0.12345, "n": 3}, {"n": 4}], [("n", "rows", "{:,}"), ("t", "time s", "{:.3f}")]))
    | rows | time s |
    |---|---|
    | 3 | 0.123 |
    | 4 |  |
    """
    body = []
    for row in rows:
        line = []
        for key, _, fmt in columns:
            v = row.get(key)
            empty = v is None or (isinstance(v, float) and v != v) or v == ""
            line.append("" if empty else fmt.format(v))
        body.append(line)
    return markdown_table(body, headers=[title for _, title, _ in columns])


def section(script: str, body: str, machine: str, *, title: str = "", when: datetime.date | None = None) -> str:
    """The text of one script's section, markers included."""
    name = Path(script).name
    day = (when or datetime.datetime.now(datetime.timezone.utc).date()).isoformat()
    command = " ".join(["python", f"benchmarks/{name}", *sys.argv[1:]]).strip()
    parts = [f"<!-- {name} -->", f"## {name}", ""]
    if title:
        parts += [title.strip(), ""]
    parts += [
        f"Run on {day} (UTC) as `{command}`.",
        "",
        f"Machine: {machine.strip()}",
        "",
        body.strip(),
        f"<!-- /{name} -->",
    ]
    return "\n".join(parts)


def replace_section(text: str, name: str, new: str) -> str:
    """``text`` with the section of script ``name`` replaced by ``new`` (appended when absent)."""
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    i = text.find(begin)
    j = text.find(end, i + len(begin)) if i >= 0 else -1
    if i >= 0 and j >= 0:
        return text[:i] + new + text[j + len(end) :]
    return text.rstrip("\n") + "\n\n" + new + "\n"


def write_section(
    script: str,
    body: str,
    machine: str,
    *,
    title: str = "",
    path: str | os.PathLike[str] = RESULTS,
    when: datetime.date | None = None,
) -> Path:
    """Replace ``script``'s section of ``RESULTS.md`` with ``body`` (Markdown tables),
    the machine line and today's date; returns the path written."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else HEADER
    name = Path(script).name
    text = replace_section(text, name, section(name, body, machine, title=title, when=when))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    print(f"updated {path} (section {name})")
    return path
