"""msa_train's fused kernels on the GPU against HF's code and liger-kernel's, side by side.

The ops: RMSNorm, RoPE and SiLU * up (msa_train.models.fused_ops) and the fused linear
cross-entropy of the language-model loss (msa_train.loss). For each model shape and T it checks
every arm against an fp32 reference (relative RMS error <= 5e-3 for ours, else the row is marked
FAILED and the script exits 1 after writing its files), then times forward and forward + backward
with ``triton.testing.do_bench`` (median) on random inputs. liger-kernel's arm runs where the
package imports (scripts/gpu_wheels.sh carries it). Writes ``fused_ops.json`` and ``.md`` to --out (the device
is named in both); ``--table-from fused_ops.json`` rewrites the table of a saved run.

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

try:
    import liger_kernel  # noqa: F401
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    LIGER = getattr(liger_kernel, "__version__", None) or "installed"
except ImportError:
    LIGER = None

SHAPES = {  # hidden, query heads, KV heads, head dim, MLP width, vocabulary
    "llama3_8b": (4096, 32, 8, 128, 14336, 128256),
    "qwen3_14b": (5120, 40, 8, 128, 17408, 151936),
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


def compare(fused, hf, ref, leaves, grads, liger=None):
    """Relative RMS errors of the fused op's, HF's (and liger's) bf16 outputs and gradients against
    ``ref``, the same math in fp32 on fp32 copies of the leaves."""
    grads = grads if isinstance(grads, tuple) else (grads,)
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)  # noqa: E731
    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    out32 = as_tuple(ref(*leaves32))
    grads32 = torch.autograd.grad(out32, leaves32, [g.float() for g in grads])
    check = {}
    for name, fn in (("fused", fused), ("hf", hf), ("liger", liger)):
        if fn is None:
            continue
        try:
            out = as_tuple(fn())
            check[f"{name}_out_err"] = max(rel(a, b) for a, b in zip(out, out32))
            check[f"{name}_grad_err"] = max(rel(a, b) for a, b in zip(torch.autograd.grad(out, leaves, grads), grads32))
        except Exception as e:  # another package's kernel failing is a result to report, not a reason to stop
            if name != "liger":
                raise
            check["liger_error"] = f"{type(e).__name__}: {e}"[:300]
    return check


def timed(check, fused, hf, liger, grads, leaves):
    """Forward and forward + backward medians of each arm that exists and ran in ``check``."""
    times = {}
    for name, fn in (("hf", hf), ("fused", fused), ("liger", liger)):
        if fn is not None and not (name == "liger" and "liger_error" in check):
            try:
                times[f"{name}_fwd_ms"] = bench(fn)
                times[f"{name}_fwd_bwd_ms"] = bench(fn, grads, leaves)
            except Exception as e:
                if name != "liger":
                    raise
                check["liger_error"] = f"{type(e).__name__}: {e}"[:300]
                times.pop("liger_fwd_ms", None)
    return times


def norm_case(T, width, rows_per_token=1):
    norm = LlamaRMSNorm(width, eps=1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    x = torch.randn(1, T, rows_per_token, width, device="cuda", dtype=torch.bfloat16).squeeze(2).requires_grad_()
    dy = torch.randn_like(x)
    hf = lambda: LlamaRMSNorm.forward(norm, x)  # noqa: E731
    fused = lambda: fo._RMSNorm.apply(x, norm.weight, norm)  # noqa: E731
    # liger's RMSNorm with HF Llama's casting, not in place (x is a leaf that the next call reads again)
    liger = (lambda: LigerRMSNormFunction.apply(x, norm.weight, 1e-5, 0.0, "llama", False)) if LIGER else None  # noqa: E731

    def ref(x32, w32):  # HF's arithmetic: the normalised row rounded to bf16 before the weight
        return w32 * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16).float()
    check = compare(fused, hf, ref, (x, norm.weight), dy, liger)
    return check, timed(check, fused, hf, liger, dy, (x, norm.weight))


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
    # liger rotates q and k in place (its output is its input's storage): checked on copies, timed
    # as a model calls it (a rotation keeps the norms, so the repeated rotations time the same)
    liger = (lambda: LigerRopeFunction.apply(q, k, cos, sin)) if LIGER else None  # noqa: E731
    liger_copy = (lambda: LigerRopeFunction.apply(q.clone(), k.clone(), cos, sin)) if LIGER else None  # noqa: E731
    check = compare(fused, hf, ref, (q, k), grads, liger_copy)
    return check, timed(check, fused, hf, liger, grads, (q, k))


def swiglu_case(T, inter):
    """The elementwise part of the MLP on one tile of T tokens (parallel.tile_tokens' tiles)."""
    import torch.nn.functional as F

    g = (2 * torch.randn(1, T, inter, device="cuda")).to(torch.bfloat16).requires_grad_()
    u = torch.randn(1, T, inter, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(u)
    hf = lambda: F.silu(g) * u  # noqa: E731
    fused = lambda: fo._SwiGLU.apply(g, u)  # noqa: E731
    liger = (lambda: LigerSiLUMulFunction.apply(g, u)) if LIGER else None  # noqa: E731
    check = compare(fused, hf, lambda g32, u32: F.silu(g32) * u32, (g, u), dy, liger)
    return check, timed(check, fused, hf, liger, dy, (g, u))


def loss_case(T, hidden, vocab):
    """The language-model loss (summed CE of lm_head(h)) on T tokens: msa_train.loss's fused form
    (4096-token chunks, the trainer's default) against HF's logits + cross_entropy and liger's fused
    linear cross-entropy (reduction="sum")."""
    import torch.nn.functional as F

    from msa_train.loss import chunked_linear_cross_entropy_sum

    head = torch.nn.Linear(hidden, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.normal_(0.0, hidden ** -0.5)
    h = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (T,), device="cuda")
    y[::7] = -100  # some tokens without a label, as packed documents have
    dy = torch.ones((), device="cuda")
    hf = lambda: F.cross_entropy(head(h).float(), y, ignore_index=-100, reduction="sum")  # noqa: E731
    fused = lambda: chunked_linear_cross_entropy_sum(head, h, y, chunk_tokens=4096)  # noqa: E731
    # liger 0.8.5 returns (loss, z_loss, token accuracy, predicted tokens): the loss is the first
    liger = (lambda: LigerFusedLinearCrossEntropyFunction.apply(h, head.weight, y, None, None, -100, 0.0, 0.0,
                                                                 "sum")[0]) if LIGER else None  # noqa: E731
    ref = lambda h32, w32: F.cross_entropy(h32 @ w32.t(), y, ignore_index=-100, reduction="sum")  # noqa: E731
    check = compare(fused, hf, ref, (h, head.weight), dy, liger)
    return check, timed(check, fused, hf, liger, dy, (h, head.weight))


def write_table(rows, device, liger_version, path):
    """The markdown table of the rows (also from a saved JSON: ``--table-from``)."""
    ms = lambda r, k: f"{r[k]:.2f}" if r.get(k) is not None else "n/a"  # noqa: E731
    err = lambda r, a: (f"{max(r[a + '_out_err'], r[a + '_grad_err']):.1e}"  # noqa: E731
                        if f"{a}_out_err" in r and f"{a}_grad_err" in r else "n/a")
    lines = [f"# msa_train's fused kernels against HF's code and liger-kernel {liger_version or '(not installed)'} on "
             f"{device} (bf16, do_bench median ms)", "",
             "ours/liger: liger's forward + backward time over ours (> 1: ours is faster). Errors: relative RMS of "
             "outputs and gradients against the same math in fp32.", "",
             "| model | T | op | HF fwd | ours fwd | liger fwd | HF fwd+bwd | ours fwd+bwd | liger fwd+bwd | ours vs HF | "
             "ours vs liger | error ours | error HF | error liger |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs_liger = f"{r['vs_liger_fwd_bwd']:.2f}x" if r.get("vs_liger_fwd_bwd") is not None else "n/a"
        lines.append(f"| {r['model']} | {r['T']:,} | {r['op']} | {ms(r, 'hf_fwd_ms')} | {ms(r, 'fused_fwd_ms')} | "
                     f"{ms(r, 'liger_fwd_ms')} | {ms(r, 'hf_fwd_bwd_ms')} | {ms(r, 'fused_fwd_bwd_ms')} | "
                     f"{ms(r, 'liger_fwd_bwd_ms')} | {r['speedup_fwd_bwd']:.2f}x | {vs_liger} | "
                     f"{r['max_error']:.1e}{'' if r['ok'] else ' FAILED'} | {err(r, 'hf')} | {err(r, 'liger')} |")
    lines += [f"- liger's arm failed for {r['model']} {r['op']}: {r['liger_error']}" for r in rows if "liger_error" in r]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--Ts", default="65536,262144")
    ap.add_argument("--models", default="llama3_8b,qwen3_14b")
    ap.add_argument("--table-from", help="a saved fused_ops.json: write its table to --out/fused_ops.md, run nothing")
    args = ap.parse_args()
    if args.table_from:
        with open(args.table_from) as f:
            saved = json.load(f)
        write_table(saved["rows"], saved["device"], saved.get("liger_kernel"), os.path.join(args.out, "fused_ops.md"))
        return
    rows = []
    for model in args.models.split(","):
        hidden, hq, hk, d, inter, vocab = SHAPES[model]
        Ts = [int(t) for t in args.Ts.split(",")]
        for T in Ts:
            cases = [("rms_norm (hidden)", lambda: norm_case(T, hidden)), ("rope (q and k)", lambda: rope_case(T, hq, hk, d))]
            if model.startswith("qwen3"):
                cases.append(("rms_norm (per-head q)", lambda: norm_case(T, d, hq)))
            if T == Ts[0]:  # one tile's size, whatever T
                cases.append(("silu * up (32K-token tile)", lambda: swiglu_case(32768, inter)))
                # 16K tokens: HF's arm holds all the logits (and their fp32 copy)
                cases.append(("linear cross-entropy (16K tokens)", lambda: loss_case(16384, hidden, vocab)))
            for op, case in cases:
                check, times = case()
                row = {"model": model, "T": T, "op": op, **check, **times}
                row["speedup_fwd_bwd"] = times["hf_fwd_bwd_ms"] / times["fused_fwd_bwd_ms"]
                # > 1: ours is faster than liger's (issue 46: liger replaces ours where within 5%)
                row["vs_liger_fwd_bwd"] = (times["liger_fwd_bwd_ms"] / times["fused_fwd_bwd_ms"]
                                           if "liger_fwd_bwd_ms" in times else None)
                row["max_error"] = max(check["fused_out_err"], check["fused_grad_err"])
                row["ok"] = row["max_error"] <= 5e-3
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0)
    with open(os.path.join(args.out, "fused_ops.json"), "w") as f:
        json.dump({"device": device, "liger_kernel": LIGER, "torch": torch.__version__, "rows": rows}, f, indent=1)
    write_table(rows, device, LIGER, os.path.join(args.out, "fused_ops.md"))
    if not all(r["ok"] for r in rows):
        raise SystemExit("bench_fused_ops: a kernel is off the fp32 reference by more than 5e-3 (FAILED rows)")


if __name__ == "__main__":
    main()
