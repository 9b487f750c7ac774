"""Run by test_sequence_parallel.py under torchrun (gloo, CPU): sequence-parallel attention and a
whole model on P ranks against the same computation on the whole sequence in each process.

Every rank builds the same inputs and module (seeded by its data-parallel rank, so the SP groups
of a 2 x 2 layout get different data), computes the whole-sequence result and its gradients, then
the sequence-parallel one on its shard of the tokens. The output and the input gradients must
equal the whole-sequence ones on the rank's tokens, and the parameter gradients summed over the SP
group the whole-sequence ones. The packed documents cross the ranks' token boundaries.

Cases on 4 ranks (``CASES``): SP 2 x DP 2 and SP 4, with HK / P KV heads a rank and with KV heads
replicated (2 KV heads at SP 4; 1 at SP 4), for NSA and dense attention (``attention=full``);
then a 2-layer Llama (4 query, 2 KV heads) at SP 4, loss and every parameter gradient, both
attentions; and a degree that neither divides nor is a multiple of the KV heads is refused.
"""
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from flash_msa.nsa import NativeSparseAttention
from msa_train.models.attention import full_attention_forward
from msa_train.parallel.sequence import SP_ATTR, build_layout, head_layout

# SP_DEVICE=cuda (one GPU per rank, NCCL, bf16, the Triton kernels through impl="auto"): the
# check on the H200s; the default is the CPU test (gloo, fp32, the PyTorch reference)
CUDA = os.environ.get("SP_DEVICE", "cpu") == "cuda"
TOL = dict(rtol=1e-4, atol=1e-5)
RMS_TOL = 2e-2  # bf16 on CUDA: relative RMS error
# (sp_degree, HQ, HK): the world is 4 ranks (2 on the 2-rank run: the first case alone)
CASES = [(2, 4, 2), (4, 8, 4), (4, 8, 2), (4, 4, 1)]


def say(line: str) -> None:
    # one write per line: the 4 ranks share the launcher's stdout pipe, and a print's separate
    # newline write lets their lines interleave
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def check(tag, name, got, want):
    got, want = got.float(), want.float()
    err = (got - want).abs().max().item()
    if CUDA:
        rms = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        ok = rms <= RMS_TOL
        err_s = f"rel RMS {rms:.2e}, max abs {err:.2e}"
    else:
        ok = torch.allclose(got, want, **TOL)
        err_s = f"max abs err {err:.2e}"
    say(f"rank {dist.get_rank()} {tag} {name}: {err_s} {'ok' if ok else 'MISMATCH'}")
    return ok


def leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def summed(sp, g):
    g = g.clone()
    dist.all_reduce(g, group=sp.group)
    return g


