"""Qwen3 (HF `Qwen3ForCausalLM`) for msa_train.

Patching keeps every HF module and parameter name: the attention module's q/k/v/o projections,
q_norm/k_norm (applied per head before RoPE), RoPE and the layer norms run unchanged; only the
attention call is routed to msa_train's backend, and NSA layers gain `self_attn.nsa`.
"""
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3ForCausalLM

from msa_train.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="qwen3",
    causal_lm_cls=Qwen3ForCausalLM,
    attention_cls=Qwen3Attention,
    layers=lambda model: model.model.layers,
)
