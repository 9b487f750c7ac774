"""Atomic checkpoints and exact resume.

Layout of ``<output_dir>/checkpoints/``::

    step_000020/                 a complete checkpoint (only complete ones carry this name)
      ds/                        DeepSpeed engine.save_checkpoint: model, optimizer, LR scheduler
      rank_00000.pt ...          per rank: torch / CUDA / python RNG states, data sampler state
      rank_00000_gpu_share.pt    under a partial optimizer offload: the GPU share's optimizer state
      trainer_state.json         step, tokens seen, the settings an exact resume depends on
      manifest.json              every file above: its size, the sha256 of each 256 MiB piece
      COMPLETE                   written last, before the rename
    .tmp_step_000030/            an interrupted write: ignored, removed by the next save

A save writes everything into ``.tmp_step_N``, fsyncs the files (the first rank of every node, then
rank 0) and the directory, then renames it to ``step_N`` (rename is atomic on POSIX), so a process
killed at any moment leaves either the new checkpoint or none, and the previous one untouched.
``resume=auto`` loads the newest ``step_*`` holding ``COMPLETE`` that verifies against its manifest
(:meth:`CheckpointManager.verify`); one that does not is set aside as ``corrupt_step_N`` with a
warning saying why, and the next older one is tried.

Every file is read with ``torch.load(weights_only=True)`` (:func:`safe_load`), DeepSpeed's included
(its checkpoint engine's reads go through it): tensors, plain types and the three DeepSpeed types
its optimizer states hold, nothing that runs code when unpickled.

Nothing complete is deleted in place: a checkpoint that goes (pruned, or replaced by a re-save of
its step) is first renamed to ``.trash_step_N`` and only then removed, so an interrupted delete
never leaves a half-deleted ``step_N`` that still carries its ``COMPLETE``. A re-save renames the
old ``step_N`` away and the new one in, back to back; if a kill falls between the two renames, the
next start finds a complete ``.tmp_step_N`` without its ``step_N`` and finishes the rename
(:meth:`CheckpointManager.recover`). Pruning keeps the newest ``keep`` checkpoints up to the step
just saved and never touches newer ones; the trainer refuses to start over checkpoints newer than
the one it starts from (:meth:`CheckpointManager.check_no_newer`), so one directory never mixes
two runs' histories.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from msa_train.parallel.engine import gpu_share_optimizer

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp_step_(\d+)$")
COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
DS_TAG = "ds"
# the rank that wrote a file, from its name (rank_00003.pt, DeepSpeed's zero_pp_rank_3_...): it hashes
# the file at save (still in its node's page cache) and at resume (about to read it)
_WRITER = re.compile(r"(?:^|pp_)rank_(\d+)")
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, corrupt, inconsistent or not plain data; the
    message names the file."""


