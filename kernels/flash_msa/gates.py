"""The gated combination of the three NSA branches, fused in Triton (fp32 math).

    o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa

Unfused, PyTorch runs this as a chain of fp32 elementwise kernels in the forward and more in
the backward (about 14 ms of fwd + bwd at T=64K, HQ=32, D=128 on an H200). The fused forward
reads the three outputs once and writes o; the fused backward reads do and the three outputs
once and writes their gradients plus dgates (a per-row reduction over D inside one program:
deterministic). Both are bandwidth-bound.

Reads bottom-up: kernels -> launchers -> autograd Function -> public function.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gate_combine_fwd_kernel(a, b, c, g, o, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # rows (token, head)
    m_r = o_r < N
    o_d = tl.arange(0, BD)
    m = m_r[:, None] & (o_d < D)[None, :]
    o_x = o_r[:, None] * D + o_d[None, :]
    b_g0 = tl.load(g + o_r * 3, mask=m_r, other=0.).to(tl.float32)  # [BR]
    b_g1 = tl.load(g + o_r * 3 + 1, mask=m_r, other=0.).to(tl.float32)
    b_g2 = tl.load(g + o_r * 3 + 2, mask=m_r, other=0.).to(tl.float32)
    b_o = b_g0[:, None] * tl.load(a + o_x, mask=m, other=0.).to(tl.float32)  # [BR, BD]
    b_o += b_g1[:, None] * tl.load(b + o_x, mask=m, other=0.).to(tl.float32)
    b_o += b_g2[:, None] * tl.load(c + o_x, mask=m, other=0.).to(tl.float32)
    tl.store(o + o_x, b_o.to(o.dtype.element_ty), mask=m)


@triton.jit
def gate_combine_bwd_kernel(a, b, c, g, do, da, db, dc, dg, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < N
    o_d = tl.arange(0, BD)
    m = m_r[:, None] & (o_d < D)[None, :]
    o_x = o_r[:, None] * D + o_d[None, :]
    b_do = tl.load(do + o_x, mask=m, other=0.).to(tl.float32)  # [BR, BD]
    b_g0 = tl.load(g + o_r * 3, mask=m_r, other=0.).to(tl.float32)
    b_g1 = tl.load(g + o_r * 3 + 1, mask=m_r, other=0.).to(tl.float32)
    b_g2 = tl.load(g + o_r * 3 + 2, mask=m_r, other=0.).to(tl.float32)
    tl.store(da + o_x, (b_g0[:, None] * b_do).to(da.dtype.element_ty), mask=m)
    tl.store(db + o_x, (b_g1[:, None] * b_do).to(db.dtype.element_ty), mask=m)
    tl.store(dc + o_x, (b_g2[:, None] * b_do).to(dc.dtype.element_ty), mask=m)
    b_dg0 = tl.sum(tl.load(a + o_x, mask=m, other=0.).to(tl.float32) * b_do, 1)  # [BR]
    b_dg1 = tl.sum(tl.load(b + o_x, mask=m, other=0.).to(tl.float32) * b_do, 1)
    b_dg2 = tl.sum(tl.load(c + o_x, mask=m, other=0.).to(tl.float32) * b_do, 1)
    tl.store(dg + o_r * 3, b_dg0.to(dg.dtype.element_ty), mask=m_r)
    tl.store(dg + o_r * 3 + 1, b_dg1.to(dg.dtype.element_ty), mask=m_r)
    tl.store(dg + o_r * 3 + 2, b_dg2.to(dg.dtype.element_ty), mask=m_r)


def _launch(D: int, device):
    BD = max(16, triton.next_power_of_2(D))
    BR = max(1, 4096 // BD)
    opts = dict(num_warps=4) if device.type == "cuda" else {}
    return BD, BR, opts


class GateCombineFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, o_cmp, o_slc, o_swa, gates, out_dtype):
        T, HQ, D = o_cmp.shape
        o_cmp, o_slc, o_swa, gates = (x.contiguous() for x in (o_cmp, o_slc, o_swa, gates))
        o = torch.empty(T, HQ, D, dtype=out_dtype, device=o_cmp.device)
        BD, BR, opts = _launch(D, o_cmp.device)
        N = T * HQ
        gate_combine_fwd_kernel[(triton.cdiv(N, BR),)](o_cmp, o_slc, o_swa, gates, o, N, D=D, BD=BD, BR=BR, **opts)
        ctx.save_for_backward(o_cmp, o_slc, o_swa, gates)
        return o

    @staticmethod
    def backward(ctx, do):
        o_cmp, o_slc, o_swa, gates = ctx.saved_tensors
        T, HQ, D = o_cmp.shape
        da, db, dc = torch.empty_like(o_cmp), torch.empty_like(o_slc), torch.empty_like(o_swa)
        dg = torch.empty_like(gates)
        BD, BR, opts = _launch(D, o_cmp.device)
        N = T * HQ
        gate_combine_bwd_kernel[(triton.cdiv(N, BR),)](o_cmp, o_slc, o_swa, gates, do.contiguous(), da, db, dc, dg,
                                                      N, D=D, BD=BD, BR=BR, **opts)
        return da, db, dc, dg, None


def gate_combine(gates: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_swa: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """o = sum_b gates[..., b] * o_b in fp32, cast to out_dtype.

    Args:
        gates: [T, HQ, 3] (compressed, selected, window); o_cmp, o_slc, o_swa: [T, HQ, D].
        out_dtype: dtype of the result (the dtype of q).

    Returns:
        o [T, HQ, D]. Differentiable in the gates and the three branch outputs.
    """
    return GateCombineFunction.apply(o_cmp, o_slc, o_swa, gates, out_dtype)
