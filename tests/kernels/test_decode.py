"""NSA decoding (flash_msa/decode.py): the rows of the last Tq queries equal the whole-sequence op's."""
import pytest
import torch

from flash_msa import NativeSparseAttention

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
    from flash_msa.decode import _block_scores

    for Tk in (block - 1, block, 300, 1000):
        Nc = max(0, (Tk - block) // stride + 1)
        n_blocks = -(-Tk // slc_block)
        p = torch.rand(3, 2, Nc, dtype=torch.float64)
        want = p @ block_overlap(Nc, n_blocks, block, stride, slc_block, "cpu", torch.float64)
        got = _block_scores(p, n_blocks, block // stride, slc_block // stride)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
