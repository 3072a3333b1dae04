"""The Ray engine carries the prepack's optional columns (issue 42): preference pairs (each pair whole
in one row, ``roles.npy``) and per-token weights (``weights.npy``) come out byte for byte the local
engine's, over several units (one per input file; one of the weighted files has no weights at all,
so the merge lays 1 for its tokens). One Ray worker: the merge is what is tested, not the pool."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from sftpack.data import default_corpus
from sftpack.offline import PrepackedDataset, prepack, prepack_ray
from sftpack.offline._format import FILES, MANIFEST, ROLES_FILE, WEIGHTS_FILE

OPTIONS = {"max_seq_len": 512, "pad_multiple": 4, "overlong": "drop", "seed": 3}


def _write(root, rows_per_file):
    root.mkdir()
    for k, rows in enumerate(rows_per_file):
        (root / f"part-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_ray_writes_the_local_pairs_and_weights(ray_cluster, tok_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    convs = [c.messages for c in default_corpus(limit=41)]
    prefs = [
        {"prompt": m[0]["content"], "chosen": " " + m[1]["content"], "rejected": " " + convs[i + 1][1]["content"]}
        for i, m in enumerate(convs[:40])
    ]
    chats = [{"messages": m} for m in convs[:40]]
    for i, r in enumerate(chats[:20]):  # the second file: no weights
        r["weight" if i % 2 else "advantage"] = 2.5 if i % 2 else -1.0
    inputs = {
        "pairs": (_write(tmp_path / "prefs", [prefs[:20], prefs[20:]]), ROLES_FILE),
        "weights": (_write(tmp_path / "chats", [chats[:20], chats[20:]]), WEIGHTS_FILE),
    }
    for name, (folder, column) in inputs.items():
        local = prepack(folder, tmp_path / f"{name}-local", tokenizer=tok, **OPTIONS)
        ray = prepack_ray(folder, tmp_path / f"{name}-ray", tokenizer=str(tok_dir), workers=1, **OPTIONS)
        assert ray.manifest["format_version"] == 5
        for f in (*FILES, column):
            assert (ray.path / f).read_bytes() == (local.path / f).read_bytes(), (name, f)
        assert json.loads((ray.path / MANIFEST).read_text()) == json.loads((local.path / MANIFEST).read_text())
        PrepackedDataset(ray.path, verify="full")
