"""The PyTorch reference of NSA: the chunked form equals the naive form, gradients are right."""
import pytest
import torch

import flash_msa
from flash_msa import reference as R
from tests.helpers import assert_close

SIZES = dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=4, window=24)


def make_inputs(T, HQ, HK, D, dtype=torch.float64, requires_grad=False, block=16):
    q = torch.randn(1, T, HQ, D, dtype=dtype)
    k = torch.randn(1, T, HK, D, dtype=dtype)
    v = torch.randn(1, T, HK, D, dtype=dtype)
    gates = torch.rand(1, T, HQ, 3, dtype=dtype)
    params = [
        torch.randn(HK, block * D, D, dtype=dtype) * (block * D) ** -0.5,
        torch.randn(HK, block, D, dtype=dtype) * 0.3,
        torch.randn(HK, block * D, D, dtype=dtype) * (block * D) ** -0.5,
        torch.randn(HK, block, D, dtype=dtype) * 0.3,
    ]
    projs = [torch.randn(HK, D, D, dtype=dtype) * D ** -0.5 for _ in range(2)]
    tensors = [q, k, v, gates, *params, *projs]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors


def nsa_ref(tensors, **kw):
    """reference.nsa_attention on make_inputs' tensors (the last two are phi's second layers)."""
    return R.nsa_attention(*tensors[:8], k_cmp_proj=tensors[8], v_cmp_proj=tensors[9], **kw)


# sequences shorter than one compression block (5), than one selection block (12), and long ones
CU_CASES = {
    "single": [0, 150],
    "varlen": [0, 5, 17, 90, 161],
    "tiny_docs": [0, 3, 4, 9, 15, 20, 33],
}


@pytest.mark.parametrize("G", [1, 2, 3, 4, 5, 8, 16], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("case", ["single", "varlen"])
def test_chunked_equals_naive(G, case):
    bounds = CU_CASES[case]
    T, HK = bounds[-1], 2 if G <= 4 else 1
    cu = torch.tensor(bounds, dtype=torch.int32)
    tensors = make_inputs(T, G * HK, HK, 8)
    a, ia = nsa_ref(tensors, **SIZES, cu_seqlens=cu, return_indices=True)
    b, ib = nsa_ref(tensors, **SIZES, cu_seqlens=cu, form="naive", return_indices=True)
    assert torch.equal(ia, ib)
    assert_close("o", a, b, tol=1e-10)


def test_branches_chunked_equal_naive_with_small_chunks():
    T, HQ, HK, D = 111, 6, 2, 8
    cu = torch.tensor([0, 7, 63, 111], dtype=torch.int32)
    q, k, v, _, w, p, _, _, j, _ = make_inputs(T, HQ, HK, D)
    q, k, v = q[0], k[0], v[0]
    kc, cu_c = R.compress_kv(k, w, p, cu, 16, 8, proj=j)
    kn, cu_n = R.compress_kv(k, w, p, cu, 16, 8, form="naive", proj=j)
    assert torch.equal(cu_c, cu_n)
    assert_close("k_cmp", kc, kn, tol=1e-12)
    from flash_msa.compression.naive import compressed_attention_chunked, select_blocks_chunked
    from flash_msa.selection.naive import selected_attention_chunked
    from flash_msa.window.naive import window_attention_chunked
    o1, l1 = compressed_attention_chunked(q, kc, kc, cu, cu_c, 16, 8, 0.3, chunk=5)
    o2, l2 = R.compressed_attention(q, kc, kc, cu, cu_c, 16, 8, 0.3, form="naive")
    assert_close("o_cmp", o1, o2, tol=1e-12)
    assert torch.equal(torch.isinf(l1), torch.isinf(l2))
    finite = torch.isfinite(l2)
    assert_close("lse", l1[finite], l2[finite], tol=1e-12)
    i1 = select_blocks_chunked(q, kc, l1, cu, cu_c, 16, 8, 16, 3, 0.3, chunk=7)
    i2 = R.select_blocks(q, kc, l2, cu, cu_c, 16, 8, 16, 3, 0.3, form="naive")
    assert torch.equal(i1, i2)
    assert_close("o_slc", selected_attention_chunked(q, k, v, i1, 16, cu, 0.3, chunk=9),
                 R.selected_attention(q, k, v, i1, 16, cu, 0.3, form="naive"), tol=1e-12)
    assert_close("o_swa", window_attention_chunked(q, k, v, cu, 10, 0.3, chunk=13),
                 R.window_attention(q, k, v, cu, 10, 0.3, form="naive"), tol=1e-12)


@pytest.mark.parametrize("G", [1, 3, 5], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("case", ["single", "varlen", "tiny_docs"])
def test_selected_span_and_gathered_chunks_agree(G, case):
    """The chunked selected attention's two ways of a chunk (gathered keys, or one masked product
    over the span its keys lie in: selection/naive.py, selected_dense_span) give the naive form's
    output and gradients, with chunks that straddle documents and entries of -1 and past the
    query's block."""
    from flash_msa.selection.naive import selected_attention_chunked
    bounds = CU_CASES[case]
    T, HK, D, bs, S = bounds[-1], 2, 8, 8, 3
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v = (torch.randn(T, h, D, dtype=torch.float64, requires_grad=True) for h in (G * HK, HK, HK))
    # distinct blocks, some past the query's own one, and some entries -1
    idx = torch.rand(T, HK, T // bs + 1).argsort(-1)[..., :S].to(torch.int32)
    idx[torch.rand(T, HK, S) < 0.2] = -1
    want = R.selected_attention(q, k, v, idx, bs, cu, 0.3, form="naive")
    grads = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    for chunk, span in [(None, 0), (None, 10 ** 6), (7, 0), (7, 10 ** 6), (11, 1)]:
        got = selected_attention_chunked(q, k, v, idx, bs, cu, 0.3, chunk=chunk, dense_span=span)
        assert_close(f"o chunk={chunk} span={span}", got, want, tol=1e-12)
        for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), torch.ones_like(got)), grads):
            assert_close(f"d{name} chunk={chunk} span={span}", a, b, tol=1e-12)


