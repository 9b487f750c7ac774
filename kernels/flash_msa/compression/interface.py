"""The Triton branch set of NSA, registered by flash_msa.nsa as ``BRANCHES["triton"]``.

Every function keeps the signature and packed-layout contract of its flash_msa.reference
counterpart (one stream [T, H, D] plus cu_seqlens; compressed rows packed per sequence
with cu_cmp in a buffer of T // stride rows).
"""
from types import SimpleNamespace

from flash_msa.compression.compress import compress_kv
from flash_msa.compression.compressed_attention import compressed_attention
from flash_msa.compression.topk import select_blocks
from flash_msa.fused import fused_impl, nsa_attention_fused
from flash_msa.gates import gate_combine
from flash_msa.window.interface import window_attention

TRITON_BRANCHES = SimpleNamespace(
    compress=compress_kv,
    compressed_attention=compressed_attention,
    select_blocks=select_blocks,
    window_attention=window_attention,
    combine=gate_combine,  # the fused fp32 gate combination
    # the attention branches and gates as one autograd Function (flash_msa/fused.py), for the
    # Triton selected-attention loop orders; the functions above otherwise
    fused=SimpleNamespace(impl=fused_impl, attention=nsa_attention_fused),
)

__all__ = ["TRITON_BRANCHES", "compress_kv", "compressed_attention", "select_blocks", "window_attention"]
