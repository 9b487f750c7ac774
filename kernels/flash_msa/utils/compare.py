"""Relative error for checks of kernels against references (tests and benchmark scripts)."""
from __future__ import annotations

import torch


def rel_rms(x: torch.Tensor, ref: torch.Tensor, chunk_rows: int = 1 << 20) -> float:
    """||x - ref|| / ||ref|| in float64.

    Sums over chunks of rows (of the last dimension), so a 1M-token output never needs a float64
    copy of itself (32 GiB at 1M tokens, 32 heads, D=128). NaN anywhere makes the result NaN, which
    fails any bound.
    """
    if x.shape != ref.shape:
        raise ValueError(f"x has shape {tuple(x.shape)} but ref has shape {tuple(ref.shape)}")
    x = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    ref = ref.reshape(-1, ref.shape[-1]) if ref.dim() else ref.reshape(1, 1)
    err = norm = 0.
    for i in range(0, x.shape[0], chunk_rows):
        a, b = x[i:i + chunk_rows].double(), ref[i:i + chunk_rows].double()
        err += (a - b).pow(2).sum().item()
        norm += b.pow(2).sum().item()
    return (err / max(norm, 1e-60)) ** 0.5
