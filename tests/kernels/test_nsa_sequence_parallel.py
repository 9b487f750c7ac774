"""NativeSparseAttention's ``sequence_parallel`` path in one process: each of P emulated ranks gets
the whole sequence and keeps its share of the heads (the exchanges are a slice and the identity),
so what is checked is the head split itself: gates, q/k/v and the compression parameters of the
rank's KV heads. On CUDA this runs the Triton kernels (bf16); the exchanges across processes are
tested on CPU with torchrun (tests/msa_train/test_sequence_parallel.py)."""
import pytest
import torch

from flash_msa.nsa import NativeSparseAttention
from tests.helpers import assert_close


class HeadShare:
    """Rank ``rank`` of ``size`` whose inputs already hold every token: to_heads keeps its heads."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def to_heads(self, x, seq_dim, head_dim):
        n = x.shape[head_dim] // self.size
        return x.narrow(head_dim, self.rank * n, n)

    def to_sequence(self, x, seq_dim, head_dim):
        return x


@pytest.mark.parametrize("P", [2, 4])
def test_head_shares_add_up_to_the_whole(P, device):
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    HQ, HK, D, hidden = 5 * 4, 4, 64 if cuda else 16, 64
    sizes = dict(cmp_block=32, cmp_stride=16, slc_block=64, slc_topk=16, window=512) if cuda else \
        dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=3, window=24)
    cu = torch.tensor([0, 700, 730, 2048] if cuda else [0, 50, 60, 128], dtype=torch.int32, device=device)
    T = int(cu[-1])
    nsa = NativeSparseAttention(hidden, HQ, HK, D, impl="auto", **sizes).to(device, dtype)
    with torch.no_grad():
        nsa.gate.weight.normal_(std=0.2)
        nsa.compress_k.proj.normal_(std=0.1)
        nsa.compress_v.proj.normal_(std=0.1)
    x = torch.randn(1, T, hidden, device=device, dtype=dtype, requires_grad=True)
    q, k, v = (torch.randn(1, T, h, D, device=device, dtype=dtype, requires_grad=True) for h in (HQ, HK, HK))
    w = torch.randn(1, T, HQ, D, device=device, dtype=dtype)
    o = nsa(x, q, k, v, cu_seqlens=cu)
    want = torch.autograd.grad((o.float() * w.float()).sum(), (x, q, k, v, *nsa.parameters()))
    parts, got = [], None
    n = HQ // P
    for r in range(P):
        o_r = nsa(x, q, k, v, cu_seqlens=cu, sequence_parallel=HeadShare(r, P))
        parts.append(o_r)
        g = torch.autograd.grad((o_r.float() * w[:, :, r * n:(r + 1) * n].float()).sum(),
                                (x, q, k, v, *nsa.parameters()), allow_unused=True)
        g = [torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, (x, q, k, v, *nsa.parameters()))]
        got = g if got is None else [a + b for a, b in zip(got, g)]
    tol = 1e-2 if cuda else 1e-5
    assert_close("o", torch.cat(parts, 2).float(), o.float(), tol=tol)
    names = ["x", "q", "k", "v", *(name for name, _ in nsa.named_parameters())]
    for name, a, b in zip(names, got, want):
        assert_close(f"d{name}", a.float(), b.float(), tol=tol)
