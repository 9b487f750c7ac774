"""Peak memory and time of the chunked PyTorch reference of NSA on CPU.

Runs forward + backward of flash_msa.reference.nsa_attention at the NSA defaults
(l=32, d=16, l'=64, n=16, w=512) and reports the peak resident set size of the
process and the peak of tracemalloc-invisible tensor memory as RSS growth.

    python scripts/reference_memory.py --T 32768 --out benchmarks/results/reference_memory_cpu.json
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from flash_msa import reference as R


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--HQ", type=int, default=4)
    ap.add_argument("--HK", type=int, default=1)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    T, HQ, HK, D, l = args.T, args.HQ, args.HK, args.D, 32
    q = torch.randn(1, T, HQ, D, requires_grad=args.backward)
    k = torch.randn(1, T, HK, D, requires_grad=args.backward)
    v = torch.randn(1, T, HK, D, requires_grad=args.backward)
    gates = torch.rand(1, T, HQ, 3)
    w = torch.eye(D).repeat(l, 1).expand(HK, -1, -1).contiguous() / l
    pos = torch.randn(HK, l, D) * 0.1
    inputs_mb = sum(t.numel() * t.element_size() for t in (q, k, v, gates, w, pos, w, pos)) / 2**20
    base = peak_rss_mb()
    t0 = time.perf_counter()
    o = R.nsa_attention(q, k, v, gates, w, pos, w, pos, cu_seqlens=torch.tensor([0, T], dtype=torch.int32))
    if args.backward:
        o.float().square().mean().backward()
    seconds = time.perf_counter() - t0
    peak = peak_rss_mb()
    dense_scores_mb = T * T * HQ * 4 / 2**20
    result = dict(T=T, HQ=HQ, HK=HK, D=D, backward=args.backward, seconds=round(seconds, 1),
                  inputs_mb=round(inputs_mb, 1), rss_before_mb=round(base, 1), peak_rss_mb=round(peak, 1),
                  peak_growth_mb=round(peak - base, 1), dense_fp32_scores_would_be_mb=round(dense_scores_mb, 1),
                  torch=torch.__version__, threads=torch.get_num_threads())
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
