"""fmsa's forward main kernel in Gluon, for sm_90 (Hopper): the same work as
:func:`flash_msa.selection.fmsa.fmsa_fwd_kernel`, with the gathers of the query rows pipelined.

The Triton kernel is bound by the latency of its gathers: each row tile loads its entry ids,
then its query rows, then runs two matmuls, and Triton does not software-pipeline a loop with a
branch in it (the branch-free forms it does pipeline took more shared memory and lost,
docs/selected_attention.md). Written by hand in Gluon, a program of ``NT`` row tiles of one key
issues the ``cp.async`` gather of tile j+1 into the second of two shared-memory buffers before it
computes tile j, so a tile's gather runs under the previous tile's matmuls and stores, with
64 KB of shared memory (two query buffers, the block's K and V) at the NSA defaults.

Same inputs, outputs and arithmetic order per row as the Triton kernel (scores in log2 units,
partial outputs normalised, lse = max + log2(sum)); the wgmma accumulation order may differ
from ``tl.dot``'s, so results agree to rounding, not bit for bit.

Gluon kernels do not run under ``TRITON_INTERPRET``: the CPU tests run the Triton kernel, and
this one is checked against it and against the reference on the GPU (tests/kernels, scripts).
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
BLOCK_SIZES = (16, 32, 64, 128)


def supported(q: torch.Tensor, block_size: int) -> bool:
    """Whether the Gluon kernel takes these inputs: Hopper, 16-bit, and the shapes it was built for."""
    return (AVAILABLE and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in HEAD_DIMS and block_size in BLOCK_SIZES
            and torch.cuda.get_device_capability(q.device)[0] == 9)


if AVAILABLE:

    @gluon.jit
    def _tile_rows(entry_ids, i_e0, r0, n_rows, ROWS: gl.constexpr, G: gl.constexpr, HK: gl.constexpr,
                   S: gl.constexpr, BM: gl.constexpr):
        # rows [r0, r0 + BM) of one key in the row layout ROWS: mask, entry ids, query tokens, heads in group
        o_r = r0 + gl.arange(0, BM, layout=ROWS)
        m_r = o_r < n_rows
        b_e = gl.load(entry_ids + i_e0 + o_r // G, mask=m_r, other=0)
        return m_r, b_e, b_e // (HK * S), o_r % G

    @gluon.jit
    def fmsa_fwd_gluon_kernel(
        q, k, v, po, plse, entry_ids, key_offsets, tile_key, tile_first,
        block_start, block_end, k_lo, c0, hk0, NB, scale2,
        HQ: gl.constexpr, HK: gl.constexpr, G: gl.constexpr, S: gl.constexpr, D: gl.constexpr,
        BS: gl.constexpr, BM: gl.constexpr, NT: gl.constexpr, HKG: gl.constexpr, OUT_MMA: gl.constexpr,
    ):
        # 4 warps (one warpgroup). LD: the gathers and stores, 16-byte vectors along D;
        # SL / OL: the wgmma accumulators of the scores [BM, BS] and the output [BM, D];
        # PL: the probabilities as the register A operand of the second matmul.
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [4, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, LD)
        COL: gl.constexpr = gl.SliceLayout(0, LD)
        SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BS, 16])
        OL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        PL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=OL, k_width=2)
        SM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = q.dtype.element_ty

        i_end = gl.load(tile_first + k_lo + HKG * NB)
        i_grp = gl.load(tile_first + k_lo) + gl.program_id(0)
        if i_grp >= i_end:
            return
        i_key = gl.load(tile_key + i_grp)
        i_hk = (i_key // NB) % HK
        i_b = i_key % NB
        i_e0 = gl.load(key_offsets + i_key)
        n_rows = (gl.load(key_offsets + i_key + 1) - i_e0) * G
        r0 = (i_grp - gl.load(tile_first + i_key)) * (NT * BM)
        k_start = gl.load(block_start + i_b)
        k_end = gl.load(block_end + i_b)

        q_s = gl.allocate_shared_memory(dtype, [2, BM, D], SM)
        k_s = gl.allocate_shared_memory(dtype, [BS, D], SM)
        v_s = gl.allocate_shared_memory(dtype, [BS, D], SM)

        # the block's K/V and the first tile's query rows: one commit group
        o_d = gl.arange(0, D, layout=COL)
        m_d = o_d < D
        o_k = k_start + gl.arange(0, BS, layout=ROW)
        p_kv = (o_k.to(gl.int64) * HK + i_hk)[:, None] * D + o_d[None, :]
        m_kv = (o_k < k_end)[:, None] & m_d[None, :]
        _async_load(k_s, k + p_kv, mask=m_kv)
        _async_load(v_s, v + p_kv, mask=m_kv)
        m_r, b_e, b_t, b_g = _tile_rows(entry_ids, i_e0, r0, n_rows, ROW, G, HK, S, BM)
        o_h = b_t.to(gl.int64) * HQ + i_hk * G + b_g
        _async_load(q_s.index(0), q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None] & m_d[None, :])
        _cp.commit_group()

        o_ks = k_start + gl.arange(0, BS, layout=gl.SliceLayout(0, SL))
        n_t = gl.minimum(gl.cdiv(n_rows - r0, BM), NT)  # tiles of this program with rows
        for j in range(n_t):
            # the next tile's entry ids, in flight during the wait (all masked past the last tile)
            m_r, b_e, b_t, b_g = _tile_rows(entry_ids, i_e0, r0 + (j + 1) * BM, n_rows, ROW, G, HK, S, BM)
            _cp.wait_group(0)  # tile j (and at j = 0 the block's K/V) landed
            # cp.async wrote through the generic proxy, wgmma reads through the async one; after
            # the barrier no warp still reads the buffer that tile j+1 now fills
            fence_async_shared()
            _barrier()
            if j + 1 < n_t:  # gather tile j+1 into the other buffer while tile j computes
                o_h = b_t.to(gl.int64) * HQ + i_hk * G + b_g
                _async_load(q_s.index((j + 1) % 2), q + o_h[:, None] * D + o_d[None, :],
                            mask=m_r[:, None] & m_d[None, :])
                _cp.commit_group()
            b_s = warpgroup_mma(q_s.index(j % 2), k_s.permute((1, 0)), gl.zeros([BM, BS], gl.float32, SL),
                                use_acc=False, is_async=True)
            b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s, ))
            m_rs, _, b_ts, _ = _tile_rows(entry_ids, i_e0, r0 + j * BM, n_rows, gl.SliceLayout(1, SL), G, HK, S, BM)
            # keys after the query are masked; a valid entry always keeps the block's first key
            m_s = m_rs[:, None] & (o_ks[None, :] <= b_ts[:, None])
            b_s = gl.where(m_s, b_s * scale2, float("-inf"))
            b_m = gl.where(m_rs, gl.max(b_s, 1), 0.)
            b_p = gl.exp2(b_s - b_m[:, None])
            b_l = gl.where(m_rs, gl.sum(b_p, 1), 1.)
            b_pa = gl.convert_layout(b_p.to(dtype), PL)
            b_o = warpgroup_mma(b_pa, v_s, gl.zeros([BM, D], gl.float32, OL), use_acc=False, is_async=True)
            b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, ))
            ORL: gl.constexpr = gl.SliceLayout(1, OL)
            b_o = (b_o * gl.convert_layout(1. / b_l, ORL)[:, None]).to(po.dtype.element_ty)
            b_lse = b_m + gl.log2(b_l)
            # rows of the partition's partial buffer, ordered (token, KV head of the partition,
            # slot, head in group), as fmsa._partial_rows
            if OUT_MMA:  # stored from the accumulator's layout: no shared-memory round trip
                m_w, e_w, t_w, g_w = _tile_rows(entry_ids, i_e0, r0 + j * BM, n_rows, ORL, G, HK, S, BM)
                o_do = gl.arange(0, D, layout=gl.SliceLayout(0, OL))
                b_lse = gl.convert_layout(b_lse, ORL)
            else:
                m_w, e_w, t_w, g_w = _tile_rows(entry_ids, i_e0, r0 + j * BM, n_rows, ROW, G, HK, S, BM)
                o_do = o_d
                b_o = gl.convert_layout(b_o, LD)
                b_lse = gl.convert_layout(b_lse, ROW)
            if HKG == HK:
                o_p = (e_w - c0 * (HK * S)) * G + g_w
            else:
                o_p = (((t_w - c0) * HKG + (i_hk - hk0)) * S + e_w % S) * G + g_w
            gl.store(po + o_p.to(gl.int64)[:, None] * D + o_do[None, :], b_o, mask=m_w[:, None] & (o_do < D)[None, :])
            gl.store(plse + o_p, b_lse, mask=m_w)
