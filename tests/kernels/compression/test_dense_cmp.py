"""Compressed attention as dense grouped attention (compression/dense_cmp.py) against flash_msa.reference.

On CPU the dense causal attention runs in plain PyTorch (backend "math"), which checks the
regrouping of tokens into query groups, the lse layout and the gate-shifted backward; on CUDA
the same checks run cuDNN (bf16), where it takes the shape.
"""
import pytest
import torch

from flash_msa import reference, tuning
from flash_msa.compression import dense_cmp
from flash_msa.utils.varlen import compressed_cu_seqlens
from tests.helpers import assert_close

# (B, L, HQ, HK, D, l, d): a short last group (1 token) or a full one, one group, G = 1..16
LAYOUTS = {
    "one-seq": (1, 200, 8, 2, 32, 32, 16),  # last group of 9 tokens
    "batch3-G5": (3, 47, 10, 2, 16, 16, 8),
    "one-group": (2, 33, 4, 4, 16, 32, 16),  # L - l < d: Tc = 1
    "full-last-group": (1, 31 + 16 * 5, 6, 3, 16, 32, 16),
    "last-group-of-1": (2, 64, 16, 1, 16, 32, 16),  # G = 16
}
CUDA_LAYOUTS = {"one-seq-D64": (1, 1000, 8, 2, 64, 32, 16), "batch2-G5-D128": (2, 700, 10, 2, 128, 32, 16)}


@pytest.fixture
def backend(device):
    name = "cudnn" if device == "cuda" else "math"
    with tuning.override(dense_cmp=dict(backend=name)):
        yield name


def _run(B, L, HQ, HK, D, l, d, device, zero_gates):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 1e-4 if device == "cpu" else 1e-2
    T = B * L
    cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=device)
    cu_cmp = compressed_cu_seqlens(cu, l, d)
    q = torch.randn(T, HQ, D, device=device, dtype=dtype, requires_grad=True)
    kc = torch.randn(T // d, HK, D, device=device, dtype=dtype, requires_grad=True)
    vc = torch.randn(T // d, HK, D, device=device, dtype=dtype, requires_grad=True)
    scale = D ** -0.5
    layout = dense_cmp.dense_layout(q, (B, L), l, d)
    if device == "cuda" and dense_cmp.split_groups(L, l, d)[1] < 2:
        assert layout is None  # cuDNN's backward takes no dense call of one position
        return
    assert layout == (B, L, "cudnn" if device == "cuda" else "math")
    with torch.no_grad():
        o, lse, aux = dense_cmp.dense_cmp_forward(q, kc, vc, layout, l, d, scale)
    o_ref, lse_ref = reference.compressed_attention(q, kc, vc, cu, cu_cmp, l, d, scale)
    assert_close("o", o, o_ref, tol)
    none = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse), none) and (lse[none] < 0).all(), "lse must be -inf where nothing is visible"
    assert (o[none.any(-1)] == 0).all()
    assert_close("lse", lse[~none], lse_ref[~none].float(), tol)
    # the single Function's backward: output gradient do, gate g folded into lse - log(g)
    do = torch.randn_like(o)
    g = torch.rand(T, HQ, device=device)
    if zero_gates:
        g.view(-1)[::7] = 0.0
    lse_g = torch.where(none, lse, lse - torch.log(g))  # as gates.gate_backward_branches: -inf stays
    with torch.no_grad():
        dq, dk, dv = dense_cmp.dense_cmp_backward(q, kc, vc, o, lse_g, do, layout, l, d, scale, aux)
    refs = torch.autograd.grad(o_ref, (q, kc, vc), do * g[..., None].to(dtype))
    for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        if name in ("dq", "dk") and L - l < d:  # one key per query: p = 1, so ds = 0 exactly
            assert x.abs().max() < 1e-5
            continue
        assert_close(name, x, r, tol)
    assert (dq[none.any(-1)] == 0).all()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dense_cmp_matches_reference(layout, device, backend):
    B, L, HQ, HK, D, l, d = LAYOUTS[layout]
    if device == "cuda":  # cuDNN takes head dims 64 and 128
        if not dense_cmp.cudnn_supported(torch.empty(1, 1, 64, device=device, dtype=torch.bfloat16)):
            pytest.skip("needs cuDNN fused attention (CUDA, sm90)")
        D = 64
    _run(B, L, HQ, HK, D, l, d, device, zero_gates=layout == "one-seq")


