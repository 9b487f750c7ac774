"""Packed documents are isolated from each other's non-finite values: a NaN in document 0's keys
or values reaches no row of document 1, in the reference (where, not a product with a 0 mask) and
in the Triton selected-attention kernels (a KV block never crosses a sequence start).

The Triton range kernels (window and compressed attention) isolate keys but not values: a tile
of queries may straddle a sequence start, and its ``p @ v`` multiplies another document's value
rows by p = 0, which keeps a NaN (docs/nsa_kernels.md, Non-finite values)."""
import pytest
import torch

import flash_msa
from flash_msa import reference
from flash_msa.compression.interface import TRITON_BRANCHES
from flash_msa.utils.varlen import compressed_cu_seqlens

CU = [0, 70, 150]  # document 0: tokens 0..69, document 1: 70..149
HQ, HK, D = 4, 2, 16
L, STRIDE = 16, 8


RANGE_V = pytest.mark.xfail(strict=True, reason="range kernels: p = 0 times another document's NaN value")


def _stream(device, which, at=65):
    T = CU[-1]
    q, k, v = torch.randn(T, HQ, D, device=device), torch.randn(T, HK, D, device=device), torch.randn(T, HK, D, device=device)
    {"k": k, "v": v}[which][at, 1, 3] = float("nan")  # one element of document 0 (65: near its end)
    return torch.tensor(CU, dtype=torch.int32, device=device), q, k, v


def _doc1_finite(o):
    assert torch.isfinite(o[CU[1]:]).all(), "document 1 caught document 0's NaN"
    assert not torch.isfinite(o[:CU[1]]).all(), "the NaN must reach the rows of document 0 that see it"


CASES = [("reference", "k"), ("reference", "v"), ("triton", "k"), pytest.param("triton", "v", marks=RANGE_V)]


@pytest.mark.parametrize("impl, which", CASES)
def test_window_isolates_documents(impl, which, device):
    cu, q, k, v = _stream(device, which)
    fn = reference.window_attention if impl == "reference" else TRITON_BRANCHES.window_attention
    _doc1_finite(fn(q, k, v, cu, 32, D ** -0.5))


@pytest.mark.parametrize("impl, which", CASES)
def test_compressed_attention_isolates_documents(impl, which, device):
    cu, q, k, v = _stream(device, which)
    cu_cmp = compressed_cu_seqlens(cu, L, STRIDE)
    n = CU[-1] // STRIDE
    kc, vc = torch.randn(n, HK, D, device=device), torch.randn(n, HK, D, device=device)
    {"k": kc, "v": vc}[which][5, 1, 3] = float("nan")  # the last compressed row of document 0 (rows 0..6)
    fn = reference.compressed_attention if impl == "reference" else TRITON_BRANCHES.compressed_attention
    o, _ = fn(q, kc, vc, cu, cu_cmp, L, STRIDE, D ** -0.5)
    _doc1_finite(o)


@pytest.mark.parametrize("impl, span", [("reference", 0), ("reference", 100), ("fmsa", None), ("qc", None)],
                         ids=["reference-gather", "reference-span", "fmsa", "qc"])
def test_selected_attention_isolates_documents(impl, span, device):
    cu, q, k, v = _stream(device, "v", at=5)  # in block 0, which every query selects
    bs = 16
    T = CU[-1]
    idx = torch.full((1, T, HK, 2), -1, dtype=torch.int32, device=device)
    idx[..., 0] = 0  # every query selects its sequence's first block
    # the reference's two ways of a chunk: gathered keys, or a masked span
    with flash_msa.tuning.override(**({} if span is None else {"reference": {"selected_dense_span": span}})):
        o = flash_msa.selected_attention(q[None], k[None], v[None], idx, block_size=bs, cu_seqlens=cu, impl=impl)[0]
    _doc1_finite(o)
