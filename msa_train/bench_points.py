"""Running one end-to-end benchmark point and reading its records: shared by ``msa_train.bench``
(throughput over sequence lengths) and ``msa_train.bench_report`` (the full-depth report, the
longest-sequence finder, the planner check), so neither imports the other."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

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
        point["error"] = _oom(proc.stderr) or _killed(proc.returncode) or _error_line(proc.stderr)
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


def _killed(returncode: int) -> Optional[str]:
    """A process ended by a signal says which (SIGKILL without a Python error: mostly the host's
    out-of-memory killer), instead of the last line it happened to print."""
    if returncode >= 0:
        return None
    import signal

    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name}" + (" (no Python error: the host's out-of-memory killer?)" if name == "SIGKILL" else "")


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
