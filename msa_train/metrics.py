"""Run observability: rich progress bar, metrics.jsonl, summary.json, optional wandb.

Only rank 0 writes. Every figure logged to wandb is also in metrics.jsonl, under the same name.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from msa_train.config import LoggerConfig

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets), for MFU.
_PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0,
                     "L40S": 362.0, "A6000": 154.8, "4090": 165.2}


def peak_tflops(device: torch.device, override: Optional[float]) -> Optional[float]:
    """Per-device peak for MFU: the override, else the table for known GPUs, else None (no MFU)."""
    if override is not None:
        return override
    if device.type == "cuda":
        return peak_tflops_of(torch.cuda.get_device_name(device))
    return None


def peak_tflops_of(device_name: str) -> Optional[float]:
    """The table's dense bf16 peak for a GPU by its name (``torch.cuda.get_device_name``), or None."""
    for key, value in _PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def model_flops_per_token(n_matmul: int, num_layers: int, attn_dim: int, mean_context: float) -> float:
    """Training FLOPs per token of the dense-equivalent model (fwd + bwd = 3x fwd).

    6 per matmul parameter (``count_parameters``' second value: not the input embedding, a lookup,
    nor NSA's own parameters, so that NSA and dense runs of one model are held to the same FLOPs)
    plus causal attention QK^T and PV: 2 matmuls x 2 FLOPs x attn_dim (HQ*D) x mean context, x3.
    """
    return 6.0 * n_matmul + 12.0 * num_layers * attn_dim * mean_context


def log_on_rank_zero_only(rank: int) -> None:
    """Ranks other than 0 log errors only: their info and warnings (the data summary, the model
    line, DeepSpeed's notes) repeat rank 0's, once per process. Rank 0 speaks for the run."""
    if rank != 0:
        for name in ("msa_train", "DeepSpeed"):  # DeepSpeed's logger is named "DeepSpeed"
            logging.getLogger(name).setLevel(logging.ERROR)


def format_eval(record: Dict[str, Any]) -> str:
    """One line for the terminal: the headline figures of an evaluation record."""
    parts = [f"eval step {record['step']}:"]
    for key, label, fmt in (("eval_loss", "loss", "{:.4f}"), ("eval_ppl", "ppl", "{:.2f}"),
                            ("eval_reward_accuracy", "reward acc", "{:.3f}"),
                            ("eval_passkey_accuracy", "pass-key acc", "{:.3f}"),
                            ("eval_retrieval_accuracy", "retrieval acc", "{:.3f}"),
                            ("eval_retrieval_token_accuracy", "answer-token acc", "{:.3f}"),
                            ("eval_retrieval_loss", "answer loss", "{:.3f}"), ("eval_reward", "reward", "{:.3f}")):
        if record.get(key) is not None:
            parts.append(f"{label} {fmt.format(record[key])}")
    by_pos = [(k[len("eval_loss_pos_"):].replace("_", "-"), v) for k, v in record.items()
              if k.startswith("eval_loss_pos_") and v is not None]
    if by_pos:
        parts.append("by position " + " ".join(f"{k}:{v:.3f}" for k, v in by_pos))
    return "  ".join(parts)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def json_line(record: Dict[str, Any], indent: Optional[int] = None) -> str:
    """Strict JSON: a NaN or infinite float becomes null (json.dumps would write the bare NaN /
    Infinity that strict parsers reject)."""
    return json.dumps(_finite_or_null(record), indent=indent, allow_nan=False)


