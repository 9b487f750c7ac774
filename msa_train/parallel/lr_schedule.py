"""Warmup-stable-decay (WSD) learning rate for the DeepSpeed engine (``train.lr_schedule=wsd``).

DeepSpeed's schedules (``deepspeed.runtime.lr_schedules``) have no stable phase, and a torch
``LambdaLR`` lacks the interface the trainer and DeepSpeed's checkpoint use (``last_batch_iteration``,
``step(i)``), so this is DeepSpeed's ``WarmupCosineLR`` with its ratio after the warm-up replaced:
the full rate until the last ``decay_num_steps`` steps, then a cosine to ``cos_min_ratio`` over them.
Its state (``last_batch_iteration``) is DeepSpeed's, saved and restored with the engine's checkpoint.
"""
from __future__ import annotations

import math

from deepspeed.runtime.lr_schedules import WarmupCosineLR


class WarmupStableDecayLR(WarmupCosineLR):
    def __init__(self, optimizer, total_num_steps: int, decay_num_steps: int, **kwargs):
        super().__init__(optimizer, total_num_steps, **kwargs)  # sets warmup_num_steps (at least 2)
        # the decay never reaches into the warm-up: at most every step after it (then it is
        # WarmupCosineLR's cosine)
        self.decay_num_steps = min(decay_num_steps, max(1, total_num_steps - self.warmup_num_steps))

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super().get_lr_ratio()
        # iterations count from 0: the last one is total_num_steps - 1 and ends at cos_min_ratio
        into_decay = self.last_batch_iteration - (self.total_num_steps - 1 - self.decay_num_steps)
        if into_decay <= 0:
            return 1.0
        progress = min(1.0, into_decay / self.decay_num_steps)
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2
