"""Runs the whole NSA op (forward + backward) a few times at one shape, for profilers.

Used by the ``ncu`` stage of scripts/gpu_session.sh: Nsight Compute attaches to this process
and profiles one launch of one kernel (``-k regex:NAME --launch-skip N --launch-count 1``).
With ``--table`` it prints torch.profiler's per-kernel time table of one iteration instead.

Usage (repo root, on the GPU machine):
    PYTHONPATH=kernels:. python scripts/profile_nsa.py [--T 65536] [--model llama3_8b] [--iters 3] [--table] [--by-op]

``--by-op`` prints the PyTorch ops (with their device time) by the Python lines that called them,
which says where each small elementwise kernel of the table comes from.

``--gaps`` runs four back-to-back iterations under torch.profiler, as a training step would (inputs
trusted: ``flash_msa.trusted_inputs``), and prints how long the GPU sat idle between kernels in the
last three, and the largest of those gaps with the kernels around them. ``--sync-check`` runs one iteration under
``torch.cuda.set_sync_debug_mode("warn")`` and prints every host sync with the line that made it.
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


def kernel_gaps(trace_path: str, iters: int, skip: int = 0, rows: int = 15) -> str:
    """Idle time of the GPU between the kernels of a chrome trace of ``iters`` iterations of equal
    kernel counts: span (first kernel start to last kernel end), busy time (union of the kernels'
    intervals) and the largest gaps, per iteration, leaving out the first ``skip`` iterations (the
    first starts with the host and the GPU together, so it shows host launch latency that later
    iterations hide)."""
    import json
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    events.sort(key=lambda e: e["ts"])
    events = events[len(events) // iters * skip:]
    iters -= skip
    busy, gaps, end, prev = 0.0, [], None, None
    for e in events:
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        if end is None or t0 >= end:
            if end is not None:
                gaps.append((t0 - end, prev, e["name"]))
            busy += t1 - t0
            end, prev = t1, e["name"]
        elif t1 > end:  # overlapping kernels (another stream)
            busy += t1 - end
            end, prev = t1, e["name"]
    span = end - events[0]["ts"]
    idle = span - busy
    lines = [f"{len(events) / iters:.0f} kernels per iteration; per iteration: span {span / iters / 1e3:.3f} ms, "
             f"busy {busy / iters / 1e3:.3f} ms, idle {idle / iters / 1e3:.3f} ms ({100 * idle / span:.1f}%) in "
             f"{len(gaps) / iters:.0f} gaps"]
    for lo, hi in ((0, 2), (2, 5), (5, 10), (10, 50), (50, 1e12)):
        sel = [g for g, _, _ in gaps if lo <= g < hi]
        lines.append(f"  gaps of {lo}-{hi if hi < 1e12 else 'inf'} us: {len(sel) / iters:.1f} per iteration, "
                     f"{sum(sel) / iters / 1e3:.3f} ms")
    lines.append(f"largest {rows} gaps (us, kernel before -> kernel after):")
    for g, a, b in sorted(gaps, key=lambda x: -x[0])[:rows]:
        lines.append(f"  {g:8.1f}  {a[:60]} -> {b[:60]}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--model", default="llama3_8b", choices=sorted(MODELS))
    ap.add_argument("--impl", default="auto", choices=("auto", "fmsa", "qc", "reference"))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--table", action="store_true", help="print a torch.profiler kernel table of one iteration")
    ap.add_argument("--by-op", action="store_true", help="print the PyTorch ops of one iteration by calling line")
    ap.add_argument("--gaps", action="store_true", help="print the GPU's idle time between kernels")
    ap.add_argument("--sync-check", action="store_true", help="print the host syncs of one iteration")
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
    if args.gaps or args.sync_check:
        import tempfile
        import warnings
        from flash_msa import trusted_inputs
        from torch.profiler import ProfilerActivity, profile
        with trusted_inputs():
            step()  # warm: the trusted path's first call
            torch.cuda.synchronize()
            if args.gaps:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(4):
                        step()
                    torch.cuda.synchronize()
                with tempfile.TemporaryDirectory() as tmp:
                    prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
                    print(kernel_gaps(os.path.join(tmp, "trace.json"), 4, skip=1))
            if args.sync_check:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.synchronize()
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                print(f"host syncs in one trusted forward + backward: {len(syncs)}")
                for w in syncs:
                    print(f"  {w.filename}:{w.lineno}: {str(w.message)[:120]}")


if __name__ == "__main__":
    main()
