"""NSA decoding in PyTorch: the rows of the last Tq queries against a KV cache (the reference of
decode/kernel.py, and the path on CPUs).

The NSA output of a query depends only on its own q and gates and on the keys and values up to it,
so the new rows are computed on their own; they match the rows of the whole-sequence op (tested
against :func:`flash_msa.nsa_attention`). Given the compressed rows (decode/__init__.py):
- compressed attention and the block scores of the Tq queries, O(Tq * Tk / d);
- top-n blocks by the training rule (:func:`flash_msa.compression.naive.top_blocks`);
- selected attention over n blocks and the window over w keys: O(Tq * (n * l' + w)).
The branches are combined in fp32 as in training.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_msa.compression.naive import top_blocks
from flash_msa.gates import gate_combine_reference
from flash_msa.selection.naive import _acc_dtype, masked_softmax_av, selected_rows


def _block_scores(p: torch.Tensor, n_blocks: int, c: int, r: int) -> torch.Tensor:
    """Compressed-token probabilities p [..., Nc] spread over selection blocks: [..., n_blocks].

    Token i covers keys [i*d, i*d + l) and block j keys [j*l', (j+1)*l'); with c = l/d and
    r = l'/d, block j takes from tokens j*r + m, m in [-(c-1), r-1], the fraction
    (min(m + c, r) - max(m, 0)) / c of each. The same for every block: one strided window over p,
    O(Nc) (the reference's [Nc, n_blocks] overlap matrix would be O(T^2) at long context).
    """
    m = torch.arange(-(c - 1), r, device=p.device)
    w = ((torch.clamp(m + c, max=r) - torch.clamp(m, min=0)).to(p.dtype) / c)  # [r + c - 1]
    Nc = p.shape[-1]
    padded = F.pad(p, (c - 1, n_blocks * r - Nc))  # position c - 1 + i holds token i
    return padded.unfold(-1, r + c - 1, r) @ w  # [..., n_blocks]


def nsa_decode_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
    *, cmp_block: int, cmp_stride: int, slc_block: int, slc_topk: int, window: int, scale: float,
) -> torch.Tensor:
    """NSA output of the last Tq positions of B sequences of Tk tokens.

    Args:
        q: [B, Tq, HQ, D], the queries of positions Tk - Tq .. Tk - 1.
        k, v: [B, Tk, HK, D], every key and value of the sequences (the KV cache), Tk >= Tq.
        gates: [B, Tq, HQ, 3] branch gates of the new tokens (compressed, selected, window).
        k_cmp, v_cmp: [B, Nc, HK, D], the sequences' compressed keys and values, Nc = the rows
            visible to the last query.
        cmp_block, cmp_stride, slc_block, slc_topk, window, scale: as in nsa_attention.

    Returns:
        [B, Tq, HQ, D] in the dtype of q. Inputs are checked by the caller (decode/__init__.py).
    """
    B, Tq, HQ, D = q.shape
    Tk, HK = k.shape[1], k.shape[2]
    acc = _acc_dtype(q)
    G = HQ // HK
    dev = q.device
    T = B * Tk  # the B sequences as one packed stream, as in training
    kf, vf = k.reshape(T, HK, D), v.reshape(T, HK, D)

    # the new rows: positions in their sequence and in the stream, visible compressed tokens
    t_rel = torch.arange(Tk - Tq, Tk, device=dev)  # [Tq]
    start = (torch.arange(B, device=dev) * Tk).repeat_interleave(Tq)  # [B*Tq]
    t = start + t_rel.repeat(B)
    n_vis = torch.where(t_rel >= cmp_block - 1, (t_rel - cmp_block + 1) // cmp_stride + 1, torch.zeros_like(t_rel))
    Nc = k_cmp.shape[1]
    kc, vc = k_cmp.to(acc), v_cmp.to(acc)
    qf = q.reshape(B * Tq, HQ, D)
    # compressed attention and its lse
    s = scale * torch.einsum("bqhgd,bnhd->bqhgn", q.to(acc).view(B, Tq, HK, G, D), kc)  # [B, Tq, HK, G, Nc]
    mask = (torch.arange(Nc, device=dev) < n_vis[:, None])[None, :, None, None, :]
    o_cmp = masked_softmax_av(s, mask, vc.permute(0, 2, 1, 3)[:, None]).reshape(B * Tq, HQ, D)
    lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)  # [B, Tq, HK, G]

    # block selection: probabilities summed over the group, spread over the blocks they overlap
    with torch.no_grad():
        p = torch.where(mask, torch.exp(s - lse[..., None]), 0.).sum(3).reshape(B * Tq, HK, Nc)
        score = _block_scores(p, -(-Tk // slc_block), cmp_block // cmp_stride, slc_block // cmp_stride)
        idx = top_blocks(score, t_rel.repeat(B) // slc_block, slc_topk)  # [B*Tq, HK, <= n]

    o_slc = selected_rows(qf, t, start, idx, kf, vf, slc_block, scale)

    # the window: keys max(start, t - w + 1) .. t
    kpos = t[:, None] - window + 1 + torch.arange(window, device=dev)  # [C, w]
    in_win = kpos >= start[:, None]
    kpos = torch.where(in_win, kpos, t[:, None])
    kg, vg = kf[kpos].to(acc), vf[kpos].to(acc)  # [C, w, HK, D]
    qg = qf.to(acc).view(B * Tq, HK, G, D)
    sw = scale * torch.einsum("chgd,cwhd->chgw", qg, kg)
    o_swa = masked_softmax_av(sw, in_win[:, None, None, :], vg.permute(0, 2, 1, 3)).reshape(B * Tq, HQ, D)

    dt = q.dtype  # each branch rounded to q's dtype, then combined in fp32, as in the whole op
    o = gate_combine_reference(gates.reshape(B * Tq, HQ, 3), o_cmp.to(dt), o_slc.to(dt), o_swa.to(dt), dt)
    return o.view(B, Tq, HQ, D)