class PhaseTimer:
    """``train.phase_times``: seconds of each phase of a step (forward, backward, optimizer step) summed
    over the steps since the last log, for finding where a step's time goes (e.g. what host-side
    optimizer state costs). Each phase starts and ends with a device synchronisation, so the times
    are exact but the steps lose whatever overlap the host had with the device; off by default."""

    NAMES = ("forward", "backward", "step")

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._sums = dict.fromkeys(self.NAMES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self._sums[name] += time.perf_counter() - t0

    def take(self) -> Dict[str, float]:
        """The sums as ``{name}_s`` record entries (none when off), and a fresh start."""
        if not self.enabled:
            return {}
        out = {f"{name}_s": value for name, value in self._sums.items()}
        self._sums = dict.fromkeys(self.NAMES, 0.0)
        return out


# Kinds of device time in a profiled step, by kernel name (first match wins). Triton kernels are
# named by their bare function name; in this trainer they are flash_msa's but for the fused loss's
# kernels (msa_train/loss.py) and the fused RMSNorm / RoPE / SwiGLU (msa_train/models/fused_ops.py). torch's own kernels have demangled C++ names ("void at::native::...").
_KERNEL_KINDS = (
    ("copy device<->host", lambda n: "memcpy" in n and ("dtoh" in n or "htod" in n)),
    ("copy/fill on device", lambda n: "memcpy" in n or "memset" in n),
    ("dense attention (cuDNN / flash SDPA)", lambda n: any(k in n for k in ("cudnn", "fmha", "flash_fwd", "flash_bwd",
                                                                           "sdpa"))),
    ("matmul (cuBLAS)", lambda n: any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "splitk"))),
    ("collectives (NCCL)", lambda n: "nccl" in n),
    ("cross-entropy rows (Triton)", lambda n: n.startswith(("_ce_rows", "_scale_kernel"))),
    ("fused layer ops (Triton)", lambda n: n.startswith(("_rms_norm", "_rope_kernel", "_swiglu_kernel"))),
    ("optimizer (AdamW)", lambda n: "adam" in n or "multi_tensor_apply" in n),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, test in _KERNEL_KINDS:
        if test(low):
            return kind
    if all(c.isalnum() or c == "_" for c in name) and not name[:1].isdigit():
        return "flash_msa (Triton)"
    return "other PyTorch kernels (elementwise, reductions, ...)"


