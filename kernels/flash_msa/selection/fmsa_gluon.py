"""fmsa's dk/dv kernel in Gluon, for sm_90 (Hopper): the work of
:func:`flash_msa.selection.fmsa.fmsa_bwd_dkdv_kernel` on transposed scores, with explicit async
wgmma and the next row tile's gathers in flight.

The Triton kernel holds 128-row tiles on 8 warps at 255 registers (one program per SM) and
passes p and ds to the dv and dk matmuls through shared memory, with block-wide barriers around
each round trip (docs/selected_attention.md). Here one warpgroup owns a key block's 64 keys and
computes, per tile of 64 query rows,

    s^T = k q^T, dp^T = v do^T            (accumulators [keys, rows])
    p^T = exp2(s^T - lse), ds^T = p^T (dp^T - delta)
    dv += p^T do                          (p^T straight from registers as the A operand)
    dk += ds^T q, dq = ds k               (ds^T once through shared memory; read transposed for dq)

while the gathers of the next tile's q and do rows (cp.async) fill the second of two buffers.
104 KB of shared memory and at most 240 registers: two programs per SM.

Gluon kernels do not run under ``TRITON_INTERPRET``: the CPU tests run the Triton kernel, and
this one is checked against the reference and the Triton kernel on the GPU.
"""
from __future__ import annotations

import torch

try:  # Gluon ships with Triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, warpgroup_mma, warpgroup_mma_wait)
    # renamed after Triton 3.6 (the device's): cp.async's load, and the CTA barrier
    _async_load = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    AVAILABLE = False

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64,)
BM = 64  # query rows per tile


def supported(q: torch.Tensor, block_size: int) -> bool:
    """Whether the Gluon kernel takes these inputs: Hopper, 16-bit, the shapes it was built for."""
    return (AVAILABLE and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in HEAD_DIMS and block_size in BLOCK_SIZES
            and torch.cuda.get_device_capability(q.device)[0] == 9)


