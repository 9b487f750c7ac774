"""Helpers for the trainer tests: compose configs through Hydra exactly like the CLI does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

REPO = Path(__file__).resolve().parents[2]

# Small but real: the tiny recipe's model and data, fewer documents so tokenisation is quick.
FAST = ["data.num_docs=48", "train.progress=false", "train.save_hf=false"]


def compose(overrides: Sequence[str] = ()):
    """Compose + validate the config for ``overrides`` (the same path as ``msa-train``)."""
    from msa_train.cli import compose as cli_compose

    return cli_compose(overrides)


def train(overrides: Sequence[str], stop_after=None):
    """Run the trainer in this process; returns (summary, metrics records)."""
    from msa_train.trainer import Trainer

    cfg = compose(list(overrides))
    summary = Trainer(cfg).train(stop_after=stop_after)
    return summary, read_metrics(Path(cfg.train.output_dir))


def read_metrics(run_dir: Path) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def env() -> dict:
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    e = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "kernels"), str(REPO), e.get("PYTHONPATH", "")])
    e.setdefault("DS_ACCELERATOR", "cpu")
    e.setdefault("WANDB_MODE", "offline")
    e["OMP_NUM_THREADS"] = "1"
    return e


def run_cli(args: Sequence[str], extra_env=None, launcher: Sequence[str] = (), timeout=300, faults: Sequence[str] = ()):
    """``python -m msa_train.cli ARGS`` (optionally under a launcher such as torchrun) in a subprocess;
    with ``faults``, the CLI with those faults patched in (tests/msa_train/faults.py)."""
    e = env()
    e.update(extra_env or {})
    entry = ["-m", "tests.msa_train.faults", *faults, "--"] if faults else ["-m", "msa_train.cli"]
    cmd = [*(launcher or [sys.executable]), *entry, *args]
    return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a launcher's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_launcher(nproc: int = 2) -> List[str]:
    """``python -m torch.distributed.run`` with ``nproc`` processes on this host, on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port())]