def test_first_tokens_see_no_compressed_token():
    T, HQ, HK, D = 40, 4, 2, 8
    cu = torch.tensor([0, T], dtype=torch.int32)
    q, k, v, _, w, p, _, _, _, _ = make_inputs(T, HQ, HK, D)
    kc, cu_c = R.compress_kv(k[0], w, p, cu, 16, 8)
    o, lse = R.compressed_attention(q[0], kc, kc, cu, cu_c, 16, 8, 0.3)
    # token t sees compressed token i iff i*8 + 15 <= t: none before t = 15
    assert (o[:15] == 0).all() and torch.isinf(lse[:15]).all() and (lse[:15] < 0).all()
    assert torch.isfinite(lse[15:]).all() and (o[15:] != 0).any(-1).all()


def test_selection_forces_initial_and_local_blocks():
    T, HQ, HK, D = 160, 4, 2, 8
    cu = torch.tensor([0, 10, T], dtype=torch.int32)
    tensors = make_inputs(T, HQ, HK, D)
    _, idx = nsa_ref(tensors, **SIZES, cu_seqlens=cu, return_indices=True)
    idx = idx[0]
    for t in range(T):
        t_rel = t if t < 10 else t - 10
        own = t_rel // 16
        for h in range(HK):
            chosen = set(idx[t, h].tolist()) - {-1}
            assert {0, own, max(own - 1, 0)} <= chosen
            assert len(chosen) == min(own + 1, 4) and max(chosen) <= own


def test_gradcheck_float64():
    T, HQ, HK, D = 37, 4, 2, 4
    cu = torch.tensor([0, 9, T], dtype=torch.int32)
    tensors = make_inputs(T, HQ, HK, D, requires_grad=True, block=8)
    sizes = dict(cmp_block=8, cmp_stride=4, slc_block=16, slc_topk=2, window=6)
    # the selection is piecewise constant; its indices are fixed by the unperturbed inputs
    assert torch.autograd.gradcheck(
        lambda *t: nsa_ref(t, **sizes, cu_seqlens=cu), tuple(tensors), eps=1e-6, atol=1e-5, fast_mode=True)


