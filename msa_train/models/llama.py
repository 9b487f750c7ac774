"""Llama (HF `LlamaForCausalLM`) for msa_train.

Patching keeps every HF module and parameter name: the attention module's q/k/v/o projections,
RoPE and the layer norms run unchanged; only the
attention call is routed to msa_train's backend, and NSA layers gain `self_attn.nsa`.
"""
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM

from msa_train.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="llama",
    causal_lm_cls=LlamaForCausalLM,
    attention_cls=LlamaAttention,
    layers=lambda model: model.model.layers,
)
