"""GPU check: training speed and bf16 exactness with flash-attn varlen and the hybrid models' kernels, where CUDA exists.

On a CUDA machine this script

1. measures bf16 exactness of packed rows the way flash-attention's own tests
   do: the packed run (flash-attn varlen when installed, else sftpack's
   reference attention on CUDA) and a same-precision *unpacked* run (each
   conversation alone, SDPA) are both compared with an fp32 unpacked reference;
   the packed error should be at most about 2x the unpacked bf16 error
   (logits, loss, gradients);
2. runs ``benchmarks/bench_train.py`` on the GPU in bf16 (real tokens/s of each
   path against padded batches, on the embedded corpus at 4,096 tokens);
3. compares the fused output head's implementations (:func:`sftpack.head.fused_linear_cross_entropy`
   with ``impl="torch"`` and each installed CUDA kernel, Liger-Kernel and cut-cross-entropy)
   on the same bf16 inputs with the full 151,646-id vocabulary: loss and gradients
   against a float32 reference, and the time of a forward + backward of each.

4. checks the hybrid families (:func:`sftpack.hybrid.keep_apart`; the small models of
   ``benchmarks/bench_hybrid.py``): for each family, bf16 exactness of packed rows against
   each sample alone, judged as in 1. (both against the float32 per-sample reference; the
   packed error within 2x the same-precision per-sample error), on the kernel route
   (``route="kernels"``: mamba_ssm / causal-conv1d ``seq_idx``, flash-linear-attention
   ``cu_seqlens``) where the family's kernels are installed
   (:func:`sftpack.hybrid.kernel_route_available`) and on the torch route on the GPU, with the
   negative control (:func:`sftpack.hybrid.leaking`) that must fail it; then real tokens/s of
   a forward + backward of the packed row on each route against right-padded batches (and one
   sample at a time), beside the slot bound. A family whose kernels are not installed says so
   in one line and is checked on the torch route only.

Without CUDA it prints why it did nothing and exits 0 (it must not fail a CPU run).
``--parts hybrid --device cpu`` runs part 4 on the CPU (the torch route only, slowly): a smoke
test of the script itself.

    python benchmarks/gpu_check.py [--quick] [--parts exactness,train,head,hybrid]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
PARTS = ("exactness", "train", "head", "hybrid")
#: the hybrid families part 4 checks: a Mamba2 mixer, a gated delta net (dense and MoE), a short conv
HYBRID_FAMILIES = ("nemotron_h", "bamba", "qwen3_5", "qwen3_next", "lfm2")


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]


def _unpacked(model, samples, n_labels):
    """Per-conversation logits (fp32 copies) and the summed-loss gradients, each conversation alone."""
    from sftpack.exactness import reference_labels

    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    logits, total = [], 0.0
    for s in samples:
        ids = torch.as_tensor(s.input_ids, device=device)[None]
        lg = model(input_ids=ids, use_cache=False).logits[0]
        lab = reference_labels(s).to(device)
        loss = torch.nn.functional.cross_entropy(lg.float(), lab, ignore_index=-100, reduction="sum") / n_labels
        loss.backward()
        total += float(loss.detach())
        logits.append(lg.detach().float())
    return logits, total, _grads(model)


def bf16_exactness(*, seed: int = 0) -> list[tuple[str, float, float, float]]:
    """``(quantity, packed bf16 error, unpacked bf16 error, ratio)`` against fp32 unpacked."""
    from sftpack.exactness import random_samples
    from sftpack.handoff import PackedBatch
    from sftpack.loop import build_model, default_attention
    from sftpack.loss import token_losses

    vocab = 4096
    lengths = torch.randint(16, 1024, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    samples = random_samples(lengths, vocab, seed=seed)
    attn = default_attention("cuda")
    fp32 = build_model(
        vocab,
        dim=256,
        layers=4,
        heads=8,
        kv_heads=4,
        seed=seed,
        attn_implementation="sdpa",
    ).cuda()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    packed_model = copy.deepcopy(bf16)
    if hasattr(packed_model, "set_attn_implementation"):
        packed_model.set_attn_implementation(attn)
    else:  # older transformers read it from the config at every call
        packed_model.config._attn_implementation = attn
    packed = PackedBatch.from_samples(samples, pad_multiple=8).to("cuda")
    n = packed.num_label_tokens

    ref_logits, ref_loss, ref_grads = _unpacked(fp32, samples, n)
    low_logits, low_loss, low_grads = _unpacked(bf16, samples, n)

    packed_model.zero_grad(set_to_none=True)
    kw = packed.to_hf_kwargs()
    kw.pop("labels")
    hidden = packed_model.model(**kw).last_hidden_state[0]
    logits = packed_model.lm_head(hidden)
    loss = token_losses(logits, packed).sum() / n
    loss.backward()
    p_grads = _grads(packed_model)
    starts = packed.cu_seqlens_padded[:-1].tolist()
    p_logits = [logits[s : s + len(x)].detach().float() for s, x in zip(starts, samples)]

    def worst(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    rows = []
    for name, packed_err, low_err in (
        ("logits", worst(p_logits, ref_logits), worst(low_logits, ref_logits)),
        ("loss", abs(float(loss) - ref_loss), abs(low_loss - ref_loss)),
        ("grads", worst(p_grads, ref_grads), worst(low_grads, ref_grads)),
    ):
        rows.append((name, packed_err, low_err, packed_err / max(low_err, 1e-12)))
    return rows


def head_agreement(*, rows: int = 4096, dim: int = 896, vocab: int = 151_646, seed: int = 0) -> list[dict]:
    """Each available head implementation on the same bf16 inputs: its error against the
    float32 reference (``impl="torch"`` on float32 copies) and its forward + backward time."""
    import time

    from sftpack.head import fused_linear_cross_entropy, head_impl

    g = torch.Generator().manual_seed(seed)
    h32 = (torch.randn(rows, dim, generator=g) * 0.5).cuda()
    w32 = (torch.randn(vocab, dim, generator=g) * dim**-0.5).cuda()
    y = torch.randint(0, vocab, (rows,), generator=g).cuda()
    y[::7] = -100
    n = int((y != -100).sum())

    def run(impl, dtype):
        h = h32.to(dtype).requires_grad_()
        w = w32.to(dtype).requires_grad_()
        loss = fused_linear_cross_entropy(h, w, y, n, impl=impl)
        gh, gw = torch.autograd.grad(loss, (h, w))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            loss2 = fused_linear_cross_entropy(h, w, y, n, impl=impl)
            torch.autograd.grad(loss2, (h, w))
        torch.cuda.synchronize()
        return float(loss), gh.float(), gw.float(), (time.perf_counter() - t0) / 3

    ref = run("torch", torch.float32)
    out = []
    for impl in ("torch", "liger", "cce"):
        try:
            head_impl(impl, h32.to(torch.bfloat16))
        except (ImportError, ValueError) as e:
            out.append({"impl": impl, "error": str(e)})
            continue
        loss, gh, gw, secs = run(impl, torch.bfloat16)
        out.append(
            {
                "impl": impl,
                "dloss": abs(loss - ref[0]) / abs(ref[0]),
                "dgrad_h": float((gh - ref[1]).abs().max() / ref[1].abs().max()),
                "dgrad_w": float((gw - ref[2]).abs().max() / ref[2].abs().max()),
                "ms": secs * 1e3,
            }
        )
    return out


def _packed(model, packed, n_labels):
    """Per-conversation logits (fp32 copies), the loss and its gradients of one packed row."""
    from sftpack.loss import token_losses

    model.zero_grad(set_to_none=True)
    kw = packed.to_hf_kwargs()
    kw.pop("labels")
    logits = model(**kw).logits[0]
    loss = token_losses(logits, packed).sum() / n_labels
    loss.backward()
    starts, ends = packed.cu_seqlens_padded[:-1].tolist(), packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
    return [logits[a : a + int(k)].detach().float() for a, k in zip(starts, ends)], float(loss.detach()), _grads(model)


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _layer_grad_ratio(model, got: list[torch.Tensor], alone: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The worst, over the gradients of the layers (every parameter but the input embedding and
    the output head), of the packed error over the per-sample bf16 error, both against the
    float32 reference; an error within half a bf16 rounding of the tensor's largest entry
    (2**-9 of it) counts as 0. The embedding and the head are left out: on a packed row each
    sums every occurrence of a token across all the samples in one bf16 reduction, which
    rounds more than a sample alone does whatever the boundaries (a Llama's do the same); no
    state crosses a boundary through them."""
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    params = [p for p in model.parameters() if p.grad is not None]
    worst = 0.0
    for p, g, a, r in zip(params, got, alone, ref):
        if id(p) in skip:
            continue
        floor = 2**-9 * float(r.abs().max())
        err, base = float((g - r).abs().max()), float((a - r).abs().max())
        worst = max(worst, 0.0 if err <= floor else err / max(base, floor, 1e-30))
    return worst


