"""Qwen2 (HF `Qwen2ForCausalLM`) for msa_train.

Patching keeps every HF module and parameter name: the attention module's q/k/v/o projections,
q/k/v biases, RoPE and the layer norms run unchanged; only the
attention call is routed to msa_train's backend, and NSA layers gain `self_attn.nsa`.
"""
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM

from msa_train.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="qwen2",
    causal_lm_cls=Qwen2ForCausalLM,
    attention_cls=Qwen2Attention,
    layers=lambda model: model.model.layers,
)
