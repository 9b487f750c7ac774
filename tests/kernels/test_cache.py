"""Per-batch index metadata: computed once per cu_seqlens tensor, never stale."""
import torch

from flash_msa.compression.compress import compress_kv
from flash_msa.utils.cache import per_batch


def test_per_batch_reuses_only_the_same_unmodified_tensor():
    calls = []

    def f(cu, n):
        calls.append(n)
        return cu * n

    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    a = per_batch(f, cu, 2)
    assert per_batch(f, cu, 2) is a and calls == [2]
    assert torch.equal(per_batch(f, cu, 3), cu * 3) and calls == [2, 3]  # other static args
    assert per_batch(f, cu.clone(), 2) is not a  # an equal but different tensor
    cu[1] = 6  # modified in place: the cached value is stale
    assert torch.equal(per_batch(f, cu, 2), torch.tensor([0, 12, 18], dtype=torch.int32))


def test_layers_share_compression_metadata(device):
    cu = torch.tensor([0, 40, 100], dtype=torch.int32, device=device)
    x = torch.randn(100, 2, 16, device=device)
    w, pos = torch.randn(2, 32 * 16, 16, device=device), torch.randn(2, 32, 16, device=device)
    _, cc1 = compress_kv(x, w, pos, cu, 32, 16)
    _, cc2 = compress_kv(x, w, pos, cu, 32, 16)
    assert cc1 is cc2  # so the compressed-attention ranges keyed on it are shared too


def test_inference_tensors_are_computed_not_cached(device):
    with torch.inference_mode():
        cu = torch.tensor([0, 40, 100], dtype=torch.int32, device=device)
        x = torch.randn(100, 2, 16, device=device)
        w, pos = torch.randn(2, 32 * 16, 16, device=device), torch.randn(2, 32, 16, device=device)
        out, cc = compress_kv(x, w, pos, cu, 32, 16)
        assert out.shape == (100 // 16, 2, 16) and cc.tolist() == [0, 1, 3]


def test_dense_batch_cu_seqlens_is_one_tensor_per_shape(device):
    # cu_seqlens=None (a dense batch) gets the same cu_seqlens object per (B, T, device), so every
    # layer and call of a dense batch shares the per-batch metadata keyed on it
    from flash_msa.utils.varlen import default_cu_seqlens, flatten_batch
    x = torch.randn(2, 50, 2, 16, device=device)
    _, cu = flatten_batch(x, None)
    assert cu.tolist() == [0, 50, 100] and cu.dtype == torch.int32 and cu.device == x.device
    assert flatten_batch(x, None)[1] is cu and default_cu_seqlens(2, 50, x.device) is cu
    assert default_cu_seqlens(2, 51, x.device) is not cu  # another shape
    w, pos = torch.randn(2, 32 * 16, 16, device=device), torch.randn(2, 32, 16, device=device)
    _, cc1 = compress_kv(flatten_batch(x, None)[0], w, pos, flatten_batch(x, None)[1], 32, 16)
    _, cc2 = compress_kv(flatten_batch(x, None)[0], w, pos, flatten_batch(x, None)[1], 32, 16)
    assert cc1 is cc2 and cc1.tolist() == [0, 2, 4]
    cu.add_(0)  # written in place: the next call makes a new tensor, with the right values
    fresh = default_cu_seqlens(2, 50, x.device)
    assert fresh is not cu and fresh.tolist() == [0, 50, 100]
    with torch.inference_mode():
        inf = default_cu_seqlens(2, 50, x.device)
        assert inf.is_inference() and inf.tolist() == [0, 50, 100]
    assert default_cu_seqlens(2, 50, x.device) is fresh  # inference mode did not replace it
    others = [default_cu_seqlens(1, 10 + i, x.device) for i in range(7)]  # 8 shapes held now
    assert default_cu_seqlens(2, 50, x.device) is fresh  # a use makes it the most recent...
    default_cu_seqlens(1, 99, x.device)  # ...so the 9th shape drops the least recently used, (1, 10)
    assert default_cu_seqlens(2, 50, x.device) is fresh and default_cu_seqlens(1, 10, x.device) is not others[0]
    if x.device.type == "cuda":  # "cuda" means the current device
        assert default_cu_seqlens(2, 50, "cuda") is fresh
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # another stream: its own tensor, reused on that stream
            on_side = default_cu_seqlens(2, 50, x.device)
            assert on_side is not fresh and default_cu_seqlens(2, 50, x.device) is on_side
        torch.cuda.current_stream().wait_stream(side)
        assert on_side.tolist() == [0, 50, 100] and default_cu_seqlens(2, 50, x.device) is fresh


def test_per_batch_on_cuda_is_per_stream_and_bypassed_during_graph_capture(device):
    if device != "cuda":
        return  # CUDA streams and graphs only
    calls = []

    def f(cu):
        calls.append(1)
        return cu * 2

    cu = torch.tensor([0, 5, 9], dtype=torch.int32, device=device)
    a = per_batch(f, cu)
    assert per_batch(f, cu) is a and len(calls) == 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # another stream: its own value
        b = per_batch(f, cu)
        assert b is not a and per_batch(f, cu) is b and len(calls) == 2
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # computed during capture, neither read nor kept
        c = per_batch(f, cu)
    assert c is not a and len(calls) == 3
    cu.copy_(torch.tensor([0, 7, 9], dtype=torch.int32, device=device))
    g.replay()
    torch.cuda.synchronize()
    assert c.tolist() == [0, 14, 18]


def test_selected_attention_in_a_cuda_graph_follows_refilled_inputs(device):
    """Warm up, capture, refill cu_seqlens and the indices in place, replay: the replay must use the
    new sequence layout (a capture that hit per_batch's cache baked the warm-up's metadata in)."""
    if device != "cuda":
        return
    from flash_msa import selected_attention, trusted_inputs

    T, HK, G, D, bs = 512, 1, 4, 64, 64
    torch.manual_seed(0)
    q = torch.randn(1, T, HK * G, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, T, HK, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def indices(bounds):
        cu = torch.tensor(bounds)
        t = torch.arange(T)
        start = cu[torch.searchsorted(cu[1:], t, right=True)]
        own = (t - start) // bs
        idx = torch.stack([own, torch.where(own >= 1, own - 1, -1), torch.where(own >= 2, 0, -1)], -1)
        return idx.int().view(1, T, 1, 3).to(device)

    def cu_of(bounds):
        return torch.tensor(bounds, dtype=torch.int32, device=device)

    new = [0, 100, 300, 512]
    for impl in ("fmsa", "qc"):
        cu, idx = cu_of([0, 0, 0, T]), indices([0, 0, 0, T])
        with trusted_inputs():
            selected_attention(q, k, v, idx, block_size=bs, cu_seqlens=cu, impl=impl)  # warm-up fills the cache
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = selected_attention(q, k, v, idx, block_size=bs, cu_seqlens=cu, impl=impl)
        cu.copy_(cu_of(new))
        idx.copy_(indices(new))
        g.replay()
        torch.cuda.synchronize()
        ref = selected_attention(q.float(), k.float(), v.float(), indices(new), block_size=bs, cu_seqlens=cu_of(new),
                                 impl="reference")
        err = (out.float() - ref).abs().max().item()
        assert err < 0.05, (impl, err)
