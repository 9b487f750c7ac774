"""Sliding-window attention (Triton) against flash_msa.reference: forward and all grads."""
import pytest
import torch

from flash_msa import reference
from flash_msa.window.interface import window_attention
from tests.helpers import assert_close

GROUPS = {"G1": (2, 2), "G3": (6, 2), "G4": (8, 2), "G5": (10, 2), "G8": (8, 1), "G16": (16, 1)}
SEQS = {"varlen": [0, 5, 40, 41, 130, 200], "one-seq-111": [0, 111], "short": [0, 1, 3, 20]}


def _check(cu_list, HQ, HK, D, window, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 1e-4 if device == "cpu" else 1e-2
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    T = cu_list[-1]
    q = torch.randn(T, HQ, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(T, HK, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(T, HK, D, device=device, dtype=dtype, requires_grad=True)
    o = window_attention(q, k, v, cu, window, D ** -0.5)
    o_ref = reference.window_attention(q, k, v, cu, window, D ** -0.5)
    assert_close("o", o, o_ref, tol)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    refs = torch.autograd.grad(o_ref, (q, k, v), do)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert_close(name, g, r, tol)
    return grads


@pytest.mark.parametrize("group", list(GROUPS))
def test_window_groups(group, device):
    HQ, HK = GROUPS[group]
    _check(SEQS["varlen"], HQ, HK, 16, 32, device)


@pytest.mark.parametrize("seqs,window", [("one-seq-111", 512), ("one-seq-111", 2), ("short", 16)],
                         ids=["w512", "w2", "short-w16"])
def test_window_sizes(seqs, window, device):
    _check(SEQS[seqs], 4, 2, 32, window, device)


def test_window_d128(device):
    _check([0, 60, 100], 4, 2, 128, 48, device)


def test_window_backward_is_deterministic(device):
    g1 = _check(SEQS["varlen"], 10, 2, 16, 32, device)
    torch.manual_seed(0)
    g2 = _check(SEQS["varlen"], 10, 2, 16, 32, device)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("group", ["G1", "G5"])
def test_window_interior_tiles(group, device, small_range_tiles):
    HQ, HK = GROUPS[group]
    _check([0, 7, 90, 160], HQ, HK, 16, 40, device)
