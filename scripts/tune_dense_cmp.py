"""Whole NSA op with compressed attention on cuDNN in 1..16 calls (compression/dense_cmp.py's
memory chunks) against the Triton range kernels, side by side: fwd + bwd ms and peak memory.

    PYTHONPATH=kernels:. python3 scripts/tune_dense_cmp.py --out $OUT [--Ts 65536,262144] [--model llama3_8b]

Writes OUT/tune_dense_cmp_h200.json (benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import bench_nsa as bn  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--Ts", default="65536,262144")
    p.add_argument("--model", default="llama3_8b")
    p.add_argument("--chunks", default="1,2,4,8,16")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=60)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--do-bench-max-t", type=int, default=65536)
    args = p.parse_args()
    import torch
    from flash_msa import nsa_attention
    from flash_msa.compression import dense_cmp
    from flash_msa.utils.validation import trusted_inputs
    HQ, HK, D = bn.MODELS[args.model]
    rows = []
    with trusted_inputs():
        for T in (int(t) for t in args.Ts.split(",")):
            leaves, do = bn.make_inputs(T, HQ, HK, D, "cuda")

            def fwd_bwd():
                return torch.autograd.grad(bn.call_nsa(nsa_attention, leaves, **bn.SIZES, impl="auto"), leaves, do)

            variants = [("triton", None)] + [("cudnn", int(c)) for c in args.chunks.split(",")]
            for backend, chunks in variants:
                dense_cmp.BACKEND, dense_cmp.CHUNKS = backend, chunks
                row = dict(model=args.model, T=T, backend=backend, chunks=chunks,
                           fwd_bwd_ms=bn.timer(fwd_bwd, T, args), peak_mib=bn.peak_mib(fwd_bwd))
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(os.path.join(args.out, "tune_dense_cmp_h200.json"), "w") as f:
                    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
            dense_cmp.BACKEND, dense_cmp.CHUNKS = "auto", None
            del leaves, do
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
