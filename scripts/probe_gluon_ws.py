"""Probe: fmsa forward + backward with the dk/dv kernel in Gluon with warp specialization
(selection/fmsa_gluon_ws.py) against the shipped Triton kernel, side by side in one run on the H200.

    PYTHONPATH=kernels:. python3 scripts/probe_gluon_ws.py --out $OUT/gws

Each variant's o, dq, dk, dv are checked against the first (Triton) run before timing (do_bench median).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--Gs", default="4,5")
    ap.add_argument("--profile", action="store_true", help="also print a kernel table of one forward + backward per variant")
    ap.add_argument("--variants", default="", help="extra module globals of fmsa_gluon_ws, e.g. 'NBUF=2,PRODUCER_REGS=24;...'")
    args = ap.parse_args()
    from bench_selected import IMPLS, make_inputs
    from flash_msa.selection import fmsa, fmsa_gluon_ws as W
    from flash_msa.utils.compare import rel_rms
    from flash_msa.utils.varlen import default_cu_seqlens
    os.makedirs(args.out, exist_ok=True)
    T, D, S, bs = args.T, 128, 16, 64
    extra = [dict(kv.split("=") for kv in v.split(",")) for v in args.variants.split(";") if v]
    base = {n: getattr(W, n) for n in ("NBUF", "SUB", "PW", "PRODUCER_REGS", "MAXNREG")}
    rows = []
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    for G in (int(g) for g in args.Gs.split(",")):
        q, k, v, do, bi = make_inputs(T, 8, G, D, S, bs, "cuda")
        cu = default_cu_seqlens(1, T, "cuda")
        ref = None
        for var in [{}, {"WS": True}, *[{"WS": True, **e} for e in extra], {}, {"WS": True}]:
            fmsa.BWD_GLUON_WS = bool(var.get("WS"))
            for n, x in base.items():
                setattr(W, n, int(var.get(n, x)))
            run = lambda: IMPLS["fmsa"](q, k, v, bi, bs, cu, D ** -0.5)
            fb = lambda: run().backward(do)
            try:
                o = run()
                got = (o, *torch.autograd.grad(o, (q, k, v), do))
                ref = got if ref is None else ref
                err = {n: rel_rms(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}
                ms = triton.testing.do_bench(fb, warmup=5, rep=30, grad_to_none=[q, k, v], return_mode="median")
                r = dict(G=G, variant=var, ms=ms, err=err)
                if args.profile:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        fb()
                        torch.cuda.synchronize()
                    r["kernels_ms"] = {e.key: round(e.device_time_total / 1e3, 3) for e in prof.key_averages()
                                       if e.device_time_total > 100}
                    q.grad = k.grad = v.grad = None
            except Exception as e:
                r = dict(G=G, variant=var, ms=None, error=f"{type(e).__name__}: {str(e)[:400]}")
            rows.append(r)
            print(r, flush=True)
        fmsa.BWD_GLUON_WS = False
        for n, x in base.items():
            setattr(W, n, x)
        del q, k, v, do, bi
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "probe_gluon_ws.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
