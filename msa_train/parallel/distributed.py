"""Process-group setup: one code path for no launcher, torchrun, deepspeed and accelerate launch.

All of these launchers export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; without
them we are a single process and create a 1-rank group ourselves (DeepSpeed needs a group), on a
free local port.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when available, else cpu; an explicit cuda without CUDA is an error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but CUDA is not available; use train.device=auto or cpu")
    return device


def init_distributed(device: str = "auto", backend: str = "auto") -> DistInfo:
    """Initialise torch.distributed (gloo on CPU, NCCL on CUDA unless ``backend`` says otherwise)."""
    device_type = resolve_device(device)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        init_method = "env://"
    else:
        # No launcher: a private 1-rank group. Not exported through RANK/MASTER_PORT, so child
        # processes (e.g. a launcher started from this one) do not mistake themselves for rank 0.
        rank, world, local_rank = 0, 1, 0
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    os.environ.setdefault("LOCAL_RANK", str(local_rank))  # DeepSpeed's engine reads it
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world)
    # DeepSpeed's comm layer wraps the group we made (zero.Init and the engine read its world size).
    import deepspeed

    if device_type == "cpu":
        _skip_cpu_shm_comm_build()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend)


def _skip_cpu_shm_comm_build() -> None:
    """Keep DeepSpeed's CPU comm backend from JIT-compiling its shared-memory all-reduce op.

    On the CPU accelerator ``deepspeed.comm`` builds ``deepspeed_shm_comm`` (a C++ extension)
    when it first initialises: about 3 minutes on a 2-core machine, for faster CPU collectives
    that our gloo CPU runs do not need. Marking the op incompatible makes DeepSpeed use
    torch.distributed's gloo collectives directly.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
