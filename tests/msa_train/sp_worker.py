"""Run by test_sequence_parallel.py under torchrun (gloo, CPU): sequence-parallel attention on P
ranks against the same attention on the whole sequence in each process.

Every rank builds the same inputs and module (same seed), computes the whole-sequence result and
its gradients, then the sequence-parallel one on its shard of the tokens. The output and the
input gradients must equal the whole-sequence ones on the rank's tokens, and the parameter
gradients summed over the ranks the whole-sequence ones.
"""
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from flash_msa.nsa import NativeSparseAttention
from msa_train.models.attention import full_attention_forward
from msa_train.parallel.sequence import SP_ATTR, build_layout

# SP_DEVICE=cuda (one GPU per rank, NCCL, bf16, the Triton kernels through impl="auto"): the
# check on the H200s; the default is the CPU test (gloo, fp32, the PyTorch reference)
CUDA = os.environ.get("SP_DEVICE", "cpu") == "cuda"
TOL = dict(rtol=1e-4, atol=1e-5)
RMS_TOL = 2e-2  # bf16 on CUDA: relative RMS error


def check(name, got, want):
    got, want = got.float(), want.float()
    err = (got - want).abs().max().item()
    if CUDA:
        rms = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        ok = rms <= RMS_TOL
        err_s = f"rel RMS {rms:.2e}, max abs {err:.2e}"
    else:
        ok = torch.allclose(got, want, **TOL)
        err_s = f"max abs err {err:.2e}"
    print(f"rank {dist.get_rank()} {name}: {err_s} {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def main() -> int:
    dist.init_process_group("nccl" if CUDA else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    if CUDA:
        torch.cuda.set_device(dev)
    sp = build_layout(world, rank, world).sp
    torch.manual_seed(0)
    if CUDA:  # NSA's defaults on Llama-3-like heads, 4K tokens
        T, HQ, HK, D, hidden = 4096, 8 * world, 2 * world, 128, 256
        sizes = dict(cmp_block=32, cmp_stride=16, slc_block=64, slc_topk=16, window=512)
        cu = torch.tensor([0, 1000, 1000 + 8 * world, T - 700, T], dtype=torch.int32)
    else:
        T, HQ, HK, D, hidden = 96 * world, 4 * world, 2 * world, 16, 32
        sizes = dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=3, window=24)
        cu = torch.tensor([0, 37, 37 + 2 * world, T - 20, T], dtype=torch.int32)  # varlen, a short document
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = torch.randn(1, T, hidden).to(dev, dtype)
    q, k, v = (torch.randn(1, T, h, D).to(dev, dtype) for h in (HQ, HK, HK))
    w = torch.randn(1, T, HQ, D).to(dev, dtype)  # weights of the scalar loss
    cu = cu.to(dev)
    nsa = NativeSparseAttention(hidden, HQ, HK, D, impl="auto" if CUDA else "reference", **sizes).to(dev, dtype)
    with torch.no_grad():  # non-trivial gates and compression
        nsa.gate.weight.normal_(std=0.2)
        nsa.compress_k.proj.normal_(std=0.1)
        nsa.compress_v.proj.normal_(std=0.1)
    ok = True

    # NSA: whole sequence here, then sequence parallel
    xf, qf, kf, vf = leaves(x, q, k, v)
    of = nsa(xf, qf, kf, vf, cu_seqlens=cu)
    (of * w).sum().backward()
    pgrads = {n: p.grad.clone() for n, p in nsa.named_parameters()}
    nsa.zero_grad()
    xs, qs, ks, vs = leaves(*(sp.shard(t, 1) for t in (x, q, k, v)))
    os_ = nsa(xs, qs, ks, vs, cu_seqlens=cu, sequence_parallel=sp)
    (os_ * sp.shard(w, 1)).sum().backward()
    ok &= check("nsa o", os_, sp.shard(of, 1))
    for n, a, b in (("x", xs, xf), ("q", qs, qf), ("k", ks, kf), ("v", vs, vf)):
        ok &= check(f"nsa d{n}", a.grad, sp.shard(b.grad, 1))
    for n, p in nsa.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=sp.group)
        ok &= check(f"nsa d({n})", g, pgrads[n])

    # dense varlen attention (msa_full): HF layout [B, H, T, D]
    module = SimpleNamespace(**{SP_ATTR: None})
    qf, kf, vf = leaves(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    of, _ = full_attention_forward(module, qf, kf, vf, scaling=D ** -0.5, cu_seq_lens_q=cu)
    (of * w).sum().backward()
    setattr(module, SP_ATTR, sp)
    qs, ks, vs = leaves(*(sp.shard(t, 2) for t in (qf, kf, vf)))
    os_, _ = full_attention_forward(module, qs, ks, vs, scaling=D ** -0.5, cu_seq_lens_q=cu)
    (os_ * sp.shard(w, 1)).sum().backward()
    ok &= check("full o", os_, sp.shard(of, 1))
    for n, a, b in (("q", qs, qf), ("k", ks, kf), ("v", vs, vf)):
        ok &= check(f"full d{n}", a.grad, sp.shard(b.grad, 2))

    # a KV-head count that does not split over the ranks is refused, naming it (3 KV heads on 2 ranks)
    if world == 2:
        bad = NativeSparseAttention(hidden, 9, 3, D, impl="reference", **sizes).to(dev, dtype)
        n = T // world
        try:
            bad(xs.detach(), *(torch.randn(1, n, h, D, device=dev, dtype=dtype) for h in (9, 3, 3)),
                cu_seqlens=cu, sequence_parallel=sp)
            print(f"rank {rank} uneven heads: no error MISMATCH", flush=True)
            ok = False
        except ValueError as e:
            print(f"rank {rank} uneven heads: {e}", flush=True)
            ok &= "num_kv_heads (3)" in str(e)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