def hybrid_check(
    device: str = "cuda", *, families: tuple[str, ...] = HYBRID_FAMILIES, quick: bool = False, seed: int = 0
) -> tuple[list[dict], list[dict], bool]:
    """Part 4: ``(exactness rows, speed rows, all as expected)`` for ``families``."""
    import bench_hybrid
    from sftpack.data import default_tokenizer
    from sftpack.handoff import PackedBatch
    from sftpack.hybrid import LAYER_KINDS, covered_layers, keep_apart, kernel_route_available, leaking
    from sftpack.loop import compact_vocabulary, tokenized_samples

    kinds = {k.name: k for k in LAYER_KINDS}
    cpu = device == "cpu"  # the smoke test: tiny models, short samples
    samples, _ = tokenized_samples(default_tokenizer(), max_seq_len=512 if cpu else 4096, limit=200 if quick else 400)
    samples, ids = compact_vocabulary(samples)
    exact_batch = next(bench_hybrid.batches(samples, 4 if cpu else 8, 1, seed))
    speed_batch = next(bench_hybrid.batches(samples, 4 if cpu else 32, 1, seed + 1))
    exact_rows, speed_rows, ok = [], [], True
    for kind in families:
        with tempfile.TemporaryDirectory() as folder:
            fp32, _ = bench_hybrid.build(kind, "tiny" if cpu else "small", len(ids), seed, folder)
        fp32 = fp32.to(device)
        layer_kinds = sorted({kinds[c.kind] for c in covered_layers(fp32)}, key=lambda k: k.name)
        with_kernels = [k for k in layer_kinds if k.kernels]
        missing = sorted({p for k in with_kernels if not kernel_route_available(k) for p in k.kernels})
        routes = ["torch"]
        if not with_kernels:
            print(f"   {kind}: {', '.join(k.name for k in layer_kinds)} has no kernel route; torch route only")
        elif missing or device != "cuda":
            why = f"{', '.join(missing)} not installed" if missing else "not on CUDA"
            print(f"   {kind}: kernel route skipped ({why}); torch route only")
        else:
            routes.insert(0, "kernels")
        low = copy.deepcopy(fp32).to(torch.bfloat16)
        packed = PackedBatch.from_samples(exact_batch).to(device)
        n = packed.num_label_tokens
        try:
            ref_logits, ref_loss, ref_grads = _unpacked(fp32, exact_batch, n)
            low_logits, low_loss, low_grads = _unpacked(low, exact_batch, n)
        except Exception as e:  # a family the device cannot run at all: say so, go on with the others
            print(f"   {kind}: per-sample reference failed: {type(e).__name__}: {str(e)[:200]}")
            ok = False
            continue
        per_sample = {
            "logits": _worst(low_logits, ref_logits),
            "loss": abs(low_loss - ref_loss),
        }
        for route in routes:
            keep_apart(low, route=route)
            for control in (False, True):
                label = f"{route}, leaking (control)" if control else route
                try:
                    with leaking(low) if control else contextlib.nullcontext():
                        p_logits, p_loss, p_grads = _packed(low, packed, n)
                except Exception as e:
                    print(f"   {kind} {label}: failed: {type(e).__name__}: {str(e)[:200]}")
                    ok = False
                    continue
                errs = {"logits": _worst(p_logits, ref_logits), "loss": abs(p_loss - ref_loss)}
                grads = _layer_grad_ratio(low, p_grads, low_grads, ref_grads)
                # the tolerance of part 1 (flash-attention's own tests): packed within 2x the bf16
                # per-sample error, for every sample's logits (a floor of 1e-6 where that error is
                # 0) and for every layer's gradient (see _layer_grad_ratio); the loss is shown (a
                # mean over thousands of tokens, its bf16 error is at float32's noise either way)
                within = (errs["logits"] <= 2 * per_sample["logits"] or errs["logits"] <= 1e-6) and grads <= 2
                exact_rows.append(
                    {"family": kind, "route": label, **{f"{q}_packed": errs[q] for q in errs}}
                    | {f"{q}_alone": per_sample[q] for q in errs}
                    | {"grads_ratio": grads, "within": within, "judged": not control or bool(with_kernels)}
                )
                # The control must fail, except a short convolution's (LFM2: no kernel route): its
                # leak, the first few tokens of a sample seeing the previous one's last few through a
                # small convolution, is 4.5e-5 in float64 at most, under bf16's rounding; the suite
                # proves that route in float64.
                ok &= within if not control else (not within or not with_kernels)
        keep_apart(low, route="torch")
        rates: dict[str, list[float]] = {}
        layouts = [("alone", "torch"), ("padded", "torch"), *[("packed", r) for r in routes]]
        for _ in range(1 if cpu else 4):  # the first round warms up, untimed
            for layout, route in layouts:
                keep_apart(low, route=route)
                try:
                    secs, _ = bench_hybrid.step(low, layout, speed_batch)
                except Exception as e:
                    print(f"   {kind} {layout} ({route}): failed: {type(e).__name__}: {str(e)[:200]}")
                    ok = False
                    secs = float("nan")
                rates.setdefault(f"{layout} {route}" if layout == "packed" else layout, []).append(secs)
        tokens = sum(len(s) for s in speed_batch)
        slots = len(speed_batch) * max(len(s) for s in speed_batch)
        rate = {k: tokens / statistics.median(v[1:] or v) for k, v in rates.items()}
        row: dict[str, Any] = {"family": kind, "tokens": tokens, "bound": slots / tokens, **rate}
        for r in routes:
            row[f"vs_padded {r}"] = rate[f"packed {r}"] / rate["padded"]
            row[f"vs_alone {r}"] = rate[f"packed {r}"] / rate["alone"]
        speed_rows.append(row)
        del fp32, low
        if device == "cuda":
            torch.cuda.empty_cache()
    return exact_rows, speed_rows, ok