if AVAILABLE:

    @gluon.jit
    def _rows(entry_ids, i_e0, r0, r_end, ROWS: gl.constexpr, G: gl.constexpr, HK: gl.constexpr,
              S: gl.constexpr, BM: gl.constexpr):
        # rows [r0, r0 + BM) of one key in the layout ROWS: mask, entry ids, query tokens, heads in group
        o_r = r0 + gl.arange(0, BM, layout=ROWS)
        m_r = o_r < r_end
        b_e = gl.load(entry_ids + i_e0 + o_r // G, mask=m_r, other=0)
        return m_r, b_e, b_e // (HK * S), o_r % G

    @gluon.jit
    def fmsa_bwd_dkdv_gluon_kernel(
        q, k, v, do, lse, delta, dk, dv, dkp, dvp, dqp, entry_ids, key_offsets,
        seg_key, seg_first, slot_first, block_start, block_end,
        k_lo, c0, hk0, NB, scale2, scale,
        HQ: gl.constexpr, HK: gl.constexpr, G: gl.constexpr, S: gl.constexpr, D: gl.constexpr,
        BS: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr, WRITE_DQ: gl.constexpr, HKG: gl.constexpr,
    ):
        # one program (one warpgroup) per segment of at most SEG rows of one key, as the Triton kernel
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [4, 1], [1, 0])  # gathers, 16 B vectors
        ROW: gl.constexpr = gl.SliceLayout(1, LD)
        COL: gl.constexpr = gl.SliceLayout(0, LD)
        SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        PL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=AL, k_width=2)
        SM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = q.dtype.element_ty

        i_seg = gl.load(seg_first + k_lo) + gl.program_id(0)
        if i_seg >= gl.load(seg_first + k_lo + HKG * NB):
            return
        i_key = gl.load(seg_key + i_seg)
        i_hk = (i_key // NB) % HK
        i_b = i_key % NB
        i_e0 = gl.load(key_offsets + i_key)
        n_rows = (gl.load(key_offsets + i_key + 1) - i_e0) * G
        i_j = i_seg - gl.load(seg_first + i_key)  # segment index within the key
        r_begin = i_j * SEG
        r_end = gl.minimum(n_rows, r_begin + SEG)
        k_start = gl.load(block_start + i_b)
        k_end = gl.load(block_end + i_b)

        q_s = gl.allocate_shared_memory(dtype, [2, BM, D], SM)
        do_s = gl.allocate_shared_memory(dtype, [2, BM, D], SM)
        k_s = gl.allocate_shared_memory(dtype, [BS, D], SM)
        v_s = gl.allocate_shared_memory(dtype, [BS, D], SM)
        ds_s = gl.allocate_shared_memory(dtype, [BS, BM], SM)

        o_d = gl.arange(0, D, layout=COL)
        m_d = o_d < D
        o_k = k_start + gl.arange(0, BS, layout=ROW)
        p_kv = (o_k.to(gl.int64) * HK + i_hk)[:, None] * D + o_d[None, :]
        m_kv = (o_k < k_end)[:, None] & m_d[None, :]
        _async_load(k_s, k + p_kv, mask=m_kv)
        _async_load(v_s, v + p_kv, mask=m_kv)
        m_r, b_e, b_t, b_g = _rows(entry_ids, i_e0, r_begin, r_end, ROW, G, HK, S, BM)
        o_h = b_t.to(gl.int64) * HQ + i_hk * G + b_g
        m_g = m_r[:, None] & m_d[None, :]
        _async_load(q_s.index(0), q + o_h[:, None] * D + o_d[None, :], mask=m_g)
        _async_load(do_s.index(0), do + o_h[:, None] * D + o_d[None, :], mask=m_g)
        _cp.commit_group()

        o_ks = k_start + gl.arange(0, BS, layout=gl.SliceLayout(1, SL))  # keys along the rows of s^T
        b_dk = gl.zeros([BS, D], gl.float32, AL)
        b_dv = gl.zeros([BS, D], gl.float32, AL)
        n_t = gl.cdiv(r_end - r_begin, BM)
        for j in range(n_t):
            r0 = r_begin + j * BM
            buf = j % 2
            # the next tile's entry ids, in flight during the wait (all masked past the segment)
            m_r, b_e, b_t, b_g = _rows(entry_ids, i_e0, r0 + BM, r_end, ROW, G, HK, S, BM)
            _cp.wait_group(0)  # tile j landed (at j = 0 also the block's K/V)
            # cp.async wrote through the generic proxy, wgmma reads through the async one; after
            # the barrier no warp still reads the buffers that tile j+1 now fills
            fence_async_shared()
            _barrier()
            if j + 1 < n_t:
                o_h = b_t.to(gl.int64) * HQ + i_hk * G + b_g
                m_g = m_r[:, None] & m_d[None, :]
                _async_load(q_s.index(1 - buf), q + o_h[:, None] * D + o_d[None, :], mask=m_g)
                _async_load(do_s.index(1 - buf), do + o_h[:, None] * D + o_d[None, :], mask=m_g)
                _cp.commit_group()
            b_q = q_s.index(buf)
            b_do = do_s.index(buf)
            b_st = warpgroup_mma(k_s, b_q.permute((1, 0)), gl.zeros([BS, BM], gl.float32, SL),
                                 use_acc=False, is_async=True)
            b_dpt = warpgroup_mma(v_s, b_do.permute((1, 0)), gl.zeros([BS, BM], gl.float32, SL),
                                  use_acc=False, is_async=True)
            # the rows' lse and delta along the columns of s^T
            m_c, _, t_c, g_c = _rows(entry_ids, i_e0, r0, r_end, gl.SliceLayout(0, SL), G, HK, S, BM)
            o_hc = t_c.to(gl.int64) * HQ + i_hk * G + g_c
            b_lse = gl.load(lse + o_hc, mask=m_c, other=0.)
            b_delta = gl.load(delta + o_hc, mask=m_c, other=0.)
            b_st, b_dpt = warpgroup_mma_wait(num_outstanding=0, deps=(b_st, b_dpt))
            m_s = m_c[None, :] & (o_ks[:, None] <= t_c[None, :])
            b_pt = gl.where(m_s, gl.exp2(b_st * scale2 - b_lse[None, :]), 0.)
            b_dst = (b_pt * (b_dpt - b_delta[None, :])).to(dtype)
            # ds^T to shared memory once: the A operand of dk (as is) and of dq (read transposed)
            ds_s.store(b_dst)
            fence_async_shared()
            _barrier()
            b_pa = gl.convert_layout(b_pt.to(dtype), PL)
            b_dv = warpgroup_mma(b_pa, b_do, b_dv, is_async=True)
            b_dk = warpgroup_mma(ds_s, b_q, b_dk, is_async=True)
            if WRITE_DQ:
                b_dv = warpgroup_mma_wait(num_outstanding=1, deps=(b_dv, ))  # p^T's registers free for dq's
                b_dq = warpgroup_mma(ds_s.permute((1, 0)), k_s, gl.zeros([BM, D], gl.float32, AL),
                                     use_acc=False, is_async=True)
                b_dk, b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(b_dk, b_dq))
                # dq through this tile's do buffer (free now: dp^T and dv are done) for coalesced stores
                b_do.store((b_dq * scale).to(dtype))
                _barrier()
                b_dqc = b_do.load(LD)
                m_w, e_w, t_w, g_w = _rows(entry_ids, i_e0, r0, r_end, ROW, G, HK, S, BM)
                if HKG == HK:
                    o_p = (e_w - c0 * (HK * S)) * G + g_w
                else:
                    o_p = (((t_w - c0) * HKG + (i_hk - hk0)) * S + e_w % S) * G + g_w
                gl.store(dqp + o_p.to(gl.int64)[:, None] * D + o_d[None, :], b_dqc.to(dqp.dtype.element_ty),
                         mask=m_w[:, None] & m_d[None, :])
            else:
                b_dv, b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dv, b_dk))
        b_dk = b_dk * scale
        # the fp32 dk/dv of this segment, stored from the accumulator layout (once per program)
        o_ka = k_start + gl.arange(0, BS, layout=gl.SliceLayout(1, AL))
        o_da = gl.arange(0, D, layout=gl.SliceLayout(0, AL))
        m_ka = (o_ka < k_end)[:, None] & (o_da < D)[None, :]
        if n_rows <= SEG:
            # the only program of this key in this partition: add to the fp32 accumulators in chunk order
            p_acc = (o_ka.to(gl.int64) * HKG + (i_hk - hk0))[:, None] * D + o_da[None, :]
            b_dk += gl.load(dk + p_acc, mask=m_ka, other=0.)
            b_dv += gl.load(dv + p_acc, mask=m_ka, other=0.)
            gl.store(dk + p_acc, b_dk, mask=m_ka)
            gl.store(dv + p_acc, b_dv, mask=m_ka)
        else:
            # one slot per segment; fmsa_bwd_dkdv_reduce_kernel sums them in segment order
            i_slot = (gl.load(slot_first + i_key) - gl.load(slot_first + k_lo) + i_j).to(gl.int64)
            o_s = i_slot * BS * D + gl.arange(0, BS, layout=gl.SliceLayout(1, AL))[:, None] * D + o_da[None, :]
            gl.store(dkp + o_s, b_dk)
            gl.store(dvp + o_s, b_dv)