@pytest.mark.parametrize("chunks", [2, 16])
def test_dense_cmp_in_chunks(chunks, device, backend):
    """The dense part in several calls over the groups' token offsets (the memory bound)."""
    B, L, HQ, HK, D, l, d = CUDA_LAYOUTS["batch2-G5-D128"] if device == "cuda" else LAYOUTS["one-seq"]
    if device == "cuda" and not dense_cmp.cudnn_supported(torch.empty(1, 1, 64, device=device, dtype=torch.bfloat16)):
        pytest.skip("needs cuDNN fused attention (CUDA, sm90)")
    with tuning.override(dense_cmp=dict(chunks=chunks)):
        _run(B, L, HQ, HK, D, l, d, device, zero_gates=True)


def test_chunk_count():
    assert dense_cmp.chunk_count(16) == 4  # 4 token offsets (4*HQ query heads) per call
    assert dense_cmp.chunk_count(12) == 3
    assert dense_cmp.chunk_count(6) == 2  # J = 3
    assert dense_cmp.chunk_count(2) == 1
    with tuning.override(dense_cmp=dict(chunks=5)):
        with pytest.raises(ValueError, match=r"dense_cmp chunks \(5\) must divide cmp_stride \(16\)"):
            dense_cmp.chunk_count(16)


def test_group_view():
    """Head j*HQ + h at position i of the dense call is token l - 1 + d*i + j, head h; the short
    last group is left to the range kernel."""
    B, L, HQ, l, d = 3, 77, 6, 32, 16
    Tc, S, n_last = dense_cmp.split_groups(L, l, d)
    assert (Tc, S, n_last) == (3, 2, 14)  # 77 - 31 - 32 = 14 tokens in the last group
    assert dense_cmp.split_groups(31 + 16 * 5, 32, 16) == (5, 5, 16)  # a full last group joins the dense call
    x = torch.randn(B * L, HQ, 5)
    y = dense_cmp.group_view(x, B, L, l, d, S)
    assert y.shape == (B, d * HQ, S, 5) and y.data_ptr() == x[l - 1].data_ptr()  # a view
    for b, j, h, i in ((0, 0, 0, 0), (1, 3, 5, 1), (2, 15, 2, 1)):
        assert torch.equal(y[b, j * HQ + h, i], x[b * L + l - 1 + d * i + j, h])


def test_dense_layout_policy(monkeypatch):
    q = torch.empty(10, 4, 64)
    layout = dense_cmp.dense_layout
    with tuning.override(dense_cmp=dict(backend="math")):
        assert layout(q, (2, 100), 32, 16) == (2, 100, "math")
        assert layout(q, None, 32, 16) is None  # a packed stream of several lengths
        assert layout(q, (2, 31), 32, 16) is None  # no compressed row: the range kernels
    with tuning.override(dense_cmp=dict(backend="triton")):
        assert layout(q, (2, 100), 32, 16) is None
    assert layout(q, (2, 100_000), 32, 16) is None  # "auto" on CPU: no cuDNN
    monkeypatch.setattr(dense_cmp, "cudnn_supported", lambda q: True)
    assert layout(q, (1, 100_000), 32, 16) == (1, 100_000, "cudnn")
    assert layout(q, (1, 1000), 32, 16) is None  # below min_groups
    assert layout(q, (1, 100_000), 32, 16, deterministic=True) is None  # the deterministic range kernels
    with tuning.override(dense_cmp=dict(backend="cudnn")):
        assert layout(q, (1, 1000), 32, 16) == (1, 1000, "cudnn")
        assert layout(q, (1, 63), 32, 16) == (1, 63, "cudnn")  # two full groups
        assert layout(q, (1, 62), 32, 16) is None  # one dense position: cuDNN's backward rejects it
        try:  # cuDNN's dq is not deterministic: deterministic algorithms keep the Triton kernels
            torch.use_deterministic_algorithms(True)
            assert layout(q, (1, 100_000), 32, 16) is None
        finally:
            torch.use_deterministic_algorithms(False)
    with tuning.override(dense_cmp=dict(backend="fast")):
        with pytest.raises(ValueError, match="dense_cmp backend must be one of"):
            layout(q, (1, 100_000), 32, 16)


