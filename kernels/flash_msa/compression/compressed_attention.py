"""Compressed attention: causal attention over the packed compressed tokens, in Triton.

Query t at position t_rel of its sequence s sees compressed token i iff
``i*d + l - 1 <= t_rel``, i.e. the packed rows ``[cu_cmp[s], cu_cmp[s] + n_vis(t))`` with
``n_vis = (t_rel - l + 1)//d + 1`` (0 before the first full block). That is a contiguous row
range per query, so the op is range attention
(:func:`flash_msa.window.window.range_attention`: forward, deterministic dq and dk/dv
kernels, GQA packed along M). This file only builds the ranges, on the device, from
``cu_seqlens`` and ``cu_cmp``.
"""
from __future__ import annotations

import torch

from flash_msa.utils.cache import per_batch
from flash_msa.window.window import range_attention


def compressed_ranges(cu_seqlens: torch.Tensor, cu_cmp: torch.Tensor, T: int, Tc: int, block: int, stride: int):
    """Key ranges of the queries (lo, hi: int32 [T]) and query ranges of the rows (qlo, qhi: int32 [Tc])."""
    dev = cu_seqlens.device
    cu, cc = cu_seqlens.to(torch.int64), cu_cmp.to(torch.int64)
    t = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu[1:], t, right=True)  # [T]
    t_rel = t - cu[seq]
    n_vis = torch.where(t_rel >= block - 1, (t_rel - block + 1) // stride + 1, torch.zeros_like(t_rel))
    lo = cc[seq]
    r = torch.arange(Tc, device=dev)
    rseq = torch.searchsorted(cc[1:], r, right=True).clamp_max(cc.numel() - 2)  # [Tc]
    valid = r < cc[-1]
    qlo = cu[rseq] + (r - cc[rseq]) * stride + block - 1  # first query that sees row r
    qhi = torch.where(valid, cu[rseq + 1], torch.zeros_like(qlo))  # padding rows: empty range
    i32 = torch.int32
    return lo.to(i32), (lo + n_vis).to(i32), qlo.to(i32), qhi.to(i32)


def compressed_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, cu_seqlens: torch.Tensor,
                         cu_cmp: torch.Tensor, block: int, stride: int, scale: float):
    """Causal attention over compressed tokens (the contract of flash_msa.reference.compressed_attention).

    Args:
        q: [T, HQ, D]; k_cmp, v_cmp: [T//stride, HK, D] packed compressed rows.
        cu_seqlens, cu_cmp: int32 [N+1] offsets of the tokens and of the compressed rows.
        block, stride: l and d. scale: softmax scale.

    Returns:
        (o [T, HQ, D] in q's dtype, 0 where no compressed token is visible;
         lse fp32 [T, HQ], -inf there). Differentiable in q, k_cmp, v_cmp (and through lse).
    """
    T = q.shape[0]
    lo, hi, qlo, qhi = per_batch(compressed_ranges, cu_seqlens, cu_cmp, T, k_cmp.shape[0], block, stride)
    return range_attention(q, k_cmp, v_cmp, lo, hi, qlo, qhi, scale, "cmp")
