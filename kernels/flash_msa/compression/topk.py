"""Fused streaming top-n block selection in Triton.

One program owns ``BT`` consecutive tokens of ONE sequence and one KV head (a device-side
tile table maps program ids to (sequence, first token) without a host sync; its size bound
is ``cdiv(T, BT) + N``; programs take the table from its end, so the tiles that see the most
blocks start first). It walks the selection blocks of the sequence in chunks of ``NB``
blocks, up to the tile's last own block, and for each chunk:

1. recomputes the scores of its G query heads against the ``BC = NB*l'/d`` compressed rows
   whose blocks start in the chunk, and turns them into probabilities with the
   compressed-attention lse: ``p = exp(s - lse)``, summed over the group in fp32 ([BT, BC]);
2. maps them to the chunk's blocks with the overlap ``W[c, j] = |keys(c) ∩ block j| / l``,
   which is banded (l <= l', d | l'): a compressed token gives the block it starts in a fixed
   share of its keys by its offset there, and spills the rest into the next block only. So the
   [BT, BC] probabilities are folded per block with two weight vectors and the spill shifted by
   one block; the spill of the chunk's last block into the next chunk's first is carried in
   registers. This replaced a [BC, NB] fp32 matmul in IEEE precision, on the CUDA cores: 5.83
   against 6.93 ms at 64K, 90.8 against 107.4 at 256K (benchmarks/results/tune/variants.md#tune_topk_fold);
3. forces block 0, the own block and the one before it (+inf), drops blocks after the own
   block, and merges the chunk into the running top-``NB`` list. Each (score, block) is one
   int32 key (``KEY32``): the score's float bits (scores are >= 0, so the bits order like the
   floats) with the low ``LOG_NB + 1`` bits replaced by a priority, ``NB - 1 - j`` for the
   chunk's j-th block and ``2 NB - 1 - i`` for the list's i-th entry (the list is sorted best
   first and its blocks all precede the chunk's), so that equal keys never occur and, at equal
   scores, the lower block wins. The blocks ride through the merge beside their keys (``KV``, the
   default; below); without it they are found again from the priorities after the merge (a
   gather from the list's block row). Scores are compared on their top 18 of 23 mantissa bits
   (17 for n > 16): two blocks whose scores differ by less than 2^-18 of the score count as tied,
   and the lower one wins. As a token's block scores sum to at most G <= 16, two tied blocks score
   at most 8 each, so they differ by less than 3.1e-5 (6.1e-5 for n > 16), inside the 1e-4 at
   which the tests accept a near-tie. The exact form, one int64 key
   ``bits(score) << 32 | (2^31 - 1 - block)``, stays (``key32=False`` in ``flash_msa.tuning.override(topk=...)``): with
   the int32 keys the kernel had 36% fewer shuffles and 13% fewer instructions under Triton 3.6
   (before PERM below; benchmarks/results/kernel_resources/latest.md), and it went from 5.34 to
   5.05 ms at 64K and from 81.4 to 77.6 ms at 256K for G = 4, and from 6.01 to 5.77 ms for G = 5
   (benchmarks/results/tune/variants.md#tune_topk_key32), picking the same blocks on 99.96% of the rows
   (the others: near-ties). The running list and the chunk are merged with a bitonic network
   (sort the chunk ascending, take the elementwise max with the descending list, bitonic-merge),
   keeping the top NB. Two networks do this: ours (``_bitonic_sort``, ``_bitonic_merge_desc``)
   and Triton's (``tl.sort``, ``tl.bitonic_merge``), which is faster on the GPU; both sort the
   same keys exactly, so they agree bit for bit. With ``KV`` the merge after the chunk's sort is
   ours in both cases, moving each key's block with it: beside Triton's network (the GPU's) by the
   xor-reduction compare-and-swap that network uses (``_merge_desc_kv``), beside ours (the
   interpreter's) by splits and joins (``_merge_desc_kv_split``: the top-k tests took 345 s with
   it under the interpreter, 672 s with the xor form).

Where it spends its time: Triton lays the [BT, NB] rows out by the layouts of the ops that use
them, and a row spread over 16 lanes made every stage of the sort a shuffle. At the NSA defaults
(n = 16, l'/d = 4) the score tile's columns are permuted (``PERM``): column
``c = 32 j1 + 16 j0 + 8 r1 + 4 j3 + 2 j2 + r0`` holds offset ``r = 2 r1 + r0`` of block
``j = 8 j3 + 4 j2 + 2 j1 + j0``, so that in the wgmma accumulator layout (column bits 0 and 3-5 in
registers, 1-2 in lanes) the fold sums the offsets inside a thread and leaves a row's blocks on
two register and two lane bits. The spill shift is then done by splits and joins
(``_shift_right``; a gather moved the rows to another layout), and the sort, the merge and
``KV`` keep that layout. Under Triton 3.6 this took the kernel from 5448 SASS instructions, 562
shuffles, 153 shared-memory accesses and 100 spill instructions to 3944, 208, 77 and none
(G = 4, benchmarks/results/kernel_resources/latest.md), and top-k from 5.08 to 3.98 ms at 64K and
from 77.6 to 62.1 ms at 256K for G = 4, and from 5.81 to 4.70 ms for G = 5, the same blocks on all
but 0.0004% (64K) and 0.0016% (256K) of the rows, near-ties of the fold's summation order
(benchmarks/results/tune/variants.md#tune_topk_perm2). Holding a whole row in one thread's registers
(the other permutation, with its lane bits replicated) lost: more instructions
(tune/variants.md#tune_topk_perm).

At that layout the chunk's sort and the merge also take their stages in two forms (``HYBRID``,
the GPU's default): along the row's two register bits by splits and joins with min/max inside a
thread (``_sort_hybrid``, ``_merge_desc_kv_hybrid``), along its lane bits as a min or max of the
exchanged pair chosen by the element's place (one predicated min/max), where Triton's network
spends four to five instructions per element on each stage (compare, 0/1 select, compare with the
direction, select). The fold adds the R = 4 offsets with constant weights (``_fold_r4``): the
generic form multiplied by the zero and unit weights, which IEEE arithmetic does not fold away.
Both sort the same keys and add in the same order, so the blocks are the same bit for bit: top-k
went from 3.97 to 3.79 ms at 64K and from 64.0 to 59.0 ms at 256K for G = 4, 4.70 to 4.49 ms for
G = 5 (benchmarks/results/tune/variants.md#tune_topk_hybrid).

Only a tile's first chunk and its last one or two need step 1's visibility mask and step 3's
forced and causal blocks: the chunks between, whose compressed rows every token of the tile sees
and whose blocks all lie before every token's block but one, run without them (``INTERIOR``), in
the same order, so the result is the same bit for bit.

The interior chunks are taken two at a time (``PAIR``, the default): each head's query tile is
loaded once for both chunks' matmuls, and the two folds and sorts, which do not depend on the
running list or on each other (but for the spill carried from the first into the second), sit side
by side in one loop body, where the compiler can interleave their long latency-bound chains; the
two merges then run in chunk order, so the blocks are the same bit for bit (an odd chunk left over
joins the masked loop, whose masks are no-ops on it). The loop is latency bound: at 64K, with 3
programs of 4 warps per SM, each scheduler issues about one instruction in five cycles (estimated
from the loop's SASS instruction count and the kernel's time). Side by side in two runs
(benchmarks/results/tune/variants.md#tune_topk_pair, each kernel timed twice per run): 3.64-3.71 against
3.78-3.84 ms at 64K and 57.80-59.03 against 60.60-61.48 at 256K for G = 4, 4.31-4.40 against
4.46-4.58 for G = 5, at 27 spill instructions under the 168-register cap (none without the pairs) and
64 KB of shared memory (48 KB), still 3 programs per SM; caps of 200 and 255 registers (2 programs
per SM) and 1 or 3 stages were slower.

Memory is O(T * n) for the output; no [T, T/d] score matrix exists anywhere. The first n keys
of the list are the top n; they are written ascending by block, -1 padded (the reference
order). Supports l <= l' with l'/d a power of two (a compressed token spans at most two
selection blocks), which covers the NSA defaults; other sizes fall back to the PyTorch reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_msa import tuning
from flash_msa.utils.cache import per_batch

LOG2E = 1.4426950408889634
# constants read inside kernels must be tl.constexpr globals
_LOG2E = tl.constexpr(1.4426950408889634)
_LOW = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _compare_swap(x, flip, R: tl.constexpr, A: tl.constexpr, C: tl.constexpr):
    # x [R, A*2*C]: compare element (a, 0, c) with (a, 1, c); group a ascending unless flip[a]
    b_x = tl.permute(tl.reshape(x, [R, A, 2, C]), [0, 1, 3, 2])  # [R, A, C, 2]
    b_l, b_r = tl.split(b_x)  # [R, A, C] each
    b_lo, b_hi = tl.minimum(b_l, b_r), tl.maximum(b_l, b_r)
    m_f = (flip != 0)[None, :, None]
    b_x = tl.join(tl.where(m_f, b_hi, b_lo), tl.where(m_f, b_lo, b_hi))  # [R, A, C, 2]
    return tl.reshape(tl.permute(b_x, [0, 1, 3, 2]), [R, A * 2 * C])


@triton.jit
def _bitonic_sort(x, R: tl.constexpr, LOG_M: tl.constexpr, DESC: tl.constexpr):
    # sorts each row of x [R, 2**LOG_M]; written with reshape/split/join (no reductions), which
    # compiles the same on every Triton and runs fast in the interpreter
    for i in tl.static_range(1, LOG_M + 1):
        for jj in tl.static_range(0, i):  # distance 2**j with j = i - 1 - jj; A = 2**LOG_M / 2**(j+1) groups
            flip = ((tl.arange(0, (1 << LOG_M) >> (i - jj)) >> jj) & 1) ^ DESC
            x = _compare_swap(x, flip, R, (1 << LOG_M) >> (i - jj), 1 << (i - 1 - jj))
    return x


@triton.jit
def _bitonic_merge_desc(x, R: tl.constexpr, LOG_M: tl.constexpr):
    # x [R, 2**LOG_M] bitonic rows -> sorted descending
    for jj in tl.static_range(0, LOG_M):  # distance 2**(LOG_M - 1 - jj), 2**jj groups
        x = _compare_swap(x, tl.full([1 << jj], 1, tl.int32), R, 1 << jj, 1 << (LOG_M - 1 - jj))
    return x


@triton.jit
def _swap_kv(k, v, flip, i: tl.constexpr, n_dims: tl.constexpr):
    # compare-and-swap of int32 keys k and values v, [2] * n_dims, along the i-th innermost
    # dimension (the partner by an xor reduction over the pair, as Triton's own sort network does)
    k_y = k ^ tl.xor_sum(k, n_dims - 1 - i, True)
    v_y = v ^ tl.xor_sum(v, n_dims - 1 - i, True)
    right = tl.reshape(tl.arange(0, 2), [1] * (n_dims - i - 1) + [2] + [1] * i)
    m_sw = (k > k_y) != (flip ^ right)
    return tl.where(m_sw, k_y, k), tl.where(m_sw, v_y, v)


@triton.jit
def _merge_stage_split(k, v, R: tl.constexpr, jj: tl.constexpr, LOG_M: tl.constexpr):
    # one descending compare-and-swap stage of keys k [R, 2**LOG_M] (distance 2**(LOG_M - 1 - jj),
    # 2**jj groups) by splits and joins, the values v moved alike: a compare, the keys' max and min,
    # two selects of the values per pair
    k_l, k_r = tl.split(tl.permute(tl.reshape(k, [R, 1 << jj, 2, 1 << (LOG_M - 1 - jj)]), [0, 1, 3, 2]))
    v_l, v_r = tl.split(tl.permute(tl.reshape(v, [R, 1 << jj, 2, 1 << (LOG_M - 1 - jj)]), [0, 1, 3, 2]))
    m_sw = k_l < k_r
    k = tl.reshape(tl.permute(tl.join(tl.maximum(k_l, k_r), tl.minimum(k_l, k_r)), [0, 1, 3, 2]), [R, 1 << LOG_M])
    v = tl.reshape(tl.permute(tl.join(tl.where(m_sw, v_r, v_l), tl.where(m_sw, v_l, v_r)), [0, 1, 3, 2]), [R, 1 << LOG_M])
    return k, v


@triton.jit
def _merge_desc_kv_split(k, v, R: tl.constexpr, LOG_M: tl.constexpr):
    # _merge_desc_kv by splits and joins, like our own network: under the interpreter the top-k
    # tests took 345 s with it, 672 s with the xor reductions; on the GPU a split along a lane bit
    # costs a layout conversion
    for jj in tl.static_range(0, LOG_M):
        k, v = _merge_stage_split(k, v, R, jj, LOG_M)
    return k, v


@triton.jit
def _merge_desc_kv(k, v, BT: tl.constexpr, NB: tl.constexpr, LOG_BT: tl.constexpr, LOG_NB: tl.constexpr):
    # bitonic rows k [BT, NB] (distinct keys) -> sorted descending, v permuted alike
    hk = tl.reshape(k, [2] * (LOG_BT + LOG_NB))
    hv = tl.reshape(v, [2] * (LOG_BT + LOG_NB))
    for i in tl.static_range(LOG_NB):
        hk, hv = _swap_kv(hk, hv, 1, LOG_NB - 1 - i, LOG_BT + LOG_NB)
    return tl.reshape(hk, [BT, NB]), tl.reshape(hv, [BT, NB])


@triton.jit
def _swap_k(k, flip, i: tl.constexpr, n_dims: tl.constexpr):
    # compare-and-swap of int32 keys k, [2] * n_dims, along the i-th innermost dimension, by an
    # xor reduction over the pair (Triton's own network's form: a shuffle when it is a lane bit)
    k_y = k ^ tl.xor_sum(k, n_dims - 1 - i, True)
    right = tl.reshape(tl.arange(0, 2), [1] * (n_dims - i - 1) + [2] + [1] * i)
    # the larger of the pair where this element's place takes it (a min/max with a predicate)
    return tl.where((flip ^ right) != 0, tl.maximum(k, k_y), tl.minimum(k, k_y))


@triton.jit
def _swap_kv_mm(k, v, flip, i: tl.constexpr, n_dims: tl.constexpr):
    # _swap_kv in _swap_k's form: the key by min/max, the value follows (keys are distinct but
    # for -1s, whose values are dropped)
    k_n = _swap_k(k, flip, i, n_dims)
    return k_n, tl.where(k_n == k, v, v ^ tl.xor_sum(v, n_dims - 1 - i, True))


@triton.jit
def _sort_hybrid(x, BT: tl.constexpr, LOG_NB: tl.constexpr, LOG_BT: tl.constexpr, REG: tl.constexpr):
    # ascending bitonic sort of the rows of x [BT, 2**LOG_NB] (distinct int32 keys). Stages along
    # the row's REG lowest index bits (in registers: PERM's layout) take min/max by splits and
    # joins, within a thread; the others the xor exchange (a shuffle). (Loop-derived values are
    # written out inline: Triton takes them as constexprs only so.)
    for i in tl.static_range(1, LOG_NB + 1):  # merge phase: bitonic runs of 2**i
        for jj in tl.static_range(0, i):  # distance 2**(i - 1 - jj)
            if i - 1 - jj < REG:
                # flip[a] = direction bit i of group a's indices (bit jj of a); 0 in the last phase
                x = _compare_swap(x, (tl.arange(0, (1 << LOG_NB) >> (i - jj)) >> jj) & 1, BT,
                                  (1 << LOG_NB) >> (i - jj), 1 << (i - 1 - jj))
            else:
                h = tl.reshape(x, [2] * (LOG_BT + LOG_NB))
                if i < LOG_NB:
                    flip = tl.reshape(tl.arange(0, 2), [1] * (LOG_BT + LOG_NB - i - 1) + [2] + [1] * i)
                    h = _swap_k(h, flip, i - 1 - jj, LOG_BT + LOG_NB)
                else:
                    h = _swap_k(h, 0, i - 1 - jj, LOG_BT + LOG_NB)
                x = tl.reshape(h, [BT, 1 << LOG_NB])
    return x


@triton.jit
def _merge_desc_kv_hybrid(k, v, BT: tl.constexpr, LOG_NB: tl.constexpr, LOG_BT: tl.constexpr, REG: tl.constexpr):
    # _merge_desc_kv with the stages along the REG lowest (register) index bits by splits and
    # joins (_merge_stage_split), the others by the predicated min/max exchange
    for jj in tl.static_range(0, LOG_NB):  # distance 2**(LOG_NB - 1 - jj)
        if LOG_NB - 1 - jj < REG:
            k, v = _merge_stage_split(k, v, BT, jj, LOG_NB)
        else:
            hk = tl.reshape(k, [2] * (LOG_BT + LOG_NB))
            hv = tl.reshape(v, [2] * (LOG_BT + LOG_NB))
            hk, hv = _swap_kv_mm(hk, hv, 1, LOG_NB - 1 - jj, LOG_BT + LOG_NB)
            k = tl.reshape(hk, [BT, 1 << LOG_NB])
            v = tl.reshape(hv, [BT, 1 << LOG_NB])
    return k, v


@triton.jit
def _term(acc, p, NUM: tl.constexpr, DEN: tl.constexpr):
    # acc + p * NUM / DEN for constant NUM / DEN in [0, 1], without a multiply by 0 or 1
    r = acc
    if NUM == DEN:
        r = acc + p
    elif NUM > 0:
        r = acc + p * (NUM / DEN)
    return r


@triton.jit
def _fold_r4(b_p3, BT: tl.constexpr, NB: tl.constexpr, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    # The caller's fold for R = l'/d = 4 (PERM): offset r of block j gives it min(l, (4 - r) d) / l
    # of its keys and spills the rest into block j + 1. The offsets are register bits, so they
    # split apart in a thread, and the weights are constants: the generic form multiplied by the
    # zero and unit weights too (an IEEE multiply by 0 does not fold).
    e, o = tl.split(tl.reshape(b_p3, [BT, NB, 2, 2]))  # offset r = 2 r1 + r0: r0 = 0 in e, 1 in o
    p0, p2 = tl.split(e)
    p1, p3 = tl.split(o)
    b_in = p0  # min(l, 4d) = l, as l <= l'
    b_in = _term(b_in, p1, min(BLOCK, 3 * STRIDE), BLOCK)
    b_in = _term(b_in, p2, min(BLOCK, 2 * STRIDE), BLOCK)
    b_in = _term(b_in, p3, min(BLOCK, STRIDE), BLOCK)
    if BLOCK > STRIDE:  # offset 3 spills l - d keys, offset 0 none (l <= 4d)
        b_out = p3 * ((BLOCK - STRIDE) / BLOCK)
        b_out = _term(b_out, p2, max(BLOCK - 2 * STRIDE, 0), BLOCK)
        b_out = _term(b_out, p1, max(BLOCK - 3 * STRIDE, 0), BLOCK)
    else:
        b_out = tl.zeros_like(p0)
    return b_in, b_out


@triton.jit
def _shift2(x, c, BT: tl.constexpr):
    # y [BT, 2]: y[:, 0] = c, y[:, 1] = x[:, 0]
    e, o = tl.split(tl.reshape(x, [BT, 1, 2]))
    return tl.reshape(tl.join(tl.reshape(c, [BT, 1]), e), [BT, 2])


@triton.jit
def _shift_right(x, c, BT: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    # y [BT, N]: y[:, j] = x[:, j - 1] and y[:, 0] = c, by splits and joins (a gather made the
    # compiler move the rows to another layout; these keep the one the fold leaves, see PERM)
    e, o = tl.split(tl.reshape(x, [BT, N // 2, 2]))  # e[a] = x[2a], o[a] = x[2a + 1]
    if LOG_N == 2:
        so = _shift2(o, c, BT)
    elif LOG_N == 3:
        so = _shift_right(o, c, BT, 4, 2)
    else:
        so = _shift_right(o, c, BT, 8, 3)
    return tl.reshape(tl.join(so, e), [BT, N])  # y[2a] = o[a - 1], y[2a + 1] = e[a]


@triton.jit
def _chunk_cols(j0, BC: tl.constexpr, SLC: tl.constexpr, STRIDE: tl.constexpr, PERM: tl.constexpr):
    # [BC] compressed tokens (relative) whose blocks start in the chunk of blocks [j0, j0 + NB)
    o_cc = tl.arange(0, BC)
    if PERM:  # column c = 32 j1 + 16 j0 + 8 r1 + 4 j3 + 2 j2 + r0 holds offset r of block j (NB = 16, R = 4)
        o_c = (j0 + ((o_cc >> 4) & 1) + ((o_cc >> 5) & 1) * 2 + ((o_cc >> 1) & 1) * 4 + ((o_cc >> 2) & 1) * 8) * 4 \
            + (o_cc & 1) + ((o_cc >> 3) & 1) * 2
    else:
        o_c = j0 * (SLC // STRIDE) + o_cc
    return o_c


@triton.jit
def _chunk_k(k, row0, o_c, i_h, o_d, m_kd, HK: tl.constexpr, D: tl.constexpr):
    # the keys [BC, BD] of KV head i_h's compressed rows row0 + o_c (masked by m_kd)
    return tl.load(k + ((row0 + o_c) * HK + i_h)[:, None] * D + o_d[None, :], mask=m_kd, other=0.)


@triton.jit
def _head_rows(q, lse, o_t, m_t, o_d, m_d, o_hq, HQ: tl.constexpr, D: tl.constexpr):
    # query head o_hq's rows of the tile [BT, BD] and their lse in log2 units [BT]
    b_q = tl.load(q + (o_t * HQ + o_hq)[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.)
    return b_q, tl.load(lse + o_t * HQ + o_hq, mask=m_t, other=0.) * _LOG2E


@triton.jit
def _chunk_fold(b_p, b_carry, o_nb, w_in, w_out, o_prev, BT: tl.constexpr, NB: tl.constexpr, LOG_NB: tl.constexpr,
                SLC: tl.constexpr, STRIDE: tl.constexpr, BLOCK: tl.constexpr, PERM: tl.constexpr, FOLD4: tl.constexpr):
    # step 2: the chunk's probabilities b_p [BT, BC] -> its block scores [BT, NB] and the spill of its
    # last block into the next chunk
    if PERM:  # columns back in (block, offset) order: a relabelling, no data moves
        b_p3 = tl.reshape(tl.permute(tl.reshape(b_p, [BT, 2, 2, 2, 2, 2, 2]), [0, 4, 5, 1, 2, 3, 6]), [BT, NB, 4])
    else:
        b_p3 = tl.reshape(b_p, [BT, NB, SLC // STRIDE])
    if FOLD4:  # R = 4 with PERM: the offsets split apart in registers, constant weights
        b_in, b_out = _fold_r4(b_p3, BT, NB, STRIDE, BLOCK)
    else:
        b_in = tl.sum(b_p3 * w_in[None, None, :], 2)  # [BT, NB]
        b_out = tl.sum(b_p3 * w_out[None, None, :], 2)  # [BT, NB], spill of block j into j + 1
    # block j receives block j - 1's spill (the chunk's first block the carry)
    if PERM:
        b_sc = b_in + _shift_right(b_out, b_carry, BT, NB, LOG_NB)
    else:
        b_prev = tl.gather(b_out, o_prev, 1)
        b_sc = b_in + tl.where(o_nb[None, :] == 0, b_carry[:, None], b_prev)
    b_carry = tl.sum(tl.where(o_nb[None, :] == NB - 1, b_out, 0.), 1)  # [BT]
    return b_sc, b_carry


@triton.jit
def _chunk_keys(b_sc, j0, m_t, own, o_nb, BT: tl.constexpr, NB: tl.constexpr, LOG_NB: tl.constexpr,
                TL_SORT: tl.constexpr, MASK: tl.constexpr, KEY32: tl.constexpr, LOG_BT: tl.constexpr,
                HYBRID: tl.constexpr):
    # step 3 up to the merge (independent of the running list): the chunk's block scores b_sc
    # [BT, NB] -> its keys, sorted ascending
    o_j = j0 + o_nb  # [NB] blocks of the chunk
    if MASK:  # forced blocks
        m_forced = (o_j[None, :] == 0) | (o_j[None, :] == own[:, None]) | (o_j[None, :] == own[:, None] - 1)
        b_sc = tl.where(m_forced, float("inf"), b_sc)
    if KEY32:
        # int32 keys: the score's bits with the low LOG_NB + 1 bits replaced by a priority, NB-1-j for
        # the chunk's j-th block (the merge gives the list's entries 2NB-1-i), so that equal truncated
        # scores go to the lower block
        b_key = (b_sc.to(tl.int32, bitcast=True) & -(2 * NB)) | (NB - 1 - o_nb)[None, :]
    else:
        b_key = (b_sc.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (-o_j[None, :] + _LOW).to(tl.int64)
    if MASK:  # blocks after the own block, and tokens past the sequence
        b_key = tl.where((o_j[None, :] <= own[:, None]) & m_t[:, None], b_key, -1)
    # merge, first half: the chunk sorted ascending. Triton's network: 2-3 layout conversions
    # instead of 25-26 (kernel_resources/latest.md)
    if HYBRID:
        b_key = _sort_hybrid(b_key, BT, LOG_NB, LOG_BT, 2)
    elif TL_SORT:
        b_key = tl.sort(b_key)
    else:
        b_key = _bitonic_sort(b_key, BT, LOG_NB, 0)
    return b_key


@triton.jit
def _chunk_merge(b_top, b_blk, b_key, j0, o_nb, BT: tl.constexpr, NB: tl.constexpr, LOG_NB: tl.constexpr,
                 TL_SORT: tl.constexpr, KEY32: tl.constexpr, KV: tl.constexpr, LOG_BT: tl.constexpr,
                 HYBRID: tl.constexpr):
    # merge, second half: the running list (descending; KEY32: blocks in b_blk) and the chunk's
    # sorted keys b_key -> their elementwise max is a bitonic sequence holding the top NB of both
    # (the first step of a bitonic merge); sort it
    if KEY32:  # the list's priorities: 2NB-1-i for its i-th entry, whose blocks all precede the chunk's
        b_top = tl.where(b_top >= 0, (b_top & -(2 * NB)) | (2 * NB - 1 - o_nb)[None, :], -1)
    if KV:
        # blocks carried through the merge beside their keys: the chunk's from its sorted keys'
        # priorities, the list's from b_blk (no gather)
        b_list = b_top > b_key
        b_blk = tl.where(b_list, b_blk, j0 + NB - 1 - (b_key & (2 * NB - 1)))
        if HYBRID:
            b_top, b_blk = _merge_desc_kv_hybrid(tl.where(b_list, b_top, b_key), b_blk, BT, LOG_NB, LOG_BT, 2)
        elif TL_SORT:
            b_top, b_blk = _merge_desc_kv(tl.where(b_list, b_top, b_key), b_blk, BT, NB, LOG_BT, LOG_NB)
        else:
            b_top, b_blk = _merge_desc_kv_split(tl.where(b_list, b_top, b_key), b_blk, BT, LOG_NB)
        b_blk = tl.where(b_top >= 0, b_blk, -1)
    elif TL_SORT:
        b_top = tl.bitonic_merge(tl.maximum(b_top, b_key), descending=True)
    else:
        b_top = _bitonic_merge_desc(tl.maximum(b_top, b_key), BT, LOG_NB)
    if KEY32 and not KV:
        b_pr = b_top & (2 * NB - 1)
        b_from_list = b_pr >= NB
        b_old = tl.gather(b_blk, tl.where(b_from_list, 2 * NB - 1 - b_pr, 0), 1)
        b_blk = tl.where(b_top >= 0, tl.where(b_from_list, b_old, j0 + NB - 1 - b_pr), -1)
    return b_top, b_blk


@triton.jit
def _select_chunk(b_top, b_blk, b_carry, j0, q, k, lse, o_t, m_t, n_vis, own, n_vis_max, row0, i_h, o_d, m_d, o_nb,
                  w_in, w_out, o_prev, scale2,
                  HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                  STRIDE: tl.constexpr, SLC: tl.constexpr, NB: tl.constexpr, LOG_NB: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr, TL_SORT: tl.constexpr,
                  MASK: tl.constexpr, KEY32: tl.constexpr, PERM: tl.constexpr, KV: tl.constexpr,
                  LOG_BT: tl.constexpr, HYBRID: tl.constexpr, BLOCK: tl.constexpr, FOLD4: tl.constexpr):
    # blocks [j0, j0 + NB) into the running top list; MASK false: an interior chunk (see the caller)
    o_c = _chunk_cols(j0, BC, SLC, STRIDE, PERM)
    if MASK:
        b_k = _chunk_k(k, row0, o_c, i_h, o_d, (o_c < n_vis_max)[:, None] & m_d[None, :], HK, D)  # [BC, BD]
    else:
        b_k = _chunk_k(k, row0, o_c, i_h, o_d, m_d[None, :], HK, D)
    b_p = tl.zeros([BT, BC], dtype=tl.float32)
    for i_g in range(G):
        b_q, b_lse = _head_rows(q, lse, o_t, m_t, o_d, m_d, i_h * G + i_g, HQ, D)
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale2  # [BT, BC]
        if MASK:
            b_p += tl.where(o_c[None, :] < n_vis[:, None], tl.exp2(b_s - b_lse[:, None]), 0.)
        else:
            b_p += tl.exp2(b_s - b_lse[:, None])
    b_sc, b_carry = _chunk_fold(b_p, b_carry, o_nb, w_in, w_out, o_prev, BT, NB, LOG_NB, SLC, STRIDE, BLOCK, PERM, FOLD4)
    b_key = _chunk_keys(b_sc, j0, m_t, own, o_nb, BT, NB, LOG_NB, TL_SORT, MASK, KEY32, LOG_BT, HYBRID)
    b_top, b_blk = _chunk_merge(b_top, b_blk, b_key, j0, o_nb, BT, NB, LOG_NB, TL_SORT, KEY32, KV, LOG_BT, HYBRID)
    return b_top, b_blk, b_carry


@triton.jit
def _select_chunk_pair(b_top, b_blk, b_carry, j0, q, k, lse, o_t, m_t, own, row0, i_h, o_d, m_d, o_nb,
                       w_in, w_out, o_prev, scale2,
                       HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                       STRIDE: tl.constexpr, SLC: tl.constexpr, NB: tl.constexpr, LOG_NB: tl.constexpr,
                       BT: tl.constexpr, BC: tl.constexpr, TL_SORT: tl.constexpr, KEY32: tl.constexpr,
                       PERM: tl.constexpr, KV: tl.constexpr, LOG_BT: tl.constexpr, HYBRID: tl.constexpr,
                       BLOCK: tl.constexpr, FOLD4: tl.constexpr):
    # two interior chunks, blocks [j0, j0 + 2 NB), in one step (PAIR): each head's query tile is
    # loaded once for both, and the two chunks' folds and sorts are independent of each other and
    # of the list, so they can interleave; then the two merges, in chunk order (the same keys as
    # two _select_chunk calls, bit for bit)
    o_ca = _chunk_cols(j0, BC, SLC, STRIDE, PERM)
    o_cb = _chunk_cols(j0 + NB, BC, SLC, STRIDE, PERM)
    b_ka = _chunk_k(k, row0, o_ca, i_h, o_d, m_d[None, :], HK, D)
    b_kb = _chunk_k(k, row0, o_cb, i_h, o_d, m_d[None, :], HK, D)
    b_pa = tl.zeros([BT, BC], dtype=tl.float32)
    b_pb = tl.zeros([BT, BC], dtype=tl.float32)
    for i_g in range(G):
        b_q, b_lse = _head_rows(q, lse, o_t, m_t, o_d, m_d, i_h * G + i_g, HQ, D)
        b_pa += tl.exp2(tl.dot(b_q, tl.trans(b_ka)) * scale2 - b_lse[:, None])
        b_pb += tl.exp2(tl.dot(b_q, tl.trans(b_kb)) * scale2 - b_lse[:, None])
    b_sca, b_carry = _chunk_fold(b_pa, b_carry, o_nb, w_in, w_out, o_prev, BT, NB, LOG_NB, SLC, STRIDE, BLOCK, PERM,
                                 FOLD4)
    b_scb, b_carry = _chunk_fold(b_pb, b_carry, o_nb, w_in, w_out, o_prev, BT, NB, LOG_NB, SLC, STRIDE, BLOCK, PERM,
                                 FOLD4)
    b_key_a = _chunk_keys(b_sca, j0, m_t, own, o_nb, BT, NB, LOG_NB, TL_SORT, False, KEY32, LOG_BT, HYBRID)
    b_key_b = _chunk_keys(b_scb, j0 + NB, m_t, own, o_nb, BT, NB, LOG_NB, TL_SORT, False, KEY32, LOG_BT, HYBRID)
    b_top, b_blk = _chunk_merge(b_top, b_blk, b_key_a, j0, o_nb, BT, NB, LOG_NB, TL_SORT, KEY32, KV, LOG_BT, HYBRID)
    b_top, b_blk = _chunk_merge(b_top, b_blk, b_key_b, j0 + NB, o_nb, BT, NB, LOG_NB, TL_SORT, KEY32, KV, LOG_BT,
                                HYBRID)
    return b_top, b_blk, b_carry


@triton.jit
def select_blocks_kernel(
    q, k, lse, cu, cu_cmp, tile_seq, tile_t0, out, scale2,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BLOCK: tl.constexpr, STRIDE: tl.constexpr, SLC: tl.constexpr, TOPK: tl.constexpr,
    NB: tl.constexpr, LOG_NB: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    TL_SORT: tl.constexpr, INTERIOR: tl.constexpr,
    KEY32: tl.constexpr, PERM: tl.constexpr, KV: tl.constexpr, LOG_BT: tl.constexpr, HYBRID: tl.constexpr,
    FOLD4: tl.constexpr, PAIR: tl.constexpr,
):
    # the table from its end: the tiles whose tokens see the most blocks start first
    i_p, i_h = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    i_s = tl.load(tile_seq + i_p)
    t0 = tl.load(tile_t0 + i_p).to(tl.int64)
    bos = tl.load(cu + i_s).to(tl.int64)
    eos = tl.load(cu + i_s + 1).to(tl.int64)
    row0 = tl.load(cu_cmp + i_s).to(tl.int64)
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    t_rel = (o_t - bos).to(tl.int32)
    n_vis = tl.where(m_t & (t_rel >= BLOCK - 1), (t_rel - BLOCK + 1) // STRIDE + 1, 0)  # [BT]
    own = t_rel // SLC  # [BT]
    own_max = tl.max(tl.where(m_t, own, -1), 0)
    n_vis_max = tl.max(n_vis, 0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_nb = tl.arange(0, NB)

    # the overlap map is banded: the R = l'/d tokens starting in block j give it the share w_in[r]
    # of their keys and spill w_out[r] into block j + 1, which takes it from column j - 1 (o_prev)
    o_cr = tl.arange(0, SLC // STRIDE)
    w_in = tl.minimum(BLOCK, SLC - o_cr * STRIDE).to(tl.float32) / BLOCK  # [R]
    w_out = tl.maximum(o_cr * STRIDE + BLOCK - SLC, 0).to(tl.float32) / BLOCK
    o_prev = tl.broadcast_to(tl.maximum(o_nb - 1, 0)[None, :], [BT, NB])

    # running top-NB keys, descending, and (KEY32) their blocks
    b_top = tl.full([BT, NB], -1, dtype=tl.int32 if KEY32 else tl.int64)
    b_blk = tl.full([BT, NB], -1, dtype=tl.int32)
    b_carry = tl.zeros([BT], dtype=tl.float32)  # spill of the previous chunk into this chunk's first block
    # Chunks 1 .. c_in - 1 are interior for every token of the tile: all their compressed rows
    # visible, none of their blocks forced (0, own - 1, own) or after the own block. They skip
    # those masks; the first chunk and the last ones keep them. Same chunk order: same result.
    n_chunks = tl.cdiv(own_max + 1, NB)
    if INTERIOR:
        own_min = tl.min(tl.where(m_t, own, _LOW), 0)
        n_vis_min = tl.min(tl.where(m_t, n_vis, _LOW), 0)
        # (at most n_chunks: a spare tile has no valid token, and its minima are _LOW)
        c_in = tl.maximum(tl.minimum(tl.minimum(n_vis_min // BC, tl.maximum(own_min - 1, 0) // NB), n_chunks), 1)
        for c in range(0, tl.minimum(n_chunks, 1)):
            b_top, b_blk, b_carry = _select_chunk(
                b_top, b_blk, b_carry, c * NB, q, k, lse, o_t, m_t, n_vis, own, n_vis_max, row0, i_h, o_d, m_d, o_nb, w_in,
                w_out, o_prev, scale2, HQ, HK, G, D, BD, STRIDE, SLC, NB, LOG_NB, BT, BC,
                TL_SORT, True, KEY32, PERM, KV, LOG_BT, HYBRID, BLOCK, FOLD4)
        if PAIR:  # interior chunks two at a time; an odd one left joins the masked loop below
            for c in range(1, c_in - 1, 2):
                b_top, b_blk, b_carry = _select_chunk_pair(
                    b_top, b_blk, b_carry, c * NB, q, k, lse, o_t, m_t, own, row0, i_h, o_d, m_d, o_nb, w_in, w_out,
                    o_prev, scale2, HQ, HK, G, D, BD, STRIDE, SLC, NB, LOG_NB, BT, BC, TL_SORT, KEY32, PERM, KV,
                    LOG_BT, HYBRID, BLOCK, FOLD4)
            c_in = tl.maximum(c_in - (c_in - 1) % 2, 1)
        else:
            for c in range(1, c_in):
                b_top, b_blk, b_carry = _select_chunk(
                    b_top, b_blk, b_carry, c * NB, q, k, lse, o_t, m_t, n_vis, own, n_vis_max, row0, i_h, o_d, m_d,
                    o_nb, w_in, w_out, o_prev, scale2, HQ, HK, G, D, BD, STRIDE, SLC, NB, LOG_NB,
                    BT, BC, TL_SORT, False, KEY32, PERM, KV, LOG_BT, HYBRID, BLOCK, FOLD4)
    else:
        c_in = 0
    for c in range(c_in, n_chunks):
        b_top, b_blk, b_carry = _select_chunk(
            b_top, b_blk, b_carry, c * NB, q, k, lse, o_t, m_t, n_vis, own, n_vis_max, row0, i_h, o_d, m_d, o_nb, w_in,
            w_out, o_prev, scale2, HQ, HK, G, D, BD, STRIDE, SLC, NB, LOG_NB, BT, BC,
            TL_SORT, True, KEY32, PERM, KV, LOG_BT, HYBRID, BLOCK, FOLD4)

    # the first TOPK keys are the top n; write their blocks ascending, -1 padded
    m_keep = (o_nb[None, :] < TOPK) & (b_top >= 0)
    if not KEY32:
        b_blk = -(b_top & _LOW).to(tl.int32) + _LOW
    if TL_SORT:
        b_blk = tl.sort(tl.where(m_keep, b_blk, _LOW))
    else:
        b_blk = _bitonic_sort(tl.where(m_keep, b_blk, _LOW), BT, LOG_NB, 0)
    b_blk = tl.where(b_blk == _LOW, -1, b_blk)
    p_o = out + (o_t * HK + i_h)[:, None] * TOPK + o_nb[None, :]
    tl.store(p_o, b_blk, mask=m_t[:, None] & (o_nb[None, :] < TOPK))


def tile_table(cu_seqlens: torch.Tensor, T: int, BT: int):
    """Programs -> (sequence, first token) for tiles of BT tokens that never cross a sequence.

    The table has the static size cdiv(T, BT) + N (no host sync); spare entries get an empty
    tile (first token = the sequence end).
    """
    cu = cu_seqlens.to(torch.int64)
    N = cu.numel() - 1
    n_tiles = (cu[1:] - cu[:-1] + BT - 1) // BT  # [N]
    cum = n_tiles.cumsum(0)
    p = torch.arange(triton.cdiv(T, BT) + N, device=cu.device)
    seq = torch.searchsorted(cum, p, right=True)
    spare = seq >= N
    seq = seq.clamp_max(N - 1)
    t0 = cu[seq] + (p - (cum[seq] - n_tiles[seq])) * BT
    t0 = torch.where(spare, cu[seq + 1], t0)
    return seq.to(torch.int32), t0.to(torch.int32)


def select_blocks(q: torch.Tensor, k_cmp: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
                  cu_cmp: torch.Tensor, block: int, stride: int, slc_block: int, topk: int, scale: float) -> torch.Tensor:
    """Top-n selection blocks per (token, KV head) (the contract of flash_msa.reference.select_blocks).

    Args:
        q: [T, HQ, D]; k_cmp: [T//stride, HK, D] packed compressed keys.
        lse: fp32 [T, HQ] natural-log lse of compressed attention (-inf where nothing is visible).
        cu_seqlens, cu_cmp: int32 [N+1]. block, stride: l and d; slc_block: l'; topk: n.
        scale: softmax scale.

    Returns:
        block_indices int32 [T, HK, topk], ascending, -1 padded. No gradient.
    """
    T, HQ, D = q.shape
    HK = k_cmp.shape[1]
    r = slc_block // stride
    if block > slc_block or slc_block % stride != 0 or r & (r - 1):  # the kernel needs R = l'/d a power of 2
        from flash_msa import reference
        return reference.select_blocks(q, k_cmp, lse, cu_seqlens, cu_cmp, block, stride, slc_block, topk, scale)
    q, k_cmp, lse = q.detach().contiguous(), k_cmp.detach().contiguous(), lse.detach().float().contiguous()
    NB = max(16, triton.next_power_of_2(topk))
    BC = NB * slc_block // stride
    G = HQ // HK
    cfg = tuning.settings("topk", _launch(q.device))
    BT, opts = cfg["BT"], cfg["opts"]
    tl_sort = cfg.get("tl_sort", False)
    interior = cfg.get("interior", True)
    pair = pair_flag(cfg)
    key32 = cfg.get("key32", True)
    perm, kv, hybrid, fold4 = layout_flags(cfg, NB, r)
    BD = max(16, triton.next_power_of_2(D))
    seq, t0 = per_batch(tile_table, cu_seqlens, T, BT)  # shared by the layers
    out = torch.empty(T, HK, topk, dtype=torch.int32, device=q.device)
    select_blocks_kernel[(seq.numel(), HK)](
        q, k_cmp, lse, cu_seqlens, cu_cmp, seq, t0, out, scale * LOG2E,
        HQ=HQ, HK=HK, G=G, D=D, BD=BD, BLOCK=block, STRIDE=stride, SLC=slc_block, TOPK=topk,
        NB=NB, LOG_NB=NB.bit_length() - 1, BT=BT, BC=BC, TL_SORT=tl_sort, INTERIOR=interior, KEY32=key32,
        PERM=perm, KV=kv, LOG_BT=BT.bit_length() - 1, HYBRID=hybrid, FOLD4=fold4, PAIR=pair, **opts)
    return out


# Launch settings of op "topk" (flash_msa.tuning): {"BT", "opts"}, optional "tl_sort", "interior",
# "key32", "perm", "kv", "hybrid", "fold", "pair"; an override replaces _launch's entries (tests and
# scripts/tune_nsa.py use it). "interior" False
# runs every chunk with the masks; "key32" False the exact int64 keys (module docstring, step 3);
# "perm" False the score columns in plain order; "kv" False the gather of the blocks after the merge
# (int32 keys only); "hybrid" True the hybrid network (with PERM and KV; _launch sets it on the
# GPU); "fold" False the generic fold; "pair" True the interior chunks two at a time
# (_select_chunk_pair; with "interior"). "perm", "kv" and "fold" default to True (PERM applies at
# n <= 16 with l'/d = 4 only).
tuning.register("topk", ("BT", "opts", "tl_sort", "interior", "key32", "perm", "kv", "hybrid", "fold", "pair"))


def layout_flags(cfg: dict, NB: int, r: int) -> tuple[bool, bool, bool, bool]:
    """(PERM, KV, HYBRID, FOLD4) of launch settings ``cfg`` for a list of NB and l'/d = r: "perm",
    "kv" and "fold" default to True, "hybrid" to False; PERM is written for NB = 16, r = 4, KV for
    int32 keys, and the hybrid network and the constant-weight fold for PERM's layout (the hybrid
    one with KV; module docstring)."""
    perm = cfg.get("perm", True) and NB == 16 and r == 4
    kv = cfg.get("kv", True) and cfg.get("key32", True)
    return perm, kv, perm and kv and cfg.get("hybrid", False), perm and cfg.get("fold", True)


def pair_flag(cfg: dict) -> bool:
    """PAIR of launch settings ``cfg``: "pair" (default False), which needs the interior chunks
    ("interior"; _select_chunk_pair)."""
    return cfg.get("pair", False) and cfg.get("interior", True)


def _launch(device) -> dict:
    """Tokens per program, the sort network, launch options; the same for every G
    (tune/variants.md#tune_topk_sort measured G=4 and 5). One matmul per head: the heads stacked into one
    [BT*G, D] matmul (G padded to a power of two) lost on the GPU (below) and that variant is gone."""
    if device.type != "cuda":
        # our network under the CPU interpreter: Triton's runs 7.7x slower there (181 against 24 s
        # for the top-k tests); tests/kernels/compression/test_topk.py checks that both pick the
        # same blocks, bit for bit. The GPU's 64 tokens per program: the interpreter's time goes
        # with the number of programs (one top-k test, 4300 tokens: 59 s at 16 tokens, 31 at 32,
        # 16 at 64), and the tests then run the tile the GPU runs
        return dict(BT=64, key32=True, pair=True, opts={})
    # benchmarks/results/tune/variants.md#tune_topk_sort: Triton's sort network with 64 tokens per program,
    # one matmul per head, wins at every group size measured: 8.05 ms against 8.49 (our network,
    # stacked heads) at 64K and 123.3 against 130.3 at 256K for G=4; 8.57 against 9.80 at 64K for
    # G=5 (tune/variants.md#tune_qwen3_topk_sort). Capped at 160 registers (197 uncapped) it runs 3
    # programs per SM instead of 2, at 12 spill instructions: 7.17 against 8.09 ms at 64K and
    # 108.5 against 123.3 at 256K for G=4, 7.93 against 8.64 for G=5 (tune/variants.md#tune_topk_maxnreg).
    # With int32 keys a 168-register cap (still 3 programs per SM) beats 160 by about 1%: 5.05
    # against 5.10 ms at 64K and 77.6 against 78.2 at 256K for G=4, 5.77 against 5.83 for G=5
    # (tune/variants.md#tune_topk_key32); with PERM and KV (module docstring) 168 beats 160 by 1-2%: 3.98
    # against 4.02 ms at 64K, 62.1 against 63.2 at 256K, 4.70 against 4.77 for G=5
    # (tune/variants.md#tune_topk_perm2)
    # The hybrid network and the constant-weight fold (module docstring) took 3.97 -> 3.79 ms at 64K
    # and 64.0 -> 59.0 at 256K for G=4, 4.70 -> 4.49 for G=5, the same blocks (tune/variants.md#tune_topk_hybrid)
    # The interior chunks two at a time (pair, module docstring): 3.64-3.71 against 3.78-3.84 ms at
    # 64K and 57.80-59.03 against 60.60-61.48 at 256K for G=4, 4.31-4.40 against 4.46-4.58 for G=5 (two
    # runs), the same blocks; other register caps and stages lost (tune/variants.md#tune_topk_pair)
    return dict(BT=64, tl_sort=True, key32=True, hybrid=True, pair=True,
                opts=dict(num_warps=4, num_stages=2, maxnreg=168))
