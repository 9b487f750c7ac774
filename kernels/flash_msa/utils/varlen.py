"""Index preparation from ``cu_seqlens`` shared by the references and kernels.

Everything here runs on the device of its input without a host sync.
"""
from __future__ import annotations

from typing import Optional

import torch


_DEFAULT_CU: dict = {}  # (B, T, device, stream) -> the cu_seqlens tensor default_cu_seqlens returns, oldest use first
_DEFAULT_CU_SIZE = 8


def default_cu_seqlens(B: int, T: int, device: torch.device) -> torch.Tensor:
    """The cu_seqlens of a dense batch [B, T] flattened to one packed stream of B*T tokens.

    The same tensor object for the same (B, T, device) and CUDA stream while nobody writes to it: the index
    metadata :func:`flash_msa.utils.cache.per_batch` derives from cu_seqlens is then computed
    once for all layers and calls of a dense batch, as for a packed batch's own cu_seqlens. A
    fresh tensor per call cost the whole NSA op about 190 small kernels and their launches per
    call at 8K (benchmarks/results/nsa/variants.md#nsa_host). Treat it as read-only; an in-place write is
    seen (``_version``) and the next call makes a new one. A fresh tensor every time inside
    ``torch.inference_mode`` (an inference tensor cannot be reused outside it, and per_batch does
    not cache them) and during CUDA graph capture (a captured tensor is filled only on replay).
    One tensor per stream: the caching allocator ties a tensor's memory to the stream it was
    made on, so one made on stream A and evicted (freed) while work queued on stream B still
    reads it could be handed out again to a kernel on A before that work has run.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from flash_msa.utils.cache import cuda_cache_scope

    cacheable, stream = cuda_cache_scope(device)
    cached = cacheable and not torch.is_inference_mode_enabled()
    key = (B, T, device, stream)
    cu = _DEFAULT_CU.pop(key, None) if cached else None  # re-inserted below: the most recently used last
    if cu is None or cu._version != 0:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    if cached:
        _DEFAULT_CU[key] = cu
        while len(_DEFAULT_CU) > _DEFAULT_CU_SIZE:  # the least recently used first
            del _DEFAULT_CU[next(iter(_DEFAULT_CU))]
    return cu


def flatten_batch(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, ...] -> ([B*T, ...], cu_seqlens). A dense batch becomes B packed sequences."""
    B, T = x.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(B, T, x.device)
    return x.reshape(B * T, *x.shape[2:]), cu_seqlens


def token_seq_bounds(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the T packed tokens, the start and end (exclusive) of its sequence. int64 [T] each."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(T, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True)  # [T] sequence id of each token
    return cu[seq], cu[seq + 1]


def num_compressed(lengths: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """Compressed tokens of a sequence of length L: those i with i*stride + block <= L."""
    return torch.where(lengths >= block, (lengths - block) // stride + 1, torch.zeros_like(lengths))


def compressed_cu_seqlens(cu_seqlens: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """cu_seqlens of the packed compressed stream: sequence s owns rows [out[s], out[s+1]).

    The total is at most T // stride, which sizes buffers without a host sync.
    """
    cu = cu_seqlens.to(torch.int64)
    counts = num_compressed(cu[1:] - cu[:-1], block, stride)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def compressed_rows(cu_seqlens: torch.Tensor, T: int, block: int, stride: int):
    """The T // stride rows of the packed compressed stream.

    Returns (cu_cmp int32 [N+1], first key int64 [Tc] of each row's block (0 for unused rows),
    valid bool [Tc]).
    """
    cu_cmp = compressed_cu_seqlens(cu_seqlens, block, stride)
    cu64, cc64 = cu_seqlens.to(torch.int64), cu_cmp.to(torch.int64)
    rows = torch.arange(T // stride, device=cu_seqlens.device)
    seq = torch.searchsorted(cc64[1:], rows, right=True).clamp_max(cu_cmp.numel() - 2)
    valid = rows < cc64[-1]
    first = cu64[seq] + (rows - cc64[seq]) * stride
    return cu_cmp, torch.where(valid, first, torch.zeros_like(first)), valid
