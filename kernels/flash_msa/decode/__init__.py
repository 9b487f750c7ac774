"""NSA for the last Tq queries of sequences whose keys are all known: decoding with a KV cache.

During generation each step brings Tq new tokens (1 when decoding, more for chunked prefill or
speculative verification) and the cache holds all Tk keys and values. :func:`nsa_decode` computes
the new rows, the rows the whole-sequence op gives those positions:

- the compressed keys and values (phi over blocks of l keys, stride d) of the cached tokens. A
  :class:`DecodeCache` keeps them between steps, so a step compresses only the blocks completed
  since the last one (one every d tokens) instead of all Tk keys again;
- then every branch and the gated sum, by Triton kernels (decode/kernel.py: three launches per step
  and layer) or in PyTorch (decode/naive.py, the kernels' reference and the CPU path).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from flash_msa.compression.naive import compress_kv
from flash_msa.decode.naive import nsa_decode_torch
from flash_msa.utils.validation import (
    check_nsa_sizes, check_qkv, check_scale, check_tensor, check_triton_device, trusted_inputs)

IMPLS = ("auto", "triton", "torch")


@dataclass
class DecodeCache:
    """The compressed keys and values [B, N, HK, D] of the first N compression blocks of the cached
    sequences, extended by :func:`nsa_decode` as blocks complete.

    It holds no keys of its own, so it stays valid only while the KV cache it was built from keeps
    its first tokens: extended at the end, or cropped (then only the rows of the remaining keys are
    used). After a cache is reordered (beam search) or refilled, start a new one (msa_train does,
    msa_train/models/attention.py). Rows of another batch, head or dtype shape are recomputed.
    """
    k_cmp: Optional[torch.Tensor] = None
    v_cmp: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        return 0 if self.k_cmp is None else self.k_cmp.shape[1]


# New rows up to this many are computed by a few PyTorch ops (_compress_few); more, by the
# training path's phi (its Triton kernel on CUDA), whose per-call index building costs about 3 ms
# of host time (scripts/decode_gpu.py, the step that completes a block).
FEW_ROWS = 64


def _compress_few(x, weight, pos, proj, cmp_block, cmp_stride):
    """phi (compression/naive.py's compress_kv) over the blocks of x [B, L, H, D] -> [B, n, H, D], as
    one unfold and one or two einsums: for the one row a decoding step completes."""
    B, L, H, D = x.shape
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    blocks = x.unfold(1, cmp_block, cmp_stride).permute(0, 1, 4, 2, 3).to(acc)  # [B, n, l, H, D]
    blocks = blocks + pos.to(acc).transpose(0, 1)
    hidden = torch.einsum("bnlhd,hlde->bnhe", blocks, weight.to(acc).view(H, cmp_block, D, D))
    if proj is not None:
        hidden = blocks.mean(2) + torch.einsum("bnhd,hde->bnhe", F.gelu(hidden), proj.to(acc))
    return hidden.to(x.dtype)


def _compress(x, weight, pos, proj, cmp_block, cmp_stride):
    """phi over the blocks of x [B, L, H, D] (each row a sequence of L tokens) -> [B, (L - l) // d + 1, H, D]."""
    B, L, H, D = x.shape
    n = (L - cmp_block) // cmp_stride + 1
    if n <= FEW_ROWS:
        return _compress_few(x, weight, pos, proj, cmp_block, cmp_stride)
    compress = compress_kv
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):  # phi's Triton kernel, as in training
        from flash_msa.compression.interface import TRITON_BRANCHES
        compress = TRITON_BRANCHES.compress
    cu = torch.arange(0, B * L + 1, L, device=x.device, dtype=torch.int32)
    with trusted_inputs():  # cu is built here: no value checks (a host sync each)
        rows, _ = compress(x.reshape(B * L, H, D), weight, pos, cu, cmp_block, cmp_stride, proj=proj)
    return rows[:B * n].view(B, n, H, D)  # each sequence's rows are consecutive in the packed output


def compressed_kv(k, v, k_cmp: tuple, v_cmp: tuple, cmp_block: int, cmp_stride: int,
                    cache: Optional[DecodeCache] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed keys and values [B, Nc, HK, D] of k, v [B, Tk, HK, D], Nc = (Tk - l) // d + 1 (0
    before the first full block); with a cache, only the rows it lacks are computed, and it is extended."""
    B, Tk, HK, D = k.shape
    Nc = max(0, (Tk - cmp_block) // cmp_stride + 1)
    have = 0
    if cache is not None and cache.k_cmp is not None:
        old = cache.k_cmp
        same = (old.shape[0] == B and tuple(old.shape[2:]) == (HK, D) and old.dtype == k.dtype
                and old.device == k.device)
        have = min(cache.rows, Nc) if same else 0  # fewer keys than before (a crop): the first Nc rows stay
    if have == Nc:
        kc, vc = (cache.k_cmp[:, :Nc], cache.v_cmp[:, :Nc]) if have else (k.new_zeros(B, 0, HK, D),
                                                                           v.new_zeros(B, 0, HK, D))
    else:
        lo, hi = have * cmp_stride, (Nc - 1) * cmp_stride + cmp_block  # the keys of rows have .. Nc - 1
        (kw, kp, kj), (vw, vp, vj) = k_cmp, v_cmp
        new_k = _compress(k[:, lo:hi], kw, kp, kj, cmp_block, cmp_stride)
        new_v = _compress(v[:, lo:hi], vw, vp, vj, cmp_block, cmp_stride)
        kc = torch.cat([cache.k_cmp[:, :have], new_k], 1) if have else new_k
        vc = torch.cat([cache.v_cmp[:, :have], new_v], 1) if have else new_v
    if cache is not None:
        cache.k_cmp, cache.v_cmp = kc, vc
    return kc, vc


def nsa_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor,
    k_cmp: tuple, v_cmp: tuple, *, cmp_block: int, cmp_stride: int, slc_block: int, slc_topk: int, window: int,
    scale: Optional[float] = None, cache: Optional[DecodeCache] = None, impl: str = "auto",
) -> torch.Tensor:
    """NSA output of the last Tq positions of B sequences of Tk tokens.

    Args:
        q: [B, Tq, HQ, D], the queries of positions Tk - Tq .. Tk - 1.
        k, v: [B, Tk, HK, D], every key and value of the sequences (the KV cache), Tk >= Tq; any
            strides (HF's cache layout [B, HK, Tk, D] transposed is read in place by the kernel).
        gates: [B, Tq, HQ, 3] branch gates of the new tokens (compressed, selected, window).
        k_cmp, v_cmp: (weight, pos, proj) of phi for keys and values (see nsa_attention).
        cmp_block, cmp_stride, slc_block, slc_topk, window, scale: as in nsa_attention.
        cache: the compressed rows of earlier steps of the same sequences (:class:`DecodeCache`).
        impl: "triton" (decode/kernel.py; CUDA, or Triton's CPU interpreter), "torch"
            (decode/naive.py), or "auto": Triton on CUDA for fp16 / bf16 / fp32, else PyTorch.

    Returns:
        [B, Tq, HQ, D] in the dtype of q.
    """
    check_tensor("q", q, ndim=4, layout="[B, Tq, HQ, D]")
    B, Tq, HQ, D = q.shape
    check_qkv(k.new_empty(B, k.shape[1], HQ, D), k, v)  # k, v [B, Tk, HK, D], HQ a multiple of HK
    Tk = k.shape[1]
    if Tq > Tk or Tq == 0:
        raise ValueError(f"q holds the last Tq of the Tk={Tk} positions of k, v: need 1 <= Tq <= Tk, got Tq={Tq}")
    if tuple(gates.shape) != (B, Tq, HQ, 3):
        raise ValueError(f"gates must have shape [B={B}, Tq={Tq}, HQ={HQ}, 3], got {tuple(gates.shape)}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    scale = check_scale(scale, D)
    check_nsa_sizes(cmp_block, cmp_stride, slc_block, slc_topk, window)
    if impl == "auto":
        impl = "triton" if q.is_cuda and q.dtype != torch.float64 else "torch"
    if impl == "triton" and q.dtype == torch.float64:
        raise TypeError("impl='triton' takes float16, bfloat16 or float32 inputs, got float64")
    if impl == "triton":
        check_triton_device(q, "impl='triton' needs", "torch")
    kc, vc = compressed_kv(k, v, k_cmp, v_cmp, cmp_block, cmp_stride, cache)
    sizes = dict(cmp_block=cmp_block, cmp_stride=cmp_stride, slc_block=slc_block, slc_topk=slc_topk, window=window)
    if impl == "triton":
        from flash_msa.decode.kernel import nsa_decode_triton
        return nsa_decode_triton(q, k, v, gates, kc, vc, scale=scale, **sizes)
    return nsa_decode_torch(q, k, v, gates, kc, vc, scale=scale, **sizes)


__all__ = ["DecodeCache", "compressed_kv", "nsa_decode"]
