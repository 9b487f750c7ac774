"""Speed-of-light probe of fmsa's two largest kernels: how much of each one's time its memory
traffic alone takes in Triton, on the shipped grid, index, tiles and launch settings.

Forward main kernel (``fmsa_fwd_kernel``), per variant:
  full       the shipped math (its partials checked bit for bit against the shipped kernel's)
  contiguous the same math on contiguous q rows (the tile's rows of the key's first token onward):
             what the gather costs over plain loads
  copy       gathers the q rows and writes them as the partials: the kernel's bytes, no matmul
  gather     gathers the q rows, writes one fp32 per row: the gather alone
  store      writes K as each tile's partials, no gather: the partial writes alone
  shipped_tma the shipped kernel with FWD_TMA: partials by TMA bulk copies in key order (padded)
  full_tma   full's math, partials in CSR order by TMA bulk copies (a descriptor per program, clipped
             at the key's last row); store_tma: those copies alone, no gather
  *_seq      full, copy and store with the partial rows written in the index's order instead (a key's
             rows consecutive: one 16 KB run per tile instead of 1 KB per entry), as a CSR-ordered
             partial layout would write them (wrapped into the buffer; not a working layout)
Baselines in the same run: ``fill_`` and ``copy_`` of the partition buffer, once per partition.
dk/dv kernel (``fmsa_bwd_dkdv_kernel``):
  full       the shipped math (dq parts and dk/dv checked bit for bit against the shipped kernel's)
  contiguous the same math on contiguous q / do rows (2 pipeline stages: see bwd_launcher)
  copy       gathers the q and do rows, writes q + do as the dq parts: the kernel's bytes, no matmul

Each variant is timed over all partitions, as fmsa launches them (triton.testing.do_bench, median),
beside the shipped kernel and the shipped merge in the same run. Inputs: randn q, k, v, do, the
bench's realistic selection (block 0 and the two local blocks forced, the rest random).

Usage (repo root, GPU): PYTHONPATH=kernels:. python3 scripts/probe_sol.py --out OUTDIR [--T 65536] [--Gs 4,5]
Writes OUTDIR/probe_sol_h200.json and prints a table. Without CUDA (TRITON_INTERPRET=1, a small --T)
it runs every variant once and checks the bitwise equalities, untimed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_selected import make_indices, useful_flops  # noqa: E402

from flash_msa.selection import fmsa  # noqa: E402
from flash_msa.selection.fmsa import _block_keys, _partial_rows  # noqa: E402
from flash_msa.utils.csr import (  # noqa: E402
    build_selection_csr, get_block_meta, multi_segment_slots, tile_bound, tile_schedule)

FWD_MODES = {"full": 0, "contiguous": 1, "copy": 2, "gather": 3, "store": 4,
             "full_seq": 5, "copy_seq": 6, "store_seq": 7, "full_tma": 8, "store_tma": 9}
BWD_MODES = {"full": 0, "contiguous": 1, "copy": 2}


@triton.jit
def _sol_softmax_pv(b_q, b_k, b_v, o_k, b_t, m_r, scale2):
    # the shipped math of one row tile: normalised partial output and its lse (log2)
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale2
    m_s = m_r[:, None] & (o_k[None, :] <= b_t[:, None])
    b_s = tl.where(m_s, b_s, float("-inf"))
    b_m = tl.where(m_r, tl.max(b_s, 1), 0.)
    b_p = tl.exp2(b_s - b_m[:, None])
    b_l = tl.where(m_r, tl.sum(b_p, 1), 1.)
    b_o = tl.dot(b_p.to(b_v.dtype), b_v) * (1. / b_l)[:, None]
    return b_o, b_m + tl.log2(b_l)


@triton.jit
def _sol_fwd_rows(q, po, plse, entry_ids, b_k, b_v, o_k, o_r, n_rows, i_e0, i_hk, c0, hk0, scale2, NQ, NP,
                  HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                  HKG: tl.constexpr, MODE: tl.constexpr):
    o_d = tl.arange(0, D)
    m_r = o_r < n_rows
    b_e = tl.load(entry_ids + i_e0 + o_r // G, mask=m_r, other=0)
    b_t = b_e // (HK * S)
    b_g = o_r % G
    if MODE == 1:  # contiguous rows of q (NQ = T * HQ rows), same count
        o_h = ((i_e0 * G + o_r) % NQ).to(tl.int64)
    else:
        o_h = b_t.to(tl.int64) * HQ + i_hk * G + b_g
    if MODE >= 5:  # the key's rows in index order, wrapped into the buffer's NP rows
        o_p = (i_e0 * G + o_r) % NP
    else:
        o_p = _partial_rows(b_e, b_t, b_g, i_hk, c0, hk0, HK, G, S, HKG)
    p_out = po + o_p.to(tl.int64)[:, None] * D + o_d[None, :]
    if MODE <= 1 or MODE == 5:
        b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)
        b_o, b_lse = _sol_softmax_pv(b_q, b_k, b_v, o_k, b_t, m_r, scale2)
        tl.store(p_out, b_o.to(po.dtype.element_ty), mask=m_r[:, None])
        tl.store(plse + o_p, b_lse, mask=m_r)
    elif MODE == 2 or MODE == 6:
        b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)
        tl.store(p_out, b_q.to(po.dtype.element_ty), mask=m_r[:, None])
        tl.store(plse + o_p, b_t.to(tl.float32), mask=m_r)
    elif MODE == 3:
        b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)
        tl.store(plse + o_p, tl.sum(b_q.to(tl.float32), 1), mask=m_r)
    else:
        tl.store(p_out, b_k.to(po.dtype.element_ty), mask=m_r[:, None])
        tl.store(plse + o_p, b_t.to(tl.float32), mask=m_r)


@triton.jit
def _sol_fwd_tma(q, desc, plse, entry_ids, b_k, b_v, o_k, i_r, n_rows, i_e0, i_base, i_hk, scale2,
                 HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                 BM: tl.constexpr, MODE: tl.constexpr):
    # full_tma / store_tma: rows i_r + [0, BM) of the key, partials in CSR order by TMA store
    o_d = tl.arange(0, D)
    o_r = i_r + tl.arange(0, BM)
    m_r = o_r < n_rows
    b_e = tl.load(entry_ids + i_e0 + o_r // G, mask=m_r, other=0)
    b_t = b_e // (HK * S)
    if MODE == 8:
        o_h = b_t.to(tl.int64) * HQ + i_hk * G + o_r % G
        b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)
        b_o, b_lse = _sol_softmax_pv(b_q, b_k, b_v, o_k, b_t, m_r, scale2)
        desc.store([i_r, 0], b_o.to(desc.dtype))
        tl.store(plse + i_base + o_r, b_lse, mask=m_r)
    else:
        desc.store([i_r, 0], b_k.to(desc.dtype))
        tl.store(plse + i_base + o_r, b_t.to(tl.float32), mask=m_r)


@triton.jit
def sol_fwd_kernel(
    q, k, v, po, plse, entry_ids, key_offsets, tile_key, tile_first,
    block_start, block_end, k_lo, c0, hk0, NB, scale2, NQ, NP,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, NT: tl.constexpr, HKG: tl.constexpr, MODE: tl.constexpr,
):
    # fmsa_fwd_kernel's body, the row tiles by _sol_fwd_rows (MODE: FWD_MODES)
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
    b_k = tl.load(k + p_kv, mask=m_k[:, None], other=0.)
    b_v = tl.load(v + p_kv, mask=m_k[:, None], other=0.)
    if MODE >= 8:
        # CSR-ordered partials (a key's rows consecutive from its first entry's row in the partition),
        # each tile written by one TMA store through a descriptor that ends at the key's last row, so
        # that a tile's rows past it are clipped by the copy engine, not written over the next key's
        i_base = (i_e0 - tl.load(key_offsets + k_lo)) * G
        desc = tl.make_tensor_descriptor(po + i_base.to(tl.int64) * D, shape=[n_rows, D], strides=[D, 1],
                                         block_shape=[BM, D])
        for i_j in range(NT):
            if r0 + i_j * BM < n_rows:
                _sol_fwd_tma(q, desc, plse, entry_ids, b_k, b_v, o_k, r0 + i_j * BM, n_rows, i_e0, i_base,
                             i_hk, scale2, HQ, HK, G, S, D, BM, MODE)
    else:
        for i_j in range(NT):
            if r0 + i_j * BM < n_rows:
                _sol_fwd_rows(q, po, plse, entry_ids, b_k, b_v, o_k, r0 + i_j * BM + tl.arange(0, BM), n_rows,
                              i_e0, i_hk, c0, hk0, scale2, NQ, NP, HQ, HK, G, S, D, HKG, MODE)


@triton.jit
def sol_dkdv_kernel(
    q, k, v, do, lse, delta, dk, dv, dkp, dvp, dqp, entry_ids, key_offsets,
    seg_key, seg_first, slot_first, block_start, block_end,
    k_lo, c0, hk0, NB, scale2, scale, NQ,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, SEG: tl.constexpr, HKG: tl.constexpr, MODE: tl.constexpr,
):
    # fmsa_bwd_dkdv_kernel with WRITE_DQ (MODE: BWD_MODES)
    i_seg = tl.load(seg_first + k_lo) + tl.program_id(0)
    if i_seg >= tl.load(seg_first + k_lo + HKG * NB):
        return
    i_key = tl.load(seg_key + i_seg)
    i_hk = (i_key // NB) % HK
    i_b = i_key % NB
    i_e0 = tl.load(key_offsets + i_key)
    n_rows = (tl.load(key_offsets + i_key + 1) - i_e0) * G
    i_j = i_seg - tl.load(seg_first + i_key)
    r_begin = i_j * SEG
    r_end = tl.minimum(n_rows, r_begin + SEG)
    o_d = tl.arange(0, D)
    o_k, m_k, p_kv = _block_keys(block_start, block_end, i_b, i_hk, HK, D, BS)
    b_k = tl.load(k + p_kv, mask=m_k[:, None], other=0.)
    b_v = tl.load(v + p_kv, mask=m_k[:, None], other=0.)
    _, _, p_acc = _block_keys(block_start, block_end, i_b, i_hk - hk0, HKG, D, BS)
    b_dk = tl.zeros([BS, D], dtype=tl.float32)
    b_dv = tl.zeros([BS, D], dtype=tl.float32)
    for i_r in range(r_begin, r_end, BM):
        o_r = i_r + tl.arange(0, BM)
        m_r = o_r < r_end
        b_e = tl.load(entry_ids + i_e0 + o_r // G, mask=m_r, other=0)
        b_t = b_e // (HK * S)
        b_g = o_r % G
        if MODE == 1:
            o_h = ((i_e0 * G + o_r) % NQ).to(tl.int64)
        else:
            o_h = b_t.to(tl.int64) * HQ + i_hk * G + b_g
        b_q = tl.load(q + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)
        b_do = tl.load(do + o_h[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.)
        o_p = _partial_rows(b_e, b_t, b_g, i_hk, c0, hk0, HK, G, S, HKG)
        if MODE <= 1:
            b_lse = tl.load(lse + o_h, mask=m_r, other=0.)
            b_delta = tl.load(delta + o_h, mask=m_r, other=0.)
            b_s = tl.dot(b_q, tl.trans(b_k)) * scale2
            m_s = m_r[:, None] & (o_k[None, :] <= b_t[:, None])
            b_p = tl.where(m_s, tl.exp2(b_s - b_lse[:, None]), 0.)
            b_dp = tl.dot(b_do, tl.trans(b_v))
            b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_q.dtype)
            b_dq = tl.dot(b_ds, b_k) * scale
            tl.store(dqp + o_p.to(tl.int64)[:, None] * D + o_d[None, :], b_dq.to(dqp.dtype.element_ty),
                     mask=m_r[:, None])
            b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
            b_dk += tl.dot(tl.trans(b_ds), b_q)
        else:
            tl.store(dqp + o_p.to(tl.int64)[:, None] * D + o_d[None, :], (b_q + b_do).to(dqp.dtype.element_ty),
                     mask=m_r[:, None])
    b_dk = b_dk * scale
    if n_rows <= SEG:
        b_dk += tl.load(dk + p_acc, mask=m_k[:, None], other=0.)
        b_dv += tl.load(dv + p_acc, mask=m_k[:, None], other=0.)
        tl.store(dk + p_acc, b_dk, mask=m_k[:, None])
        tl.store(dv + p_acc, b_dv, mask=m_k[:, None])
    else:
        i_slot = (tl.load(slot_first + i_key) - tl.load(slot_first + k_lo) + i_j).to(tl.int64)
        o_s = i_slot * BS * D + tl.arange(0, BS)[:, None] * D + o_d[None, :]
        tl.store(dkp + o_s, b_dk)
        tl.store(dvp + o_s, b_dv)


def setup(T, HK, G, D, bs, S, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    HQ = HK * G
    q = torch.randn(T, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(T, HK, D, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(T, HK, D, device=device, dtype=torch.bfloat16, generator=gen)
    do = torch.randn(T, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)
    bi = make_indices(T, HK, S, bs, device, gen)
    cu = torch.tensor([0, T], device=device, dtype=torch.int32)
    return q, k, v, do, bi, cu


def fwd_launcher(q, k, v, bi, csr, HKG, scale, mode):
    """All partitions' forward main kernels (the shipped one for mode None) into one partial buffer."""
    T, HQ, D = q.shape
    HK, S = k.shape[1], bi.shape[-1]
    G = HQ // HK
    meta, Tc = csr.meta, csr.chunk_size
    BM, R = fmsa.FWD_BM, fmsa.FWD_BM * fmsa.FWD_TILES
    tile_key, tile_first = tile_schedule(csr, G, R)
    rows = fmsa.partition_rows(T, Tc, HKG, G, S)
    po = torch.zeros(rows, D, device=q.device, dtype=q.dtype)  # zeros: rows no partition writes compare equal
    plse = torch.zeros(rows, device=q.device, dtype=torch.float32)
    if mode == "shipped_tma":  # fmsa_fwd_kernel with TMA: tile-ordered buffer, descriptor, entry rows
        po = torch.zeros(fmsa.padded_rows(rows, HKG, meta.num_blocks, BM), D, device=q.device, dtype=q.dtype)
        desc, pidx, key_rows = fmsa._tma_index(po, csr, G, BM, rows)
    launches = []
    for i_c, c0, hk0, k_lo in fmsa._partitions(csr, HKG):
        grid = (tile_bound(min(Tc, T - c0) * HKG * S, G, R, HKG * fmsa.chunk_blocks(csr, i_c)),)
        args = (q, k, v, po, plse, csr.entry_ids, csr.key_offsets, tile_key, tile_first,
                meta.block_start, meta.block_end, k_lo, c0, hk0, meta.num_blocks, scale * fmsa.LOG2E)
        kw = dict(HQ=HQ, HK=HK, G=G, S=S, D=D, BS=meta.block_size, BM=BM, NT=fmsa.FWD_TILES, HKG=HKG,
                  num_warps=fmsa.FWD_WARPS, num_stages=fmsa.FWD_STAGES, **fmsa._reg_cap(fmsa.FWD_MAXNREG, q))
        launches.append((grid, args, kw))

    def run():
        for grid, args, kw in launches:
            if mode is None:  # the shipped kernel, partials in entry order (pidx unused)
                fmsa.fmsa_fwd_kernel[grid](*args[:5], plse, plse, *args[5:], **kw, TMA=False)
            elif mode == "shipped_tma":
                kw_tma = dict(kw, num_stages=fmsa._fwd_stages(True, meta.block_size, D))
                fmsa.fmsa_fwd_kernel[grid](*args[:3], desc, plse, pidx, key_rows, *args[5:], **kw_tma, TMA=True)
            else:
                sol_fwd_kernel[grid](*args, T * HQ, rows, **kw, MODE=FWD_MODES[mode])
    return run, po, plse


