"""Compression phi (Triton kernels, deterministic backward) against flash_msa.reference, and RoPE."""
import pytest
import torch

from flash_msa import reference
from flash_msa.compression.compress import compress_kv
from flash_msa.compression.compressed_attention import compressed_attention
from tests.helpers import assert_close, rel_rms

CASES = {
    "one-seq-111": [0, 111],
    "varlen": [0, 7, 40, 41, 150],
    "shorter-than-block": [0, 20, 31, 63],
    "T-below-stride": [0, 9],
    # 37 rows and 43 slots at d=16: several row and slot tiles (16 per program on CPU)
    "many-seqs": [0, 33, 200, 215, 400, 531, 600],
}


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _tol(device):
    return 1e-4 if device == "cpu" else 5e-3


def _assert_grads_match(out, ref, leaves, device):
    """Every gradient of ``leaves`` (x, weight, pos, then proj if given) through out and through ref."""
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    refs = torch.autograd.grad(ref, leaves, do)
    for name, g, r in zip(("dx", "dweight", "dpos", "dproj"), grads, refs):
        assert_close(name, g, r, _tol(device))


def _params(HK, D, l, device, dtype):
    w = (torch.randn(HK, l * D, D, device=device) / (l * D) ** 0.5).to(dtype).requires_grad_()
    pos = (0.5 * torch.randn(HK, l, D, device=device)).to(dtype).requires_grad_()
    return w, pos


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("l,d", [(32, 16), (16, 8), (32, 8), (16, 16)], ids=["l32d16", "l16d8", "l32d8", "l16d16"])
def test_compress_matches_reference(case, l, d, device):
    dtype = _dtype(device)
    cu = torch.tensor(CASES[case], dtype=torch.int32, device=device)
    T, HK, D = CASES[case][-1], 2, 16
    x = torch.randn(T, HK, D, device=device, dtype=dtype, requires_grad=True)
    w, pos = _params(HK, D, l, device, dtype)
    out, cu_cmp = compress_kv(x, w, pos, cu, l, d)
    ref, cu_ref = reference.compress_kv(x, w, pos, cu, l, d)
    assert torch.equal(cu_cmp, cu_ref)
    assert out.shape == (T // d, HK, D)
    if out.numel() == 0:
        return
    assert_close("x_cmp", out, ref, _tol(device))
    _assert_grads_match(out, ref, (x, w, pos), device)


@pytest.mark.parametrize("case,l,d,D", [("varlen", 32, 16, 16), ("shorter-than-block", 32, 16, 16),
                                       ("many-seqs", 32, 16, 32), ("many-seqs", 64, 16, 16), ("varlen", 16, 4, 16),
                                       ("varlen", 32, 16, 64)])
def test_compress_mlp_matches_reference(case, l, d, D, device):
    """phi with its second layer (the model's configuration): mean pooling + proj^T gelu(W^T X)."""
    dtype = _dtype(device)
    cu = torch.tensor(CASES[case], dtype=torch.int32, device=device)
    T, HK = CASES[case][-1], 2
    x = torch.randn(T, HK, D, device=device, dtype=dtype, requires_grad=True)
    w, pos = _params(HK, D, l, device, dtype)
    proj = (torch.randn(HK, D, D, device=device) / D ** 0.5).to(dtype).requires_grad_()
    out, _ = compress_kv(x, w, pos, cu, l, d, proj=proj)
    ref, _ = reference.compress_kv(x, w, pos, cu, l, d, proj=proj)
    naive, _ = reference.compress_kv(x, w, pos, cu, l, d, form="naive", proj=proj)
    assert_close("naive", naive, ref, 1e-5)
    assert_close("x_cmp", out, ref, _tol(device))
    _assert_grads_match(out, ref, (x, w, pos, proj), device)


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "mlp"])
def test_compress_split_weight_gradient(mlp, device):
    """dW and dproj summed over compressed rows in several splits (partials added in order)."""
    from flash_msa import tuning
    # 37 rows: splits of 13 rows (16 on CPU tiles)
    with tuning.override(compress=dict(dw_split_rows=8, dw_max_splits=3)):
        _split_weight_gradient(mlp, device)


