"""Input validation shared by every public flash_msa function.

Errors name the argument and say what was expected, so a wrong call fails at the
boundary instead of deep inside a Triton kernel or with a silently wrong result.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# NSA's sizes that the kernels (and the reference) take
CMP_BLOCK_SIZES = (8, 16, 32, 64)
CMP_STRIDES = (4, 8, 16, 32, 64)
SELECTED_BLOCK_SIZES = (16, 32, 64, 128)
MAX_TOPK = 32

_TRUSTED: ContextVar[bool] = ContextVar("flash_msa_trusted_inputs", default=False)


def _trusting(t: torch.Tensor) -> bool:
    """Whether the value checks are skipped for ``t``: on an accelerator, inside
    :func:`trusted_inputs` (of this thread or task)."""
    return t.device.type != "cpu" and _TRUSTED.get()


@contextmanager
def trusted_inputs() -> Iterator[None]:
    """Skip the value checks that need a device-to-host copy.

    Shapes, dtypes, devices and scalars are always checked. Three checks read values:
    ``cu_seqlens`` (starts at 0, non-decreasing, ends at T), ``block_indices`` (entries in
    [-1, n_blocks) of the query's sequence, distinct per query) and the gates (in [0, 1]). On an
    accelerator they are skipped inside this context; on the CPU they always run. The context is per thread (and asyncio task): another thread's calls keep their
    checks. The trainer validates ``cu_seqlens`` once per batch on the CPU and then runs its
    layers inside this context, so the hot path has no host sync.
    """
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def check_tensor(name: str, x, *, ndim: int, layout: str, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got {tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")


def check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
    """Checks q [B, T, HQ, D], k and v [B, T, HK, D]; returns (B, T, HQ, HK, D)."""
    check_tensor("q", q, ndim=4, layout="[B, T, HQ, D]")
    check_tensor("k", k, ndim=4, layout="[B, T, HK, D]")
    check_tensor("v", v, ndim=4, layout="[B, T, HK, D]")
    B, T, HQ, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, T, HK, D], got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(
            f"k must have shape [B={B}, T={T}, HK, D={D}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    HK = k.shape[2]
    if HK == 0 or HQ == 0 or HQ % HK != 0:
        raise ValueError(f"the number of query heads HQ={HQ} must be a positive multiple of the KV heads HK={HK}")
    if HQ // HK > 16:
        raise ValueError(f"GQA group HQ/HK must be between 1 and 16, got {HQ}/{HK} = {HQ // HK}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if T == 0:
        raise ValueError("q, k and v must hold at least one token (T >= 1)")
    if B == 0:
        raise ValueError(f"q, k and v must hold at least one sequence (B >= 1), got q {tuple(q.shape)}")
    if D == 0:
        raise ValueError(f"the head dim D must be at least 1, got q {tuple(q.shape)}")
    return B, T, HQ, HK, D


def check_cu_seqlens(cu_seqlens: Optional[torch.Tensor], B: int, T: int, device: torch.device) -> None:
    """Checks the FlashAttention varlen convention: B == 1 and int32 offsets [0, ..., T]."""
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an int32 torch.Tensor [N+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must have dtype int32, got {str(cu_seqlens.dtype).replace('torch.', '')}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have shape [N+1] with N >= 1 sequences, got {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B={B}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on the device of q ({device}), got {cu_seqlens.device}")
    if _trusting(cu_seqlens):
        return
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {values if len(values) < 20 else str(values[:20]) + '...'}")
    if values[-1] != T:
        raise ValueError(f"cu_seqlens must end at the number of tokens T={T}, got {values[-1]}")


def check_triton_device(q: torch.Tensor, subject: str, fallback: str) -> None:
    """Triton kernels run on CUDA tensors, or on any tensor under the CPU interpreter
    (``TRITON_INTERPRET=1``); elsewhere they would fail deep inside Triton. ``subject`` names the
    kernels with their verb ("the ... kernels need"), ``fallback`` the impl that runs there.
    Meta tensors pass: they only reach the checks that need no data, as in the tests."""
    if q.device.type not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(f"{subject} CUDA tensors, q is on {q.device}: use impl={fallback!r} (or 'auto', which "
                         "picks it there), or TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter")


def check_block_size(name: str, value, supported: Sequence[int]) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value not in supported:
        raise ValueError(f"{name} must be one of {tuple(supported)}, got {value!r}")


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_block_indices(block_indices, B: int, T: int, HK: int, device: torch.device) -> int:
    """Checks block_indices int32 [B, T, HK, S]; returns S."""
    if not isinstance(block_indices, torch.Tensor):
        raise TypeError(f"block_indices must be an int32 torch.Tensor [B, T, HK, S], got {type(block_indices).__name__}")
    if block_indices.dtype != torch.int32:
        raise TypeError(f"block_indices must have dtype int32, got {str(block_indices.dtype).replace('torch.', '')}")
    if block_indices.dim() != 4 or tuple(block_indices.shape[:3]) != (B, T, HK):
        raise ValueError(
            f"block_indices must have shape [B={B}, T={T}, HK={HK}, S], got {tuple(block_indices.shape)}")
    S = block_indices.shape[3]
    if S < 1:
        raise ValueError(f"block_indices must hold at least one entry per query (S >= 1), got S={S}")
    if block_indices.device != device:
        raise ValueError(f"block_indices must be on the device of q ({device}), got {block_indices.device}")
    return S


def check_entries(block_indices: torch.Tensor, block_size: int, cu_seqlens: Optional[torch.Tensor]) -> None:
    """Entries must lie in [-1, n_blocks), n_blocks = cdiv(L, block_size) for the L tokens of the
    query's sequence (a larger one names no block of it, another negative one nothing), and the
    entries of one query (-1 aside) must be distinct: a repeat would count its block twice.

    Value checks, so they follow the policy of :func:`trusted_inputs` (skipped inside it on an
    accelerator: no host sync per layer). Cost: a few elementwise ops and one sort of [B, T, HK, S].
    """
    if _trusting(block_indices):
        return
    B, T = block_indices.shape[:2]
    if cu_seqlens is None:
        n_blocks = torch.full((T,), -(-T // block_size), device=block_indices.device)
    else:
        cu = cu_seqlens.to(torch.int64)
        lens = cu[1:] - cu[:-1]
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)  # [T] sequence of each token
        n_blocks = (lens[seq] + block_size - 1) // block_size
    n_blocks = n_blocks.view(1, T, 1, 1)
    bad = (block_indices < -1) | (block_indices >= n_blocks)
    if bad.any():
        b, t, h, j = bad.nonzero()[0].tolist()
        raise ValueError(f"block_indices must lie in [-1, n_blocks) with n_blocks = cdiv(sequence length, block_size) "
                         f"of the query's sequence: block_indices[{b}, {t}, {h}, {j}] = {block_indices[b, t, h, j].item()}, "
                         f"n_blocks = {n_blocks[0, t, 0, 0].item()}")
    s = block_indices.sort(-1).values
    repeat = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
    if repeat.any():
        b, t, h, j = repeat.nonzero()[0].tolist()
        raise ValueError(f"block_indices must hold distinct entries per query (-1 aside): "
                         f"block_indices[{b}, {t}, {h}] repeats block {s[b, t, h, j].item()}")


def check_gates_range(gates: torch.Tensor) -> None:
    """Gate values must lie in [0, 1] (sigmoid outputs): the whole-op backward shifts each
    branch's lse by -log(gate) (flash_msa/fused.py), which a negative or NaN gate would turn into
    NaN gradients. A value check, so it follows the policy of :func:`trusted_inputs`."""
    if _trusting(gates):
        return
    bad = ~((gates >= 0) & (gates <= 1))  # NaN included
    if bad.any():
        at = bad.nonzero()[0].tolist()
        raise ValueError(f"gates must lie in [0, 1] (sigmoid outputs): gates{at} = {gates[tuple(at)].item()}")


def check_scale(scale, D: int) -> float:
    """The softmax scale: None means 1/sqrt(D); else a finite positive number (inf would give NaN)."""
    if scale is None:
        return D ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite positive float or None (meaning 1/sqrt(D)), got {scale!r}")
    return float(scale)


def check_nsa_sizes(cmp_block, cmp_stride, slc_block, slc_topk, window) -> None:
    """NSA's block sizes, stride, top-n and window (nsa_attention, decoding, msa_train's config)."""
    check_block_size("cmp_block", cmp_block, CMP_BLOCK_SIZES)
    check_block_size("cmp_stride", cmp_stride, CMP_STRIDES)
    if cmp_block % cmp_stride != 0:
        raise ValueError(f"cmp_block ({cmp_block}) must be a multiple of cmp_stride ({cmp_stride})")
    check_block_size("slc_block", slc_block, SELECTED_BLOCK_SIZES)
    if slc_block % cmp_stride != 0:
        raise ValueError(f"slc_block ({slc_block}) must be a multiple of cmp_stride ({cmp_stride})")
    if not isinstance(slc_topk, int) or isinstance(slc_topk, bool) or not 1 <= slc_topk <= MAX_TOPK:
        raise ValueError(f"slc_topk must be an int in [1, {MAX_TOPK}], got {slc_topk!r}")
    check_positive_int("window", window)
