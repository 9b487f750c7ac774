"""NSA decoding with a KV cache on the GPU (flash_msa/decode.py): correctness and time per token.

1. Rows: NativeSparseAttention (Llama3-8B shape: HQ 32, HK 8, D 128, NSA defaults, bf16) at T
   tokens; decode() of the last Tq rows against the whole op on the Triton kernels (fmsa); relative
   RMS error of the rows.
2. Time per decoded token for one layer at Tk keys (do_bench median, random data): nsa.decode of
   one query against SDPA dense decoding of one query (cuDNN/flash, GQA expanded).

    python scripts/decode_gpu.py --out benchmarks/results/decode_h200.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flash_msa import NativeSparseAttention


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--check-T", type=int, default=8192)
    ap.add_argument("--Tks", default="8192,65536,262144")
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of decode calls here")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    HQ, HK, D, H = 32, 8, 128, 4096
    torch.manual_seed(0)
    nsa = NativeSparseAttention(H, HQ, HK, D, impl="fmsa", device=dev, dtype=dt)
    with torch.no_grad():
        for p in nsa.parameters():
            p.add_(0.02 * torch.randn_like(p))
    out = {"gpu": torch.cuda.get_device_name(), "shape": dict(HQ=HQ, HK=HK, D=D, **nsa.sizes), "check": [], "time": []}
    T = args.check_T
    hidden = torch.randn(1, T, H, device=dev, dtype=dt)
    q, k, v = (torch.randn(1, T, h, D, device=dev, dtype=dt) for h in (HQ, HK, HK))
    with torch.no_grad():
        whole = nsa(hidden, q, k, v)
        for Tq in (1, 7, 64):
            rows = nsa.decode(hidden[:, T - Tq:], q[:, T - Tq:], k, v)
            err = rel_rms(rows, whole[:, T - Tq:])
            out["check"].append({"T": T, "Tq": Tq, "rel_rms": err})
            print(f"rows T={T} Tq={Tq}: rel RMS {err:.2e}", flush=True)
        for Tk in map(int, args.Tks.split(",")):
            h1 = torch.randn(1, 1, H, device=dev, dtype=dt)
            q1 = torch.randn(1, 1, HQ, D, device=dev, dtype=dt)
            kk, vv = (torch.randn(1, Tk, HK, D, device=dev, dtype=dt) for _ in range(2))
            t_nsa = do_bench(lambda: nsa.decode(h1, q1, kk, vv))
            qd, kd, vd = q1.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
            t_dense = do_bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
            out["time"].append({"Tk": Tk, "nsa_decode_ms": t_nsa, "sdpa_decode_ms": t_dense})
            print(f"Tk={Tk}: nsa.decode {t_nsa:.3f} ms, SDPA dense {t_dense:.3f} ms per token per layer", flush=True)
        if args.profile:  # where one decoded token's time goes, at the middle length
            Tk = int(args.Tks.split(",")[len(args.Tks.split(",")) // 2])
            kk, vv = (torch.randn(1, Tk, HK, D, device=dev, dtype=dt) for _ in range(2))
            for _ in range(3):
                nsa.decode(h1, q1, kk, vv)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    nsa.decode(h1, q1, kk, vv)
                torch.cuda.synchronize()
            ev = prof.key_averages()
            launches = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
            table = (f"profile, 10 decode calls at Tk={Tk}: {launches / 10:.0f} GPU kernels and copies per call\n"
                     f"by GPU time:\n{ev.table(sort_by='cuda_time_total', row_limit=25)}\n"
                     f"by CPU time (self):\n{ev.table(sort_by='self_cpu_time_total', row_limit=25)}")
            print(table, flush=True)
            with open(args.profile, "w") as f:
                f.write(table)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
