"""Runs the whole NSA op (forward + backward) a few times at one shape, for profilers.

Used by the ``ncu`` stage of scripts/gpu_session.sh: Nsight Compute attaches to this process
and profiles one launch of one kernel (``-k regex:NAME --launch-skip N --launch-count 1``).
With ``--table`` it prints torch.profiler's per-kernel time table of one iteration instead.

Usage (repo root, on the GPU machine):
    PYTHONPATH=kernels:. python scripts/profile_nsa.py [--T 65536] [--model llama3_8b] [--iters 3] [--table] [--by-op]

``--by-op`` prints the PyTorch ops (with their device time) by the Python lines that called them,
which says where each small elementwise kernel of the table comes from.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_nsa import MODELS, SIZES, call_nsa, make_inputs  # noqa: E402


def op_table(events, rows: int = 40) -> str:
    """PyTorch (aten) ops with device time, summed by op and by the repository's innermost three
    calling lines: where each small elementwise kernel of the kernel table comes from."""
    acc = {}
    for e in events:
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if not e.name.startswith("aten::") or t <= 0:
            continue
        frames = [f for f in (e.stack or []) if "flash_msa" in f or "scripts" in f][:3]
        key = (e.name, " < ".join(frames))
        acc.setdefault(key, [0.0, 0])
        acc[key][0] += t
        acc[key][1] += 1
    total = sum(t for t, _ in acc.values())
    lines = [f"aten ops: {total / 1e3:.3f} ms of device time in {sum(c for _, c in acc.values())} calls"]
    for (name, where), (t, c) in sorted(acc.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{t / 1e3:8.3f} ms {c:4d}x  {name:36s} {where}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--model", default="llama3_8b", choices=sorted(MODELS))
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--table", action="store_true", help="print a torch.profiler kernel table of one iteration")
    ap.add_argument("--by-op", action="store_true", help="print the PyTorch ops of one iteration by calling line")
    args = ap.parse_args()
    from flash_msa import nsa_attention
    HQ, HK, D = MODELS[args.model]
    leaves, do = make_inputs(args.T, HQ, HK, D, "cuda")

    def step():
        o = call_nsa(nsa_attention, leaves, **SIZES, impl=args.impl)
        torch.autograd.grad(o, leaves, do)

    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
    if args.table:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    if args.by_op:
        from torch.profiler import ProfilerActivity, profile
        # verbose: the events keep their Python stacks (without it torch 2.11 drops them)
        config = torch._C._profiler._ExperimentalConfig(verbose=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                     experimental_config=config) as prof:
            step()
            torch.cuda.synchronize()
        print(op_table(prof.events()))


if __name__ == "__main__":
    main()
