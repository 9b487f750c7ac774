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
def _row_tile(N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    # this program's BR rows (token, head) of N: ids, mask, [BR, BD] offsets into [N, D] and mask
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < N
    o_d = tl.arange(0, BD)
    return o_r, m_r, o_r[:, None] * D + o_d[None, :], m_r[:, None] & (o_d < D)[None, :]


@triton.jit
def gate_combine_fwd_kernel(a, b, c, g, o, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r, m_r, o_x, m = _row_tile(N, D, BD, BR)
    b_g0 = tl.load(g + o_r * 3, mask=m_r, other=0.).to(tl.float32)  # [BR]
    b_g1 = tl.load(g + o_r * 3 + 1, mask=m_r, other=0.).to(tl.float32)
    b_g2 = tl.load(g + o_r * 3 + 2, mask=m_r, other=0.).to(tl.float32)
    b_o = b_g0[:, None] * tl.load(a + o_x, mask=m, other=0.).to(tl.float32)  # [BR, BD]
    b_o += b_g1[:, None] * tl.load(b + o_x, mask=m, other=0.).to(tl.float32)
    b_o += b_g2[:, None] * tl.load(c + o_x, mask=m, other=0.).to(tl.float32)
    tl.store(o + o_x, b_o.to(o.dtype.element_ty), mask=m)


@triton.jit
def _gate_grads(a, b, c, b_do, o_x, m, dg, o_r, m_r):
    # r_b = rowsum(o_b * do) [BR] of the three branch outputs (rows o_r, do [BR, BD] in fp32): the
    # gates' gradient, stored into dg [N, 3]
    b_r0 = tl.sum(tl.load(a + o_x, mask=m, other=0.).to(tl.float32) * b_do, 1)
    b_r1 = tl.sum(tl.load(b + o_x, mask=m, other=0.).to(tl.float32) * b_do, 1)
    b_r2 = tl.sum(tl.load(c + o_x, mask=m, other=0.).to(tl.float32) * b_do, 1)
    tl.store(dg + o_r * 3, b_r0.to(dg.dtype.element_ty), mask=m_r)
    tl.store(dg + o_r * 3 + 1, b_r1.to(dg.dtype.element_ty), mask=m_r)
    tl.store(dg + o_r * 3 + 2, b_r2.to(dg.dtype.element_ty), mask=m_r)
    return b_r0, b_r1, b_r2


@triton.jit
def gate_combine_bwd_kernel(a, b, c, g, do, da, db, dc, dg, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r, m_r, o_x, m = _row_tile(N, D, BD, BR)
    b_do = tl.load(do + o_x, mask=m, other=0.).to(tl.float32)  # [BR, BD]
    b_g0 = tl.load(g + o_r * 3, mask=m_r, other=0.).to(tl.float32)
    b_g1 = tl.load(g + o_r * 3 + 1, mask=m_r, other=0.).to(tl.float32)
    b_g2 = tl.load(g + o_r * 3 + 2, mask=m_r, other=0.).to(tl.float32)
    tl.store(da + o_x, (b_g0[:, None] * b_do).to(da.dtype.element_ty), mask=m)
    tl.store(db + o_x, (b_g1[:, None] * b_do).to(db.dtype.element_ty), mask=m)
    tl.store(dc + o_x, (b_g2[:, None] * b_do).to(dc.dtype.element_ty), mask=m)
    _gate_grads(a, b, c, b_do, o_x, m, dg, o_r, m_r)


@triton.jit
def _shifted_lse(lse, g, LOG2_UNITS: tl.constexpr):
    # lse - log(g) in the branch's units (log2 or natural), -inf kept: p' = exp(s - lse') = g * p
    b_lg = tl.log2(g)
    if not LOG2_UNITS:
        b_lg = b_lg * 0.6931471805599453
    return tl.where(lse == float("-inf"), lse, lse - b_lg)


@triton.jit
def gate_bwd_branch_kernel(a, b, c, g, do, lse_a, lse_b, lse_c, dg, delta, lse_g, N,
                           D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    # The backward of the combination without writing the branches' output gradients g_b * do.
    # Branch b's softmax backward needs dp_b = g_b (do v^T), p_b and delta_b = g_b r_b with
    # r_b = rowsum(o_b * do): it equals the same backward on do itself with p'_b = g_b p_b and
    # delta r_b, and p'_b is the softmax with lse'_b = lse_b - log(g_b). So this writes dgates
    # (r_b), the deltas r_b ([3, N] fp32) and lse'_b ([3, N], each in its branch's units: natural
    # for compressed attention and the window, log2 for selected attention), and the branch
    # kernels run unchanged on do.
    o_r, m_r, o_x, m = _row_tile(N, D, BD, BR)
    b_do = tl.load(do + o_x, mask=m, other=0.).to(tl.float32)  # [BR, BD]
    b_r0, b_r1, b_r2 = _gate_grads(a, b, c, b_do, o_x, m, dg, o_r, m_r)
    tl.store(delta + o_r, b_r0, mask=m_r)
    tl.store(delta + N + o_r, b_r1, mask=m_r)
    tl.store(delta + 2 * N + o_r, b_r2, mask=m_r)
    b_g0 = tl.load(g + o_r * 3, mask=m_r, other=1.).to(tl.float32)
    b_g1 = tl.load(g + o_r * 3 + 1, mask=m_r, other=1.).to(tl.float32)
    b_g2 = tl.load(g + o_r * 3 + 2, mask=m_r, other=1.).to(tl.float32)
    tl.store(lse_g + o_r, _shifted_lse(tl.load(lse_a + o_r, mask=m_r, other=0.), b_g0, False), mask=m_r)
    tl.store(lse_g + N + o_r, _shifted_lse(tl.load(lse_b + o_r, mask=m_r, other=0.), b_g1, True), mask=m_r)
    tl.store(lse_g + 2 * N + o_r, _shifted_lse(tl.load(lse_c + o_r, mask=m_r, other=0.), b_g2, False), mask=m_r)


def _launch(D: int, device):
    BD = max(16, triton.next_power_of_2(D))
    BR = max(1, 4096 // BD)
    opts = dict(num_warps=4) if device.type == "cuda" else {}
    return BD, BR, opts


class GateCombineFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, o_cmp, o_slc, o_swa, gates, out_dtype):
        o_cmp, o_slc, o_swa, gates = (x.contiguous() for x in (o_cmp, o_slc, o_swa, gates))
        o = gate_combine_fwd(o_cmp, o_slc, o_swa, gates, out_dtype)
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


def gate_combine_fwd(o_cmp: torch.Tensor, o_slc: torch.Tensor, o_swa: torch.Tensor, gates: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """The combination's forward on contiguous [T, HQ, D] outputs and [T, HQ, 3] gates (no autograd)."""
    T, HQ, D = o_cmp.shape
    o = torch.empty(T, HQ, D, dtype=out_dtype, device=o_cmp.device)
    BD, BR, opts = _launch(D, o_cmp.device)
    N = T * HQ
    gate_combine_fwd_kernel[(triton.cdiv(N, BR),)](o_cmp, o_slc, o_swa, gates, o, N, D=D, BD=BD, BR=BR, **opts)
    return o


def gate_backward_branches(o_cmp, o_slc, o_swa, gates, do, lse_cmp, lse_slc, lse_swa):
    """(dgates [T, HQ, 3], delta fp32 [3, T, HQ], lse fp32 [3, T, HQ]): the gates' gradient, and
    per branch the delta and gate-shifted lse with which its backward on ``do`` itself gives the
    gradients of its inputs (gate_bwd_branch_kernel). lse_cmp and lse_swa are in natural log,
    lse_slc in log2; so are the shifted ones."""
    T, HQ, D = o_cmp.shape
    dg = torch.empty_like(gates)
    delta = torch.empty(3, T, HQ, dtype=torch.float32, device=do.device)
    lse = torch.empty_like(delta)
    BD, BR, opts = _launch(D, do.device)
    N = T * HQ
    gate_bwd_branch_kernel[(triton.cdiv(N, BR),)](o_cmp, o_slc, o_swa, gates, do, lse_cmp, lse_slc, lse_swa,
                                                  dg, delta, lse, N, D=D, BD=BD, BR=BR, **opts)
    return dg, delta, lse


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


def gate_combine_reference(gates: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_swa: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`gate_combine` in plain PyTorch (the reference, and the CPU path): same arguments, same result."""
    g = gates.float()  # the combination runs in fp32
    o = g[..., 0:1] * o_cmp.float() + g[..., 1:2] * o_slc.float() + g[..., 2:3] * o_swa.float()
    return o.to(out_dtype)
