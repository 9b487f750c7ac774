"""NativeSparseAttention's ``sequence_parallel`` path in one process: each of P emulated ranks gets
the whole sequence and keeps its share of the heads (the exchanges are a slice and the identity),
so what is checked is the head split itself: gates, q/k/v and the compression parameters of the
rank's KV heads, and with fewer KV heads than ranks their replication and the group-wide block
selection (the group's queries and lse gathered from the ranks sharing a KV head: emulated by a
first pass that records each rank's). On CUDA this runs the Triton kernels (bf16); the exchanges
across processes are tested on CPU with torchrun (tests/msa_train/test_sequence_parallel.py)."""
import pytest
import torch

from flash_msa.nsa import NativeSparseAttention
from tests.helpers import assert_close


class HeadShare:
    """Rank ``rank`` of ``size`` whose inputs already hold every token: to_heads keeps its heads.
    ``seen`` collects each rank's (q, lse) of the selection; ``replay`` gathers them for the group."""

    def __init__(self, rank: int, size: int, seen: dict, replay: bool):
        self.rank, self.size, self.seen, self.replay = rank, size, seen, replay

    def to_heads(self, x, seq_dim, head_dim):
        n = x.shape[head_dim] // self.size
        return x.narrow(head_dim, self.rank * n, n)

    def kv_to_heads(self, x, seq_dim, head_dim):
        hk = x.shape[head_dim]
        return self.to_heads(x.repeat_interleave(self.size // hk, head_dim) if hk < self.size else x, seq_dim, head_dim)

    def kv_shard(self, p, dim):
        hk = p.shape[dim]
        if hk >= self.size:
            return p.narrow(dim, self.rank * (hk // self.size), hk // self.size)
        return p.narrow(dim, self.rank // (self.size // hk), 1)

    def to_sequence(self, x, seq_dim, head_dim):
        return x

    def gather_group(self, num_kv_heads):
        if num_kv_heads >= self.size:
            return None
        m = self.size // num_kv_heads
        peers = range(self.rank // m * m, self.rank // m * m + m)

        def gather(q, lse):
            if not self.replay:
                self.seen[self.rank] = (q.detach().clone(), lse.detach().clone())
                return q, lse
            return tuple(torch.cat([self.seen[r][i] for r in peers], 1) for i in (0, 1))

        return gather


# (HQ, HK, P): HK / P KV heads a rank, and KV heads replicated on 2 and 4 ranks (G = 5, 4, 8)
@pytest.mark.parametrize("HQ, HK, P", [(20, 4, 2), (20, 4, 4), (8, 2, 4), (8, 1, 4)],
                         ids=["hk4-p2", "hk4-p4", "hk2-p4-replicated", "hk1-p4-replicated"])
def test_head_shares_add_up_to_the_whole(HQ, HK, P, device):
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    D, hidden = 64 if cuda else 16, 64
    sizes = dict(cmp_block=32, cmp_stride=16, slc_block=64, slc_topk=16, window=512) if cuda else \
        dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=4, window=24)  # one block of 4 chosen
    cu = torch.tensor([0, 700, 730, 2048] if cuda else [0, 50, 60, 160], dtype=torch.int32, device=device)
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
    parts, got, seen = [], None, {}
    n = HQ // P
    if HK < P:  # the first pass records every rank's queries and lse for the group-wide selection
        with torch.no_grad():
            for r in range(P):
                nsa(x, q, k, v, cu_seqlens=cu, sequence_parallel=HeadShare(r, P, seen, replay=False))
    for r in range(P):
        o_r = nsa(x, q, k, v, cu_seqlens=cu, sequence_parallel=HeadShare(r, P, seen, replay=True))
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
