"""Range attention in Triton, and sliding-window attention on top of it.

Range attention: query t (one packed stream ``[T, HQ, D]``) attends to the contiguous key
rows ``[lo[t], hi[t])`` of ``k, v [Tk, HK, D]``. Two NSA branches are exactly this:

- sliding window: ``lo = max(seq_start, t - w + 1)``, ``hi = t + 1`` (keys are the tokens);
- compressed attention: ``lo = cu_cmp[seq]``, ``hi = lo + n_visible(t)`` (keys are the packed
  compressed rows, see :mod:`flash_msa.compression.compressed_attention`).

The backward also needs, for every key row s, the contiguous range ``[qlo[s], qhi[s])`` of
queries that see it; it must be exact (query t sees row s iff ``qlo[s] <= t < qhi[s]``).
Ranges are int32 arrays computed on the device from ``cu_seqlens`` (no host sync), so tiles
may straddle sequences freely.

Every loop runs in three parts: masked tiles at the two edges, and between them the tiles
that every row of the program sees in full, which skip the range test and the load masks
(:func:`_split_range`). Compressed attention is almost all interior: a tile of 32 queries
sees the same compressed rows but the last one or two.

GQA packing: a program's M dimension is ``BM`` consecutive (token, head-of-group) rows
``m = t*G + g`` of one KV head, so K/V tiles are loaded once for the whole group and any
G (1..16, 5 included) packs densely.

Backward: dq per query tile, dk/dv per key tile, no atomics, so it is deterministic. The
dk/dv programs are ordered key tile-major, and for compressed attention each walks its query
rows from the last down, so that the programs running together read the same q/do rows
(``desc`` of the launch settings, ``_tiles``).
Scores are kept in log2 units inside the kernels; ``lse`` is returned in natural log.

Reads bottom-up: kernels -> host launchers -> autograd Function -> public functions.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from flash_msa import tuning
from flash_msa.utils.cache import per_batch
from flash_msa.utils.varlen import token_seq_bounds

LOG2E = 1.4426950408889634
# constants read inside kernels must be tl.constexpr globals
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_BIG = tl.constexpr(1 << 30)


@triton.jit
def _split_range(start, end, in_lo, in_hi, B: tl.constexpr):
    # Splits the loop [start, end) (steps of B from start) into masked [start, a), unmasked
    # [a, b) and masked [b, end): [a, b) is the largest run of whole steps inside the
    # interior [in_lo, in_hi), where every (row, column) pair of the tile is visible.
    a = start + tl.cdiv(tl.maximum(in_lo - start, 0), B) * B
    b = a + tl.maximum(in_hi - a, 0) // B * B
    a = tl.where(in_lo < in_hi, a, start)
    b = tl.where(in_lo < in_hi, b, start)
    return a, b


@triton.jit
def _query_tile_keys(lo, hi, o_t, m_m, BN: tl.constexpr):
    # key ranges of a tile of query rows: each row's [lo, hi) ([BM] each), the union
    # [n_start, n_end) of the non-empty rows, and the interior [a, b) every row sees in full
    # (an empty row makes it empty)
    b_lo = tl.load(lo + o_t, mask=m_m, other=0)  # [BM]
    b_hi = tl.load(hi + o_t, mask=m_m, other=0)
    m_nonempty = m_m & (b_lo < b_hi)
    n_start = tl.min(tl.where(m_nonempty, b_lo, _BIG), 0)
    n_end = tl.max(tl.where(m_nonempty, b_hi, 0), 0)
    a, b = _split_range(n_start, n_end, tl.max(tl.where(m_m, b_lo, 0), 0), tl.min(tl.where(m_m, b_hi, _BIG), 0), BN)
    return b_lo, b_hi, n_start, a, b, n_end


@triton.jit
def _kv_tile(k, v, n0, n_end, i_h, HK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
             MASK: tl.constexpr):
    # key rows [n0, n0 + BN) of KV head i_h; an interior tile (MASK false) lies inside [0, n_end)
    o_n = n0 + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    o_kv = (o_n.to(tl.int64) * HK + i_h)[:, None] * D + o_d[None, :]
    if MASK:
        m_kv = (o_n < n_end)[:, None] & (o_d < D)[None, :]
    else:
        m_kv = (o_d < D)[None, :]
    b_k = tl.load(k + o_kv, mask=m_kv, other=0.)  # [BN, BD]
    b_v = tl.load(v + o_kv, mask=m_kv, other=0.)  # [BN, BD]
    return o_n, b_k, b_v


@triton.jit
def _fwd_step(b_q, b_m, b_l, b_acc, k, v, b_lo, b_hi, n0, n_end, i_h, scale2,
              HK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr):
    o_n, b_k, b_v = _kv_tile(k, v, n0, n_end, i_h, HK, D, BD, BN, MASK)  # [BN], [BN, BD] x2
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale2  # [BM, BN]
    if MASK:
        m_s = (o_n[None, :] >= b_lo[:, None]) & (o_n[None, :] < b_hi[:, None])
        b_s = tl.where(m_s, b_s, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    b_ms = tl.where(b_mn == float("-inf"), 0., b_mn)  # rows with nothing visible yet
    b_p = tl.exp2(b_s - b_ms[:, None])
    b_a = tl.exp2(b_m - b_ms)
    b_l = b_l * b_a + tl.sum(b_p, 1)
    b_acc = b_acc * b_a[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return b_mn, b_l, b_acc


@triton.jit
def range_attn_fwd_kernel(
    q, k, v, o, lse, lo, hi, mid, o_loc, lse_loc, scale2, T, Tk,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, LOCAL: tl.constexpr,
):
    # LOCAL: keys [mid, hi) first, whose partial output and lse (log2) go to o_loc / lse_loc
    # (selected attention's last blocks, flash_msa/fused.py), then [lo, mid) on the same state
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T * G
    o_t = (o_m // G).to(tl.int64)
    o_hq = i_h * G + o_m % G
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_q = q + (o_t * HQ + o_hq)[:, None] * D + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.)  # [BM, BD]

    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    if LOCAL:  # a few tiles (two blocks), all masked: one loop here, not three (see the note above _tiles)
        b_lo, b_hi, n_start, _, _, n_end = _query_tile_keys(mid, hi, o_t, m_m, BN)
        for n0 in range(n_start, n_end, BN):
            b_m, b_l, b_acc = _fwd_step(b_q, b_m, b_l, b_acc, k, v, b_lo, b_hi, n0, n_end, i_h, scale2, HK, D, BD, BN, True)
        m_any = b_l > 0
        b_ls = tl.where(m_any, b_l, 1.)
        tl.store(o_loc + (o_t * HQ + o_hq)[:, None] * D + o_d[None, :], (b_acc / b_ls[:, None]).to(o_loc.dtype.element_ty),
                 mask=m_m[:, None] & m_d[None, :])
        tl.store(lse_loc + o_t * HQ + o_hq, tl.where(m_any, b_m + tl.log2(b_ls), float("-inf")), mask=m_m)
        b_lo, b_hi, n_start, a, b, n_end = _query_tile_keys(lo, mid, o_t, m_m, BN)
    else:
        b_lo, b_hi, n_start, a, b, n_end = _query_tile_keys(lo, hi, o_t, m_m, BN)
    for n0 in range(n_start, a, BN):
        b_m, b_l, b_acc = _fwd_step(b_q, b_m, b_l, b_acc, k, v, b_lo, b_hi, n0, n_end, i_h, scale2, HK, D, BD, BN, True)
    for n0 in range(a, b, BN):
        b_m, b_l, b_acc = _fwd_step(b_q, b_m, b_l, b_acc, k, v, b_lo, b_hi, n0, n_end, i_h, scale2, HK, D, BD, BN, False)
    for n0 in range(b, n_end, BN):
        b_m, b_l, b_acc = _fwd_step(b_q, b_m, b_l, b_acc, k, v, b_lo, b_hi, n0, n_end, i_h, scale2, HK, D, BD, BN, True)
    m_any = b_l > 0
    b_o = b_acc / tl.where(m_any, b_l, 1.)[:, None]
    b_lse = tl.where(m_any, (b_m + tl.log2(tl.where(m_any, b_l, 1.))) * _LN2, float("-inf"))
    tl.store(o + (o_t * HQ + o_hq)[:, None] * D + o_d[None, :], b_o.to(o.dtype.element_ty),
             mask=m_m[:, None] & m_d[None, :])
    tl.store(lse + o_t * HQ + o_hq, b_lse, mask=m_m)


@triton.jit
def range_attn_bwd_preprocess_kernel(o, do, dlse, delta, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    # delta = rowsum(o * do) - dlse: the lse gradient enters ds = p * (dp - delta) exactly.
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < N
    o_d = tl.arange(0, BD)
    m = m_r[:, None] & (o_d < D)[None, :]
    b_o = tl.load(o + o_r[:, None] * D + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_do = tl.load(do + o_r[:, None] * D + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_dlse = tl.load(dlse + o_r, mask=m_r, other=0.)
    tl.store(delta + o_r, tl.sum(b_o * b_do, 1) - b_dlse, mask=m_r)


@triton.jit
def _dq_step(b_q, b_do, b_lse, b_delta, b_lse2, b_delta2, b_dq, k, v, b_lo, b_hi, n0, n_end, i_h, scale2,
             HK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
             TWO: tl.constexpr):
    # TWO: these keys are also in a second softmax (lse2, delta2: selected attention's last
    # blocks, flash_msa/fused.py) over the same scores; its ds adds to this one's
    o_n, b_k, b_v = _kv_tile(k, v, n0, n_end, i_h, HK, D, BD, BN, MASK)  # [BN], [BN, BD] x2
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale2  # [BM, BN]
    b_p = tl.exp2(b_s - b_lse[:, None])
    if TWO:
        b_p2 = tl.exp2(b_s - b_lse2[:, None])
    if MASK:
        m_s = (o_n[None, :] >= b_lo[:, None]) & (o_n[None, :] < b_hi[:, None])
        b_p = tl.where(m_s, b_p, 0.)
        if TWO:
            b_p2 = tl.where(m_s, b_p2, 0.)
    b_dp = tl.dot(b_do, tl.trans(b_v))  # [BM, BN]
    b_ds = b_p * (b_dp - b_delta[:, None])
    if TWO:
        b_ds += b_p2 * (b_dp - b_delta2[:, None])
    return b_dq + tl.dot(b_ds.to(b_k.dtype), b_k)


@triton.jit
def range_attn_bwd_dq_kernel(
    q, k, v, do, lse, delta, dq, lo, hi, mid, lse2, delta2, scale2, scale, T, Tk,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr, LOCAL: tl.constexpr,
):
    # ACC: dq already holds other branches' dq of these rows (flash_msa/fused.py), added to in fp32.
    # LOCAL: keys [mid, hi) are also in a second softmax, lse2 (log2) and delta2 (the forward's
    # o_loc part of selected attention), whose dq this adds
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T * G
    o_t = (o_m // G).to(tl.int64)
    o_hq = i_h * G + o_m % G
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_qd = (o_t * HQ + o_hq)[:, None] * D + o_d[None, :]
    m_qd = m_m[:, None] & m_d[None, :]
    b_q = tl.load(q + o_qd, mask=m_qd, other=0.)  # [BM, BD]
    b_do = tl.load(do + o_qd, mask=m_qd, other=0.)  # [BM, BD]
    b_lse = tl.load(lse + o_t * HQ + o_hq, mask=m_m, other=0.) * _LOG2E  # [BM]
    # rows with nothing visible (lse = -inf) contribute nothing; keep their exp2 finite
    b_lse = tl.where(b_lse == float("-inf"), 0., b_lse)
    b_delta = tl.load(delta + o_t * HQ + o_hq, mask=m_m, other=0.)  # [BM]

    b_dq = tl.zeros([BM, BD], dtype=tl.float32)
    if LOCAL:
        b_lse2 = tl.load(lse2 + o_t * HQ + o_hq, mask=m_m, other=0.)  # log2; +inf (a zero gate) gives p2 = 0
        b_delta2 = tl.load(delta2 + o_t * HQ + o_hq, mask=m_m, other=0.)
        b_lo, b_hi, n_start, _, _, n_end = _query_tile_keys(mid, hi, o_t, m_m, BN)
        for n0 in range(n_start, n_end, BN):  # a few tiles, all masked (as in the forward)
            b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_lse2, b_delta2, b_dq, k, v, b_lo, b_hi, n0, n_end, i_h, scale2,
                            HK, D, BD, BN, True, True)
        b_lo, b_hi, n_start, a, b, n_end = _query_tile_keys(lo, mid, o_t, m_m, BN)
    else:
        b_lo, b_hi, n_start, a, b, n_end = _query_tile_keys(lo, hi, o_t, m_m, BN)
    for n0 in range(n_start, a, BN):
        b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_lse, b_delta, b_dq, k, v, b_lo, b_hi, n0, n_end, i_h, scale2,
                        HK, D, BD, BN, True, False)
    for n0 in range(a, b, BN):
        b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_lse, b_delta, b_dq, k, v, b_lo, b_hi, n0, n_end, i_h, scale2,
                        HK, D, BD, BN, False, False)
    for n0 in range(b, n_end, BN):
        b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_lse, b_delta, b_dq, k, v, b_lo, b_hi, n0, n_end, i_h, scale2,
                        HK, D, BD, BN, True, False)
    b_dq = b_dq * scale
    if ACC:
        b_dq += tl.load(dq + o_qd, mask=m_qd, other=0.).to(tl.float32)
    tl.store(dq + o_qd, b_dq.to(dq.dtype.element_ty), mask=m_qd)


@triton.jit
def _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, lo, hi, mid, lse2, delta2, o_n, m0, r_end, i_h, scale2,
               HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
               MASK: tl.constexpr, TWO: tl.constexpr):
    # TWO (with MASK): keys [mid, hi) of a row are also in a second softmax (lse2 in log2, delta2),
    # see range_attn_bwd_dq_kernel
    o_m = m0 + tl.arange(0, BM)
    o_t = (o_m // G).to(tl.int64)
    o_hq = i_h * G + o_m % G
    o_d = tl.arange(0, BD)
    o_qd = (o_t * HQ + o_hq)[:, None] * D + o_d[None, :]
    if MASK:
        m_m = o_m < r_end
    else:
        m_m = o_m >= 0  # every row of an interior tile is a real, visible row
    m_qd = m_m[:, None] & (o_d < D)[None, :]
    b_q = tl.load(q + o_qd, mask=m_qd, other=0.)  # [BM, BD]
    b_do = tl.load(do + o_qd, mask=m_qd, other=0.)  # [BM, BD]
    b_lse = tl.load(lse + o_t * HQ + o_hq, mask=m_m, other=0.) * _LOG2E
    b_delta = tl.load(delta + o_t * HQ + o_hq, mask=m_m, other=0.)
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale2  # [BM, BN]
    if MASK:
        b_lo = tl.load(lo + o_t, mask=m_m, other=0)
        b_hi = tl.load(hi + o_t, mask=m_m, other=0)
        m_s = m_m[:, None] & (o_n[None, :] >= b_lo[:, None]) & (o_n[None, :] < b_hi[:, None])  # [BM, BN]
        b_p = tl.where(m_s, tl.exp2(b_s - tl.where(m_m, b_lse, 0.)[:, None]), 0.)
    else:
        b_p = tl.exp2(b_s - b_lse[:, None])
    if TWO:
        b_mid = tl.load(mid + o_t, mask=m_m, other=0)
        b_lse2 = tl.load(lse2 + o_t * HQ + o_hq, mask=m_m, other=0.)
        b_delta2 = tl.load(delta2 + o_t * HQ + o_hq, mask=m_m, other=0.)
        m_s2 = m_m[:, None] & (o_n[None, :] >= b_mid[:, None]) & (o_n[None, :] < b_hi[:, None])
        b_p2 = tl.where(m_s2, tl.exp2(b_s - tl.where(m_m, b_lse2, 0.)[:, None]), 0.)
        b_dv += tl.dot(tl.trans((b_p + b_p2).to(b_do.dtype)), b_do)
    else:
        b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
    b_dp = tl.dot(b_do, tl.trans(b_v))  # [BM, BN]
    b_ds = b_p * (b_dp - b_delta[:, None])
    if TWO:
        b_ds += b_p2 * (b_dp - b_delta2[:, None])
    b_dk += tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q)
    return b_dk, b_dv


@triton.jit
def range_attn_bwd_dkdv_kernel(
    q, k, v, do, lse, delta, dk, dv, lo, hi, qlo, qhi, mid, qmid, lse2, delta2, scale2, scale, T, Tk,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, DESC: tl.constexpr, LOCAL: tl.constexpr,
):
    # one program per (key tile, KV head), a 1-D grid ordered tile-major (the KV heads of a tile
    # are neighbours), see _tiles' desc. LOCAL (rows upwards only): key row s is also in the second
    # softmax of the queries [qlo[s], qmid[s]) (range_attn_bwd_dq_kernel), whose rows come first.
    i_n, i_h = tl.program_id(0) // HK, tl.program_id(0) % HK
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < Tk
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_kv = (o_n.to(tl.int64) * HK + i_h)[:, None] * D + o_d[None, :]
    m_kv = m_n[:, None] & m_d[None, :]
    b_k = tl.load(k + o_kv, mask=m_kv, other=0.)  # [BN, BD]
    b_v = tl.load(v + o_kv, mask=m_kv, other=0.)  # [BN, BD]
    b_qlo = tl.load(qlo + o_n, mask=m_n, other=0)
    b_qhi = tl.load(qhi + o_n, mask=m_n, other=0)
    m_nonempty = m_n & (b_qlo < b_qhi)
    t_start = tl.min(tl.where(m_nonempty, b_qlo, _BIG), 0)
    t_end = tl.max(tl.where(m_nonempty, b_qhi, 0), 0)
    r_start = tl.where(t_start < t_end, t_start * G, 0)
    r_end = t_end * G
    # query rows that see every key row of the tile (qlo/qhi are exact ranges; an empty key row
    # or a tile past Tk makes it empty)
    t_in_lo = tl.max(tl.where(m_n, b_qlo, _BIG), 0)
    t_in_hi = tl.min(tl.where(m_n, b_qhi, 0), 0)
    m_in = t_in_lo < t_in_hi

    b_dk = tl.zeros([BN, BD], dtype=tl.float32)
    b_dv = tl.zeros([BN, BD], dtype=tl.float32)
    if LOCAL:
        # rows up to the last query whose second softmax holds a key row of the tile, with both
        # softmaxes (masked), then the rest as below
        r_loc = tl.minimum(tl.maximum(tl.max(tl.where(m_nonempty, tl.load(qmid + o_n, mask=m_n, other=0), 0), 0) * G,
                                      r_start), r_end)
        for m0 in range(r_start, r_loc, BM):  # rows past r_loc are masked: the loops below take them
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, lo, hi, mid, lse2, delta2, o_n, m0,
                                    r_loc, i_h, scale2, HQ, G, D, BD, BM, True, True)
        r_start = r_loc
    a, b = _split_range(r_start, r_end, tl.where(m_in, t_in_lo, 0) * G, tl.where(m_in, t_in_hi, 0) * G, BM)
    if DESC:
        # rows from the last down: every program of a sequence starts at its end and walks down
        # at the same pace, so programs running together read the same q/do rows and share them
        # in L2 (walked upwards, each program starts at its own first row and reads a stream no
        # other program reads in time)
        for m0 in range(b, r_end, BM):
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, lo, hi, mid, lse2, delta2, o_n, m0, r_end, i_h, scale2,
                                    HQ, G, D, BD, BM, True, False)
        for i_m in range(0, (b - a) // BM):
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, lo, hi, mid, lse2, delta2, o_n, b - (i_m + 1) * BM, r_end,
                                    i_h, scale2, HQ, G, D, BD, BM, False, False)
        for i_m in range(0, (a - r_start) // BM):
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, lo, hi, mid, lse2, delta2, o_n, a - (i_m + 1) * BM, r_end,
                                    i_h, scale2, HQ, G, D, BD, BM, True, False)
    else:
        for m0 in range(r_start, a, BM):
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, lo, hi, mid, lse2, delta2, o_n, m0, r_end, i_h, scale2,
                                    HQ, G, D, BD, BM, True, False)
        for m0 in range(a, b, BM):
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, lo, hi, mid, lse2, delta2, o_n, m0, r_end, i_h, scale2,
                                    HQ, G, D, BD, BM, False, False)
        for m0 in range(b, r_end, BM):
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, lo, hi, mid, lse2, delta2, o_n, m0, r_end, i_h, scale2,
                                    HQ, G, D, BD, BM, True, False)
    tl.store(dk + o_kv, (b_dk * scale).to(dk.dtype.element_ty), mask=m_kv)
    tl.store(dv + o_kv, b_dv.to(dv.dtype.element_ty), mask=m_kv)


# dk/dv schedule ("desc" below). The programs run key tile-major, and per kind DESC walks each
# program's query rows from the last down (_tiles adds it to the dk/dv launch options unless the
# entry sets it). Before (rows
# upwards, head after head), compressed attention's dk/dv read q/do at a 4% L2 hit rate
# (Nsight Compute on the H200), and at 64K its 512
# programs of falling length ran head after head, the longest of the last heads last. Whole
# backward, H200 bf16 (benchmarks/results/tune/variants.md#tune_dkdv_schedule), before -> now: compressed
# 20.88 -> 15.84 ms at 64K and 262.7 -> 251.6 at 256K; the window, whose key tiles see equal
# short ranges, gains only from the tile-major order (rows downwards cost it 6% at 256K):
# 5.41 -> 5.10 ms at 64K, 22.06 -> 20.75 at 256K.

# The local part of the window kernels (LOCAL, flash_msa/fused.py) runs its few tiles all masked,
# in one loop per kernel. Three loop parts like the rest (unmasked tiles inside; with dk/dv's ds as
# (p + p2) dp - (p delta + p2 delta2)) measured the same whole op at 64K: 54.7 against 54.5 ms
# (Llama3-8B), 68.1 against 68.1 (Qwen3-14B), the window dq kernel 2.80 against 2.67 ms
# (commit e8488f2: benchmarks/results/nsa/variants.md#nsa_local_e8488f2, profile/variants.md#profile_nsa_64k_local_e8488f2).

# Launch settings of op "range_attention" (flash_msa.tuning): per kernel "fwd" | "dq" | "dkdv" a
# (BM, BN, launch options) entry, and "desc" {kind: bool}, the dk/dv row order. An override
# (flash_msa.tuning.override(range_attention=...)) replaces whole entries; tests force small tiles
# with it and scripts/tune_nsa.py times candidates.
tuning.register("range_attention", ("fwd", "dq", "dkdv", "desc"))


def _tiles(D: int, device, kind: str, local: bool = False) -> dict:
    """Tile sizes and launch options for ``kind`` ("cmp" or "window"; ``local``: the window with
    selected attention's local blocks, flash_msa/fused.py): H200-tuned on CUDA, large tiles for the
    CPU interpreter."""
    BD = max(16, triton.next_power_of_2(D))
    desc = {"cmp": True, "window": False}
    if device.type != "cuda":
        cfg = dict(fwd=(64, 64, {}), dq=(64, 64, {}), dkdv=(64, 64, {}))
    elif BD <= 64:
        cfg = dict(fwd=(128, 64, dict(num_warps=4, num_stages=3)), dq=(128, 64, dict(num_warps=8, num_stages=2)),
                   dkdv=(64, 64, dict(num_warps=4, num_stages=2)))
    elif kind == "cmp":  # D=128, benchmarks/results/tune/latest.md (64K and 256K agree)
        cfg = dict(fwd=(128, 64, dict(num_warps=8, num_stages=3)), dq=(64, 64, dict(num_warps=4, num_stages=2)),
                   dkdv=(64, 64, dict(num_warps=4, num_stages=2)))
    else:  # the window, D=128, same sweep
        cfg = dict(fwd=(128, 32, dict(num_warps=4, num_stages=3)), dq=(128, 64, dict(num_warps=8, num_stages=3)),
                   dkdv=(64, 64, dict(num_warps=4, num_stages=2)))
        if local:  # with the local blocks, 64-row dq tiles (tune_nsa.py --ops window_local,
            # benchmarks/results/tune/variants.md#tune_window_local): the window's backward at 64K 5.61
            # against 5.89 ms (Llama3-8B), 6.94 against 7.52 (Qwen3-14B); without them the two
            # tiles are even (5.39 / 5.35 ms, tune/latest.md)
            cfg["dq"] = (64, 64, dict(num_warps=4, num_stages=2))
    cfg = dict(tuning.settings("range_attention", dict(cfg, desc=desc)))
    bm, bn, opts = cfg["dkdv"]
    cfg["dkdv"] = (bm, bn, {"DESC": cfg.pop("desc")[kind], **opts})  # the kind's row order unless the entry sets one
    return dict(BD=BD, **cfg)


def range_attention_fwd(q, k, v, lo, hi, scale: float, kind: str = "window", local: Optional[tuple] = None):
    """q [T, HQ, D], k/v [Tk, HK, D], lo/hi int32 [T] -> (o [T, HQ, D], lse fp32 [T, HQ], natural log).

    ``local`` = (mid int32 [T], o_loc [T, HQ, D], lse_loc fp32 [T, HQ]) with lo <= mid < hi: the
    attention of each query over its keys [mid, hi) alone is also written, to o_loc and (log2) lse_loc.
    """
    T, HQ, D = q.shape
    Tk, HK = k.shape[:2]
    G = HQ // HK
    o = torch.empty_like(q)
    lse = torch.empty(T, HQ, dtype=torch.float32, device=q.device)
    cfg = _tiles(D, q.device, kind, local is not None)
    BM, BN, opts = cfg["fwd"]
    grid = (triton.cdiv(T * G, BM), HK)
    mid, o_loc, lse_loc = (hi, o, lse) if local is None else local
    range_attn_fwd_kernel[grid](q, k, v, o, lse, lo, hi, mid, o_loc, lse_loc, scale * LOG2E, T, Tk,
                                HQ=HQ, HK=HK, G=G, D=D, BD=cfg["BD"], BM=BM, BN=BN, LOCAL=local is not None, **opts)
    return o, lse


def range_attention_bwd(q, k, v, o, lse, do, dlse, lo, hi, qlo, qhi, scale: float, kind: str = "window", *,
                        delta: Optional[torch.Tensor] = None, dq: Optional[torch.Tensor] = None,
                        local: Optional[tuple] = None):
    """Gradients (dq, dk, dv) of range attention; dlse (or None) is the gradient of lse.

    ``delta`` ([T, HQ] fp32, rowsum(o * do) - dlse) may be given, then ``o`` and ``dlse`` are not
    read; a given ``dq`` holds other branches' dq, which this adds to (flash_msa/fused.py).
    ``local`` = (mid [T], qmid [Tk], lse2 [T, HQ] log2, delta2 [T, HQ]): keys [mid[t], hi[t]) of
    query t are also in a second softmax of the same scores, with lse2 and delta2 (its forward
    is range_attention_fwd's o_loc part); its gradients are added. Key row s is in it for the
    queries [qlo[s], qmid[s]) (exactly). Window kind only (rows upwards in dk/dv).
    """
    T, HQ, D = q.shape
    Tk, HK = k.shape[:2]
    G = HQ // HK
    cfg = _tiles(D, q.device, kind, local is not None)
    BD = cfg["BD"]
    if delta is None:
        delta = torch.empty(T, HQ, dtype=torch.float32, device=q.device)
        if dlse is None:
            dlse = torch.zeros(T, HQ, dtype=torch.float32, device=q.device)
        BR = 64
        range_attn_bwd_preprocess_kernel[(triton.cdiv(T * HQ, BR),)](
            o, do, dlse.float().contiguous(), delta, T * HQ, D=D, BD=BD, BR=BR)
    acc = dq is not None
    if not acc:
        dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    mid, qmid, lse2, delta2 = (hi, qhi, lse, delta) if local is None else local
    BM, BN, opts = cfg["dq"]
    range_attn_bwd_dq_kernel[(triton.cdiv(T * G, BM), HK)](
        q, k, v, do, lse, delta, dq, lo, hi, mid, lse2, delta2, scale * LOG2E, scale, T, Tk,
        HQ=HQ, HK=HK, G=G, D=D, BD=BD, BM=BM, BN=BN, ACC=acc, LOCAL=local is not None, **opts)
    if Tk > 0:
        BM, BN, opts = cfg["dkdv"]
        if local is not None and opts["DESC"]:
            raise ValueError("range_attention_bwd: local needs the dk/dv rows upwards (DESC False)")
        range_attn_bwd_dkdv_kernel[(triton.cdiv(Tk, BN) * HK,)](
            q, k, v, do, lse, delta, dk, dv, lo, hi, qlo, qhi, mid, qmid, lse2, delta2, scale * LOG2E, scale, T, Tk,
            HQ=HQ, HK=HK, G=G, D=D, BD=BD, BM=BM, BN=BN, LOCAL=local is not None, **opts)
    return dq, dk, dv


class RangeAttentionFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, qlo, qhi, scale, kind):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = range_attention_fwd(q, k, v, lo, hi, scale, kind)
        ctx.save_for_backward(q, k, v, o, lse, lo, hi, qlo, qhi)
        ctx.scale, ctx.kind = scale, kind
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, lo, hi, qlo, qhi = ctx.saved_tensors
        dq, dk, dv = range_attention_bwd(q, k, v, o, lse, do.contiguous(), dlse, lo, hi, qlo, qhi, ctx.scale, ctx.kind)
        return dq, dk, dv, None, None, None, None, None, None


def range_attention(q, k, v, lo, hi, qlo, qhi, scale: float, kind: str = "window"):
    """Attention of query t over key rows [lo[t], hi[t]); see the module docstring.

    Args:
        q: [T, HQ, D]; k, v: [Tk, HK, D] with HQ a multiple of HK.
        lo, hi: int32 [T], the key range of each query token (empty when lo >= hi).
        qlo, qhi: int32 [Tk], the exact range of query tokens that see key row s.
        scale: softmax scale.
        kind: "window" (short ranges) or "cmp" (long ranges): picks the tuned tiles.

    Returns:
        (o [T, HQ, D] in q's dtype, 0 where the range is empty; lse fp32 [T, HQ], -inf there).
        Differentiable in q, k, v (and through lse).
    """
    return RangeAttentionFunction.apply(q, k, v, lo, hi, qlo, qhi, scale, kind)


def window_ranges(cu_seqlens: torch.Tensor, T: int, window: int):
    """(lo, hi, qlo, qhi) int32 [T] for the sliding window: no host sync."""
    start, end = token_seq_bounds(cu_seqlens, T)
    t = torch.arange(T, device=cu_seqlens.device)
    lo = torch.maximum(start, t - window + 1)
    qhi = torch.minimum(t + window, end)
    return lo.to(torch.int32), (t + 1).to(torch.int32), t.to(torch.int32), qhi.to(torch.int32)


def local_ranges(cu_seqlens: torch.Tensor, T: int, block: int):
    """(mid int32 [T], qmid int32 [T]) for the last two selection blocks of each query: query t
    of a sequence starting at s0, in its block b = (t - s0) // block, has keys [mid[t], t] in
    blocks b - 1 and b (b alone when b = 0); key row s is in them for the queries
    [s, qmid[s]), qmid[s] = the start of block (s - s0) // block + 2, or the sequence's end."""
    start, end = token_seq_bounds(cu_seqlens, T)
    t = torch.arange(T, device=cu_seqlens.device)
    own = (t - start) // block
    mid = start + (own - 1).clamp_min(0) * block
    qmid = torch.minimum(start + (own + 2) * block, end)
    return mid.to(torch.int32), qmid.to(torch.int32)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     window: int, scale: float) -> torch.Tensor:
    """Sliding-window attention on one packed stream (the contract of flash_msa.reference.window_attention).

    Args:
        q: [T, HQ, D]; k, v: [T, HK, D].
        cu_seqlens: int32 [N+1] offsets of the packed sequences.
        window: w; query t of a sequence starting at s0 sees keys [max(s0, t - w + 1), t].
        scale: softmax scale.

    Returns:
        o: [T, HQ, D] in q's dtype. Differentiable in q, k, v (deterministic backward).
    """
    lo, hi, qlo, qhi = per_batch(window_ranges, cu_seqlens, q.shape[0], window)  # shared by the layers
    o, _ = range_attention(q, k, v, lo, hi, qlo, qhi, scale, "window")
    return o