def test_nsa_attention_passes_uniform_streams(monkeypatch):
    """nsa_attention marks a stream uniform (so compressed attention may run dense) only when it
    knows on the host that every sequence has one length: a dense batch, or one sequence."""
    import flash_msa.nsa as nsa
    seen = []

    def spy(branches, q, *args, uniform, deterministic, gather_group=None):
        seen.append(uniform)
        return torch.zeros_like(q)

    monkeypatch.setattr(nsa, "_compose", spy)
    B, T, HQ, HK, D, l = 2, 64, 4, 2, 16, 32
    q, k, v = torch.randn(B, T, HQ, D), torch.randn(B, T, HK, D), torch.randn(B, T, HK, D)
    gates = torch.rand(B, T, HQ, 3)
    params = [torch.randn(HK, l * D, D), torch.randn(HK, l, D)] * 2
    nsa.nsa_attention(q, k, v, gates, *params)
    one = [x[:1] for x in (q, k, v, gates)]
    nsa.nsa_attention(*one, *params, cu_seqlens=torch.tensor([0, T], dtype=torch.int32))
    nsa.nsa_attention(*one, *params, cu_seqlens=torch.tensor([0, T // 2, T], dtype=torch.int32))  # equal, but packed
    assert seen == [(B, T), (1, T), None]


@pytest.mark.parametrize("src_layout", ["heads-contiguous", "positions-contiguous"])
def test_copy_heads_into_group_view(device, src_layout):
    """copy_heads writes a [B, H, S, D] source into the groups' strided view exactly, from either
    memory order a dense call may return ([B, S, H, D] or [B, H, S, D]), over tiles of heads (the last partial)."""
    B, L, HQ, D, l, d, S = 2, 32 + 16 * 5, 40, 64, 32, 16, 5
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    o = torch.zeros(B * L, HQ, D, device=device, dtype=dtype)
    view = dense_cmp.group_view(o, B, L, l, d, S)[:, 4 * HQ:12 * HQ]  # offsets 4..11: 320 heads, 3 tiles of 128
    src = torch.randn(B, S, 8 * HQ, D, device=device, dtype=dtype).transpose(1, 2)
    if src_layout == "positions-contiguous":
        src = src.contiguous()
    dense_cmp.copy_heads(view, src)
    want = torch.zeros_like(o)
    dense_cmp.group_view(want, B, L, l, d, S)[:, 4 * HQ:12 * HQ] = src
    assert torch.equal(o, want)
    with pytest.raises(ValueError, match="contiguous D"):
        dense_cmp.copy_heads(view, src.float() if dtype != torch.float32 else src.double())


@pytest.mark.parametrize("src_layout", ["heads-contiguous", "positions-contiguous"])
def test_add_head_copies(device, src_layout):
    """add_head_copies adds the J copies of H heads in a [B, J*H, S, D] source (cuDNN's dk / dv of the
    repeated KV heads) to an fp32 strided view [B, H, S, D] (the compressed rows' gradient), H not a
    power of two; a wrong shape or dtype is refused."""
    B, Tc, H, D, J, S = 2, 7, 3, 64, 4, 6
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    acc = torch.randn(B * Tc + 3, H, D, device=device)  # packed rows, the last 3 past the B sequences
    dst = acc[:B * Tc].view(B, Tc, H, D)[:, :S].transpose(1, 2)
    src = torch.randn(B, S, J * H, D, device=device, dtype=dtype).transpose(1, 2)
    if src_layout == "positions-contiguous":
        src = src.contiguous()
    want = acc.clone()
    want[:B * Tc].view(B, Tc, H, D)[:, :S] += src.float().unflatten(1, (J, H)).sum(1).transpose(1, 2)
    dense_cmp.add_head_copies(dst, src)
    assert torch.allclose(acc, want, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="fp32 dst"):
        dense_cmp.add_head_copies(dst.to(torch.float64), src)
    with pytest.raises(ValueError, match="fp32 dst"):
        dense_cmp.add_head_copies(dst, src[:, :5])
