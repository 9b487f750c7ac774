"""fmsa's dk/dv kernel in Gluon with warp specialization, for sm_90 (Hopper). Experimental.

The work of :func:`flash_msa.selection.fmsa.fmsa_bwd_dkdv_kernel` on transposed scores, split
over two partitions of one program (one key segment):

- a producer warp gathers the q and do rows of each 64-row tile (cp.async, 16-byte vectors)
  into a ring of NBUF shared-memory stages and signals each stage through an mbarrier that
  cp.async itself arrives on when the copies land;
- the consumer warpgroup (the default partition) waits for a stage, then computes

      s^T = k q^T, dp^T = v do^T            (accumulators [keys, rows])
      p^T = exp2(s^T - lse), ds^T = p^T (dp^T - delta)
      dv += p^T do                          (p^T straight from registers as the A operand)
      dk += ds^T q, dq = ds k               (ds^T once through shared memory)

  stages dq through the tile's do buffer for coalesced stores, and hands the stage back.

So the consumer's instruction stream holds no gather address arithmetic and no load waits of
its own, and two programs per SM (maxnreg 128: the producer's warpgroup at 24 registers, the
consumer at 232) interleave their serial chains. Gluon kernels do not run under
``TRITON_INTERPRET``: this one is checked against the Triton kernel on the GPU.
"""
from __future__ import annotations

import torch

try:  # Gluon ships with Triton >= 3.4; warp_specialize's list form as in Triton 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
    _async_load = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    AVAILABLE = False

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64,)
BM = 64  # query rows per tile
NBUF = 2  # ring stages (q and do tiles each)
SUB = 16  # rows per cp.async call of the producer (keeps its registers at a few addresses)
PW = 4  # producer warps (registers are allocated per warpgroup anyway)
PRODUCER_REGS = 24
MAXNREG = 128


def supported(q: torch.Tensor, block_size: int) -> bool:
    return (AVAILABLE and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in HEAD_DIMS and block_size in BLOCK_SIZES
            and torch.cuda.get_device_capability(q.device)[0] == 9)