def test_module_matches_functional_and_backward_runs():
    T, HQ, HK, D, hidden = 70, 5, 1, 8, 12
    cu = torch.tensor([0, 30, T], dtype=torch.int32)
    m = flash_msa.NativeSparseAttention(hidden, HQ, HK, D, **SIZES, impl="reference")
    h = torch.randn(1, T, hidden, requires_grad=True)
    q, k, v = (torch.randn(1, T, n, D, requires_grad=True) for n in (HQ, HK, HK))
    o = m(h, q, k, v, cu_seqlens=cu)
    gates = torch.full((1, T, HQ, 3), 1 / 3)
    ref = R.nsa_attention(q, k, v, gates, m.compress_k.weight, m.compress_k.pos, m.compress_v.weight,
                          m.compress_v.pos, **SIZES, cu_seqlens=cu, k_cmp_proj=m.compress_k.proj,
                          v_cmp_proj=m.compress_v.proj)
    assert_close("o", o, ref, tol=1e-6)
    o.square().sum().backward()
    for name, p in [("h", h), ("q", q), ("k", k), ("v", v), *m.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # at initialisation proj = 0, so only proj (and the gates) receive gradient through phi
    assert m.gate.weight.grad.abs().sum() > 0 and m.compress_k.proj.grad.abs().sum() > 0


def test_compression_init_is_mean_pooling():
    m = flash_msa.NativeSparseAttention(8, 2, 1, 4, cmp_block=8, cmp_stride=4, slc_block=16, slc_topk=2, window=8)
    k = torch.randn(20, 1, 4)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    c = m.compress_k
    kc, _ = R.compress_kv(k, c.weight.detach(), c.pos.detach(), cu, 8, 4, proj=c.proj.detach())
    mean_pos = c.pos.detach().mean(1)  # [1, D]: a constant shift of every compressed key
    expected = torch.stack([k[i * 4:i * 4 + 8].mean(0) for i in range(4)]) + mean_pos
    assert_close("k_cmp", kc[:4], expected, tol=1e-6)


def test_position_encoding_changes_compressed_scores():
    """With the MLP phi the intra-block position encoding is not a constant shift: permuting a
    block's keys changes its compressed key."""
    torch.manual_seed(1)
    HK, D, l = 1, 4, 8
    w, pos = torch.randn(HK, l * D, D, dtype=torch.float64), torch.randn(HK, l, D, dtype=torch.float64)
    proj = torch.randn(HK, D, D, dtype=torch.float64)
    cu = torch.tensor([0, l], dtype=torch.int32)
    k = torch.randn(l, HK, D, dtype=torch.float64)
    a, _ = R.compress_kv(k, w, pos, cu, l, l, proj=proj)
    pos2 = pos + torch.randn_like(pos)
    b, _ = R.compress_kv(k, w, pos2, cu, l, l, proj=proj)
    shift = (pos2 - pos).mean(1)
    assert (b[0] - a[0] - shift).abs().max() > 1e-3


def test_dense_batch_equals_varlen():
    T, HQ, HK, D = 50, 4, 2, 8
    tensors = make_inputs(T, HQ, HK, D)
    two = [torch.cat([t, t.flip(1)]) if t.dim() == 4 else t for t in tensors]
    dense = nsa_ref(two, **SIZES)
    packed = [t.reshape(1, 2 * T, *t.shape[2:]) if t.dim() == 4 else t for t in two]
    cu = torch.tensor([0, T, 2 * T], dtype=torch.int32)
    assert_close("o", dense.reshape(1, 2 * T, HQ, D), nsa_ref(packed, **SIZES, cu_seqlens=cu), tol=1e-12)


def test_selected_attention_reference_semantics():
    T, HQ, HK, D, bs = 40, 2, 1, 8, 16
    q, k, v = (torch.randn(1, T, n, D, dtype=torch.float64) for n in (HQ, HK, HK))
    cu = torch.tensor([0, 20, T], dtype=torch.int32)
    idx = torch.full((1, T, HK, 2), -1, dtype=torch.int32)
    idx[0, :, 0, 1] = 1  # block 1 only: invisible to the first 16 tokens of each sequence
    o = flash_msa.selected_attention(q, k, v, idx, block_size=bs, cu_seqlens=cu, impl="reference")
    rel = torch.cat([torch.arange(20), torch.arange(20)])
    assert (o[0, rel < 16] == 0).all() and (o[0, rel >= 16] != 0).any(-1).all()
    # token 16 of a sequence sees only itself: output is its own value row
    assert_close("o", o[0, 16], v[0, 16].expand(HQ, D), tol=1e-12)
    assert_close("o", o[0, 36], v[0, 36].expand(HQ, D), tol=1e-12)
