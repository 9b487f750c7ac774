"""Probe: sliding-window attention on PyTorch's flex_attention against flash_msa's Triton window kernels.

Issue 4 allows flex_attention for the window only if it matches a Triton kernel's speed at 64K.
This times both, side by side in one process on the same inputs (the Llama3-8B head shape: 32
query heads, 8 KV heads, D = 128, bf16, one sequence, w = 512): flash_msa's ``window_attention``
(the range kernels, without the whole op's local blocks) and ``flex_attention`` compiled by
torch.compile with a sliding-window causal ``BlockMask`` and GQA, forward and forward + backward,
timed in the order ours, flex, ours. Before timing, the outputs and gradients of the two are compared
(relative RMS; both are bf16, so a few 1e-3 is rounding). Writes a JSON under --out.

    PYTHONPATH=kernels:. python3 scripts/probe_flex_window.py --out $OUT/flex --Ts 65536,262144
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from flash_msa.utils.compare import rel_rms
from flash_msa.window.window import window_attention


def flex_window(T: int, window: int, device):
    """A compiled flex_attention call with a causal sliding-window BlockMask of T x T, GQA on."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def in_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    # _compile: without it the mask is evaluated on a dense T x T grid (512 GiB at 256K)
    mask = create_block_mask(in_window, B=None, H=None, Q_LEN=T, KV_LEN=T, device=device, _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, scale):  # [T, H, D] -> [1, H, T, D] views and back
        o = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                 block_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    return run


def bench(fn, grads=None):
    return triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=grads, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--Ts", default="65536,262144")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--HQ", type=int, default=32)
    ap.add_argument("--HK", type=int, default=8)
    ap.add_argument("--D", type=int, default=128)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = "cuda"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = []
    for T in [int(x) for x in args.Ts.split(",")]:
        gen = torch.Generator(device=device).manual_seed(0)
        def rnd(*shape):  # random, never zero
            x = torch.randn(*shape, device=device, generator=gen, dtype=torch.bfloat16)
            return x.masked_fill_(x.abs() < 1e-3, 1e-3)
        q = rnd(T, args.HQ, args.D).requires_grad_()
        k = rnd(T, args.HK, args.D).requires_grad_()
        v = rnd(T, args.HK, args.D).requires_grad_()
        do = rnd(T, args.HQ, args.D)
        cu = torch.tensor([0, T], device=device, dtype=torch.int32)
        scale = args.D ** -0.5
        flex = flex_window(T, args.window, device)
        impls = {"triton": lambda: window_attention(q, k, v, cu, args.window, scale),
                 "flex": lambda: flex(q, k, v, scale)}
        got = {}
        for name, fn in impls.items():
            o = fn()
            got[name] = (o.detach(), *torch.autograd.grad(o, (q, k, v), do))
        err = {n: rel_rms(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got["flex"], got["triton"])}
        del got
        row = {"T": T, "HQ": args.HQ, "HK": args.HK, "D": args.D, "window": args.window,
               "flex_vs_triton_rel_rms": err}
        for name in ("triton", "flex", "triton"):
            fn = impls[name]
            with torch.no_grad():
                fwd = bench(fn)
            fb = bench(lambda: fn().backward(do), grads=[q, k, v])
            key = name if name not in row.get("times", {}) else name + "_again"
            row.setdefault("times", {})[key] = {"fwd_ms": fwd, "fwd_bwd_ms": fb}
            print(f"T={T} {key}: forward {fwd:.2f} ms, forward + backward {fb:.2f} ms", flush=True)
        print(f"T={T} flex against triton, relative RMS: "
              + ", ".join(f"{n} {e:.1e}" for n, e in err.items()), flush=True)
        rows.append(row)
        del q, k, v, do, flex
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(os.path.join(args.out, "flex_window.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
