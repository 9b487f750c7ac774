"""Compressed attention (Triton range attention) against flash_msa.reference: forward, lse, all grads."""
import pytest
import torch

from flash_msa import reference
from flash_msa.compression.compressed_attention import compressed_attention
from flash_msa.utils.varlen import compressed_cu_seqlens
from tests.helpers import assert_close

# (HQ, HK): G = 1, 3, 4, 5, 8, 16
GROUPS = {"G1": (2, 2), "G3": (6, 2), "G4": (8, 2), "G5": (10, 2), "G8": (8, 1), "G16": (16, 1)}
SEQS = {"one-seq-150": [0, 150], "varlen": [0, 5, 40, 41, 110, 190], "short-seqs": [0, 31, 32, 65, 80]}


def _inputs(cu_list, HQ, HK, D, l, d, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    T = cu_list[-1]
    cu_cmp = compressed_cu_seqlens(cu, l, d)
    Tc = T // d
    valid = (torch.arange(Tc, device=device) < cu_cmp[-1])[:, None, None]
    q = torch.randn(T, HQ, D, device=device, dtype=dtype, requires_grad=True)
    kc = (torch.randn(Tc, HK, D, device=device) * valid).to(dtype).requires_grad_()
    vc = (torch.randn(Tc, HK, D, device=device) * valid).to(dtype).requires_grad_()
    return q, kc, vc, cu, cu_cmp


def _check(cu_list, HQ, HK, D, device, l=32, d=16):
    tol = 1e-4 if device == "cpu" else 1e-2
    q, kc, vc, cu, cu_cmp = _inputs(cu_list, HQ, HK, D, l, d, device)
    o, lse = compressed_attention(q, kc, vc, cu, cu_cmp, l, d, D ** -0.5)
    o_ref, lse_ref = reference.compressed_attention(q, kc, vc, cu, cu_cmp, l, d, D ** -0.5)
    assert_close("o", o, o_ref, tol)
    none = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse), none), "lse must be -inf exactly where nothing is visible"
    assert (o[none.any(-1)] == 0).all()
    if (~none).any():
        assert_close("lse", lse[~none], lse_ref[~none].float(), tol)
    do = torch.randn_like(o)
    dlse = torch.randn_like(lse).masked_fill(none, 0)
    loss = (o.float() * do.float()).sum() + (lse.masked_fill(none, 0) * dlse).sum()
    loss_ref = (o_ref.float() * do.float()).sum() + (lse_ref.masked_fill(none, 0).float() * dlse).sum()
    grads = torch.autograd.grad(loss, (q, kc, vc))
    refs = torch.autograd.grad(loss_ref, (q, kc, vc))
    for name, g, r in zip(("dq", "dk_cmp", "dv_cmp"), grads, refs):
        assert_close(name, g, r, tol)
    return grads


@pytest.mark.parametrize("group", list(GROUPS))
def test_compressed_attention_groups(group, device):
    HQ, HK = GROUPS[group]
    _check(SEQS["varlen"], HQ, HK, 16, device)


@pytest.mark.parametrize("seqs", ["one-seq-150", "short-seqs"])
def test_compressed_attention_sequences(seqs, device):
    _check(SEQS[seqs], 4, 2, 32, device)


def test_compressed_attention_d64_small_blocks(device):
    _check([0, 70, 130], 4, 1, 64, device, l=16, d=8)


def test_compressed_attention_backward_is_deterministic(device):
    g1 = _check(SEQS["varlen"], 10, 2, 16, device)
    torch.manual_seed(0)
    g2 = _check(SEQS["varlen"], 10, 2, 16, device)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("group", ["G1", "G5"])
def test_compressed_attention_interior_tiles(group, device, small_range_tiles):
    HQ, HK = GROUPS[group]
    _check([0, 20, 300, 420], HQ, HK, 16, device)


def test_compressed_attention_dkdv_rows_upwards(device, small_range_tiles):
    """The dk/dv kernel walking its query rows upwards (the window's order, range_attention's
    "desc"; compressed attention walks them downwards, covered above): all three loop parts run."""
    from flash_msa import tuning
    with tuning.override(range_attention=dict(desc=dict(cmp=False, window=False))):
        _check([0, 20, 300, 420], 10, 2, 16, device)
