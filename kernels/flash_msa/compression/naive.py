"""Reference compression branch of NSA: plain PyTorch, computed in fp32 (fp64 for fp64 inputs).

Everything works on one packed stream ``[T, H, D]`` plus ``cu_seqlens``.

Compression (phi). Compressed token i of a sequence covers its keys ``[i*d, i*d + l)``
(block l, stride d); a sequence of length L has ``(L - l)//d + 1`` of them (0 when L < l).
phi is a learned per-KV-head MLP over the block's l keys (or values), each first shifted by
a learned intra-block position encoding, with a mean-pooling skip path:

    X_j     = x[i*d + j, h] + pos[h, j]                                  j < l
    x_cmp   = mean_j X_j + P[h]^T gelu( W[h]^T flatten_j X_j ),   W[h]: [l*D, D], P[h]: [D, D]

Without ``proj`` (P) phi is the linear map ``W[h]^T flatten_j X_j``; there the position
encoding only adds a constant per head (which softmax over compressed keys ignores), so the
model always passes P, through which pos matters.

The compressed rows of all sequences are packed back to back, sequence s owning rows
``[cu_cmp[s], cu_cmp[s+1])``; the buffer has ``T // d`` rows (an upper bound that needs no
host sync) and rows past ``cu_cmp[-1]`` are zero.

Compressed attention. Query t at position t_rel in its sequence sees compressed token i
iff ``i*d + l - 1 <= t_rel``. A query that sees none outputs 0 (and its lse is -inf).

Block selection. The compressed-attention probabilities ``p = exp(s - lse)`` are summed
over the G query heads of each KV head in fp32 and spread over selection blocks (size l')
by overlap: compressed token i gives block j the fraction of its l keys that lie in
``[j*l', (j+1)*l')``. Block 0 and the two local blocks (the query's own and the one before)
are forced; only blocks at or before the query's own block are candidates; the top n
are kept, ties going to the lower block. Output int32 ``[T, HK, n]``, ascending, -1 padded.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from flash_msa.selection.naive import _acc_dtype, masked_softmax_av, run_chunk
from flash_msa.utils.varlen import compressed_cu_seqlens, compressed_rows, token_seq_bounds


def compress_kv(
    x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, cu_seqlens: torch.Tensor,
    block: int, stride: int, proj: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """phi over every block: x [T, H, D], weight [H, block*D, D], pos [H, block, D], proj [H, D, D].

    Returns (x_cmp [T//stride, H, D] in x's dtype, cu_cmp int32 [N+1]).
    """
    T, H, D = x.shape
    acc = _acc_dtype(x)
    cu_cmp, first_key, valid = compressed_rows(cu_seqlens, T, block, stride)  # [N+1], [Tc], [Tc]
    keys = (first_key[:, None] + torch.arange(block, device=x.device)).clamp_max(T - 1)  # [Tc, l]
    blocks = x[keys].to(acc) + pos.to(acc).transpose(0, 1)  # [Tc, l, H, D]
    hidden = torch.bmm(blocks.permute(2, 0, 1, 3).reshape(H, -1, block * D), weight.to(acc))  # [H, Tc, D]
    if proj is None:
        out = hidden.transpose(0, 1)
    else:
        out = blocks.mean(1) + torch.bmm(F.gelu(hidden), proj.to(acc)).transpose(0, 1)  # [Tc, H, D]
    # rows past the sequences' blocks are 0 (where, not a product: their clamped keys may hold NaN)
    return torch.where(valid[:, None, None], out, 0.).to(x.dtype), cu_cmp


def _visible(cu_seqlens, cu_cmp, T: int, Tc: int, block: int, stride: int, device):
    """Per query: sequence start, first compressed row of its sequence, number of visible rows."""
    start, _ = token_seq_bounds(cu_seqlens, T)
    seq = torch.searchsorted(cu_seqlens.to(torch.int64)[1:], torch.arange(T, device=device), right=True)
    row0 = cu_cmp.to(torch.int64)[seq]  # [T]
    t_rel = torch.arange(T, device=device) - start
    n_vis = torch.where(t_rel >= block - 1, (t_rel - block + 1) // stride + 1, torch.zeros_like(t_rel))
    return start, row0, n_vis


def _compressed_scores(q, k_cmp, row0, n_vis, scale, acc):
    """Scores of queries [C, HQ, D] against all compressed rows: ([C, HK, G, Tc], mask [C, 1, 1, Tc])."""
    C, HQ, D = q.shape
    Tc, HK = k_cmp.shape[:2]
    rows = torch.arange(Tc, device=q.device)
    mask = (rows >= row0[:, None]) & (rows < (row0 + n_vis)[:, None])  # [C, Tc]
    qg = q.to(acc).view(C, HK, HQ // HK, D)
    s = scale * torch.einsum("chgd,rhd->chgr", qg, k_cmp.to(acc))
    return s, mask[:, None, None, :]


def compressed_attention_chunked(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, cu_seqlens: torch.Tensor,
    cu_cmp: torch.Tensor, block: int, stride: int, scale: float, chunk: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over compressed tokens, by chunks of queries.

    q [T, HQ, D], k_cmp/v_cmp [Tc, HK, D] -> (o [T, HQ, D] in q's dtype, lse fp32/fp64 [T, HQ]).
    Memory per chunk is O(chunk * HQ * Tc).
    """
    T, HQ, D = q.shape
    Tc, HK = k_cmp.shape[:2]
    acc = _acc_dtype(q)
    if chunk is None:
        chunk = max(1, min(T, (1 << 24) // max(1, HQ * max(Tc, 1))))
    _, row0, n_vis = _visible(cu_seqlens, cu_cmp, T, Tc, block, stride, q.device)
    vf = v_cmp.to(acc).transpose(0, 1)  # [HK, Tc, D]

    def one_chunk(c0: int, c1: int, q, k_cmp, vf):
        s, mask = _compressed_scores(q[c0:c1], k_cmp, row0[c0:c1], n_vis[c0:c1], scale, acc)
        o = masked_softmax_av(s, mask, vf[None])  # [C, HK, G, D]
        lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)  # [C, HK, G]
        return o.reshape(c1 - c0, HQ, D), lse.reshape(c1 - c0, HQ)

    outs, lses = zip(*[run_chunk(one_chunk, c0, min(T, c0 + chunk), q, k_cmp, vf) for c0 in range(0, T, chunk)])
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def block_overlap(n_cmp: int, n_blocks: int, block: int, stride: int, slc_block: int, device, dtype) -> torch.Tensor:
    """[n_cmp, n_blocks]: fraction of compressed token i's keys that fall in selection block j."""
    i0 = torch.arange(n_cmp, device=device)[:, None] * stride
    j0 = torch.arange(n_blocks, device=device)[None, :] * slc_block
    inter = (torch.minimum(i0 + block, j0 + slc_block) - torch.maximum(i0, j0)).clamp_min(0)
    return inter.to(dtype) / block


def top_blocks(score: torch.Tensor, own: torch.Tensor, topk: int) -> torch.Tensor:
    """The selection rule on block scores [C, HK, n_blocks] of queries whose own block is ``own`` [C]:
    block 0 and the local blocks forced, no block after the own one, the top ``topk`` with ties to
    the lower block. int64 [C, HK, min(topk, n_blocks)], ascending, -1 padded."""
    n_blocks = score.shape[-1]
    own = own[:, None, None]
    j = torch.arange(n_blocks, device=score.device)
    forced = (j == 0) | (j == own) | (j == own - 1)
    score = torch.where(forced, torch.full_like(score, float("inf")), score)
    score = torch.where(j <= own, score, torch.full_like(score, float("-inf")))
    # stable descending sort: equal scores keep ascending block order, so ties go to the lower block
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :topk]
    chosen = torch.gather(score, -1, order) > float("-inf")
    idx = torch.where(chosen, order, torch.full_like(order, n_blocks))
    idx = idx.sort(-1).values
    return torch.where(idx < n_blocks, idx, torch.full_like(idx, -1))


def select_blocks_chunked(
    q: torch.Tensor, k_cmp: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, cu_cmp: torch.Tensor,
    block: int, stride: int, slc_block: int, topk: int, scale: float, chunk: Optional[int] = None,
) -> torch.Tensor:
    """Top-n selection blocks per (query, KV head): int32 [T, HK, topk], ascending, -1 padded.

    q [T, HQ, D], k_cmp [Tc, HK, D], lse [T, HQ] from compressed attention. No gradient.
    """
    T, HQ, D = q.shape
    Tc, HK = k_cmp.shape[:2]
    with torch.no_grad():
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if chunk is None:
            chunk = max(1, min(T, (1 << 24) // max(1, HQ * max(Tc, 1))))
        start, row0, n_vis = _visible(cu_seqlens, cu_cmp, T, Tc, block, stride, q.device)
        n_blocks = -(-T // slc_block)  # the most blocks any sequence can have
        # row r of the packed compressed stream is compressed token i_rel(r) of its sequence
        rows = torch.arange(Tc, device=q.device)
        seq = torch.searchsorted(cu_cmp[1:].to(torch.int64), rows, right=True).clamp_max(cu_cmp.numel() - 2)
        i_rel = rows - cu_cmp.to(torch.int64)[seq]
        w_rows = block_overlap(max(Tc, 1), n_blocks, block, stride, slc_block, q.device, acc)[i_rel.clamp_min(0)]
        out = []
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            s, mask = _compressed_scores(q[c0:c1], k_cmp, row0[c0:c1], n_vis[c0:c1], scale, acc)
            # masked before the exp: a query that sees no compressed token has lse = -inf, and
            # exp(s + inf) * 0 would be NaN (cmp_block > slc_block leaves own blocks without one)
            p = torch.where(mask, torch.exp(s - lse[c0:c1].to(acc).view(c1 - c0, HK, HQ // HK, 1)), 0.)  # [C, HK, G, Tc]
            score = p.sum(2) @ w_rows  # [C, HK, n_blocks], summed over the group in fp32
            out.append(top_blocks(score, (torch.arange(c0, c1, device=q.device) - start[c0:c1]) // slc_block, topk))
        idx = torch.cat(out).to(torch.int32)
        if idx.shape[-1] < topk:  # fewer blocks than topk in the whole stream
            pad = idx.new_full((T, HK, topk - idx.shape[-1]), -1)
            idx = torch.cat([idx, pad], -1)
        return idx


# ---------------------------------------------------------------------------------------
# Naive forms: loops over sequences and tokens that follow the definitions literally. They
# share no index arithmetic with the chunked forms above, which makes them an independent
# check at tiny sizes.


def _sequences(cu_seqlens: torch.Tensor):
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def compress_kv_naive(x, weight, pos, cu_seqlens, block, stride, proj=None):
    """Same contract as :func:`compress_kv`, one compressed token at a time."""
    T, H, D = x.shape
    acc = _acc_dtype(x)
    rows = []
    for s0, s1 in _sequences(cu_seqlens):
        for i in range(0, max(0, (s1 - s0 - block) // stride + 1)):
            blk = x[s0 + i * stride: s0 + i * stride + block].to(acc) + pos.to(acc).transpose(0, 1)  # [l, H, D]
            hidden = [blk[:, h].reshape(-1) @ weight[h].to(acc) for h in range(H)]
            if proj is not None:
                hidden = [blk[:, h].mean(0) + F.gelu(hidden[h]) @ proj[h].to(acc) for h in range(H)]
            rows.append(torch.stack(hidden))
    out = torch.zeros(T // stride, H, D, dtype=acc, device=x.device)
    if rows:
        out = torch.cat([torch.stack(rows), out[len(rows):]])
    return out.to(x.dtype), compressed_cu_seqlens(cu_seqlens, block, stride)


def _seq_compressed_probs(q, k_cmp, s0, s1, r0, block, stride, scale, acc):
    """For one sequence: (scores [HQ, L, n], visible mask [L, n]) against its n compressed tokens."""
    L, n = s1 - s0, max(0, (s1 - s0 - block) // stride + 1)
    HQ, HK = q.shape[1], k_cmp.shape[1]
    kc = k_cmp[r0:r0 + n].to(acc).repeat_interleave(HQ // HK, dim=1)  # [n, HQ, D]
    s = scale * torch.einsum("thd,nhd->htn", q[s0:s1].to(acc), kc)
    vis = torch.tensor([[i * stride + block - 1 <= t for i in range(n)] for t in range(L)],
                       dtype=torch.bool, device=q.device).view(L, n)
    return s, vis


def compressed_attention_naive(q, k_cmp, v_cmp, cu_seqlens, cu_cmp, block, stride, scale):
    """Same contract as :func:`compressed_attention_chunked`, one sequence at a time with dense masks."""
    T, HQ, D = q.shape
    HK = k_cmp.shape[1]
    acc = _acc_dtype(q)
    o = torch.zeros(T, HQ, D, dtype=acc, device=q.device)
    lse = torch.full((T, HQ), float("-inf"), dtype=acc, device=q.device)
    for (s0, s1), r0 in zip(_sequences(cu_seqlens), cu_cmp.tolist()):
        s, vis = _seq_compressed_probs(q, k_cmp, s0, s1, r0, block, stride, scale, acc)
        if s.shape[-1] == 0:
            continue
        vc = v_cmp[r0:r0 + s.shape[-1]].to(acc).repeat_interleave(HQ // HK, dim=1).transpose(0, 1)  # [HQ, n, D]
        o[s0:s1] = masked_softmax_av(s, vis, vc).transpose(0, 1)
        lse[s0:s1] = torch.logsumexp(s.masked_fill(~vis, float("-inf")), -1).transpose(0, 1)
    return o.to(q.dtype), lse


def select_blocks_naive(q, k_cmp, lse, cu_seqlens, cu_cmp, block, stride, slc_block, topk, scale):
    """Same contract as :func:`select_blocks_chunked`, one query at a time, overlaps counted as sets."""
    T, HQ, D = q.shape
    HK = k_cmp.shape[1]
    G = HQ // HK
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.full((T, HK, topk), -1, dtype=torch.int32)
    with torch.no_grad():
        for (s0, s1), r0 in zip(_sequences(cu_seqlens), cu_cmp.tolist()):
            s, vis = _seq_compressed_probs(q, k_cmp, s0, s1, r0, block, stride, scale, acc)
            n = s.shape[-1]
            p = torch.where(vis, torch.exp(s - lse[s0:s1].to(acc).T[..., None]), 0.)  # NaN-free, as above
            p = p.view(HK, G, s1 - s0, n).sum(1).cpu()
            for t in range(s1 - s0):
                own = t // slc_block
                for h in range(HK):
                    score = []
                    for j in range(own + 1):
                        keys = set(range(j * slc_block, (j + 1) * slc_block))
                        val = sum(p[h, t, i].item() * len(keys & set(range(i * stride, i * stride + block))) / block
                                  for i in range(n))
                        score.append(float("inf") if j in (0, own, own - 1) else val)
                    ranked = sorted(range(own + 1), key=lambda j: (-score[j], j))[:topk]
                    out[s0 + t, h, :len(ranked)] = torch.tensor(sorted(ranked), dtype=torch.int32)
    return out.to(q.device)