def bwd_launcher(q, k, v, do, lse, delta, bi, csr, HKG, scale, mode):
    """All partitions' dk/dv kernels (the shipped one for mode None), without the reductions; every
    variant's timing includes the two fp32 zero fills of the [T, HKG, D] accumulators, as fmsa's."""
    T, HQ, D = q.shape
    HK, S = k.shape[1], bi.shape[-1]
    G = HQ // HK
    meta, Tc = csr.meta, csr.chunk_size
    BS, NB = meta.block_size, meta.num_blocks
    BM = fmsa._bwd_tile_rows(D, BS)
    SEG = fmsa.SEG_TILES * BM
    seg_key, seg_first = tile_schedule(csr, G, SEG)
    slot_first = multi_segment_slots(csr, G, SEG)
    n_slots = 2 * fmsa.partition_rows(T, Tc, HKG, G, S) // SEG + 1
    dkp = torch.zeros(n_slots, BS, D, device=q.device, dtype=torch.float32)
    dvp = torch.zeros_like(dkp)
    dk_acc = torch.zeros(T, HKG, D, device=q.device, dtype=torch.float32)
    dv_acc = torch.zeros_like(dk_acc)
    dqp = torch.zeros(fmsa.partition_rows(T, Tc, HKG, G, S), D, device=q.device, dtype=q.dtype)
    launches = []
    for i_c, c0, hk0, k_lo in fmsa._partitions(csr, HKG):
        grid = (tile_bound(min(Tc, T - c0) * HKG * S, G, SEG, HKG * fmsa.chunk_blocks(csr, i_c)),)
        args = (q, k, v, do, lse, delta, dk_acc, dv_acc, dkp, dvp, dqp, csr.entry_ids, csr.key_offsets,
                seg_key, seg_first, slot_first, meta.block_start, meta.block_end, k_lo, c0, hk0, NB,
                scale * fmsa.LOG2E, scale)
        # contiguous rows: 2 stages, as Triton's pipeliner then stages q / do too and 3 stages would
        # need 265 KB of shared memory (198 KB at 2; kernel_resources-style compile under Triton 3.6)
        stages = 2 if mode == "contiguous" else fmsa.BWD_STAGES
        kw = dict(HQ=HQ, HK=HK, G=G, S=S, D=D, BS=BS, BM=BM, SEG=SEG, HKG=HKG,
                  num_warps=fmsa.BWD_WARPS, num_stages=stages, **fmsa._reg_cap(fmsa.BWD_MAXNREG, q))
        launches.append((grid, args, kw))

    def run():
        dk_acc.zero_()
        dv_acc.zero_()
        for grid, args, kw in launches:
            if mode is None:
                fmsa.fmsa_bwd_dkdv_kernel[grid](*args[:11], dk_acc, dk_acc, *args[11:], **kw, WRITE_DQ=True, TMA=False)
            else:
                sol_dkdv_kernel[grid](*args, T * HQ, **kw, MODE=BWD_MODES[mode])
    return run, (dqp, dk_acc, dv_acc, dkp, dvp)


