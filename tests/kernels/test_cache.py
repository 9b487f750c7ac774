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
