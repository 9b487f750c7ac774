"""NSA decoding with a KV cache on the GPU (flash_msa/decode/): correctness and time per token.

1. Rows: NativeSparseAttention (Llama3-8B shape: HQ 32, HK 8, D 128, NSA defaults, bf16) at T
   tokens; decode() of the last Tq rows, by the Triton kernel and by PyTorch, against the whole op
   on the Triton kernels (fmsa), and the two decode paths against each other (relative RMS).
2. Time per decoded token for one layer at Tk keys (do_bench median, random data, K/V in HF's cache
   layout [B, HK, Tk, D]), side by side: PyTorch decoding without a DecodeCache (phi over all keys
   every step), the Triton kernel without one, with one holding every compressed row (a step that
   completes no block, 15 of 16), and with one lacking the newest row (the step that completes a
   block); SDPA dense decoding (GQA) beside them. Each is timed twice: do_bench's median of GPU events,
   and the wall time per call of back-to-back calls (host included: one decoded token is host bound).
   Timing stops at the first failed check.

    python scripts/decode_gpu.py --out benchmarks/results/decode/latest.json --profile benchmarks/results/decode/profile.txt
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flash_msa import NativeSparseAttention
from flash_msa.decode import DecodeCache


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


def wall_ms(fn, calls=50, repeats=5):
    """Median over repeats of the wall time per call of `calls` back-to-back calls, synchronised at the
    end: the host's time to issue a step counts, as in a decoding loop (do_bench times the GPU's events)."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return sorted(times)[len(times) // 2]


def time_step(nsa, B, Tk, H, HQ, HK, D, dev, dt):
    """ms per decoded token and layer for each path at Tk cached keys and a batch of B."""
    h1 = torch.randn(B, 1, H, device=dev, dtype=dt)
    q1 = torch.randn(B, 1, HQ, D, device=dev, dtype=dt)
    kk, vv = (torch.randn(B, HK, Tk, D, device=dev, dtype=dt).transpose(1, 2) for _ in range(2))  # [B, Tk, HK, D]
    full = DecodeCache()
    nsa.decode(h1, q1, kk, vv, cache=full)  # every compressed row
    lacking = DecodeCache()

    def completes_a_block():
        lacking.k_cmp, lacking.v_cmp = full.k_cmp[:, :-1], full.v_cmp[:, :-1]
        return nsa.decode(h1, q1, kk, vv, cache=lacking)

    qd, kd, vd = q1.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
    paths = {"triton_cache": lambda: nsa.decode(h1, q1, kk, vv, cache=full),
             "triton_cache_block_completes": completes_a_block,
             "sdpa_dense": lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)}
    if B == 1:
        paths = {"torch_no_cache": lambda: nsa.decode(h1, q1, kk, vv, impl="torch"),
                 "triton_no_cache": lambda: nsa.decode(h1, q1, kk, vv, impl="triton"), **paths}
    row = {"B": B, "Tk": Tk}
    for name, fn in paths.items():
        row[f"{name}_ms"] = do_bench(fn)
    for name, fn in paths.items():  # back-to-back calls as a decoding loop issues them (host time included)
        row[f"{name}_wall_ms"] = wall_ms(fn)
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return row, (h1, q1, kk, vv, full)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--check-T", type=int, default=8192)
    ap.add_argument("--Tks", default="8192,65536,262144,1048576")
    ap.add_argument("--batch-Tk", type=int, default=65536, help="also time a batch of --batch sequences at this Tk")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of decode calls here")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    HQ, HK, D, H = 32, 8, 128, 4096
    torch.manual_seed(0)
    nsa = NativeSparseAttention(H, HQ, HK, D, impl="fmsa", device=dev, dtype=dt)
    with torch.no_grad():
        for p in nsa.parameters():
            p.add_(0.02 * torch.randn_like(p))
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": dict(HQ=HQ, HK=HK, D=D, **nsa.sizes), "check": [], "time": []}
    T = args.check_T
    hidden = torch.randn(1, T, H, device=dev, dtype=dt)
    q, k, v = (torch.randn(1, T, h, D, device=dev, dtype=dt) for h in (HQ, HK, HK))
    ok = True
    with torch.no_grad():
        whole = nsa(hidden, q, k, v)
        for Tq in (1, 7, 64):
            rows = {impl: nsa.decode(hidden[:, T - Tq:], q[:, T - Tq:], k, v, impl=impl) for impl in ("triton", "torch")}
            check = {"T": T, "Tq": Tq, "rel_rms": rel_rms(rows["triton"], whole[:, T - Tq:]),
                     "torch_rel_rms": rel_rms(rows["torch"], whole[:, T - Tq:]),
                     "triton_vs_torch_rel_rms": rel_rms(rows["triton"], rows["torch"])}
            out["check"].append(check)
            ok &= max(check["rel_rms"], check["triton_vs_torch_rel_rms"]) <= 5e-3
            print(f"rows T={T} Tq={Tq}: triton {check['rel_rms']:.2e}, torch {check['torch_rel_rms']:.2e} against the "
                  f"whole op; triton against torch {check['triton_vs_torch_rel_rms']:.2e}", flush=True)
        out["ok"] = ok
        if not ok:
            print("check failed: no timing", flush=True)
        else:
            for Tk in map(int, args.Tks.split(",")):
                out["time"].append(time_step(nsa, 1, Tk, H, HQ, HK, D, dev, dt)[0])
            if args.batch > 1:
                out["time"].append(time_step(nsa, args.batch, args.batch_Tk, H, HQ, HK, D, dev, dt)[0])
        if ok and args.profile:  # where one decoded token's time goes, with a full DecodeCache
            _, (h1, q1, kk, vv, full) = time_step(nsa, 1, 65536, H, HQ, HK, D, dev, dt)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    nsa.decode(h1, q1, kk, vv, cache=full)
                torch.cuda.synchronize()
            ev = prof.key_averages()
            launches = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
            table = (f"profile, 10 decode calls (Triton kernel, full DecodeCache) at Tk=65536: {launches / 10:.0f} GPU "
                     f"kernels and copies per call\nby GPU time:\n{ev.table(sort_by='cuda_time_total', row_limit=15)}\n"
                     f"by CPU time (self):\n{ev.table(sort_by='self_cpu_time_total', row_limit=15)}")
            print(table, flush=True)
            with open(args.profile, "w") as f:
                f.write(table)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