def _deepspeed_safe_globals() -> list:
    # What DeepSpeed 0.19's ZeRO 1-3 and bf16 optimizer states pickle besides tensors and plain
    # types (read off the files it saves): plain records, rebuilt without running code.
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def safe_load(path, map_location=None, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain types only, so a crafted file cannot
    run code. Raises :class:`CheckpointError` naming ``path`` for anything else, or a truncated file."""
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        detail = next((line for line in str(e).splitlines() if "Unsupported" in line or "error" in line.lower()),
                      str(e).splitlines()[0] if str(e) else "")
        raise CheckpointError(f"{path}: refused to load: it holds more than tensors and plain types "
                              f"({detail.strip()})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read, truncated or corrupt ({type(e).__name__}: {e})") from e


class _SafeLoading:
    """DeepSpeed's checkpoint engine with its ``load`` (model, optimizer and ZeRO state files) through
    :func:`safe_load`; everything else is the engine's own. DeepSpeed reads with weights_only=False
    and takes no option for it."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location=map_location)


_PIECE = 1 << 28  # bytes per sha256 in the manifest: a file's pieces hash in parallel


def _piece_sha256(path: Path, index: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(index * _PIECE)
        left = _PIECE
        while left and (data := f.read(min(left, 1 << 23))):
            h.update(data)  # hashlib releases the GIL on large buffers: threads hash in parallel
            left -= len(data)
    return h.hexdigest()


def file_digests(root: Path, files: List[str]) -> Dict[str, List[str]]:
    """sha256 of each 256 MiB piece of each file (relative to ``root``), hashed on up to 8 threads."""
    tasks = [(f, i) for f in files for i in range(max(1, -(-(root / f).stat().st_size // _PIECE)))]
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(tasks)))) as pool:
        digests = list(pool.map(lambda t: _piece_sha256(root / t[0], t[1]), tasks))
    out: Dict[str, List[str]] = {f: [] for f in files}
    for (f, _), d in zip(tasks, digests):
        out[f].append(d)
    return out


def _files(root: Path) -> List[str]:
    """Relative paths of the files under ``root`` but the manifest and the marker, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, COMPLETE))


def _mine(rel: str, rank: int, world: int) -> bool:
    m = _WRITER.search(Path(rel).name)
    return (int(m.group(1)) if m else 0) % world == rank


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


def _gpu_share_file(rank: int) -> str:
    return f"rank_{rank:05d}_gpu_share.pt"


def _save_gpu_share(engine, tmp: Path, rank: int) -> None:
    """Under a partial offload, the GPU share's optimizer state (what DeepSpeed's files leave out,
    :func:`gpu_share_optimizer`) by sub-group index, in ``rank_N_gpu_share.pt``, with the size of each
    sub-group. Saved from the device: torch.save copies one tensor's storage at a time to the host,
    which has no room for the whole share beside the offloaded state (about 13 GiB of moments for 20%
    of an 8B model, on a host that the offloaded 80% leaves 3 GiB)."""
    share = gpu_share_optimizer(engine)
    if share is None:
        return
    backup, params = share
    torch.save({"numel": {i: p.numel() for i, p in params.items()},
                "state": {i: dict(backup.state[p]) for i, p in params.items() if p in backup.state}},
               tmp / _gpu_share_file(rank))


def _restore_gpu_share(engine, path: Path, rank: int) -> None:
    share = gpu_share_optimizer(engine)
    params = share[1] if share else {}
    file = path / _gpu_share_file(rank)
    if not params and not file.is_file():
        return
    device = next(iter(params.values())).device if params else "cpu"
    saved = safe_load(file, map_location=device, mmap=True) if file.is_file() else None
    if saved is None or saved["numel"] != {i: p.numel() for i, p in params.items()}:
        raise CheckpointError(
            f"{path}: its optimizer state was saved with another split between host and GPU "
            f"({'none' if saved is None else len(saved['numel'])} sub-groups stepped on the GPU, this run "
            f"{len(params)}): resume with the parallel.offload_ratio (and parallel.zero_stage) it was saved with")
    backup = share[0]
    for i, p in params.items():
        state = saved["state"].get(i)
        if state is None:
            backup.state.pop(p, None)  # saved before its first step
        else:  # AdamW keeps its step count on the host (not fused, not capturable)
            backup.state[p] = {k: v.cpu() if torch.is_tensor(v) and v.dim() == 0 else v for k, v in state.items()}


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

    def __init__(self, root: Path, rank: int, keep: int = 2, local_rank: Optional[int] = None, group=None,
                 trainable_only: bool = False):
        """``group``: a process group for host-side messages (gloo; None: the default group, then gloo too).
        ``trainable_only`` (LoRA): the weights saved are the trainable ones only; frozen ones are
        expected to be in the model already when a checkpoint is loaded (built from model.path)."""
        self.root, self.rank, self.keep, self.group = Path(root), rank, keep, group
        self.trainable_only = trainable_only
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def _all_gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _hash_mine(self, root: Path, files: List[str]) -> Dict[str, List[str]]:
        return file_digests(root, [f for f in files if _mine(f, self.rank, self.world)])

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
        engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=self.trainable_only)
        torch.save({"rng": rng_state(), **rank_state}, tmp / f"rank_{self.rank:05d}.pt")
        _save_gpu_share(engine, tmp, self.rank)  # what DeepSpeed's own files leave out (gpu_share_optimizer)
        if self.rank == 0:
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        _barrier()
        if self.local_rank == 0 and self.rank != 0:
            # rank 0's fsync below flushes only what its own node wrote; on a filesystem shared by
            # several nodes each node flushes its ranks' files (all written: the barrier above)
            # before rank 0 marks the step complete
            _fsync_tree(tmp)
        # every rank hashes the files it wrote (rank 0's listing: one view of the directory)
        files = _files(tmp) if self.world == 1 else self._all_gather(_files(tmp) if self.rank == 0 else None)[0]
        digests = {k: v for part in self._all_gather(self._hash_mine(tmp, files)) for k, v in part.items()}
        if self.rank == 0:
            self._publish(tmp, final, step, {f: {"size": (tmp / f).stat().st_size, "sha256": digests[f]}
                                             for f in files})
        _barrier()
        return final

    def _publish(self, tmp: Path, final: Path, step: int, files: Dict[str, Dict[str, Any]]) -> None:
        """Rank 0, all files written: the manifest, the marker, then the rename that makes it a checkpoint."""
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync_tree(tmp)
        (tmp / COMPLETE).write_text(f"{step}\n")
        with open(tmp / COMPLETE, "rb") as f:
            os.fsync(f.fileno())
        _fsync_dir(tmp)  # the marker's directory entry, before the rename publishes it
        swap_in(tmp, final)  # replaces a checkpoint of the same step (e.g. final == periodic)
        self._prune(step)

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

    def verify(self, path: Path) -> None:
        """Collective. Checks ``path`` against its manifest: every file there with its size, none
        besides, each rank hashing the files it will read; every ``.pt`` file loadable as plain data;
        the step of trainer_state.json and of DeepSpeed's model states that of the manifest. Raises
        :class:`CheckpointError` naming the files that are wrong (on any rank)."""
        problems = self._all_gather(self._problems(Path(path)))
        found = [p for part in problems for p in part]
        if found:
            raise CheckpointError("; ".join(dict.fromkeys(found)))

    def _problems(self, path: Path) -> List[str]:
        manifest = path / MANIFEST
        try:
            record = json.loads(manifest.read_text())
            step, files = int(record["step"]), dict(record["files"])
        except FileNotFoundError:
            return [f"{manifest} is missing (not a checkpoint written by msa-train, or damaged)"]
        except (ValueError, KeyError, TypeError) as e:
            return [f"{manifest} is not a valid manifest ({type(e).__name__}: {e})"]
        m = _STEP_DIR.match(path.name)
        if m and int(m.group(1)) != step:
            return [f"{manifest} is the manifest of step {step}, not of {path.name}"]
        present = set(_files(path))
        out = [f"{path / f} is missing" for f in sorted(set(files) - present)]
        out += [f"{path / f} is not in the manifest" for f in sorted(present - set(files))]
        for f in sorted(set(files) & present):
            size = (path / f).stat().st_size
            if size != files[f]["size"]:
                out.append(f"{path / f} has {size} bytes, the manifest {files[f]['size']} (truncated or replaced)")
        if out:
            return out
        for f, digest in self._hash_mine(path, sorted(files)).items():
            if digest != files[f]["sha256"]:
                out.append(f"{path / f} does not match its sha256 in the manifest (corrupt or replaced)")
        if out:
            return out
        try:
            state_step = self.read_trainer_state(path)["step"]
        except (ValueError, KeyError) as e:
            return [f"{path / 'trainer_state.json'} is not a valid trainer state ({type(e).__name__}: {e})"]
        if state_step != step:
            out.append(f"{path / 'trainer_state.json'} is at step {state_step}, the manifest at step {step}")
        for f in sorted(files):
            if not f.endswith(".pt") or not _mine(f, self.rank, self.world):
                continue
            try:  # mmap (zip format, torch's default): the pickled structure is read, the tensors' bytes are not
                state = safe_load(path / f, map_location="cpu", mmap=zipfile.is_zipfile(path / f))
            except CheckpointError as e:
                out.append(str(e))
                continue
            if f.endswith("model_states.pt") and isinstance(state, dict) and state.get("global_steps") != step:
                out.append(f"{path / f} holds DeepSpeed's state of step {state.get('global_steps')}, "
                           f"the checkpoint is of step {step}")
        return out

    def resolve(self, resume: str) -> Optional[Path]:
        """``none`` -> None; ``auto`` -> the newest complete checkpoint that verifies (or None when
        there is none at all); else the given directory, which must verify. Collective (it first runs
        :meth:`recover`). With ``auto`` a checkpoint that does not verify is renamed
        ``corrupt_step_N`` (kept for inspection) with a warning saying why, and the next older one is
        tried; when none verifies it raises, naming each one's problem."""
        self.recover()
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume)
            if not (path / COMPLETE).is_file():
                raise ValueError(f"train.resume={resume!r} is not a complete checkpoint directory (no {COMPLETE} file)")
            try:
                self.verify(path)
            except CheckpointError as e:
                raise CheckpointError(f"train.resume={resume!r} does not verify: {e}") from None
            return path
        skipped = []
        for _, path in reversed(complete_checkpoints(self.root)):
            try:
                self.verify(path)
            except CheckpointError as e:
                skipped.append(f"{path.name}: {e}")
                self._set_aside(path, str(e))
                continue
            return path
        if skipped:
            raise CheckpointError(f"train.resume=auto: no checkpoint under {self.root} verifies (each set aside as "
                                  f"corrupt_step_N): {' | '.join(skipped)}")
        aside = sorted(p.name for p in self.root.glob("corrupt_step_*")) if self.root.is_dir() else []
        if aside and self.rank == 0:  # an earlier resume set every checkpoint aside: say so before step 0
            log.warning("train.resume=auto: no checkpoint to resume under %s, only %s set aside earlier as not "
                        "verifying; training starts from step 0", self.root, ", ".join(aside))
        return None

    def _set_aside(self, path: Path, why: str) -> None:
        """Collective: move a checkpoint that does not verify out of the ``step_*`` names (pruning,
        ``resume=auto`` and the newer-checkpoint check no longer see it)."""
        aside = path.with_name(f"corrupt_{path.name}")
        if self.rank == 0:
            log.warning("train.resume=auto: skipping %s, which does not verify (%s); moved to %s", path, why, aside)
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(path, aside)
            _fsync_dir(path.parent)
        _barrier()

    @staticmethod
    def read_trainer_state(path: Path) -> Dict[str, Any]:
        return json.loads((Path(path) / "trainer_state.json").read_text())

    def load(self, engine, path: Path, weights_only: bool = False) -> tuple[Dict[str, Any], Dict[str, Any]]:
        """Restore engine (weights, optimizer, LR schedule) and RNG; returns (trainer_state, rank_state).
        ``weights_only`` (evaluation) restores the weights alone: rank_state is then empty. Every file
        is read as plain data (:func:`safe_load`); run :meth:`verify` first."""
        path = Path(path)
        if not isinstance(engine.checkpoint_engine, _SafeLoading):
            engine.checkpoint_engine = _SafeLoading(engine.checkpoint_engine)
        # ZeRO-3 keeps the weights in the optimizer's partitions: read them there (load_optimizer_states)
        # rather than through DeepSpeed's zero_to_fp32, which reads every rank's files without weights_only
        zero3 = engine.zero_optimization_partition_weights()
        try:
            load_path, _ = engine.load_checkpoint(str(path), tag=DS_TAG,
                                                  load_optimizer_states=zero3 or not weights_only,
                                                  load_lr_scheduler_states=not weights_only,
                                                  load_module_strict=not self.trainable_only)
        except CheckpointError:
            raise
        except (RuntimeError, AssertionError, KeyError, OSError, ValueError) as e:
            raise CheckpointError(f"{path / DS_TAG}: DeepSpeed could not load it ({type(e).__name__}: {e})") from e
        if load_path is None:
            raise CheckpointError(f"{path / DS_TAG}: DeepSpeed found no model states to load")
        trainer_state = self.read_trainer_state(path)
        if engine.global_steps != trainer_state["step"]:
            raise CheckpointError(f"{path / DS_TAG} holds DeepSpeed's state of step {engine.global_steps}, "
                                  f"{path / 'trainer_state.json'} step {trainer_state['step']}")
        if weights_only:
            return trainer_state, {}
        rank_file = path / f"rank_{self.rank:05d}.pt"
        if not rank_file.is_file():
            raise ValueError(f"{path} has no state for rank {self.rank}: was it saved with a different world size?")
        rank_state = safe_load(rank_file)
        _restore_gpu_share(engine, path, self.rank)
        set_rng_state(rank_state.pop("rng"))
        return trainer_state, rank_state