def print_hybrid(exact_rows: list[dict], speed_rows: list[dict]) -> None:
    print(
        f"   {'family':11s} {'route':27s} | {'logits':>17s} | {'loss':>17s} | {'grads':>11s} | within 2x"
        f"\n   {'':39s} | {'packed':>8s} {'alone':>8s} | {'packed':>8s} {'alone':>8s} | {'packed/alone':>11s} |"
    )
    for r in exact_rows:
        verdict = "yes" if r["within"] else "NO"
        if "control" not in r["route"]:
            verdict += "" if r["within"] else "  <- should be exact"
        elif not r["judged"]:
            verdict += " (not judged: a short conv's leak is under bf16's rounding)"
        else:
            verdict += "  <- the control should fail" if r["within"] else " (the control fails, as it must)"
        print(
            f"   {r['family']:11s} {r['route']:27s} | {r['logits_packed']:8.2e} {r['logits_alone']:8.2e} | "
            f"{r['loss_packed']:8.2e} {r['loss_alone']:8.2e} | {r['grads_ratio']:11.2f} | "
            f"{verdict}"
        )
    print("\n   real tokens/s, forward + backward, bf16 (packed: one row; padded: one right-padded batch):")
    for r in speed_rows:
        routes = [k.split(" ", 1)[1] for k in r if k.startswith("packed ")]
        print(
            f"   {r['family']:11s} {r['tokens']:,} tokens, slot bound {r['bound']:.2f}x: alone {r['alone']:,.0f}, "
            f"padded {r['padded']:,.0f}, "
            + ", ".join(
                f"packed ({x}) {r[f'packed {x}']:,.0f} = {r[f'vs_padded {x}']:.2f}x padded, "
                f"{r[f'vs_alone {x}']:.2f}x alone"
                for x in routes
            )
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer conversations and steps in the speed parts",
    )
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all, in that order)",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: run the hybrid part on the CPU (torch route only, slow): a smoke test of this script",
    )
    p.add_argument(
        "--hybrid-families",
        default=",".join(HYBRID_FAMILIES),
        help=f"the hybrid part's families (default {','.join(HYBRID_FAMILIES)})",
    )
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if bad := sorted(set(parts) - set(PARTS)):
        p.error(f"unknown parts {bad}: choose from {', '.join(PARTS)}")
    if args.device == "cpu" and parts != ["hybrid"]:
        p.error("--device cpu runs the hybrid part only: add --parts hybrid")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check. "
            "Run it on a GPU machine; the CPU numbers come from benchmarks/bench_train.py and "
            "benchmarks/bench_hybrid.py."
        )
        return 0
    if args.device == "cpu":
        print("gpu_check: hybrid part on the CPU (a smoke test: torch route only, 4 samples, no timing rounds)")
        return hybrid_part(args)
    try:
        import flash_attn

        flash = f"flash-attn {flash_attn.__version__}"
    except ImportError:
        flash = "flash-attn NOT installed: packed rows use sftpack's reference attention on CUDA"
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {flash}")
    ok = True
    if "exactness" in parts:
        ok &= llama_exactness()
    if "train" in parts:
        train_speed(args)
    if "head" in parts:
        ok &= heads()
    if "hybrid" in parts:
        ok &= hybrid_part(args) == 0
    return 0 if ok else 1


