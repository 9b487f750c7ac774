"""The DeepSpeed JSON, generated from the typed config (never written by hand beside it)."""
from __future__ import annotations

import math
from typing import Any, Dict

from msa_train.config import ParallelConfig, TrainConfig


PARTIAL_OFFLOAD_SUB_GROUP = 100_000_000  # elements per optimizer sub-group under a partial offload


def build_deepspeed_config(parallel: ParallelConfig, train: TrainConfig, *, world_size: int,
                           bf16: bool) -> Dict[str, Any]:
    """DeepSpeed config dict for ZeRO ``parallel.zero_stage`` with AdamW and warmup + cosine LR.

    Args:
        world_size: data-parallel ranks (one packed sequence per rank per micro step).
        bf16: train in bf16 with fp32 master weights (DeepSpeed's bf16 optimizer).

    ``parallel.optimizer=torch`` (default) uses torch's AdamW; ``deepspeed`` uses DeepSpeed's
    FusedAdam, or cpu_adam with optimizer offload, which JIT-compile C++/CUDA extensions on first
    use (minutes, and a compiler must be present) but step faster, cpu_adam much faster.
    """
    torch_adam = parallel.optimizer == "torch"
    zero: Dict[str, Any] = {"stage": parallel.zero_stage}
    if parallel.zero_stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=False, reduce_scatter=True)
    if parallel.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if parallel.offload_ratio < 1:
            zero["offload_optimizer"]["ratio"] = parallel.offload_ratio
            # DeepSpeed puts the last `ratio` of the optimizer's sub-groups on the host, counting
            # sub-groups, not elements; its default of 1e9 elements a sub-group gives an 8B model eight,
            # so the split would land on eighths. At 1e8 an 8B model has about 66, and the split lands
            # within a few percent (the GPU's first sub-group is the 525M-element embedding's)
            zero["sub_group_size"] = PARTIAL_OFFLOAD_SUB_GROUP
    if parallel.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if parallel.zero_stage == 3:
        # Gather every parameter per module call: no prefetch bucket heuristics, simplest memory model.
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.grad_accum * world_size,
        "gradient_clipping": train.grad_clip,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # torch's AdamW on offloaded (host) optimizer state: allowed, slower than cpu_adam
        "zero_force_ds_cpu_optimizer": not torch_adam,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": train.lr, "betas": list(train.betas), "eps": 1e-8,
                       "weight_decay": train.weight_decay, "torch_adam": torch_adam},
        },
        "scheduler": _scheduler(train),
        "steps_per_print": 10 ** 9,  # our logger reports; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }


# the "scheduler" type of train.lr_schedule=wsd: msa_train/parallel/lr_schedule.py, not one of DeepSpeed's
WSD_SCHEDULER = "WarmupStableDecayLR"


def _scheduler(train) -> Dict[str, Any]:
    """Linear warmup from lr / warmup_steps (step 0 trains too), then a cosine to lr * min_lr_ratio
    (DeepSpeed's WarmupCosineLR), or with train.lr_schedule=wsd the full rate until the last
    decay_fraction of the steps and the cosine over those (msa_train/parallel/lr_schedule.py, which
    build_engine hands to DeepSpeed itself)."""
    params = {"total_num_steps": train.steps, "warmup_num_steps": max(1, train.warmup_steps),
              "warmup_min_ratio": 1.0 / max(1, train.warmup_steps), "cos_min_ratio": train.min_lr_ratio,
              "warmup_type": "linear"}
    if train.lr_schedule == "wsd":
        # at least one step: a decay_fraction > 0 always decays
        decay = max(1, math.ceil(train.decay_fraction * train.steps))
        return {"type": WSD_SCHEDULER, "params": {**params, "decay_num_steps": decay}}
    return {"type": "WarmupCosineLR", "params": params}
