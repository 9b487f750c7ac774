"""Seconds to build a recipe's model: on the host then moved to the GPU (what the DeepSpeed engine
did before 736fa7e) against built on the GPU (``torch.device`` around ``build_model``, as the
trainer now does under ZeRO 0-2), side by side in one process, alternating, ``--repeat`` times.

Usage (repo root, on the GPU machine):
    PYTHONPATH=kernels:. python scripts/bench_build.py --out OUTDIR [--recipe llama3_8b_64k] \
        [-- model.hf_config.num_hidden_layers=4 ...]
Writes OUTDIR/build_<recipe>_h200.{json,md}.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_once(cfg, where: str) -> float:
    from msa_train.models import build_model

    dtype = torch.bfloat16
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    if where == "gpu":
        with torch.device("cuda"):
            model = build_model(cfg.model, cfg.attention, dtype=dtype)
    else:
        model = build_model(cfg.model, cfg.attention, dtype=dtype).to("cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default="llama3_8b_64k")
    ap.add_argument("--attention", default="fmsa")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_build.py compares building on the host and on a GPU: it needs CUDA")
    from msa_train.cli import compose

    cfg = compose([f"recipe={args.recipe}", "data=generated", f"attention={args.attention}", *args.overrides])
    torch.zeros(1, device="cuda")  # the CUDA context outside the timing
    times = {"host": [], "gpu": []}
    for _ in range(args.repeat):
        for where in ("host", "gpu"):
            times[where].append(build_once(cfg, where))
            print(where, f"{times[where][-1]:.2f} s", flush=True)
    from msa_train.models import count_parameters
    n_params = count_parameters(cfg.model, cfg.attention)[0]
    result = {"recipe": args.recipe, "attention": args.attention, "overrides": args.overrides,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "n_params": n_params,
              "seconds": times, "median_s": {k: statistics.median(v) for k, v in times.items()}}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"build_{args.recipe}_h200")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Building `{args.recipe}` (attention={args.attention}, {' '.join(args.overrides) or 'as is'}) "
             f"on {result['device']}", "",
             f"{n_params / 1e9:.2f}B parameters, bf16, seed of the recipe; seconds from the call to every weight "
             "on the GPU (synchronised), runs alternating.", "",
             "| built | runs (s) | median (s) |", "|---|---|---|"]
    for k, label in (("host", "on the host, then `.to('cuda')`"), ("gpu", "under `torch.device('cuda')`")):
        lines.append(f"| {label} | {', '.join(f'{t:.2f}' for t in times[k])} | {result['median_s'][k]:.2f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
