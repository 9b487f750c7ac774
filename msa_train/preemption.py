"""Stop cleanly on SIGTERM / SIGUSR1: checkpoint at the end of the current step, then return.

Schedulers announce preemption with a signal (SLURM sends SIGTERM, or SIGUSR1 some time before
with ``--signal=USR1@120``; torchrun forwards SIGTERM to its workers). The handler only sets a
flag; at the end of every optimizer step the ranks agree on it (one all-reduce of a CPU int over
gloo: host-side, no GPU sync), so a signal that reaches one rank stops all of them at the same
step, where the trainer writes its usual atomic checkpoint; ``train.resume=auto`` continues
exactly from there. SIGINT (Ctrl-C) keeps its default: stop now.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Installs the handlers (main thread only) until :meth:`restore`."""

    def __init__(self, rank: int, world_size: int, group=None):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.received: Optional[int] = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def requested(self, step: int) -> bool:
        """Collective: whether any rank received a stop signal (by the end of ``step``)."""
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def control_group(backend: str, world_size: int, timeout=None):
    """A gloo group for host-side control messages (None: the default group is gloo already, or one rank);
    ``timeout`` (a timedelta) bounds its collectives, as the default group's."""
    if world_size == 1 or backend == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timeout)  # collective: every rank creates it