def _split_weight_gradient(mlp, device):
    dtype = _dtype(device)
    cu = torch.tensor(CASES["many-seqs"], dtype=torch.int32, device=device)
    T, HK, D, l, d = CASES["many-seqs"][-1], 2, 16, 32, 16
    x = torch.randn(T, HK, D, device=device, dtype=dtype, requires_grad=True)
    w, pos = _params(HK, D, l, device, dtype)
    proj = (torch.randn(HK, D, D, device=device) / D ** 0.5).to(dtype).requires_grad_() if mlp else None
    out, _ = compress_kv(x, w, pos, cu, l, d, proj=proj)
    ref, _ = reference.compress_kv(x, w, pos, cu, l, d, proj=proj)
    _assert_grads_match(out, ref, (x, w, pos) + ((proj,) if mlp else ()), device)


def test_compress_backward_is_deterministic(device):
    cu = torch.tensor([0, 50, 130], dtype=torch.int32, device=device)
    x = torch.randn(130, 2, 16, device=device, dtype=_dtype(device), requires_grad=True)
    w, pos = _params(2, 16, 32, device, x.dtype)
    do = torch.randn(130 // 16, 2, 16, device=device, dtype=x.dtype)
    g1 = torch.autograd.grad(compress_kv(x, w, pos, cu, 32, 16)[0], (x, w, pos), do)
    g2 = torch.autograd.grad(compress_kv(x, w, pos, cu, 32, 16)[0], (x, w, pos), do)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def _rope(x, positions, base=10000.0):
    """Rotate-half RoPE (HF Llama convention): x [T, H, D], positions [T]."""
    D = x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None, :], torch.cat([ang.sin()] * 2, -1)[:, None, :]
    x1, x2 = x.double().chunk(2, -1)
    return (x.double() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def test_rope_and_compressed_keys(device):
    """phi compresses keys after RoPE. With a phi that commutes with the rotations (mean pooling,
    zero position encoding: the initialisation) compressed attention depends only on relative
    positions: shifting every position by P changes nothing. A general learned phi mixes keys
    rotated by different angles, so its scores also depend on absolute position."""
    torch.manual_seed(0)
    T, HQ, HK, D, l, d = 96, 4, 2, 16, 32, 16
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(T, h, D, device=device, dtype=torch.float64) for h in (HQ, HK, HK))
    mean_w = (torch.eye(D, device=device, dtype=torch.float64) / l).repeat(l, 1).expand(HK, -1, -1).contiguous()
    zero_pos = torch.zeros(HK, l, D, device=device, dtype=torch.float64)
    rand_w = torch.randn(HK, l * D, D, device=device, dtype=torch.float64) / (l * D) ** 0.5

    def run(w, shift, kernel):
        p = torch.arange(T, device=device) + shift
        qr, kr = _rope(q, p), _rope(k, p)
        cmp, att = (compress_kv, compressed_attention) if kernel else (reference.compress_kv, reference.compressed_attention)
        kc, cc = cmp(kr, w, zero_pos, cu, l, d)
        vc, _ = cmp(v, w, zero_pos, cu, l, d)
        return kc, att(qr.float(), kc.float(), vc.float(), cu, cc, l, d, D ** -0.5)[0]

    kc0, o0 = run(mean_w, 0, True)
    kc1, o1 = run(mean_w, 1000, True)
    n = (T - l) // d + 1
    # mean pooling commutes with RoPE: the compressed key is the rotated mean, so it rotates with the shift
    assert torch.allclose(_rope(kc0[:n], torch.full((n,), 1000, device=device)), kc1[:n], atol=1e-9)
    # fp32 dots run as tf32 on CUDA, which rounds the rotated inputs differently
    assert_close("mean-pool phi is shift invariant", o1, o0, 1e-5 if device == "cpu" else 2e-3)
    _, o_ref = run(mean_w, 1000, False)
    assert_close("kernel vs reference under RoPE", o1, o_ref)
    _, r0 = run(rand_w, 0, True)
    _, r1 = run(rand_w, 1000, True)
    assert rel_rms(r1, r0) > 1e-2, "a general phi should see absolute positions through RoPE"