def csr_rows(csr, HKG, G, S):
    """The last partition's partial rows in CSR order (full_tma) and in the shipped layout, paired."""
    HK, NB = csr.HK, csr.meta.num_blocks
    _, c0, hk0, k_lo = list(fmsa._partitions(csr, HKG))[-1]
    e_lo, e_hi = csr.key_offsets[k_lo].item(), csr.key_offsets[k_lo + HKG * NB].item()
    e = csr.entry_ids[e_lo:e_hi].long()
    g = torch.arange(G, device=e.device)
    t, hk, slot = e // (HK * S), (e // S) % HK, e % S
    if HKG == HK:
        ref = (e - c0 * HK * S)[:, None] * G + g
    else:
        ref = (((t - c0) * HKG + (hk - hk0)) * S + slot)[:, None] * G + g
    return (torch.arange(e_hi - e_lo, device=e.device)[:, None] * G + g).flatten(), ref.flatten()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn):
    if not torch.cuda.is_available():  # the CPU interpreter (TRITON_INTERPRET=1) checks the variants only
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def probe(T, HK, G, D, bs, S, seed=0, modes=None):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # full_tma / store_tma build their TMA descriptors in the kernel: 128 B of global scratch each
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    q, k, v, do, bi, cu = setup(T, HK, G, D, bs, S, device, seed)
    scale = D ** -0.5
    HQ = HK * G
    chunk, HKG = fmsa.default_partition(T, HQ, HK, S, D, q.element_size())
    meta = get_block_meta(cu, T, bs)
    csr = build_selection_csr(bi, meta, chunk)
    o, lse, _ = fmsa.fmsa_forward(q, k, v, bi, bs, cu, scale)
    delta = fmsa.attention_delta(o, do)
    row = dict(T=T, HK=HK, G=G, D=D, block_size=bs, S=S, chunk=chunk, heads_per_partition=HKG,
               fwd_tflop=useful_flops(bi, G, D, bs) / 1e12)
    # partial bytes of all partitions: gathered q rows = partial rows = valid entries * G
    n_rows = int((csr.key_offsets[-1] - csr.key_offsets[0]).item()) * G
    row["gathered_gb"] = n_rows * D * 2 / 1e9
    # the whole shipped forward (tile schedule, main kernels, merges): the merge's share is this minus fwd_shipped_ms
    # the whole forward with the row stores (fmsa_forward_ms) and with FWD_TMA (partials by TMA bulk
    # copies in key order, fmsa_forward_tma_ms), checked bit for bit against each other
    shipped_tma = fmsa.FWD_TMA
    try:
        fmsa.FWD_TMA = False
        row["fmsa_forward_ms"] = bench(lambda: fmsa.fmsa_fwd(q, k, v, bi, csr, scale, HKG))
        o_ref = fmsa.fmsa_fwd(q, k, v, bi, csr, scale, HKG)
        fmsa.FWD_TMA = True
        if fmsa._tma(fmsa.FWD_TMA, q):
            o_tma = fmsa.fmsa_fwd(q, k, v, bi, csr, scale, HKG)
            row["fmsa_forward_tma_bitwise"] = all(torch.equal(a, b) for a, b in zip(o_ref, o_tma))
            del o_tma
            row["fmsa_forward_tma_ms"] = bench(lambda: fmsa.fmsa_fwd(q, k, v, bi, csr, scale, HKG))
        del o_ref
    finally:
        fmsa.FWD_TMA = shipped_tma

    n_part = len(list(fmsa._partitions(csr, HKG)))
    buf = torch.empty(fmsa.partition_rows(T, chunk, HKG, G, S), D, device=device, dtype=q.dtype)
    src = torch.randn_like(buf)

    def fill():
        for _ in range(n_part):
            buf.fill_(1.0)

    def copy():
        for _ in range(n_part):
            buf.copy_(src)
    row["partition_buffer_gb"] = buf.numel() * buf.element_size() / 1e9
    row["partitions"] = n_part
    row["fill_ms"] = bench(fill)
    row["copy_ms"] = bench(copy)
    del buf, src
    ref_run, ref_po, ref_plse = fwd_launcher(q, k, v, bi, csr, HKG, scale, None)
    row["fwd_shipped_ms"] = bench(ref_run)
    ref_run()
    sync()
    fwd = {}
    for mode in modes or [*FWD_MODES, "shipped_tma"]:
        if mode in BWD_MODES and mode not in FWD_MODES:
            continue
        run, po, plse = fwd_launcher(q, k, v, bi, csr, HKG, scale, mode)
        if mode == "full":
            run()
            sync()
            # one partition's buffer: the last partition's rows are what both buffers hold
            row["fwd_full_bitwise"] = bool(torch.equal(po, ref_po) and torch.equal(plse, ref_plse))
        if mode == "full_tma":
            run()
            sync()
            # the last partition's partials in CSR order against the shipped layout's, row by row
            rows_csr, rows_ref = csr_rows(csr, HKG, G, S)
            row["fwd_tma_bitwise"] = bool(torch.equal(po[rows_csr], ref_po[rows_ref])
                                          and torch.equal(plse[rows_csr], ref_plse[rows_ref]))
        fwd[mode] = bench(run)
    row["fwd_ms"] = fwd

    ref_bwd, ref_out = bwd_launcher(q, k, v, do, lse, delta, bi, csr, HKG, scale, None)
    row["dkdv_shipped_ms"] = bench(ref_bwd)
    ref_bwd()
    sync()
    bwd = {}
    for mode in BWD_MODES if modes is None else [m for m in modes if m in BWD_MODES]:
        run, out = bwd_launcher(q, k, v, do, lse, delta, bi, csr, HKG, scale, mode)
        if mode == "full":
            run()
            sync()
            row["dkdv_full_bitwise"] = bool(all(torch.equal(a, b) for a, b in zip(out, ref_out)))
        bwd[mode] = bench(run)
    row["dkdv_ms"] = bwd
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--HK", type=int, default=8)
    ap.add_argument("--Gs", default="4,5")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--modes", default=None, help="comma-separated variants to run (default all); "
                    "names shared by both kernels run in both")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for G in (int(g) for g in args.Gs.split(",")):
        row = probe(args.T, args.HK, G, args.D, 64, 16, modes=args.modes.split(",") if args.modes else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__, triton=triton.__version__, rows=rows)
    with open(os.path.join(args.out, "probe_sol_h200.json"), "w") as f:
        json.dump(res, f, indent=1)
    for r in rows:
        print(f"G={r['G']}: {r['partitions']} partitions of {r['partition_buffer_gb']:.3f} GB: fill_ {r['fill_ms']:.2f} ms, "
              f"copy_ {r['copy_ms']:.2f} ms; gathered rows {r['gathered_gb']:.2f} GB; shipped forward {r['fmsa_forward_ms']:.2f} ms, "
              f"with FWD_TMA {r.get('fmsa_forward_tma_ms', float('nan')):.2f} ms")
    print("\n| G | kernel | shipped | " + " | ".join([*FWD_MODES, "shipped_tma"]) + " |")
    for r in rows:
        print(f"| {r['G']} | forward main | {r['fwd_shipped_ms']:.2f} | "
              + " | ".join(f"{r['fwd_ms'].get(m, float('nan')):.2f}" for m in [*FWD_MODES, "shipped_tma"]) + " |")
        print(f"| {r['G']} | dk/dv | {r['dkdv_shipped_ms']:.2f} | "
              + " | ".join(f"{r['dkdv_ms'].get(m, float('nan')):.2f}" for m in FWD_MODES) + " |")


if __name__ == "__main__":
    main()
