"""fmsa (KV-block-centric) and qc (query-centric) selected attention against the reference:
forward and dq, dk, dv, over group sizes, block sizes, head dims, varlen and adversarial indices."""
import pytest
import torch

from flash_msa.selection import fmsa
from tests.helpers import assert_close
from tests.kernels.selection._cases import (
    assert_matches_reference, kernel_dtype, make_case, run, seq_starts, tolerance)

IMPLS = ["fmsa", "qc"]

# (T or cu_seqlens, HK, G, D, S, block_size): every G of 1..16 the issue names, block sizes
# 16..128, D 16/32/64/128, odd lengths, varlen with sequences shorter than a block.
SHAPES = {
    "g1-bs16-t63-hk2": (63, 2, 1, 16, 3, 16),
    "g2-bs32-t111": (111, 1, 2, 32, 3, 32),
    "g3-bs16-varlen-short": ([0, 5, 21, 22, 50, 57, 80], 1, 3, 16, 3, 16),
    "g4-bs64-t150-d64": (150, 1, 4, 64, 2, 64),
    "g5-bs16-t47-hk2": (47, 2, 5, 16, 4, 16),
    "g7-bs128-t150": (150, 1, 7, 32, 2, 128),
    "g8-bs16-t40-d128": (40, 1, 8, 128, 2, 16),
    "g16-bs16-t40": (40, 1, 16, 16, 3, 16),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_matches_reference(impl, shape, device):
    T, HK, G, D, S, bs = shape
    cu = None
    if isinstance(T, list):
        cu, T = T, T[-1]
    assert_matches_reference(impl, make_case(T, HK, G, D, S, bs, device, cu_seqlens=cu), device)


def _adversarial(pattern: str, T: int, bs: int) -> torch.Tensor:
    """int32 [1, T, 1, 4] block indices of one adversarial pattern (one sequence, HK=1)."""
    t = torch.arange(T)
    own = t // bs
    bi = torch.full((T, 1, 4), -1, dtype=torch.int32)
    if pattern == "all-block0":  # every query selects block 0 only: one long key
        bi[:, 0, 0] = 0
    elif pattern == "everyone-block1":  # block 1 for all (past the causal limit for block-0 queries)
        bi[:, 0, 2] = 1
        bi[:, 0, 0] = torch.where(own == 1, -torch.ones_like(own), own)  # entries stay distinct
    elif pattern == "unsorted-pad-middle":  # distinct, descending, -1 between entries
        bi[:, 0, 0] = own
        bi[:, 0, 2] = (own - 2).clamp_min(-1)
        bi[:, 0, 3] = torch.where(own >= 3, torch.zeros_like(own), -torch.ones_like(own))
    elif pattern == "beyond-causal":  # half the entries name blocks after the query's own
        bi[:, 0, 0] = own + 1
        bi[:, 0, 1] = own
        bi[:, 0, 2] = own + 3
        bi[:, 0, 3] = torch.where(own == 0, torch.full_like(own, 2), torch.zeros_like(own))
    return bi[None]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pattern", ["all-block0", "everyone-block1", "unsorted-pad-middle", "beyond-causal"])
def test_adversarial_indices(impl, pattern, device):
    T, bs = 70, 16
    c = make_case(T, 1, 2, 16, 4, bs, device, block_indices=_adversarial(pattern, T, bs))
    assert_matches_reference(impl, c, device)


@pytest.mark.parametrize("impl", IMPLS)
def test_query_without_valid_block(impl, device):
    """Queries whose entries are all -1 or past the causal limit output 0 with finite gradients."""
    T, bs = 45, 16
    cu = [0, 20, 45]
    bi = _adversarial("all-block0", T, bs).clone()
    empty = torch.tensor([0, 3, 17, 21, 30, 44])
    bi[0, empty] = -1
    bi[0, 30, 0, 1] = 2  # only a block past its own: still no valid key
    c = make_case(T, 1, 3, 16, 4, bs, device, cu_seqlens=cu, block_indices=bi)
    o, dq, dk, dv = assert_matches_reference(impl, c, device)
    assert (o[0, empty.to(o.device)] == 0).all()
    assert (dq[0, empty.to(o.device)] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_is_deterministic(impl, device, monkeypatch, launch):
    """Two backward runs give bitwise equal gradients. fmsa runs with several query chunks, long
    keys split into segments and several tiles per forward program, to cover those paths."""
    kwargs = {}
    if impl == "fmsa":
        launch("fmsa", seg_tiles=1)
        launch("fmsa", fwd_tiles=2)
        launch("fmsa", bwd_bm=16)
        kwargs = {"chunk_size": 32}
    c = make_case(100, 1, 5, 16, 3, 16, device, cu_seqlens=[0, 9, 100])
    c.block_indices[..., 0] = torch.where(c.block_indices[..., 0] >= 0, c.block_indices[..., 0], 0)
    c.block_indices[..., 1:] = torch.where(c.block_indices[..., 1:] == 0, -1, c.block_indices[..., 1:])
    first = assert_matches_reference(impl, c, device, **kwargs)
    second = run(impl, c, **kwargs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk,heads", [(32, 1), (32, 3), (128, 1)],
                         ids=["chunks-per-head", "chunks-all-heads", "one-chunk-per-head"])
def test_fmsa_partitions(chunk, heads, device, monkeypatch, launch):
    """The partial buffers hold one partition (query chunk x KV heads) at a time: per KV head or
    all heads, one or several chunks, with long keys split into segments; each matches the
    reference, at HK=3 (not a power of two) and varlen. (The default, one partition of all
    heads at these sizes, is what every other test runs.)"""
    launch("fmsa", seg_tiles=1)
    launch("fmsa", bwd_bm=16)
    c = make_case(100, 3, 2, 16, 3, 16, device, cu_seqlens=[0, 9, 70, 100], seed=3)
    c.block_indices[..., 0] = torch.where(c.block_indices[..., 0] >= 0, c.block_indices[..., 0], 0)
    c.block_indices[..., 1:] = torch.where(c.block_indices[..., 1:] == 0, -1, c.block_indices[..., 1:])
    assert_matches_reference("fmsa", c, device, chunk_size=chunk, heads=heads)


@pytest.mark.parametrize("chunk,heads", [(32, 1), (128, 3)], ids=["chunks-per-head", "one-partition"])
def test_fmsa_backward_adds_to_given_dk_dv(chunk, heads, device, monkeypatch, launch):
    """Given dkv = (dk, dv) (the whole op passes the window's), fmsa's backward adds its fp32 dk/dv
    to them in the heads' last reduction and returns those very tensors: their values plus its own,
    on every token row, over several partitions and split keys."""
    launch("fmsa", seg_tiles=1)
    launch("fmsa", bwd_bm=16)
    c = make_case(100, 3, 2, 16, 3, 16, device, cu_seqlens=[0, 9, 70, 100], seed=5)
    q, k, v, do = (x.detach()[0] for x in (c.q, c.k, c.v, c.do))
    bi = c.block_indices[0]
    o, lse, state = fmsa.fmsa_forward(q, k, v, bi, c.block_size, c.cu_seqlens, c.scale, chunk_size=chunk,
                                      heads=heads)
    delta = fmsa.attention_delta(o, do)
    _, dk, dv = fmsa.fmsa_backward(q, k, v, lse, bi, state, c.scale, do, delta)
    base_k, base_v = torch.randn_like(k), torch.randn_like(v)
    dk_in, dv_in = base_k.clone(), base_v.clone()
    _, dk2, dv2 = fmsa.fmsa_backward(q, k, v, lse, bi, state, c.scale, do, delta, dkv=(dk_in, dv_in))
    assert dk2 is dk_in and dv2 is dv_in
    assert_close("dk", dk2.float(), base_k.float() + dk.float(), tolerance(device))
    assert_close("dv", dv2.float(), base_v.float() + dv.float(), tolerance(device))
    with pytest.raises(ValueError, match="dkv's dk must be a contiguous"):
        fmsa.fmsa_backward(q, k, v, lse, bi, state, c.scale, do, delta, dkv=(dk_in.transpose(0, 1), dv_in))
    with pytest.raises(ValueError, match="dkv's dv must be a contiguous"):
        fmsa.fmsa_backward(q, k, v, lse, bi, state, c.scale, do, delta, dkv=(dk_in, dv_in.double()))


def test_default_partition(monkeypatch, launch):
    """One partition with all KV heads when the sequence fits the budget; otherwise one KV head
    and the longest power-of-two chunk whose partials fit, unless all heads would take fewer
    than HK chunks; a given head count gets the longest chunk that fits; others are refused."""
    launch("fmsa", partial_budget=1 << 20)
    launch("fmsa", partial_budget_per_token=0)
    HQ, HK, S, D = 16, 4, 4, 64
    per_token_head = (HQ // HK) * S * (2 * D + 4)  # 2112 bytes: 496 tokens of one head fit, 124 of four
    assert fmsa.default_partition(100, HQ, HK, S, D) == (100, HK)
    chunk, heads = fmsa.default_partition(4096, HQ, HK, S, D)
    assert (chunk, heads) == (256, 1)
    assert chunk * per_token_head <= 1 << 20 < 2 * chunk * per_token_head
    # 150 tokens: all heads in 3 chunks of 64 (fewer than HK) rather than 4 per-head partitions
    assert fmsa.default_partition(150, HQ, HK, S, D) == (64, HK)
    assert fmsa.default_partition(4096, HQ, HK, S, D, heads=HK) == (64, HK)
    assert fmsa.default_partition(150, HQ, HK, S, D, heads=1) == (150, 1)
    assert fmsa.partition_heads(4096, HK, 256, None) == 1 and fmsa.partition_heads(200, HK, 256, None) == HK
    with pytest.raises(ValueError, match="heads per partition must be 1 or HK=3"):
        fmsa.partition_heads(100, 3, 32, 2)
    with pytest.raises(ValueError, match="heads per partition must be 1 or HK=4"):
        fmsa.default_partition(100, HQ, HK, S, D, heads=2)


@pytest.mark.parametrize("impl", IMPLS)
def test_default_per_head_partitions(impl, device, monkeypatch, launch):
    """With a partial budget small enough that ``default_partition`` picks per-head partitions
    in several chunks, both kernels (qc's backward uses fmsa's dk/dv) match the reference and
    a second backward is bitwise equal."""
    launch("fmsa", partial_budget=4 << 10)
    launch("fmsa", partial_budget_per_token=0)
    launch("fmsa", seg_tiles=1)
    launch("fmsa", bwd_bm=16)
    T, HK, G, D, S = 96, 2, 2, 16, 3
    c = make_case(T, HK, G, D, S, 16, device, cu_seqlens=[0, 40, 96], seed=5)
    # one KV head, two chunks (chunks are at least 64 tokens)
    assert fmsa.default_partition(T, HK * G, HK, S, D, c.q.element_size()) == (64, 1)
    c.block_indices[..., 0] = torch.where(c.block_indices[..., 0] >= 0, c.block_indices[..., 0], 0)
    first = assert_matches_reference(impl, c, device)
    for a, b in zip(first, run(impl, c)):
        assert torch.equal(a, b)


def test_seq_starts_helper():
    assert seq_starts(torch.tensor([0, 3, 5], dtype=torch.int32), 5).tolist() == [0, 0, 0, 3, 3]


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_index_buffer_rewritten_before_backward(impl, device):
    """A caller reusing its index buffer in place between forward and backward: the reference
    (which recomputes chunks in backward) still gives the forward's gradients; the kernels, which
    save the tensor, are refused by autograd. Never a silent mix."""
    from flash_msa import selected_attention

    T, HK, G, D, bs = 64, 1, 2, 16, 16
    q = torch.randn(1, T, HK * G, D, device=device, requires_grad=True)
    k = torch.randn(1, T, HK, D, device=device, requires_grad=True)
    v = torch.randn(1, T, HK, D, device=device, requires_grad=True)
    own = torch.arange(T, device=device) // bs
    idx = torch.stack([own, torch.where(own > 0, own - 1, -1)], -1).int()[None, :, None, :].contiguous()
    want = torch.autograd.grad(selected_attention(q, k, v, idx.clone(), block_size=bs, impl=impl).sum(), (q, k, v))
    buf = idx.clone()
    out = selected_attention(q, k, v, buf, block_size=bs, impl=impl)
    buf[..., 1] = -1
    if impl == "reference":
        for g, w in zip(torch.autograd.grad(out.sum(), (q, k, v)), want):
            assert_close("grad", g, w, tol=1e-6)
    else:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out.sum(), (q, k, v))


@pytest.mark.parametrize("shape,chunk,heads", [
    ((100, 3, 2, 16, 3, 16), 32, 1),
    ((100, 3, 5, 16, 3, 16), 128, 3),
    ((150, 1, 4, 64, 2, 64), None, None),
    ((40, 1, 16, 16, 3, 16), None, None),
], ids=["g2-chunks-per-head", "g5-one-partition", "g4-bs64-d64", "g16"])
def test_fmsa_tma_partials(shape, chunk, heads, device, monkeypatch, launch):
    """fwd_tma / bwd_tma (the forward's partials and the backward's dq parts written tile by tile
    by TMA bulk copies in key order, found by the reductions through a per-entry row index) against
    both stored row by row in entry order: the same output and gradients bit for bit, with several
    tiles per program, split keys and partitions; both match the reference."""
    T, HK, G, D, S, bs = shape
    launch("fmsa", fwd_tiles=2)
    launch("fmsa", fwd_bm=16)
    launch("fmsa", seg_tiles=2)
    launch("fmsa", bwd_bm=16)
    c = make_case(T, HK, G, D, S, bs, device, cu_seqlens=[0, 9, 70, T] if T == 100 else None, seed=7)
    kw = {} if chunk is None else dict(chunk_size=chunk, heads=heads)
    launch("fmsa", fwd_tma=False)
    launch("fmsa", bwd_tma=False)
    rows = run("fmsa", c, **kw)
    if device != "cpu" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    launch("fmsa", fwd_tma=True)
    launch("fmsa", bwd_tma=True)
    tma = assert_matches_reference("fmsa", c, device, **kw)
    for name, a, b in zip(("o", "dq", "dk", "dv"), rows, tma):
        assert torch.equal(a, b), name


def test_fmsa_tma_dq_buffer_too_small_is_refused(device):
    """With bwd_tma the dq-part buffer needs each key's rows padded to a tile: a buffer of the
    unpadded size is refused with the size it needs, before any kernel writes past it."""
    if not fmsa._tma(fmsa.LAUNCH["bwd_tma"], torch.empty(1, device=device, dtype=kernel_dtype(device))):
        pytest.skip("no TMA writes here")
    c = make_case(40, 1, 2, 16, 2, 16, device)
    q, k, v, do = (x.detach()[0] for x in (c.q, c.k, c.v, c.do))
    bi = c.block_indices[0]
    o, lse, (csr, HKG) = fmsa.fmsa_forward(q, k, v, bi, c.block_size, c.cu_seqlens, c.scale)
    delta = fmsa.attention_delta(o, do)
    rows = fmsa.partition_rows(40, csr.chunk_size, HKG, 2, csr.S)
    small = torch.empty(rows, 16, device=q.device, dtype=q.dtype)
    with pytest.raises(ValueError, match=r"dq_partial has \d+ rows; with bwd_tma it needs dq_partial_rows\(\)"):
        fmsa.fmsa_bwd_dkdv(q, k, v, do, lse, delta, csr, c.scale, small, HKG, bi, torch.empty_like(q))