def attention_case(layout, HQ, HK, dev, dtype) -> bool:
    sp, P = layout.sp, layout.sp.size
    tag = f"sp{P}-dp{layout.dp_size}-hq{HQ}-hk{HK}"
    torch.manual_seed(layout.dp_rank)
    if CUDA:  # NSA's defaults on Llama-3-like heads, 4K tokens
        T, D, hidden = 4096, 128, 256
        sizes = dict(cmp_block=32, cmp_stride=16, slc_block=64, slc_topk=16, window=512)
        cu = torch.tensor([0, 1000, 1000 + 8 * P, T - 700, T], dtype=torch.int32)
    else:  # 4 documents, one short; shards of T / P = 320 / P tokens; one block of 5 chosen
        T, D, hidden = 320, 16, 32
        sizes = dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=5, window=24)
        cu = torch.tensor([0, 37, 45, T - 90, T], dtype=torch.int32)
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
    ok &= check(tag, "nsa o", os_, sp.shard(of, 1))
    for n, a, b in (("x", xs, xf), ("q", qs, qf), ("k", ks, kf), ("v", vs, vf)):
        ok &= check(tag, f"nsa d{n}", a.grad, sp.shard(b.grad, 1))
    for n, p in nsa.named_parameters():
        ok &= check(tag, f"nsa d({n})", summed(sp, p.grad), pgrads[n])

    # dense varlen attention (msa_full): HF layout [B, H, T, D]
    module = SimpleNamespace(**{SP_ATTR: None})
    qf, kf, vf = leaves(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    of, _ = full_attention_forward(module, qf, kf, vf, scaling=D ** -0.5, cu_seq_lens_q=cu)
    (of * w).sum().backward()
    setattr(module, SP_ATTR, sp)
    qs, ks, vs = leaves(*(sp.shard(t, 2) for t in (qf, kf, vf)))
    os_, _ = full_attention_forward(module, qs, ks, vs, scaling=D ** -0.5, cu_seq_lens_q=cu)
    (os_ * sp.shard(w, 1)).sum().backward()
    ok &= check(tag, "full o", os_, sp.shard(of, 1))
    for n, a, b in (("q", qs, qf), ("k", ks, kf), ("v", vs, vf)):
        ok &= check(tag, f"full d{n}", a.grad, sp.shard(b.grad, 2))
    return ok


def model_case(layout, attention: str, dev, dtype) -> bool:
    """A 2-layer Llama with 4 query and 2 KV heads (each KV head on 2 of the 4 ranks): the summed
    next-token loss and every parameter gradient, SP against the whole sequence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from msa_train.models import patch_model
    from msa_train.models.causal_lm import CausalLMWithLoss
    from msa_train.parallel.sequence import attach

    sp, tag = layout.sp, f"model-sp{layout.sp.size}-{attention}"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    lm = patch_model(LlamaForCausalLM(config), dict(name=attention, cmp_block=16, cmp_stride=8, slc_block=16,
                                                    slc_topk=5, window=24)).to(dev, dtype)
    for m in lm.modules():
        if hasattr(m, "nsa"):
            with torch.no_grad():
                m.nsa.gate.weight.normal_(std=0.2)
                m.nsa.compress_k.proj.normal_(std=0.1)
    model = CausalLMWithLoss(lm, chunk_tokens=64)
    T = 256
    cu = torch.tensor([0, 70, 75, 200, T], dtype=torch.int32, device=dev)  # documents across the shards
    ids = torch.randint(0, 64, (1, T), device=dev)
    pos = torch.cat([torch.arange(int(e - s)) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])[None].to(dev)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100, device=dev)], 1)
    targets[:, cu[1:].long() - 1] = -100  # no target across a document's end
    kw = dict(cu_seqlens=cu, max_seqlen=125)
    loss = model(ids, pos, targets, **kw)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    attach(lm, sp)
    part = model(sp.shard(ids, 1), sp.shard(pos, 1), sp.shard(targets, 1), **kw)
    part.backward()
    ok = check(tag, "loss", summed(sp, part.detach()), loss.detach())
    for n, p in model.named_parameters():
        ok &= check(tag, f"d({n})", summed(sp, p.grad), want[n])
    return ok


def stopped_rank_main() -> int:
    """``sp_worker.py stopped``: SP 2 x DP 2 with a 3 s collective timeout on the SP groups; rank 3
    stops (sleeps) instead of joining its group's all-to-all, so rank 2's must fail within the
    timeout, not wait for the default process group's 30 minutes."""
    import datetime
    import time

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sp = build_layout(2, rank, dist.get_world_size(), timeout=datetime.timedelta(seconds=3)).sp
    if rank == 3:
        time.sleep(120)
        return 0
    t0 = time.perf_counter()
    try:
        sp.to_heads(torch.randn(1, 8, 4, 2), seq_dim=1, head_dim=2)
    except RuntimeError as e:
        say(f"rank {rank} timed out after {time.perf_counter() - t0:.1f} s: {str(e).splitlines()[0][:200]}")
        return 3  # the launcher then ends the other ranks
    say(f"rank {rank} exchanged")
    time.sleep(60)  # keep the store's host (rank 0) up until rank 2 has timed out
    return 0


def main() -> int:
    if sys.argv[1:] == ["stopped"]:
        return stopped_rank_main()
    dist.init_process_group("nccl" if CUDA else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    if CUDA:
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if CUDA else torch.float32
    ok = True
    layouts = {}
    for P, HQ, HK in CASES:
        if world % P:
            continue
        if P not in layouts:
            layouts[P] = build_layout(P, rank, world)
        ok &= attention_case(layouts[P], HQ, HK, dev, dtype)
    if world == 4:
        for attention in ("nsa", "full"):
            ok &= model_case(layouts[4], attention, dev, dtype)
        try:  # 3 KV heads at SP 4: neither divides the other
            head_layout(12, 3, 4)
            say(f"rank {rank} uneven heads: no error MISMATCH")
            ok = False
        except ValueError as e:
            say(f"rank {rank} uneven heads: {e}")
            ok &= "sp_degree=4" in str(e) and "num_key_value_heads (3)" in str(e)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
