"""NSA decoding (flash_msa/decode/): the rows of the last Tq queries equal the whole-sequence op's, and
the Triton kernel (decode/kernel.py, under TRITON_INTERPRET=1 on CPU) equals the PyTorch path."""
import pytest
import torch

from flash_msa import NativeSparseAttention
from flash_msa.decode import DecodeCache, compressed_kv, nsa_decode

SIZES = dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=4, window=24)


def _module(HQ, HK, D, hidden=32, dtype=torch.float64, **sizes):
    torch.manual_seed(0)
    nsa = NativeSparseAttention(hidden, HQ, HK, D, impl="reference", dtype=dtype, **{**SIZES, **sizes})
    with torch.no_grad():  # gates and phi away from their initial symmetric values
        for p in nsa.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return nsa


@pytest.mark.parametrize("B, Tk, Tq, HQ, HK, D", [
    (1, 100, 1, 4, 2, 16),     # decoding one token, mid-block
    (2, 96, 1, 5, 1, 16),      # G=5, Tk on a block edge
    (2, 77, 9, 6, 2, 8),       # several new tokens (chunked prefill), they span a block edge
    (1, 12, 1, 2, 2, 8),       # shorter than one compression block: no compressed token yet
    (1, 40, 40, 4, 4, 8),      # Tq = Tk: the prefill itself
    (3, 200, 3, 16, 1, 8),     # G=16, more blocks than topk, many candidates
], ids=["one", "g5-edge", "chunk", "short", "prefill", "g16"])
def test_decode_rows_equal_the_whole_sequence(B, Tk, Tq, HQ, HK, D):
    nsa = _module(HQ, HK, D)
    torch.manual_seed(1)
    hidden = torch.randn(B, Tk, 32, dtype=torch.float64)
    q = torch.randn(B, Tk, HQ, D, dtype=torch.float64)
    k, v = torch.randn(2, B, Tk, HK, D, dtype=torch.float64)
    with torch.no_grad():
        whole = nsa(hidden, q, k, v)[:, Tk - Tq:]
        rows = nsa.decode(hidden[:, Tk - Tq:], q[:, Tk - Tq:], k, v)
    assert rows.shape == (B, Tq, HQ, D)
    # the branches agree to fp64 rounding; the gated sum runs in fp32 in both (as in training)
    torch.testing.assert_close(rows, whole, rtol=1e-6, atol=1e-7)


def test_decode_fp32_and_steps():
    """Token by token, as generation runs it, in fp32."""
    nsa = _module(8, 2, 16, dtype=torch.float32, cmp_block=32, cmp_stride=16, slc_block=32, slc_topk=3, window=40)
    torch.manual_seed(2)
    T = 150
    hidden, q = torch.randn(1, T, 32), torch.randn(1, T, 8, 16)
    k, v = torch.randn(2, 1, T, 2, 16)
    with torch.no_grad():
        whole = nsa(hidden, q, k, v)
        steps = torch.cat([nsa.decode(hidden[:, t:t + 1], q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1])
                           for t in range(90, T)], dim=1)
    torch.testing.assert_close(steps, whole[:, 90:], rtol=2e-5, atol=2e-5)


def test_decode_errors():
    nsa = _module(4, 2, 8)
    q = torch.randn(1, 3, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="need 1 <= Tq <= Tk, got Tq=3"):
        nsa.decode(torch.randn(1, 3, 32, dtype=torch.float64), q, k, k)
    with pytest.raises(ValueError, match="hidden_states must have shape"):
        nsa.decode(torch.randn(1, 2, 32, dtype=torch.float64), q, torch.cat([k, k], 1), torch.cat([k, k], 1))


