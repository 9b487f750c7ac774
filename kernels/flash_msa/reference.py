"""flash_msa.reference: the PyTorch ground truth of every NSA branch and of the whole op.

Each function takes one packed stream ``[T, H, D]`` plus ``cu_seqlens`` and a ``form``:
``"chunked"`` (default) processes queries in chunks, so memory is
O(T * (n*l' + w + T/d)) and never O(T^2); ``"naive"`` follows the definitions with dense
masks or per-token loops, for tiny tests. Both compute the same function in fp32 (fp64
for fp64 inputs) and support autograd (selection has no gradient).
"""
from __future__ import annotations

from typing import Optional

import torch

from flash_msa.compression import naive as _cmp
from flash_msa.selection import naive as _slc
from flash_msa.window import naive as _swa
from flash_msa.utils.varlen import flatten_batch

FORMS = ("chunked", "naive")


def _form(form: str) -> bool:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return form == "naive"


def compress_kv(x, weight, pos, cu_seqlens, block, stride, form: str = "chunked", proj=None):
    """phi: x [T, H, D] -> (x_cmp [T//stride, H, D], cu_cmp int32 [N+1])."""
    fn = _cmp.compress_kv_naive if _form(form) else _cmp.compress_kv
    return fn(x, weight, pos, cu_seqlens, block, stride, proj=proj)


def compressed_attention(q, k_cmp, v_cmp, cu_seqlens, cu_cmp, block, stride, scale, form: str = "chunked"):
    """-> (o [T, HQ, D], lse [T, HQ] fp32; -inf where no compressed token is visible)."""
    fn = _cmp.compressed_attention_naive if _form(form) else _cmp.compressed_attention_chunked
    return fn(q, k_cmp, v_cmp, cu_seqlens, cu_cmp, block, stride, scale)


def select_blocks(q, k_cmp, lse, cu_seqlens, cu_cmp, block, stride, slc_block, topk, scale, form: str = "chunked"):
    """-> block_indices int32 [T, HK, topk], ascending, -1 padded."""
    fn = _cmp.select_blocks_naive if _form(form) else _cmp.select_blocks_chunked
    return fn(q, k_cmp, lse, cu_seqlens, cu_cmp, block, stride, slc_block, topk, scale)


def selected_attention(q, k, v, block_indices, block_size, cu_seqlens, scale, form: str = "chunked"):
    """-> o [T, HQ, D]."""
    fn = _slc.selected_attention_naive if _form(form) else _slc.selected_attention_chunked
    return fn(q, k, v, block_indices, block_size, cu_seqlens, scale)


def window_attention(q, k, v, cu_seqlens, window, scale, form: str = "chunked"):
    """-> o [T, HQ, D]."""
    fn = _swa.window_attention_naive if _form(form) else _swa.window_attention_chunked
    return fn(q, k, v, cu_seqlens, window, scale)


def nsa_attention(
    q, k, v, gates, k_cmp_weight, k_cmp_pos, v_cmp_weight, v_cmp_pos, *,
    cmp_block: int = 32, cmp_stride: int = 16, slc_block: int = 64, slc_topk: int = 16, window: int = 512,
    cu_seqlens: Optional[torch.Tensor] = None, scale: Optional[float] = None, form: str = "chunked",
    return_indices: bool = False, k_cmp_proj: Optional[torch.Tensor] = None, v_cmp_proj: Optional[torch.Tensor] = None,
    block_indices: Optional[torch.Tensor] = None,
):
    """The whole NSA op in plain PyTorch, on [B, T, H, D] inputs (see flash_msa.nsa_attention).

    ``block_indices`` [B, T, HK, n], when given, replaces the selection (to compare a kernel's
    arithmetic on the blocks it selected, apart from near-tie flips of the selection itself).

    Returns o [B, T, HQ, D], and the selected block_indices [B, T, HK, n] if return_indices.
    """
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    qf, cu = flatten_batch(q, cu_seqlens)
    kf, vf = k.reshape(B * T, HK, D), v.reshape(B * T, HK, D)
    k_cmp, cu_cmp = compress_kv(kf, k_cmp_weight, k_cmp_pos, cu, cmp_block, cmp_stride, form, proj=k_cmp_proj)
    v_cmp, _ = compress_kv(vf, v_cmp_weight, v_cmp_pos, cu, cmp_block, cmp_stride, form, proj=v_cmp_proj)
    o_cmp, lse = compressed_attention(qf, k_cmp, v_cmp, cu, cu_cmp, cmp_block, cmp_stride, scale, form)
    if block_indices is None:
        idx = select_blocks(qf.detach(), k_cmp.detach(), lse.detach(), cu, cu_cmp, cmp_block, cmp_stride,
                            slc_block, slc_topk, scale, form)
    else:
        idx = block_indices.reshape(B * T, HK, -1)
    o_slc = selected_attention(qf, kf, vf, idx, slc_block, cu, scale, form)
    o_swa = window_attention(qf, kf, vf, cu, window, scale, form)
    g = gates.reshape(B * T, HQ, 3).to(torch.promote_types(gates.dtype, torch.float32))
    o = g[..., 0:1] * o_cmp.to(g.dtype) + g[..., 1:2] * o_slc.to(g.dtype) + g[..., 2:3] * o_swa.to(g.dtype)
    o = o.to(q.dtype).view(B, T, HQ, D)
    return (o, idx.view(B, T, HK, -1)) if return_indices else o
