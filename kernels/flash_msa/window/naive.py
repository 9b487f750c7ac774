"""Reference sliding-window attention: plain PyTorch, computed in fp32 (fp64 for fp64 inputs).

Query t of a sequence starting at s0 attends to keys ``[max(s0, t - window + 1), t]``.
Inputs are one packed stream ``[T, H, D]`` plus ``cu_seqlens``.
"""
from __future__ import annotations

from typing import Optional

import torch

from flash_msa.selection.naive import _acc_dtype, masked_softmax_av, run_chunk
from flash_msa.utils.varlen import token_seq_bounds


def window_attention_naive(q, k, v, cu_seqlens, window: int, scale: float) -> torch.Tensor:
    """Dense [T, T] mask form, for tiny tests. q [T, HQ, D], k/v [T, HK, D] -> [T, HQ, D]."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    acc = _acc_dtype(q)
    start, _ = token_seq_bounds(cu_seqlens, T)
    pos = torch.arange(T, device=q.device)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= torch.maximum(start, pos - window + 1)[:, None])
    qf = q.to(acc).view(T, HK, HQ // HK, D).permute(1, 2, 0, 3)  # [HK, G, T, D]
    kf, vf = k.to(acc).permute(1, 0, 2)[:, None], v.to(acc).permute(1, 0, 2)[:, None]  # [HK, 1, T, D]
    o = masked_softmax_av(scale * qf @ kf.transpose(-1, -2), mask, vf)
    return o.permute(2, 0, 1, 3).reshape(T, HQ, D).to(q.dtype)


def window_attention_chunked(q, k, v, cu_seqlens, window: int, scale: float, chunk: Optional[int] = None):
    """Chunks of queries against the keys their windows can reach: O(chunk * (chunk + window)) per step."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    G = HQ // HK
    acc = _acc_dtype(q)
    if chunk is None:
        chunk = max(64, min(T, 1024))
    start, _ = token_seq_bounds(cu_seqlens, T)

    def one_chunk(c0: int, c1: int, q, k, v):
        k0 = max(0, c0 - window + 1)
        t = torch.arange(c0, c1, device=q.device)[:, None]
        s_pos = torch.arange(k0, c1, device=q.device)[None, :]
        mask = (s_pos <= t) & (s_pos >= torch.maximum(start[c0:c1, None], t - window + 1))  # [C, K]
        qc = q[c0:c1].to(acc).view(c1 - c0, HK, G, D).permute(1, 2, 0, 3)  # [HK, G, C, D]
        kc = k[k0:c1].to(acc).permute(1, 0, 2)[:, None]  # [HK, 1, K, D]
        vc = v[k0:c1].to(acc).permute(1, 0, 2)[:, None]
        o = masked_softmax_av(scale * qc @ kc.transpose(-1, -2), mask, vc)  # [HK, G, C, D]
        return o.permute(2, 0, 1, 3).reshape(c1 - c0, HQ, D)

    outs = [run_chunk(one_chunk, c0, min(T, c0 + chunk), q, k, v) for c0 in range(0, T, chunk)]
    return torch.cat(outs).to(q.dtype)
