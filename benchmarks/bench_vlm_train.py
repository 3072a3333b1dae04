"""Training a tiny Qwen2-VL through the loop: the trainer path (packed at the step) vs padded batches.

What ``sftpack train --corpus vqa --packing trainer`` and ``--packing none`` run, step for
step: the same easy-vqa conversations per step (one seeded order), the trainer path
binning them into micro-batches of at most ``--max-seq-len`` tokens and packing each
(``sftpack.trainer.pack_step`` with the samples' media: per-sample MRoPE positions, the vision tower over
each image, sftpack's varlen attention), the baseline padding them into one ``[B, S]``
batch (the model's own path with the same positions). Forward, backward (through the
fused head on the supervised slots) and the AdamW step of two copies of the same model,
alternating A/B every step (the order flipped every other step), medians over ``--steps``
steps each. Real tokens/s counts text and image placeholders, never padding.

The vision tower's work is the same in both (every image once, attending within itself);
packing removes the language model's padding. So the ratio depends on how much of a step
the tower takes: ``--image-sides`` sets it (the tower's attention grows with the square of
an image's patches).

Usage::

    python benchmarks/bench_vlm_train.py                       # writes its RESULTS.md section
    python benchmarks/bench_vlm_train.py --steps 3 --no-results
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

from _machine import cpu_model, load_average
from _results import add_flag, formatted_table, write_section


def machine() -> str:
    import torch
    import transformers

    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}; "
        f"load average {load_average():.1f} at start"
    )


class TowerClock:
    """Seconds a step spends in the vision tower, forward and backward, measured by hooks while the
    model trains (every micro-batch summed):

    - forward: the tower's forward pre-hook to its forward hook;
    - backward: from the moment the gradient of the tower's output (its merger's, what the language
      model receives) is ready to the last gradient accumulated into a tower parameter.

    The autograd engine runs one node at a time on CPU; the few language-model nodes that may run
    inside the backward interval (the embedding's) are counted to the tower: its share is an upper
    bound by that much."""

    def __init__(self, model: Any) -> None:
        tower = model.model.visual
        self.seconds = 0.0
        self._start = self._grad = self._last = 0.0
        self._open = False  # a backward interval not settled yet
        self._handles = [
            tower.register_forward_pre_hook(self._begins),
            tower.register_forward_hook(self._ends),
            tower.merger.register_forward_hook(self._merged),
        ]
        for p in tower.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def _settle(self) -> None:
        if self._open:
            self.seconds += self._last - self._grad
            self._open = False

    def _begins(self, *_: Any) -> None:
        self._settle()
        self._start = time.perf_counter()

    def _ends(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._start

    def _merged(self, _m: Any, _i: Any, out: Any) -> None:
        if getattr(out, "requires_grad", False):
            out.register_hook(self._grad_ready)

    def _grad_ready(self, grad: Any) -> None:
        self._grad = self._last = time.perf_counter()
        self._open = True

    def _accumulated(self, _p: Any) -> None:
        self._last = time.perf_counter()

    def take(self) -> float:
        """The seconds since the last call (the backward still open is settled first)."""
        self._settle()
        out, self.seconds = self.seconds, 0.0
        return out


class Runner:
    """One model, its optimizer and its source: :meth:`step` is one optimizer step of the loop."""

    def __init__(
        self, packing: str, samples: list, vocab: Any, args: argparse.Namespace, dim: int, layers: int
    ) -> None:
        import torch

        from sftpack.loop import TrainConfig, make_source
        from sftpack.loop._model import LossModule, build_media_model
        from sftpack.multimodal import family_for

        self.cfg = TrainConfig(
            packing=packing,
            steps=args.steps,
            batch_size=args.batch_size,
            max_seq_len=args.max_seq_len,
            dim=dim,
            layers=layers,
            device="cpu",
        )
        family = family_for()
        tok = family.tokenizer()
        self.model = build_media_model(family, tok, vocab=vocab, dim=dim, layers=layers, seed=0)
        pad_id = int(vocab.searchsorted(tok.pad_token_id))
        self.source = make_source(self.cfg, samples=samples, pad_id=pad_id)
        self.loss = LossModule(self.model, pad_between_seqs=self.cfg.pad_between_seqs)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)
        self.clock = TowerClock(self.model)
        self.rows: list[dict[str, float]] = []

    def step(self) -> None:
        import torch

        self.clock.take()
        t0 = time.perf_counter()
        mbs = self.source.next_step()
        n = torch.tensor(sum(mb.num_label_tokens for mb in mbs))
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in mbs:
            loss = self.loss(mb, n)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        dt = time.perf_counter() - t0
        tower = self.clock.take()
        real = sum(mb.num_real_tokens for mb in mbs)
        slots = sum(mb.num_tokens for mb in mbs)
        self.rows.append(
            {
                "s": dt,
                "tok_s": real / dt,
                "tower_share": tower / dt,
                "rest_s": dt - tower,
                "real": real,
                "slots": slots,
                "padding": 1 - real / slots,
                "images": sum(mb.num_media_items for mb in mbs),
                "mbs": len(mbs),
                "loss": total,
                "load": load_average(),
            }
        )


COLUMNS = [
    ("shape", "language model", "{}"),
    ("mode", "mode", "{}"),
    ("tok_s", "real tokens/s (median)", "{:,.0f}"),
    ("s", "s/step (median)", "{:.3f}"),
    ("real", "real tokens/step", "{:,.0f}"),
    ("slots", "token slots/step", "{:,.0f}"),
    ("padding", "padding", "{:.1%}"),
    ("images", "images/step", "{:.1f}"),
    ("mbs", "micro-batches/step", "{:.1f}"),
    ("bound", "bound (slots saved)", "{:.2f}x"),
    ("speedup", "step x padded", "{:.2f}x"),
    ("rest_speedup", "step without the tower x padded", "{:.2f}x"),
    ("tower_share", "vision tower share of the step", "{:.0%}"),
    ("load", "load (median)", "{:.1f}"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=64, help="easy-vqa conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-sides", type=int, nargs=2, default=[56, 224], metavar=("MIN", "MAX"))
    ap.add_argument("--batch-size", type=int, default=8, help="conversations per step")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="the trainer path's token budget per micro-batch")
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=["64x2", "128x8"],
        help="DIMxLAYERS of the language model (the vision tower: width DIM, depth 2), one table row pair each",
    )
    ap.add_argument("--steps", type=int, default=12, help="timed steps per mode (after one warm-up step each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    add_flag(ap)
    args = ap.parse_args()

    import torch

    from sftpack.loop import compact_vocabulary
    from sftpack.loop._model import media_token_ids
    from sftpack.loop._setup import media_samples
    from sftpack.multimodal import family_for, vqa_corpus

    torch.set_num_threads(args.threads)
    where = machine()
    print(f"machine: {where}")
    lo, hi = args.image_sides
    convs = vqa_corpus(seed=args.seed, limit=args.limit, min_side=lo, max_side=hi)
    samples, _ = media_samples(convs, max_seq_len=args.max_seq_len)
    family = family_for()
    tok = family.tokenizer()
    samples, vocab = compact_vocabulary(samples, keep=[tok.pad_token_id, *media_token_ids(family, tok).values()])
    corpus = (
        f"{len(samples)} easy-vqa samples (seed {args.seed}, images {lo}-{hi} px a side, "
        f"{sum(s.media.num_items for s in samples if s.media is not None)} images), {args.batch_size} per step; "
        "tiny Qwen2-VL, "
        f"float32, its vocabulary the {len(vocab)} ids the data uses; {args.threads} torch thread(s)"
    )
    print(corpus)
    rows = []
    for shape in args.shapes:
        dim, layers = (int(x) for x in shape.split("x"))
        packed = Runner("trainer", samples, vocab, args, dim, layers)
        padded = Runner("none", samples, vocab, args, dim, layers)
        packed.step()  # warm-up (first-call costs), not timed
        padded.step()
        packed.rows.clear()
        padded.rows.clear()
        for i in range(args.steps):
            order = (packed, padded) if i % 2 == 0 else (padded, packed)
            for r in order:
                r.step()
        # the same conversations and images every step: the sanity of the comparison
        assert [r["images"] for r in packed.rows] == [r["images"] for r in padded.rows]
        assert [r["real"] for r in packed.rows] == [r["real"] for r in padded.rows]
        pair = []
        for name, r in (("trainer (packed at the step)", packed), ("none (padded)", padded)):
            pair.append(
                {"shape": f"dim {dim}, {layers} layers", "mode": name}
                | {k: statistics.median(x[k] for x in r.rows) for k in r.rows[0]}
            )
        # per step, packed against padded (the same conversations): speed, speed without the tower, slots saved
        a, b = packed.rows, padded.rows
        ratios = {
            "speedup": [x["tok_s"] / y["tok_s"] for x, y in zip(a, b)],
            "rest_speedup": [y["rest_s"] / x["rest_s"] for x, y in zip(a, b)],
            "bound": [y["slots"] / x["slots"] for x, y in zip(a, b)],
        }
        pair[0].update({k: statistics.median(v) for k, v in ratios.items()})
        pair[1].update(dict.fromkeys(ratios, 1.0))
        print(formatted_table(pair, COLUMNS))
        rows += pair
    table = formatted_table(rows, COLUMNS)
    print(table)
    if not args.no_results:
        body = (
            f"{corpus}. Forward + backward + AdamW step through the loop's pieces "
            "(sftpack.loop: make_source's TrainerSource / PaddedSource, LossModule), the two modes "
            f"alternating every step, medians over {args.steps} steps each (after one warm-up step each); "
            "both see the same conversations and images every step (checked). Bound: the padded batch's slots "
            "over the packed rows' (the slots packing saves; the language model's work per slot). Step x padded, "
            "step without the tower x padded and the bound are medians of per-step ratios. The vision tower's share "
            "(forward + backward, timed by hooks: `TowerClock`) is the same work in both modes, every image once, "
            "so packing moves only the rest of the step toward the bound and the step lands between, by the "
            "tower's share. Absolute times are under the load given (a shared machine); the ratios, measured side "
            "by side, are the point.\n\n"
            f"{table}\n"
        )
        write_section(__file__, body, where, title="bench_vlm_train.py: training a tiny Qwen2-VL, packed vs padded")


if __name__ == "__main__":
    main()
