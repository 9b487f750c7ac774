"""What patching needs to know about one HF model family."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Type

import torch.nn as nn


@dataclass(frozen=True)
class ModelFamily:
    """One HF decoder family.

    Attributes:
        model_type: ``config.model_type`` (the registry key).
        causal_lm_cls: the HF ``*ForCausalLM`` class.
        attention_cls: the HF attention module class whose call we route to our backends.
        layers: model -> the list of decoder layers (each has ``.self_attn``).
    """
    model_type: str
    causal_lm_cls: Type[nn.Module]
    attention_cls: Type[nn.Module]
    layers: Callable[[nn.Module], nn.ModuleList]

    def attention_modules(self, model: nn.Module):
        for layer in self.layers(model):
            attn = layer.self_attn
            if not isinstance(attn, self.attention_cls):
                raise TypeError(f"expected {self.attention_cls.__name__} in {self.model_type} layers, "
                                f"got {type(attn).__name__}")
            yield attn
