"""BASELINE ONLY (removed once measured): the PyTorch form of phi shipped until the Triton kernels,
kept for scripts/tune_nsa.py to time side by side. Compression phi as one gather of stride chunks + one batched matmul, with a deterministic
hand-written backward.

phi (see :mod:`flash_msa.compression.naive`): compressed token i of a sequence is
``W[h]^T · flatten_j(x[i*d + j, h] + pos[h, j])`` over its block of l keys (stride d). On a
packed stream the T//d output rows are filled back to back per sequence (``cu_cmp``), rows
past ``cu_cmp[-1]`` are 0, and everything is sized without a host sync.

Why not gather the blocks: l = r*d, so a block is r consecutive stride chunks, and neighbouring
blocks share r - 1 of them. Each chunk is gathered once (``slots``: a sequence with n blocks owns
n + r - 1 consecutive slots), the r pieces of W are applied to every chunk in one bmm
(``[H, slots, d*D] @ [H, d*D, r*Dout]``), and block i adds piece c of slot ``slot(i) + c``.
The position encoding is a constant bias ``flatten(pos) @ W`` per head. That reads x once
instead of twice and never builds the [H, Tc, l*D] blocks (with them: 4.1 ms of GPU time per
call at 64K tokens, Llama3-8B heads, mostly elementwise passes and an accumulating scatter;
benchmarks/results/tune_h200.log, from ``scripts/tune_nsa.py --ops compress``).

Backward: dW and dx are one bmm each. Within a sequence the slots cover disjoint tokens, so dx
is one scatter that writes every token at most once: no float atomics, bitwise deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_msa.utils.cache import per_batch
from flash_msa.utils.varlen import compressed_rows


def compression_slots(cu_seqlens: torch.Tensor, T: int, block: int, stride: int):
    """Stride-chunk slots of the packed stream, on the device without a host sync.

    Returns (cu_cmp int32 [N+1]; token index int64 [Ns, stride] of every slot's chunk, T for
    slots that no block uses; row_slot int64 [Tc], the first slot of each compressed row, 0 for
    unused rows; valid bool [Tc]), with Ns = T//stride + N*(r - 1) and r = block // stride.
    """
    r = block // stride
    cu_cmp, _, valid = compressed_rows(cu_seqlens, T, block, stride)
    cu, cc = cu_seqlens.to(torch.int64), cu_cmp.to(torch.int64)
    N = cu.numel() - 1
    dev = cu.device
    slot_cum = cc + torch.arange(N + 1, device=dev) * (r - 1)  # slots of sequence s start at slot_cum[s]
    Tc = T // stride
    slots = torch.arange(Tc + N * (r - 1), device=dev)
    seq = torch.searchsorted(slot_cum[1:], slots, right=True).clamp_max(N - 1)
    j = slots - slot_cum[seq]
    n_blocks = cc[seq + 1] - cc[seq]
    used = (n_blocks > 0) & (j < n_blocks + r - 1) & (slots < slot_cum[-1])
    tok = cu[seq, None] + j[:, None] * stride + torch.arange(stride, device=dev)  # [Ns, stride]
    tok = torch.where(used[:, None], tok, torch.full_like(tok, T))
    rows = torch.arange(Tc, device=dev)
    row_seq = torch.searchsorted(cc[1:], rows, right=True).clamp_max(N - 1)
    row_slot = torch.where(valid, rows + row_seq * (r - 1), torch.zeros_like(rows))
    return cu_cmp, tok, row_slot, valid


def _stack_weight(weight: torch.Tensor, r: int) -> torch.Tensor:
    """[H, r*d*D, Dout] -> [H, d*D, r*Dout]: the r pieces of W side by side."""
    H, K, Dout = weight.shape
    return weight.view(H, r, K // r, Dout).permute(0, 2, 1, 3).reshape(H, K // r, r * Dout)


def _piece_index(row_slot: torch.Tensor, r: int) -> torch.Tensor:
    """[Tc, r]: row (slot(i) + c)*r + c of the [slots*r, Dout] matmul output, piece c of block i."""
    c = torch.arange(r, device=row_slot.device)
    return (row_slot[:, None] + c) * r + c


def _gather_chunks(x: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """[H, Ns, d*D]: the stride chunk of every slot. Unused slots (token T) read token T - 1
    instead: no valid row uses their products, and no padded copy of x is made."""
    T, H, D = x.shape
    return x[tok.clamp_max(T - 1)].permute(2, 0, 1, 3).reshape(H, tok.shape[0], -1)


class CompressFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, pos, tok, row_slot, valid, block, stride):
        T, H, D = x.shape
        r = block // stride
        w = weight.to(x.dtype)
        Dout = w.shape[-1]
        chunks = _gather_chunks(x, tok)  # [H, Ns, d*D]
        y = torch.bmm(chunks, _stack_weight(w, r)).view(H, -1, Dout)  # [H, Ns*r, Dout]
        bias = torch.bmm(pos.to(x.dtype).reshape(H, 1, block * D), w)  # [H, 1, Dout]
        out = y[:, _piece_index(row_slot, r)].sum(2) + bias  # [H, Tc, Dout]
        out = out.transpose(0, 1) * valid[:, None, None].to(out.dtype)
        ctx.save_for_backward(x, weight, pos, tok, row_slot, valid)
        ctx.block, ctx.stride = block, stride
        return out.contiguous()

    @staticmethod
    def backward(ctx, do):
        x, weight, pos, tok, row_slot, valid = ctx.saved_tensors
        block, stride = ctx.block, ctx.stride
        T, H, D = x.shape
        r = block // stride
        w = weight.to(x.dtype)
        Dout = w.shape[-1]
        Ns = tok.shape[0]
        do = (do * valid[:, None, None].to(do.dtype)).transpose(0, 1).to(x.dtype)  # [H, Tc, Dout]
        # dy: piece c of slot(i) + c receives block i's gradient; (slot, piece) pairs of the valid
        # rows are distinct, unused rows go to a dummy slot Ns
        idx = torch.where(valid[:, None], _piece_index(row_slot, r), torch.full_like(row_slot[:, None], Ns * r))
        dy = x.new_zeros(H, (Ns + 1) * r, Dout)
        dy[:, idx.reshape(-1)] = do[:, :, None, :].expand(-1, -1, r, -1).reshape(H, -1, Dout)
        dy = dy[:, :Ns * r].reshape(H, Ns, r * Dout)
        chunks = _gather_chunks(x, tok)  # [H, Ns, d*D], recomputed
        dw = torch.bmm(chunks.transpose(1, 2), dy)  # [H, d*D, r*Dout]
        dw = dw.view(H, stride * D, r, Dout).permute(0, 2, 1, 3).reshape(H, block * D, Dout).float()
        dbias = do.float().sum(1)  # [H, Dout]
        pos_flat = pos.float().reshape(H, block * D)
        dw += pos_flat[:, :, None] * dbias[:, None, :]
        dpos = torch.bmm(w.float(), dbias[:, :, None]).view(H, block, D)
        dchunks = torch.bmm(dy, _stack_weight(w, r).transpose(1, 2))  # [H, Ns, d*D]
        dx = x.new_zeros(T + 1, H, D)
        dx[tok.reshape(-1)] = dchunks.view(H, -1, D).transpose(0, 1)  # every token written at most once
        return dx[:T], dw.to(weight.dtype), dpos.to(pos.dtype), None, None, None, None, None


def _mean_pool_weight(H: int, D: int, block: int, like: torch.Tensor) -> torch.Tensor:
    """[H, block*D, D]: the linear map that averages a block's l rows."""
    eye = torch.eye(D, device=like.device, dtype=like.dtype) / block
    return eye.repeat(block, 1).expand(H, -1, -1)


