"""Public selected attention: validation, then dispatch to one implementation.

The registry of selected-attention implementations (``IMPLS``) and the one decision of which runs
(:func:`resolve_impl`, used by ``selected_attention`` and ``nsa_attention`` alike) live here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from flash_msa.selection.fmsa import (
    check_kernel_limits, fmsa_backward, fmsa_forward, fmsa_selected_attention, kernel_limits_error)
from flash_msa.selection.naive import selected_attention_chunked
from flash_msa.selection.qc import qc_backward, qc_forward, qc_selected_attention
from flash_msa.utils.validation import (
    SELECTED_BLOCK_SIZES, check_block_indices, check_block_size, check_cu_seqlens, check_entries, check_qkv,
    check_scale)
from flash_msa.utils.varlen import flatten_batch

ALL_IMPLS = ("auto", "fmsa", "qc", "reference")


@dataclass(frozen=True)
class SelectedImpl:
    """One selected-attention implementation: ``attention`` on validated [B, T, H, D] inputs; the
    Triton loop orders also give the flat ``forward`` -> (o, lse, state) and ``backward`` that the
    whole-op Function composes (flash_msa/fused.py)."""
    attention: Callable
    forward: Optional[Callable] = None
    backward: Optional[Callable] = None
    kernels: bool = True  # Triton kernels: CUDA, or the CPU interpreter (TRITON_INTERPRET=1)


def _reference(q, k, v, block_indices, block_size, cu_seqlens, scale):
    B, T, HQ, D = q.shape
    qf, cu = flatten_batch(q, cu_seqlens)
    o = selected_attention_chunked(
        qf, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]),
        block_indices.reshape(B * T, *block_indices.shape[2:]), block_size, cu, scale)
    return o.view(B, T, HQ, D)


# The implementations of this build, by impl name; "auto" resolves to one of them.
IMPLS: dict[str, SelectedImpl] = {
    "reference": SelectedImpl(_reference, kernels=False),
    "fmsa": SelectedImpl(fmsa_selected_attention, fmsa_forward, fmsa_backward),  # KV-block-centric
    "qc": SelectedImpl(qc_selected_attention, qc_forward, qc_backward),  # query-centric
}


def choose_impl(q: torch.Tensor, k: torch.Tensor, S: int, block_size: int) -> str:
    """The implementation "auto" runs for this shape (see docs/dispatch.md).

    On an H200 the KV-block-centric kernel was faster than the query-centric one at every
    measured G (1..16), T (8K..1M) and in forward and forward + backward, so "auto" picks
    "fmsa" on CUDA wherever the kernels support the shape, and the reference elsewhere (CPU: the
    interpreter is for tests, which ask for a kernel by name).
    """
    if q.device.type != "cuda" or "fmsa" not in IMPLS:
        return "reference"
    if kernel_limits_error(q, S) is not None:
        return "reference"
    return "fmsa"


def resolve_impl(impl: str, q: torch.Tensor, k: torch.Tensor, S: int, block_size: int) -> str:
    """The selected-attention implementation a call runs, decided here only (selected_attention and
    nsa_attention): "auto" by :func:`choose_impl`; "reference" as asked; a kernel ("fmsa", "qc") as
    asked, or a ValueError/TypeError when it cannot run: a shape or dtype the kernels do not take,
    or a CPU tensor outside Triton's interpreter (``TRITON_INTERPRET=1``). Never a silent fallback.
    """
    if impl not in ALL_IMPLS:
        raise ValueError(f"impl must be one of {ALL_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = choose_impl(q, k, S, block_size)
    if impl not in IMPLS:
        available = ", ".join(["auto", *sorted(IMPLS)])
        raise NotImplementedError(f"selected_attention impl={impl!r} is not available in this build; available: {available}")
    if IMPLS[impl].kernels:
        check_kernel_limits(q, S)
    return impl


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
            -1 means unused. Entries must lie in [-1, n_blocks), n_blocks = cdiv(L, block_size) of
            the query's sequence of L tokens, and one query's entries must be distinct (both
            checked, unless inside ``flash_msa.trusted_inputs()`` on an accelerator); entries past
            the query's own block are ignored; keys after the query are masked (causal).
        block_size: keys per block, one of 16, 32, 64, 128.
        cu_seqlens: optional int32 [N+1] offsets of N packed sequences (then B == 1).
        scale: softmax scale, finite and positive; default 1/sqrt(D).
        impl: "auto", "fmsa" (KV-block-centric), "qc" (query-centric) or "reference" (see
            :func:`resolve_impl`: an explicit kernel on a CPU tensor raises unless TRITON_INTERPRET=1).

    Returns:
        o: [B, T, HQ, D] in the dtype of q. A query with no valid key gets 0.
        Gradients flow to q, k and v.
    """
    B, T, HQ, HK, D = check_qkv(q, k, v)
    check_cu_seqlens(cu_seqlens, B, T, q.device)
    S = check_block_indices(block_indices, B, T, HK, q.device)
    check_block_size("block_size", block_size, SELECTED_BLOCK_SIZES)
    check_entries(block_indices, block_size, cu_seqlens)
    scale = check_scale(scale, D)
    impl = resolve_impl(impl, q, k, S, block_size)
    return run_selected(q, k, v, block_indices, block_size, cu_seqlens, scale, impl)


def run_selected(q, k, v, block_indices, block_size: int, cu_seqlens, scale: float, impl: str) -> torch.Tensor:
    """Dispatch without validation to ``impl`` from :func:`resolve_impl`, for callers whose inputs
    are already checked (nsa_attention)."""
    return IMPLS[impl].attention(q, k, v, block_indices, block_size, cu_seqlens, scale)
