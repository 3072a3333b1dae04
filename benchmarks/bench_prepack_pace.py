"""Prepack at the tokenizer's pace: ``sftpack prepack`` end to end against the plain tokenizer.

Contenders, each in its own long-lived process (tokenizer loaded, corpus read and
one warm-up run done before the first timed round, then idle, blocked on its
pipe, while the others run), so no one pays another's start-up or import::

    plain      tokenizer(texts, add_special_tokens=False) batch by batch (256) over the
               conversations already rendered to text: the Rust tokenizer on both cores,
               nothing else (the strict yardstick)
    user       what a user writes without sftpack: tokenizer.apply_chat_template(batch,
               tokenize=False) then tokenizer(texts) on each batch of 256
    prepack N  sftpack.offline.prepack(None, out, max_seq_len=4096, num_proc=N): the
               embedded corpus read, rendered, tokenized, masked, staged, bin-packed,
               written, checksummed and published (the work `sftpack prepack` does
               after its imports and tokenizer load)
    base N     the same prepack from another source tree (``--baseline-src``, e.g. the
               previous commit exported with ``git archive``), for before/after in one run

Rounds are interleaved (every contender once per round, the order rotated each
round) and each ratio is the median over rounds of the per-round ratio
``plain wall / prepack wall``, with its range, beside the load average of the
round. CPU ratios use the CPU seconds of each contender's process and its reaped
workers. The prepacks of every contender must be byte-identical (checked).

    python benchmarks/bench_prepack_pace.py [--rounds 5] [--procs 1,2] [--limit N]
        [--baseline-src /tmp/base/src]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section

BATCH = 256
MAX_SEQ_LEN = 4096


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# ---------------------------------------------------------------------------- children


def _child(kind: str, procs: int, limit: int | None, workdir: Path) -> None:
    from sftpack.data import default_corpus, default_tokenizer

    tok = default_tokenizer()
    convs = list(default_corpus(limit=limit))
    messages = [c.messages for c in convs]
    if kind == "plain":
        texts = tok.apply_chat_template(messages, tokenize=False)

        def run(k: int | None = None) -> dict[str, Any]:
            n = 0
            for i in range(0, len(texts[:k]), BATCH):
                n += sum(map(len, tok(texts[i : i + BATCH], add_special_tokens=False)["input_ids"]))
            return {"tokens": n}

    elif kind == "user":

        def run(k: int | None = None) -> dict[str, Any]:
            n = 0
            for i in range(0, len(messages[:k]), BATCH):
                batch = tok.apply_chat_template(messages[i : i + BATCH], tokenize=False)
                n += sum(map(len, tok(batch, add_special_tokens=False)["input_ids"]))
            return {"tokens": n}

    else:
        from sftpack.offline import prepack

        out = workdir / f"{kind}_{procs}"

        def run(k: int | None = None) -> dict[str, Any]:
            lim = limit if k is None else k
            r = prepack(None, out, tokenizer=tok, max_seq_len=MAX_SEQ_LEN, num_proc=procs, overwrite=True, limit=lim)
            h = hashlib.sha256()
            for p in sorted(out.iterdir()):
                h.update(p.name.encode() + b"\0" + p.read_bytes())
            return {"tokens": int(r.counts["tokens"]), "digest": h.hexdigest(), "seconds": r.seconds}

    serve(run, 64)


def serve(run: Callable[..., dict[str, Any]], warm: int) -> None:
    """A child's life: ``run(warm)`` once (warm-up: templates compiled, numba kernels loaded, page
    cache warm), then one timed ``run()`` per ``run`` line on stdin, its result as a JSON line
    (a result's ``"after"``: a callable run after the clock stops, whose dict joins the result)."""
    import sftpack

    run(warm)
    print(json.dumps({"ready": True, "sftpack": str(Path(sftpack.__file__).parent)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        w, c = time.perf_counter(), _cpu()
        res = run()
        res.update(wall=time.perf_counter() - w, cpu=_cpu() - c)
        after = res.pop("after", None)  # what checks the result (e.g. its digest), not timed
        if after is not None:
            res.update(after())
        print(json.dumps(res), flush=True)


class Contender:
    """One contender: ``script --child KIND`` in its own process, warm, timed on each ``run`` line
    it reads (bench_image_pace.py runs its own children through it, ``script=`` its file)."""

    def __init__(
        self,
        name: str,
        kind: str,
        procs: int,
        args: argparse.Namespace,
        src: str | None = None,
        *,
        script: str = __file__,
        extra: tuple[str, ...] = (),
    ):
        self.name = name
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, script, "--child", kind, "--child-procs", str(procs), "--workdir", str(args.workdir)]
        if getattr(args, "limit", None) is not None:
            cmd += ["--limit", str(args.limit)]
        cmd += list(extra)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.results: list[dict[str, Any]] = []

    def ready(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"contender {self.name} died while starting")
        return json.loads(line)

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"contender {self.name} died")
        res = json.loads(line)
        self.results.append(res)
        return res

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


# ---------------------------------------------------------------------------- parent


def machine() -> str:
    import tokenizers
    import transformers

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cpu_model()}, {usable} usable cores; Python {platform.python_version()}, tokenizers "
        f"{tokenizers.__version__}, transformers {transformers.__version__}, {platform.system()}"
    )


