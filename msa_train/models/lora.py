"""LoRA on a patched model, through peft (``model.lora.r > 0``; docs/trainer.md).

:func:`apply_lora` injects peft's LoRA layers into the model in place (``peft.inject_adapter_in_model``:
no ``PeftModel`` wrapper, so the trainer, the loss module, sequence parallelism and the KV-cache
``generate()`` see the same model object as without LoRA). Then only the adapters and, by
``model.lora.nsa``, NSA's own parameters train:

- ``train`` (default): NSA's compression phi and gate projection train fully. They are new to a
  dense checkpoint, so there is no pretrained value for a low-rank update to stay near;
- ``lora``: the gate projection gets adapters as well (phi still trains fully);
- ``freeze``: NSA's parameters are frozen too (a model already trained with NSA).

Checkpoints hold only what trains (``CheckpointManager.save(..., trainable_only=True)``); the frozen
weights come back from ``model.path`` (or the seed) when the run is built again. The HF export is
merged (:func:`merged_state_dict`): ``W + (alpha / r) B A`` under the original parameter names, so
``<run>/hf`` loads like any other export, without peft.
"""
from __future__ import annotations

import logging
from typing import Dict, Mapping, Tuple

import torch
import torch.nn as nn

from msa_train.config import LoraConfig

log = logging.getLogger(__name__)

ADAPTER = "default"
NSA_GATE = "gate"  # NativeSparseAttention.gate: hidden -> 3 gates per query head
_NSA = ".nsa."


def is_nsa_parameter(name: str) -> bool:
    return _NSA in f".{name}"


def _nsa_trains(name: str, cfg: LoraConfig) -> bool:
    """Whether NSA's parameter ``name`` trains: not under freeze, and not the gate's base under lora."""
    return cfg.nsa != "freeze" and not (cfg.nsa == "lora" and f".{NSA_GATE}." in name)


def apply_lora(model: nn.Module, cfg: LoraConfig, dtype: torch.dtype) -> Tuple[int, int]:
    """Inject LoRA adapters (``cfg``) into ``model`` in place and set what trains.

    Returns:
        (trainable, total) parameter counts (ZeRO-3's partitioned parameters counted whole).

    Raises:
        ValueError: when no module of the model matches ``cfg.target_modules``.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    targets = list(cfg.target_modules)
    has_nsa = any(is_nsa_parameter(n) for n, _ in model.named_parameters())
    if cfg.nsa == "lora" and has_nsa:
        targets.append(NSA_GATE)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in cfg.target_modules if t not in names]
    if len(missing) == len(cfg.target_modules):
        raise ValueError(f"model.lora.target_modules={list(cfg.target_modules)}: no linear layer of the model has "
                         f"these names; its linear layers are named {sorted(names)}")
    if missing:
        log.warning("model.lora.target_modules: %s match no linear layer of the model (skipped)", missing)
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                              target_modules=[t for t in targets if t in names or t == NSA_GATE])
    # peft matches a target name against the last part of a module's name: "gate" is NSA's gate
    # projection only (the MLP's is gate_proj), and the LM head is never named here
    inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        if "lora_" in name:
            # peft makes the adapters fp32; DeepSpeed's bf16 engine keeps its own fp32 master copy of
            # every trainable parameter and wants them in the model's dtype
            p.data = p.data.to(dtype)
            p.requires_grad_(True)
        else:
            p.requires_grad_(is_nsa_parameter(name) and _nsa_trains(name, cfg))
    trainable = sum(_numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(_numel(p) for p in model.parameters())
    return trainable, total


def count_trainable(model: nn.Module, cfg: LoraConfig) -> Tuple[int, int]:
    """(trainable, adapter) parameter counts once :func:`apply_lora` has run on ``model`` (which may
    be a meta-device model: nothing is injected here): r (in + out) per adapted linear layer, plus
    NSA's parameters by ``cfg.nsa``. The memory planner counts gradients and optimizer state from it."""
    targets = set(cfg.target_modules)
    adapters = 0
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, nn.Linear) and (leaf in targets or (cfg.nsa == "lora" and leaf == NSA_GATE
                                                               and is_nsa_parameter(f"{name}.weight"))):
            adapters += cfg.r * (m.in_features + m.out_features)
    nsa = sum(_numel(p) for name, p in model.named_parameters() if is_nsa_parameter(name) and _nsa_trains(name, cfg))
    return adapters + nsa, adapters


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def merged_state_dict(state: Mapping[str, torch.Tensor], cfg: LoraConfig) -> Dict[str, torch.Tensor]:
    """A LoRA model's full state dict (``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``,
    ...) as the plain model's: ``...q_proj.weight = W + (alpha / r) B A`` (computed in fp32, stored in
    W's dtype, on the host), adapters dropped, every other name as it was."""
    scale = cfg.alpha / cfg.r
    out: Dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            prefix, leaf = name.split(".base_layer.", 1)
            plain = f"{prefix}.{leaf}"
            a = state.get(f"{prefix}.lora_A.{ADAPTER}.weight") if leaf == "weight" else None
            if a is not None:
                b = state[f"{prefix}.lora_B.{ADAPTER}.weight"]
                # to the host as it is made: the export runs with the engine still on the GPU
                value = (value.float() + scale * (b.float() @ a.float())).to(value.dtype).cpu()
            out[plain] = value
        else:
            out[name] = value
    return out

