"""Selected attention in the KV-block-centric (Flash-MSA) loop order.

Index: :func:`flash_msa.utils.csr.build_selection_csr` groups the valid (query, KV head,
slot) entries by key = (query chunk, KV head, global KV block), on the GPU without a host
sync. The rows of a key are its (entry, head-in-group) pairs, row r -> entry r // G,
head r % G, so tiles of BM rows are full for any group size G.

Partitions: the partial buffers hold one partition of the entries at a time, a query chunk
and either all KV heads or one KV head (``default_partition``; docs/selected_attention.md,
Memory). Its keys are consecutive in the CSR.

Forward, per partition:
  1. ``fmsa_fwd_kernel``: one program per group of ``fwd_tiles`` row tiles of one key. It loads
     K/V of the block once; per tile it gathers the query rows and writes the normalised
     partial output and its lse to a compact buffer indexed by entry. Programs past the
     partition's last group exit at once.
  2. ``fmsa_merge_kernel``: one program per (token, KV head) merges the partials of the
     token's valid slots in slot order: no atomics, deterministic.
Backward: ``fmsa_bwd_preprocess_kernel`` (delta = rowsum(o * do)), then per partition:
  1. ``fmsa_bwd_dkdv_kernel``: one program per segment (at most ``seg_tiles`` row tiles) of a key.
     It loads K/V once, accumulates dk/dv over its tiles in registers and writes the dq
     contribution of each row to a compact buffer. A key of one segment adds dk/dv to fp32
     accumulators (of the partition's KV heads) only it touches; a longer key (block 0)
     writes one slot per segment.
  2. ``fmsa_bwd_dkdv_reduce_kernel``: adds the slots of each split key in segment order; in the KV
     heads' last chunk it writes the fp32 sums of every block to dk, dv (or adds them to given ones).
  3. ``fmsa_bwd_dq_kernel``: one program per (token, KV head) sums the dq contributions in
     slot order.

Scores are kept in log2 units (``scale * log2(e)`` folded into the scale). Launch settings: the
``LAUNCH`` table (``flash_msa.tuning.override(fmsa=...)`` replaces entries).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4; older Tritons keep the row stores (fwd_tma / bwd_tma then do nothing)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from flash_msa import tuning
from flash_msa.utils.csr import (
    SelectionCSR, build_selection_csr, get_block_meta, multi_segment_slots, padded_key_rows, tile_bound,
    tile_schedule)
from flash_msa.utils.validation import check_triton_device
from flash_msa.utils.varlen import flatten_batch

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128)
MAX_S = 32
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Bytes of one partition's partial buffers (forward o + lse, backward dq), in the input dtype:
# 768 MiB up to T = 128K, then 6 KiB per token, so extra memory stays linear in T
# (docs/selected_attention.md, Memory). At 64K, 768 MiB gives 32768-token chunks instead of 16384
# (half the partitions): forward + backward 22.61 against 24.12 / 24.05 ms at G=4 (656 against 385
# MiB extra), 27.71 against 29.31 / 29.30 at G=5 (796 against 457 MiB); twice that again (one chunk
# per KV head) 21.92 and 27.19 ms at 1200 and 1476 MiB, past the 1 GB the API promises at 64K
# (benchmarks/results/selected/variants.md#selected_variants11). Past 128K, twice the 6 KiB per token gained
# about 1% of the whole op at 256K (429.3 against 431.7 / 433.9 ms) for 1 GB more (nsa_budget_h200_37ca19b.md).
# (LAUNCH: partial_budget, partial_budget_per_token)
# Backward segments: tiles of BM rows per program (longer keys are split, then reduced).
# With per-head partitions at 64K, fwd+bwd at G=4 / G=5: 16 tiles 29.0 / 33.8 ms, 32 tiles
# 27.9 / 32.5, 64 tiles 27.4 / 32.0, 128 tiles 36.4 / 37.5 (block 0's key, selected by every
# query, then has too few segments); benchmarks/results/selected/variants.md#selected_variants2. (LAUNCH: seg_tiles)


@triton.jit
def _block_keys(block_start, block_end, i_b, i_hk, HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    # key positions of global block i_b (int32, < T), their mask, and the [BS, D] offsets of their
    # K/V rows of KV head i_hk (widened to int64 for the address only)
    o_k = tl.load(block_start + i_b) + tl.arange(0, BS)  # [BS]
    m_k = o_k < tl.load(block_end + i_b)
    p_kv = (o_k.to(tl.int64) * HK + i_hk)[:, None] * D + tl.arange(0, D)[None, :]
    return o_k, m_k, p_kv


@triton.jit
def _partial_rows(b_e, b_t, b_g, i_hk, c0, hk0, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                  HKG: tl.constexpr):
    # int32 rows of the partition's partial buffer, ordered (token, KV head of the partition,
    # slot, head in group); the partition is tokens [c0, c0 + chunk) and KV heads [hk0, hk0 + HKG)
    if HKG == HK:
        o_p = (b_e - c0 * (HK * S)) * G + b_g
    else:
        o_p = (((b_t - c0) * HKG + (i_hk - hk0)) * S + b_e % S) * G + b_g
    return o_p


@triton.jit
def _fwd_rows(q, po, plse, pidx, entry_ids, b_k, b_v, o_k, o_r, n_rows, i_e0, i_hk, c0, hk0, scale2, i_tma,
              HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
              HKG: tl.constexpr, TMA: tl.constexpr, BM: tl.constexpr):
    # rows o_r [BM] of one key against its block's K/V [BS, D]: partial output and lse.
    # TMA: po is a descriptor of the key-ordered (padded) partial buffer, whose row i_tma this tile fills
    o_d = tl.arange(0, D)
    m_r = o_r < n_rows
    # index arithmetic in int32 (entry ids < 2^31: build_selection_csr; partial rows < 2^31:
    # the chunk_size check in FMSASelectedAttentionFunction), widened to int64 only for
    # addresses; with the reciprocal below this took the kernel (before key groups) from 156 to
    # 142 registers at G=4 and from 200 to 142 at G=5 (3 programs per SM instead of 2),
    # benchmarks/results/kernel_resources/latest.md
    b_e = tl.load(entry_ids + i_e0 + o_r // G, mask=m_r, other=0)  # [BM] entry ids
    b_t = b_e // (HK * S)  # [BM] query tokens
    b_g = o_r % G
    o_h = b_t.to(tl.int64) * HQ + i_hk * G + b_g  # [BM] rows of q
    b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale2  # [BM, BS]
    # keys after the query are masked; a valid entry always keeps the block's first key
    m_s = m_r[:, None] & (o_k[None, :] <= b_t[:, None])
    b_s = tl.where(m_s, b_s, float("-inf"))
    b_m = tl.where(m_r, tl.max(b_s, 1), 0.)
    b_p = tl.exp2(b_s - b_m[:, None])
    b_l = tl.where(m_r, tl.sum(b_p, 1), 1.)
    b_o = tl.dot(b_p.to(b_v.dtype), b_v) * (1. / b_l)[:, None]  # [BM, D] normalised partial output
    o_p = _partial_rows(b_e, b_t, b_g, i_hk, c0, hk0, HK, G, S, HKG)  # [BM]
    if TMA:
        # one asynchronous bulk copy of the whole tile (its rows past the key's last are padding
        # that nothing reads), and the tile row of each entry's first head for the merge
        po.store([i_tma, 0], b_o.to(po.dtype))
        tl.store(pidx + o_p // G, i_tma + o_r % BM, mask=m_r & (b_g == 0))  # o_r starts at a multiple of BM
    else:
        tl.store(po + o_p.to(tl.int64)[:, None] * D + o_d[None, :], b_o.to(po.dtype.element_ty), mask=m_r[:, None])
    tl.store(plse + o_p, b_m + tl.log2(b_l), mask=m_r)


@triton.jit
def _slot_rows(pidx, o_row, i_s, o_g, m_v, G: tl.constexpr, BG: tl.constexpr, TMA: tl.constexpr):
    # [BG] rows of the G heads of a (token, KV head)'s slot i_s in a partial buffer (forward partials,
    # dq parts): in entry order, or with TMA in key order through the per-entry row index pidx
    if TMA:
        o_p = tl.load(pidx + (o_row + i_s) + tl.zeros([BG], dtype=tl.int64), mask=m_v, other=0) + o_g
    else:
        o_p = (o_row + i_s) * G + o_g
    return o_p


@triton.jit
def fmsa_fwd_kernel(
    q, k, v, po, plse, pidx, key_rows, entry_ids, key_offsets, tile_key, tile_first,
    block_start, block_end, k_lo, c0, hk0, NB, scale2,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, NT: tl.constexpr, HKG: tl.constexpr, TMA: tl.constexpr,
):
    # One program per group of NT*BM rows of one key (the schedule's "tiles" are these groups):
    # the block's K/V are loaded once, then NT row tiles of BM rows. The partition's keys are
    # [k_lo, k_lo + HKG * NB); programs past its last group do nothing. With TMA the partial
    # outputs go by bulk copies in key order, each key's rows padded to a multiple of BM (key_rows:
    # padded_key_rows), and pidx maps each entry to its first row there.
    i_end = tl.load(tile_first + k_lo + HKG * NB)
    i_grp = tl.load(tile_first + k_lo) + tl.program_id(0)
    if i_grp >= i_end:
        return
    i_key = tl.load(tile_key + i_grp)
    i_hk = (i_key // NB) % HK
    i_e0 = tl.load(key_offsets + i_key)
    n_rows = (tl.load(key_offsets + i_key + 1) - i_e0) * G
    r0 = (i_grp - tl.load(tile_first + i_key)) * (NT * BM)
    o_k, m_k, p_kv = _block_keys(block_start, block_end, i_key % NB, i_hk, HK, D, BS)
    b_k = tl.load(k + p_kv, mask=m_k[:, None], other=0.)  # [BS, D]
    b_v = tl.load(v + p_kv, mask=m_k[:, None], other=0.)
    i_row = r0
    if TMA:  # the key's first row in the partition's padded buffer (< 2^31, as its partial rows)
        i_row += (tl.load(key_rows + i_key) - tl.load(key_rows + k_lo)).to(tl.int32)
    for i_j in range(NT):
        if r0 + i_j * BM < n_rows:
            _fwd_rows(q, po, plse, pidx, entry_ids, b_k, b_v, o_k, r0 + i_j * BM + tl.arange(0, BM), n_rows, i_e0,
                      i_hk, c0, hk0, scale2, i_row + i_j * BM, HQ, HK, G, S, D, HKG, TMA, BM)


@triton.jit
def fmsa_merge_kernel(
    po, plse, pidx, o, lse, block_indices, tok_start, c0, hk0, T,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BG: tl.constexpr, BSS: tl.constexpr, HKG: tl.constexpr, LOCAL: tl.constexpr,
    TMA: tl.constexpr,
):
    # TMA: the partial outputs are in key order (fmsa_fwd_kernel), each entry's first row in pidx
    # LOCAL > 0: the token's last LOCAL blocks are not in the partials (the CSR left them out);
    # o / lse hold their partial output and lse (log2) on entry, written by the window kernel
    # (flash_msa/fused.py), which this merges first.
    i_t = c0 + tl.program_id(0).to(tl.int64)
    i_hk = hk0 + tl.program_id(1)
    if i_t >= T:
        return
    own = (i_t - tl.load(tok_start + i_t)) // BS
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    o_d = tl.arange(0, D)
    # pass 1: max of the valid slots' lse, all slots loaded at once. [BSS, BG]
    o_s = tl.arange(0, BSS)
    b_idx = tl.load(block_indices + (i_t * HK + i_hk) * S + o_s, mask=o_s < S, other=-1)
    m_sv = (b_idx >= 0) & (b_idx <= own - LOCAL)
    o_row = ((i_t - c0) * HKG + tl.program_id(1)) * S  # first partial entry of this (token, KV head)
    m_sg = m_sv[:, None] & m_g[None, :]
    b_lse = tl.load(plse + (o_row + o_s)[:, None] * G + o_g[None, :], mask=m_sg, other=float("-inf"))
    b_m = tl.max(b_lse, 0)  # [BG]
    o_h = i_t * HQ + i_hk * G + o_g
    if LOCAL > 0:
        b_lloc = tl.load(lse + o_h, mask=m_g, other=0.)  # never -inf: the own block holds the token
        b_m = tl.maximum(b_m, b_lloc)
    b_ok = b_m > float("-inf")
    b_m = tl.where(b_ok, b_m, 0.)
    b_l = tl.sum(tl.exp2(b_lse - b_m[None, :]), 0)
    # pass 2: weighted sum in slot order; loads are independent of each other
    b_acc = tl.zeros([BG, D], dtype=tl.float32)
    if LOCAL > 0:
        b_wl = tl.exp2(b_lloc - b_m)
        b_l += b_wl
        b_acc += tl.load(o + o_h[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.).to(tl.float32) * b_wl[:, None]
    for i_s in tl.static_range(S):
        b_iv = tl.load(block_indices + (i_t * HK + i_hk) * S + i_s + tl.zeros([BG], dtype=tl.int64))  # [BG], one value
        m_v = (b_iv >= 0) & (b_iv <= own - LOCAL) & m_g
        o_p = (o_row + i_s) * G + o_g  # [BG]
        b_w = tl.exp2(tl.load(plse + o_p, mask=m_v, other=float("-inf")) - b_m)
        o_p = _slot_rows(pidx, o_row, i_s, o_g, m_v, G, BG, TMA)
        b_o = tl.load(po + o_p.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_v[:, None], other=0.).to(tl.float32)
        b_acc += b_o * b_w[:, None]
    b_l = tl.where(b_ok, b_l, 1.)
    tl.store(o + o_h[:, None] * D + o_d[None, :], (b_acc / b_l[:, None]).to(o.dtype.element_ty), mask=m_g[:, None])
    tl.store(lse + o_h, tl.where(b_ok, b_m + tl.log2(b_l), 0.), mask=m_g)


@triton.jit
def fmsa_bwd_preprocess_kernel(o, do, delta, N, D: tl.constexpr, BR: tl.constexpr):
    # delta = rowsum(o * do) in fp32, without materialising fp32 copies of o and do
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < N
    o_d = tl.arange(0, D)
    b_o = tl.load(o + o_r[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.).to(tl.float32)
    b_do = tl.load(do + o_r[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.).to(tl.float32)
    tl.store(delta + o_r, tl.sum(b_o * b_do, 1), mask=m_r)


@triton.jit
def fmsa_bwd_dkdv_kernel(
    q, k, v, do, lse, delta, dk, dv, dkp, dvp, dqp, pidx, key_rows, entry_ids, key_offsets,
    seg_key, seg_first, slot_first, block_start, block_end,
    k_lo, c0, hk0, NB, scale2, scale,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, SEG: tl.constexpr, WRITE_DQ: tl.constexpr, HKG: tl.constexpr,
    TMA: tl.constexpr,
):
    # one program per segment of at most SEG rows of one key, so that a block selected by
    # every query (block 0) is spread over many programs instead of serialising the launch.
    # The partition's keys are [k_lo, k_lo + HKG * NB); dk/dv hold its HKG KV heads.
    i_seg = tl.load(seg_first + k_lo) + tl.program_id(0)
    if i_seg >= tl.load(seg_first + k_lo + HKG * NB):
        return
    i_key = tl.load(seg_key + i_seg)
    i_hk = (i_key // NB) % HK
    i_b = i_key % NB
    i_e0 = tl.load(key_offsets + i_key)
    n_rows = (tl.load(key_offsets + i_key + 1) - i_e0) * G
    i_j = i_seg - tl.load(seg_first + i_key)  # segment index within the key
    r_begin = i_j * SEG
    r_end = tl.minimum(n_rows, r_begin + SEG)
    o_d = tl.arange(0, D)
    o_k, m_k, p_kv = _block_keys(block_start, block_end, i_b, i_hk, HK, D, BS)
    b_k = tl.load(k + p_kv, mask=m_k[:, None], other=0.)
    b_v = tl.load(v + p_kv, mask=m_k[:, None], other=0.)
    _, _, p_acc = _block_keys(block_start, block_end, i_b, i_hk - hk0, HKG, D, BS)  # in dk / dv
    b_dk = tl.zeros([BS, D], dtype=tl.float32)
    b_dv = tl.zeros([BS, D], dtype=tl.float32)
    if TMA:  # dq parts by bulk copies in key order, keys padded to BM rows, as the forward's partials
        i_row0 = (tl.load(key_rows + i_key) - tl.load(key_rows + k_lo)).to(tl.int32)
    for i_r in range(r_begin, r_end, BM):
        o_r = i_r + tl.arange(0, BM)
        m_r = o_r < r_end
        b_e = tl.load(entry_ids + i_e0 + o_r // G, mask=m_r, other=0)  # int32, as in the forward
        b_t = b_e // (HK * S)
        b_g = o_r % G
        o_h = b_t.to(tl.int64) * HQ + i_hk * G + b_g  # [BM] rows of q, do, lse, delta
        b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)  # [BM, D]
        b_do = tl.load(do + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)
        b_lse = tl.load(lse + o_h, mask=m_r, other=0.)
        b_delta = tl.load(delta + o_h, mask=m_r, other=0.)
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale2  # [BM, BS]
        m_s = m_r[:, None] & (o_k[None, :] <= b_t[:, None])
        b_p = tl.where(m_s, tl.exp2(b_s - b_lse[:, None]), 0.)
        b_dp = tl.dot(b_do, tl.trans(b_v))  # [BM, BS]
        b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_q.dtype)
        if WRITE_DQ:
            b_dq = tl.dot(b_ds, b_k) * scale  # [BM, D]
            o_p = _partial_rows(b_e, b_t, b_g, i_hk, c0, hk0, HK, G, S, HKG)
            if TMA:
                dqp.store([i_row0 + i_r, 0], b_dq.to(dqp.dtype))
                tl.store(pidx + o_p // G, i_row0 + o_r, mask=m_r & (b_g == 0))
            else:
                tl.store(dqp + o_p.to(tl.int64)[:, None] * D + o_d[None, :], b_dq.to(dqp.dtype.element_ty),
                         mask=m_r[:, None])
        # The two accumulating matmuls last. Triton waits for a matmul right after issuing it unless
        # its result is loop-carried, as these are: here they run on across the dq store and the next
        # row tile's loads, where in the order of the math (dv before dp, dk before dq) the waits for
        # dp and dq also waited for them. Forward + backward at 64K: 24.07 / 24.05 against 24.15 ms at
        # G=4, 29.34 / 29.31 against 29.57 at G=5; both before the dq store (more spills): 24.54 /
        # 30.00 (benchmarks/results/selected/variants.md#selected_variants10, commit a8272cc's BWD_ACC_LAST).
        b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
        b_dk += tl.dot(tl.trans(b_ds), b_q)
    b_dk = b_dk * scale
    if n_rows <= SEG:
        # the only program of this key in this partition: add to the fp32 accumulators in chunk order
        b_dk += tl.load(dk + p_acc, mask=m_k[:, None], other=0.)
        b_dv += tl.load(dv + p_acc, mask=m_k[:, None], other=0.)
        tl.store(dk + p_acc, b_dk, mask=m_k[:, None])
        tl.store(dv + p_acc, b_dv, mask=m_k[:, None])
    else:
        # one slot per segment; fmsa_bwd_dkdv_reduce_kernel sums them in segment order
        i_slot = (tl.load(slot_first + i_key) - tl.load(slot_first + k_lo) + i_j).to(tl.int64)
        o_s = i_slot * BS * D + tl.arange(0, BS)[:, None] * D + o_d[None, :]
        tl.store(dkp + o_s, b_dk)
        tl.store(dvp + o_s, b_dv)


@triton.jit
def fmsa_bwd_dkdv_reduce_kernel(
    dk, dv, dkp, dvp, key_offsets, slot_first, block_start, block_end, k_lo, NB, NBC, dk_out, dv_out, hk0,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SEG: tl.constexpr, HKG: tl.constexpr, HK: tl.constexpr,
    FINAL: tl.constexpr, ADD: tl.constexpr,
):
    # program (KV head of the partition, block); dk/dv hold the partition's HKG KV heads in fp32.
    # Not FINAL: adds the segment slots of each split key to them. FINAL (the heads' last chunk,
    # every block): also writes the sums to dk_out / dv_out [T, HK, D], added to what they hold
    # with ADD, rounded once: every token's row, as the blocks partition the tokens.
    i_p = tl.program_id(0)
    i_h = i_p // NBC
    i_b = i_p % NBC
    i_key = k_lo + i_h * NB + i_b
    n_rows = (tl.load(key_offsets + i_key + 1) - tl.load(key_offsets + i_key)) * G
    if not FINAL:
        if n_rows <= SEG:
            return
    n_seg = tl.where(n_rows > SEG, tl.cdiv(n_rows, SEG), 0)  # a key of one segment has no slots
    i_slot0 = (tl.load(slot_first + i_key) - tl.load(slot_first + k_lo)).to(tl.int64)
    o_d = tl.arange(0, D)
    _, m_k, p_acc = _block_keys(block_start, block_end, i_b, i_h, HKG, D, BS)
    o_s = tl.arange(0, BS)[:, None] * D + o_d[None, :]
    b_dk = tl.load(dk + p_acc, mask=m_k[:, None], other=0.)
    b_dv = tl.load(dv + p_acc, mask=m_k[:, None], other=0.)
    for i_j in range(0, n_seg):
        b_dk += tl.load(dkp + (i_slot0 + i_j) * BS * D + o_s)
        b_dv += tl.load(dvp + (i_slot0 + i_j) * BS * D + o_s)
    if FINAL:
        _, _, p_out = _block_keys(block_start, block_end, i_b, hk0 + i_h, HK, D, BS)
        if ADD:
            b_dk += tl.load(dk_out + p_out, mask=m_k[:, None], other=0.).to(tl.float32)
            b_dv += tl.load(dv_out + p_out, mask=m_k[:, None], other=0.).to(tl.float32)
        tl.store(dk_out + p_out, b_dk.to(dk_out.dtype.element_ty), mask=m_k[:, None])
        tl.store(dv_out + p_out, b_dv.to(dv_out.dtype.element_ty), mask=m_k[:, None])
    else:
        tl.store(dk + p_acc, b_dk, mask=m_k[:, None])
        tl.store(dv + p_acc, b_dv, mask=m_k[:, None])


@triton.jit
def fmsa_bwd_dq_kernel(
    dqp, pidx, dq, block_indices, tok_start, c0, hk0, T,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BG: tl.constexpr, HKG: tl.constexpr, ACC: tl.constexpr, LOCAL: tl.constexpr,
    TMA: tl.constexpr,
):
    # ACC: dq already holds other branches' dq of these rows (flash_msa/fused.py), added to in fp32;
    # LOCAL: the token's last LOCAL blocks have no dq parts (the window kernel added their dq)
    i_t = c0 + tl.program_id(0).to(tl.int64)
    i_hk = hk0 + tl.program_id(1)
    if i_t >= T:
        return
    own = (i_t - tl.load(tok_start + i_t)) // BS
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    o_d = tl.arange(0, D)
    o_row = ((i_t - c0) * HKG + tl.program_id(1)) * S
    b_dq = tl.zeros([BG, D], dtype=tl.float32)
    for i_s in tl.static_range(S):  # slot order: deterministic; loads independent of each other
        b_iv = tl.load(block_indices + (i_t * HK + i_hk) * S + i_s + tl.zeros([BG], dtype=tl.int64))  # [BG], one value
        m_v = (b_iv >= 0) & (b_iv <= own - LOCAL) & m_g
        o_p = _slot_rows(pidx, o_row, i_s, o_g, m_v, G, BG, TMA)
        b_dq += tl.load(dqp + o_p.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_v[:, None], other=0.).to(tl.float32)
    o_h = i_t * HQ + i_hk * G + o_g
    if ACC:
        b_dq += tl.load(dq + o_h[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.).to(tl.float32)
    tl.store(dq + o_h[:, None] * D + o_d[None, :], b_dq.to(dq.dtype.element_ty), mask=m_g[:, None])


def _group_rows(G: int) -> int:
    return max(16, triton.next_power_of_2(G))


def _reduce_rows(G: int) -> int:
    """Rows of the merge / dq reductions: no matmul there, so no padding to 16."""
    return max(2, triton.next_power_of_2(G))


def attention_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """fp32 [T, HQ]: rowsum(o * do), the softmax-backward correction term."""
    T, HQ, D = o.shape
    delta = torch.empty(T, HQ, device=o.device, dtype=torch.float32)
    BR = 64
    fmsa_bwd_preprocess_kernel[(triton.cdiv(T * HQ, BR),)](o, do, delta, T * HQ, D=D, BR=BR)
    return delta


# Launch settings (measured on H200, docs/selected_attention.md), in LAUNCH below.
# fwd_tiles: row tiles per forward program, all of one key, so its K/V are loaded once: 4 tiles
# took the forward from 10.37 to 9.35 ms at 64K G=4 and from 12.68 to 11.37 at G=5, against 2 consecutive tiles of any keys with K/V loaded per tile
# (benchmarks/results/selected/variants.md#selected_variants4; 8 tiles: 9.36 / 11.28).
# fwd_maxnreg, the register cap of the forward kernel: 128 fits 4 programs per SM instead of 3
# (the compiler's choice is 147 registers with key groups, 142 before), at the cost of a few spills. Measured
# before key groups at 64K: 10.52 against 11.05 ms at G=4, 12.97 against 13.70 at G=5
# (selected_variants_h200.log, fourth run); with them, uncapped 10.00 against 9.35 ms at G=4
# and 11.87 against 11.37 at G=5 (selected_variants4_h200.log).
# fwd_tma (Hopper and later): the forward's partial outputs written tile by tile by TMA bulk copies
# (asynchronous: a tile's write runs under the next tile's matmuls) in key order, each key's rows
# padded to a multiple of BM, which the merge reads through a per-entry row index; instead of row
# by row from registers in entry order. bwd_tma: the same for the dk/dv kernel's dq parts and the
# dq reduction. At 64K on the H200: forward 8.10 against 8.28 / 8.31 ms at G=4, 9.99 against
# 10.31 / 10.35 at G=5; forward + backward with both 21.61 against 22.31 / 22.22 ms at G=4, 26.76
# against 27.48 / 27.38 at G=5, for 35 MiB more (benchmarks/results/selected/variants.md#selected_variants16,
# second run; the main kernel alone 5.50 against 5.70 ms at G=4, probes/results.md#probe_sol_tma). At 2
# stages the staging tile leaves 3 programs per SM instead of 4: 8.96 ms.
# bwd_stages: 3 software-pipeline stages for the dk/dv loop (the entry ids of the row tile after next
# load ahead, so the next tile's q/do gather, double-buffered, needs no second round trip): forward +
# backward at 64K 24.22 against 25.92 ms (2 stages) at G=4, 29.65 against 30.33 at G=5
# (benchmarks/results/selected/variants.md#selected_variants6; 1 stage: 25.90 / 33.31). It compiles for every
# block size and head dim with the same registers and spills as 2 stages (kernel_resources.py).
# bwd_maxnreg, the register cap of the dk/dv kernel (0: none; the compiler then takes 255 at every
# tile size measured).
# merge_warps_small_g, the warps of a merge program (one token, the G heads of one KV head: a
# [G, D] tile per slot). One warp for G <= 8, where a program's 16 slot loads then take 16-byte
# vectors per thread: forward at 64K 8.91 against 9.34 ms (4 warps) at G=4, 10.98 against 11.29 at G=5; at G=16, 4 warps
# (15.21 against 15.48 with one); benchmarks/results/selected/variants.md#selected_variants5. The dq
# reduction (same shape) measured the same with 1, 2 or 4 warps and keeps the default 4.
LAUNCH = MappingProxyType(dict(
    fwd_bm=64, fwd_warps=4, fwd_stages=2, fwd_tiles=4, fwd_maxnreg=128, fwd_tma=True, fwd_tma_stages=1,
    bwd_tma=True, bwd_bm=128, bwd_warps=8, bwd_stages=3, bwd_maxnreg=0, merge_warps_small_g=1, seg_tiles=64,
    partial_budget=768 << 20, partial_budget_per_token=6 << 10,
))
tuning.register("fmsa", LAUNCH)


def launch_settings() -> Mapping:
    """LAUNCH with the active ``flash_msa.tuning.override(fmsa=...)`` applied."""
    return tuning.settings("fmsa", LAUNCH)


def _tma(flag: bool, q: torch.Tensor) -> bool:
    """Whether a kernel writes its partials by TMA (``flag``: fwd_tma or bwd_tma): on NVIDIA Hopper
    or later with 2-byte inputs (what was measured; the dk/dv kernel's fp32 staging tile would not
    fit its shared memory), or in the CPU interpreter, which emulates the copies. Needs Triton's
    host-side tensor descriptors (3.4+)."""
    if not flag or TensorDescriptor is None:
        return False
    if not q.is_cuda:
        return True
    return (torch.version.hip is None and q.element_size() == 2
            and torch.cuda.get_device_capability(q.device)[0] >= 9)


def padded_rows(rows: int, HKG: int, num_blocks: int, BM: int) -> int:
    """Rows of a partial buffer of ``rows`` rows in key order (TMA writes), each key's rows padded
    to a multiple of BM: at most BM more per (KV head, block) of a partition."""
    return rows + HKG * num_blocks * BM


def _tma_index(buf: torch.Tensor, csr: SelectionCSR, G: int, BM: int, rows: int):
    """What a kernel writing ``buf`` by TMA in key order takes: the descriptor of its BM-row tiles,
    the per-entry row index it fills (one per G rows of the unpadded ``rows``) and the keys'
    padded first rows."""
    return (TensorDescriptor.from_tensor(buf, [BM, buf.shape[1]]),
            torch.empty(rows // G, device=buf.device, dtype=torch.int32), padded_key_rows(csr, G, BM))


def dq_partial_rows(q: torch.Tensor, csr: SelectionCSR, HKG: int, G: int) -> int:
    """Rows of the backward's dq-part buffer: one partition's partial rows, plus the padding of
    every key's rows to a multiple of the tile with bwd_tma."""
    T, _, D = q.shape
    cfg = launch_settings()
    rows = partition_rows(T, csr.chunk_size, HKG, G, csr.S)
    if _tma(cfg["bwd_tma"], q):
        rows = padded_rows(rows, HKG, csr.meta.num_blocks, _bwd_tile_rows(cfg, D, csr.meta.block_size))
    return rows


