"""Probe: Triton's automatic warp specialization (``tl.range(..., warp_specialize=True)``) on the
H200, for the window kernels (as the whole op runs them, with selected attention's local blocks)
and for fmsa's dk/dv loop, side by side with the shipped launches in one run.

    PYTHONPATH=kernels:. python3 scripts/probe_ws.py --out $OUT/ws

Each variant is checked against the shipped launch's outputs before it is timed (do_bench
median); a variant that does not compile is reported, not fatal.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_nsa  # noqa: E402
from tune_nsa import cfg  # noqa: E402


def window_probe(args, rows):
    from flash_msa.window.window import local_ranges, window_ranges
    tune_nsa.RANGE_CANDIDATES = {
        "fwd": [cfg(128, 32, 4, 3), cfg(128, 32, 4, 3, WS=True), cfg(128, 64, 4, 3, WS=True),
                cfg(128, 64, 8, 2, WS=True), cfg(128, 128, 8, 2, WS=True), cfg(128, 32, 4, 3)],
        "dq": [cfg(64, 64, 4, 2), cfg(64, 64, 4, 2, WS=True), cfg(128, 64, 8, 2, WS=True),
               cfg(64, 64, 4, 3, WS=True), cfg(64, 64, 4, 2)],
        "dkdv": [cfg(64, 64, 4, 2), cfg(64, 64, 4, 2, WS=True), cfg(128, 64, 8, 2, WS=True),
                 cfg(64, 64, 4, 3, WS=True), cfg(64, 64, 4, 2)],
    }
    HQ, HK, D = tune_nsa.MODELS["llama3_8b"]
    T = args.T
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (tune_nsa.rnd(gen, T, h, D) for h in (HQ, HK, HK, HQ))
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")

    def emit(r):
        r.update(model="llama3_8b", T=T)
        rows.append(r)
        print(f"window_local T={T} {r['op']:<18} {r['config']:<40} "
              + (f"{r['ms']:8.3f} ms" if r.get("ms") is not None else "       -    ")
              + (f" err {r['err']:.1e}" if r.get("err") is not None else "")
              + (f" {r['error']}" if "error" in r else ""), flush=True)

    tune_nsa.sweep_range("window", q, k, v, do, window_ranges(cu, T, tune_nsa.WINDOW), D ** -0.5, args, emit,
                         local=local_ranges(cu, T, tune_nsa.SLC))


def fmsa_probe(args, rows):
    from bench_selected import IMPLS, make_inputs
    from flash_msa.selection import fmsa
    from flash_msa.utils.compare import rel_rms
    from flash_msa.utils.varlen import default_cu_seqlens
    T, D, S, bs = args.T, 128, 16, 64
    for G in (4, 5):
        q, k, v, do, bi = make_inputs(T, 8, G, D, S, bs, "cuda")
        cu = default_cu_seqlens(1, T, "cuda")
        ref = None
        for ws in (False, True, False):
            fmsa.BWD_WS = ws
            run = lambda: IMPLS["fmsa"](q, k, v, bi, bs, cu, D ** -0.5)
            fb = lambda: run().backward(do)
            try:
                o = run()
                got = (o, *torch.autograd.grad(o, (q, k, v), do))
                ref = got if ref is None else ref
                err = max(rel_rms(a, b) for a, b in zip(got, ref))
                ms = triton.testing.do_bench(fb, warmup=5, rep=20, grad_to_none=[q, k, v], return_mode="median")
                r = dict(op="fmsa_fwd+bwd", G=G, BWD_WS=ws, ms=ms, err=err)
            except Exception as e:
                r = dict(op="fmsa_fwd+bwd", G=G, BWD_WS=ws, ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(r)
            print(r, flush=True)
        fmsa.BWD_WS = False
        del q, k, v, do, bi
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--parts", default="window,fmsa")
    ap.add_argument("--range-kernels", default="fwd,dq,dkdv")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=50)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if "window" in args.parts:
        window_probe(args, rows)
    if "fmsa" in args.parts:
        fmsa_probe(args, rows)
    with open(os.path.join(args.out, "probe_ws.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