def compress_kv(x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, cu_seqlens: torch.Tensor,
                block: int, stride: int, proj: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """phi over every block of a packed stream (the contract of flash_msa.reference.compress_kv).

    Args:
        x: [T, H, D] keys or values (after RoPE for keys).
        weight: [H, block*D, D]; pos: [H, block, D]; proj: optional [H, D, D], the second layer
            of phi on top of mean pooling (compression/naive.py).
        cu_seqlens: int32 [N+1]; block, stride: l and d, l a multiple of d.

    Returns:
        (x_cmp [T//stride, H, D] in x's dtype, zero past cu_cmp[-1]; cu_cmp int32 [N+1]).
        Differentiable in x, weight, pos and proj.
    """
    if block % stride != 0:
        raise ValueError(f"block ({block}) must be a multiple of stride ({stride})")
    T = x.shape[0]
    cu_cmp, tok, row_slot, valid = per_batch(compression_slots, cu_seqlens, T, block, stride)  # shared by the layers
    if valid.numel() == 0:
        extra = 0 if proj is None else proj.sum()
        out = x[:0] + 0 * (weight.sum() + pos.sum() + extra)  # [0, H, D], keeps every input in the graph
        return out, cu_cmp
    if proj is None:
        return CompressFunction.apply(x.contiguous(), weight, pos, tok, row_slot, valid, block, stride), cu_cmp
    # One gathered-block matmul yields both the MLP's hidden layer and the block mean:
    # [W | mean-pooling], so the blocks are read once.
    H, D = x.shape[1], x.shape[2]
    w_cat = torch.cat([weight, _mean_pool_weight(H, D, block, weight)], dim=-1)  # [H, l*D, 2D]
    both = CompressFunction.apply(x.contiguous(), w_cat, pos, tok, row_slot, valid, block, stride)  # [Tc, H, 2D]
    hidden, mean = both[..., :D], both[..., D:]
    out = mean + torch.bmm(F.gelu(hidden.float()).to(x.dtype).transpose(0, 1), proj.to(x.dtype)).transpose(0, 1)
    return out, cu_cmp