def _fwd_stages(cfg: Mapping, tma: bool, block_size: int, D: int) -> int:
    return (cfg["fwd_tma_stages"] if tma else cfg["fwd_stages"]) if block_size * D <= 64 * 128 else 1


def _reg_cap(cap: int, x: torch.Tensor) -> dict:
    """Launch option for a register cap (0: none); the CPU interpreter takes no maxnreg."""
    return {"maxnreg": cap} if cap and x.is_cuda else {}


def _merge_warps(cfg: Mapping, G: int) -> int:
    return cfg["merge_warps_small_g"] if G <= 8 else 4


def _fwd_tile_rows(cfg: Mapping, D: int, block_size: int) -> int:
    return cfg["fwd_bm"]


def _bwd_tile_rows(cfg: Mapping, D: int, block_size: int) -> int:
    return cfg["bwd_bm"] if block_size * D <= 64 * 128 else min(cfg["bwd_bm"], 32)


def chunk_blocks(csr: SelectionCSR, i_c: int) -> int:
    """Static bound on the global blocks chunk i_c can select: causality gives id <= t // bs + N."""
    meta = csr.meta
    t_end = min(meta.T, (i_c + 1) * csr.chunk_size)
    return min(meta.num_blocks, (t_end - 1) // meta.block_size + meta.num_blocks - meta.T // meta.block_size + 1)


def default_partition(T: int, HQ: int, HK: int, S: int, D: int, element_size: int = 2,
                      heads: Optional[int] = None) -> tuple[int, int]:
    """(query tokens per chunk, KV heads per partition) for the partial buffers.

    Partials (forward o, backward dq) are stored in the input dtype, plus an fp32 lse, and
    one partition's must fit ``max(partial_budget, partial_budget_per_token * T)`` bytes (LAUNCH). When
    the whole sequence fits with all KV heads, that is one partition. Otherwise a partition
    is one KV head and the largest power-of-two chunk that fits, HK times longer chunks than
    all heads would get, so keys gather more rows (fuller tiles) and dk/dv are read back and
    rewritten for fewer chunks (docs/selected_attention.md, Memory). Short sequences, that all
    heads would cover in fewer than HK chunks, keep all heads together: there per-head
    partitions only add launches. At 8K tokens and the 384 MiB budget of then (4 chunks with
    all heads, or 8 per-head partitions) the whole-NSA benchmark measured selected attention at
    4.0 ms with all heads (nsa/variants.md#nsa_755b1ad's 8K row) against 5.9 ms per head
    (nsa/variants.md#nsa_6c8eeb7's).

    ``heads`` (HK or 1) fixes the head count; the chunk is then the largest that fits.
    """
    heads = _check_heads(HK, heads)
    per_token = (HQ // HK) * S * (element_size * D + 4)  # one KV head's partial bytes per token
    cfg = launch_settings()
    budget = max(cfg["partial_budget"], cfg["partial_budget_per_token"] * T)
    pow2_floor = lambda n: 1 << max(6, n.bit_length() - 1)
    if heads is None:
        if T * HK * per_token <= budget:
            return T, HK
        heads = 1 if -(-T // pow2_floor(budget // (HK * per_token))) >= HK else HK
    if T * heads * per_token <= budget:
        return T, heads
    return min(T, pow2_floor(budget // (heads * per_token))), heads


def _check_heads(HK: int, heads: Optional[int]) -> Optional[int]:
    if heads is not None and heads not in (1, HK):
        raise ValueError(f"heads per partition must be 1 or HK={HK}, got {heads}")
    return heads


def partition_heads(T: int, HK: int, chunk_size: int, heads: Optional[int]) -> int:
    """KV heads per partition for a given chunk: ``heads`` when given (HK or 1), else all when
    one chunk covers T."""
    if _check_heads(HK, heads) is None:
        return HK if chunk_size >= T else 1
    return heads


def partition_rows(T: int, chunk_size: int, HKG: int, G: int, S: int) -> int:
    """Rows of one partition's partial buffers: (token, KV head of the partition, slot, head in group)."""
    return min(chunk_size, T) * HKG * S * G


def _partitions(csr: SelectionCSR, HKG: int):
    """(chunk index, first token, first KV head, first key) of each partition, head-major so
    that a KV head's K/V stay in L2 across its chunks and its dk/dv accumulators are final
    after its last chunk. One launch per partition, as many as all heads in HK times shorter
    chunks would take (``default_partition``): the loop bounds buffer memory, not work."""
    HK, NB, Tc = csr.HK, csr.meta.num_blocks, csr.chunk_size
    for hk0 in range(0, HK, HKG):
        for i_c in range(csr.num_chunks):
            yield i_c, i_c * Tc, hk0, (i_c * HK + hk0) * NB


def fmsa_fwd(q, k, v, block_indices, csr: SelectionCSR, scale, HKG: int,
             o: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
    """q [T, HQ, D], k/v [T, HK, D], block_indices [T, HK, S] -> o [T, HQ, D], lse fp32 [T, HQ] (log2).

    Partitions of ``csr.chunk_size`` tokens and ``HKG`` KV heads (HK or 1) bound the partial buffers.
    When ``csr.local`` > 0, ``o`` and ``lse`` hold the partial output and lse (log2) of each
    query's last ``csr.local`` blocks on entry (flash_msa/fused.py) and are merged into in place.
    """
    T, HQ, D = q.shape
    HK, S = k.shape[1], block_indices.shape[-1]
    G = HQ // HK
    meta, Tc = csr.meta, csr.chunk_size
    cfg = launch_settings()
    BM = _fwd_tile_rows(cfg, D, meta.block_size)
    R = BM * cfg["fwd_tiles"]  # rows of a program: fwd_tiles row tiles of one key
    tile_key, tile_first = tile_schedule(csr, G, R)
    if csr.local:
        if o is None or lse is None:
            raise ValueError("fmsa_fwd: a CSR without the local blocks needs their partial output and lse as o, lse")
    else:
        o = torch.empty_like(q)
        lse = torch.empty(T, HQ, device=q.device, dtype=torch.float32)
    rows = partition_rows(T, Tc, HKG, G, S)
    tma = _tma(cfg["fwd_tma"], q)
    pdt = torch.float32 if q.dtype == torch.float32 else q.dtype
    po = torch.empty(padded_rows(rows, HKG, meta.num_blocks, BM) if tma else rows, D, device=q.device, dtype=pdt)
    plse = torch.empty(rows, device=q.device, dtype=torch.float32)
    po_arg, pidx, key_rows = _tma_index(po, csr, G, BM, rows) if tma else (po, plse, plse)  # (plse: not read)
    for i_c, c0, hk0, k_lo in _partitions(csr, HKG):
        entries = min(Tc, T - c0) * HKG * S
        fmsa_fwd_kernel[(tile_bound(entries, G, R, HKG * chunk_blocks(csr, i_c)),)](
            q, k, v, po_arg, plse, pidx, key_rows, csr.entry_ids, csr.key_offsets, tile_key, tile_first,
            meta.block_start, meta.block_end, k_lo, c0, hk0, meta.num_blocks, scale * LOG2E,
            HQ=HQ, HK=HK, G=G, S=S, D=D, BS=meta.block_size, BM=BM, NT=cfg["fwd_tiles"], HKG=HKG, TMA=tma,
            num_warps=cfg["fwd_warps"], num_stages=_fwd_stages(cfg, tma, meta.block_size, D),
            **_reg_cap(cfg["fwd_maxnreg"], q))
        fmsa_merge_kernel[(min(Tc, T - c0), HKG)](
            po, plse, pidx, o, lse, block_indices, meta.tok_start, c0, hk0, T,
            HQ=HQ, HK=HK, G=G, S=S, D=D, BS=meta.block_size, BG=_reduce_rows(G),
            BSS=triton.next_power_of_2(S), HKG=HKG, LOCAL=csr.local, TMA=tma, num_warps=_merge_warps(cfg, G))
    return o, lse


def fmsa_bwd_dkdv(q, k, v, do, lse, delta, csr: SelectionCSR, scale, dq_partial: Optional[torch.Tensor],
                  HKG: int, block_indices: Optional[torch.Tensor] = None, dq: Optional[torch.Tensor] = None,
                  dq_acc: bool = False, dkv: Optional[tuple] = None):
    """dk, dv (dtype of k) by KV block. With ``dq_partial`` also dq (into ``dq``; added to what it
    holds with ``dq_acc``), partition by partition. ``dkv`` = (dk, dv) holding other branches'
    gradients, which this adds its fp32 sums to (one rounding) and returns."""
    T, HQ, D = q.shape
    HK, S = k.shape[1], csr.S
    G = HQ // HK
    meta, Tc = csr.meta, csr.chunk_size
    BS, NB = meta.block_size, meta.num_blocks
    cfg = launch_settings()
    BM = _bwd_tile_rows(cfg, D, BS)
    SEG = cfg["seg_tiles"] * BM
    seg_key, seg_first = tile_schedule(csr, G, SEG)
    slot_first = multi_segment_slots(csr, G, SEG)
    n_slots = 2 * partition_rows(T, Tc, HKG, G, S) // SEG + 1  # a key of n > SEG rows has < 2n / SEG segments
    dkp = torch.empty(n_slots, BS, D, device=k.device, dtype=torch.float32)
    dvp = torch.empty_like(dkp)
    # fp32 accumulators of one partition's KV heads, final after the heads' last chunk
    dk_acc = torch.empty(T, HKG, D, device=k.device, dtype=torch.float32)
    dv_acc = torch.empty_like(dk_acc)
    if dkv is None:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:
        dk, dv = dkv
        for name, x in (("dk", dk), ("dv", dv)):
            if x.shape != k.shape or x.dtype != k.dtype or not x.is_contiguous():
                raise ValueError(f"dkv's {name} must be a contiguous {k.dtype} tensor of k's shape {tuple(k.shape)}, "
                                 f"got {tuple(x.shape)} {x.dtype}{'' if x.is_contiguous() else ' (not contiguous)'}")
    write_dq = dq_partial is not None
    tma = write_dq and _tma(cfg["bwd_tma"], q)
    if tma:  # dq_partial needs dq_partial_rows() rows: keys padded to BM
        need = dq_partial_rows(q, csr, HKG, G)
        if dq_partial.shape[0] < need:
            raise ValueError(f"dq_partial has {dq_partial.shape[0]} rows; with bwd_tma it needs "
                             f"dq_partial_rows() = {need}")
        dq_arg, pidx, key_rows = _tma_index(dq_partial, csr, G, BM, partition_rows(T, Tc, HKG, G, S))
    else:
        dq_arg = dq_partial if write_dq else dk_acc
        pidx = key_rows = dk_acc  # not read
    for i_c, c0, hk0, k_lo in _partitions(csr, HKG):
        if i_c == 0:
            dk_acc.zero_()
            dv_acc.zero_()
        nbc = chunk_blocks(csr, i_c)
        entries = min(Tc, T - c0) * HKG * S
        fmsa_bwd_dkdv_kernel[(tile_bound(entries, G, SEG, HKG * nbc),)](
            q, k, v, do, lse, delta, dk_acc, dv_acc, dkp, dvp, dq_arg, pidx, key_rows,
            csr.entry_ids, csr.key_offsets, seg_key, seg_first, slot_first,
            meta.block_start, meta.block_end, k_lo, c0, hk0, NB, scale * LOG2E, scale,
            HQ=HQ, HK=HK, G=G, S=S, D=D, BS=BS, BM=BM, SEG=SEG, WRITE_DQ=write_dq, HKG=HKG, TMA=tma,
            num_warps=cfg["bwd_warps"], num_stages=cfg["bwd_stages"], **_reg_cap(cfg["bwd_maxnreg"], q))
        final = i_c == csr.num_chunks - 1  # these KV heads are done: the sums of every block go to dk, dv
        n_red = NB if final else nbc  # (the last chunk's nbc is NB too)
        fmsa_bwd_dkdv_reduce_kernel[(HKG * n_red,)](
            dk_acc, dv_acc, dkp, dvp, csr.key_offsets, slot_first, meta.block_start, meta.block_end,
            k_lo, NB, n_red, dk, dv, hk0, G=G, D=D, BS=BS, SEG=SEG, HKG=HKG, HK=HK, FINAL=final,
            ADD=dkv is not None, num_warps=8)
        if write_dq:
            fmsa_bwd_dq_kernel[(min(Tc, T - c0), HKG)](
                dq_partial, pidx, dq, block_indices, meta.tok_start, c0, hk0, T,
                HQ=HQ, HK=HK, G=G, S=S, D=D, BS=BS, BG=_reduce_rows(G), HKG=HKG, ACC=dq_acc, LOCAL=csr.local,
                TMA=tma)
    return dk, dv


def fmsa_forward(q, k, v, block_indices, block_size: int, cu_seqlens, scale: float,
                 chunk_size: Optional[int] = None, heads: Optional[int] = None, local: int = 0,
                 o: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
    """(o, lse, (csr, HKG)) on flat [T, H, D] inputs: the forward and what its backward needs.

    ``local`` > 0: the last ``local`` blocks of each query (which every query must have selected)
    are computed by the caller, whose partial output and lse (log2) ``o`` and ``lse`` hold; the
    backward then leaves their gradients to the caller too (flash_msa/fused.py)."""
    T, HQ, D = q.shape
    HK, S = k.shape[1], block_indices.shape[-1]
    if chunk_size is None:
        chunk_size, HKG = default_partition(T, HQ, HK, S, D, q.element_size(), heads)
    else:
        HKG = partition_heads(T, HK, chunk_size, heads)
    meta = get_block_meta(cu_seqlens, T, block_size)
    # the kernels index partial rows in int32; with TMA each key's rows are padded to a tile
    cfg = launch_settings()
    rows = padded_rows(partition_rows(T, chunk_size, HKG, HQ // HK, S), HKG, meta.num_blocks,
                       max(cfg["fwd_bm"], cfg["bwd_bm"]))
    if rows >= 2 ** 31:
        raise ValueError(f"chunk_size={chunk_size} gives {rows} partial rows per partition "
                         "(chunk * KV heads per partition * G * S, plus a tile per key); it must be < 2^31")
    csr = build_selection_csr(block_indices, meta, chunk_size, local)
    o, lse = fmsa_fwd(q, k, v, block_indices, csr, scale, HKG, o, lse)
    return o, lse, (csr, HKG)


def fmsa_backward(q, k, v, lse, block_indices, state, scale: float, do, delta, dq: Optional[torch.Tensor] = None,
                  dkv: Optional[tuple] = None):
    """(dq, dk, dv) from :func:`fmsa_forward`'s lse (log2) and state, with delta = rowsum(o * do).
    A given ``dq`` (``dkv`` = (dk, dv)) holds other branches' gradients, which this adds to
    (flash_msa/fused.py)."""
    csr, HKG = state
    T, HQ, D = q.shape
    acc = dq is not None
    if not acc:
        dq = torch.empty_like(q)
    # bf16/fp16 partials for bf16/fp16 inputs (summed in fp32), fp32 for fp32 inputs
    rows = dq_partial_rows(q, csr, HKG, HQ // k.shape[1])
    dq_partial = torch.empty(rows, D, device=q.device, dtype=q.dtype)
    dk, dv = fmsa_bwd_dkdv(q, k, v, do, lse, delta, csr, scale, dq_partial, HKG, block_indices, dq, dq_acc=acc,
                           dkv=dkv)
    return dq, dk, dv


class FMSASelectedAttentionFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, block_indices, block_size, cu_seqlens, scale, chunk_size, heads):
        o, lse, state = fmsa_forward(q, k, v, block_indices, block_size, cu_seqlens, scale, chunk_size, heads)
        ctx.save_for_backward(q, k, v, o, lse, block_indices)
        ctx.state, ctx.scale = state, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, block_indices = ctx.saved_tensors
        do = do.contiguous()
        delta = attention_delta(o, do)  # [T, HQ]
        dq, dk, dv = fmsa_backward(q, k, v, lse, block_indices, ctx.state, ctx.scale, do, delta)
        return dq, dk, dv, None, None, None, None, None, None


def kernel_limits_error(q: torch.Tensor, S: int) -> Optional[Exception]:
    """The error for a head dim, S or dtype the Triton kernels do not support, else None (the
    kernels' check, and the test "auto" and the whole NSA op choose by)."""
    D = q.shape[-1]
    if D not in HEAD_DIMS:
        return ValueError(f"D (head dim) must be one of {HEAD_DIMS} for the Triton kernels, got {D}")
    if S > MAX_S:
        return ValueError(f"S (selected blocks per query) must be at most {MAX_S} for the Triton kernels, got {S}")
    if q.dtype not in KERNEL_DTYPES:
        return TypeError(f"q dtype must be one of (float16, bfloat16, float32) for the Triton kernels, got {q.dtype}")
    return None


def check_kernel_limits(q: torch.Tensor, S: int) -> None:
    """The shapes and dtypes the Triton kernels support, beyond the interface's checks; and a
    device they run on (CUDA, or any tensor under the CPU interpreter, ``TRITON_INTERPRET=1``)."""
    err = kernel_limits_error(q, S)
    if err is not None:
        raise err
    check_triton_device(q, "the Triton selected-attention kernels need", "reference")


def fmsa_selected_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
    block_size: int, cu_seqlens: Optional[torch.Tensor], scale: float, chunk_size: Optional[int] = None,
    heads: Optional[int] = None,
) -> torch.Tensor:
    """KV-block-centric selected attention on validated [B, T, H, D] inputs (see ``selected_attention``).

    ``chunk_size`` (query tokens per chunk) and ``heads`` (KV heads per partition, HK or 1)
    default to :func:`default_partition`; with only ``heads`` given, the chunk is the largest
    that fits the budget; with only ``chunk_size`` given, ``heads`` is HK when one chunk covers
    the batch and 1 otherwise.
    Raises ValueError for shapes this kernel does not support (head dim, S, dtype).
    """
    check_kernel_limits(q, block_indices.shape[-1])
    B, T, HQ, D = q.shape
    qf, cu = flatten_batch(q.contiguous(), cu_seqlens)
    kf = k.contiguous().reshape(B * T, *k.shape[2:])
    vf = v.contiguous().reshape(B * T, *v.shape[2:])
    bi = block_indices.contiguous().reshape(B * T, *block_indices.shape[2:])
    o = FMSASelectedAttentionFunction.apply(qf, kf, vf, bi, block_size, cu, scale, chunk_size, heads)
    return o.view(B, T, HQ, D)
