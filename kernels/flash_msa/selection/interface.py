"""Public selected attention: validation, then dispatch to one implementation."""
from __future__ import annotations

from typing import Optional

import torch

from flash_msa.selection.fmsa import fmsa_selected_attention, kernel_limits_error
from flash_msa.selection.naive import selected_attention_chunked
from flash_msa.selection.nsa import nsa_selected_attention
from flash_msa.utils.validation import (
    check_block_indices, check_block_size, check_distinct_entries, check_cu_seqlens, check_qkv, check_scale)
from flash_msa.utils.varlen import flatten_batch

SELECTED_BLOCK_SIZES = (16, 32, 64, 128)
# Implementations that exist in this build; "auto" resolves to one of them.
IMPLS: dict[str, object] = {}
ALL_IMPLS = ("auto", "fmsa", "nsa", "reference")


def _reference(q, k, v, block_indices, block_size, cu_seqlens, scale):
    B, T, HQ, D = q.shape
    qf, cu = flatten_batch(q, cu_seqlens)
    o = selected_attention_chunked(
        qf, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]),
        block_indices.reshape(B * T, *block_indices.shape[2:]), block_size, cu, scale)
    return o.view(B, T, HQ, D)


IMPLS["reference"] = _reference
IMPLS["fmsa"] = fmsa_selected_attention
IMPLS["nsa"] = nsa_selected_attention


def choose_impl(q: torch.Tensor, k: torch.Tensor, S: int, block_size: int) -> str:
    """The implementation "auto" runs for this shape (see docs/dispatch.md).

    On an H200 the KV-block-centric kernel was faster than the query-centric one at every
    measured G (1..16), T (8K..1M) and in forward and forward + backward, so "auto" picks
    "fmsa" wherever the kernels support the shape, and the reference elsewhere.
    """
    if q.device.type != "cuda" or "fmsa" not in IMPLS:
        return "reference"
    if kernel_limits_error(q, S) is not None:
        return "reference"
    return "fmsa"


def selected_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor, *,
    block_size: int, cu_seqlens: Optional[torch.Tensor] = None, scale: Optional[float] = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of each query over the KV blocks it selected.

    Args:
        q: [B, T, HQ, D] queries.
        k, v: [B, T, HK, D] keys and values, HQ a multiple of HK (GQA group 1..16).
        block_indices: int32 [B, T, HK, S]. Entry b >= 0 names KV block b of the query's
            sequence (keys [b*block_size, (b+1)*block_size) counted from the sequence start);
            -1 means unused. Entries of one query must be distinct (checked, unless inside
            ``flash_msa.trusted_inputs()`` on an accelerator); entries past the query's own block
            are ignored; keys after the query are masked (causal).
        block_size: keys per block, one of 16, 32, 64, 128.
        cu_seqlens: optional int32 [N+1] offsets of N packed sequences (then B == 1).
        scale: softmax scale, default 1/sqrt(D).
        impl: "auto", "fmsa" (KV-block-centric), "nsa" (query-centric) or "reference".

    Returns:
        o: [B, T, HQ, D] in the dtype of q. A query with no valid key gets 0.
        Gradients flow to q, k and v.
    """
    B, T, HQ, HK, D = check_qkv(q, k, v)
    check_cu_seqlens(cu_seqlens, B, T, q.device)
    check_block_indices(block_indices, B, T, HK, q.device)
    check_distinct_entries(block_indices)
    check_block_size("block_size", block_size, SELECTED_BLOCK_SIZES)
    scale = check_scale(scale, D)
    if impl not in ALL_IMPLS:
        raise ValueError(f"impl must be one of {ALL_IMPLS}, got {impl!r}")
    return run_selected(q, k, v, block_indices, block_size, cu_seqlens, scale, impl)


def run_selected(q, k, v, block_indices, block_size: int, cu_seqlens, scale: float, impl: str) -> torch.Tensor:
    """Dispatch without validation, for callers whose inputs are already checked (nsa_attention)."""
    if impl == "auto":
        impl = choose_impl(q, k, block_indices.shape[-1], block_size)
    if impl not in IMPLS:
        available = ", ".join(["auto", *sorted(IMPLS)])
        raise NotImplementedError(f"selected_attention impl={impl!r} is not available in this build; available: {available}")
    return IMPLS[impl](q, k, v, block_indices, block_size, cu_seqlens, scale)
