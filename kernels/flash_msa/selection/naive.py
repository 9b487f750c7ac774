"""Reference selected attention: plain PyTorch, computed in fp32 (fp64 for fp64 inputs).

Both forms take one packed stream ``[T, H, D]`` plus ``cu_seqlens``; the public
``selected_attention(impl="reference")`` flattens a dense batch into that form.

Semantics (the contract of selection/interface.py): query t of a sequence starting at ``s0`` attends, for its KV
head, to the keys of the blocks named in ``block_indices[t]``: entry b >= 0 names keys
``[s0 + b*block_size, s0 + (b+1)*block_size)``. Entries of -1, entries past the query's
own block, and keys after the query are ignored. A query with no key left outputs 0.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from flash_msa import tuning
from flash_msa.utils.varlen import token_seq_bounds


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def run_chunk(fn, *args):
    """fn(*args), recomputed in backward when autograd is recording.

    The chunked references would otherwise save every chunk's gathered keys and scores for
    backward (O(T * n * l' * D)); checkpointing keeps only the chunk inputs and outputs.
    """
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def masked_softmax_av(s: torch.Tensor, mask: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(s) @ v over the last dim of s, restricted to ``mask``; rows with no key give 0.

    s, mask: [..., N]; v: [..., N, D] -> [..., D]. Written without -inf so that fully
    masked rows have finite gradients. A key outside a row's mask never reaches the row, not even
    a NaN or inf in its score or value (packed documents stay isolated from each other): masked
    scores are replaced, and since ``p @ v`` would multiply a masked key's non-finite value by 0,
    such values enter as 0 and only the rows that see them become NaN.
    """
    if s.shape[-1] == 0:  # no keys at all (a stream shorter than one compression stride): every row gives 0
        return s @ v  # an empty sum: zeros [..., D] (broadcast as the general case), in the graph of s and v
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    m = s.amax(-1, keepdim=True).detach()
    p = torch.where(mask, torch.exp(s - m), 0.)
    denom = p.sum(-1, keepdim=True)
    bad = ~torch.isfinite(v).all(-1)  # [..., N] keys with a non-finite value
    o = (p @ v.masked_fill(bad[..., None], 0.)) / torch.where(denom > 0, denom, torch.ones_like(denom))
    seen = (mask & bad[..., None, :]).any(-1, keepdim=True)  # [..., R, 1] rows that see one
    return o.masked_fill(seen, float("nan"))


def _valid_entries(block_indices: torch.Tensor, t_rel: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T, HK, S] bool: entry names a block at or before the query's own block."""
    own_block = (t_rel // block_size)[:, None, None]
    return (block_indices >= 0) & (block_indices.to(torch.int64) <= own_block)


def selected_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
    block_size: int, cu_seqlens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Dense-mask form: builds a [T, HK, T] mask. For tiny tests only.

    q [T, HQ, D], k/v [T, HK, D], block_indices int32 [T, HK, S] -> o [T, HQ, D] (dtype of q).
    """
    T, HQ, D = q.shape
    HK = k.shape[1]
    G = HQ // HK
    acc = _acc_dtype(q)
    start, _ = token_seq_bounds(cu_seqlens, T)
    pos = torch.arange(T, device=q.device)
    t_rel = pos - start
    valid = _valid_entries(block_indices, t_rel, block_size)  # [T, HK, S]
    key_block = (pos - start) // block_size  # [T] block of each key within its own sequence
    # mask[t, h, s]: key s is in a valid selected block of query t, in its sequence, and not after it
    picked = ((block_indices.to(torch.int64)[..., None] == key_block) & valid[..., None]).any(2)  # [T, HK, T]
    same_seq = start[:, None] == start[None, :]
    causal = pos[None, :] <= pos[:, None]
    mask = picked & (same_seq & causal)[:, None, :]
    qf = q.to(acc).view(T, HK, G, D).permute(1, 2, 0, 3)  # [HK, G, T, D]
    kf = k.to(acc).permute(1, 0, 2)  # [HK, T, D]
    vf = v.to(acc).permute(1, 0, 2)
    s = scale * qf @ kf[:, None].transpose(-1, -2)  # [HK, G, T, T]
    o = masked_softmax_av(s, mask.permute(1, 0, 2)[:, None], vf[:, None])  # [HK, G, T, D]
    return o.permute(2, 0, 1, 3).reshape(T, HQ, D).to(q.dtype)


# selected_dense_span: a chunk of queries whose keys (from its first sequence's start to its last
# query) span at most this many times the keys each query gathers (S * block_size) attends over
# that span with a mask instead of gathering: on a CPU the gather's indexing backward and its many
# small products cost more there. Measured on this project's 2-core CPU, one thread, forward and
# backward of the tiny recipe's layer (T = 512 in three documents, 4 query / 2 KV heads of 32, 4
# blocks of 32): 177-255 ms gathered against 45 ms masked (the dense-mask form: 40 ms); the tiny
# recipe's 20-step NSA test went from 23.0 s to 12.4 s (dense: 13.3 s). Backward keeps at most
# selected_dense_span * S * block_size scores a query row, O(T * topk); the span's bound is read
# on the host (a sync: this is the reference, not a kernel).
SETTINGS = {"selected_dense_span": 4}
tuning.register("reference", SETTINGS)


def selected_attention_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
    block_size: int, cu_seqlens: torch.Tensor, scale: float, chunk: Optional[int] = None,
    dense_span: Optional[int] = None,
) -> torch.Tensor:
    """Gather form: each chunk of queries gathers the keys of its selected blocks (or, where its
    keys span at most ``dense_span`` times those, attends over the span with a mask; by default
    the ``"reference"`` tuning table's ``selected_dense_span``).

    Memory is O(chunk * HQ * S * block_size) at a time. Backward recomputes a gathered chunk, so
    only its inputs are saved; a span's scores (at most ``dense_span * S * block_size`` a query
    row) are kept: O(T * HQ * S * block_size) in all, never O(T^2). Same arguments as
    :func:`selected_attention_naive`, plus ``chunk`` (query rows per chunk).
    """
    T, HQ, D = q.shape
    HK, S = k.shape[1], block_indices.shape[-1]
    if chunk is None:  # about 16M gathered elements per chunk
        chunk = max(1, min(T, (1 << 24) // max(1, HK * S * block_size * D)))
    if dense_span is None:
        dense_span = tuning.settings("reference", SETTINGS)["selected_dense_span"]
    span = dense_span * S * block_size
    start_all, _ = token_seq_bounds(cu_seqlens, T)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # the backward recomputes each chunk from these indices: a snapshot, so that a caller
        # reusing its index buffer in place before backward still gets the forward's gradients
        # (the Triton paths save the tensor instead, and autograd refuses the modified one)
        block_indices = block_indices.clone()

    def one_chunk(c0: int, c1: int, q, k, v):
        return selected_rows(q[c0:c1], torch.arange(c0, c1, device=q.device), start_all[c0:c1],
                             block_indices[c0:c1], k, v, block_size, scale)

    def rows(c0: int, c1: int):
        k0 = int(start_all[c0])  # starts never decrease: the chunk's keys lie in [k0, c1)
        if c1 - k0 <= span:
            # saved for backward: the span's scores, at most dense_span times the gathered ones
            # without their keys' D, so nothing to recompute
            return _span_rows(q[c0:c1], torch.arange(c0, c1, device=q.device), start_all[c0:c1],
                              block_indices[c0:c1], k[k0:c1], v[k0:c1], k0, block_size, scale)
        return run_chunk(one_chunk, c0, c1, q, k, v)

    return torch.cat([rows(c0, min(T, c0 + chunk)) for c0 in range(0, T, chunk)]).to(q.dtype)


def _span_rows(q: torch.Tensor, t: torch.Tensor, start: torch.Tensor, block_indices: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, k0: int, block_size: int, scale: float) -> torch.Tensor:
    """:func:`selected_rows` of C query rows against the R keys of stream positions [k0, k0 + R)
    that hold all their keys, as one masked product over the span (the dense-mask form's rule)."""
    C, HQ, D = q.shape
    R, HK = k.shape[:2]
    G = HQ // HK
    acc = _acc_dtype(q)
    kpos = k0 + torch.arange(R, device=q.device)  # [R]
    rel = kpos[None, :] - start[:, None]  # [C, R] key position in each query's sequence
    valid = _valid_entries(block_indices, t - start, block_size)  # [C, HK, S]
    # a key before the query's sequence lies in a negative block, which no valid entry names
    key_block = torch.div(rel, block_size, rounding_mode="floor")
    picked = ((block_indices.to(torch.int64)[..., None] == key_block[:, None, None, :]) & valid[..., None]).any(2)
    mask = picked & (kpos[None, :] <= t[:, None])[:, None, :]  # [C, HK, R]
    qf = q.to(acc).view(C, HK, G, D).permute(1, 0, 2, 3).reshape(HK, C * G, D)
    s = scale * qf @ k.to(acc).permute(1, 2, 0)  # [HK, C*G, R]
    mask = mask.permute(1, 0, 2)[:, :, None, :].expand(HK, C, G, R).reshape(HK, C * G, R)
    o = masked_softmax_av(s, mask, v.to(acc).permute(1, 0, 2))  # [HK, C*G, D]
    return o.view(HK, C, G, D).permute(1, 0, 2, 3).reshape(C, HQ, D)


def selected_rows(q: torch.Tensor, t: torch.Tensor, start: torch.Tensor, block_indices: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Selected attention of C query rows against a packed key stream (the gather form's core).

    q [C, HQ, D] at stream positions ``t`` [C] of sequences starting at ``start`` [C], block_indices
    [C, HK, S]; k/v [T, HK, D] -> [C, HQ, D] in the accumulation dtype.
    """
    C, HQ, D = q.shape
    HK = k.shape[1]
    acc = _acc_dtype(q)
    offs = torch.arange(block_size, device=q.device)
    heads = torch.arange(HK, device=q.device)[None, :, None]
    idx = block_indices.to(torch.int64)  # [C, HK, S]
    valid = _valid_entries(block_indices, t - start, block_size)
    # absolute key positions of every selected block: [C, HK, S, bs]
    kpos = start[:, None, None, None] + idx[..., None] * block_size + offs
    mask = valid[..., None] & (kpos <= t[:, None, None, None])
    kpos = torch.where(mask, kpos, torch.zeros_like(kpos)).flatten(2)  # [C, HK, S*bs]
    kg = k[kpos, heads].to(acc)  # [C, HK, S*bs, D]
    vg = v[kpos, heads].to(acc)
    qc = q.to(acc).view(C, HK, HQ // HK, D)
    s = scale * qc @ kg.transpose(-1, -2)  # [C, HK, G, S*bs]
    o = masked_softmax_av(s, mask.flatten(2)[:, :, None, :], vg)  # [C, HK, G, D]
    return o.reshape(C, HQ, D)