def llama_exactness() -> bool:
    print(
        "\n1. bf16 exactness (12 conversations of 16-1023 tokens, Llama dim 256 x 4 layers), errors vs fp32 unpacked:"
    )
    print(f"   {'quantity':8s} {'packed bf16':>12s} {'unpacked bf16':>14s} {'ratio':>7s}")
    ok = True
    for name, packed_err, low_err, ratio in bf16_exactness():
        print(f"   {name:8s} {packed_err:12.3e} {low_err:14.3e} {ratio:7.2f}")
        ok &= ratio <= 2.0 or packed_err <= 1e-6
    print(f"   packed within 2x of the same-precision unpacked error: {ok}")
    return ok


def train_speed(args: argparse.Namespace) -> None:
    print("\n2. training speed, bf16 (benchmarks/bench_train.py):", flush=True)
    import bench_train

    bench_args = [
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--vocab",
        "tokenizer",
        "--dim",
        "512",
        "--layers",
        "8",
        "--heads",
        "8",
        "--kv-heads",
        "4",
        "--threads",
        str(torch.get_num_threads()),
        "--csv",
        str(bench_train.OUT / "gpu_check_train.csv"),
        "--no-results",  # the CPU section of RESULTS.md stays the CPU run's
    ]
    if args.quick:
        bench_args += ["--limit", "300", "--steps", "2"]
    else:
        bench_args += [
            "--limit",
            "2000",
            "--steps",
            "10",
            "--conversations",
            "32",
            "--rows",
            "8",
        ]
    bench_train.main(bench_args)


