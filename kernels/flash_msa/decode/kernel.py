"""NSA decoding in Triton: every branch of the last Tq queries against a KV cache, in three launches.

A program works on one new query and one KV head, with the G query heads of the group as the rows
of its matmuls (padded to 16, the matmul minimum). Decoding one token of one sequence gives only
HK such (query, KV head) pairs, so the passes over the compressed rows, which grow with the
sequence, are split over S programs each (flash-decoding), and small fixed-size work merges them:

1. ``decode_cmp_kernel`` (query, KV head, split): compressed attention over the split's compressed
   rows (online softmax in log2 units); writes the split's running max, sum and unnormalised output;
2. ``decode_topk_kernel`` (query, KV head, split): merges the lse of the S splits of step 1, then
   walks the split's selection blocks in windows of BR compressed rows covering NBC blocks:
   p = exp2(s - lse) summed over the group (fp32) is spread over the blocks by the overlap
   |keys(i) ∩ block j| / l; block 0 and the own and previous blocks are forced, blocks after the own
   one dropped, and a sorted list of the best NL keys is merged with each window's (bitonic: the
   elementwise max of the list and the window sorted the other way holds the top NL). A key is
   ``bits(score) << 32 | (2^31 - 1 - block)``: scores are >= 0, so their float bits order like the
   floats, and the lower block wins a tie, the reference's rule. Writes the split's list;
3. ``decode_out_kernel`` (query, KV head): merges the splits' outputs into o_cmp and their lists
   into the top n, runs selected attention over those blocks and the sliding window (keys
   ``max(0, t - w + 1) .. t``), and writes the gated sum in fp32 of the three branches, each rounded
   to the input dtype first, as in training.

decode/naive.py is the reference these are tested against. The compressed rows come in
precomputed (decode/__init__.py keeps them across steps); K/V are read in place through their
strides (HF's cache layout). Scratch: O(Tq * HQ * S * D), nothing that grows with the sequence.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# programs to aim for in steps 1 and 2 (about two per SM of an H100 / H200)
TARGET_PROGRAMS = 264


@triton.jit
def _online_step(b_q, b_k, b_v, m_k, m_i, l_i, acc, sm_scale):
    """One online-softmax step of the [BG, BD] queries against a tile of keys (log2 units)."""
    b_s = tl.dot(b_q, tl.trans(b_k)) * sm_scale  # [BG, BK]
    b_s = tl.where(m_k[None, :], b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))  # m_i starts finite, so a fully masked tile keeps alpha = 1
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(b_s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
    return m_new, l_i, acc


@triton.jit
def _query(q_ptr, sq_b, sq_t, sq_h, Tq, Tk, G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, D: tl.constexpr):
    """The program's query: (batch, row in the batch, position t, KV head, its (query, KV head) pair
    index, group heads, [BG, BD] q tile). The KV head is int64: times K/V's head stride it passes 2^31
    at long Tk in HF's cache layout."""
    i_r, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64)
    pair = i_r * tl.num_programs(1) + i_h
    i_b = (i_r // Tq).to(tl.int64)
    i_t = (i_r % Tq).to(tl.int64)
    t = Tk - Tq + i_r % Tq
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    heads = i_h * G + o_g
    b_q = tl.load(q_ptr + i_b * sq_b + i_t * sq_t + heads[:, None] * sq_h + o_d[None, :],
                  mask=(o_g < G)[:, None] & (o_d < D)[None, :], other=0.)
    return i_b, i_t, t, i_h, pair, heads, b_q


@triton.jit
def _n_visible(t, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr):
    """Compressed rows visible to position t: i*d + l - 1 <= t."""
    return tl.where(t >= CMP_BLOCK - 1, (t - CMP_BLOCK + 1) // CMP_STRIDE + 1, 0)


@triton.jit
def decode_cmp_kernel(
    q_ptr, kc_ptr, vc_ptr, m_ptr, l_ptr, acc_ptr,
    sq_b, sq_t, sq_h, skc_b, skc_t, skc_h, svc_b, svc_t, svc_h,
    Tq, Tk, sm_scale, ROWS, S,  # ROWS: compressed rows per split, a multiple of BC; S: splits
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BG: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, BC: tl.constexpr,
):
    i_b, i_t, t, i_h, pair, heads, b_q = _query(q_ptr, sq_b, sq_t, sq_h, Tq, Tk, G, BG, BD, D)
    i_s = tl.program_id(2)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    kc_base = kc_ptr + i_b * skc_b + i_h * skc_h
    vc_base = vc_ptr + i_b * svc_b + i_h * svc_h
    hi = tl.minimum(_n_visible(t, CMP_BLOCK, CMP_STRIDE), (i_s + 1) * ROWS)
    m_i = tl.full([BG], -1e30, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    o_c = tl.arange(0, BC)
    for c0 in range(i_s * ROWS, hi, BC):
        rows = c0 + o_c
        m_c = rows < hi
        p_rows = rows.to(tl.int64)[:, None]
        b_k = tl.load(kc_base + p_rows * skc_t + o_d[None, :], mask=m_c[:, None] & m_d[None, :], other=0.)
        b_v = tl.load(vc_base + p_rows * svc_t + o_d[None, :], mask=m_c[:, None] & m_d[None, :], other=0.)
        m_i, l_i, acc = _online_step(b_q, b_k, b_v, m_c, m_i, l_i, acc, sm_scale)
    o_g = tl.arange(0, BG)
    m_g = o_g < G  # the scratch holds the G real heads, not the padding
    slot = pair * S + i_s
    tl.store(m_ptr + slot * G + o_g, m_i, mask=m_g)
    tl.store(l_ptr + slot * G + o_g, l_i, mask=m_g)
    tl.store(acc_ptr + (slot * G + o_g[:, None]) * D + o_d[None, :], acc, mask=m_g[:, None] & m_d[None, :])


@triton.jit
def _merged_lse(m_ptr, l_ptr, pair, S, SP: tl.constexpr, G: tl.constexpr, BG: tl.constexpr):
    """The compressed-attention lse [BG] (log2) of one (query, KV head) from its S split partials,
    with the max M and the sum L (L = 0: no visible row)."""
    o_s = tl.arange(0, SP)
    o_g = tl.arange(0, BG)
    p = (pair * S + o_s)[:, None] * G + o_g[None, :]
    m = (o_s < S)[:, None] & (o_g < G)[None, :]
    m_s = tl.load(m_ptr + p, mask=m, other=-1e30)  # [SP, BG]
    l_s = tl.load(l_ptr + p, mask=m, other=0.)
    M = tl.max(m_s, 0)
    L = tl.sum(l_s * tl.exp2(m_s - M[None, :]), 0)
    lse = tl.where(L > 0, M + tl.log2(tl.where(L > 0, L, 1.)), float("-inf"))
    return lse, M, L


@triton.jit
def decode_topk_kernel(
    q_ptr, kc_ptr, m_ptr, l_ptr, key_ptr,
    sq_b, sq_t, sq_h, skc_b, skc_t, skc_h,
    Tq, Tk, sm_scale, WINDOWS, S, S2,  # WINDOWS: score windows (of NBC blocks) per split; S, S2: splits
    SP: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BG: tl.constexpr, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, BR: tl.constexpr, NBC: tl.constexpr,
    SLC_BLOCK: tl.constexpr, NL: tl.constexpr,
):
    i_b, i_t, t, i_h, pair, heads, b_q = _query(q_ptr, sq_b, sq_t, sq_h, Tq, Tk, G, BG, BD, D)
    i_s = tl.program_id(2)
    lse, M, L = _merged_lse(m_ptr, l_ptr, pair, S, SP, G, BG)
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    kc_base = kc_ptr + i_b * skc_b + i_h * skc_h
    n_vis = _n_visible(t, CMP_BLOCK, CMP_STRIDE)
    own = t // SLC_BLOCK
    o_j = tl.arange(0, NL)
    o_r = tl.arange(0, BR)
    best = tl.full([NL], -1, tl.int64)  # descending; -1 = no block
    j_end = tl.minimum(own + 1, (i_s + 1) * WINDOWS * NBC)
    for j0 in range(i_s * WINDOWS * NBC, j_end, NBC):
        first = j0 * SLC_BLOCK - CMP_BLOCK + 1  # the first row that overlaps block j0: i*d + l > j0*l'
        rows = tl.where(first > 0, (first + CMP_STRIDE - 1) // CMP_STRIDE, 0) + o_r
        m_r = rows < n_vis
        b_k = tl.load(kc_base + rows.to(tl.int64)[:, None] * skc_t + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                      other=0.)
        b_s = tl.dot(b_q, tl.trans(b_k)) * sm_scale  # [BG, BR]
        p = tl.where((o_g < G)[:, None] & m_r[None, :], tl.exp2(b_s - lse[:, None]), 0.)
        p_row = tl.sum(p, 0)  # [BR], summed over the group in fp32
        blk = j0 + o_j
        lo = tl.maximum(rows[:, None] * CMP_STRIDE, blk[None, :] * SLC_BLOCK)
        hi = tl.minimum(rows[:, None] * CMP_STRIDE + CMP_BLOCK, (blk[None, :] + 1) * SLC_BLOCK)
        overlap = tl.maximum(hi - lo, 0).to(tl.float32) / CMP_BLOCK  # [BR, NL]
        score = tl.sum(p_row[:, None] * overlap, 0)  # [NL]
        forced = (blk == 0) | (blk == own) | (blk == own - 1)
        score = tl.where(forced, float("inf"), score)
        key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (2147483647 - blk).to(tl.int64)
        key = tl.where((o_j < NBC) & (blk <= own), key, -1)
        best = tl.sort(tl.maximum(best, tl.sort(key)), descending=True)
    tl.store(key_ptr + (pair * S2 + i_s) * NL + o_j, best)


@triton.jit
def decode_out_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, key_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sg_c, so_b, so_t, so_h,
    Tq, Tk, sm_scale, S, S2,
    SP: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BG: tl.constexpr, SLC_BLOCK: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, NL: tl.constexpr,
    WINDOW: tl.constexpr, BW: tl.constexpr,
):
    i_b, i_t, t, i_h, pair, heads, b_q = _query(q_ptr, sq_b, sq_t, sq_h, Tq, Tk, G, BG, BD, D)
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    k_base = k_ptr + i_b * sk_b + i_h * sk_h
    v_base = v_ptr + i_b * sv_b + i_h * sv_h

    # compressed attention: the splits' outputs, rescaled to the common max (0 without a visible row)
    lse, M, L = _merged_lse(m_ptr, l_ptr, pair, S, SP, G, BG)
    o_cmp = tl.zeros([BG, BD], tl.float32)
    for s in range(S):
        slot = pair * S + s
        w = tl.exp2(tl.load(m_ptr + slot * G + o_g, mask=m_g, other=-1e30) - M)
        o_cmp += w[:, None] * tl.load(acc_ptr + (slot * G + o_g[:, None]) * D + o_d[None, :],
                                      mask=m_g[:, None] & m_d[None, :], other=0.)
    o_cmp = o_cmp / tl.where(L > 0, L, 1.)[:, None]

    # the top n of the splits' lists, then selected attention over those blocks
    o_j = tl.arange(0, NL)
    best = tl.full([NL], -1, tl.int64)
    for s in range(S2):
        part = tl.load(key_ptr + (pair * S2 + s) * NL + o_j)
        best = tl.sort(tl.maximum(best, tl.sort(part)), descending=True)
    chosen = tl.where((o_j < TOPK) & (best >= 0), 2147483647 - (best & 0xFFFFFFFF), -1)  # [NL] block ids
    m_s = tl.full([BG], -1e30, tl.float32)
    l_s = tl.zeros([BG], tl.float32)
    acc_s = tl.zeros([BG, BD], tl.float32)
    o_k = tl.arange(0, BS)
    for s in range(TOPK):
        b = tl.sum(tl.where(o_j == s, chosen, 0))
        keys = b * SLC_BLOCK + o_k
        m_k = (keys >= 0) & (o_k < SLC_BLOCK) & (keys <= t)  # b = -1 (no block) gives negative keys
        p_keys = keys.to(tl.int64)[:, None]
        b_k = tl.load(k_base + p_keys * sk_t + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.)
        b_v = tl.load(v_base + p_keys * sv_t + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.)
        m_s, l_s, acc_s = _online_step(b_q, b_k, b_v, m_k, m_s, l_s, acc_s, sm_scale)
    o_slc = acc_s / tl.where(l_s > 0, l_s, 1.)[:, None]

    # the sliding window
    m_w = tl.full([BG], -1e30, tl.float32)
    l_w = tl.zeros([BG], tl.float32)
    acc_w = tl.zeros([BG, BD], tl.float32)
    o_w = tl.arange(0, BW)
    for k0 in range(tl.maximum(t - WINDOW + 1, 0), t + 1, BW):
        keys = k0 + o_w
        m_k = keys <= t
        p_keys = keys.to(tl.int64)[:, None]
        b_k = tl.load(k_base + p_keys * sk_t + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.)
        b_v = tl.load(v_base + p_keys * sv_t + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.)
        m_w, l_w, acc_w = _online_step(b_q, b_k, b_v, m_k, m_w, l_w, acc_w, sm_scale)
    o_swa = acc_w / tl.where(l_w > 0, l_w, 1.)[:, None]

    # the gated sum in fp32, each branch rounded to the input dtype first (as the whole op does)
    dt = o_ptr.dtype.element_ty
    p_g = g_ptr + i_b * sg_b + i_t * sg_t + heads * sg_h
    g_cmp = tl.load(p_g, mask=m_g, other=0.).to(tl.float32)
    g_slc = tl.load(p_g + sg_c, mask=m_g, other=0.).to(tl.float32)
    g_swa = tl.load(p_g + 2 * sg_c, mask=m_g, other=0.).to(tl.float32)
    o = (g_cmp[:, None] * o_cmp.to(dt).to(tl.float32) + g_slc[:, None] * o_slc.to(dt).to(tl.float32)
         + g_swa[:, None] * o_swa.to(dt).to(tl.float32))
    tl.store(o_ptr + i_b * so_b + i_t * so_t + heads[:, None] * so_h + o_d[None, :], o.to(dt),
             mask=m_g[:, None] & m_d[None, :])


@functools.lru_cache(maxsize=None)  # a pure function of the sizes, asked on every decoding step
def _score_window(cmp_block: int, cmp_stride: int, slc_block: int, lanes: int) -> tuple[int, int]:
    """(BR, NBC): a window of BR compressed rows holds every row that overlaps NBC consecutive
    selection blocks (NBC <= lanes). The rows of blocks [j0, j0 + n) run from
    ceil((j0 l' - l + 1) / d) to floor(((j0 + n) l' - 1) / d), at most (n l' + l - 2) // d + 1."""
    br = 64
    while True:
        fits = [n for n in range(1, lanes + 1) if (n * slc_block + cmp_block - 2) // cmp_stride + 1 <= br]
        if fits and (max(fits) == lanes or br >= 256):
            return br, max(fits)
        br *= 2


def _splits(pairs: int, units: int, target: int) -> tuple[int, int]:
    """Split ``units`` (row chunks or score windows) over about target / pairs programs per pair:
    returns (units per split, splits), every split non-empty."""
    want = max(1, min(units, -(-target // max(pairs, 1))))
    per = -(-units // want) if units else 1
    return per, max(1, -(-units // per)) if units else 1


def nsa_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor, k_cmp: torch.Tensor,
                      v_cmp: torch.Tensor, *, cmp_block: int, cmp_stride: int, slc_block: int, slc_topk: int,
                      window: int, scale: float, target_programs: Optional[int] = None) -> torch.Tensor:
    """Launcher. q [B, Tq, HQ, D]; k, v [B, Tk, HK, D] (any strides but the last); gates [B, Tq, HQ, 3] (any strides);
    k_cmp, v_cmp [B, Nc, HK, D], the compressed rows of the sequences (Nc = rows visible to the last
    query). ``target_programs`` sets how finely steps 1 and 2 split (default TARGET_PROGRAMS).
    Returns [B, Tq, HQ, D] in q's dtype. Inputs are checked by the caller (decode/__init__.py)."""
    B, Tq, HQ, D = q.shape
    Tk, HK = k.shape[1], k.shape[2]
    G, Nc = HQ // HK, k_cmp.shape[1]
    q, k, v, k_cmp, v_cmp = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, k_cmp, v_cmp))
    if Nc == 0:  # no compressed row yet: the kernels read none, but want a real pointer
        k_cmp = v_cmp = k.new_zeros(B, 1, HK, D)
    BG, BD = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    NL = max(16, triton.next_power_of_2(slc_topk))
    BR, NBC = _score_window(cmp_block, cmp_stride, slc_block, NL)
    BC = 64
    pairs = B * Tq * HK
    target = target_programs or TARGET_PROGRAMS
    chunks_per_split, S = _splits(pairs, triton.cdiv(Nc, BC), target)
    windows_per_split, S2 = _splits(pairs, triton.cdiv(triton.cdiv(Tk, slc_block), NBC), target)
    dev = q.device
    m_part = torch.empty(pairs * S * G, device=dev, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(pairs * S * G * D, device=dev, dtype=torch.float32)
    key_part = torch.empty(pairs * S2 * NL, device=dev, dtype=torch.int64)
    o = torch.empty(B, Tq, HQ, D, dtype=q.dtype, device=dev)
    sm_scale = scale * LOG2E
    shape = dict(G=G, D=D, BD=BD, BG=BG)
    sq, skc, svc = q.stride()[:3], k_cmp.stride()[:3], v_cmp.stride()[:3]
    decode_cmp_kernel[(B * Tq, HK, S)](
        q, k_cmp, v_cmp, m_part, l_part, acc_part, *sq, *skc, *svc, Tq, Tk, sm_scale, chunks_per_split * BC, S,
        CMP_BLOCK=cmp_block, CMP_STRIDE=cmp_stride, BC=BC, num_warps=4, **shape)
    # the splits are run-time arguments, so a growing cache compiles nothing new; SP bounds S for
    # every length at this number of (query, KV head) pairs
    SP = triton.next_power_of_2(-(-target // pairs))
    decode_topk_kernel[(B * Tq, HK, S2)](
        q, k_cmp, m_part, l_part, key_part, *sq, *skc, Tq, Tk, sm_scale, windows_per_split, S, S2,
        SP=SP, CMP_BLOCK=cmp_block, CMP_STRIDE=cmp_stride, BR=BR, NBC=NBC, SLC_BLOCK=slc_block,
        NL=NL, num_warps=4, **shape)
    decode_out_kernel[(B * Tq, HK)](
        q, k, v, gates, o, m_part, l_part, acc_part, key_part,
        *sq, *k.stride()[:3], *v.stride()[:3], *gates.stride(), *o.stride()[:3], Tq, Tk, sm_scale, S, S2,
        SP=SP, SLC_BLOCK=slc_block, BS=max(16, triton.next_power_of_2(slc_block)), TOPK=slc_topk,
        NL=NL, WINDOW=window, BW=64, num_warps=4, **shape)
    return o


__all__ = ["nsa_decode_triton", "TARGET_PROGRAMS"]