def _median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def compared_row(c: Contender, yard: Contender, user: Contender | None, yard_key: str) -> dict[str, Any]:
    """What both pace benchmarks report of contender ``c`` against the yardstick ``yard`` (its
    median wall under ``yard_key``), round by round: the median wall, the wall and CPU ratios
    (median, min, max) and, with ``user``, the user's pipeline's wall and its ratio."""
    ratio = _median_range([y["wall"] / r["wall"] for y, r in zip(yard.results, c.results)])
    cpu = _median_range([y["cpu"] / r["cpu"] for y, r in zip(yard.results, c.results)])
    row: dict[str, Any] = {
        "contender": c.name,
        "wall": statistics.median(r["wall"] for r in c.results),
        yard_key: statistics.median(r["wall"] for r in yard.results),
        "ratio": ratio[0],
        "ratio_min": ratio[1],
        "ratio_max": ratio[2],
        "cpu_ratio": cpu[0],
        "cpu_ratio_min": cpu[1],
        "cpu_ratio_max": cpu[2],
    }
    if user is not None:
        row["user_wall"] = statistics.median(r["wall"] for r in user.results)
        row["user_ratio"] = statistics.median(u["wall"] / r["wall"] for u, r in zip(user.results, c.results))
    return row


def run_rounds(
    spec: list[tuple[str, str, int, str | None]],
    args: argparse.Namespace,
    *,
    script: str = __file__,
    extra: tuple[str, ...] = (),
) -> tuple[list[Contender], list[float]]:
    """Start each contender of ``spec`` (``(name, kind, processes, src)``) one at a time (the
    start-ups do not overlap the rounds), run ``args.rounds`` rounds, who goes first rotating,
    and close them; returns the contenders (their ``results``) and each round's load average."""
    contenders: list[Contender] = []
    loads: list[float] = []
    try:
        for name, kind, p, src in spec:
            c = Contender(name, kind, p, args, src, script=script, extra=extra)
            info = c.ready()
            print(f"  {name:<10} ready (sftpack from {info['sftpack']})", flush=True)
            contenders.append(c)
        for r in range(args.rounds):
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            load0 = load_average()
            line = []
            for c in order:
                res = c.run()
                line.append(f"{c.name} {res['wall']:.1f}s")
            loads.append((load0 + load_average()) / 2)
            print(f"round {r + 1}: load {loads[-1]:.1f}: " + ", ".join(line), flush=True)
    finally:
        for c in contenders:
            c.close()
    return contenders, loads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--procs", default="1,2", help="prepack process counts, comma-separated")
    ap.add_argument("--limit", type=int, default=None, help="first N conversations only")
    ap.add_argument("--baseline-src", default=None, help="a source tree (its src/ folder) to prepack with as 'base'")
    ap.add_argument("--no-user", action="store_true", help="leave out the apply_chat_template + tokenizer contender")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "bench_prepack_pace.csv")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-procs", type=int, default=1, help=argparse.SUPPRESS)
    add_flag(ap)
    args = ap.parse_args(argv)
    if args.child is not None:
        _child(args.child, args.child_procs, args.limit, args.workdir)
        return 0

    tmp = tempfile.TemporaryDirectory(prefix="bench_prepack_pace_") if args.workdir is None else None
    args.workdir = Path(tmp.name) if tmp is not None else args.workdir
    where = machine()
    print(f"machine: {where}")
    procs = [int(p) for p in args.procs.split(",")]
    spec: list[tuple[str, str, int, str | None]] = [("plain", "plain", 1, None)]
    if not args.no_user:
        spec.append(("user", "user", 1, None))
    spec += [(f"prepack {p}", "prepack", p, None) for p in procs]
    if args.baseline_src:
        spec += [(f"base {p}", "base", p, args.baseline_src) for p in procs]
    try:
        contenders, loads = run_rounds(spec, args)
    finally:
        if tmp is not None:
            tmp.cleanup()

    by = {c.name: c for c in contenders}
    plain, user = by["plain"], by.get("user")
    tokens = {c.name: {r["tokens"] for r in c.results} for c in contenders}
    assert all(t == tokens["plain"] and len(t) == 1 for t in tokens.values()), f"token counts differ: {tokens}"
    digests = {c.name: {r["digest"] for r in c.results} for c in contenders if c.results and "digest" in c.results[0]}
    identical = len(set().union(*digests.values())) == 1
    n = next(iter(tokens["plain"]))
    rows = []
    for c in contenders:
        if c is plain or c is user:
            continue
        row = compared_row(c, plain, user, "plain_wall")
        row["tokens"] = n
        row["tokenize_s"] = statistics.median(r["seconds"]["read_tokenize"] for r in c.results)
        row["rest_s"] = statistics.median(r["seconds"]["total"] - r["seconds"]["read_tokenize"] for r in c.results)
        rows.append(row)
    load_txt = f"load average {min(loads):.1f}-{max(loads):.1f} during the rounds"

    columns = [
        ("contender", "contender", "{}"),
        ("wall", "prepack wall s", "{:.2f}"),
        ("tokenize_s", "of which read + tokenize s", "{:.2f}"),
        ("rest_s", "pack + write + checksum s", "{:.2f}"),
        ("plain_wall", "plain tokenizer wall s", "{:.2f}"),
        ("ratio", "ratio (plain / prepack)", "{:.2f}x"),
        ("ratio_min", "min", "{:.2f}x"),
        ("ratio_max", "max", "{:.2f}x"),
        ("cpu_ratio", "CPU ratio", "{:.2f}x"),
    ]
    if user is not None:
        columns += [
            ("user_wall", "apply_chat_template + tokenizer wall s", "{:.2f}"),
            ("user_ratio", "ratio", "{:.2f}x"),
        ]
    table = formatted_table(rows, columns)
    print()
    print(table)
    met = all(r["ratio"] >= 0.8 for r in rows if r["contender"].startswith("prepack"))
    print(
        f"\n{n:,} tokens; median of {args.rounds} interleaved rounds (range beside it); {load_txt}; "
        f"prepacks byte-identical across contenders: {identical}; goal ratio >= 0.80: {'met' if met else 'MISSED'}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.write(",".join(k for k, _, _ in columns) + ",load,machine\n")
        for r in rows:
            f.write(",".join(str(r.get(k, "")) for k, _, _ in columns) + f",{load_txt},{where!r}\n")
    if not args.no_results:
        title = (
            f"`sftpack prepack` of the embedded corpus ({n:,} tokens, rows of {MAX_SEQ_LEN:,}) end to end, against "
            "the plain tokenizer: `tokenizer(texts)` in batches of 256 over the already-rendered conversations "
            "(ratio), and `apply_chat_template` + `tokenizer(texts)` as a user would write it (last column). Each "
            f"contender runs warm in its own process; median of {args.rounds} interleaved rounds; {load_txt}. "
            f"Goal: ratio >= 0.80 ({'met' if met else 'missed'}); prepacks byte-identical for every process count"
            f"{' and the baseline' if args.baseline_src else ''}: {'yes' if identical else 'NO'}."
        )
        write_section(__file__, table, f"{where}; {load_txt}", title=title)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