if AVAILABLE:

    @gluon.jit
    def _rows(entry_ids, i_e0, r0, r_end, ROWS: gl.constexpr, G: gl.constexpr, HK: gl.constexpr,
              S: gl.constexpr, BM: gl.constexpr):
        o_r = r0 + gl.arange(0, BM, layout=ROWS)
        m_r = o_r < r_end
        b_e = gl.load(entry_ids + i_e0 + o_r // G, mask=m_r, other=0)
        return m_r, b_e, b_e // (HK * S), o_r % G

    @gluon.jit
    def _producer(q, do, entry_ids, i_e0, r_begin, r_end, i_hk, q_s, do_s, ready, empty,
                  HQ: gl.constexpr, HK: gl.constexpr, G: gl.constexpr, S: gl.constexpr, D: gl.constexpr,
                  BM: gl.constexpr, NBUF: gl.constexpr, SUB: gl.constexpr, PW: gl.constexpr):
        LP: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [PW, 1], [1, 0])
        o_d = gl.arange(0, D, layout=gl.SliceLayout(0, LP))
        m_d = o_d < D
        n_t = gl.cdiv(r_end - r_begin, BM)
        for j in range(n_t):
            s = j % NBUF
            mbarrier.wait(empty.index(s), ((j // NBUF) & 1) ^ 1)
            for c in gl.static_range(BM // SUB):
                m_r, b_e, b_t, b_g = _rows(entry_ids, i_e0, r_begin + j * BM + c * SUB, r_end,
                                           gl.SliceLayout(1, LP), G, HK, S, SUB)
                o_h = b_t.to(gl.int64) * HQ + i_hk * G + b_g
                m = m_r[:, None] & m_d[None, :]
                off = o_h[:, None] * D + o_d[None, :]
                _async_load(q_s.index(s).slice(c * SUB, SUB), q + off, mask=m)
                _async_load(do_s.index(s).slice(c * SUB, SUB), do + off, mask=m)
            # arrives (count 32 * PW: every thread of this partition) once this thread's copies have landed
            _cp.mbarrier_arrive(ready.index(s), increment_count=False)

    @gluon.jit
    def _consumer(k_s, v_s, q_s, do_s, ds_s, ready, empty, lse, delta, dqp, entry_ids,
                  i_e0, r_begin, r_end, i_hk, k_start, c0, hk0, scale2, scale,
                  HQ: gl.constexpr, HK: gl.constexpr, G: gl.constexpr, S: gl.constexpr, D: gl.constexpr,
                  BS: gl.constexpr, BM: gl.constexpr, NBUF: gl.constexpr, WRITE_DQ: gl.constexpr,
                  HKG: gl.constexpr):
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [4, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, LD)
        COL: gl.constexpr = gl.SliceLayout(0, LD)
        SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        PL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=AL, k_width=2)
        dtype: gl.constexpr = k_s.dtype
        o_d = gl.arange(0, D, layout=COL)
        m_d = o_d < D
        b_dk = gl.zeros([BS, D], gl.float32, AL)
        b_dv = gl.zeros([BS, D], gl.float32, AL)
        n_t = gl.cdiv(r_end - r_begin, BM)
        for j in range(n_t):
            s = j % NBUF
            r0 = r_begin + j * BM
            # the rows' tokens, lse and delta along the columns of s^T, loaded before the wait
            m_c, _, t_c, g_c = _rows(entry_ids, i_e0, r0, r_end, gl.SliceLayout(0, SL), G, HK, S, BM)
            o_hc = t_c.to(gl.int64) * HQ + i_hk * G + g_c
            b_lse = gl.load(lse + o_hc, mask=m_c, other=0.)
            b_delta = gl.load(delta + o_hc, mask=m_c, other=0.)
            mbarrier.wait(ready.index(s), (j // NBUF) & 1)
            fence_async_shared()  # the producer's cp.async wrote through the generic proxy; wgmma reads async
            b_q = q_s.index(s)
            b_do = do_s.index(s)
            b_st = warpgroup_mma(k_s, b_q.permute((1, 0)), gl.zeros([BS, BM], gl.float32, SL),
                                 use_acc=False, is_async=True)
            b_dpt = warpgroup_mma(v_s, b_do.permute((1, 0)), gl.zeros([BS, BM], gl.float32, SL),
                                  use_acc=False, is_async=True)
            b_st, b_dpt = warpgroup_mma_wait(num_outstanding=0, deps=(b_st, b_dpt))
            o_ks = k_start + gl.arange(0, BS, layout=gl.SliceLayout(1, SL))  # keys along the rows of s^T
            m_s = m_c[None, :] & (o_ks[:, None] <= t_c[None, :])
            b_pt = gl.where(m_s, gl.exp2(b_st * scale2 - b_lse[None, :]), 0.)
            b_dst = (b_pt * (b_dpt - b_delta[None, :])).to(dtype)
            ds_s.store(b_dst)
            fence_async_shared()
            _barrier()
            b_pa = gl.convert_layout(b_pt.to(dtype), PL)
            b_dv = warpgroup_mma(b_pa, b_do, b_dv, is_async=True)
            b_dk = warpgroup_mma(ds_s, b_q, b_dk, is_async=True)
            if WRITE_DQ:
                b_dv = warpgroup_mma_wait(num_outstanding=1, deps=(b_dv, ))
                b_dq = warpgroup_mma(ds_s.permute((1, 0)), k_s, gl.zeros([BM, D], gl.float32, AL),
                                     use_acc=False, is_async=True)
                b_dk, b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(b_dk, b_dq))
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
            _barrier()  # every thread is done with the stage (and ds_s) before it is handed back
            mbarrier.arrive(empty.index(s), count=1)
        return b_dk, b_dv

    @gluon.jit
    def fmsa_bwd_dkdv_gluon_ws_kernel(
        q, k, v, do, lse, delta, dk, dv, dkp, dvp, dqp, entry_ids, key_offsets,
        seg_key, seg_first, slot_first, block_start, block_end,
        k_lo, c0, hk0, NB, scale2, scale,
        HQ: gl.constexpr, HK: gl.constexpr, G: gl.constexpr, S: gl.constexpr, D: gl.constexpr,
        BS: gl.constexpr, BM: gl.constexpr, SEG: gl.constexpr, WRITE_DQ: gl.constexpr, HKG: gl.constexpr,
        NBUF: gl.constexpr, SUB: gl.constexpr, PRODUCER_REGS: gl.constexpr, PW: gl.constexpr,
    ):
        # one program per segment of at most SEG rows of one key, as the Triton kernel
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [4, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, LD)
        COL: gl.constexpr = gl.SliceLayout(0, LD)
        AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
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
        i_j = i_seg - gl.load(seg_first + i_key)
        r_begin = i_j * SEG
        r_end = gl.minimum(n_rows, r_begin + SEG)
        k_start = gl.load(block_start + i_b)
        k_end = gl.load(block_end + i_b)

        q_s = gl.allocate_shared_memory(dtype, [NBUF, BM, D], SM)
        do_s = gl.allocate_shared_memory(dtype, [NBUF, BM, D], SM)
        k_s = gl.allocate_shared_memory(dtype, [BS, D], SM)
        v_s = gl.allocate_shared_memory(dtype, [BS, D], SM)
        ds_s = gl.allocate_shared_memory(dtype, [BS, BM], SM)
        ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NBUF):
            mbarrier.init(ready.index(i), count=32 * PW)  # the producer's threads (cp.async arrive, noinc)
            mbarrier.init(empty.index(i), count=1)

        o_d = gl.arange(0, D, layout=COL)
        m_d = o_d < D
        o_k = k_start + gl.arange(0, BS, layout=ROW)
        p_kv = (o_k.to(gl.int64) * HK + i_hk)[:, None] * D + o_d[None, :]
        m_kv = (o_k < k_end)[:, None] & m_d[None, :]
        _async_load(k_s, k + p_kv, mask=m_kv)
        _async_load(v_s, v + p_kv, mask=m_kv)
        _cp.commit_group()
        _cp.wait_group(0)
        fence_async_shared()
        _barrier()

        b_dk, b_dv = gl.warp_specialize([
            (_consumer, (k_s, v_s, q_s, do_s, ds_s, ready, empty, lse, delta, dqp, entry_ids,
                         i_e0, r_begin, r_end, i_hk, k_start, c0, hk0, scale2, scale,
                         HQ, HK, G, S, D, BS, BM, NBUF, WRITE_DQ, HKG)),
            (_producer, (q, do, entry_ids, i_e0, r_begin, r_end, i_hk, q_s, do_s, ready, empty,
                         HQ, HK, G, S, D, BM, NBUF, SUB, PW)),
        ], [PW], [PRODUCER_REGS])

        b_dk = b_dk * scale
        o_ka = k_start + gl.arange(0, BS, layout=gl.SliceLayout(1, AL))
        o_da = gl.arange(0, D, layout=gl.SliceLayout(0, AL))
        m_ka = (o_ka < k_end)[:, None] & (o_da < D)[None, :]
        if n_rows <= SEG:
            p_acc = (o_ka.to(gl.int64) * HKG + (i_hk - hk0))[:, None] * D + o_da[None, :]
            b_dk += gl.load(dk + p_acc, mask=m_ka, other=0.)
            b_dv += gl.load(dv + p_acc, mask=m_ka, other=0.)
            gl.store(dk + p_acc, b_dk, mask=m_ka)
            gl.store(dv + p_acc, b_dv, mask=m_ka)
        else:
            i_slot = (gl.load(slot_first + i_key) - gl.load(slot_first + k_lo) + i_j).to(gl.int64)
            o_s = i_slot * BS * D + gl.arange(0, BS, layout=gl.SliceLayout(1, AL))[:, None] * D + o_da[None, :]
            gl.store(dkp + o_s, b_dk)
            gl.store(dvp + o_s, b_dv)


def launch(grid, args: tuple, const: dict) -> None:
    """fmsa_bwd_dkdv_kernel's launch (same arguments) on the warp-specialized Gluon kernel."""
    fmsa_bwd_dkdv_gluon_ws_kernel[grid](*args, **const, BM=BM, NBUF=NBUF, SUB=SUB, PRODUCER_REGS=PRODUCER_REGS, PW=PW,
                                        num_warps=4, maxnreg=MAXNREG)
