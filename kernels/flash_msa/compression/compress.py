"""Compression phi in Triton: one forward kernel and three backward kernels, all deterministic.

phi (see :mod:`flash_msa.compression.naive`): compressed token i of a sequence is
``W[h]^T · flatten_j(x[i*d + j, h] + pos[h, j])`` over its block of l keys (stride d), and with
the second layer ``proj`` the model's form ``mean_j(x + pos) + proj[h]^T gelu(W[h]^T ...)``. On a
packed stream the T//d output rows are filled back to back per sequence (``cu_cmp``), rows past
``cu_cmp[-1]`` are 0, and everything is sized without a host sync.

Kernels (one program per tile of rows or slots and one KV head, but for dW):

- ``compress_fwd_kernel``: per tile of compressed rows, ``sum_j x_j @ W_j`` over the block's l
  offsets (x rows gathered straight from the packed stream, W_j = rows [j*D, (j+1)*D) of W[h]),
  plus the position encoding as a constant bias ``flatten(pos) @ W`` (fp32, on the host side);
  with ``proj`` the block mean and ``gelu(hidden) @ proj`` in the same program. The fp32 hidden
  layer is kept for the backward.
- ``compress_bwd_prep_kernel`` (with ``proj``): the hidden layer's gradient
  ``dh = (dout @ proj^T) * gelu'(hidden)`` per tile of rows.
- ``compress_bwd_dx_kernel``: per tile of stride chunks ("slots", see :func:`compression_slots`):
  token ``i*d + j`` of a chunk gets ``dh(i - c) @ W[j + c*d]^T`` from the r = l/d blocks that
  cover it (plus ``dout/l`` through the mean). Each token is written by exactly one program.
- ``compress_bwd_dw_kernel``: per (offset j, head, split of the rows), ``dW_j = sum_i x_j(i)^T dh(i)``
  in row order; a second launch (``PROJ``), one program per (head, split), sums
  ``dproj = gelu(hidden)^T dout``. The splits' partials are added in order on the host.

The position encoding's share of the forward ([H, D] biases), of dpos ([H, l, D]) and of dW
(an [H, l, D, D] outer product) is computed on the host side with PyTorch.

Why hand-written: the PyTorch form (a gather of stride chunks, a batched matmul and index
arithmetic, 20-odd elementwise and indexing kernels per call) took 5.4 ms for K and V forward +
backward at 64K tokens (benchmarks/results/nsa/variants.md#nsa_6c8eeb7), against well under 1 ms of bytes;
these kernels read x once per block it belongs to and write every output once
(benchmarks/results/tune/variants.md#tune_compress: 2.14 -> 1.05 ms per call at 64K, 6.69 -> 3.03 at 256K).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_msa import tuning
from flash_msa.utils.cache import per_batch
from flash_msa.utils.varlen import compressed_rows

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# a program holds [D, D] tiles of W and proj: head dims beyond 128 run the PyTorch reference
KERNEL_HEAD_DIMS = (16, 32, 64, 128)
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def compress_fwd_kernel(
    x, w, bias, mpos, proj, out, hid, first_key, valid, Tc,
    H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BC: tl.constexpr, MLP: tl.constexpr,
    PREC: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < Tc
    m_v = m_c & (tl.load(valid + o_c, mask=m_c, other=0) != 0)  # [BC] rows that hold a block
    b_k0 = tl.load(first_key + o_c, mask=m_v, other=0)  # [BC] int64 first token of each block
    o_d = tl.arange(0, D)
    p_w = w + i_h.to(tl.int64) * (BLOCK * D * D) + o_d[:, None] * D + o_d[None, :]  # W_0 of head i_h: [D, D]
    b_h = tl.zeros([BC, D], dtype=tl.float32)
    b_sum = tl.zeros([BC, D], dtype=tl.float32)
    for j in range(BLOCK):
        b_x = tl.load(x + ((b_k0 + j) * H + i_h)[:, None] * D + o_d[None, :], mask=m_v[:, None], other=0.)  # [BC, D]
        b_w = tl.load(p_w + j * D * D).to(b_x.dtype)  # [D, D]
        b_h += tl.dot(b_x, b_w, input_precision=PREC)
        if MLP:
            b_sum += b_x.to(tl.float32)
    b_h += tl.load(bias + i_h * D + o_d)[None, :]  # flatten(pos) @ W, fp32
    o_out = (o_c.to(tl.int64) * H + i_h)[:, None] * D + o_d[None, :]
    if MLP:
        tl.store(hid + o_out, tl.where(m_v[:, None], b_h, 0.), mask=m_c[:, None])
        b_g = 0.5 * b_h * (1. + tl.erf(b_h * _SQRT1_2))  # exact gelu
        b_p = tl.load(proj + i_h.to(tl.int64) * D * D + o_d[:, None] * D + o_d[None, :]).to(x.dtype.element_ty)
        b_o = tl.dot(b_g.to(x.dtype.element_ty), b_p, input_precision=PREC)
        b_o += b_sum * (1. / BLOCK) + tl.load(mpos + i_h * D + o_d)[None, :]
    else:
        b_o = b_h
    tl.store(out + o_out, tl.where(m_v[:, None], b_o, 0.).to(out.dtype.element_ty), mask=m_c[:, None])


@triton.jit
def compress_bwd_prep_kernel(
    do, hid, proj, valid, dh, Tc,
    H: tl.constexpr, D: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
):
    # the MLP's hidden-layer gradient: dh = (do @ proj^T) * gelu'(hid), 0 on rows without a block
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < Tc
    m_v = m_c & (tl.load(valid + o_c, mask=m_c, other=0) != 0)
    o_d = tl.arange(0, D)
    o_x = (o_c.to(tl.int64) * H + i_h)[:, None] * D + o_d[None, :]
    b_do = tl.load(do + o_x, mask=m_v[:, None], other=0.)  # [BC, D]
    b_pt = tl.load(proj + i_h.to(tl.int64) * D * D + o_d[None, :] * D + o_d[:, None]).to(b_do.dtype)  # proj^T
    b_dg = tl.dot(b_do, b_pt, input_precision=PREC)
    b_h = tl.load(hid + o_x, mask=m_v[:, None], other=0.)
    b_gd = 0.5 * (1. + tl.erf(b_h * _SQRT1_2)) + b_h * tl.exp(-0.5 * b_h * b_h) * _INV_SQRT_2PI
    tl.store(dh + o_x, (b_dg * b_gd).to(dh.dtype.element_ty), mask=m_c[:, None])


@triton.jit
def compress_bwd_dx_kernel(
    dh, do, w, dx, slot_tok, slot_row, Ns, T,
    H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, STRIDE: tl.constexpr, BC: tl.constexpr,
    MLP: tl.constexpr, PREC: tl.constexpr,
):
    # slot s (a stride chunk of one sequence) holds tokens slot_tok[s] + [0, STRIDE); the block that
    # starts c chunks earlier covers it at offset j + c*STRIDE, and slot_row[s - c] is its row (-1: none)
    R: tl.constexpr = BLOCK // STRIDE
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    o_s = i_s * BC + tl.arange(0, BC)
    m_s = o_s < Ns
    b_t0 = tl.load(slot_tok + o_s, mask=m_s, other=T)  # [BC] int64, T for unused slots
    m_t = b_t0 < T
    o_d = tl.arange(0, D)
    p_wt = w + i_h.to(tl.int64) * (BLOCK * D * D) + o_d[None, :] * D + o_d[:, None]  # W_0^T of head i_h: [D, D]
    b_dm = tl.zeros([BC, D], dtype=tl.float32)
    if MLP:  # the mean's gradient, the same for every token of the chunk
        for c in tl.static_range(R):
            b_r = tl.load(slot_row + o_s - c, mask=m_s & (o_s >= c), other=-1).to(tl.int64)
            b_dm += tl.load(do + (b_r * H + i_h)[:, None] * D + o_d[None, :], mask=(b_r >= 0)[:, None],
                            other=0.).to(tl.float32)
        b_dm = b_dm * (1. / BLOCK)
    for j in range(STRIDE):
        b_dx = b_dm
        for c in tl.static_range(R):
            b_r = tl.load(slot_row + o_s - c, mask=m_s & (o_s >= c), other=-1).to(tl.int64)
            b_dh = tl.load(dh + (b_r * H + i_h)[:, None] * D + o_d[None, :], mask=(b_r >= 0)[:, None], other=0.)
            b_wt = tl.load(p_wt + (j + c * STRIDE) * D * D).to(b_dh.dtype)  # [D, D]
            b_dx += tl.dot(b_dh, b_wt, input_precision=PREC)
        tl.store(dx + ((b_t0 + j) * H + i_h)[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty),
                 mask=m_t[:, None])


@triton.jit
def compress_bwd_dw_kernel(
    x, dh, do, hid, dw, dproj, first_key, valid, Tc, rows_per_split,
    H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
    PROJ: tl.constexpr,
):
    # program (j, head, split), j < BLOCK: the split's share of dW_j = sum over rows i of
    # x[first_key(i) + j]^T dh(i); PROJ (a launch of its own, j = 0): of dproj = sum_i gelu(hid(i))^T do(i).
    # Rows in order within a split, splits summed in order on the host: deterministic. The two parts
    # are separate launches (constexpr PROJ), not a branch on j: with the branch in the row loop Triton
    # did not pipeline its loads, and with both parts in one kernel the dW part took the registers of
    # the gelu part (183 against 102 on sm_90, one program per SM instead of two).
    i_j, i_h, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = tl.arange(0, D)
    b_acc = tl.zeros([D, D], dtype=tl.float32)
    r0 = i_s * rows_per_split
    for c0 in range(r0, tl.minimum(Tc, r0 + rows_per_split), BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < Tc
        m_v = m_c & (tl.load(valid + o_c, mask=m_c, other=0) != 0)
        o_r = (o_c.to(tl.int64) * H + i_h)[:, None] * D + o_d[None, :]
        if PROJ:
            b_h = tl.load(hid + o_r, mask=m_v[:, None], other=0.).to(tl.float32)  # (fp32; typed for MLP=False too)
            b_a = (0.5 * b_h * (1. + tl.erf(b_h * _SQRT1_2))).to(do.dtype.element_ty)
            b_b = tl.load(do + o_r, mask=m_v[:, None], other=0.)
        else:
            b_k0 = tl.load(first_key + o_c, mask=m_v, other=0)
            b_a = tl.load(x + ((b_k0 + i_j) * H + i_h)[:, None] * D + o_d[None, :], mask=m_v[:, None], other=0.)
            b_b = tl.load(dh + o_r, mask=m_v[:, None], other=0.)
        b_acc += tl.dot(tl.trans(b_a), b_b, input_precision=PREC)
    o_dd = o_d[:, None] * D + o_d[None, :]
    if PROJ:
        tl.store(dproj + (i_s * H + i_h).to(tl.int64) * D * D + o_dd, b_acc)
    else:
        tl.store(dw + ((i_s * H + i_h).to(tl.int64) * BLOCK + i_j) * D * D + o_dd, b_acc)


def _dot_precision(dtype: torch.dtype):
    """tl.dot input precision: exact products for fp32 inputs (the CPU tests' dtype), the default otherwise."""
    return "ieee" if dtype == torch.float32 else None


def compression_slots(cu_seqlens: torch.Tensor, T: int, block: int, stride: int):
    """Rows and stride-chunk slots of the packed stream, on the device without a host sync.

    Returns (cu_cmp int32 [N+1]; first_key int64 [Tc], the first token of each row's block, 0 for
    unused rows; valid bool [Tc]; slot_tok int64 [Ns], the first token of every slot's chunk, T
    for unused slots; slot_row int32 [Ns], the row of the block that starts at the slot, -1 for
    none), with Tc = T//stride, Ns = Tc + N*(r - 1) and r = block // stride. A sequence with n
    blocks owns n + r - 1 consecutive slots (its chunks up to the end of its last block); block
    i starts at its slot i, so the r - 1 slots before a sequence's first never start a block.
    """
    r = block // stride
    cu_cmp, first_key, valid = compressed_rows(cu_seqlens, T, block, stride)
    cu, cc = cu_seqlens.to(torch.int64), cu_cmp.to(torch.int64)
    N = cu.numel() - 1
    dev = cu.device
    slot_cum = cc + torch.arange(N + 1, device=dev) * (r - 1)  # slots of sequence s start at slot_cum[s]
    slots = torch.arange(T // stride + N * (r - 1), device=dev)
    seq = torch.searchsorted(slot_cum[1:], slots, right=True).clamp_max(N - 1)
    j = slots - slot_cum[seq]
    n_blocks = cc[seq + 1] - cc[seq]
    used = (n_blocks > 0) & (j < n_blocks + r - 1) & (slots < slot_cum[-1])
    slot_tok = torch.where(used, cu[seq] + j * stride, torch.full_like(j, T))
    slot_row = torch.where(used & (j < n_blocks), cc[seq] + j, torch.full_like(j, -1))
    return cu_cmp, first_key, valid, slot_tok, slot_row.to(torch.int32)


# Launch settings of op "compress" (flash_msa.tuning), from _tiles: per kernel "fwd" | "prep" |
# "dx" | "dw" a (rows per program, launch options) entry; "dw_split_rows" and "dw_max_splits":
# dW / dproj's reduction over compressed rows takes one split per dw_split_rows rows, at most
# dw_max_splits (partials of splits * H * l * D * D fp32: 64 MiB at 4 splits, 8 KV heads, l=32,
# D=128; 128 MiB at 8). 8 rather than 4 since the pipelined dW kernel: one of k/v forward + backward
# at 256K 2.31 against 2.40 ms (benchmarks/results/tune/variants.md#tune_compress2); from 128K on.
# An override (flash_msa.tuning.override(compress=...)) replaces whole entries (tests and
# scripts/tune_nsa.py use it).
tuning.register("compress", ("fwd", "prep", "dx", "dw", "dw_split_rows", "dw_max_splits"))


def _tiles(device) -> dict:
    if device.type != "cuda":
        cfg = dict(fwd=(16, {}), prep=(16, {}), dx=(16, {}), dw=(16, {}))
    else:
        # without spills on sm_90 (scripts/kernel_resources.py); the forward's 3 stages took one of
        # k/v forward + backward from 1.05 to 0.98 ms at 64K and 3.68 to 3.40 at 256K
        # (benchmarks/results/tune/variants.md#tune_compress)
        cfg = dict(fwd=(64, dict(num_warps=8, num_stages=3)), prep=(64, dict(num_warps=4, num_stages=1)),
                   dx=(32, dict(num_warps=4, num_stages=2)), dw=(64, dict(num_warps=8, num_stages=2)))
    return tuning.settings("compress", dict(cfg, dw_split_rows=1024, dw_max_splits=8))


class CompressFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, pos, proj, first_key, valid, slot_tok, slot_row, block, stride):
        T, H, D = x.shape
        Tc = first_key.numel()
        mlp = proj is not None
        cfg = _tiles(x.device)
        prec = _dot_precision(x.dtype)
        w32 = weight.float()
        bias = torch.bmm(pos.float().reshape(H, 1, block * D), w32).view(H, D)  # flatten(pos) @ W, fp32
        mpos = pos.float().mean(1)  # [H, D]
        out = torch.empty(Tc, H, D, device=x.device, dtype=x.dtype)
        hid = torch.empty(Tc, H, D, device=x.device, dtype=torch.float32) if mlp else out
        BC, opts = cfg["fwd"]
        compress_fwd_kernel[(triton.cdiv(Tc, BC), H)](
            x, weight, bias, mpos, proj if mlp else weight, out, hid, first_key, valid, Tc,
            H=H, D=D, BLOCK=block, BC=BC, MLP=mlp, PREC=prec, **opts)
        ctx.save_for_backward(x, weight, pos, proj, hid if mlp else None, first_key, valid, slot_tok, slot_row)
        ctx.block, ctx.stride, ctx.mlp = block, stride, mlp
        return out

    @staticmethod
    def backward(ctx, do):
        x, weight, pos, proj, hid, first_key, valid, slot_tok, slot_row = ctx.saved_tensors
        block, stride, mlp = ctx.block, ctx.stride, ctx.mlp
        T, H, D = x.shape
        Tc = first_key.numel()
        cfg = _tiles(x.device)
        prec = _dot_precision(x.dtype)
        do = do.to(x.dtype).contiguous()  # [Tc, H, D]; rows without a block are never read
        if mlp:
            dh = torch.empty_like(do)
            BC, opts = cfg["prep"]
            compress_bwd_prep_kernel[(triton.cdiv(Tc, BC), H)](do, hid, proj, valid, dh, Tc, H=H, D=D, BC=BC,
                                                               PREC=prec, **opts)
        else:
            dh = do
        dx = torch.zeros(T, H, D, device=x.device, dtype=x.dtype)  # tokens in no block keep 0
        BC, opts = cfg["dx"]
        Ns = slot_tok.numel()
        compress_bwd_dx_kernel[(triton.cdiv(Ns, BC), H)](
            dh, do, weight, dx, slot_tok, slot_row, Ns, T,
            H=H, D=D, BLOCK=block, STRIDE=stride, BC=BC, MLP=mlp, PREC=prec, **opts)
        # the sums over rows are split into Tc // dw_split_rows chunks (1 to dw_max_splits) of equal
        # size rounded up to BC rows, so that more programs than (l + 1) * H share the reduction;
        # the last chunk may be shorter, or empty (its partial is 0)
        BC, opts = cfg["dw"]
        splits = max(1, min(cfg["dw_max_splits"], Tc // cfg["dw_split_rows"]))
        rows = triton.cdiv(triton.cdiv(Tc, splits), BC) * BC
        dw = torch.empty(splits, H, block * D, D, device=x.device, dtype=torch.float32)
        dproj = torch.empty(splits, H, D, D, device=x.device, dtype=torch.float32) if mlp else dw
        for part in (False, True) if mlp else (False,):
            compress_bwd_dw_kernel[(1 if part else block, H, splits)](
                x, dh, do, hid if mlp else dh, dw, dproj, first_key, valid, Tc, rows,
                H=H, D=D, BLOCK=block, BC=BC, PREC=prec, PROJ=part, **opts)
        dw = dw.sum(0)  # [H, l*D, D], splits in order
        dproj = dproj.sum(0) if mlp else None
        # the position encoding: X_j = x_j + pos_j, so dW_j gains pos_j^T sum_i dh(i) and
        # dpos_j = (sum_i dh(i)) W_j^T (+ sum_i dout(i) / l through the mean); sums over rows with a block
        m = valid[:, None, None]
        dh_sum = torch.where(m, dh, 0).sum(0, dtype=torch.float32)  # [H, D]
        dw = dw.view(H, block, D, D) + pos.float()[..., None] * dh_sum[:, None, None, :]
        dpos = torch.einsum("he,hjde->hjd", dh_sum, weight.float().view(H, block, D, D))
        if mlp:
            dpos = dpos + torch.where(m, do, 0).sum(0, dtype=torch.float32)[:, None, :] / block
        return (dx, dw.view(H, block * D, D).to(weight.dtype), dpos.to(pos.dtype),
                None if dproj is None else dproj.to(proj.dtype), None, None, None, None, None, None)


def compress_kv(x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, cu_seqlens: torch.Tensor,
                block: int, stride: int, proj: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """phi over every block of a packed stream (the contract of flash_msa.reference.compress_kv).

    Args:
        x: [T, H, D] keys or values (after RoPE for keys). The kernels take fp16, bf16 and fp32
            and D in KERNEL_HEAD_DIMS; other dtypes and head dims run the PyTorch reference.
        weight: [H, block*D, D]; pos: [H, block, D]; proj: optional [H, D, D], the second layer
            of phi on top of mean pooling (compression/naive.py).
        cu_seqlens: int32 [N+1]; block, stride: l and d, l a multiple of d.

    Returns:
        (x_cmp [T//stride, H, D] in x's dtype, zero past cu_cmp[-1]; cu_cmp int32 [N+1]).
        Differentiable in x, weight, pos and proj; the backward is deterministic.
    """
    if block % stride != 0:
        raise ValueError(f"block ({block}) must be a multiple of stride ({stride})")
    T, H, D = x.shape
    if x.dtype not in KERNEL_DTYPES or D not in KERNEL_HEAD_DIMS:
        from flash_msa import reference
        return reference.compress_kv(x, weight, pos, cu_seqlens, block, stride, proj=proj)
    cu_cmp, first_key, valid, slot_tok, slot_row = per_batch(compression_slots, cu_seqlens, T, block, stride)
    if valid.numel() == 0:
        extra = 0 if proj is None else proj.sum()
        out = x[:0] + 0 * (weight.sum() + pos.sum() + extra)  # [0, H, D], keeps every input in the graph
        return out, cu_cmp
    args = [a.contiguous() for a in (x, weight, pos)]
    out = CompressFunction.apply(*args, None if proj is None else proj.contiguous(),
                                 first_key, valid, slot_tok, slot_row, block, stride)
    return out, cu_cmp
