"""Host-side cost of the whole NSA op (forward + backward) on one GPU, side by side in one run.

For each T and variant it reports the device time (``triton.testing.do_bench``, median, the
CPU free to run ahead), the host time to issue one call (``time.perf_counter`` around the call,
no sync inside), the time of one call from an idle GPU (CUDA events around it after a sync:
what a step pays when the host is the bottleneck) and the kernels per call (torch.profiler).

Variants:
  fresh   cu_seqlens=None with a new cu_seqlens tensor made for every call (the default before
          default_cu_seqlens returned one tensor per shape): every per-batch index is rebuilt
  none    cu_seqlens=None as shipped
  packed  an explicit cu_seqlens of 4 equal sequences, the same tensor every call (the trainer's
          case: compressed attention on the range kernels, not cuDNN)

Inputs are trusted (``flash_msa.trusted_inputs``), as in the trainer. ``--cprofile T`` prints the
Python functions with the most host time for the shipped variant at T.

Usage (repo root, on the GPU machine):
    PYTHONPATH=kernels:. python scripts/bench_host.py --out OUTDIR [--Ts 8192,16384,32768,65536]
Writes OUTDIR/nsa_host_h200.{json,md}.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_nsa import MODELS, SIZES, call_nsa, make_inputs, rel_rms  # noqa: E402

VARIANTS = ("fresh", "none", "packed")


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_ms(fn, reps: int = 10) -> tuple[float, float]:
    """Median host time to issue fn, and median event time of fn from an idle GPU."""
    issue, cold = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize()
        issue.append((t1 - t0) * 1e3)
        cold.append(a.elapsed_time(b))
    return sorted(issue)[reps // 2], sorted(cold)[reps // 2]


def fresh_cu(B: int, T: int, device) -> torch.Tensor:
    """The default before: a new cu_seqlens tensor every call."""
    return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)


def measure(T: int, HQ: int, HK: int, D: int, cprofile: bool) -> list:
    from flash_msa import nsa_attention, trusted_inputs
    from flash_msa.utils import varlen
    cached = varlen.default_cu_seqlens
    leaves, do = make_inputs(T, HQ, HK, D, "cuda")
    packed = torch.arange(0, T + 1, T // 4, dtype=torch.int32, device="cuda")
    outs, rows = {}, []
    for variant in VARIANTS:
        kw = {"cu_seqlens": packed} if variant == "packed" else {}

        def step(kw=kw):
            o = call_nsa(nsa_attention, leaves, **SIZES, **kw)
            return o, torch.autograd.grad(o, leaves, do)

        varlen.default_cu_seqlens = fresh_cu if variant == "fresh" else cached
        try:
            with trusted_inputs():
                o, grads = step()
                outs[variant] = [o.detach().float()] + [g.float() for g in grads[:4]]
                del o, grads
                row = {"T": T, "variant": variant}
                row["device_ms"] = triton.testing.do_bench(step, warmup=5, rep=50, return_mode="median")
                row["issue_ms"], row["idle_gpu_ms"] = host_ms(step)
                row["kernels"] = kernels_per_call(step)
                if variant == "none" and cprofile:
                    pr = cProfile.Profile()
                    torch.cuda.synchronize()
                    pr.enable()
                    for _ in range(5):
                        step()
                    pr.disable()
                    torch.cuda.synchronize()
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
                    print(s.getvalue(), flush=True)
        finally:
            varlen.default_cu_seqlens = cached
        if variant == "none":  # the same op: o bit for bit, gradients up to cuDNN's dq order
            row["o_equal_fresh"] = torch.equal(outs["fresh"][0], outs["none"][0])
            row["grad_rel_rms_fresh"] = max(rel_rms(a, b) for a, b in zip(outs["none"][1:], outs["fresh"][1:]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--Ts", default="8192,16384,32768,65536")
    ap.add_argument("--model", default="llama3_8b", choices=sorted(MODELS))
    ap.add_argument("--cprofile", type=int, default=0, help="T at which to print the host-time profile")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    HQ, HK, D = MODELS[args.model]
    rows = []
    for T in (int(t) for t in args.Ts.split(",")):
        rows += measure(T, HQ, HK, D, args.cprofile == T)
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "nsa_host_h200.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "triton": triton.__version__, "model": args.model,
                   "rows": rows}, f, indent=1)
    lines = [f"# Host cost of the whole NSA op, {args.model} shape ({dev}, torch {torch.__version__}, "
             f"triton {triton.__version__}, bf16, forward + backward, trusted inputs)", "",
             "device = do_bench median (host free to run ahead); issue = host time to issue one call; "
             "idle-GPU = one call timed by CUDA events from an idle GPU; kernels = kernels per call.", "",
             "| T | variant | device ms | issue ms | idle-GPU ms | kernels |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['variant']} | {r['device_ms']:.2f} | {r['issue_ms']:.2f} | "
                     f"{r['idle_gpu_ms']:.2f} | {r['kernels']} |")
    with open(os.path.join(args.out, "nsa_host_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
