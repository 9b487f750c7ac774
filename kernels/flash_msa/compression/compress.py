"""Compression phi as gather + batched matmul, with a deterministic hand-written backward.

phi (see :mod:`flash_msa.compression.naive`): compressed token i of a sequence is
``W[h]^T · flatten_j(x[i*d + j, h] + pos[h, j])`` over its block of l keys (stride d). On a
packed stream the T//d output rows are filled back to back per sequence (``cu_cmp``), rows
past ``cu_cmp[-1]`` are 0, and everything is sized without a host sync.

Forward: one gather builds the blocks ``[HK, Tc, l*D]`` (2x the bytes of x at l = 2d) and one
bmm per call applies every head's W. Backward: dW and dpos are bmm / reductions; dx is the
transpose of the gather. Because l is a multiple of d, the block rows split into r = l/d
stride-chunks, and for a fixed chunk c the rows of different compressed tokens land on
disjoint tokens, so dx is r plain scatters (a static loop of r <= 16 steps), each writing every
token at most once: no float atomics, bitwise deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_msa.utils.varlen import compressed_rows


def _gather_blocks(x, pos, first, block):
    """[H, Tc, l*D] blocks of x plus the position encoding (x's dtype; fp32 math for fp32 x)."""
    T, H, D = x.shape
    keys = (first[:, None] + torch.arange(block, device=x.device)).clamp_max(T - 1)  # [Tc, l]
    blocks = x[keys] + pos.to(x.dtype).transpose(0, 1)  # [Tc, l, H, D]
    return blocks.permute(2, 0, 1, 3).reshape(H, -1, block * D)


class CompressFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, pos, first, valid, block, stride):
        T, H, D = x.shape
        blocks = _gather_blocks(x, pos, first, block)  # [H, Tc, l*D]
        out = torch.bmm(blocks, weight.to(x.dtype)).transpose(0, 1)  # [Tc, H, D]
        out = out * valid[:, None, None].to(out.dtype)
        ctx.save_for_backward(x, weight, pos, first, valid)
        ctx.block, ctx.stride = block, stride
        return out.contiguous()

    @staticmethod
    def backward(ctx, do):
        x, weight, pos, first, valid = ctx.saved_tensors
        block, stride = ctx.block, ctx.stride
        T, H, D = x.shape
        Tc = first.shape[0]
        do = (do * valid[:, None, None].to(do.dtype)).transpose(0, 1).to(x.dtype)  # [H, Tc, D]
        blocks = _gather_blocks(x, pos, first, block)  # [H, Tc, l*D], recomputed
        dw = torch.bmm(blocks.transpose(1, 2), do)  # [H, l*D, D]
        db = torch.bmm(do, weight.to(x.dtype).transpose(1, 2)).float()  # [H, Tc, l*D]
        db = db.view(H, Tc, block, D)
        dpos = db.sum(1)  # [H, l, D]
        # dx: chunk c of every block covers tokens first + c*stride + [0, stride), disjoint across rows.
        r = block // stride
        db = db.view(H, Tc, r, stride, D).permute(1, 2, 3, 0, 4)  # [Tc, r, stride, H, D]
        dx = torch.zeros(T + 1, H, D, dtype=torch.float32, device=x.device)
        o_s = torch.arange(stride, device=x.device)
        for c in range(r):
            idx = first[:, None] + c * stride + o_s  # [Tc, stride]
            idx = torch.where(valid[:, None], idx, torch.full_like(idx, T))  # padding rows -> a dummy row (their grads are 0)
            dx.index_put_((idx.reshape(-1),), db[:, c].reshape(-1, H, D), accumulate=True)
        return dx[:T].to(x.dtype), dw.to(weight.dtype), dpos.to(pos.dtype), None, None, None, None


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
    cu_cmp, first, valid = compressed_rows(cu_seqlens, T, block, stride)
    if first.numel() == 0:
        extra = 0 if proj is None else proj.sum()
        out = x[:0] + 0 * (weight.sum() + pos.sum() + extra)  # [0, H, D], keeps every input in the graph
        return out, cu_cmp
    if proj is None:
        return CompressFunction.apply(x.contiguous(), weight, pos, first, valid, block, stride), cu_cmp
    # One gathered-block matmul yields both the MLP's hidden layer and the block mean:
    # [W | mean-pooling], so the blocks are read once.
    H, D = x.shape[1], x.shape[2]
    w_cat = torch.cat([weight, _mean_pool_weight(H, D, block, weight)], dim=-1)  # [H, l*D, 2D]
    both = CompressFunction.apply(x.contiguous(), w_cat, pos, first, valid, block, stride)  # [Tc, H, 2D]
    hidden, mean = both[..., :D], both[..., D:]
    out = mean + torch.bmm(F.gelu(hidden.float()).to(x.dtype).transpose(0, 1), proj.to(x.dtype)).transpose(0, 1)
    return out, cu_cmp
