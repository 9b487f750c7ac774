"""The Triton kernels behind the public ``selected_attention``: registration, dispatch, limits."""
import pytest
import torch

from flash_msa import selected_attention
from flash_msa.selection.fmsa import fmsa_selected_attention
from flash_msa.selection.interface import IMPLS, choose_impl
from flash_msa.utils.csr import build_selection_csr, prepare_block_meta
from tests.kernels.selection._cases import kernel_dtype, random_indices, tolerance
from tests.helpers import assert_close


def test_kernels_registered():
    assert {"fmsa", "qc", "reference"} <= set(IMPLS)


def test_auto_is_reference_without_cuda():
    q = torch.zeros(1, 8, 4, 16)
    assert choose_impl(q, q[:, :, :2], 4, 16) == "reference"


def test_auto_falls_back_for_unsupported_shapes():
    # a head dim the kernels do not support must never make "auto" raise
    q = torch.zeros(1, 8, 4, 48)
    assert choose_impl(q, q[:, :, :2], 4, 16) == "reference"


@pytest.mark.parametrize("impl", ["fmsa", "qc"])
def test_dense_batch_through_public_api(impl, device):
    """[B=2, T, H, D] without cu_seqlens: two independent sequences."""
    B, T, HK, G, D, S, bs = 2, 37, 1, 2, 16, 3, 16
    gen = torch.Generator().manual_seed(0)
    bi = torch.cat([random_indices(T, HK, S, bs, torch.tensor([0, T], dtype=torch.int32), gen=gen) for _ in range(B)])
    dtype = kernel_dtype(device)
    q = torch.randn(B, T, HK * G, D, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(B, T, HK, D, generator=gen).to(device, dtype).requires_grad_()
    v = torch.randn(B, T, HK, D, generator=gen).to(device, dtype).requires_grad_()
    o = selected_attention(q, k, v, bi.to(device), block_size=bs, impl=impl)
    o.float().square().sum().backward()
    for b in range(B):
        qb, kb, vb = (x.detach()[b:b + 1].float().requires_grad_() for x in (q, k, v))
        ob = selected_attention(qb, kb, vb, bi[b:b + 1].to(device), block_size=bs, impl="reference")
        ob.square().sum().backward()
        assert_close(f"{impl} o[{b}]", o[b:b + 1].float(), ob, tol=tolerance(device))
        for name, x, r in (("dq", q, qb), ("dk", k, kb), ("dv", v, vb)):
            assert_close(f"{impl} {name}[{b}]", x.grad[b:b + 1].float(), r.grad, tol=tolerance(device))


@pytest.mark.parametrize("impl", ["fmsa", "qc"])
@pytest.mark.parametrize("bad, match", [
    ({"D": 48}, "D \\(head dim\\) must be one of"),
    ({"S": 33}, "S \\(selected blocks per query\\) must be at most 32"),
], ids=["head-dim-48", "S-33"])
def test_kernel_limits_raise(impl, bad, match, device):
    D, S = bad.get("D", 16), bad.get("S", 2)
    q = torch.zeros(1, 16, 2, D, device=device)
    k = torch.zeros(1, 16, 1, D, device=device)
    bi = torch.full((1, 16, 1, S), -1, dtype=torch.int32, device=device)
    bi[..., 0] = 0
    with pytest.raises(ValueError, match=match):
        selected_attention(q, k, k, bi, block_size=16, impl=impl)


def test_float64_is_refused_by_kernels(device):
    q = torch.zeros(1, 16, 2, 16, dtype=torch.float64, device=device)
    k = torch.zeros(1, 16, 1, 16, dtype=torch.float64, device=device)
    bi = torch.tensor([0, -1], dtype=torch.int32, device=device).expand(1, 16, 1, 2)
    with pytest.raises(TypeError, match="q dtype must be one of"):
        selected_attention(q, k, k, bi, block_size=16, impl="fmsa")


def test_csr_groups_entries_by_block():
    """Entries of one (chunk, KV head, block) key are contiguous, in token order; invalid ones dropped."""
    cu = torch.tensor([0, 5, 40], dtype=torch.int32)
    T, HK, S, bs = 40, 2, 3, 16
    bi = random_indices(T, HK, S, bs, cu, gen=torch.Generator().manual_seed(1))[0]
    meta = prepare_block_meta(cu, T, bs)
    assert meta.num_blocks == T // bs + 2
    assert meta.block_start[:4].tolist() == [0, 5, 21, 37] and meta.block_end[:4].tolist() == [5, 21, 37, 40]
    csr = build_selection_csr(bi, meta, chunk_size=16)
    off = csr.key_offsets.tolist()
    seen = []
    for key in range(len(off) - 1):
        ids = csr.entry_ids[off[key]:off[key + 1]].long()
        t, hk, s = ids // (HK * S), (ids // S) % HK, ids % S
        chunk, rest = divmod(key, HK * meta.num_blocks)
        assert (t // 16 == chunk).all() and (hk == rest // meta.num_blocks).all()
        assert (meta.tok_block0[t] + bi[t, hk, s] == rest % meta.num_blocks).all()
        assert (t[1:] >= t[:-1]).all()
        seen += ids.tolist()
    own = (torch.arange(T) - torch.tensor([0] * 5 + [5] * 35)) // bs
    valid = (bi >= 0) & (bi <= own[:, None, None])
    assert sorted(seen) == valid.flatten().nonzero().flatten().tolist()


@pytest.mark.parametrize("local", [0, 2])
@pytest.mark.parametrize("short", [False, True])
def test_entry_keys_kernel_matches_torch(local, short, device):
    """The CSR's sort keys from its Triton kernel equal the PyTorch form, bit for bit: varlen with
    a sequence shorter than a block, -1 entries, entries past the causal limit, the local blocks
    left out, int32 and int16 keys, several chunks."""
    from flash_msa.utils import csr as csr_mod
    cu = torch.tensor([0, 5, 40, 107], dtype=torch.int32, device=device)
    T, HK, S, bs = 107, 3, 4, 16
    bi = random_indices(T, HK, S, bs, cu.cpu(), gen=torch.Generator().manual_seed(4))[0].to(device)
    meta = prepare_block_meta(cu, T, bs)
    got = csr_mod.entry_keys(bi, meta, 32, local, short)
    want = csr_mod.entry_keys_torch(bi, meta, 32, local, short)
    assert got.dtype == want.dtype == (torch.int16 if short else torch.int32)
    assert torch.equal(got, want)
    num_keys = 4 * HK * meta.num_blocks
    assert (want == (num_keys - (1 << 15) if short else num_keys)).any()  # some entries invalid


@pytest.mark.parametrize("T,HK,chunk", [(40, 2, 16), (69888, 5, 23296)])
def test_csr_int16_keys_match_int32(monkeypatch, T, HK, chunk):
    """The CSR sorts int16 keys when they fit; the int32 sort gives the same index. The second case
    has 3 * 5 * 4369 = 65535 keys, the most that fit (the invalid mark is then 2^15 - 1)."""
    from flash_msa.utils import csr as csr_mod
    cu = torch.tensor([0, T], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    # blocks up to 2 past the causal limit, -1 in a quarter of the slots (duplicates do not matter here)
    bi = (torch.rand(T, HK, 2, generator=gen) * (torch.arange(T)[:, None, None] // 16 + 3)).int()
    bi[torch.rand(T, HK, 2, generator=gen) < 0.25] = -1
    meta = prepare_block_meta(cu, T, 16)
    short = build_selection_csr(bi, meta, chunk_size=chunk)
    assert short.num_chunks * HK * meta.num_blocks < csr_mod.SHORT_KEYS_BELOW
    monkeypatch.setattr(csr_mod, "SHORT_KEYS_BELOW", 0)
    wide = build_selection_csr(bi, meta, chunk_size=chunk)
    assert torch.equal(short.key_offsets, wide.key_offsets) and torch.equal(short.entry_ids, wide.entry_ids)
    assert short.key_offsets[-1] < T * HK * 2  # some entries invalid (sorted past the last key)
    assert short.key_offsets.dtype == torch.int32 and short.entry_ids.dtype == torch.int32


def test_block_meta_is_shared_until_cu_seqlens_changes():
    from flash_msa.utils.csr import get_block_meta
    cu = torch.tensor([0, 5, 40], dtype=torch.int32)
    first = get_block_meta(cu, 40, 16)
    assert get_block_meta(cu, 40, 16) is first
    assert get_block_meta(cu, 40, 32) is not first
    cu[1] = 7  # in-place change: a new version, so the cached metadata must not be reused
    assert get_block_meta(cu, 40, 16).tok_start[6].item() == 0
    assert get_block_meta(cu.clone(), 40, 16) is not first


def test_chunk_with_too_many_partial_rows_is_refused():
    """The kernels index a partition's partial rows (chunk * KV heads of the partition * G * S,
    here all heads as the chunk covers T) in int32: a chunk_size that
    would overflow them raises before anything is allocated (meta tensors: no memory)."""
    T, HQ, HK, D, S = 1 << 21, 64, 4, 64, 32
    q = torch.empty(1, T, HQ, D, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, T, HK, D, device="meta", dtype=torch.bfloat16)
    bi = torch.empty(1, T, HK, S, device="meta", dtype=torch.int32)
    cu = torch.empty(2, device="meta", dtype=torch.int32)
    with pytest.raises(ValueError, match="chunk_size"):
        fmsa_selected_attention(q, k, k, bi, 64, cu, D ** -0.5, chunk_size=T)
