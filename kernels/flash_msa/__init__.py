"""flash_msa: Triton kernels for Native Sparse Attention, with the Flash-MSA KV-block-centric
selected attention, and a PyTorch reference beside every kernel (flash_msa.reference)."""
from flash_msa import decode, reference, tuning
from flash_msa.nsa import NativeSparseAttention, nsa_attention
from flash_msa.selection import selected_attention
from flash_msa.utils.validation import trusted_inputs

__version__ = "0.1.0"
__all__ = ["NativeSparseAttention", "decode", "nsa_attention", "reference", "selected_attention", "trusted_inputs",
           "tuning"]
