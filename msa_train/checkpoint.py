"""Atomic checkpoints and exact resume.

Layout of ``<output_dir>/checkpoints/``::

    step_000020/                 a complete checkpoint (only complete ones carry this name)
      ds/                        DeepSpeed engine.save_checkpoint: model, optimizer, LR scheduler
      rank_00000.pt ...          per rank: torch / CUDA / python RNG states, data sampler state
      trainer_state.json         step, tokens seen, the settings an exact resume depends on
      COMPLETE                   written last, before the rename
    .tmp_step_000030/            an interrupted write: ignored, removed by the next save

A save writes everything into ``.tmp_step_N``, fsyncs the files (the first rank of every node, then
rank 0) and the directory, then renames it to ``step_N`` (rename is atomic on POSIX), so a process
killed at any moment leaves either the new checkpoint or none, and the previous one untouched.
``resume=auto`` loads the newest ``step_*`` holding ``COMPLETE``.

Nothing complete is deleted in place: a checkpoint that goes (pruned, or replaced by a re-save of
its step) is first renamed to ``.trash_step_N`` and only then removed, so an interrupted delete
never leaves a half-deleted ``step_N`` that still carries its ``COMPLETE``. A re-save renames the
old ``step_N`` away and the new one in, back to back; if a kill falls between the two renames, the
next start finds a complete ``.tmp_step_N`` without its ``step_N`` and finishes the rename
(:meth:`CheckpointManager.recover`). Pruning keeps the newest ``keep`` checkpoints up to the step
just saved and never touches newer ones; the trainer refuses to start over checkpoints newer than
the one it starts from (:meth:`CheckpointManager.check_no_newer`), so one directory never mixes
two runs' histories.

Test hook: ``MSA_TRAIN_CRASH_IN_SAVE=<step>`` SIGKILLs the process in the middle of that step's
write (after the DeepSpeed files, before the marker and the rename).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp_step_(\d+)$")
COMPLETE = "COMPLETE"
DS_TAG = "ds"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def complete_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the complete checkpoints under ``ckpt_root``, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in ckpt_root.iterdir()
                  if (m := _STEP_DIR.match(p.name)) and (p / COMPLETE).is_file())


def find_latest(ckpt_root: Path) -> Optional[Path]:
    """The newest complete checkpoint directory under ``ckpt_root``, or None."""
    found = complete_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def swap_in(new: Optional[Path], final: Path) -> None:
    """Put the complete directory ``new`` at ``final`` (or, with ``new`` None, remove ``final``): an
    existing ``final`` is renamed out of sight first (``.trash_<name>``), the new one renamed in right
    after, the parent fsynced, and only then is the old one deleted. A kill leaves no half-deleted
    directory under the final name."""
    trash = final.with_name(f".trash_{final.name}")
    shutil.rmtree(trash, ignore_errors=True)
    if final.exists():
        os.rename(final, trash)
    if new is not None:
        os.rename(new, final)
    _fsync_dir(final.parent)
    shutil.rmtree(trash, ignore_errors=True)


class CheckpointManager:
    """Saves and restores the engine, RNG and data state; keeps the newest ``keep`` checkpoints."""

    def __init__(self, root: Path, rank: int, keep: int = 2, local_rank: Optional[int] = None):
        self.root, self.rank, self.keep = Path(root), rank, keep
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank

    def save(self, engine, step: int, trainer_state: Dict[str, Any], rank_state: Dict[str, Any]) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint path."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp_step_{step:06d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in [*self.root.glob(".tmp_step_*"), *self.root.glob(".trash_step_*")]:
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=False)
        torch.save({"rng": rng_state(), **rank_state}, tmp / f"rank_{self.rank:05d}.pt")
        _barrier()
        if self.local_rank == 0 and self.rank != 0:
            # rank 0's fsync below flushes only what its own node wrote; on a filesystem shared by
            # several nodes each node flushes its ranks' files (all written: the barrier above)
            # before rank 0 marks the step complete
            _fsync_tree(tmp)
        _barrier()
        if self.rank == 0:
            if os.environ.get("MSA_TRAIN_CRASH_IN_SAVE") == str(step):
                os.kill(os.getpid(), signal.SIGKILL)
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
            _fsync_tree(tmp)
            (tmp / COMPLETE).write_text(f"{step}\n")
            with open(tmp / COMPLETE, "rb") as f:
                os.fsync(f.fileno())
            _fsync_dir(tmp)  # the marker's directory entry, before the rename publishes it
            swap_in(tmp, final)  # replaces a checkpoint of the same step (e.g. final == periodic)
            self._prune(step)
        _barrier()
        return final

    def _prune(self, step: int) -> None:
        """Keep the newest ``keep`` complete checkpoints up to ``step``; never touch newer ones."""
        if self.keep <= 0:
            return
        complete = [(s, p) for s, p in complete_checkpoints(self.root) if s <= step]
        for _, path in complete[:-self.keep]:
            swap_in(None, path)

    def recover(self) -> None:
        """Collective. Finish a re-save that a kill interrupted between its two renames: a complete
        ``.tmp_step_N`` whose ``step_N`` is gone becomes ``step_N``."""
        if self.rank == 0 and self.root.is_dir():
            for tmp in self.root.iterdir():
                m = _TMP_DIR.match(tmp.name)
                final = self.root / f"step_{m.group(1)}" if m else None
                if final is not None and (tmp / COMPLETE).is_file() and not final.exists():
                    os.rename(tmp, final)
                    _fsync_dir(self.root)
        _barrier()

    def check_no_newer(self, step: int, resumed_from: Optional[Path]) -> None:
        """Refuse to train from ``step`` (0 for a fresh run) over complete checkpoints of later steps
        in this run's directory: saves and ``resume=auto`` would then mix two histories, and pruning
        by step could delete this run's newest checkpoint."""
        newer = [p for s, p in complete_checkpoints(self.root) if s > step]
        if newer:
            start = f"resuming from {resumed_from} (step {step})" if resumed_from else "starting a fresh run"
            raise ValueError(
                f"{self.root} holds checkpoints of later steps than this run starts from ({start}): "
                f"{', '.join(p.name for p in newer)}. Resume the newest with train.resume=auto, use a new "
                "train.output_dir, or move those checkpoints away first")

    def resolve(self, resume: str) -> Optional[Path]:
        """``none`` -> None; ``auto`` -> newest complete (or None); else the given directory.
        Collective (it first runs :meth:`recover`)."""
        self.recover()
        if resume == "none":
            return None
        if resume == "auto":
            return find_latest(self.root)
        path = Path(resume)
        if not (path / COMPLETE).is_file():
            raise ValueError(f"train.resume={resume!r} is not a complete checkpoint directory (no {COMPLETE} file)")
        return path

    @staticmethod
    def read_trainer_state(path: Path) -> Dict[str, Any]:
        return json.loads((Path(path) / "trainer_state.json").read_text())

    def load(self, engine, path: Path, weights_only: bool = False) -> tuple[Dict[str, Any], Dict[str, Any]]:
        """Restore engine (weights, optimizer, LR schedule) and RNG; returns (trainer_state, rank_state).
        ``weights_only`` (evaluation) restores the weights alone: rank_state is then empty."""
        load_path, _ = engine.load_checkpoint(str(path), tag=DS_TAG, load_optimizer_states=not weights_only,
                                              load_lr_scheduler_states=not weights_only)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
        if weights_only:
            return self.read_trainer_state(path), {}
        rank_file = path / f"rank_{self.rank:05d}.pt"
        if not rank_file.is_file():
            raise ValueError(f"{path} has no state for rank {self.rank}: was it saved with a different world size?")
        rank_state = torch.load(rank_file, weights_only=False)
        set_rng_state(rank_state.pop("rng"))
        return self.read_trainer_state(path), rank_state
