"""Process-group setup: one code path for no launcher, torchrun, deepspeed and accelerate launch.

All of these launchers export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; without
them we are a single process and create a 1-rank group ourselves (DeepSpeed needs a group), on a
free local port.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: datetime.timedelta = datetime.timedelta(minutes=10)  # of every collective (parallel.timeout_s)

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


class PeerLost(RuntimeError):
    """A collective timed out or lost its connection: another rank stopped, hung or died."""


# A gloo group of its own for naming the silent rank after a collective failed: the group the
# collective ran on may be left mid-operation. Set by init_distributed alone, as torch keeps its
# default group.
_MONITOR: Optional[Any] = None
_LOST = re.compile(r"Timed out waiting|Connection closed by peer|Connection reset by peer|"
                   r"failed to pass monitoredBarrier|Socket Timeout|timed out", re.IGNORECASE)


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Initialise torch.distributed (gloo on CPU, NCCL on CUDA unless ``backend`` says otherwise).

    Args:
        timeout_s: how long a collective waits for every rank (``parallel.timeout_s``); past it the
            run fails (see :func:`peer_lost`) instead of waiting torch's default 30 minutes.
    """
    global _MONITOR
    timeout = datetime.timedelta(seconds=timeout_s)
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
        # device_id binds NCCL's communicator to this rank's GPU at once (without it NCCL guesses
        # the device from the rank and warns that a wrong guess can hang)
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timeout, device_id=dev if device_type == "cuda" else None)
        if world > 1:
            _MONITOR = dist.new_group(backend="gloo", timeout=timeout)  # collective: every rank creates it
    # DeepSpeed's comm layer wraps the group we made (zero.Init and the engine read its world size).
    import deepspeed

    if device_type == "cpu":
        _skip_cpu_shm_comm_build()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend,
                    timeout=timeout)


def bound_collectives(timeout: datetime.timedelta) -> int:
    """Give every process group of this rank ``timeout``; returns how many. Groups made without one
    wait torch's default 30 minutes, and DeepSpeed makes its own that way (its clone of the world
    group for the gradient norm, ZeRO's partition groups): call this once the engine is built."""
    from torch.distributed import distributed_c10d as c10d

    groups = [g for g in list(c10d._world.pg_map) if g is not None and not c10d._rank_not_in_group(g)]
    for group in groups:
        c10d._set_pg_timeout(timeout, group)  # torch's own setter; there is no public one for a made group
    return len(groups)


def peer_lost(error: BaseException, timeout_s: float) -> Optional[PeerLost]:
    """The :class:`PeerLost` that a failed collective means, naming the silent rank, or None for
    other errors. Gloo's own message ("Timed out waiting 5000ms for recv operation") names no rank:
    a monitored barrier on a group of its own asks every rank, and rank 0 hears which did not answer
    (another rank hears only whether rank 0 did). NCCL's watchdog ends a timed-out process itself."""
    if not dist.is_initialized() or not _LOST.search(str(error)):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != rank]
    lost = others if len(others) == 1 else None
    if _MONITOR is not None:
        try:
            dist.monitored_barrier(group=_MONITOR, timeout=datetime.timedelta(seconds=min(timeout_s, 30.0)),
                                   wait_all_ranks=True)
            lost = []  # every rank answers now: one was only slow
        except RuntimeError as e:
            named = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
            if named:
                lost = [int(r) for r in named.group(1).replace(" ", "").split(",") if r]
            elif "from rank 0" in str(e):
                lost = [0]
    if lost == []:
        return PeerLost(f"rank {rank}: a collective waited longer than parallel.timeout_s={timeout_s:g} s, though "
                        "every rank answers now: one was slower than that (a long checkpoint write, a slow file "
                        f"system); raise parallel.timeout_s. ({str(error).strip().splitlines()[0]})")
    who = f"rank {', '.join(map(str, lost))}" if lost else "another rank (rank 0's log names it)"
    return PeerLost(f"rank {rank}: a collective got no answer from {who} within parallel.timeout_s={timeout_s:g} s: "
                    "that process stopped, hung or died. Check it; if it is only slow (a long checkpoint write, "
                    f"a slow file system), raise parallel.timeout_s. ({str(error).strip().splitlines()[0]})")


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
