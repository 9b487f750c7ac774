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
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from msa_train.metrics import profile_table

ROOT = Path(__file__).resolve().parents[1]


def run_point(recipe: str, attention: str, seq_len: int, steps: int, extra: List[str], workdir: Path,
              timeout: int, nproc: int = 1) -> Dict:
    out_dir = workdir / f"{attention}_{seq_len}"
    args = [f"recipe={recipe}", f"attention={attention}", f"train.seq_len={seq_len}", f"train.steps={steps}",
            f"train.output_dir={out_dir}", "train.save_final=false", "train.save_hf=false",
            "train.progress=false", "train.warmup_steps=1",
            "data=generated", f"data.num_docs={steps + 2}", f"data.min_doc_tokens={max(64, seq_len // 2)}",
            f"data.max_doc_tokens={seq_len}", *extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "kernels"), str(ROOT), env.get("PYTHONPATH", "")])
    env["HYDRA_FULL_ERROR"] = "1"  # the error's own last line, not Hydra's hint
    point = {"attention": attention, "seq_len": seq_len, "steps": steps, "ok": False}
    launcher = [sys.executable]
    if nproc > 1:  # one process per GPU of this host, e.g. for parallel.sp_degree
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                     "--master-port", str(_free_port())]
        point["nproc"] = nproc
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([*launcher, "-m", "msa_train.cli", *args], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # recorded like any failed point; the others still run
        point["error"] = f"timeout after {timeout} s"
        return point
    point["process_s"] = round(time.perf_counter() - t0, 2)  # start to exit, startup and teardown included
    point["ok"] = proc.returncode == 0
    if proc.returncode != 0:
        point["error"] = _oom(proc.stderr) or _error_line(proc.stderr)
        point["stderr_tail"] = proc.stderr.strip().splitlines()[-25:]  # where it failed, for the JSON
        return point
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out_dir / "summary.json").read_text())
    point |= {"records": records, "summary": summary, "peak_memory_gb": summary.get("peak_memory_gb")}
    profiles = sorted(out_dir.glob("profile_step*.json"))  # train.profile_step
    if profiles:
        point["profile"] = json.loads(profiles[-1].read_text())
    return point


def _oom(stderr: str) -> Optional[str]:
    """"OOM", with the allocation that failed and the memory then free when the message says so."""
    tail = stderr[-8000:]
    if "out of memory" not in tail.lower():
        return None
    asked = re.findall(r"Tried to allocate ([\d.]+ [KMGT]iB)", tail)
    free = re.findall(r"of which ([\d.]+ [KMGT]iB) is free", tail)
    return "OOM" + (f" ({asked[-1]} asked, {free[-1]} free)" if asked and free else "")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _error_line(stderr: str) -> str:
    """The failed run's exception line (the last one of the traceback: HYDRA_FULL_ERROR is set)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b", line)]
    return (errors or lines or ["failed without a message"])[-1]


def summarise(point: Dict, warmup: int) -> Optional[float]:
    if not point.get("ok"):
        return None
    records = [r for r in point["records"] if not r.get("profiled")] or point["records"]  # profiler time: out
    timed = [r["tokens_per_s"] for r in records if r["step"] > warmup] or [r["tokens_per_s"] for r in records]
    return sum(timed) / len(timed)


PHASES = ("forward_s", "backward_s", "step_s")


def phase_means(point: Dict, warmup: int) -> Optional[Dict[str, float]]:
    """Seconds per step of each phase (records from ``train.phase_times=true``), mean after warmup.
    A record's sums cover the steps since the record before it (the first: since step 0, as in the
    fresh runs this benchmark starts)."""
    records = [r for r in point.get("records", []) if all(k in r for k in PHASES)]
    spans = [(r, r["step"] - prev) for r, prev in zip(records, [0] + [r["step"] for r in records])]
    spans = [(r, n) for r, n in spans if not r.get("profiled")] or spans
    timed = [(r, n) for r, n in spans if r["step"] > warmup] or spans
    if not timed:
        return None
    steps = sum(n for _, n in timed)
    return {k: sum(r[k] for r, _ in timed) / steps for k in PHASES}


def default_stem(recipe: str, tag: str) -> Path:
    """Where a user's benchmark writes when ``--out`` is not given: under ``runs/`` of the working directory."""
    return Path("runs") / "bench" / f"e2e_{recipe}_{tag}"


def what_ran(attention: str, device: str, bf16: bool = True) -> Dict[str, str]:
    """The kernels an arm runs on ``device`` ("cpu" or a GPU name): for attention=full the dense kernel
    of a one-document and of a packed row (models/attention.py's routing), for nsa/fmsa the Triton
    kernels on CUDA and the PyTorch reference elsewhere (models/attention.py's nsa backend)."""
    import torch

    from msa_train.models.attention import dense_kernel_name

    cuda = device != "cpu"
    dtype = torch.bfloat16 if (cuda and bf16) else torch.float32
    if attention == "full":
        one, packed = dense_kernel_name(cuda, dtype, 1), dense_kernel_name(cuda, dtype, 2)
        return {"device": device, "impl": f"{one} (one document a row) / {packed} (packed rows)"}
    impl = f"flash_msa Triton kernels (selected attention: {attention})" if cuda else \
        "PyTorch reference (flash_msa naive.py: no Triton kernels off CUDA; not a speed measurement)"
    return {"device": device, "impl": impl}


def memory_label(device: str) -> str:
    return ("Peak host memory of the process (GiB, max RSS: there is no device memory on CPU)" if device == "cpu"
            else "Peak device memory (GiB, torch.cuda.max_memory_allocated)")


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
