"""parallel.fused_ops on the GPU: HF's RMSNorm, RoPE and SiLU * up against msa_train's kernels, side by side.

For each model shape and T it checks the kernels against HF's bf16 code and an fp32 reference
(relative RMS error <= 5e-3, else the row is marked FAILED and the script exits 1 after writing its
files), then times forward and forward + backward of both with ``triton.testing.do_bench``
(median) on random inputs. Writes ``fused_ops_h200.json`` and ``.md`` to --out.

    python scripts/bench_fused_ops.py --out $OUT [--Ts 65536,262144]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from msa_train.models import fused_ops as fo

SHAPES = {  # hidden, query heads, KV heads, head dim, MLP width
    "llama3_8b": (4096, 32, 8, 128, 14336),
    "qwen3_14b": (5120, 40, 8, 128, 17408),
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench(fn, grads=None, leaves=()):
    """Median ms of fn() (no autograd), or of fn() and its backward with ``grads`` (the leaves'
    gradients reset between runs, so no accumulation is timed)."""
    from triton.testing import do_bench

    if grads is None:
        with torch.no_grad():
            return do_bench(fn, warmup=25, rep=200, return_mode="median")

    def step():
        torch.autograd.backward(fn(), grads)
    return do_bench(step, warmup=25, rep=200, grad_to_none=list(leaves), return_mode="median")


def compare(fused, hf, ref, leaves, grads):
    """Relative RMS errors of the fused op's and HF's bf16 outputs and gradients against ``ref``, the
    same math in fp32 on fp32 copies of the leaves."""
    grads = grads if isinstance(grads, tuple) else (grads,)
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)  # noqa: E731
    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    out32 = as_tuple(ref(*leaves32))
    grads32 = torch.autograd.grad(out32, leaves32, [g.float() for g in grads])
    check = {}
    for name, fn in (("fused", fused), ("hf", hf)):
        out = as_tuple(fn())
        check[f"{name}_out_err"] = max(rel(a, b) for a, b in zip(out, out32))
        check[f"{name}_grad_err"] = max(rel(a, b) for a, b in zip(torch.autograd.grad(out, leaves, grads), grads32))
    return check


def norm_case(T, width, rows_per_token=1):
    norm = LlamaRMSNorm(width, eps=1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    x = torch.randn(1, T, rows_per_token, width, device="cuda", dtype=torch.bfloat16).squeeze(2).requires_grad_()
    dy = torch.randn_like(x)
    hf = lambda: LlamaRMSNorm.forward(norm, x)  # noqa: E731
    fused = lambda: fo._RMSNorm.apply(x, norm.weight, norm)  # noqa: E731

    def ref(x32, w32):  # HF's arithmetic: the normalised row rounded to bf16 before the weight
        return w32 * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16).float()
    check = compare(fused, hf, ref, (x, norm.weight), dy)
    leaves = (x, norm.weight)
    times = {"hf_fwd_ms": bench(hf), "fused_fwd_ms": bench(fused)}
    times.update(hf_fwd_bwd_ms=bench(hf, dy, leaves), fused_fwd_bwd_ms=bench(fused, dy, leaves))
    return check, times


def rope_case(T, hq, hk, d):
    q = torch.randn(1, T, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(1, T, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    emb = torch.cat([torch.arange(T, device="cuda")[:, None].float() * inv] * 2, -1)[None]
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    hf_apply = modeling_llama.apply_rotary_pos_emb
    hf_apply = getattr(hf_apply, "__wrapped__", hf_apply)
    dispatch = fo.rope_dispatcher(hf_apply)

    def fused():  # as called from a patched attention module
        token = fo._FUSE_ROPE.set(True)
        try:
            return dispatch(q, k, cos, sin)
        finally:
            fo._FUSE_ROPE.reset(token)

    token = fo._FUSE_ROPE.set(True)
    try:  # what is timed is the kernel, not HF's code again
        assert fo._fusable_rope(q, k, cos, sin, 1), "bench_fused_ops: the RoPE case would run HF's code"
    finally:
        fo._FUSE_ROPE.reset(token)
    hf = lambda: hf_apply(q, k, cos, sin)  # noqa: E731
    ref = lambda q32, k32: hf_apply(q32, k32, cos.float(), sin.float())  # noqa: E731
    grads = (torch.randn_like(q), torch.randn_like(k))
    check = compare(fused, hf, ref, (q, k), grads)
    times = {"hf_fwd_ms": bench(hf), "fused_fwd_ms": bench(fused)}
    times.update(hf_fwd_bwd_ms=bench(hf, grads, (q, k)), fused_fwd_bwd_ms=bench(fused, grads, (q, k)))
    return check, times


def swiglu_case(T, inter):
    """The elementwise part of the MLP on one tile of T tokens (parallel.tile_tokens' tiles)."""
    import torch.nn.functional as F

    g = (2 * torch.randn(1, T, inter, device="cuda")).to(torch.bfloat16).requires_grad_()
    u = torch.randn(1, T, inter, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(u)
    hf = lambda: F.silu(g) * u  # noqa: E731
    fused = lambda: fo._SwiGLU.apply(g, u)  # noqa: E731
    check = compare(fused, hf, lambda g32, u32: F.silu(g32) * u32, (g, u), dy)
    times = {"hf_fwd_ms": bench(hf), "fused_fwd_ms": bench(fused)}
    times.update(hf_fwd_bwd_ms=bench(hf, dy, (g, u)), fused_fwd_bwd_ms=bench(fused, dy, (g, u)))
    return check, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--Ts", default="65536,262144")
    ap.add_argument("--models", default="llama3_8b,qwen3_14b")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        hidden, hq, hk, d, inter = SHAPES[model]
        Ts = [int(t) for t in args.Ts.split(",")]
        for T in Ts:
            cases = [("rms_norm (hidden)", lambda: norm_case(T, hidden)), ("rope (q and k)", lambda: rope_case(T, hq, hk, d))]
            if model.startswith("qwen3"):
                cases.append(("rms_norm (per-head q)", lambda: norm_case(T, d, hq)))
            if T == Ts[0]:  # one tile's size, whatever T
                cases.append(("silu * up (32K-token tile)", lambda: swiglu_case(32768, inter)))
            for op, case in cases:
                check, times = case()
                row = {"model": model, "T": T, "op": op, **check, **times}
                row["speedup_fwd_bwd"] = times["hf_fwd_bwd_ms"] / times["fused_fwd_bwd_ms"]
                row["max_error"] = max(check["fused_out_err"], check["fused_grad_err"])
                row["ok"] = row["max_error"] <= 5e-3
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0)
    with open(os.path.join(args.out, "fused_ops_h200.json"), "w") as f:
        json.dump({"device": device, "rows": rows}, f, indent=1)
    lines = [f"# parallel.fused_ops kernels against HF's code on {device} (bf16, do_bench median ms)", "",
             "Errors: relative RMS of outputs and gradients against the same math in fp32 (fused; HF's bf16 code).", "",
             "| model | T | op | HF fwd | fused fwd | HF fwd+bwd | fused fwd+bwd | speedup | error fused | error HF |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['T']:,} | {r['op']} | {r['hf_fwd_ms']:.2f} | {r['fused_fwd_ms']:.2f} | "
                     f"{r['hf_fwd_bwd_ms']:.2f} | {r['fused_fwd_bwd_ms']:.2f} | {r['speedup_fwd_bwd']:.2f}x | "
                     f"{r['max_error']:.1e}{'' if r['ok'] else ' FAILED'} | "
                     f"{max(r['hf_out_err'], r['hf_grad_err']):.1e} |")
    with open(os.path.join(args.out, "fused_ops_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all(r["ok"] for r in rows):
        raise SystemExit("bench_fused_ops: a kernel is off the fp32 reference by more than 5e-3 (FAILED rows)")


if __name__ == "__main__":
    main()