@pytest.mark.parametrize("block, stride, slc_block", [(32, 16, 64), (16, 8, 16), (64, 16, 32), (32, 32, 128)])
def test_block_scores_equal_the_overlap_matrix(block, stride, slc_block):
    """The O(Nc) strided window equals the reference's [Nc, n_blocks] overlap matrix."""
    from flash_msa.compression.naive import block_overlap
    from flash_msa.decode.naive import _block_scores

    for Tk in (block - 1, block, 300, 1000):
        Nc = max(0, (Tk - block) // stride + 1)
        n_blocks = -(-Tk // slc_block)
        p = torch.rand(3, 2, Nc, dtype=torch.float64)
        want = p @ block_overlap(Nc, n_blocks, block, stride, slc_block, "cpu", torch.float64)
        got = _block_scores(p, n_blocks, block // stride, slc_block // stride)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _decode_inputs(nsa, B, Tk, Tq, seed=0):
    torch.manual_seed(seed)
    HQ, HK, D = nsa.num_heads, nsa.num_kv_heads, nsa.head_dim
    dtype, dev = nsa.gate.weight.dtype, nsa.gate.weight.device
    q = torch.randn(B, Tq, HQ, D).to(dev, dtype)
    k, v = torch.randn(2, B, HK, Tk, D).to(dev, dtype).transpose(2, 3)  # HF's cache layout, read in place
    gates = nsa._gates(torch.randn(B, Tq, 32).to(dev, dtype), q)
    phi = [(m.weight, m.pos, m.proj) for m in (nsa.compress_k, nsa.compress_v)]
    return q, k, v, gates, phi


def _rel_rms(a, b):
    return ((a.double() - b.double()).pow(2).mean() / b.double().pow(2).mean()).sqrt().item()


DEFAULTS = dict(cmp_block=32, cmp_stride=16, slc_block=64, slc_topk=16, window=512)


def _kernel_module(device, HQ, HK, D, **sizes):
    """fp32 in Triton's CPU interpreter (tests/conftest.py sets it without CUDA); bf16 on a GPU, where
    fp32 matmuls would run in TF32. Returns the module and the tolerance of the kernel's rows
    against the PyTorch path's on the same inputs (relative RMS)."""
    if device == "cuda":
        return _module(HQ, HK, D, dtype=torch.float32, **sizes).to(device, torch.bfloat16), 5e-3
    return _module(HQ, HK, D, dtype=torch.float32, **sizes), 1e-5


@pytest.mark.parametrize("B, Tk, Tq, HQ, HK, D, sizes", [
    (1, 300, 1, 4, 2, 16, {}),                    # mid-block, more blocks than topk
    (2, 96, 1, 5, 1, 16, {}),                     # G=5, Tk on a block edge
    (2, 77, 9, 6, 2, 8, {}),                      # several new tokens spanning a block edge; D=8 padded to 16
    (1, 12, 1, 2, 2, 16, {}),                     # shorter than one compression block: no compressed row
    (1, 40, 40, 3, 1, 16, {}),                    # Tq = Tk, G=3
    (3, 200, 2, 16, 1, 16, {}),                   # G=16
    (1, 1100, 1, 8, 2, 32, DEFAULTS),             # the NSA defaults: 18 blocks, two score windows of 15
    (1, 2000, 2, 4, 1, 24, dict(DEFAULTS, window=100, slc_topk=5)),  # D=24, a window not a multiple of 64
], ids=["one", "g5-edge", "chunk-d8", "short", "prefill-g3", "g16", "defaults", "d24-w100"])
def test_triton_decode_equals_pytorch(device, B, Tk, Tq, HQ, HK, D, sizes):
    nsa, tol = _kernel_module(device, HQ, HK, D, **sizes)
    q, k, v, gates, (kc, vc) = _decode_inputs(nsa, B, Tk, Tq, seed=B * Tk + Tq)
    args = dict(scale=None, **nsa.sizes)
    with torch.no_grad():
        want = nsa_decode(q, k, v, gates, kc, vc, impl="torch", **args)
        got = nsa_decode(q, k, v, gates, kc, vc, impl="triton", **args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _rel_rms(got, want) < tol


def test_triton_decode_splits_agree(device):
    """Steps 1 and 2 split the compressed rows and the score windows over programs: one split, a few
    and one per row chunk / window give the same rows, and the reference's."""
    from flash_msa.decode.kernel import nsa_decode_triton

    nsa, tol = _kernel_module(device, 8, 2, 32, **dict(DEFAULTS, window=200))
    q, k, v, gates, (kc, vc) = _decode_inputs(nsa, 1, 3000, 2)
    with torch.no_grad():
        rows, vrows = compressed_kv(k, v, kc, vc, 32, 16)
        want = nsa_decode(q, k, v, gates, kc, vc, impl="torch", **nsa.sizes)
        # 186 compressed rows in 3 chunks of 64 over 1, 2, 3 splits; 47 blocks in 4 windows over 1, 2, 4
        outs = [nsa_decode_triton(q, k, v, gates, rows, vrows, scale=nsa.head_dim ** -0.5, target_programs=n,
                                  **nsa.sizes) for n in (1, 8, 10 ** 4)]
    for got in outs:
        assert _rel_rms(got, want) < tol
    assert _rel_rms(outs[0], outs[2]) < tol


def test_triton_decode_ties_go_to_the_lower_block(device, monkeypatch):
    """q = 0: every compressed score is 0, so blocks tie on their overlap shares and the top-n is
    decided by the tie rule alone; the kernel's int64 keys must pick the reference's blocks."""
    import flash_msa.decode.naive as naive

    nsa, tol = _kernel_module(device, 4, 1, 16, cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=5, window=8)
    q, k, v, gates, (kc, vc) = _decode_inputs(nsa, 2, 250, 3)
    q = torch.zeros_like(q)
    with torch.no_grad():
        want = nsa_decode(q, k, v, gates, kc, vc, impl="torch", **nsa.sizes)
        got = nsa_decode(q, k, v, gates, kc, vc, impl="triton", **nsa.sizes)
        # the test can tell: with ties going to the higher block the rows differ
        lower_first = naive.top_blocks
        monkeypatch.setattr(naive, "top_blocks", lambda score, own, topk: lower_first(
            score + 1e-6 * torch.arange(score.shape[-1], dtype=score.dtype, device=score.device), own, topk))
        other = nsa_decode(q, k, v, gates, kc, vc, impl="torch", **nsa.sizes)
    assert _rel_rms(got, want) < tol
    assert _rel_rms(other, want) > 4 * tol


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_decode_cache_extends_the_compressed_rows(device, impl, monkeypatch):
    """Token by token with a DecodeCache: the rows without one, and the cache holds the rows of every
    completed compression block; for fewer tokens it keeps their rows, for another batch it starts anew."""
    nsa, tol = _kernel_module(device, 4, 2, 16, cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=4, window=24)
    q, k, v, gates, (kc, vc) = _decode_inputs(nsa, 2, 72, 9)
    cache = DecodeCache()
    with torch.no_grad():
        for j in range(9):  # Tk = 64 .. 72: blocks complete at Tk = 64 and 72
            Tk = 64 + j
            one = dict(q=q[:, j:j + 1], k=k[:, :Tk], v=v[:, :Tk], gates=gates[:, j:j + 1], k_cmp=kc, v_cmp=vc)
            got = nsa_decode(**one, cache=cache, impl=impl, **nsa.sizes)
            want = nsa_decode(**one, impl="torch", **nsa.sizes)  # no cache
            assert _rel_rms(got, want) < tol
            assert cache.rows == (Tk - 16) // 8 + 1
        full = cache.k_cmp.clone()
        nsa_decode(q[:, :1], k[:, :40], v[:, :40], gates[:, :1], kc, vc, cache=cache, impl=impl, **nsa.sizes)
        assert cache.rows == (40 - 16) // 8 + 1  # a cropped cache: the rows of the keys left
        assert torch.equal(cache.k_cmp, full[:, :cache.rows])
        nsa_decode(q[:1, :1], k[:1, :40], v[:1, :40], gates[:1, :1], kc, vc, cache=cache, impl=impl, **nsa.sizes)
        assert cache.rows == (40 - 16) // 8 + 1 and cache.k_cmp.shape[0] == 1  # one sequence: anew
    import flash_msa.decode

    monkeypatch.setattr(flash_msa.decode, "FEW_ROWS", 0)  # all at once by the training path's phi
    rows, _ = compressed_kv(k, v, kc, vc, 16, 8)
    assert _rel_rms(full, rows) < tol  # grown block by block = computed at once


def test_decode_impl_errors(monkeypatch):
    nsa = _module(4, 2, 16, dtype=torch.float32)
    q, k, v, gates, (kc, vc) = _decode_inputs(nsa, 1, 40, 1)
    with pytest.raises(ValueError, match="impl must be one of"):
        nsa_decode(q, k, v, gates, kc, vc, impl="cuda", **nsa.sizes)
    with pytest.raises(TypeError, match="impl='triton' takes float16, bfloat16 or float32"):
        nsa_decode(q.double(), k.double(), v.double(), gates, kc, vc, impl="triton", **nsa.sizes)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors"):
        nsa_decode(q, k, v, gates, kc, vc, impl="triton", **nsa.sizes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="5 GB of keys: on a GPU")
def test_triton_decode_addresses_past_2_to_the_31():
    """32 KV heads of 600K keys in HF's layout put the last head's keys past 2^31 elements from the
    start: its rows must equal those of a call on that head alone (a wrapped int32 offset would fault
    or read another head)."""
    from flash_msa.decode.kernel import nsa_decode_triton

    torch.manual_seed(7)
    B, Tk, HK, D = 1, 600_000, 32, 128
    q = torch.randn(B, 1, HK, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, HK, Tk, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    kc, vc = (torch.randn(B, (Tk - 32) // 16 + 1, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gates = torch.rand(B, 1, HK, 3, device="cuda")
    args = dict(scale=D ** -0.5, **DEFAULTS)
    with torch.no_grad():
        # one split each (32 and 1 programs), so the two compute the head's rows in the same order
        every = nsa_decode_triton(q, k, v, gates, kc, vc, target_programs=HK, **args)
        last = nsa_decode_triton(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], gates[:, :, -1:], kc[:, :, -1:],
                                 vc[:, :, -1:], target_programs=1, **args)
    torch.testing.assert_close(every[:, :, -1:], last, rtol=0, atol=0)
