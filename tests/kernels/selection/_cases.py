"""Inputs and checks shared by the selected-attention kernel tests.

On CPU the kernels run in the Triton interpreter (tests/conftest.py) in fp32 against the
dense reference at rel RMS 1e-4. On CUDA the same tests run in bf16 against the reference
computed in fp32 from the same bf16 inputs, at 2e-2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flash_msa.selection.interface import IMPLS
from flash_msa.selection.naive import selected_attention_naive
from tests.helpers import assert_close


@dataclass
class Case:
    q: torch.Tensor            # [1, T, HQ, D] leaf, requires grad
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    block_indices: torch.Tensor  # int32 [1, T, HK, S]
    cu_seqlens: torch.Tensor
    block_size: int

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def kernel_dtype(device) -> torch.dtype:
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def tolerance(device) -> float:
    return 1e-4 if kernel_dtype(device) == torch.float32 else 2e-2


def seq_starts(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    cu = cu_seqlens.long().cpu()
    seq = torch.searchsorted(cu[1:], torch.arange(T), right=True)
    return cu[seq]


def random_indices(T, HK, S, block_size, cu_seqlens, *, beyond_causal=True, gen=None) -> torch.Tensor:
    """Distinct, unsorted entries with -1 anywhere; some entries past the query's own block (blocks
    of its sequence: the interface rejects entries past the sequence's last block)."""
    start = seq_starts(cu_seqlens, T)
    cu = cu_seqlens.long().cpu()
    end = cu[1:][torch.searchsorted(cu[1:], torch.arange(T), right=True)]
    out = torch.full((T, HK, S), -1, dtype=torch.int32)
    for t in range(T):
        own = (t - int(start[t])) // block_size
        n_blocks = -(-int(end[t] - start[t]) // block_size)
        hi = min(n_blocks, own + 1 + (2 if beyond_causal else 0))  # up to 2 blocks past the causal limit
        for h in range(HK):
            perm = torch.randperm(hi, generator=gen)[:S]
            slots = torch.randperm(S, generator=gen)[:len(perm)]
            out[t, h, slots] = perm.int()
    return out[None]


def make_case(T, HK, G, D, S, block_size, device, *, cu_seqlens: Optional[list] = None,
              block_indices: Optional[torch.Tensor] = None, seed=0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor(cu_seqlens if cu_seqlens is not None else [0, T], dtype=torch.int32)
    if block_indices is None:
        block_indices = random_indices(T, HK, S, block_size, cu, gen=gen)
    dtype = kernel_dtype(device)
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    q, k, v = rnd(1, T, HK * G, D), rnd(1, T, HK, D), rnd(1, T, HK, D)
    return Case(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), rnd(1, T, HK * G, D),
                block_indices.to(device), cu.to(device), block_size)


def run(impl: str, c: Case, **kwargs):
    """(o, dq, dk, dv) of one implementation."""
    o = IMPLS[impl].attention(c.q, c.k, c.v, c.block_indices, c.block_size, c.cu_seqlens, c.scale, **kwargs)
    dq, dk, dv = torch.autograd.grad(o, (c.q, c.k, c.v), c.do)
    return o, dq, dk, dv


def reference(c: Case):
    """(o, dq, dk, dv) of the dense reference in fp32 on the same inputs."""
    q, k, v = (x.detach().float().requires_grad_() for x in (c.q, c.k, c.v))
    o = selected_attention_naive(q[0], k[0], v[0], c.block_indices[0], c.block_size, c.cu_seqlens, c.scale)[None]
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), c.do.float())
    return o, dq, dk, dv


def assert_matches_reference(impl: str, c: Case, device, **kwargs):
    outs = run(impl, c, **kwargs)
    for name, x, r in zip(("o", "dq", "dk", "dv"), outs, reference(c)):
        assert x.dtype == c.q.dtype
        assert_close(f"{impl} {name}", x.float(), r, tol=tolerance(device))
    return outs
