"""Probe: cuDNN compressed attention on strided views of q (the layout compression/dense_cmp.py uses).

Query groups as views [B, d*HQ, S, D] of the token rows (head j*HQ + h at position i is token
l - 1 + d*i + j), the compressed keys and values repeated d times (KV head j*HK + k), one
sequence and a dense batch of two. Checks the output against the Triton range kernel on the
same rows and times cuDNN's forward and backward, the KV repeat, and the Triton forward.
Run on the H200 (benchmarks/results/cmp_cudnn_views_probe_h200.json):
    PYTHONPATH=kernels python3 scripts/probe_cudnn_cmp_views.py
"""
import math, sys, os, json, torch
sys.path.insert(0, "kernels")
from triton.testing import do_bench
from flash_msa.compression.compressed_attention import compressed_ranges
from flash_msa.utils.compare import rel_rms as rel
from flash_msa.utils.varlen import compressed_cu_seqlens
from flash_msa.window.window import range_attention_fwd, range_attention_bwd
dev = "cuda"; D, HQ, HK, l, d = 128, 32, 8, 32, 16; G = HQ // HK
out = {}
for B, L in ((1, 65536), (2, 32768), (1, 262144)):
    T = B * L; Tc = (L - l) // d + 1; S = Tc - 1; scale = D ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    do = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    kc = torch.randn(T // d, HK, D, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(T // d, HK, D, device=dev, dtype=torch.bfloat16, generator=g)
    cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=dev)
    cc = compressed_cu_seqlens(cu, l, d)
    cr = compressed_ranges(cu, cc, T, T // d, l, d)
    o_t, lse_t = range_attention_fwd(q, kc, vc, cr[0], cr[1], scale, "cmp")
    q4 = q.view(B, L, HQ, D)[:, l - 1:l - 1 + d * S].reshape(B, S, d * HQ, D).transpose(1, 2)
    do4 = do.view(B, L, HQ, D)[:, l - 1:l - 1 + d * S].reshape(B, S, d * HQ, D).transpose(1, 2)
    def kv4(x):
        return x[:B * Tc].view(B, Tc, 1, HK, D)[:, :S].expand(B, S, d, HK, D).reshape(B, S, d * HK, D).transpose(1, 2)
    k4, v4 = kv4(kc), kv4(vc)
    r = {}
    try:
        f = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, True, False, scale=scale)
        res = f()
        o4, lse4 = res[0], res[1]
        r["o4_stride"] = list(o4.stride()); r["o4_shape"] = list(o4.shape); r["lse4_shape"] = list(lse4.shape)
        o_rows = o4.transpose(1, 2).reshape(B, S * d, HQ, D)
        r["o_rel"] = rel(o_rows, o_t.view(B, L, HQ, D)[:, l - 1:l - 1 + d * S])
        o4v = o_t.view(B, L, HQ, D)[:, l - 1:l - 1 + d * S].reshape(B, S, d * HQ, D).transpose(1, 2)
        b = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(do4, q4, k4, v4, o4v, lse4, res[6], res[7], None, None, None, S, S, 0.0, True, scale=scale)
        dq4, dk4, dv4 = b()
        r["dq4_stride"] = list(dq4.stride()); r["dk4_shape"] = list(dk4.shape)
        r["fwd_ms"] = do_bench(f, warmup=5, rep=30); r["bwd_ms"] = do_bench(b, warmup=5, rep=30)
        r["kv_repeat_ms"] = do_bench(lambda: (kv4(kc), kv4(vc)), warmup=5, rep=30)
        r["triton_fwd_ms"] = do_bench(lambda: range_attention_fwd(q, kc, vc, cr[0], cr[1], scale, "cmp"), warmup=5, rep=30)
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    out[f"B{B}_L{L}"] = r
    print(B, L, r, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_views.json"), "w"), indent=1)