def heads() -> bool:
    ok = True
    print("\n3. fused output head, bf16, 4,096 rows x width 896 x 151,646 ids, relative errors vs float32:")
    print(f"   {'impl':6s} {'loss':>9s} {'grad h':>9s} {'grad W':>9s} {'fwd+bwd ms':>11s}")
    for r in head_agreement():
        if "error" in r:
            print(f"   {r['impl']:6s} not run: {r['error']}")
            continue
        print(f"   {r['impl']:6s} {r['dloss']:9.2e} {r['dgrad_h']:9.2e} {r['dgrad_w']:9.2e} {r['ms']:11.1f}")
        # bf16 inputs (u = 2**-8): each implementation within a few bf16 roundings of float32
        ok &= max(r["dloss"], r["dgrad_h"], r["dgrad_w"]) <= 4 * 2**-8
    print(f"   every implementation within 4 bf16 roundings (1.6e-2 relative) of float32: {ok}")
    return ok


def hybrid_part(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from sftpack.hybrid import LAYER_KINDS, kernel_route_available

    hf_logging.disable_progress_bar()  # the saves and loads of every model

    installed = ", ".join(
        f"{k.name}: {'installed' if kernel_route_available(k) else 'NOT installed'} ({', '.join(k.kernels)})"
        for k in LAYER_KINDS
        if k.kernels
    )
    print(
        f"\n4. hybrid models (keep_apart), bf16, the small models of benchmarks/bench_hybrid.py; kernels: {installed}."
        "\n   Errors against the float32 per-sample reference: the packed row (each route, and the leaking "
        "control) and each sample alone in bf16; exact when packed is within 2x of alone (as in 1.) for every "
        "sample's logits and every layer's gradient (grads: the worst packed/alone ratio over the layers' "
        "parameters, the embedding and the head left out; the loss is shown, not judged):",
        flush=True,
    )
    families = tuple(x for x in args.hybrid_families.split(",") if x)
    exact_rows, speed_rows, ok = hybrid_check(args.device, families=families, quick=args.quick)
    print_hybrid(exact_rows, speed_rows)
    print(f"   every route within 2x of the per-sample bf16 error, every leaking control outside: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
