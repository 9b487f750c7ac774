"""Selected attention in the query-centric loop order (``impl="qc"``; the order of the NSA paper's kernel).

One program owns one query token and the G query heads of one KV head: the heads form
the M dimension of the matmuls (padded to 16 rows when G < 16). It loops over the
token's selected KV blocks with an online softmax. The backward computes dq in the same
order; dk and dv come from the KV-block-centric kernel of :mod:`flash_msa.selection.fmsa`
(one program per KV block, so they need no atomics and are deterministic).

Reads bottom-up: kernels -> host launchers -> autograd Function -> public function.
Internally scores are kept in log2 units (``scale * log2(e)`` folded into the scale) and
``lse`` is the log2-sum-exp2 of those scores.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from flash_msa.selection import fmsa as _fmsa
from flash_msa.utils.csr import build_selection_csr, get_block_meta
from flash_msa.utils.varlen import flatten_batch

LOG2E = 1.4426950408889634


@triton.jit
def _selected_block(k, v, b_start, b_idx, i_t, i_hk, HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    # K and V rows [BS, D] of selected block b_idx of the sequence starting at b_start, keys after
    # token i_t masked (to 0) and that mask; positions in int32 (< T), widened only for addresses
    o_k = (b_start + b_idx * BS).to(tl.int32) + tl.arange(0, BS)  # [BS] absolute key positions
    m_k = o_k <= i_t
    p_kv = (o_k.to(tl.int64) * HK + i_hk)[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(k + p_kv, mask=m_k[:, None], other=0.), tl.load(v + p_kv, mask=m_k[:, None], other=0.), m_k


@triton.jit
def qc_fwd_kernel(
    q, k, v, o, lse, block_indices, tok_start, scale2,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BG: tl.constexpr,
):
    i_t, i_hk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b_start = tl.load(tok_start + i_t).to(tl.int64)
    own = (i_t - b_start) // BS
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    o_d = tl.arange(0, D)
    p_q = q + (i_t * HQ + i_hk * G + o_g)[:, None] * D + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None], other=0.)  # [BG, D]
    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_acc = tl.zeros([BG, D], dtype=tl.float32)
    for i_s in range(S):
        b_idx = tl.load(block_indices + (i_t * HK + i_hk) * S + i_s)
        if (b_idx >= 0) & (b_idx <= own):
            b_k, b_v, m_k = _selected_block(k, v, b_start, b_idx, i_t, i_hk, HK, D, BS)  # [BS, D] x2, [BS]
            b_s = tl.dot(b_q, tl.trans(b_k)) * scale2  # [BG, BS]
            b_s = tl.where(m_k[None, :], b_s, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, 1))
            b_a = tl.exp2(b_m - b_mn)
            b_p = tl.exp2(b_s - b_mn[:, None])
            b_l = b_l * b_a + tl.sum(b_p, 1)
            b_acc = b_acc * b_a[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
            b_m = b_mn
    b_ok = b_l > 0
    b_o = b_acc / tl.where(b_ok, b_l, 1.)[:, None]
    o_h = i_t * HQ + i_hk * G + o_g
    tl.store(o + o_h[:, None] * D + o_d[None, :], b_o.to(o.dtype.element_ty), mask=m_g[:, None])
    tl.store(lse + o_h, tl.where(b_ok, b_m + tl.log2(tl.where(b_ok, b_l, 1.)), 0.), mask=m_g)


@triton.jit
def qc_bwd_dq_kernel(
    q, k, v, do, lse, delta, dq, block_indices, tok_start, scale2, scale,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BG: tl.constexpr, ACC: tl.constexpr,
):
    # ACC: dq already holds other branches' dq of these rows (flash_msa/fused.py), added to in fp32
    i_t, i_hk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b_start = tl.load(tok_start + i_t).to(tl.int64)
    own = (i_t - b_start) // BS
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    o_d = tl.arange(0, D)
    o_h = i_t * HQ + i_hk * G + o_g  # [BG] rows of q, do, lse, delta
    b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.)  # [BG, D]
    b_do = tl.load(do + o_h[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.)
    b_lse = tl.load(lse + o_h, mask=m_g, other=0.)
    b_delta = tl.load(delta + o_h, mask=m_g, other=0.)
    b_dq = tl.zeros([BG, D], dtype=tl.float32)
    for i_s in range(S):
        b_idx = tl.load(block_indices + (i_t * HK + i_hk) * S + i_s)
        if (b_idx >= 0) & (b_idx <= own):
            b_k, b_v, m_k = _selected_block(k, v, b_start, b_idx, i_t, i_hk, HK, D, BS)
            b_s = tl.dot(b_q, tl.trans(b_k)) * scale2  # [BG, BS]
            b_p = tl.where(m_k[None, :], tl.exp2(b_s - b_lse[:, None]), 0.)
            b_dp = tl.dot(b_do, tl.trans(b_v))  # [BG, BS]
            b_ds = b_p * (b_dp - b_delta[:, None])
            b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)
    b_dq = b_dq * scale
    if ACC:
        b_dq += tl.load(dq + o_h[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.).to(tl.float32)
    tl.store(dq + o_h[:, None] * D + o_d[None, :], b_dq.to(dq.dtype.element_ty), mask=m_g[:, None])


def _group_rows(G: int) -> int:
    return max(16, triton.next_power_of_2(G))


def _stages(block_size: int, D: int) -> int:
    """Software-pipeline depth of the block loop: Triton's default (3) was measured at l'=64,
    D=128; larger K/V blocks get no pipelining so their buffers fit in shared memory."""
    return 3 if block_size * D <= 64 * 128 else 1


def qc_fwd(q, k, v, block_indices, meta, scale):
    """q [T, HQ, D], k/v [T, HK, D], block_indices [T, HK, S] -> o [T, HQ, D], lse fp32 [T, HQ]."""
    T, HQ, D = q.shape
    HK, S = k.shape[1], block_indices.shape[-1]
    o = torch.empty_like(q)
    lse = torch.empty(T, HQ, device=q.device, dtype=torch.float32)
    qc_fwd_kernel[(T, HK)](
        q, k, v, o, lse, block_indices, meta.tok_start, scale * LOG2E,
        HQ=HQ, HK=HK, G=HQ // HK, S=S, D=D, BS=meta.block_size, BG=_group_rows(HQ // HK),
        num_stages=_stages(meta.block_size, D))
    return o, lse


def qc_bwd_dq(q, k, v, do, lse, delta, block_indices, meta, scale, dq=None):
    """dq; a given ``dq`` is added to (see :func:`qc_backward`)."""
    T, HQ, D = q.shape
    HK, S = k.shape[1], block_indices.shape[-1]
    acc = dq is not None
    if not acc:
        dq = torch.empty_like(q)
    qc_bwd_dq_kernel[(T, HK)](
        q, k, v, do, lse, delta, dq, block_indices, meta.tok_start, scale * LOG2E, scale,
        HQ=HQ, HK=HK, G=HQ // HK, S=S, D=D, BS=meta.block_size, BG=_group_rows(HQ // HK), ACC=acc,
        num_stages=_stages(meta.block_size, D))
    return dq


def qc_forward(q, k, v, block_indices, block_size: int, cu_seqlens, scale: float):
    """(o, lse, meta) on flat [T, H, D] inputs: the forward and what its backward needs."""
    meta = get_block_meta(cu_seqlens, q.shape[0], block_size)
    o, lse = qc_fwd(q, k, v, block_indices, meta, scale)
    return o, lse, meta


def qc_backward(q, k, v, lse, block_indices, meta, scale: float, do, delta, dq: Optional[torch.Tensor] = None,
                 dkv: Optional[tuple] = None):
    """(dq, dk, dv) from :func:`qc_forward`'s lse (log2) and meta, with delta = rowsum(o * do).
    A given ``dq`` (``dkv`` = (dk, dv)) holds other branches' gradients, which this adds to
    (flash_msa/fused.py)."""
    dq = qc_bwd_dq(q, k, v, do, lse, delta, block_indices, meta, scale, dq)
    # dk, dv: KV-block-centric; partitions bound the buffer of split keys' segments
    T, HQ, D = q.shape
    chunk, heads = _fmsa.default_partition(T, HQ, k.shape[1], block_indices.shape[-1], D, q.element_size())
    csr = build_selection_csr(block_indices, meta, chunk)
    dk, dv = _fmsa.fmsa_bwd_dkdv(q, k, v, do, lse, delta, csr, scale, None, heads, dkv=dkv)
    return dq, dk, dv


class QCSelectedAttentionFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, block_indices, block_size, cu_seqlens, scale):
        o, lse, meta = qc_forward(q, k, v, block_indices, block_size, cu_seqlens, scale)
        ctx.save_for_backward(q, k, v, o, lse, block_indices)
        ctx.meta, ctx.scale = meta, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, block_indices = ctx.saved_tensors
        do = do.contiguous()
        delta = _fmsa.attention_delta(o, do)  # [T, HQ]
        dq, dk, dv = qc_backward(q, k, v, lse, block_indices, ctx.meta, ctx.scale, do, delta)
        return dq, dk, dv, None, None, None, None


def qc_selected_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
    block_size: int, cu_seqlens: Optional[torch.Tensor], scale: float,
) -> torch.Tensor:
    """Query-centric selected attention on validated [B, T, H, D] inputs (see ``selected_attention``).

    Raises ValueError for shapes this kernel does not support (head dim, S, dtype).
    """
    _fmsa.check_kernel_limits(q, block_indices.shape[-1])
    B, T, HQ, D = q.shape
    qf, cu = flatten_batch(q.contiguous(), cu_seqlens)
    kf = k.contiguous().reshape(B * T, *k.shape[2:])
    vf = v.contiguous().reshape(B * T, *v.shape[2:])
    bi = block_indices.contiguous().reshape(B * T, *block_indices.shape[2:])
    o = QCSelectedAttentionFunction.apply(qf, kf, vf, bi, block_size, cu, scale)
    return o.view(B, T, HQ, D)