def profile_summary(prof, step: int, wall_s: float, top: int = 40) -> Dict[str, Any]:
    """Device time of a ``torch.profiler`` run over one step, by kind (:func:`kernel_kind`) and by
    kernel (the ``top`` longest), in ms. Kernels of concurrent streams each count in full, so the
    sum can exceed the wall time."""
    # key_averages has one entry per kernel name; GPU-side user annotations (e.g.
    # "Optimizer.step#AdamW.step") span kernels counted already
    kernels = [{"name": ev.key, "ms": ev.device_time_total / 1e3, "calls": ev.count, "kind": kernel_kind(ev.key)}
               for ev in prof.key_averages()
               if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0
               and not getattr(ev, "is_user_annotation", False)]
    kernels.sort(key=lambda k: -k["ms"])
    kinds: Dict[str, float] = {}
    for k in kernels:
        kinds[k["kind"]] = kinds.get(k["kind"], 0.0) + k["ms"]
    return {"step": step, "wall_s": wall_s, "device_ms": sum(kinds.values()),
            "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "kernels": kernels[:top]}


def profile_table(summary: Dict[str, Any], top: int = 40) -> list:
    """Markdown lines of a :func:`profile_summary`: device time by kind, then the longest kernels."""
    total = summary["device_ms"] or 1.0
    lines = ["| kind | ms | share |", "|---|---|---|"]
    lines += [f"| {k} | {ms:.1f} | {ms / total:.1%} |" for k, ms in summary["kinds_ms"].items()]
    lines += ["", "| kernel | kind | ms | calls |", "|---|---|---|---|"]
    return lines + [f"| `{k['name'][:90]}` | {k['kind']} | {k['ms']:.1f} | {k['calls']} |"
                    for k in summary["kernels"][:top]]


def write_profile(run_dir: Path, summary: Dict[str, Any]) -> Path:
    """``profile_step<N>.json`` and a markdown table of the same beside it, in the run directory."""
    stem = run_dir / f"profile_step{summary['step']}"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    head = [f"# Device time of step {summary['step']} (torch.profiler; wall {summary['wall_s']:.2f} s, "
            f"kernels {summary['device_ms'] / 1e3:.2f} s)", ""]
    stem.with_suffix(".md").write_text("\n".join(head + profile_table(summary)) + "\n")
    return stem.with_suffix(".md")


class MetricsLogger:
    """Writes metrics.jsonl (+ wandb) and drives the progress bar on rank 0."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, total_steps: int, start_step: int, enabled: bool,
                 progress: bool, config_dict: Dict[str, Any]):
        self.enabled = enabled
        self.run_dir = run_dir
        self._wandb = None
        self._progress = None
        if not enabled:
            return
        self.metrics_path = run_dir / "metrics.jsonl"
        self._truncate_after(start_step)
        self._file = open(self.metrics_path, "a", buffering=1)
        if cfg.name == "wandb":
            import wandb

            # Offline unless the user says otherwise (logger.mode or $WANDB_MODE): tests need no account.
            mode = cfg.mode or os.environ.get("WANDB_MODE", "offline")
            # one wandb run per training run: its id is kept in the run dir, and a resume continues
            # it (wandb keeps the first record of a step, so a rolled-back step keeps its
            # pre-crash record, the same values after an exact resume but for the timings)
            id_file = run_dir / "wandb_run_id"
            run_id = id_file.read_text().strip() if start_step > 0 and id_file.is_file() else uuid.uuid4().hex[:8]
            id_file.write_text(run_id + "\n")
            self._wandb = wandb.init(project=cfg.project, name=cfg.run_name, dir=str(run_dir), mode=mode,
                                     config=config_dict, id=run_id, resume="allow")
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[loss]}  {task.fields[tps]} tok/s  MFU {task.fields[mfu]}  "
                           "mem {task.fields[mem]} GB"),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                                 loss="loss -", tps="-", mfu="-", mem="-")
            self._progress.start()

    def _truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint so the file reads as one continuous run.

        A line that does not parse (a write cut short by a kill or a full disk) is dropped too,
        and the file is replaced atomically (temporary file, fsync, rename): a kill here leaves
        the old file or the new one."""
        if not self.metrics_path.exists():
            return
        keep = []
        for line in self.metrics_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                keep.append(line)
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics_path)

    def _write(self, record: Dict[str, Any]) -> None:
        """metrics.jsonl and wandb: every figure under the same name in both."""
        self._file.write(json_line(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def rewind(self, step: int, record: Dict[str, Any]) -> None:
        """Drop the records past ``step`` (training went back to a checkpoint of that step) and write ``record``."""
        if not self.enabled:
            return
        self._file.close()
        self._truncate_after(step)
        self._file = open(self.metrics_path, "a", buffering=1)
        self._write(record)

    def log(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write(record)
        if self._progress is not None:
            mfu = record.get("mfu")
            loss = "loss -" if record["loss"] is None else f"loss {record['loss']:.4f}"
            if record.get("reward") is not None:  # GRPO: the rollouts' reward says more than its loss
                loss = f"reward {record['reward']:.3f}"
            self._progress.update(self._task, completed=record["step"], loss=loss,
                                  tps=f"{record['tokens_per_s']:,.0f}",
                                  mfu="-" if mfu is None else f"{100 * mfu:.1f}%",
                                  mem=f"{record['peak_memory_gb']:.2f}")

    def log_eval(self, record: Dict[str, Any]) -> None:
        """An evaluation record (its keys start with ``eval_``): metrics.jsonl, wandb, and one terminal line."""
        if not self.enabled:
            return
        self._write(record)
        line = format_eval(record)
        if self._progress is not None:
            self._progress.console.print(line)
        else:
            print(line, flush=True)

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def close(self, summary: Optional[Dict[str, Any]] = None) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        if summary is not None:
            (self.run_dir / "summary.json").write_text(json_line(summary, indent=2))
            if self._wandb is not None:
                self._wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
