"""End-to-end training throughput: one recipe under attention=full|nsa|fmsa over sequence lengths.

    python -m msa_train.bench --recipe tiny --attention full,nsa,fmsa --seq-lens 512,1024 --steps 6
    python -m msa_train.bench --recipe llama3_8b_64k --seq-lens 65536,131072,262144 -- data=generated model.path=...

Every (attention, seq_len) point is a fresh ``msa-train`` process (no state shared between points)
with the given recipe, on the generated corpus with documents as long as the sequence unless
other data overrides follow ``--``. Tokens/s is the mean over the steps after ``--warmup``.
Writes ``<out>.json``, a markdown table beside it, and a PNG (tokens/s and speedup over
attention=full) when matplotlib is installed; ``--out`` defaults to ``runs/bench/e2e_<recipe>_<device>``
under the working directory (never the source tree). Each point says what ran: the device, the
dense kernel of attention=full, and whether nsa/fmsa ran their Triton kernels or, off CUDA, the
PyTorch reference.

Subcommands (msa_train/bench_report.py): ``report`` (the full-depth end-to-end grid, resumable),
``longest`` (the longest trainable sequence), ``plan-check`` (the memory planner against measured peaks).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from msa_train.metrics import profile_table
from msa_train.bench_points import (PHASES, _oom, default_stem, memory_label, phase_means, run_point,  # noqa: F401
                                   summarise, what_ran)

ROOT = Path(__file__).resolve().parents[1]




 
def write_outputs(result: Dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    atts, lens = result["attention"], result["seq_lens"]
    table = {(p["attention"], p["seq_len"]): p for p in result["points"]}
    missing = {"tokens_per_s": None, "error": "not run"}
    for a in atts:
        for T in lens:
            table.setdefault((a, T), missing)
    lines = [f"# End-to-end training throughput: recipe `{result['recipe']}` on {result['device']}", "",
             ("tokens/s per device" if result.get("nproc", 1) == 1 else
              f"tokens/s of the whole run on {result['nproc']} processes") +
             " (mean after warmup); speedup = tokens/s / attention=full at the same length.", "",
             "| " + " | ".join(["seq_len", *(f"{a} tok/s" for a in atts),
                               *(f"{a} speedup" for a in atts if a != "full")]) + " |",
             "|---" * (1 + len(atts) + len([a for a in atts if a != "full"])) + "|"]
    for T in lens:
        tps = {a: table[(a, T)].get("tokens_per_s") for a in atts}
        cells = [f"{tps[a]:,.0f}" if tps[a] else table[(a, T)].get("error", "failed") for a in atts]
        base = tps.get("full")
        speed = [f"{tps[a] / base:.2f}x" if (tps[a] and base) else "-" for a in atts if a != "full"]
        lines.append("| " + " | ".join([f"{T:,}", *map(str, cells), *speed]) + " |")
    lines += ["", f"What ran on {result['device']}:", ""]
    lines += [f"- {a}: {what_ran(a, result['device'])['impl']}" for a in atts]
    peaks = {key: p.get("peak_memory_gb") for key, p in table.items()}
    if any(peaks.values()):
        lines += ["", f"{memory_label(result['device'])} of each point:", "",
                  "| seq_len | " + " | ".join(atts) + " |", "|---" * (1 + len(atts)) + "|"]
        lines += [f"| {T:,} | " + " | ".join(f"{peaks[(a, T)]:.1f}" if peaks.get((a, T)) else "-" for a in atts) + " |"
                  for T in lens]
    by_point = lambda kv: (kv[0][1], atts.index(kv[0][0]))  # noqa: E731 (sequence length, then attention)
    phases = {key: p.get("phase_s") for key, p in table.items() if p.get("phase_s")}
    if phases:
        lines += ["", "Seconds per step by phase (`train.phase_times=true`: a device sync around each phase):", "",
                  "| attention | seq_len | forward | backward | optimizer step |", "|---|---|---|---|---|"]
        lines += [f"| {a} | {T:,} | " + " | ".join(f"{ph[k]:.2f}" for k in PHASES) + " |"
                  for (a, T), ph in sorted(phases.items(), key=by_point)]
    timed = [(key, p) for key, p in sorted(table.items(), key=by_point) if p.get("process_s") and p.get("summary")]
    if timed:
        lines += ["", "Seconds of each point: the process from start to exit, its startup (the trainer's build "
                  "steps, `startup_s`, with the longest) and its training loop (steps, compilation included):", "",
                  "| attention | seq_len | process | startup | longest startup step | training loop |",
                  "|---|---|---|---|---|---|"]
        for (a, T), p in timed:
            startup = p["summary"].get("startup_s") or {}
            longest = max(startup.items(), key=lambda kv: kv[1], default=None)
            lines.append(f"| {a} | {T:,} | {p['process_s']:.1f} | "
                         + (f"{sum(startup.values()):.1f} | {longest[0]} {longest[1]:.1f}" if longest else "- | -")
                         + f" | {p['summary']['wall_time_s']:.1f} |")
    for (a, T), p in sorted(table.items(), key=by_point):
        prof = p.get("profile")
        if not prof:
            continue
        lines += ["", f"Device time of {a} at {T:,} tokens, step {prof['step']} under torch.profiler "
                  f"(`train.profile_step`; wall {prof['wall_s']:.2f} s, kernels {prof['device_ms'] / 1e3:.2f} s):", "",
                  *profile_table(prof, top=20)]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for a in atts:
        xs = [T for T in lens if table[(a, T)].get("tokens_per_s")]
        ax1.plot(xs, [table[(a, T)]["tokens_per_s"] for T in xs], marker="o", label=a)
        if a != "full":
            xs2 = [T for T in xs if table[("full", T)].get("tokens_per_s")] if "full" in atts else []
            ax2.plot(xs2, [table[(a, T)]["tokens_per_s"] / table[("full", T)]["tokens_per_s"] for T in xs2],
                     marker="o", label=a)
    for ax, title in ((ax1, "tokens/s"), (ax2, "speedup over full")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:  # no speedup lines when attention=full ran alone
            ax.legend()
    fig.suptitle(f"{result['recipe']} on {result['device']}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)


def main(argv: Optional[List[str]] = None) -> Dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("report", "longest", "plan-check"):
        from msa_train import bench_report

        return bench_report.main(argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--attention", default="full,nsa,fmsa")
    p.add_argument("--seq-lens", default="512,1024")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from the mean")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per point")
    p.add_argument("--nproc", type=int, default=1, help="processes per point (torchrun on this host), e.g. for "
                   "parallel.sp_degree; tokens/s is then the whole run's")
    p.add_argument("--out", default=None, help="output path stem (default runs/bench/e2e_<recipe>_<device>)")
    args = p.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    tag = "cpu" if device == "cpu" else device.split()[-1].lower()
    atts = args.attention.split(",")
    lens = [int(x) for x in args.seq_lens.split(",")]
    points = []
    result = {"recipe": args.recipe, "device": device, "attention": atts, "seq_lens": lens, "steps": args.steps,
              "warmup": args.warmup, "nproc": args.nproc, "extra_overrides": extra, "points": points,
              "ran": {a: what_ran(a, device) for a in atts}, "memory": memory_label(device)}
    stem = Path(args.out) if args.out else default_stem(args.recipe, tag)
    with tempfile.TemporaryDirectory() as tmp:
        for T in lens:
            for a in atts:
                point = run_point(args.recipe, a, T, args.steps, extra, Path(tmp), args.timeout, args.nproc)
                point["tokens_per_s"] = summarise(point, args.warmup)
                phases = phase_means(point, args.warmup)
                if phases:
                    point["phase_s"] = phases
                point.pop("records", None)
                points.append(point)
                print(f"{a:>5} T={T:>8}: " + (f"{point['tokens_per_s']:,.0f} tok/s" if point["tokens_per_s"]
                                              else f"failed ({point.get('error')})"), flush=True)
                write_outputs(result, stem)  # after every point, so a run stopped early keeps what it measured
    print(stem.with_suffix(".md").read_text())
    return result


if __name__ == "__main__":
    main()
