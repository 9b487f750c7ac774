"""Parallelisation: activation checkpointing, ZeRO-3 leaf modules, and the DeepSpeed engine.

We call DeepSpeed directly (``deepspeed.initialize``; ZeRO-3 construction through transformers'
``HfDeepSpeedConfig``, which enters ``deepspeed.zero.Init``) rather than through
accelerate's DeepSpeed plugin because the trainer needs the engine's own API that accelerate hides
or re-wraps: ``save_checkpoint`` / ``load_checkpoint`` into our atomic temp directory with a fixed
tag, the LR scheduler built from the generated JSON, ``get_global_grad_norm``, and ZeRO-3 leaf
modules. Launchers (torchrun, deepspeed, accelerate launch) set environment variables, which
:mod:`msa_train.parallel.distributed` reads, so all three work unchanged (the ``--local_rank=N``
that the deepspeed launcher also appends is dropped by :func:`msa_train.cli.take_launcher_args`).
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Dict, List

import torch.nn as nn

from msa_train.parallel.memory import layer_checkpoint, tile_token_layers


class ModelInitContext:
    """Context for building the model. Under ZeRO-3 it registers the DeepSpeed config with
    transformers (``HfDeepSpeedConfig``), so ``from_config`` / ``from_pretrained`` construct the
    model inside ``deepspeed.zero.Init`` and load checkpoint shards straight into partitioned
    parameters: a model larger than one device's memory is never materialised whole.

    transformers holds that registration through a weak reference, so keep this object alive as
    long as the model is used (the trainer keeps it).
    """

    def __init__(self, zero_stage: int, ds_config: Dict[str, Any]):
        self.hf_ds_config = None
        if zero_stage == 3:
            try:
                from transformers.integrations import HfDeepSpeedConfig
            except ImportError:  # older transformers
                from transformers.deepspeed import HfDeepSpeedConfig
            self.hf_ds_config = HfDeepSpeedConfig(ds_config)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def model_init_context(zero_stage: int, ds_config: Dict[str, Any]) -> ModelInitContext:
    """See :class:`ModelInitContext`."""
    return ModelInitContext(zero_stage, ds_config)


def parallelize(model: nn.Module, *, activation_checkpointing: bool, zero_stage: int,
                offload_activations: bool = False, tile_tokens: int = 0, fused_ops: bool = False) -> nn.Module:
    """Apply memory/parallel transforms to the patched HF model (in place).

    * Activation checkpointing: HF's per-decoder-layer checkpointing, non-reentrant (works with
      ZeRO-3 and with the NSA hidden-state pre-hook, which re-runs during recomputation). With
      ``offload_activations`` the layers' saved inputs (the hidden states, ``T x hidden`` per layer)
      are held in pinned host memory between the forward and the layer's backward.
    * ``tile_tokens > 0``: the token-wise layers keep less for the backward (``memory.tile_token_layers``):
      each decoder MLP runs in tiles of at most that many tokens (DeepSpeed's ``TiledMLP``), and the
      RMSNorms save their input only and recompute their fp32 insides in the backward, tile by tile.
    * ``fused_ops``: the RMSNorms, the attention layers' RoPE and the MLPs' SwiGLU run as single
      Triton kernels (``msa_train.models.fused_ops``); fused norms keep only their input, so tiling
      leaves them alone, and a tiled MLP runs the fused SwiGLU tile by tile.
    * ZeRO-3: NSA modules use their sub-modules' weights as tensors (compression maps, gate), so
      they are ZeRO-3 leaf modules: all their parameters are gathered when the NSA module runs.
    """
    if offload_activations and not activation_checkpointing:
        raise ValueError("offload_activations offloads the checkpointed layers' inputs: it needs activation_checkpointing")
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)
                  and hasattr(m, "_gradient_checkpointing_func")]
        if offload_activations and not layers:
            raise ValueError("parallel.offload_activations: the model has no checkpointed layers to offload")
        for layer in layers:  # HF's non-reentrant checkpoint, marking its recompute (memory.layer_checkpoint)
            layer._gradient_checkpointing_func = functools.partial(layer_checkpoint, offload=offload_activations)
    if fused_ops:
        from msa_train.models import family_of
        from msa_train.models.fused_ops import fuse_token_ops

        fuse_token_ops(model, family_of(model.config).attention_modules(model))
    if tile_tokens:
        tile_token_layers(model, tile_tokens)
    model.config.use_cache = False
    if zero_stage == 3:
        from deepspeed.utils import set_z3_leaf_modules
        from flash_msa.nsa import NativeSparseAttention

        if any(isinstance(m, NativeSparseAttention) for m in model.modules()):
            set_z3_leaf_modules(model, [NativeSparseAttention])
    return model


def build_engine(model: nn.Module, ds_config: Dict[str, Any]):
    """``deepspeed.initialize`` with the optimizer and LR scheduler described by ``ds_config``.

    Returns:
        (engine, optimizer, lr_scheduler)
    """
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    from msa_train.parallel.deepspeed_config import WSD_SCHEDULER
    from msa_train.parallel.lr_schedule import WarmupStableDecayLR

    wait_for_extension_builds(ds_config)
    # WarmupCosineLR warns that it has not started while the engine is built; the trainer starts it
    # right after (see Trainer._build_optimizer), so the warning is noise.
    quiet = _DropMessage("before it has started")
    client_scheduler = None
    if ds_config.get("scheduler", {}).get("type") == WSD_SCHEDULER:  # ours: DeepSpeed does not know the name
        params = ds_config["scheduler"]["params"]
        ds_config = {k: v for k, v in ds_config.items() if k != "scheduler"}
        client_scheduler = functools.partial(WarmupStableDecayLR, **params)  # called with the optimizer
    ds_logger.addFilter(quiet)
    try:
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config,
            lr_scheduler=client_scheduler)
    finally:
        ds_logger.removeFilter(quiet)
    return engine, optimizer, scheduler


# A build of one of DeepSpeed's C++ extensions takes about 1.5 minutes on two cores (cpu_adam); a lock
# file older than this was left by a build that never finished
STALE_BUILD_LOCK_S = 600


def extension_build_locks(ds_config: Dict[str, Any]) -> List[Path]:
    """The lock files of the C++ extensions that DeepSpeed compiles on first use for ``ds_config``'s
    optimizer: cpu_adam for an offloaded optimizer (a partial offload's GPU share is torch's AdamW),
    fused_adam otherwise; none for torch's AdamW."""
    optimizer = ds_config.get("optimizer", {})
    if optimizer.get("params", {}).get("torch_adam", True):
        return []
    name = "cpu_adam" if ds_config.get("zero_optimization", {}).get("offload_optimizer") else "fused_adam"
    try:  # where torch.utils.cpp_extension.load builds: private, and its layout changes between versions
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return []
    return [Path(_get_build_directory(name, verbose=False)) / "lock"]


def wait_for_extension_builds(ds_config: Dict[str, Any], stale_after_s: float = STALE_BUILD_LOCK_S,
                              poll_s: float = 1.0) -> None:
    """Wait while another process builds one of the extensions ``ds_config`` needs; raise on a lock
    that a killed build left behind.

    torch's extension loader takes a lock file for a build and removes it when the build ends; every
    other process waits, with no time limit, until the file is gone. A build that was killed (a
    stopped job, a machine that went away) leaves the file, and every later run then waits silently
    for ever. Waiting here instead, with the lock's age as the limit, turns that into an error that
    names the file."""
    for lock in extension_build_locks(ds_config):
        told = False
        while True:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                break
            if age > stale_after_s:
                raise ValueError(
                    f"{lock}: a lock left by a build of DeepSpeed's {lock.parent.name} extension that never finished "
                    f"({age / 60:.0f} minutes old; a build takes a few). torch would wait on it for ever: remove "
                    f"it (or the directory {lock.parent}) and run again")
            if not told:
                logging.getLogger(__name__).warning(
                    "waiting for another process's build of DeepSpeed's %s extension (%s)", lock.parent.name, lock)
                told = True
            time.sleep(poll_s)


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def _gpu_share_stepper(engine):
    """DeepSpeed's second optimizer under a ZeRO-3 partial offload (its ``backup_optimizer``), or None."""
    return getattr(getattr(engine, "optimizer", None), "backup_optimizer", None)


def gpu_share_optimizer(engine):
    """Under DeepSpeed's ZeRO-3 partial offload (``parallel.offload_ratio`` < 1) the optimizer's GPU
    sub-groups are stepped by a second optimizer (its ``backup_optimizer``, torch's AdamW, built once
    from the first's settings) that neither DeepSpeed's checkpoint (stage3.py's ``_rigid_state_dict``
    saves the host optimizer's state only) nor its LR scheduler (it sets the host optimizer's groups)
    reaches. Returns (that optimizer, {sub-group index: its fp32 partition}), or None without a
    partial offload; the checkpoint saves its state and :func:`sync_gpu_share` its settings."""
    backup = _gpu_share_stepper(engine)
    devices = getattr(engine.optimizer, "subgroup_to_device", None) if backup is not None else None
    if not devices:
        return None
    flat = engine.optimizer.fp32_partitioned_groups_flat
    return backup, {i: flat[i] for i, where in devices.items() if where != "cpu"}


SYNCED = ("lr", "betas", "eps", "weight_decay")


def sync_gpu_share(engine) -> None:
    """Before a step: the GPU share's optimizer takes the host optimizer's learning rate (which the
    schedule moves) and AdamW settings, group by group, so both shares train alike. Python only,
    over the optimizer's few parameter groups."""
    backup = _gpu_share_stepper(engine)
    if backup is None:
        return
    for mine, theirs in zip(backup.param_groups, engine.optimizer.param_groups):
        for key in SYNCED:
            if key in theirs:
                mine[key] = theirs[key]
