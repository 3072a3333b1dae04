"""GPU check: training speed and bf16 exactness with flash-attn varlen, where CUDA exists.

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

Without CUDA it prints why it did nothing and exits 0 (it must not fail a CPU run).

    python benchmarks/gpu_check.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]


def _unpacked(model, samples, n_labels):
    """Per-conversation logits (fp32 copies) and the summed-loss gradients, each conversation alone."""
    from sftpack.exactness import reference_labels

    model.zero_grad(set_to_none=True)
    logits, total = [], 0.0
    for s in samples:
        ids = torch.as_tensor(s.input_ids, device="cuda")[None]
        out = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        lg = model.lm_head(out)
        lab = reference_labels(s).cuda()
        loss = torch.nn.functional.cross_entropy(lg.float(), lab, ignore_index=-100, reduction="sum") / n_labels
        loss.backward()
        total += float(loss)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer conversations and steps in the speed part",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check. "
            "Run it on a GPU machine; the CPU numbers come from benchmarks/bench_train.py."
        )
        return 0
    try:
        import flash_attn

        flash = f"flash-attn {flash_attn.__version__}"
    except ImportError:
        flash = "flash-attn NOT installed: packed rows use sftpack's reference attention on CUDA"
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {flash}")

    print(
        "\n1. bf16 exactness (12 conversations of 16-1023 tokens, Llama dim 256 x 4 layers), errors vs fp32 unpacked:"
    )
    print(f"   {'quantity':8s} {'packed bf16':>12s} {'unpacked bf16':>14s} {'ratio':>7s}")
    ok = True
    for name, packed_err, low_err, ratio in bf16_exactness():
        print(f"   {name:8s} {packed_err:12.3e} {low_err:14.3e} {ratio:7.2f}")
        ok &= ratio <= 2.0 or packed_err <= 1e-6
    print(f"   packed within 2x of the same-precision unpacked error: {ok}")

    print("\n2. training speed, bf16 (benchmarks/bench_train.py):", flush=True)
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
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
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
