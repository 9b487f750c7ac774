"""parallel.fused_ops on the GPU: HF's RMSNorm and RoPE against msa_train's kernels, side by side.

For each model shape and T it checks the kernels against HF's bf16 code and an fp32 reference,
then times forward and forward + backward of both with ``triton.testing.do_bench`` (median) on
random inputs. Writes ``fused_ops_h200.json`` and ``.md`` to --out.

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

SHAPES = {  # hidden, query heads, KV heads, head dim
    "llama3_8b": (4096, 32, 8, 128),
    "qwen3_14b": (5120, 40, 8, 128),
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench(fn, grads=None, leaves=()):
    """Median ms of fn() (no autograd), or of fn() and its backward with ``grads`` (the leaves'
    gradients reset between runs, so no accumulation is timed)."""
    from triton.testing import do_bench

    if grads is None:
        with torch.no_grad():
            return do_bench(fn, warmup=5, rep=40)

    def step():
        torch.autograd.backward(fn(), grads)
    return do_bench(step, warmup=5, rep=40, grad_to_none=list(leaves))


def norm_case(T, width, rows_per_token=1):
    norm = LlamaRMSNorm(width, eps=1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    x = torch.randn(1, T, rows_per_token, width, device="cuda", dtype=torch.bfloat16).squeeze(2).requires_grad_()
    g = torch.randn_like(x)
    hf = lambda: LlamaRMSNorm.forward(norm, x)  # noqa: E731
    fused = lambda: fo._RMSNorm.apply(x, norm.weight, norm)  # noqa: E731
    y, y_hf = fused(), hf()
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16).float() * norm.weight.float()
    dx, dw = torch.autograd.grad(y, (x, norm.weight), g)
    dx_hf, dw_hf = torch.autograd.grad(y_hf, (x, norm.weight), g)
    check = {"y_vs_fp32": rel(y, ref), "y_hf_vs_fp32": rel(y_hf, ref), "dx_vs_hf": rel(dx, dx_hf), "dw_vs_hf": rel(dw, dw_hf)}
    del y, y_hf, dx, dw, dx_hf, dw_hf, ref
    times = {"hf_fwd_ms": bench(hf), "fused_fwd_ms": bench(fused)}
    leaves = (x, norm.weight)
    times.update(hf_fwd_bwd_ms=bench(hf, g, leaves), fused_fwd_bwd_ms=bench(fused, g, leaves))
    return check, times


def rope_case(T, hq, hk, d):
    q = torch.randn(1, T, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(1, T, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    emb = torch.cat([torch.arange(T, device="cuda")[:, None].float() * inv] * 2, -1)[None]
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    hf_apply = modeling_llama.apply_rotary_pos_emb
    hf_apply = getattr(hf_apply, "__wrapped__", hf_apply)
    fused_apply = fo.rope_dispatcher(hf_apply)
    cos_t, sin_t = cos.clone(), sin.clone()
    for t in (cos_t, sin_t):
        setattr(t, fo._TAG, True)
    hf = lambda: hf_apply(q, k, cos, sin)  # noqa: E731
    fused = lambda: fused_apply(q, k, cos_t, sin_t)  # noqa: E731
    (qf, kf), (qh, kh) = fused(), hf()
    q32, k32 = hf_apply(q.float(), k.float(), cos.float(), sin.float())
    gq, gk = torch.randn_like(qh), torch.randn_like(kh)
    dq, dk = torch.autograd.grad((qf, kf), (q, k), (gq, gk))
    dqh, dkh = torch.autograd.grad((qh, kh), (q, k), (gq, gk))
    check = {"q_vs_fp32": rel(qf, q32), "q_hf_vs_fp32": rel(qh, q32), "k_vs_fp32": rel(kf, k32),
             "dq_vs_hf": rel(dq, dqh), "dk_vs_hf": rel(dk, dkh)}
    del qf, kf, qh, kh, q32, k32, dq, dk, dqh, dkh
    times = {"hf_fwd_ms": bench(hf), "fused_fwd_ms": bench(fused)}
    times.update(hf_fwd_bwd_ms=bench(hf, (gq, gk), (q, k)), fused_fwd_bwd_ms=bench(fused, (gq, gk), (q, k)))
    return check, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--Ts", default="65536,262144")
    ap.add_argument("--models", default="llama3_8b,qwen3_14b")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        hidden, hq, hk, d = SHAPES[model]
        for T in (int(t) for t in args.Ts.split(",")):
            cases = [("rms_norm (hidden)", lambda: norm_case(T, hidden)), ("rope (q and k)", lambda: rope_case(T, hq, hk, d))]
            if model.startswith("qwen3"):
                cases.append(("rms_norm (per-head q)", lambda: norm_case(T, d, hq)))
            for op, case in cases:
                check, times = case()
                row = {"model": model, "T": T, "op": op, **check, **times}
                row["speedup_fwd_bwd"] = times["hf_fwd_bwd_ms"] / times["fused_fwd_bwd_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0)
    with open(os.path.join(args.out, "fused_ops_h200.json"), "w") as f:
        json.dump({"device": device, "rows": rows}, f, indent=1)
    lines = [f"# parallel.fused_ops kernels against HF's code on {device} (bf16, do_bench median ms)", "",
             "| model | T | op | HF fwd | fused fwd | HF fwd+bwd | fused fwd+bwd | speedup | max rel. error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = max(v for k, v in r.items() if k.endswith(("_vs_fp32", "_vs_hf")) and "_hf_vs" not in k)
        lines.append(f"| {r['model']} | {r['T']:,} | {r['op']} | {r['hf_fwd_ms']:.2f} | {r['fused_fwd_ms']:.2f} | "
                     f"{r['hf_fwd_bwd_ms']:.2f} | {r['fused_fwd_bwd_ms']:.2f} | {r['speedup_fwd_bwd']:.2f}x | {err:.1e} |")
    with open(os.path.join(args.out, "fused_ops_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
