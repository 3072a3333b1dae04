"""Does a change of the code leave what users keep byte for byte the same? Compares another checkout.

Writes, with this checkout's sftpack and with the one at ``--before`` (each in a fresh
interpreter, ``PYTHONPATH`` set to its ``src``): a text prepack of the embedded corpus
(400 conversations, rows of 1,024, ``--overlong truncate``, seed 3), its two exports
(packed JSONL, Megatron-Bridge), the first 7 rows of a ``PackingDataset`` over 300 samples
(seed 5, buffer 64) and its resume state after them; then prints each file's SHA-256 on both
sides and whether they agree. Issue 40 (a refactor of the house) asks that they do.

Run: ``python benchmarks/check_same_bytes.py --before /path/to/other/checkout``
(e.g. ``git worktree add /tmp/before <commit>``). Exits 1 when a file differs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WRITE = r"""
import hashlib, itertools, json, sys
from pathlib import Path
out = Path(sys.argv[1])
from sftpack.cli import main
args = ["prepack", "--out", str(out / "rows"), "--limit", "400", "--max-seq-len", "1024", "--seed", "3"]
assert main([*args, "--no-progress", "--num-proc", "1", "--overlong", "truncate"]) == 0
from sftpack.offline import export_megatron_bridge, export_packed_jsonl
export_packed_jsonl(str(out / "rows"), out / "packed.jsonl")
export_megatron_bridge(str(out / "rows"), out / "bridge")
from sftpack.data import default_corpus, default_tokenizer
from sftpack.loader import PackingDataset
from sftpack.loop import tokenized_samples
samples = tokenized_samples(default_tokenizer(), list(itertools.islice(default_corpus(), 300)), max_seq_len=1024)[0]
ds = PackingDataset(samples, max_seq_len=1024, seed=5, buffer_size=64)
it = iter(ds)
rows = [next(it) for _ in range(7)]
(out / "loader_state.json").write_text(json.dumps(ds.state_dict(), sort_keys=True, default=str))
(out / "loader_rows.txt").write_text("\n".join(hashlib.sha256(r.input_ids.numpy().tobytes()).hexdigest() for r in rows))
"""


def _write(tree: Path, out: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONDONTWRITEBYTECODE="1")
    subprocess.run([sys.executable, "-c", WRITE, str(out)], env=env, check=True, capture_output=True, cwd=out.parent)
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the other checkout (its src/sftpack is measured)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = _write(args.before.resolve(), Path(tmp) / "before")
        after = _write(ROOT, Path(tmp) / "after")
    print("| file | before | after | same |")
    print("|---|---|---|---|")
    for name in sorted(before.keys() | after.keys()):
        b, a = before.get(name, "-"), after.get(name, "-")
        print(f"| {name} | {b[:12]} | {a[:12]} | {'yes' if a == b else 'NO'} |")
    same = before == after
    print(f"\n{len(after)} files; " + ("all byte-identical" if same else "SOME DIFFER"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
