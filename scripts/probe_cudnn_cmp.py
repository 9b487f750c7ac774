"""Probe: compressed attention as plain causal GQA attention over the compressed rows (cuDNN).

Query token t = cu[s] + i*d + l - 1 + j (j < d) sees compressed rows [cc[s], cc[s] + i] of its
sequence: the d tokens of "group" i all see rows 0..i. Put the d tokens of group i, times the G
heads of a KV head, as d*G query heads of one position i: the op is causal attention with
Tc positions, HK*d*G query heads and HK KV heads (top-left causal, varlen by cu_cmp).

Checks the reshaped cuDNN op against the Triton range kernel and times both, fwd and bwd, in
three call forms: PyTorch's varlen cuDNN op (``cum_seq_q``, one sequence or 8 documents) and the
batched 4-D op (one sequence). Run on the H200 with the kernels of c604cea:
    PYTHONPATH=kernels python3 scripts/probe_cudnn_cmp.py --out $OUT --Ts 65536,262144
(benchmarks/results/cmp_cudnn_probe_h200.json). Found: the 4-D op matches (o 1e-3, dq/dk/dv
3e-3 relative RMS, bf16) and is faster than the range kernels (64K: fwd 3.8 vs 5.1 ms, bwd 11.9
vs 15.6; 256K: 59.5 vs 75.1, 171 vs 252); the varlen op's forward is 20x slower (76 ms at 64K)
and its gradients came back NaN in these calls; no form's backward is deterministic, with or
without torch.use_deterministic_algorithms. The gathers here are index-based (1.3 and 2.1 ms at
64K); compression/dense_cmp.py uses strided copies instead.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))

from flash_msa.compression.compressed_attention import compressed_ranges  # noqa: E402
from flash_msa.utils.varlen import compressed_rows  # noqa: E402
from flash_msa.window.window import range_attention_bwd, range_attention_fwd  # noqa: E402

L, DS = 32, 16


def group_index(cu, T, l=L, d=DS):
    cu_cmp, first, valid = compressed_rows(cu, T, l, d)
    Tc = first.shape[0]
    cu64 = cu.to(torch.int64)
    seq = torch.searchsorted(cu_cmp.to(torch.int64)[1:], torch.arange(Tc, device=cu.device), right=True)
    seq = seq.clamp_max(cu.numel() - 2)
    end = cu64[seq + 1]
    tok = first[:, None] + (l - 1) + torch.arange(d, device=cu.device)[None]
    ok = valid[:, None] & (tok < end[:, None])
    return cu_cmp, torch.where(ok, tok, torch.full_like(tok, T))  # [Tc, d], T = the zero pad row


def to_groups(x, qidx, HK):
    """[T, HQ, D] -> [Tc, HK*d*G, D] (head = k*d*G + j*G + g)."""
    T, HQ, D = x.shape
    Tc, d = qidx.shape
    xp = torch.cat([x, x.new_zeros(1, HQ, D)])
    g = xp[qidx.reshape(-1)].view(Tc, d, HK, HQ // HK, D).transpose(1, 2)
    return g.reshape(Tc, HK * d * (HQ // HK), D)


def from_groups(y, qidx, T, HK, fill=0.0):
    """Inverse of to_groups for [Tc, HK*d*G, ...] -> [T, HQ, ...] (tokens in no group get fill)."""
    Tc, d = qidx.shape
    rest = y.shape[2:]
    G = y.shape[1] // (HK * d)
    yy = y.view(Tc, HK, d, G, *rest).transpose(1, 2).reshape(Tc * d, HK * G, *rest)
    out = y.new_full((T + 1, HK * G, *rest), fill)
    out[qidx.reshape(-1)] = yy
    return out[:T]


def rel(a, b):
    a, b = a.float(), b.float()
    m = torch.isfinite(b)
    return ((a[m] - b[m]).pow(2).mean().sqrt() / b[m].pow(2).mean().sqrt().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe_out")
    p.add_argument("--Ts", default="65536,262144")
    p.add_argument("--HQ", type=int, default=32)
    p.add_argument("--HK", type=int, default=8)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from triton.testing import do_bench
    dev = "cuda"
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
    res = []
    D, HQ, HK = 128, args.HQ, args.HK
    scale = 1 / math.sqrt(D)
    for T in [int(x) for x in args.Ts.split(",")]:
        for layout in ("one", "varlen", "one4d"):
            row = dict(T=T, layout=layout)
            res.append(row)
            try:
                gen = torch.Generator(device=dev).manual_seed(T)
                if layout in ("one", "one4d"):
                    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
                else:  # 8 documents of random lengths
                    cuts = torch.sort(torch.randperm(T - 1, generator=torch.Generator().manual_seed(1))[:7] + 1).values
                    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to(torch.int32).to(dev)
                Tc = T // DS
                q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
                kc = torch.randn(Tc, HK, D, device=dev, dtype=torch.bfloat16, generator=gen)
                vc = torch.randn(Tc, HK, D, device=dev, dtype=torch.bfloat16, generator=gen)
                do = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
                cu_cmp, qidx = group_index(cu, T)
                cr = compressed_ranges(cu, cu_cmp, T, Tc, L, DS)
                o_t, lse_t = range_attention_fwd(q, kc, vc, cr[0], cr[1], scale, "cmp")
                delta = (o_t.float() * do.float()).sum(-1)
                dq_t, dk_t, dv_t = range_attention_bwd(q, kc, vc, None, lse_t, do, None, *cr, scale, "cmp", delta=delta)

                def triton_fwd():
                    return range_attention_fwd(q, kc, vc, cr[0], cr[1], scale, "cmp")

                def triton_bwd():
                    return range_attention_bwd(q, kc, vc, None, lse_t, do, None, *cr, scale, "cmp", delta=delta)

                qg = to_groups(q, qidx, HK)
                dog = to_groups(do, qidx, HK)
                maxq = Tc
                cc = cu_cmp.to(torch.int32)

                def cudnn_fwd(qg=qg):
                    if layout == "one4d":  # [1, H, Tc, D] views, no cum_seq
                        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
                            qg[None].transpose(1, 2), kc[None].transpose(1, 2), vc[None].transpose(1, 2), None, True,
                            0.0, True, False, scale=scale)
                        return r[0].transpose(1, 2)[0], r[1], r[6], r[7]
                    r = torch.ops.aten._cudnn_attention_forward(qg, kc, vc, None, cc, cc, maxq, maxq, True, 0.0, True,
                                                                False, scale=scale)
                    return r[0], r[1], r[6], r[7]

                og, lseg, seed, off = cudnn_fwd()
                row["lse_shape"] = list(lseg.shape)
                row["o_shape"] = list(og.shape)
                print(T, layout, "cudnn o", tuple(og.shape), og.stride(), "lse", tuple(lseg.shape), lseg.stride(), flush=True)
                o_c = from_groups(og, qidx, T, HK)
                row["o_rel"] = rel(o_c, o_t)
                lse_flat = lseg.reshape(Tc, -1) if lseg.shape[0] == Tc else lseg.reshape(-1, Tc).t()
                lse_c = from_groups(lse_flat.contiguous(), qidx, T, HK, fill=float("-inf"))
                row["lse_rel"] = rel(lse_c, lse_t)
                print(T, layout, "o_rel", row["o_rel"], "lse_rel", row["lse_rel"], flush=True)

                def cudnn_bwd():
                    if layout == "one4d":
                        t4 = lambda x: x[None].transpose(1, 2)  # noqa: E731
                        r = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                            t4(dog), t4(qg), t4(kc), t4(vc), t4(og), lseg, seed, off, None, None, None, maxq, maxq, 0.0, True, scale=scale)
                        return tuple(x.transpose(1, 2)[0] for x in r)
                    return torch.ops.aten._cudnn_attention_backward(dog, qg, kc, vc, og, lseg, seed, off, None,
                                                                    cc, cc, maxq, maxq, 0.0, True, scale=scale)

                dqg, dkc, dvc = cudnn_bwd()
                dq_c = from_groups(dqg, qidx, T, HK)
                row.update(dq_rel=rel(dq_c, dq_t), dk_rel=rel(dkc, dk_t), dv_rel=rel(dvc, dv_t))
                dqg2, dkc2, dvc2 = cudnn_bwd()
                row["bwd_deterministic"] = bool(torch.equal(dqg, dqg2) and torch.equal(dkc, dkc2) and torch.equal(dvc, dvc2))
                print(T, layout, {k: row[k] for k in ("dq_rel", "dk_rel", "dv_rel", "bwd_deterministic")}, flush=True)
                torch.use_deterministic_algorithms(True)
                try:
                    d1 = cudnn_bwd()
                    d2 = cudnn_bwd()
                    row["det_bwd_deterministic"] = all(torch.equal(a, b) for a, b in zip(d1, d2))
                    row["det_dq_rel"] = rel(from_groups(d1[0], qidx, T, HK), dq_t)
                    row["det_dk_rel"] = rel(d1[1], dk_t)
                    row["cudnn_bwd_det_ms"] = do_bench(cudnn_bwd, warmup=5, rep=30)
                finally:
                    torch.use_deterministic_algorithms(False)
                print(T, layout, {k: row.get(k) for k in ("det_bwd_deterministic", "det_dq_rel", "det_dk_rel")}, flush=True)
                row["triton_fwd_ms"] = do_bench(triton_fwd, warmup=5, rep=30)
                row["triton_bwd_ms"] = do_bench(triton_bwd, warmup=5, rep=30)
                row["cudnn_fwd_ms"] = do_bench(cudnn_fwd, warmup=5, rep=30)
                row["cudnn_bwd_ms"] = do_bench(cudnn_bwd, warmup=5, rep=30)
                row["gather_q_ms"] = do_bench(lambda: to_groups(q, qidx, HK), warmup=5, rep=30)
                row["scatter_o_ms"] = do_bench(lambda: from_groups(og, qidx, T, HK), warmup=5, rep=30)
                print(T, layout, {k: round(v, 3) for k, v in row.items() if k.endswith("_ms")}, flush=True)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                traceback.print_exc()
            with open(os.path.join(args.out, "probe_cudnn_cmp.json"), "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
