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


@pytest.mark.parametrize("block", [16, 64])
def test_local_ranges_brute_force(block, device):
    """local_ranges (fmsa's two local blocks inside the window, flash_msa/fused.py) against the
    definition: key s is in query t's local blocks iff same sequence, s <= t and the block of s is
    t's own block or the one before; mid[t] is the first such key, qmid[s] one past the last such query."""
    from flash_msa.window.window import local_ranges
    lengths = [1, block - 1, block, block + 1, 3 * block + 5, 7]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    T = int(cu[-1])
    mid, qmid = (x.cpu().tolist() for x in local_ranges(cu, T, block))
    seq = [i for i, n in enumerate(lengths) for _ in range(n)]
    start = [int(cu[i]) for i in seq]
    blk = [(t - start[t]) // block for t in range(T)]
    sees = [[seq[s] == seq[t] and s <= t and blk[t] - 1 <= blk[s] for s in range(T)] for t in range(T)]
    assert mid == [min(s for s in range(T) if sees[t][s]) for t in range(T)]
    assert qmid == [max(t for t in range(T) if sees[t][s]) + 1 for s in range(T)]
    # and exactly: query t is in key s's range [s, qmid[s]) iff it sees s
    assert all((s <= t < qmid[s]) == sees[t][s] for t in range(T) for s in range(T))
